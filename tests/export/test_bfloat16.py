"""bfloat16 diffusion transformers (SD3.5-shaped MMDiT, FLUX.1 dev) made from the project's float16 export: nothing
float16 is left, the weights are the float32 weights rounded to bfloat16 as torch rounds them, the ops ORT's CUDA
provider cannot run in bfloat16 run in float32 between Casts, and the graph is a valid model. ORT's CPU provider has
no bfloat16 MatMul or Add, so the graph is checked numerically with its bfloat16 values read back as float32 (exact):
that copy computes what the float32 export computes with its weights rounded to bfloat16, on ORT's CPU kernels. Both
the ORT-optimized graph (the fused one a GPU runs) and the plain export are checked. ``export_pipeline(dtype="bf16")``
(and ``export --dtype bf16``) writes that model, its step-cache parts cut from it; CLIP and the VAE float16, T5
float32; a UNet pipeline, an unknown dtype or one in conflict with ``fp16=True`` is refused before anything is
written."""

from __future__ import annotations

import copy
from typing import Dict, NamedTuple

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

from optimum_iobinding.errors import ArgumentError, ArgumentTypeError
from optimum_iobinding.export import export_pipeline
from optimum_iobinding.export.bfloat16 import (
    bfloat16_bits,
    has_bfloat16_cuda_kernel,
    ops_without_bfloat16_cuda_kernels,
    to_bfloat16,
)
from optimum_iobinding.export.optimize import convert_to_float16
from optimum_iobinding.export.tiny import build_tiny_random_flux_pipeline, build_tiny_random_sd3_pipeline

from .test_transformer_fusions import random_inputs

FLOAT, FLOAT16, BFLOAT16 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16
BUILDERS = {
    "sd3.5": build_tiny_random_sd3_pipeline,
    "flux-dev": lambda: build_tiny_random_flux_pipeline(guidance_embeds=True),
}
# The ops without a bfloat16 CUDA kernel at opset 17 in each export: SD3's patch-embedding Conv and its unpatchify
# Einsum; in the plain exports (no ORT optimizer) also the ReduceMean of every query/key RMS norm, which ORT's
# optimizer otherwise fuses into SimplifiedLayerNormalization
KEPT_IN_FLOAT32 = {
    ("sd3.5", "cuda"): ["Conv", "Einsum"],
    ("sd3.5", None): ["Conv", "Einsum", "ReduceMean"],
    ("flux-dev", "cuda"): [],
    ("flux-dev", None): ["ReduceMean"],
}


class Exports(NamedTuple):
    kind: str
    optimize: object
    float32: onnx.ModelProto
    float16: onnx.ModelProto
    bfloat16: onnx.ModelProto


@pytest.fixture(
    scope="module",
    params=[(kind, optimize) for kind in BUILDERS for optimize in ("cuda", None)],
    ids=lambda param: f"{param[0]}-{'fused' if param[1] else 'plain'}",
)
def exports(request, tmp_path_factory) -> Exports:
    """One tiny transformer exported in float32 and in float16 by the project's export (ORT's optimizer for CUDA,
    or none), and the float16 one converted to bfloat16 with the float32 one's weights."""
    kind, optimize = request.param
    torch_pipe = BUILDERS[kind]()
    folder = tmp_path_factory.mktemp(kind)
    models = []
    for fp16 in (False, True):
        out = export_pipeline(
            None,
            folder / ("fp16" if fp16 else "fp32"),
            torch_pipeline=torch_pipe,
            fp16=fp16,
            optimize=optimize,
            components=["transformer"],
            progress=False,
        )
        models.append(onnx.load(str(out / "transformer" / "model.onnx")))
    float32, float16 = models
    return Exports(kind, optimize, float32, float16, to_bfloat16(float16, float32))


def element_types(graph: onnx.GraphProto) -> Dict[str, int]:
    types = {value.name: value.type.tensor_type.elem_type for value in (*graph.input, *graph.value_info, *graph.output)}
    types.update({tensor.name: tensor.data_type for tensor in graph.initializer})
    return types


