"""Hostile and mistaken inputs to a model (CPU, tiny models): each gets a clear error naming the input, what was
expected and what came — or a correct result — and saving never overwrites a file unasked; no model file can make
shape evaluation hang, and a file that is no model is named wherever it is read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from optimum_iobinding import IOBindingORTModel, OnnxStableDiffusionPipeline, infer_output_shapes
from optimum_iobinding.runtime import shapes as shape_module
from optimum_iobinding.runtime.shapes import DimExpressionError, evaluate_dim_expression


# ------------------------------------------------------------------------------------------------- data loss
def test_model_save_pretrained_refuses_to_overwrite_a_file_unasked(tiny_folder, tmp_path):
    model = IOBindingORTModel.from_pretrained(tiny_folder, subfolder="vae_decoder")
    (tmp_path / "model.onnx").write_bytes(b"mine")
    with pytest.raises(FileExistsError, match=r"save_directory: expected no files named like the model's"):
        model.save_pretrained(tmp_path)
    assert (tmp_path / "model.onnx").read_bytes() == b"mine"
    model.save_pretrained(tmp_path, overwrite=True)
    assert onnx.load(str(tmp_path / "model.onnx")).graph.input[0].name == "latent_sample"
    model.save_pretrained(Path(model.model_path).parent)  # onto its own files: nothing to do, no error


# ---------------------------------------------------------------------------------------------------- hangs
@pytest.mark.parametrize(
    "expression",
    [
        "(((((h**64)**64)**64)**64)**64)",
        "h**64**64",
        "2**64*2**64*2**64*2**64*2**64",
        "(h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h*h)**64",
        "max(h**64, h**64)**64",
        "floor(h**64 / 3)**64",
    ],
)
def test_a_hostile_dim_expression_is_refused_by_the_value_bound(expression, monkeypatch):
    # the work bound: no intermediate value may pass MAX_VALUE_BITS, checked before every power is computed
    largest = []
    real = shape_module.bounded

    def recording(value, text):
        largest.append(shape_module.value_bits(value))
        return real(value, text)

    monkeypatch.setattr(shape_module, "bounded", recording)
    with pytest.raises(DimExpressionError, match=r"exceeds 256 bits"):
        evaluate_dim_expression(expression, {"h": 1000})
    assert max(largest) <= 2 * shape_module.MAX_VALUE_BITS  # a product of two bounded values at most


def test_a_model_declaring_a_hostile_output_dim_still_runs(tmp_path, make_model, make_session):
    model_proto = make_model(
        [helper.make_node("Identity", ["x"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["h"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["(((h**64)**64)**64)"])],
    )
    model = IOBindingORTModel(make_session(model_proto))
    assert infer_output_shapes(model, {"x": (3,)}) == {"y": (3,)}  # ONNX shape inference sizes it instead
    torch.testing.assert_close(model(x=torch.arange(3.0))[0], torch.arange(3.0))


@pytest.mark.parametrize(
    "shape, error, message",
    [
        ((2, -3), ValueError, r"input 'x': expected non-negative integer sizes below 2\*\*62, got -3 in dim 1"),
        (
            (2**70, 3),
            ValueError,
            r"input 'x': expected non-negative integer sizes below 2\*\*62, got 1180591620717411303424",
        ),
        ((2, 1.5), TypeError, r"input 'x': expected non-negative integer sizes, got 1.5 in dim 1"),
        ((2.0, 3), TypeError, r"input 'x': expected non-negative integer sizes, got 2.0 in dim 0"),
        ((True, 3), TypeError, r"got True in dim 0"),
        ((2, "3"), TypeError, r"got '3' in dim 1"),
        (3, TypeError, r"input 'x': expected a shape \(a sequence of non-negative integers\), got int 3"),
    ],
)
def test_infer_output_shapes_refuses_sizes_that_are_not_sizes(concat_model, shape, error, message):
    with pytest.raises(error, match=message):
        infer_output_shapes(concat_model, {"x": shape})


# ------------------------------------------------------------------------------------------------- inputs
@pytest.mark.parametrize(
    "dtype, value, message",
    [
        (
            TensorProto.UINT8,
            torch.tensor([300]),
            r"input 'x': expected values in \[0, 255\] \(the model's torch.uint8\), "
            r"got values in \[300, 300\]",
        ),
        (TensorProto.INT32, np.array([2**40], dtype=np.int64), r"expected values in \[-2147483648, 2147483647\]"),
        (
            TensorProto.INT8,
            -200,
            r"expected values in \[-128, 127\] \(the model.s torch.int8\), got values in \[-200, -200\]",
        ),
    ],
)
def test_integers_that_would_wrap_are_refused(dtype, value, message, make_model, make_session):
    model = IOBindingORTModel(
        make_session(
            make_model(
                [helper.make_node("Identity", ["x"], ["y"])],
                [helper.make_tensor_value_info("x", dtype, ["n"])],
                [helper.make_tensor_value_info("y", dtype, ["n"])],
            )
        )
    )
    with pytest.raises(ValueError, match=message):
        model(x=value if not isinstance(value, int) else np.array([value]))


def test_integers_that_fit_are_converted(tiny_folder, make_model, make_session):
    model = IOBindingORTModel(
        make_session(
            make_model(
                [helper.make_node("Identity", ["x"], ["y"])],
                [helper.make_tensor_value_info("x", TensorProto.UINT8, [2])],
                [helper.make_tensor_value_info("y", TensorProto.UINT8, [2])],
            )
        )
    )
    assert model(x=torch.tensor([0, 255]))[0].tolist() == [0, 255]


# ------------------------------------------------------------------------------------- arrays a model cannot bind
@pytest.fixture
def identity_model(make_model, make_session):
    """``identity_model(elem_type=TensorProto.FLOAT, io_binding=True)``: y = x, a model of an in-memory session."""

    def build(elem_type: int = TensorProto.FLOAT, io_binding: bool = True) -> IOBindingORTModel:
        return IOBindingORTModel(
            make_session(
                make_model(
                    [helper.make_node("Identity", ["x"], ["y"])],
                    [helper.make_tensor_value_info("x", elem_type, ["n"])],
                    [helper.make_tensor_value_info("y", elem_type, ["n"])],
                )
            ),
            io_binding=io_binding,
        )

    return build


@pytest.mark.parametrize("io_binding", [True, False])
@pytest.mark.parametrize(
    "dtype, elem_type",
    [(">f4", TensorProto.FLOAT), (">f8", TensorProto.FLOAT16), (">i8", TensorProto.INT32), (">u2", TensorProto.INT64)],
)
def test_an_array_of_the_other_byte_order_is_read_as_the_same_values(dtype, elem_type, io_binding, identity_model):
    # a big-endian array (read from a file or a network buffer) means the same numbers: converted, not refused
    values = np.array([1, -2, 300], dtype=dtype) if dtype[1] != "u" else np.array([1, 2, 300], dtype=dtype)
    model = identity_model(elem_type, io_binding)
    assert model(x=values)[0].tolist() == values.astype(values.dtype.newbyteorder("=")).tolist()


@pytest.mark.skipif(np.dtype(np.longdouble).itemsize <= 8, reason="longdouble is float64 on this platform")
@pytest.mark.parametrize("io_binding", [True, False])
@pytest.mark.parametrize("value", [np.ones(3, dtype=np.longdouble), np.longdouble(1.5)], ids=["array", "scalar"])
def test_a_longdouble_array_is_refused_naming_the_input(value, io_binding, identity_model):
    with pytest.raises(
        TypeError,
        match=r"input 'x': expected a numpy dtype torch can hold .*, got float(96|128) "
        r"\(numpy's longdouble\); cast it with .astype\(np.float64\)",
    ):
        identity_model(io_binding=io_binding)(x=value)


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's: sparse and quantized tensors are beta or deprecated
@pytest.mark.parametrize("io_binding", [True, False])
@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: torch.ones(3).to_sparse(),
            r"input 'x': expected a dense \(strided\) tensor, got a sparse_coo tensor; "
            r"call .to_dense\(\)",
        ),
        (
            lambda: torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (3,)),
            r"input 'x': expected a dense \(strided\) tensor, got a sparse_coo tensor",
        ),
        (
            lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8),
            r"input 'x': expected a tensor of a plain dtype, got the quantized torch.quint8; call .dequantize\(\)",
        ),
    ],
    ids=["to_sparse", "sparse_coo_tensor", "quantized"],
)
def test_tensors_that_are_not_one_dense_block_are_refused_naming_the_input(make, message, io_binding, identity_model):
    with pytest.raises(TypeError, match=message):
        identity_model(io_binding=io_binding)(x=make())


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's: sparse CSR and nested tensors are beta
def test_a_sparse_csr_or_nested_tensor_is_refused_naming_the_input(identity_model):
    model = identity_model()
    with pytest.raises(TypeError, match=r"input 'x': expected a dense \(strided\) tensor, got a sparse_csr tensor"):
        model(x=torch.eye(3).to_sparse_csr())
    with pytest.raises(TypeError, match=r"input 'x': expected a dense \(strided\) tensor, got a nested tensor"):
        model(x=torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]))
    assert model(x=np.ones(3, np.float32))[0].tolist() == [1.0, 1.0, 1.0]  # nothing left half-done


@pytest.mark.parametrize("elem_type", [TensorProto.INT32, TensorProto.UINT8])
def test_wide_unsigned_numpy_integers_are_range_checked_like_any_other(elem_type, identity_model):
    model = identity_model(elem_type)
    assert model(x=np.array([1, 200], dtype=np.uint64))[0].tolist() == [1, 200]
    with pytest.raises(
        ValueError,
        match=r"input 'x': expected values in \[.*\] \(the model's torch.(int32|uint8)\), "
        r"got values in \[1, 18446744073709551615\]",
    ):
        model(x=np.array([1, 2**64 - 1], dtype=np.uint64))


# ------------------------------------------------------------------------------------- model files that are no model
UNREADABLE = {
    "empty": (b"", r"is empty \(0 bytes\), expected an ONNX model"),
    "garbage": (b"\xff\xfe this is not a protobuf message \x00\x01" * 8, r"is not a readable ONNX model: DecodeError"),
    "no graph": (
        onnx.ModelProto(ir_version=8).SerializeToString(),
        r"is not a readable ONNX model: it parses as a "
        r"protobuf message but holds no ONNX graph",
    ),
}


@pytest.mark.parametrize("kind", list(UNREADABLE))
@pytest.mark.parametrize(
    "settings", [{}, dict(io_binding=False), dict(share_weights=True)], ids=["default", "numpy", "owned-weights"]
)
def test_a_model_file_that_is_no_model_is_named_by_the_constructor_and_from_pretrained(tmp_path, kind, settings):
    data, message = UNREADABLE[kind]
    path = tmp_path / "unet" / "model.onnx"
    path.parent.mkdir()
    path.write_bytes(data)
    named = rf"path: '{path}' {message}"
    with pytest.raises(ValueError, match=named):
        IOBindingORTModel(path, **settings)
    with pytest.raises(ValueError, match=named):
        IOBindingORTModel.from_pretrained(tmp_path, subfolder="unet", **settings)
    with pytest.raises(ValueError, match=named):
        IOBindingORTModel.load_model(path)


@pytest.mark.parametrize("kind", list(UNREADABLE))
def test_a_model_file_that_is_no_model_is_named_where_cuda_reads_its_graph(tmp_path, kind):
    # on CUDA the constructor reads the declared inputs from the file (load_declared_graph, or the whole graph with
    # load_graph where the weights are owned from the start) instead of making a session
    from optimum_iobinding.runtime.hub import load_declared_graph, load_graph

    data, message = UNREADABLE[kind]
    path = tmp_path / "model.onnx"
    path.write_bytes(data)
    for read in (load_graph, load_declared_graph):
        with pytest.raises(ValueError, match=rf"path: '{path}' {message}"):
            read(str(path))
    with pytest.raises(ValueError, match=rf"model: '{path}' (is empty|is not a readable ONNX model)"):
        infer_output_shapes(path, {"x": (1,)})


@pytest.mark.parametrize("layout", ["weights-inside", "weights-beside", "initializers-as-inputs"])
def test_the_declared_graph_read_without_the_weights_is_what_the_whole_parse_declares(tmp_path, layout):
    from onnx import numpy_helper

    from optimum_iobinding.runtime.hub import load_declared_graph, load_graph

    weights = [numpy_helper.from_array(np.full((64, 64), k, np.float32), f"w{k}") for k in range(3)]
    nodes = [helper.make_node("MatMul", ["x" if k == 0 else f"y{k - 1}", f"w{k}"], [f"y{k}"]) for k in range(3)]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])]
    if layout == "initializers-as-inputs":  # as IR versions before 4 list them
        inputs += [helper.make_tensor_value_info(f"w{k}", TensorProto.FLOAT, [64, 64]) for k in range(3)]
    outputs = [helper.make_tensor_value_info("y2", TensorProto.FLOAT, ["batch", 64])]
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, initializer=weights))
    path = tmp_path / "model.onnx"
    if layout == "weights-beside":
        onnx.save_model(model, str(path), save_as_external_data=True, location="model.onnx_data", size_threshold=0)
    else:
        onnx.save_model(model, str(path))
    declared, whole = load_declared_graph(str(path)).graph, load_graph(str(path)).graph
    assert [v.SerializeToString() for v in declared.input] == [v.SerializeToString() for v in whole.input]
    assert [v.SerializeToString() for v in declared.output] == [v.SerializeToString() for v in whole.output]
    assert [t.name for t in declared.initializer] == [t.name for t in whole.initializer] == ["w0", "w1", "w2"]
    assert not declared.node and not any(t.raw_data or t.float_data for t in declared.initializer)


@pytest.mark.parametrize("kind", ["empty", "garbage"])
@pytest.mark.parametrize("component", ["unet", "vae_decoder"])
def test_a_pipeline_names_the_component_file_that_is_no_model(copy_of, kind, component):
    from optimum_iobinding.pipelines.auto import pipeline_class_for

    folder = copy_of()
    data, message = UNREADABLE[kind]
    (folder / component / "model.onnx").write_bytes(data)
    with pytest.raises(ValueError, match=rf"path: '.*{component}/model\.onnx' {message}"):
        OnnxStableDiffusionPipeline.from_pretrained(folder)
    if component == "unet":  # the CLI's choice of pipeline reads the UNet's graph first
        with pytest.raises(ValueError, match=rf"path: '.*unet/model\.onnx' {message}"):
            pipeline_class_for(folder)


# ----------------------------------------------------------------------------- declared output shapes and their size
def test_an_output_declaration_that_contradicts_the_graph_is_refused_naming_the_output(
    tmp_path, make_model, make_session
):
    declared = make_model(
        [helper.make_node("Identity", ["x"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["2*n", 3])],
    )
    message = (
        r"output 'y': the model declares shape \['2\*n', 3\], which is \[4, 3\] for these inputs, but its graph "
        r"computes \[2, 3\] \(ONNX shape inference\)"
    )
    onnx.save(declared, str(tmp_path / "model.onnx"))
    for model in (IOBindingORTModel(make_session(declared)), IOBindingORTModel(tmp_path / "model.onnx")):
        with pytest.raises(ValueError, match=message):
            model(x=torch.ones(2, 3))
        assert model.output_signatures == 0  # nothing allocated, nothing kept


def test_an_enormous_declared_output_dim_is_refused_from_the_graph_as_cuda_reads_it(make_model):
    # what the file declares (and the CUDA path reads from the graph): 10**12 columns, 8 TB; the graph makes 3
    declared = make_model(
        [helper.make_node("Identity", ["x"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 10**12])],
    )
    with pytest.raises(
        ValueError,
        match=r"output 'y': the model declares shape \['n', 1000000000000\], which is "
        r"\[2, 1000000000000\] for these inputs, but its graph computes \[2, 3\]",
    ):
        infer_output_shapes(declared, {"x": (2, 3)})


@pytest.fixture
def constant_of_shape_model(make_model) -> onnx.ModelProto:
    """y = zeros(shape) with the output declared as large as the graph makes it: 1.2 TB for [10**6, 10**6, 300]."""
    return make_model(
        [helper.make_node("ConstantOfShape", ["shape"], ["y"])],
        [helper.make_tensor_value_info("shape", TensorProto.INT64, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [10**6, 10**6, 300])],
    )


@pytest.mark.parametrize("io_binding", [True, False])
def test_an_output_larger_than_memory_is_refused_before_anything_is_allocated(
    monkeypatch, io_binding, make_session, constant_of_shape_model
):
    model = IOBindingORTModel(make_session(constant_of_shape_model), io_binding=io_binding)
    allocated = []
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: allocated.append(a) or real_empty(*a, **k))
    with pytest.raises(
        ValueError,
        match=r"output 'y': expected an output that fits in the host's (available|physical) "
        r"memory \(\d+ bytes.*\), got shape \[1000000, 1000000, 300\] "
        r"\(1200000000000000 bytes, 1091.4 TiB\) from the model's declared dims "
        r"\[1000000, 1000000, 300\]; nothing was allocated",
    ):
        model(shape=torch.tensor([10**6, 10**6, 300]))
    assert allocated == [] and model.output_signatures == 0 and model.shape_inferencer.cached_signatures == ()


def test_outputs_are_measured_against_the_device_memory_once_per_signature(monkeypatch, identity_model):
    from optimum_iobinding.runtime import model as model_module

    model = identity_model()
    queries = []

    def limit():
        queries.append(1)
        return 24 << 20, "a 24 MiB test bound"

    monkeypatch.setattr(model_module, "available_host_memory", limit)
    for _ in range(3):
        model(x=torch.ones(5))
    assert queries == []  # small outputs are never measured
    for _ in range(3):
        model(x=torch.ones(5 << 20))  # 20 MiB: measured, and it fits
    assert len(queries) == 1  # once per signature, not per call
    with pytest.raises(
        ValueError,
        match=r"output 'y': expected an output that fits in a 24 MiB test bound "
        r"\(25165824 bytes, 24.0 MiB\), got shape \[8388608\] \(33554432 bytes, 32.0 "
        r"MiB\) from the model's declared dims \['n'\]",
    ):
        model(x=torch.ones(8 << 20))
    assert model.output_signatures == 2
