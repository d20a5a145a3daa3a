"""IOBindingORTModel on the CPU execution provider: results, conversions, buffers, errors, loading and saving."""

from __future__ import annotations

import ctypes

import gc

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from optimum_iobinding import IOBindingORTModel, infer_output_shapes
from optimum_iobinding.runtime.dtypes import TORCH_TO_ONNX
from optimum_iobinding.runtime.inputs import check_input_device

ALL_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def random_tensor(shape, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=generator) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    low, high = (0, 255) if dtype == torch.uint8 else (-100, 100)
    return torch.randint(low, high, shape, generator=generator).to(dtype)


def session_run(session: ort.InferenceSession, feeds: dict) -> list:
    """Plain session.run, the reference; bfloat16 (which numpy lacks) goes through OrtValues."""
    if any(t.dtype == torch.bfloat16 for t in feeds.values()):
        values = {
            name: ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                t.view(torch.int16).numpy().view(np.uint16), TensorProto.BFLOAT16
            )
            for name, t in feeds.items()
        }
        outputs = session.run_with_ort_values([o.name for o in session.get_outputs()], values)
        # numpy has no bfloat16: the bytes are read through the OrtValue's public address and size
        return [
            torch.frombuffer(
                bytearray((ctypes.c_uint8 * o.tensor_size_in_bytes()).from_address(o.data_ptr())), dtype=torch.bfloat16
            ).reshape(o.shape())
            for o in outputs
        ]
    return [torch.from_numpy(r) for r in session.run(None, {n: t.numpy() for n, t in feeds.items()})]


@pytest.fixture
def transpose_concat_model(make_model, tensor):
    """``transpose_concat_model(elem_type)``: y = transpose(concat(x, x)), real data movement that every tensor type
    supports."""

    def build(elem_type: int) -> onnx.ModelProto:
        return make_model(
            [helper.make_node("Concat", ["x", "x"], ["c"], axis=0), helper.make_node("Transpose", ["c"], ["y"])],
            [tensor("x", elem_type, ["batch", 5])],
            [tensor("y", elem_type, [5, "2*batch"])],
        )

    return build


@pytest.fixture
def identity_model(make_model, tensor):
    """``identity_model(elem_type=TensorProto.FLOAT, dims=("batch", 4))``: y = x."""

    def build(elem_type=TensorProto.FLOAT, dims=("batch", 4)) -> onnx.ModelProto:
        return make_model(
            [helper.make_node("Identity", ["x"], ["y"])],
            [tensor("x", elem_type, list(dims))],
            [tensor("y", elem_type, list(dims))],
        )

    return build


# ------------------------------------------------------------------------------------------- equality with run()
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_binding_is_bitwise_equal_to_session_run_for_every_dtype(dtype, make_session, transpose_concat_model):
    session = make_session(transpose_concat_model(TORCH_TO_ONNX[dtype]))
    x = random_tensor((3, 5), dtype)
    (expected,) = session_run(session, {"x": x})
    (got,) = IOBindingORTModel(session)(x=x)
    assert got.dtype == dtype
    assert got.shape == (5, 6)
    assert torch.equal(got, expected)


def test_binding_is_bitwise_equal_to_session_run_for_a_float_computation(make_model, make_session, tensor):
    model = make_model(
        [helper.make_node("Tanh", ["x"], ["t"]), helper.make_node("Mul", ["t", "x"], ["y"])],
        [tensor("x", TensorProto.FLOAT, ["batch", 64])],
        [tensor("y", TensorProto.FLOAT, ["batch", 64])],
    )
    session = make_session(model)
    x = random_tensor((8, 64), torch.float32)
    assert torch.equal(IOBindingORTModel(session)(x=x)[0], session_run(session, {"x": x})[0])


def test_three_outputs_come_back_in_session_order_and_equal_session_run(three_output_model, make_session):
    session = make_session(three_output_model)
    a, b = random_tensor((4, 3), torch.float32, 1) * 10, random_tensor((4, 3), torch.float32, 2)
    got = IOBindingORTModel(session)(a=a, b=b)
    expected = session_run(session, {"a": a, "b": b})
    assert [t.dtype for t in got] == [torch.float32, torch.int64, torch.bool]
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