def float16_places(model: onnx.ModelProto) -> list:
    """Everything of ``model`` that names float16: value types, initializers, element-type and tensor attributes."""
    graph = model.graph
    places = [
        value.name
        for value in (*graph.input, *graph.output, *graph.value_info)
        if value.type.tensor_type.elem_type == FLOAT16
    ]
    places += [tensor.name for tensor in graph.initializer if tensor.data_type == FLOAT16]
    for node in graph.node:
        for attribute in node.attribute:
            element_type = attribute.type == onnx.AttributeProto.INT and attribute.name in ("to", "dtype")
            if (element_type and attribute.i == FLOAT16) or (
                attribute.type == onnx.AttributeProto.TENSOR and attribute.t.data_type == FLOAT16
            ):
                places.append(f"{node.name}.{attribute.name}")
    return places


def bfloat16_values(tensor: TensorProto) -> np.ndarray:
    """A bfloat16 tensor's values as float32 (exact: bfloat16 is float32's upper half)."""
    bits = np.frombuffer(tensor.raw_data, dtype="<u2").astype(np.uint32) << 16
    return bits.view(np.float32).reshape(tuple(tensor.dims))


def torch_bfloat16(values: np.ndarray) -> np.ndarray:
    """``values`` rounded to bfloat16 by torch, as float32."""
    return torch.from_numpy(np.array(values, dtype=np.float32)).to(torch.bfloat16).float().numpy()


