"""Float16 exports of the diffusion transformers (SD3, FLUX.1 dev) keep what diffusers computes in float32 in float32:
the sinusoidal timestep and guidance embeddings and FLUX.1's rotary cos/sin tables, up to the first layer with
weights, which runs in float16 like every block after it. Checked on the graph (element types) and numerically, the
island cut out of the exported model and run by ONNX Runtime on the CPU against diffusers' own functions."""

from __future__ import annotations

from typing import Dict, List, Sequence

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from diffusers.models.embeddings import get_timestep_embedding
from onnx.utils import Extractor

from optimum_iobinding.export import export_pipeline
from optimum_iobinding.export.tiny import build_tiny_random_flux_pipeline, build_tiny_random_sd3_pipeline

FLOAT, FLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
# ops that carry weights or attend: every one of them runs in float16 in a float16 export
WEIGHTED_OPS = ("MatMul", "Gemm", "Conv", "MultiHeadAttention")


def export_transformer(torch_pipe, folder, optimize):
    out = export_pipeline(
        None,
        folder,
        torch_pipeline=torch_pipe,
        fp16=True,
        optimize=optimize,
        components=["transformer"],
        progress=False,
    )
    return onnx.load(str(out / "transformer" / "model.onnx"))


@pytest.fixture(scope="module")
def sd3_pipe():
    return build_tiny_random_sd3_pipeline()


@pytest.fixture(scope="module")
def flux_dev_pipe():
    return build_tiny_random_flux_pipeline(guidance_embeds=True)


@pytest.fixture(scope="module", params=[None, "cpu"], ids=["exported", "ort-optimized"])
def sd3_fp16(request, sd3_pipe, tmp_path_factory):
    return export_transformer(sd3_pipe, tmp_path_factory.mktemp("sd3") / "fp16", request.param)


@pytest.fixture(scope="module", params=[None, "cpu"], ids=["exported", "ort-optimized"])
def flux_dev_fp16(request, flux_dev_pipe, tmp_path_factory):
    return export_transformer(flux_dev_pipe, tmp_path_factory.mktemp("flux") / "fp16", request.param)


def element_types(graph: onnx.GraphProto) -> Dict[str, int]:
    types = {value.name: value.type.tensor_type.elem_type for value in (*graph.input, *graph.value_info, *graph.output)}
    types.update({tensor.name: tensor.data_type for tensor in graph.initializer})
    return types


def input_types(model: onnx.ModelProto) -> Dict[str, int]:
    return {value.name: value.type.tensor_type.elem_type for value in model.graph.input}


def embedding_outputs(model: onnx.ModelProto, sources: Sequence[str]) -> List[str]:
    """The float values computed from the graph inputs ``sources`` and constants alone, without a layer, that a node
    computing from more reads: where the embeddings of ``sources`` end; before the converter's Cast to float16, if
    any (the value diffusers computes)."""
    graph = model.graph
    types = element_types(graph)
    producer = {output: node for node in graph.node for output in node.output}
    graph_inputs = {value.name for value in graph.input}
    behind: Dict[str, frozenset] = {}

    def inputs_behind(value: str) -> frozenset:  # the graph inputs a value is computed from
        if value not in behind:
            behind[value] = frozenset()  # no cycles in a graph; this only stops a recursion through one
            node = producer.get(value)
            if node is None:
                behind[value] = frozenset({value} & graph_inputs)
            elif node.op_type in WEIGHTED_OPS:  # the embedding ends at the first layer
                behind[value] = frozenset({"a layer's weights"})
            else:
                behind[value] = frozenset().union(*(inputs_behind(name) for name in node.input if name))
        return behind[value]

    def pure(value: str) -> bool:
        return bool(inputs_behind(value)) and inputs_behind(value) <= set(sources)

    ends: List[str] = []
    for node in graph.node:
        if node.output and pure(node.output[0]):
            continue
        for value in node.input:
            if value and pure(value) and types.get(value) in (FLOAT, FLOAT16):
                cast = producer.get(value)
                if (
                    cast is not None
                    and cast.op_type == "Cast"
                    and cast.attribute[0].i == FLOAT16
                    and types.get(cast.input[0]) == FLOAT
                ):
                    value = cast.input[0]
                if value not in ends:
                    ends.append(value)
    return ends


