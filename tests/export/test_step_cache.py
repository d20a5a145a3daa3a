"""First-Block Cache's parts of a diffusion transformer (export_pipeline(step_cache=True)): the transformer's
folder holds head, body and out graphs beside model.onnx that read its weights file, run in turn they compute what
model.onnx computes, and the head's marked values are diffusers' first block's input and output."""

from __future__ import annotations

from pathlib import Path
from typing import Dict

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx.external_data_helper import uses_external_data

from optimum_iobinding.errors import ArgumentError
from optimum_iobinding.export import export_pipeline
from optimum_iobinding.export.step_cache import STEP_CACHE_PARTS, split_graph
from optimum_iobinding.layout import FIRST_BLOCK_MARKS
from optimum_iobinding.export.tiny import build_tiny_random_flux_pipeline, build_tiny_random_sd3_pipeline

PARTS = [name for name, _ in STEP_CACHE_PARTS]


def flux_inputs() -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = np.stack(np.meshgrid(np.arange(4), np.arange(4), indexing="ij"), -1).reshape(-1, 2)
    return {
        "hidden_states": rng.standard_normal((2, 16, 64)),
        "encoder_hidden_states": rng.standard_normal((2, 7, 32)),
        "pooled_projections": rng.standard_normal((2, 32)),
        "timestep": np.array([0.7, 0.7]),
        "txt_ids": np.zeros((7, 3), np.int64),
        "img_ids": np.concatenate([np.zeros((16, 1)), ids], 1),
    }


def sd3_inputs() -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "hidden_states": rng.standard_normal((2, 16, 8, 8)),
        "encoder_hidden_states": rng.standard_normal((2, 7, 64)),
        "pooled_projections": rng.standard_normal((2, 64)),
        "timestep": np.array([700.0, 700.0]),
    }


FAMILIES = {"flux": (build_tiny_random_flux_pipeline, flux_inputs), "sd3": (build_tiny_random_sd3_pipeline, sd3_inputs)}


@pytest.fixture(
    scope="module",
    params=[(family, fp16) for family in FAMILIES for fp16 in (False, True)],
    ids=lambda param: f"{param[0]}-{'fp16' if param[1] else 'fp32'}",
)
def exported(request, tmp_path_factory):
    """(family, the torch pipeline, its transformer's folder of a step-cache export optimized for the CPU)."""
    family, fp16 = request.param
    torch_pipe = FAMILIES[family][0]()
    out = export_pipeline(
        None,
        tmp_path_factory.mktemp(family) / "out",
        torch_pipeline=torch_pipe,
        fp16=fp16,
        optimize="cpu",
        components=["transformer"],
        progress=False,
        step_cache=True,
    )
    return family, torch_pipe, out / "transformer"


def feed(session: ort.InferenceSession, values: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    types = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64}
    return {value.name: values[value.name].astype(types[value.type]) for value in session.get_inputs()}