def read_as_float32(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of the bfloat16 ``model`` with every bfloat16 type, value and Cast made float32 (the values read back
    exactly): a graph ORT's CPU provider runs, computing what the bfloat16 one computes without its roundings of
    activations."""
    model = copy.deepcopy(model)
    graph = model.graph
    for value in (*graph.input, *graph.output, *graph.value_info):
        if value.type.tensor_type.elem_type == BFLOAT16:
            value.type.tensor_type.elem_type = FLOAT
    tensors = [tensor for tensor in graph.initializer]
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.INT and attribute.name == "to" and attribute.i == BFLOAT16:
                attribute.i = FLOAT
            elif attribute.type == onnx.AttributeProto.TENSOR:
                tensors.append(attribute.t)
    for tensor in tensors:
        if tensor.data_type == BFLOAT16:
            tensor.CopyFrom(numpy_helper.from_array(bfloat16_values(tensor), tensor.name))
    return model


def with_weights_rounded_like(float32: onnx.ModelProto, bfloat16: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``float32`` whose initializers and Constant values that ``bfloat16`` holds in bfloat16 are rounded to
    bfloat16 by torch."""
    rounded = copy.deepcopy(float32)
    stored = {tensor.name for tensor in bfloat16.graph.initializer if tensor.data_type == BFLOAT16}
    stored |= {
        node.output[0]
        for node in bfloat16.graph.node
        if node.op_type == "Constant" and node.attribute[0].t.data_type == BFLOAT16
    }
    tensors = [tensor for tensor in rounded.graph.initializer if tensor.name in stored]
    tensors += [
        node.attribute[0].t for node in rounded.graph.node if node.op_type == "Constant" and node.output[0] in stored
    ]
    for tensor in tensors:
        tensor.CopyFrom(numpy_helper.from_array(torch_bfloat16(numpy_helper.to_array(tensor)), tensor.name))
    return rounded


def run(model: onnx.ModelProto, inputs: Dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, inputs)[0]


def is_cast(node: onnx.NodeProto, to: int) -> bool:
    return node.op_type == "Cast" and helper.get_attribute_value(node.attribute[0]) == to


def checkable(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy that onnx's checker can read: ORT's own ops that ORT writes in ONNX's domain (its
    SimplifiedLayerNormalization), which onnx does not define, are moved to ORT's domain, whose ops onnx leaves
    unchecked."""
    model = copy.deepcopy(model)
    for node in model.graph.node:
        if node.domain in ("", "ai.onnx") and not onnx.defs.has(node.op_type):
            node.domain = "com.microsoft"
    return model


# --------------------------------------------------------------------------------------------------- the types
def test_no_float16_is_left_anywhere_in_a_bfloat16_transformer(exports):
    assert float16_places(exports.float16)  # there was some
    assert float16_places(exports.bfloat16) == []


def test_a_bfloat16_transformer_takes_and_returns_bfloat16_where_the_float16_one_takes_float16(exports):
    for float16_values, bfloat16_values_ in (
        (exports.float16.graph.input, exports.bfloat16.graph.input),
        (exports.float16.graph.output, exports.bfloat16.graph.output),
    ):
        half = {value.name: value.type.tensor_type.elem_type for value in float16_values}
        converted = {value.name: value.type.tensor_type.elem_type for value in bfloat16_values_}
        assert converted == {name: BFLOAT16 if kind == FLOAT16 else kind for name, kind in half.items()}
    inputs = {value.name: value.type.tensor_type.elem_type for value in exports.bfloat16.graph.input}
    assert inputs["hidden_states"] == inputs["encoder_hidden_states"] == BFLOAT16
    # SD3 embeds its timestep from float32, as diffusers feeds it; FLUX.1 rounds it to the latents' dtype first
    assert inputs["timestep"] == (FLOAT if exports.kind == "sd3.5" else BFLOAT16)


# ------------------------------------------------------------------------------------------------- the weights
def test_every_weight_is_its_float32_weight_rounded_to_bfloat16_as_torch_rounds_it(exports):
    originals = {tensor.name: numpy_helper.to_array(tensor) for tensor in exports.float32.graph.initializer}
    weights = [tensor for tensor in exports.bfloat16.graph.initializer if tensor.data_type == BFLOAT16]
    assert len(weights) > 20 and all(tensor.name in originals for tensor in weights)
    for tensor in weights:
        np.testing.assert_array_equal(bfloat16_values(tensor), torch_bfloat16(originals[tensor.name]), tensor.name)


def test_the_weights_of_the_ops_kept_in_float32_are_the_float32_weights_themselves(exports):
    originals = {tensor.name: numpy_helper.to_array(tensor) for tensor in exports.float32.graph.initializer}
    kept = [tensor for tensor in exports.bfloat16.graph.initializer if tensor.data_type == FLOAT]
    # SD3's patch embedding (its Conv's weight and bias); FLUX.1 has no such op
    assert len(kept) == (2 if exports.kind == "sd3.5" else 0)
    for tensor in kept:
        np.testing.assert_array_equal(numpy_helper.to_array(tensor), originals[tensor.name])


def test_a_weight_float16_cannot_hold_takes_its_float32_value_rounded_to_bfloat16(make_model, tensor):
    """ORT's float16 converter clamps a weight to float16's range (65504) and lifts a tiny one to its smallest
    subnormal; bfloat16 holds both, so they come from the float32 weight, not the float16 one."""
    weight = np.array([[1.0e5, 1.0e-9], [3.0, -7.0e4]], dtype=np.float32)
    float32 = make_model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        [tensor("x", FLOAT, [1, 2])],
        [tensor("y", FLOAT, [1, 2])],
        [numpy_helper.from_array(weight, "w")],
    )
    float16 = convert_to_float16(float32)
    assert numpy_helper.to_array(float16.graph.initializer[0]).max() == 65504  # clamped
    converted = to_bfloat16(float16, float32)
    np.testing.assert_array_equal(bfloat16_values(converted.graph.initializer[0]), torch_bfloat16(weight))
    # without its float32 original a weight is rounded from its float16 value
    from_float16 = to_bfloat16(float16, {})
    assert bfloat16_values(from_float16.graph.initializer[0])[0, 0] == torch_bfloat16(np.float32(65504))


def test_bfloat16_bits_round_to_nearest_even_as_torch_does():
    rng = np.random.default_rng(0)
    values = np.concatenate(
        [
            rng.standard_normal(10000).astype(np.float32) * np.float32(10.0) ** rng.integers(-30, 30, 10000),
            # ties between two bfloat16s (the lower 16 bits 0x8000), either side of even
            (np.arange(0x3F800000, 0x3F800000 + 64 * 0x10000, 0x10000, dtype=np.uint32) + 0x8000).view(np.float32),
            np.array(
                [0.0, -0.0, np.inf, -np.inf, np.finfo(np.float32).max, np.finfo(np.float32).tiny, 1e-45],
                dtype=np.float32,
            ),
        ]
    )
    expected = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(bfloat16_bits(values), expected)
    nan = (bfloat16_bits(np.array([np.nan, -np.nan], np.float32)).astype(np.uint32) << 16).view(np.float32)
    assert np.isnan(nan).all() and np.signbit(nan).tolist() == [False, True]


# ------------------------------------------------------------------------------------------- ops kept float32
def test_the_ops_without_a_bfloat16_cuda_kernel_are_found_in_the_float16_export(exports):
    assert ops_without_bfloat16_cuda_kernels(exports.float16) == KEPT_IN_FLOAT32[(exports.kind, exports.optimize)]


def test_every_op_of_a_bfloat16_transformer_that_handles_bfloat16_has_a_bfloat16_cuda_kernel(exports):
    assert ops_without_bfloat16_cuda_kernels(exports.bfloat16) == []


def test_the_ops_without_a_bfloat16_kernel_compute_in_float32_between_casts(exports):
    graph = exports.bfloat16.graph
    types = element_types(graph)
    producer = {output: node for node in graph.node for output in node.output}
    readers: Dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    kept = [node for node in graph.node if node.op_type in KEPT_IN_FLOAT32[(exports.kind, exports.optimize)]]
    # SD3's Conv and Einsum; the plain exports' ReduceMean of each RMS norm (SD3.5: ten, FLUX.1: six)
    assert len(kept) == {"sd3.5": 2, "flux-dev": 0}[exports.kind] + (
        0 if exports.optimize else {"sd3.5": 10, "flux-dev": 6}[exports.kind]
    )
    for node in kept:
        floats = [name for name in (*node.input, *node.output) if name and types[name] != TensorProto.INT64]
        assert {types[name] for name in floats} == {FLOAT}, node.name
        activations = [name for name in node.input if name in producer and producer[name].op_type != "Constant"]
        assert all(is_cast(producer[name], FLOAT) for name in activations), node.name
        assert all(is_cast(reader, BFLOAT16) for name in node.output for reader in readers[name]), node.name


def test_whether_cuda_runs_an_op_in_bfloat16_depends_on_the_opset():
    assert not has_bfloat16_cuda_kernel("", "Conv", 17) and has_bfloat16_cuda_kernel("", "Conv", 22)
    assert has_bfloat16_cuda_kernel("ai.onnx", "MatMul", 17) and not has_bfloat16_cuda_kernel("", "MatMul", 12)
    assert has_bfloat16_cuda_kernel("com.microsoft", "MultiHeadAttention", 1)
    assert not has_bfloat16_cuda_kernel("com.microsoft", "BiasAdd", 1)
    assert not has_bfloat16_cuda_kernel("", "Einsum", 23)


def test_a_value_the_float16_model_declares_no_type_for_is_typed_by_orts_shape_inference(exports):
    """The ops kept in float32 are found by the types of what they read: values the float16 model does not type (the
    activations every MatMul, Einsum and ReduceMean reads, here) are typed by ORT's symbolic shape inference first."""
    float16 = copy.deepcopy(exports.float16)
    untyped = {node.input[0] for node in float16.graph.node if node.op_type in ("MatMul", "Einsum", "ReduceMean")}
    values = [value for value in float16.graph.value_info if value.name not in untyped]
    assert len(values) < len(float16.graph.value_info)
    del float16.graph.value_info[:]
    float16.graph.value_info.extend(values)
    converted = to_bfloat16(float16, exports.float32)
    assert float16_places(converted) == [] and ops_without_bfloat16_cuda_kernels(converted) == []
    types = element_types(converted.graph)
    assert {types.get(name) for name in untyped} == {BFLOAT16}
    kept = KEPT_IN_FLOAT32[(exports.kind, exports.optimize)]
    assert all(types[node.input[0]] == FLOAT for node in converted.graph.node if node.op_type in kept)


def test_the_values_inside_a_subgraph_become_bfloat16_too(make_model, tensor):
    scale = helper.make_node("Constant", [], ["scale"], value=numpy_helper.from_array(np.float16([2.5]), "scale"))
    then_branch = helper.make_graph(
        [scale, helper.make_node("Mul", ["x", "scale"], ["scaled"])], "then", [], [tensor("scaled", FLOAT16, [1])]
    )
    else_branch = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["same"])], "else", [], [tensor("same", FLOAT16, [1])]
    )
    float16 = make_model(
        [helper.make_node("If", ["condition"], ["y"], then_branch=then_branch, else_branch=else_branch)],
        [tensor("condition", TensorProto.BOOL, []), tensor("x", FLOAT16, [1])],
        [tensor("y", FLOAT16, [1])],
    )
    converted = to_bfloat16(float16, {})
    branches = {attribute.name: attribute.g for attribute in converted.graph.node[0].attribute}
    assert [
        value.type.tensor_type.elem_type for graph in (converted.graph, *branches.values()) for value in graph.output
    ] == [BFLOAT16, BFLOAT16, BFLOAT16]
    (constant,) = [node for node in branches["then_branch"].node if node.op_type == "Constant"]
    assert constant.attribute[0].t.data_type == BFLOAT16 and bfloat16_values(constant.attribute[0].t) == [2.5]
    onnx.checker.check_model(converted, full_check=True)


