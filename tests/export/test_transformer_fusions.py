"""The project's rewrites of the diffusion transformers' graphs (SD3.5-shaped MMDiT with dual attention and QK norms,
FLUX.1 schnell and dev) after ORT's MMDiT optimizer: each rewritten graph computes what ORT's optimized graph computed,
on tiny random weights with ONNX Runtime's CPU kernels; each rewrite finds every place of its pattern and leaves
look-alikes that are not it alone. FLUX.1's rotary embedding is also checked in a float16 export, which ORT's CPU
RotaryEmbedding kernel runs in float16."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable, Dict

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from optimum_iobinding.export import components, export_pipeline
from optimum_iobinding.export.optimize import fusion_options_for, optimize_component
from optimum_iobinding.export.tiny import build_tiny_random_flux_pipeline, build_tiny_random_sd3_pipeline
from optimum_iobinding.export.transformer_fusions import (
    fold_value_biases,
    fuse_diffusion_transformer,
    fuse_gelu_biases,
    fuse_modulated_layer_norms,
    fuse_rotary_embeddings,
)

BUILDERS: Dict[str, Callable] = {
    "sd3.5": build_tiny_random_sd3_pipeline,
    "flux-schnell": build_tiny_random_flux_pipeline,
    "flux-dev": lambda: build_tiny_random_flux_pipeline(guidance_embeds=True),
}
# AdaLN places of each tiny transformer: SD3.5's two blocks (norm1 feeds the attention's and the dual attention's
# modulation in the first, the context's norm1 and both norm2s; the last block's context has norm1 only) and
# norm_out; FLUX.1's double block (norm1, norm1_context, norm2, norm2_context), single block and norm_out
MODULATED_NORMS = {"sd3.5": 9, "flux-schnell": 6, "flux-dev": 6}
# feed-forward GELUs: SD3.5's ff, ff_context, ff (the last block has no context feed-forward); FLUX.1's ff,
# ff_context and the single block's proj_mlp
GELUS = {"sd3.5": 3, "flux-schnell": 3, "flux-dev": 3}
# rotary embeddings: FLUX.1's double block rotates its joint attention's query and key, its single block its
# attention's query and key; SD3.5 has none
ROTARY_EMBEDDINGS = {"sd3.5": 0, "flux-schnell": 4, "flux-dev": 4}
# attentions of one stream, whose value bias can move into the output projection: SD3.5's second (image-only)
# attention in its first block, FLUX.1's single block; the joint attentions keep theirs
VALUE_BIASES = {"sd3.5": 1, "flux-schnell": 1, "flux-dev": 1}


@pytest.fixture(scope="module", params=list(BUILDERS))
def optimized(request, tmp_path_factory) -> tuple:
    """(kind, ORT's CPU-optimized float32 transformer, before the project's rewrites)."""
    folder = tmp_path_factory.mktemp(request.param)
    export_pipeline(
        None, folder / "plain", torch_pipeline=BUILDERS[request.param](), components=["transformer"], progress=False
    )
    path = folder / "plain" / "transformer" / "model.onnx"
    model = optimize_component("transformer", path, fusion_options_for("mmdit", "cpu"), "cpu", "mmdit").model
    onnx.load_external_data_for_model(model, str(path.parent))
    return request.param, model


def random_inputs(model: onnx.ModelProto) -> Dict[str, np.ndarray]:
    """Inputs of a tiny SD3 / FLUX.1 transformer at 16² latents (SD3: CFG batch 2) with 7 text tokens."""
    rng = np.random.default_rng(0)
    names = {value.name for value in model.graph.input}
    if "img_ids" in names:  # FLUX.1: 8×8 packed tokens of 64 channels, batch 1
        ids = np.stack(np.meshgrid(np.arange(8), np.arange(8), indexing="ij"), -1).reshape(-1, 2)
        inputs = {
            "hidden_states": rng.standard_normal((1, 64, 64)),
            "encoder_hidden_states": rng.standard_normal((1, 7, 32)),
            "pooled_projections": rng.standard_normal((1, 32)),
            "timestep": np.array([0.7]),
            "img_ids": np.concatenate([np.zeros((64, 1)), ids], 1),
            "txt_ids": np.zeros((7, 3)),
            "guidance": np.array([3.5]),
        }
    else:
        inputs = {
            "hidden_states": rng.standard_normal((2, 16, 16, 16)),
            "encoder_hidden_states": rng.standard_normal((2, 7, 64)),
            "pooled_projections": rng.standard_normal((2, 64)),
            "timestep": np.array([700.0, 700.0]),
        }
    types = {
        value.name: helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type) for value in model.graph.input
    }
    return {name: value.astype(types[name]) for name, value in inputs.items() if name in names}


def run(model: onnx.ModelProto, inputs: Dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, inputs)[0]


def unit_affine_norms(model: onnx.ModelProto) -> int:
    """LayerNormalizations whose scale is a constant (a unit scale, as ORT's fusion writes AdaLN's norm)."""
    constants = {output for node in model.graph.node if node.op_type == "Constant" for output in node.output}
    constants |= {tensor.name for tensor in model.graph.initializer}
    return sum(node.op_type == "LayerNormalization" and node.input[1] in constants for node in model.graph.node)


@pytest.mark.parametrize(
    "rewrite",
    [
        fuse_modulated_layer_norms,
        fuse_gelu_biases,
        fuse_rotary_embeddings,
        fold_value_biases,
        fuse_diffusion_transformer,
    ],
    ids=["modulated-layer-norm", "gelu-bias", "rotary-embedding", "value-bias", "all"],
)
def test_a_rewritten_transformer_computes_what_orts_optimized_graph_computed(optimized, rewrite):
    kind, model = optimized
    rewritten = copy.deepcopy(model)
    made = rewrite(rewritten)
    if rewrite is fuse_rotary_embeddings and not ROTARY_EMBEDDINGS[kind]:
        assert made == 0  # no rotary embedding in this transformer: nothing to find
    else:
        assert made, f"{rewrite.__name__} found nothing to rewrite in the {kind} transformer"
    inputs = random_inputs(model)
    expected, actual = run(model, inputs), run(rewritten, inputs)
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())


def test_each_single_stream_attention_hands_its_value_bias_to_the_output_projection(optimized):
    kind, model = optimized
    rewritten = copy.deepcopy(model)
    assert fold_value_biases(rewritten) == VALUE_BIASES[kind]
    producer = {output: node for node in rewritten.graph.node for output in node.output}

    def behind(value: str) -> onnx.NodeProto:  # the node computing the values, behind the head split
        node = producer[value]
        while node.op_type in ("Transpose", "Reshape"):
            node = producer[node.input[0]]
        return node

    attentions = [node for node in rewritten.graph.node if node.op_type == "MultiHeadAttention"]
    single = [node for node in attentions if producer[node.input[2]].op_type != "Concat"]
    assert len(single) == VALUE_BIASES[kind]
    assert all(behind(node.input[2]).op_type == "MatMul" for node in single)  # no bias Add left
    joint = [node for node in attentions if node not in single]
    assert joint and all(behind(producer[node.input[2]].input[0]).op_type == "Add" for node in joint)


def test_every_adaln_modulation_runs_inside_its_layer_norm(optimized):
    kind, model = optimized
    rewritten = copy.deepcopy(model)
    assert fuse_modulated_layer_norms(rewritten) == MODULATED_NORMS[kind]
    assert unit_affine_norms(rewritten) == 0
    producer = {output: node for node in rewritten.graph.node for output in node.output}
    for node in rewritten.graph.node:
        if node.op_type == "LayerNormalization":  # its scale and bias: the per-sample modulation, not a constant
            assert producer[node.input[1]].op_type in ("Add", "Unsqueeze") and node.input[2] in producer


def test_every_feed_forward_gelu_adds_its_projections_bias_itself(optimized):
    kind, model = optimized
    rewritten = copy.deepcopy(model)
    assert fuse_gelu_biases(rewritten) == GELUS[kind]
    producer = {output: node for node in rewritten.graph.node for output in node.output}
    gelus = [node for node in rewritten.graph.node if node.op_type == "FastGelu"]
    assert len(gelus) == GELUS[kind]
    assert all(len(gelu.input) == 2 and producer[gelu.input[0]].op_type == "MatMul" for gelu in gelus)


def test_every_rotary_embedding_is_one_rotary_embedding_node_reading_shared_half_tables(optimized):
    kind, model = optimized
    rewritten = copy.deepcopy(model)
    assert fuse_rotary_embeddings(rewritten) == ROTARY_EMBEDDINGS[kind]
    if not ROTARY_EMBEDDINGS[kind]:
        assert rewritten.SerializeToString() == model.SerializeToString()
        return
    assert not [node for node in rewritten.graph.node if node.op_type == "Neg"]
    rotaries = [node for node in rewritten.graph.node if node.op_type == "RotaryEmbedding"]
    assert len(rotaries) == ROTARY_EMBEDDINGS[kind]
    assert all(node.domain == "com.microsoft" for node in rotaries)
    # the queries in the 3-D layout the fused attention reads (so with their number of heads), the keys in their 4-D
    # one; pairs of neighbouring channels rotated (interleaved)
    attributes = sorted(({a.name: helper.get_attribute_value(a) for a in node.attribute} for node in rotaries), key=len)
    assert attributes == [{"interleaved": 1}] * 2 + [{"interleaved": 1, "num_heads": 2}] * 2
    # one cos and one sin table of half the head size for all of them, token s at row s (a start offset of 0)
    assert len({tuple(node.input[1:]) for node in rotaries}) == 1
    initializers = {tensor.name: numpy_helper.to_array(tensor) for tensor in rewritten.graph.initializer}
    assert initializers[rotaries[0].input[1]].tolist() == [0]
    producer = {output: node for node in rewritten.graph.node for output in node.output}
    for table, function in zip(rotaries[0].input[2:], ("Cos", "Sin")):
        halves = producer[table]
        assert halves.op_type == "Concat" and [producer[part].op_type for part in halves.input] == [function] * 3
    # the full-width tables (each cos and sin written twice) went with the pattern
    assert not [node for node in rewritten.graph.node if node.op_type == "Flatten"]


def test_a_float16_flux_export_with_rotary_embedding_nodes_computes_what_it_computes_without(tmp_path, monkeypatch):
    def export(folder: Path) -> onnx.ModelProto:
        out = export_pipeline(
            None,
            folder,
            torch_pipeline=build_tiny_random_flux_pipeline(guidance_embeds=True),
            components=["transformer"],
            optimize="cpu",
            fp16=True,
            progress=False,
        )
        return onnx.load(str(out / "transformer" / "model.onnx"))

    def without_rotary_embeddings(model: onnx.ModelProto) -> Dict[str, int]:
        return {
            "modulated_layer_norm": fuse_modulated_layer_norms(model),
            "gelu_bias": fuse_gelu_biases(model),
            "value_bias": fold_value_biases(model),
        }

    rewritten = export(tmp_path / "rotary")
    with monkeypatch.context() as patch:
        patch.setitem(components.GRAPH_REWRITES, "mmdit", without_rotary_embeddings)
        plain = export(tmp_path / "plain")
    assert [node.op_type for node in plain.graph.node].count("Neg") == 4
    assert [node.op_type for node in rewritten.graph.node].count("RotaryEmbedding") == 4
    assert "Neg" not in [node.op_type for node in rewritten.graph.node]
    inputs = random_inputs(plain)
    expected, actual = run(plain, inputs), run(rewritten, inputs)
    assert actual.dtype == np.float16
    expected, actual = expected.astype(np.float32), actual.astype(np.float32)
    np.testing.assert_allclose(actual, expected, rtol=1e-2, atol=5e-3 * np.abs(expected).max())


def test_the_default_optimized_export_carries_the_rewrites(tmp_path):
    out = export_pipeline(
        None,
        tmp_path / "flux",
        torch_pipeline=build_tiny_random_flux_pipeline(),
        components=["transformer"],
        optimize="cpu",
        fp16=True,
        progress=False,
    )
    model = onnx.load(str(out / "transformer" / "model.onnx"))
    assert unit_affine_norms(model) == 0
    assert all(len(node.input) == 2 for node in model.graph.node if node.op_type == "FastGelu")
    assert [node.op_type for node in model.graph.node].count("RotaryEmbedding") == 4


# ------------------------------------------------------------------------------- what is not the pattern stays
def layer_norm_graph(
    scale: np.ndarray, modulation_shape, shift_shape=None, second_reader: bool = False, input_shape=(2, 5, 4)
):
    """x (2, 5, 4) → LayerNormalization(scale, 0) → Mul(modulation) → Add(shift) → y, with the modulation and the
    shift graph inputs of the given shapes (and, with ``second_reader``, the norm's output read by an Identity too).
    Its epsilon is large, so that a fused norm that lost it would compute something else."""
    nodes = [
        helper.make_node("LayerNormalization", ["x", "scale", "zero"], ["normed"], axis=-1, epsilon=0.5),
        helper.make_node("Mul", ["normed", "modulation"], ["scaled"]),
        helper.make_node("Add", ["scaled", "shift"], ["y"]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if second_reader:
        nodes.append(helper.make_node("Identity", ["normed"], ["z"]))
        outputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, None))
    graph = helper.make_graph(
        nodes,
        "norm",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, list(input_shape)),
            helper.make_tensor_value_info("modulation", TensorProto.FLOAT, list(modulation_shape)),
            helper.make_tensor_value_info("shift", TensorProto.FLOAT, list(shift_shape or modulation_shape)),
        ],
        outputs,
        [
            numpy_helper.from_array(scale.astype(np.float32), "scale"),
            numpy_helper.from_array(np.zeros(4, np.float32), "zero"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def test_a_per_sample_modulation_of_a_unit_norm_is_fused_and_computes_the_same():
    model = layer_norm_graph(np.ones(4), (2, 1, 4))
    rng = np.random.default_rng(1)
    inputs = {
        "x": rng.standard_normal((2, 5, 4), np.float32),
        "modulation": rng.standard_normal((2, 1, 4), np.float32),
        "shift": rng.standard_normal((2, 1, 4), np.float32),
    }
    expected = run(model, inputs)
    assert fuse_modulated_layer_norms(model) == 1
    assert [node.op_type for node in model.graph.node] == ["LayerNormalization"]
    np.testing.assert_allclose(run(model, inputs), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "scale, modulation, shift, second_reader, input_shape",
    [
        (np.full(4, 2.0), (2, 1, 4), None, False, (2, 5, 4)),  # a learned scale: the norm's own affine would be lost
        (np.ones(4), (2, 5, 4), None, False, (2, 5, 4)),  # a per-token tensor, not a per-sample modulation
        (np.ones(4), (2, 1, 4), (2, 5, 4), False, (2, 5, 4)),  # a per-token shift
        (np.ones(4), (2, 1, 4), None, True, (2, 5, 4)),  # the plain norm is read elsewhere too
        (np.ones(4), (2, 1, 4), None, False, (1, 5, 4)),  # a modulation of more samples than the input has
    ],
    ids=["learned-scale", "per-token-modulation", "per-token-shift", "norm-read-elsewhere", "broadcast-batch"],
)
def test_what_is_not_an_adaln_modulation_is_left_alone(scale, modulation, shift, second_reader, input_shape):
    model = layer_norm_graph(scale, modulation, shift, second_reader, input_shape)
    before = model.SerializeToString()
    assert fuse_modulated_layer_norms(model) == 0
    assert model.SerializeToString() == before


def test_a_gelu_whose_input_is_read_elsewhere_keeps_its_bias_add():
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["projected"]),
        helper.make_node("Add", ["projected", "b"], ["biased"]),
        helper.make_node("FastGelu", ["biased"], ["y"], domain="com.microsoft"),
        helper.make_node("Identity", ["biased"], ["z"]),
    ]
    graph = helper.make_graph(
        nodes,
        "gelu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, None),
        ],
        [
            numpy_helper.from_array(np.ones((4, 6), np.float32), "w"),
            numpy_helper.from_array(np.ones(6, np.float32), "b"),
        ],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)], ir_version=10
    )
    assert fuse_gelu_biases(model) == 0
    assert [node.op_type for node in model.graph.node] == ["MatMul", "Add", "FastGelu", "Identity"]


def rotary_graph(layout: str = "bnsh", stacked: str = "-imaginary,real", table: str = "interleaved"):
    """q (1, 2 heads, 5 tokens, 8) in ``layout`` (``bnsh`` or ``bsnh``) → FLUX.1's rotary embedding as the export
    writes it → y, with the cos and sin of the graph input ``angles`` (5, 4): each column repeated twice in a row
    (``interleaved``, FLUX.1's tables) or the four columns twice side by side (``halves``); the rotation stacks
    ``stacked``'s two parts in that order."""
    heads, tokens, dim = 2, 5, 8
    shape = [1, heads, tokens, dim] if layout == "bnsh" else [1, tokens, heads, dim]
    int64 = lambda name, values: numpy_helper.from_array(np.array(values, np.int64), name)  # noqa: E731
    constants = [
        int64("zero", [0]),
        int64("one", [1]),
        int64("two", [2]),
        int64("last", [-1]),
        int64("end", [2**63 - 1]),
        int64("shape", shape),
        int64("broadcast", [0, 1] if layout == "bnsh" else [0, 2]),
    ]
    nodes = []
    for function in ("Cos", "Sin"):
        name = function.lower()
        nodes.append(helper.make_node(function, ["angles"], [f"{name}_half"]))
        if table == "interleaved":
            nodes += [helper.make_node("Unsqueeze", [f"{name}_half", "last"], [f"{name}_{side}"]) for side in "ab"]
            nodes += [
                helper.make_node("Concat", [f"{name}_a", f"{name}_b"], [f"{name}_pairs"], axis=-1),
                helper.make_node("Flatten", [f"{name}_pairs"], [f"{name}_table"], axis=1),
            ]
        else:
            nodes.append(helper.make_node("Concat", [f"{name}_half", f"{name}_half"], [f"{name}_table"], axis=-1))
        nodes.append(helper.make_node("Unsqueeze", [f"{name}_table", "broadcast"], [f"{name}_4d"]))
    nodes += [
        helper.make_node("Slice", ["q", "one", "end", "last", "two"], ["imaginary"]),
        helper.make_node("Neg", ["imaginary"], ["-imaginary"]),
        helper.make_node("Slice", ["q", "zero", "end", "last", "two"], ["real"]),
        helper.make_node("Unsqueeze", ["-imaginary", "last"], ["-imaginary_1"]),
        helper.make_node("Unsqueeze", ["real", "last"], ["real_1"]),
        helper.make_node("Concat", [f"{part}_1" for part in stacked.split(",")], ["stacked"], axis=-1),
        helper.make_node("Reshape", ["stacked", "shape"], ["rotated"]),
        helper.make_node("Mul", ["q", "cos_4d"], ["q_cos"]),
        helper.make_node("Mul", ["rotated", "sin_4d"], ["rotated_sin"]),
        helper.make_node("Add", ["q_cos", "rotated_sin"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "rotary",
        [
            helper.make_tensor_value_info("q", TensorProto.FLOAT, shape),
            helper.make_tensor_value_info("angles", TensorProto.FLOAT, [tokens, dim // 2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        constants,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


@pytest.mark.parametrize("layout", ["bnsh", "bsnh"])
def test_a_rotary_embedding_becomes_one_rotary_embedding_node_in_either_layout_and_computes_the_same(layout):
    model = rotary_graph(layout)
    rng = np.random.default_rng(2)
    inputs = {
        "q": rng.standard_normal([1, 2, 5, 8] if layout == "bnsh" else [1, 5, 2, 8], np.float32),
        "angles": rng.uniform(-4, 4, (5, 4)).astype(np.float32),
    }
    expected = run(model, inputs)
    assert fuse_rotary_embeddings(model) == 1
    # the keys' 4-D layout as it is; the queries' (batch, sequence, heads, head_dim) through the 3-D one and back
    rotation = ["RotaryEmbedding"] if layout == "bnsh" else ["Reshape", "RotaryEmbedding", "Reshape"]
    assert sorted(node.op_type for node in model.graph.node) == sorted(["Cos", "Sin", *rotation])
    np.testing.assert_allclose(run(model, inputs), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "stacked, table",
    [
        ("real,-imaginary", "interleaved"),  # the other rotation: (x₀, -x₁) pairs instead of (-x₁, x₀)
        ("-imaginary,real", "halves"),  # tables repeated half after half: not the pairs the Slices make
    ],
    ids=["other-rotation", "tables-in-halves"],
)
def test_what_is_not_fluxs_rotary_embedding_is_left_alone(stacked, table):
    model = rotary_graph("bnsh", stacked, table)
    before = model.SerializeToString()
    assert fuse_rotary_embeddings(model) == 0
    assert model.SerializeToString() == before


# --------------------------------------------------------------------------------- value biases, by hand-made graphs
def attention_graph(value_reader: bool = False, mlp_first: bool = False, shared_bias: bool = False):
    """One or two single-stream attentions, each ``x (1, 6, 8) → q, k = x W, v = x W_v + b_v →
    MultiHeadAttention(2 heads) → [Concat with an MLP branch x W_m (width 4) first, where ``mlp_first``] → MatMul(W_o)
    → Add(b_o)``. ``value_reader``: the value is a graph output too; ``shared_bias``: two such attentions whose
    output projections share one bias initializer."""
    rng = np.random.default_rng(3)
    initializers, nodes, outputs = [], [], []

    def weight(name, *shape):
        initializers.append(numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name))
        return name

    for block in range(2 if shared_bias else 1):
        p = f"b{block}_"
        nodes += [
            helper.make_node("MatMul", ["x", weight(p + "wq", 8, 8)], [p + "q"]),
            helper.make_node("MatMul", ["x", weight(p + "wk", 8, 8)], [p + "k"]),
            helper.make_node("MatMul", ["x", weight(p + "wv", 8, 8)], [p + "xv"]),
            helper.make_node("Add", [p + "xv", weight(p + "bv", 8)], [p + "v"]),
            helper.make_node(
                "MultiHeadAttention", [p + "q", p + "k", p + "v"], [p + "o"], domain="com.microsoft", num_heads=2
            ),
        ]
        attended = p + "o"
        if mlp_first:
            nodes += [
                helper.make_node("MatMul", ["x", weight(p + "wm", 8, 4)], [p + "m"]),
                helper.make_node("Concat", [p + "m", p + "o"], [p + "mo"], axis=-1),
            ]
            attended = p + "mo"
        bias = "bo" if shared_bias else weight(p + "bo", 8)
        nodes += [
            helper.make_node("MatMul", [attended, weight(p + "wo", 12 if mlp_first else 8, 8)], [p + "y0"]),
            helper.make_node("Add", [p + "y0", bias], [p + "y"]),
        ]
        outputs.append(helper.make_tensor_value_info(p + "y", TensorProto.FLOAT, None))
        if value_reader:
            outputs.append(helper.make_tensor_value_info(p + "v", TensorProto.FLOAT, None))
    if shared_bias:
        weight("bo", 8)
    graph = helper.make_graph(
        nodes, "attention", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6, 8])], outputs, initializers
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)], ir_version=10
    )


def run_all(model: onnx.ModelProto, inputs: Dict[str, np.ndarray]) -> list:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, inputs)


@pytest.mark.parametrize(
    "mlp_first, shared_bias",
    [(False, False), (True, False), (False, True)],
    ids=["alone", "after-the-mlp-in-a-concat", "output-bias-shared-by-two"],
)
def test_a_moved_value_bias_gives_the_same_outputs(mlp_first, shared_bias):
    model = attention_graph(mlp_first=mlp_first, shared_bias=shared_bias)
    inputs = {"x": np.random.default_rng(4).standard_normal((1, 6, 8)).astype(np.float32)}
    expected = run_all(model, inputs)
    assert fold_value_biases(model) == (2 if shared_bias else 1)
    assert not any(node.op_type == "Add" and node.output[0].endswith("_v") for node in model.graph.node)
    for got, want in zip(run_all(model, inputs), expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_value_read_by_more_than_its_attention_keeps_its_bias():
    model = attention_graph(value_reader=True)
    before = model.SerializeToString()
    assert fold_value_biases(model) == 0
    assert model.SerializeToString() == before


def test_the_rewritten_flux_transformers_compute_the_same_for_two_images_at_once(optimized):
    kind, model = optimized
    if not kind.startswith("flux"):
        pytest.skip("SD3's inputs are a batch of two already")
    rewritten = copy.deepcopy(model)
    fuse_diffusion_transformer(rewritten)
    inputs = random_inputs(model)
    for name in ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "guidance"):
        if name in inputs:
            inputs[name] = np.concatenate([inputs[name], -inputs[name][::-1]])
    expected, actual = run(model, inputs), run(rewritten, inputs)
    assert expected.shape[0] == 2
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())