def test_without_io_binding_returns_cpu_torch_tensors_equal_to_session_run(three_output_model, make_session):
    session = make_session(three_output_model)
    a, b = random_tensor((2, 3), torch.float32, 3), random_tensor((2, 3), torch.float32, 4)
    model = IOBindingORTModel(session, io_binding=False)
    got = model(a=a, b=b)
    assert all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in got)
    for g, e in zip(got, session_run(session, {"a": a, "b": b})):
        assert torch.equal(g, e)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.bool, torch.int8], ids=str)
def test_without_io_binding_handles_dtypes_numpy_lacks_or_renames(dtype, make_session, transpose_concat_model):
    session = make_session(transpose_concat_model(TORCH_TO_ONNX[dtype]))
    x = random_tensor((2, 5), dtype)
    (got,) = IOBindingORTModel(session, io_binding=False)(x=x)
    assert got.dtype == dtype and torch.equal(got, session_run(session, {"x": x})[0])


# ---------------------------------------------------------------------------------------------------- properties
def test_properties_describe_the_session(three_output_model, make_session):
    model = IOBindingORTModel(make_session(three_output_model))
    assert model.device == torch.device("cpu")
    assert model.providers == ["CPUExecutionProvider"]
    assert model.input_names == ["a", "b"]
    assert model.output_names == ["sum", "rounded", "greater"]
    assert model.input_dtypes == {"a": torch.float32, "b": torch.float32}
    assert model.output_dtypes == {"sum": torch.float32, "rounded": torch.int64, "greater": torch.bool}
    assert isinstance(model.session, ort.InferenceSession)


# ------------------------------------------------------------------------------------------------ output shapes
def test_expression_dim_sizes_the_bound_output(concat_model, make_session):
    model = IOBindingORTModel(make_session(concat_model))
    x = random_tensor((3, 7), torch.float32)
    assert infer_output_shapes(model, {"x": (3, 7)}) == {"y": (6, 7)}
    (y,) = model(x=x)
    assert torch.equal(y, torch.cat([x, x]))


def test_unnamed_output_dims_are_sized_by_onnx_shape_inference_and_preallocated(make_model, make_session, tensor):
    model_proto = make_model(
        [helper.make_node("Concat", ["x", "x"], ["y"], axis=1)],
        [tensor("x", TensorProto.FLOAT, [None, 4])],
        [tensor("y", TensorProto.FLOAT, [None, None])],
    )
    model = IOBindingORTModel(make_session(model_proto))
    assert infer_output_shapes(model, {"x": (3, 4)}) == {"y": (3, 8)}
    x = random_tensor((3, 4), torch.float32)
    first = model(x=x)[0]
    second = model(x=x + 1)[0]
    assert second.data_ptr() == first.data_ptr()  # a preallocated, reused buffer, not one ORT allocated
    assert torch.equal(second, torch.cat([x + 1, x + 1], dim=1))


def test_data_dependent_output_is_allocated_by_ort_and_handed_over_without_copy(make_model, make_session, tensor):
    model_proto = make_model(
        [helper.make_node("NonZero", ["x"], ["y"])],
        [tensor("x", TensorProto.FLOAT, ["n"])],
        [tensor("y", TensorProto.INT64, [1, None])],
    )
    session = make_session(model_proto)
    model = IOBindingORTModel(session)
    assert infer_output_shapes(model, {"x": (5,)}) == {"y": None}
    x = torch.tensor([0.0, 1.0, 0.0, 2.0, 3.0])
    (y,) = model(x=x)
    assert torch.equal(y, session_run(session, {"x": x})[0])
    gc.collect()
    assert y.tolist() == [[1, 3, 4]]  # still valid once the binding let go of ORT's value


def test_reused_output_buffers_are_overwritten_by_the_next_call_with_the_same_shapes(make_session, identity_model):
    model = IOBindingORTModel(make_session(identity_model()))
    first = model(x=torch.zeros(2, 4))[0]
    second = model(x=torch.ones(2, 4))[0]
    assert second.data_ptr() == first.data_ptr()
    assert torch.equal(first, torch.ones(2, 4))  # documented: reuse overwrites earlier results