# -------------------------------------------------------------------------------------------------- the graph
def test_a_bfloat16_transformer_passes_onnx_checker_and_orts_symbolic_shape_inference(exports):
    onnx.checker.check_model(checkable(exports.bfloat16), full_check=True)  # types of every ONNX op included
    inferred = SymbolicShapeInference.infer_shapes(exports.bfloat16, auto_merge=True, guess_output_rank=False)
    (output,) = inferred.graph.output
    assert output.type.tensor_type.elem_type == BFLOAT16
    assert len(output.type.tensor_type.shape.dim) == (4 if exports.kind == "sd3.5" else 3)


def test_the_bfloat16_graph_computes_the_float32_graph_with_its_weights_rounded_to_bfloat16(exports):
    """The bfloat16 graph with its values read as float32 against the float32 export whose weights are rounded as the
    conversion rounds them: the same graph, up to the Casts, computing the same numbers."""
    inputs = random_inputs(exports.float32)
    expected = run(with_weights_rounded_like(exports.float32, exports.bfloat16), inputs)
    actual = run(read_as_float32(exports.bfloat16), inputs)
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())


def test_the_bfloat16_graph_stays_within_bfloat16_rounding_of_the_float32_export(exports):
    """Weights rounded to bfloat16 (a relative error of at most 2⁻⁹ each) move the output of these two-block
    transformers by well under eight such roundings of its largest value."""
    inputs = random_inputs(exports.float32)
    expected = run(exports.float32, inputs)
    actual = run(read_as_float32(exports.bfloat16), inputs)
    error = np.abs(actual - expected).max()
    assert 0 < error <= 8 * 2.0**-9 * np.abs(expected).max()