def run_island(model: onnx.ModelProto, inputs: Dict[str, np.ndarray], outputs: Sequence[str]) -> List[np.ndarray]:
    """The sub-graph from ``inputs`` to ``outputs``, cut out of ``model`` and run by ONNX Runtime on the CPU."""
    island = Extractor(model).extract_model(list(inputs), list(outputs))
    session = ort.InferenceSession(island.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, inputs)


# -------------------------------------------------------------------------------------------------- the graph
def test_in_a_float16_sd3_export_sin_and_cos_compute_in_float32_and_every_weighted_op_in_float16(sd3_fp16):
    graph = sd3_fp16.graph
    types = element_types(graph)
    sines = [node for node in graph.node if node.op_type in ("Sin", "Cos")]
    assert sines and all(types[node.input[0]] == FLOAT for node in sines)
    weighted = [node for node in graph.node if node.op_type in WEIGHTED_OPS]
    assert weighted and all(types[node.input[0]] == FLOAT16 for node in weighted)


def test_a_float16_sd3_export_takes_its_timestep_in_float32_as_diffusers_feeds_it(sd3_fp16):
    types = input_types(sd3_fp16)
    assert types["timestep"] == FLOAT
    assert types["hidden_states"] == types["encoder_hidden_states"] == types["pooled_projections"] == FLOAT16


def test_in_a_float16_flux_dev_export_the_embeddings_and_rotary_tables_compute_in_float32(flux_dev_fp16):
    graph = flux_dev_fp16.graph
    types = element_types(graph)
    sines = [node for node in graph.node if node.op_type in ("Sin", "Cos")]
    # the timestep's and the guidance's sin and cos, and the cos and sin of each of the three rotary axes
    assert len(sines) == 10 and all(types[node.input[0]] == FLOAT for node in sines)
    weighted = [node for node in graph.node if node.op_type in WEIGHTED_OPS]
    assert weighted and all(types[node.input[0]] == FLOAT16 for node in weighted)


def test_a_float16_flux_dev_export_takes_timestep_and_guidance_in_float16_as_diffusers_rounds_them(flux_dev_fp16):
    types = input_types(flux_dev_fp16)
    assert types["timestep"] == types["guidance"] == types["hidden_states"] == FLOAT16
    assert types["img_ids"] == types["txt_ids"] == onnx.TensorProto.INT64


def test_the_float32_island_is_a_handful_of_nodes_before_the_first_layer(sd3_fp16, flux_dev_fp16):
    for model in (sd3_fp16, flux_dev_fp16):
        written = [output for node in model.graph.node for output in node.output]
        assert len(written) == len(set(written))  # one node writes each value (the converter's casts deduplicated)
        types = element_types(model.graph)
        float32_nodes = [
            node
            for node in model.graph.node
            if node.op_type != "Constant" and any(types.get(output) == FLOAT for output in node.output)
        ]
        # SD3: one embedding; FLUX.1 dev: two embeddings and three rotary axes
        assert 0 < len(float32_nodes) <= 80 and len(float32_nodes) < len(model.graph.node) / 8


# ------------------------------------------------------------------------------------------------ the numbers
def test_the_sd3_timestep_embedding_of_a_float16_export_is_diffusers_float32_one(sd3_pipe, sd3_fp16):
    (embedding_name,) = embedding_outputs(sd3_fp16, ["timestep"])
    t = np.array([987.6, 3.3], dtype=np.float32)
    fed = t if input_types(sd3_fp16)["timestep"] == FLOAT else t.astype(np.float16)
    (embedding,) = run_island(sd3_fp16, {"timestep": fed}, [embedding_name])
    projection = sd3_pipe.transformer.time_text_embed.time_proj
    expected = get_timestep_embedding(
        torch.from_numpy(t),
        projection.num_channels,
        flip_sin_to_cos=projection.flip_sin_to_cos,
        downscale_freq_shift=projection.downscale_freq_shift,
        scale=projection.scale,
    )
    np.testing.assert_allclose(embedding.astype(np.float32), expected.numpy(), atol=1e-4)
    assert embedding.dtype == np.float32