def test_different_shapes_get_their_own_buffers_and_come_back_to_them(make_session, identity_model):
    model = IOBindingORTModel(make_session(identity_model()))
    small = model(x=torch.zeros(2, 4))[0]
    large = model(x=torch.ones(3, 4))[0]
    assert large.data_ptr() != small.data_ptr()
    assert torch.equal(small, torch.zeros(2, 4))  # another signature leaves it alone
    again = model(x=torch.full((2, 4), 5.0))[0]
    assert again.data_ptr() == small.data_ptr()
    assert torch.equal(large, torch.ones(3, 4))


def test_output_buffers_are_kept_for_at_most_max_output_signatures(make_session, identity_model):
    model = IOBindingORTModel(make_session(identity_model()), max_output_signatures=2)
    first = model(x=torch.zeros(1, 4))[0]
    model(x=torch.zeros(2, 4))
    model(x=torch.zeros(3, 4))  # evicts the signature of batch 1
    assert model(x=torch.ones(1, 4))[0].data_ptr() != first.data_ptr()
    assert torch.equal(first, torch.zeros(1, 4))


def test_reuse_outputs_false_returns_fresh_tensors(make_session, identity_model):
    model = IOBindingORTModel(make_session(identity_model()), reuse_outputs=False)
    first = model(x=torch.zeros(2, 4))[0]
    second = model(x=torch.ones(2, 4))[0]
    assert first.data_ptr() != second.data_ptr()
    assert torch.equal(first, torch.zeros(2, 4)) and torch.equal(second, torch.ones(2, 4))


def test_an_earlier_output_fed_back_as_input_is_never_its_own_output_buffer(make_model, make_session, tensor):
    model_proto = make_model(
        [helper.make_node("Transpose", ["x"], ["y"])],
        [tensor("x", TensorProto.FLOAT, ["n", "n"])],
        [tensor("y", TensorProto.FLOAT, ["n", "n"])],
    )
    model = IOBindingORTModel(make_session(model_proto))
    x = torch.arange(16.0).reshape(4, 4)
    (y,) = model(x=x)
    (z,) = model(x=y)  # bound onto y's memory, a transpose would read what it already overwrote
    assert z.data_ptr() != y.data_ptr()
    assert torch.equal(y, x.t()) and torch.equal(z, x)


# ------------------------------------------------------------------------------------------ inputs and conversions
def test_contiguous_tensor_of_the_right_dtype_is_bound_without_a_copy(monkeypatch, make_session, identity_model):
    model = IOBindingORTModel(make_session(identity_model()))
    x = random_tensor((2, 4), torch.float32)
    bound = {}
    original = ort.IOBinding.bind_input  # every binding's: the model's own is private to it

    def record(binding, name, device_type, device_id, element_type, shape, buffer_ptr):
        bound[name] = buffer_ptr
        return original(binding, name, device_type, device_id, element_type, shape, buffer_ptr)

    monkeypatch.setattr(ort.IOBinding, "bind_input", record)
    model(x=x)
    assert bound["x"] == x.data_ptr()


def test_non_contiguous_input_is_made_contiguous(make_session, identity_model):
    model = IOBindingORTModel(make_session(identity_model(dims=("a", "b"))))
    x = random_tensor((4, 3), torch.float32)
    assert not x.t().is_contiguous()
    assert torch.equal(model(x=x.t())[0], x.t())


def test_numpy_input_is_accepted(make_session, identity_model):
    model = IOBindingORTModel(make_session(identity_model()))
    array = np.arange(8, dtype=np.float32).reshape(2, 4)
    assert torch.equal(model(x=array)[0], torch.from_numpy(array))


def test_numpy_input_of_a_wider_dtype_is_cast(make_session, identity_model):
    model = IOBindingORTModel(make_session(identity_model()))
    array = np.linspace(0, 1, 8).reshape(2, 4)  # float64
    assert torch.equal(model(x=array)[0], torch.from_numpy(array).float())