# -------------------------------------------------------------------------------------------------- arguments
def test_the_float16_model_is_left_as_it_is_unless_converted_in_place(exports):
    float16 = copy.deepcopy(exports.float16)
    to_bfloat16(float16, exports.float32)
    assert float16 == exports.float16
    assert to_bfloat16(float16, exports.float32, in_place=True) is float16
    assert float16_places(float16) == []


def test_float32_weights_of_another_model_are_refused(make_model, tensor):
    weight = np.arange(4, dtype=np.float32).reshape(2, 2)
    float32 = make_model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        [tensor("x", FLOAT, [1, 2])],
        [tensor("y", FLOAT, [1, 2])],
        [numpy_helper.from_array(weight, "w")],
    )
    float16 = convert_to_float16(float32)
    with pytest.raises(ArgumentError, match="float32_weights: expected the float32 original of 'w'"):
        to_bfloat16(float16, {"w": weight + 1})
    with pytest.raises(ArgumentError, match=r"float32_weights: expected 'w' as a float32 array of shape \(2, 2\)"):
        to_bfloat16(float16, {"w": weight.reshape(4)})
    with pytest.raises(ArgumentTypeError, match="float32_weights: expected a mapping"):
        to_bfloat16(float16, [weight])
    with pytest.raises(ArgumentTypeError, match="float16_model: expected an onnx.ModelProto"):
        to_bfloat16("model.onnx", float32)