def run_parts(folder: Path, inputs: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """The parts in turn, each fed from the inputs and the earlier parts' outputs: every value they computed."""
    values = dict(inputs)
    for name in PARTS:
        session = ort.InferenceSession(str(folder / name), providers=["CPUExecutionProvider"])
        results = session.run(None, feed(session, values))
        values.update({value.name: result for value, result in zip(session.get_outputs(), results)})
    return values


def test_the_parts_run_in_turn_compute_what_the_whole_transformer_computes(exported):
    family, _, folder = exported
    inputs = FAMILIES[family][1]()
    whole = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    (expected,) = whole.run(None, feed(whole, inputs))
    values = run_parts(folder, inputs)
    if expected.dtype == np.float16:  # ORT's session fuses across a cut in the whole graph: float16 rounds there
        np.testing.assert_allclose(
            values["out_hidden_states"].astype(np.float32),
            expected.astype(np.float32),
            atol=1e-2 * float(np.abs(expected).max()),
        )
    else:
        np.testing.assert_array_equal(values["out_hidden_states"], expected)


def test_the_parts_read_the_transformers_weights_file_and_model_onnx_keeps_its_own_outputs(exported):
    _, _, folder = exported
    whole = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    assert [value.name for value in whole.graph.output] == ["out_hidden_states"]
    weights = {tensor.name for tensor in whole.graph.initializer if uses_external_data(tensor)}
    assert weights and (folder / "model.onnx_data").is_file()
    covered = set()
    for name in PARTS:
        part = onnx.load(str(folder / name), load_external_data=False)
        external = [tensor for tensor in part.graph.initializer if uses_external_data(tensor)]
        assert {entry.value for tensor in external for entry in tensor.external_data if entry.key == "location"} == {
            "model.onnx_data"
        }
        covered |= {tensor.name for tensor in external}
        # the graph alone: no weight is copied into a part's file
        assert (folder / name).stat().st_size < (folder / "model.onnx").stat().st_size
    assert covered == weights  # each weight read by some part, none left out


def test_the_out_part_reads_of_the_body_only_the_blocks_output_so_a_cached_step_can_skip_it(exported):
    _, _, folder = exported
    names = {name: onnx.load(str(folder / name), load_external_data=False).graph for name in PARTS}
    whole = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    head_outputs = {value.name for value in names["head.onnx"].output}
    graph_inputs = {value.name for value in whole.input}
    assert [value.name for value in names["body.onnx"].output] == ["blocks_output"]
    assert {value.name for value in names["out.onnx"].input} <= graph_inputs | head_outputs | {"blocks_output"}
    assert {value.name for value in names["body.onnx"].input} <= graph_inputs | head_outputs


@pytest.mark.parametrize("kind", ["sd", "flux"])
def test_a_step_cache_exports_model_onnx_has_the_plain_exports_operators(tmp_path, kind):
    """The marks are graph outputs while ORT's optimizer runs, and could keep a fusion from happening: the fused fp16
    ``model.onnx`` of a step-cache export must be the plain export's graph, so that caching costs nothing uncached."""
    import collections

    component = "unet" if kind == "sd" else "transformer"
    counts = []
    for step_cache in (False, True):
        source = dict(tiny_random="sd") if kind == "sd" else dict(torch_pipeline=build_tiny_random_flux_pipeline())
        out = export_pipeline(
            None,
            tmp_path / str(step_cache),
            fp16=True,
            optimize="cuda",
            components=[component],
            progress=False,
            step_cache=step_cache,
            **source,
        )
        graph = onnx.load(str(out / component / "model.onnx"), load_external_data=False).graph
        counts.append(collections.Counter(node.op_type for node in graph.node))
    assert counts[0] == counts[1] and sum(counts[0].values()) > 100


def test_the_heads_marks_are_diffusers_first_blocks_input_and_outputs(exported):
    family, torch_pipe, folder = exported
    caught = {}
    transformer = torch_pipe.transformer
    first = transformer.transformer_blocks[0]
    handles = [
        first.register_forward_pre_hook(lambda m, a, k: caught.update(input=k["hidden_states"]), with_kwargs=True),
        first.register_forward_hook(lambda m, a, output: caught.update(output=output)),
    ]
    inputs = FAMILIES[family][1]()
    try:
        with torch.no_grad():
            arguments = {
                name: torch.from_numpy(np.asarray(value, np.float32 if value.dtype != np.int64 else np.int64))
                for name, value in inputs.items()
            }
            transformer(**arguments, return_dict=False)
    finally:
        for handle in handles:
            handle.remove()
    values = run_parts(folder, inputs)
    encoder_hidden_states, hidden_states = caught["output"]
    tolerance = 3e-2 if values["first_block_input"].dtype == np.float16 else 1e-4
    for mark, expected in zip(FIRST_BLOCK_MARKS[:3], (caught["input"], hidden_states, encoder_hidden_states)):
        got = values[mark].astype(np.float32)
        np.testing.assert_allclose(
            got, expected.numpy(), atol=tolerance * max(1.0, float(expected.abs().max())), err_msg=mark
        )


def test_an_export_without_step_cache_writes_no_parts(tmp_path):
    out = export_pipeline(
        None,
        tmp_path / "out",
        torch_pipeline=build_tiny_random_flux_pipeline(),
        components=["transformer"],
        progress=False,
    )
    assert not [name for name in PARTS if (out / "transformer" / name).exists()]


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(tiny_random="controlnet", step_cache=True), "step_cache: expected an SD3, FLUX.1 or Wan pipeline"),
        (dict(tiny_random="flux", step_cache="yes"), "step_cache: expected True or False, got 'yes'"),
    ],
    ids=["controlnet-pipeline", "not-a-bool"],
)
def test_step_cache_is_refused_by_name_before_any_export(tmp_path, arguments, message):
    with pytest.raises(ArgumentError, match=message):
        export_pipeline(None, tmp_path / "out", progress=False, **arguments)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_transformer_of_one_block_is_refused_before_any_export(tmp_path):
    torch_pipe = build_tiny_random_sd3_pipeline()
    torch_pipe.transformer.transformer_blocks = torch_pipe.transformer.transformer_blocks[:1]
    with pytest.raises(
        ArgumentError,
        match=r"step_cache: expected a transformer of at least 2 blocks \(First-Block "
        r"Cache runs the first and skips the others\), got 1",
    ):
        export_pipeline(None, tmp_path / "out", torch_pipeline=torch_pipe, progress=False, step_cache=True)
    assert not (tmp_path / "out").exists()


def test_a_cut_that_names_no_value_of_the_graph_is_refused_by_name(exported):
    _, _, folder = exported
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    with pytest.raises(ArgumentError, match=r"cuts: expected values the graph computes, got \['nowhere'\]"):
        split_graph(model, [["nowhere"], None])