def test_python_scalar_and_zero_d_tensor_bind_as_scalars(make_model, make_session, tensor):
    model_proto = make_model(
        [helper.make_node("Mul", ["x", "scale"], ["y"])],
        [tensor("x", TensorProto.FLOAT, ["n"]), tensor("scale", TensorProto.FLOAT, [])],
        [tensor("y", TensorProto.FLOAT, ["n"])],
    )
    model = IOBindingORTModel(make_session(model_proto))
    x = torch.arange(3.0)
    assert torch.equal(model(x=x, scale=2)[0], x * 2)  # a Python int for a float scalar input
    assert torch.equal(model(x=x, scale=0.5)[0], x * 0.5)
    assert torch.equal(model(x=x, scale=torch.tensor(3.0))[0], x * 3)
    assert torch.equal(model(x=x, scale=np.float32(4.0))[0], x * 4)


def test_empty_dim_runs_and_returns_an_empty_tensor(concat_model, make_session):
    model = IOBindingORTModel(make_session(concat_model))
    (y,) = model(x=torch.zeros(0, 3))
    assert y.shape == (0, 3)


def test_float16_input_is_cast_for_a_float32_model(make_session, identity_model):
    model = IOBindingORTModel(make_session(identity_model()))
    x = random_tensor((2, 4), torch.float16)
    (y,) = model(x=x)
    assert y.dtype == torch.float32 and torch.equal(y, x.float())


def test_int64_input_is_cast_for_an_int32_model(make_session, identity_model):
    model = IOBindingORTModel(make_session(identity_model(TensorProto.INT32)))
    x = torch.tensor([[1, 2, 3, 4]], dtype=torch.int64)
    (y,) = model(x=x)
    assert y.dtype == torch.int32 and y.tolist() == [[1, 2, 3, 4]]


def test_a_converted_temporary_input_stays_alive_until_the_run_ends(monkeypatch, make_session, identity_model):
    model = IOBindingORTModel(make_session(identity_model(dims=(256, 256))))
    source = np.random.default_rng(0).standard_normal((256, 256))  # float64: converted to a temporary float32
    run = model.session.run_with_iobinding

    def collect_then_run(binding, *args):
        gc.collect()
        # Reuse freed memory: if the temporary had been dropped, its block would now hold this garbage.
        scribble = [torch.full((256, 256), float("nan")) for _ in range(8)]
        result = run(binding, *args)
        del scribble
        return result

    monkeypatch.setattr(model.session, "run_with_iobinding", collect_then_run)
    (y,) = model(x=source)
    assert torch.equal(y, torch.from_numpy(source).float())


# ---------------------------------------------------------------------------------------------------------- errors
def test_unknown_input_name_is_an_error_naming_it(concat_model, make_session):
    model = IOBindingORTModel(make_session(concat_model))
    with pytest.raises(ValueError, match=r"unknown input 'z'.*\['x'\]"):
        model(x=torch.zeros(1, 2), z=torch.zeros(1))


def test_missing_input_is_an_error_naming_it(three_output_model, make_session):
    model = IOBindingORTModel(make_session(three_output_model))
    with pytest.raises(ValueError, match=r"missing input 'b'"):
        model(a=torch.zeros(1, 3))


def test_wrong_rank_is_an_error_with_expected_and_received_shapes(concat_model, make_session):
    model = IOBindingORTModel(make_session(concat_model))
    with pytest.raises(ValueError, match=r"input 'x': expected rank 2 .*got rank 3 \(shape \[1, 2, 3\]\)"):
        model(x=torch.zeros(1, 2, 3))


def test_static_dim_mismatch_is_an_error(three_output_model, make_session):
    model = IOBindingORTModel(make_session(three_output_model))
    with pytest.raises(ValueError, match=r"input 'a': expected size 3 in dim 1 .*got 4"):
        model(a=torch.zeros(2, 4), b=torch.zeros(2, 4))