def test_a_float16_model_whose_weights_are_on_disk_is_refused(make_model, tensor, tmp_path):
    weight = np.ones((2, 2), dtype=np.float32)
    float32 = make_model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        [tensor("x", FLOAT, [1, 2])],
        [tensor("y", FLOAT, [1, 2])],
        [numpy_helper.from_array(weight, "w")],
    )
    onnx.save_model(
        convert_to_float16(float32),
        str(tmp_path / "model.onnx"),
        save_as_external_data=True,
        location="weights",
        size_threshold=0,
    )
    light = onnx.load(str(tmp_path / "model.onnx"), load_external_data=False)
    with pytest.raises(ArgumentError, match="float16_model: expected its weights in memory, got 1 on disk"):
        to_bfloat16(light, float32)


# ------------------------------------------------------------------------------- export_pipeline(dtype="bf16")
def test_export_pipeline_with_dtype_bf16_writes_what_to_bfloat16_makes_of_its_float16_and_float32_exports(
    exports, tmp_path
):
    out = export_pipeline(
        None,
        tmp_path / "bf16",
        torch_pipeline=BUILDERS[exports.kind](),
        dtype="bf16",
        optimize=exports.optimize,
        components=["transformer"],
        progress=False,
    )
    assert onnx.load(str(out / "transformer" / "model.onnx")) == exports.bfloat16


@pytest.fixture(scope="module", params=list(BUILDERS))
def bfloat16_step_cache_export(request, tmp_path_factory):
    """(kind, the transformer's folder) of a fused bfloat16 export with First-Block Cache's parts."""
    out = export_pipeline(
        None,
        tmp_path_factory.mktemp(request.param) / "out",
        torch_pipeline=BUILDERS[request.param](),
        dtype="bf16",
        optimize="cuda",
        components=["transformer"],
        progress=False,
        step_cache=True,
    )
    return request.param, out / "transformer"


def part_paths(folder) -> list:
    from optimum_iobinding.export.step_cache import STEP_CACHE_PARTS

    return [folder / name for name, _ in STEP_CACHE_PARTS]


def test_a_bfloat16_export_with_step_cache_writes_a_bfloat16_transformer_without_float16(bfloat16_step_cache_export):
    kind, folder = bfloat16_step_cache_export
    model = onnx.load(str(folder / "model.onnx"))
    inputs = {value.name: value.type.tensor_type.elem_type for value in model.graph.input}
    assert inputs["hidden_states"] == inputs["encoder_hidden_states"] == inputs["pooled_projections"] == BFLOAT16
    assert inputs["timestep"] == (FLOAT if kind == "sd3.5" else BFLOAT16)
    assert [value.type.tensor_type.elem_type for value in model.graph.output] == [BFLOAT16]
    assert float16_places(model) == [] and ops_without_bfloat16_cuda_kernels(model) == []


def test_the_step_cache_parts_of_a_bfloat16_export_are_bfloat16_and_read_its_weights_from_its_weights_file(
    bfloat16_step_cache_export,
):
    """Every part takes and returns bfloat16 (SD3's float32 ``timestep`` aside) and holds nothing float16; the
    transformer's weights on disk are read by the parts from ``model.onnx_data``, none copied into a part (only
    values under the export's 1 KiB external-data threshold stay inside the graphs, as in ``model.onnx``)."""
    from onnx.external_data_helper import uses_external_data

    kind, folder = bfloat16_step_cache_export
    whole = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    on_disk = {tensor.name for tensor in whole.graph.initializer if uses_external_data(tensor)}
    assert len(on_disk) > 20
    read = set()
    for path in part_paths(folder):
        part = onnx.load(str(path), load_external_data=False)
        assert float16_places(part) == [] and ops_without_bfloat16_cuda_kernels(part) == [], path.name
        floats = {
            value.name: value.type.tensor_type.elem_type
            for value in (*part.graph.input, *part.graph.output)
            if value.type.tensor_type.elem_type in (FLOAT, FLOAT16, BFLOAT16)
        }
        if kind == "sd3.5" and "timestep" in floats:
            assert floats.pop("timestep") == FLOAT
        assert floats and set(floats.values()) == {BFLOAT16}, (path.name, floats)
        for tensor in part.graph.initializer:
            if uses_external_data(tensor):
                location = {entry.key: entry.value for entry in tensor.external_data}["location"]
                assert location == "model.onnx_data", (path.name, tensor.name)
                read.add(tensor.name)
            else:
                assert tensor.name not in on_disk and len(tensor.raw_data) < 1024, (path.name, tensor.name)
    assert read == on_disk