def test_the_flux_rotary_tables_of_a_float16_export_are_diffusers_ones(flux_dev_pipe, flux_dev_fp16):
    tables = embedding_outputs(flux_dev_fp16, ["txt_ids", "img_ids"])
    assert tables
    txt_ids = np.zeros((3, 3), dtype=np.int64)
    rows, columns = np.meshgrid(np.arange(120, 124), np.arange(90, 93), indexing="ij")  # positions of a large image
    img_ids = np.stack([np.zeros_like(rows), rows, columns], axis=-1).reshape(-1, 3).astype(np.int64)
    got = run_island(flux_dev_fp16, {"txt_ids": txt_ids, "img_ids": img_ids}, tables)
    cos, sin = flux_dev_pipe.transformer.pos_embed(torch.from_numpy(np.concatenate([txt_ids, img_ids])))
    expected = [cos.float().numpy(), sin.float().numpy()]
    # ORT's RotaryEmbedding (the optimized graph's) takes each frequency once: the tables before their interleaved
    # repeat, every other column of diffusers' (S, D)
    expected += [table[:, ::2] for table in expected]
    # which output is which: the exporter names them; compare each with the closest of diffusers' tables
    matches = []
    for table in got:
        # the attention's layouts add axes of one (the attention of ORT's optimized graph, another layout)
        table = np.squeeze(table).astype(np.float32)
        errors = [
            np.abs(table - reference).max() if reference.shape == table.shape else np.inf for reference in expected
        ]
        assert min(errors) < 1e-4
        matches.append(int(np.argmin(errors)) % 2)
    assert all(table.dtype == np.float32 for table in got)
    assert sorted(set(matches)) == [0, 1]  # both tables, cos and sin


# ------------------------------------------------------------------------------------ options refused up front
UNFETCHABLE = "nobody/nothing-here"  # a hub id no download can provide (the Hub is unreachable in these tests)


@pytest.fixture
def offline_hub(monkeypatch):
    """The Hugging Face Hub cannot be reached: every download fails as huggingface_hub's own offline error."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def unreachable(repo_id, **kwargs):
        raise LocalEntryNotFoundError("the Hub cannot be reached from this test")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)


@pytest.mark.parametrize(
    "kind, family, option",
    [
        ("flux", "FLUX.1", "vae"),
        ("flux", "FLUX.1", "tiny_vae"),  # (FLUX.1 takes ControlNets)
        ("sd3", "Stable Diffusion 3", "vae"),
        ("sd3", "Stable Diffusion 3", "controlnet"),
        ("sd3", "Stable Diffusion 3", "tiny_vae"),
    ],
)
def test_a_tiny_random_transformer_export_refuses_a_vae_or_controlnet_by_name_before_fetching_it(
    tmp_path, offline_hub, option, kind, family
):
    with pytest.raises(ValueError, match=f"^{option}: expected none for a {family} pipeline .* got '{UNFETCHABLE}'$"):
        export_pipeline(None, tmp_path / "out", tiny_random=kind, progress=False, **{option: UNFETCHABLE})
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def sd3_folder(sd3_pipe, tmp_path_factory):
    """The tiny SD3 pipeline saved as a diffusers folder (what a hub id downloads to)."""
    folder = tmp_path_factory.mktemp("sd3-diffusers") / "sd3"
    sd3_pipe.save_pretrained(str(folder))
    return folder


@pytest.mark.parametrize("option", ["vae", "controlnet", "tiny_vae"])
def test_an_sd3_folder_export_refuses_a_vae_or_controlnet_before_it_loads_the_pipeline(
    sd3_folder, tmp_path, offline_hub, option
):
    def loader(name):
        raise AssertionError("the pipeline was loaded before the options were checked")

    with pytest.raises(ValueError, match=f"^{option}: expected none for a Stable Diffusion 3 pipeline"):
        export_pipeline(
            str(sd3_folder), tmp_path / "out", pipeline_loader=loader, progress=False, **{option: UNFETCHABLE}
        )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("optimize", [None, "cpu", "cuda"])
def test_the_transformers_output_dims_are_numbers_or_the_inputs_own_so_its_shape_is_known_before_the_run(
    sd3_pipe, flux_dev_pipe, tmp_path, optimize
):
    # a dim named by neither (ORT's fused graphs leave e.g. "Reshapeout_hidden_states_dim_1") makes the output's
    # shape unknown before the run, and the transformer then runs without a CUDA graph
    for kind, pipe in (("sd3", sd3_pipe), ("flux", flux_dev_pipe)):
        model = export_transformer(pipe, tmp_path / f"{kind}-{optimize}", optimize)
        input_dims = {dim.dim_param for value in model.graph.input for dim in value.type.tensor_type.shape.dim}
        (output,) = model.graph.output
        dims = [dim.dim_value or dim.dim_param for dim in output.type.tensor_type.shape.dim]
        assert all(isinstance(dim, int) or dim in input_dims for dim in dims), (kind, dims)