def test_a_named_dim_the_inputs_disagree_on_is_sized_by_shape_inference(make_model, make_session, tensor):
    # diffusers' exports name the timestep's dim "batch" too, and its pipeline passes [t] with a batch-2 sample
    model_proto = make_model(
        [helper.make_node("Unsqueeze", ["timestep", "axis"], ["t"]), helper.make_node("Mul", ["sample", "t"], ["y"])],
        [tensor("sample", TensorProto.FLOAT, ["batch", 3]), tensor("timestep", TensorProto.FLOAT, ["batch"])],
        [tensor("y", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(np.array([1], dtype=np.int64), "axis")],
    )
    model = IOBindingORTModel(make_session(model_proto))
    sample = random_tensor((2, 3), torch.float32)
    assert infer_output_shapes(model, {"sample": (2, 3), "timestep": (1,)}) == {"y": (2, 3)}
    assert torch.equal(model(sample=sample, timestep=torch.tensor([2.0]))[0], sample * 2)


@pytest.mark.parametrize("io_binding", [True, False])
def test_lossy_dtype_is_an_error(io_binding, make_session, identity_model):
    model = IOBindingORTModel(make_session(identity_model(TensorProto.INT64)), io_binding=io_binding)
    with pytest.raises(TypeError, match=r"input 'x': expected dtype torch.int64, got torch.float32"):
        model(x=torch.zeros(1, 4))


def test_complex_tensor_is_an_error(make_session, identity_model):
    model = IOBindingORTModel(make_session(identity_model()))
    with pytest.raises(TypeError, match=r"input 'x': expected dtype torch.float32, got torch.complex64"):
        model(x=torch.zeros(1, 4, dtype=torch.complex64))


def test_unsupported_python_type_is_an_error(make_session, identity_model):
    model = IOBindingORTModel(make_session(identity_model()))
    with pytest.raises(
        TypeError, match=r"input 'x': expected a torch.Tensor, numpy.ndarray or Python scalar, got list"
    ):
        model(x=[[1.0, 2.0, 3.0, 4.0]])


def test_model_with_an_unsupported_tensor_type_is_refused_at_construction(make_model, make_session, tensor):
    model_proto = make_model(
        [helper.make_node("Identity", ["x"], ["y"])],
        [tensor("x", TensorProto.STRING, [1])],
        [tensor("y", TensorProto.STRING, [1])],
    )
    with pytest.raises(TypeError, match=r"input 'x' has type tensor\(string\)"):
        IOBindingORTModel(make_session(model_proto))


def test_a_cuda_tensor_on_another_gpu_than_the_sessions_is_an_error():
    with pytest.raises(ValueError, match=r"input 'x': expected a tensor on cuda:0 .*got one on cuda:1"):
        check_input_device("x", torch.device("cuda", 1), torch.device("cuda", 0))
    check_input_device("x", torch.device("cuda", 0), torch.device("cuda", 0))
    check_input_device("x", torch.device("cpu"), torch.device("cuda", 1))  # copied once, silently


def test_a_meta_tensor_is_an_error(make_session, identity_model):
    model = IOBindingORTModel(make_session(identity_model()))
    with pytest.raises(ValueError, match=r"input 'x': expected a CPU or CUDA tensor, got one on meta"):
        model(x=torch.zeros(1, 4, device="meta"))


def test_unavailable_provider_is_an_error_listing_the_available_ones(tmp_path, identity_model):
    path = tmp_path / "model.onnx"
    onnx.save(identity_model(), path)
    with pytest.raises(ValueError, match=r"provider: 'NoSuchExecutionProvider' is not available.*CPUExecutionProvider"):
        IOBindingORTModel(path, provider="NoSuchExecutionProvider")


def test_missing_file_is_an_error_naming_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nothing at .*absent\.onnx"):
        IOBindingORTModel(tmp_path / "absent.onnx")


def test_corrupt_file_is_an_error_naming_the_path(tmp_path, identity_model):
    path = tmp_path / "model.onnx"
    path.write_bytes(identity_model().SerializeToString()[:20])
    with pytest.raises(ValueError, match=r"could not load .*model\.onnx"):
        IOBindingORTModel(path)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_tensor_on_cuda_1_for_a_cuda_0_session_is_refused(make_session, identity_model):
    model = IOBindingORTModel(make_session(identity_model(), "CUDAExecutionProvider"))
    with pytest.raises(ValueError, match="got one on cuda:1"):
        model(x=torch.zeros(1, 4, device="cuda:1"))


# ----------------------------------------------------------------------------------------------- loading / saving
def save_with_external_data(model: onnx.ModelProto, path) -> None:
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="weights.pb",
        size_threshold=0,
    )