def test_the_step_cache_parts_of_a_bfloat16_export_run_in_turn_compute_what_its_transformer_computes(
    bfloat16_step_cache_export,
):
    """Read as float32 (ORT's CPU provider has no bfloat16 MatMul), the parts run in turn give the whole graph's
    output, up to the float32 rounding of what ORT fuses across a cut."""
    _, folder = bfloat16_step_cache_export
    whole = read_as_float32(onnx.load(str(folder / "model.onnx")))
    inputs = random_inputs(whole)
    expected = run(whole, inputs)
    values = dict(inputs)
    for path in part_paths(folder):
        part = read_as_float32(onnx.load(str(path)))
        session = ort.InferenceSession(part.SerializeToString(), providers=["CPUExecutionProvider"])
        results = session.run(None, {value.name: values[value.name] for value in session.get_inputs()})
        values.update({value.name: result for value, result in zip(session.get_outputs(), results)})
    np.testing.assert_allclose(values["out_hidden_states"], expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


# ------------------------------------------------------------------------------------------- refused dtypes
@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(dtype="int8"), "dtype: expected 'fp32', 'fp16' or 'bf16', got 'int8'"),
        (dict(dtype="bfloat16"), "dtype: expected 'fp32', 'fp16' or 'bf16', got 'bfloat16'"),
        (
            dict(dtype="bf16", fp16=True),
            "dtype: expected 'fp32', 'fp16' or 'bf16', got 'bf16' together with fp16=True, "
            "an alias of dtype='fp16'; hint: give dtype alone",
        ),
        (dict(dtype="fp32", fp16=True), "dtype: expected 'fp32', 'fp16' or 'bf16', got 'fp32' together with fp16=True"),
    ],
    ids=["int8", "bfloat16", "bf16-and-fp16", "fp32-and-fp16"],
)
def test_an_unknown_or_conflicting_dtype_is_refused_before_anything_is_written(tmp_path, arguments, message):
    with pytest.raises(ArgumentError, match=message.replace("(", r"\(").replace(")", r"\)")):
        export_pipeline(None, tmp_path / "out", tiny_random="sd3", progress=False, **arguments)
    assert not (tmp_path / "out").exists()


def test_fp16_true_is_an_alias_of_dtype_fp16():
    from optimum_iobinding.export.export import resolve_dtype

    assert resolve_dtype(None, fp16=True) == resolve_dtype("fp16", fp16=True) == resolve_dtype("fp16") == "fp16"
    assert resolve_dtype(None) == "fp32" and resolve_dtype("bf16") == "bf16"


UNET_REFUSAL = (
    "dtype: expected 'fp32' or 'fp16' for {}, got 'bf16'; hint: bf16 is for Stable Diffusion 3/3.5 and "
    "FLUX.1 (on a UNet most ops would stay float32, without a bfloat16 CUDA kernel: Conv below opset 22, "
    "GroupNorm, NhwcConv, BiasSplitGelu)"
)


@pytest.mark.parametrize(
    "arguments, what",
    [
        (dict(tiny_random="sd"), "the tiny random sd pipeline (a UNet)"),
        (dict(tiny_random="xl"), "the tiny random xl pipeline (a UNet)"),
        (dict(tiny_random="controlnet"), "a ControlNet pipeline (a UNet)"),
        (dict(tiny_vae=True), "a VAE alone"),
    ],
    ids=["sd", "xl", "controlnet", "vae-alone"],
)
def test_bf16_is_refused_for_a_unet_pipeline_before_it_is_built(tmp_path, monkeypatch, arguments, what):
    import optimum_iobinding.export.export as export_module

    monkeypatch.setattr(
        export_module,
        "TINY_RANDOM_KINDS",
        {kind: (lambda: pytest.fail("built before bf16 was refused")) for kind in export_module.TINY_RANDOM_KINDS},
    )
    with pytest.raises(ArgumentError) as refusal:
        export_pipeline(None, tmp_path / "out", dtype="bf16", progress=False, **arguments)
    assert str(refusal.value) == UNET_REFUSAL.format(what)
    assert not (tmp_path / "out").exists()


def test_bf16_is_refused_for_a_folder_whose_model_index_names_a_unet_before_it_loads(tmp_path):
    source = tmp_path / "sd"
    source.mkdir()
    (source / "model_index.json").write_text(
        '{"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"]}'
    )
    with pytest.raises(ArgumentError) as refusal:
        export_pipeline(
            source,
            tmp_path / "out",
            dtype="bf16",
            progress=False,
            pipeline_loader=lambda name: pytest.fail("loaded before bf16 was refused"),
        )
    assert str(refusal.value) == UNET_REFUSAL.format(f"{str(source)!r}, whose model_index.json names a UNet")
    assert not (tmp_path / "out").exists()


def test_bf16_is_refused_for_a_loaded_unet_pipeline_before_any_component_is_exported(tmp_path, monkeypatch):
    import optimum_iobinding.export.export as export_module
    from optimum_iobinding.export.tiny import build_tiny_random_pipeline

    monkeypatch.setattr(
        export_module, "export_unet_pipeline", lambda *args, **kwargs: pytest.fail("exported before bf16 was refused")
    )
    source = tmp_path / "unknown"  # a folder without a model_index.json: what it holds is known once loaded
    source.mkdir()
    with pytest.raises(ArgumentError) as refusal:
        export_pipeline(
            source,
            tmp_path / "out",
            dtype="bf16",
            progress=False,
            pipeline_loader=lambda name: build_tiny_random_pipeline(),
        )
    assert str(refusal.value) == UNET_REFUSAL.format("a StableDiffusionPipeline (a UNet)")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------- each component's precision
def test_a_bf16_export_makes_the_transformer_bfloat16_clip_and_the_vae_float16_and_t5_float32():
    from optimum_iobinding.export.flux import FLUX_COMPONENTS, FLUX_OPTIMIZER_MODEL_TYPES
    from optimum_iobinding.export.transformer import SD3_COMPONENTS, SD3_OPTIMIZER_MODEL_TYPES
    from optimum_iobinding.export.transformer_pipeline import component_precisions

    assert component_precisions(SD3_COMPONENTS, SD3_OPTIMIZER_MODEL_TYPES, "bf16") == {
        "text_encoder": "fp16",
        "text_encoder_2": "fp16",
        "text_encoder_3": "fp32",
        "transformer": "bf16",
        "vae_encoder": "fp16",
        "vae_decoder": "fp16",
    }
    assert component_precisions(FLUX_COMPONENTS, FLUX_OPTIMIZER_MODEL_TYPES, "bf16") == {
        "text_encoder": "fp16",
        "text_encoder_2": "fp32",
        "transformer": "bf16",
        "vae_encoder": "fp16",
        "vae_decoder": "fp16",
    }
    # the float16 export's rule, and float32 throughout
    assert component_precisions(FLUX_COMPONENTS, FLUX_OPTIMIZER_MODEL_TYPES, "fp16") == {
        **dict.fromkeys(FLUX_COMPONENTS, "fp16"),
        "text_encoder_2": "fp32",
    }
    assert set(component_precisions(FLUX_COMPONENTS, FLUX_OPTIMIZER_MODEL_TYPES, "fp32").values()) == {"fp32"}


def test_the_export_command_with_dtype_bf16_writes_each_component_of_a_flux_pipeline_in_its_precision(tmp_path, capsys):
    from optimum_iobinding.cli import main

    assert (
        main(
            [
                "export",
                "--tiny-random",
                "flux",
                "--dtype",
                "bf16",
                "--optimize",
                "cuda",
                "--output",
                str(tmp_path / "out"),
            ]
        )
        == 0
    )
    assert f"to {tmp_path / 'out'} (bf16, opset 17)" in capsys.readouterr().out
    outputs = {}
    for component in ("text_encoder", "text_encoder_2", "transformer", "vae_encoder", "vae_decoder"):
        model = onnx.load(str(tmp_path / "out" / component / "model.onnx"), load_external_data=False)
        outputs[component] = model.graph.output[0].type.tensor_type.elem_type
    assert outputs == {
        "text_encoder": FLOAT16,
        "text_encoder_2": FLOAT,
        "transformer": BFLOAT16,
        "vae_encoder": FLOAT16,
        "vae_decoder": FLOAT16,
    }