@pytest.fixture
def weighted_model(make_model, tensor) -> onnx.ModelProto:
    """y = x @ w, w = arange(12) as [4, 3], an initializer."""
    weight = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3), "w")
    return make_model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        [tensor("x", TensorProto.FLOAT, ["batch", 4])],
        [tensor("y", TensorProto.FLOAT, ["batch", 3])],
        [weight],
    )


WIDE = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32) / 1000  # owned: at least 1024 elements


@pytest.fixture
def model_and_part(tmp_path, make_model, tensor):
    """A model (``y = x @ w``) and a part beside it that names the same weight (``z = x @ w + x @ w``), both reading
    one weights file."""
    weight = numpy_helper.from_array(WIDE.numpy(), "w")
    model = make_model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        [tensor("x", TensorProto.FLOAT, ["batch", 64])],
        [tensor("y", TensorProto.FLOAT, ["batch", 32])],
        [weight],
    )
    save_with_external_data(model, tmp_path / "model.onnx")
    part = onnx.load(str(tmp_path / "model.onnx"), load_external_data=False)  # w: still the model's file
    del part.graph.node[:], part.graph.output[:]
    part.graph.node.extend([helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "m"], ["z"])])
    part.graph.output.append(tensor("z", TensorProto.FLOAT, ["batch", 32]))
    onnx.save_model(part, str(tmp_path / "part.onnx"))
    return IOBindingORTModel(str(tmp_path / "model.onnx")), tmp_path / "part.onnx"


def test_a_part_reads_the_weights_its_model_owns_so_an_in_place_change_reaches_it(model_and_part):
    model, path = model_and_part
    weights = model.own_weights()
    part = model.part(path)
    x = torch.ones(2, 64)
    expected = 2 * (x @ WIDE)
    torch.testing.assert_close(part(x=x)[0], expected)
    weights["w"].mul_(3)  # as runtime LoRA changes them
    torch.testing.assert_close(part(x=x)[0], 3 * expected)
    torch.testing.assert_close(model(x=x)[0], 1.5 * expected)
    assert part.owned_weights["w"].data_ptr() == weights["w"].data_ptr()


def test_a_part_of_a_model_whose_weights_are_not_owned_loads_them_from_the_file(model_and_part):
    model, path = model_and_part
    part = model.part(path)
    x = torch.ones(2, 64)
    torch.testing.assert_close(part(x=x)[0], 2 * (x @ WIDE))
    assert not part.owned_weights


def test_a_part_that_is_not_there_is_refused_naming_it(model_and_part, tmp_path):
    model, _ = model_and_part
    with pytest.raises(ValueError, match="expected an .onnx file, found nothing at .*nowhere.onnx"):
        model.part(tmp_path / "nowhere.onnx")


def test_from_pretrained_loads_a_subfolder_and_runs(tmp_path, weighted_model):
    (tmp_path / "unet").mkdir()
    save_with_external_data(weighted_model, tmp_path / "unet" / "model.onnx")
    model = IOBindingORTModel.from_pretrained(tmp_path, subfolder="unet")
    x = torch.ones(2, 4)
    assert torch.equal(model(x=x)[0], x @ torch.arange(12.0).reshape(4, 3))


def test_save_pretrained_writes_the_model_and_its_external_data(tmp_path, weighted_model):
    save_with_external_data(weighted_model, tmp_path / "model.onnx")
    model = IOBindingORTModel.from_pretrained(tmp_path / "model.onnx")
    target = tmp_path / "saved"
    model.save_pretrained(target)
    assert (target / "model.onnx").is_file() and (target / "weights.pb").is_file()
    reloaded = IOBindingORTModel.from_pretrained(target)
    x = random_tensor((3, 4), torch.float32)
    assert torch.equal(reloaded(x=x)[0], model(x=x)[0])


def test_save_pretrained_of_an_in_memory_session_writes_its_bytes(tmp_path, concat_model, make_session):
    model = IOBindingORTModel(make_session(concat_model))
    model.save_pretrained(tmp_path)
    x = random_tensor((2, 3), torch.float32)
    assert torch.equal(IOBindingORTModel.from_pretrained(tmp_path)(x=x)[0], model(x=x)[0])


def test_from_pretrained_of_a_folder_without_the_file_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"expected 'model.onnx' in .*vae_decoder"):
        IOBindingORTModel.from_pretrained(tmp_path, subfolder="vae_decoder")


def test_load_model_takes_providers_with_options_as_ort_does(tmp_path, identity_model):
    path = tmp_path / "model.onnx"
    onnx.save(identity_model(), path)
    session = IOBindingORTModel.load_model(
        path, [("CPUExecutionProvider", {"arena_extend_strategy": "kSameAsRequested"})]
    )
    assert session.get_providers() == ["CPUExecutionProvider"]
    assert IOBindingORTModel(path, provider=["CPUExecutionProvider"]).device == torch.device("cpu")


# ---------------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_cuda_session_binds_device_tensors_in_place_and_returns_device_tensors(make_session, transpose_concat_model):
    model = IOBindingORTModel(make_session(transpose_concat_model(TensorProto.FLOAT16), "CUDAExecutionProvider"))
    assert model.device == torch.device("cuda", 0)
    x = random_tensor((3, 5), torch.float16).cuda()
    (y,) = model(x=x)
    assert y.device == model.device
    assert torch.equal(y.cpu(), torch.cat([x, x]).t().cpu())


def test_directml_with_binding_is_refused_saying_what_to_use_instead(tmp_path, concat_model):
    path = tmp_path / "model.onnx"
    onnx.save(concat_model, str(path))
    with pytest.raises(ValueError, match="DmlExecutionProvider.*io_binding=False"):
        IOBindingORTModel(path, provider="DmlExecutionProvider")
    # without binding DirectML is only a provider this build lacks, as any other
    with pytest.raises(ValueError, match="not available in this onnxruntime build"):
        IOBindingORTModel(path, provider="DmlExecutionProvider", io_binding=False)


def test_an_amd_gpu_session_binds_on_the_torch_cuda_device_of_its_device_id():
    from optimum_iobinding.runtime.model import session_device

    class RocmSession:  # what a ROCm/MIGraphX session reports (no AMD GPU here to make a real one)
        def __init__(self, provider):
            self.provider = provider

        def get_providers(self):
            return [self.provider, "CPUExecutionProvider"]

        def get_provider_options(self):
            return {self.provider: {"device_id": "1"}, "CPUExecutionProvider": {}}

    for provider in ("ROCMExecutionProvider", "MIGraphXExecutionProvider"):
        assert session_device(RocmSession(provider)) == torch.device("cuda", 1)


def test_a_sibling_has_its_own_session_and_the_same_file_options_and_results(tmp_path, sibling_model):
    path = tmp_path / "m.onnx"
    onnx.save(sibling_model, path)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    model = IOBindingORTModel(path, sess_options=options, reuse_outputs=False, config={"scale": 2})
    twin = model.sibling()
    assert twin.session is not model.session and twin.model_path == model.model_path
    assert twin.reuse_outputs is False and twin.config == {"scale": 2} and twin.providers == model.providers
    assert twin.session.get_session_options().intra_op_num_threads == 1
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    torch.testing.assert_close(twin(x=x)[0], model(x=x)[0])
    assert model.sibling(reuse_outputs=True).reuse_outputs is True
    with pytest.raises(TypeError, match=r"sibling: expected settings among .*got \['provider'\]"):
        model.sibling(provider="CPUExecutionProvider")


@pytest.fixture
def sibling_model(make_model) -> onnx.ModelProto:
    """y = x * x."""
    return make_model(
        [helper.make_node("Mul", ["x", "x"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])],
    )
