"""DeepCache's parts of a UNet (export_pipeline(step_cache=True) on the SD 1.x/2.x, SDXL and LCM families): the UNet's
folder holds a full graph with every branch's feature as an extra output and a shallow graph per branch beside an
unchanged model.onnx, all reading its weights file; over the full part's feature a shallow part computes what the
``DeepCache`` package's helper computes on a shallow step, and on the full step's own inputs what the whole UNet
computes."""

from __future__ import annotations

from pathlib import Path
from typing import Dict

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from DeepCache import DeepCacheSDHelper
from onnx.external_data_helper import uses_external_data

from optimum_iobinding import IOBindingORTModel, infer_output_shapes
from optimum_iobinding.errors import ArgumentError
from optimum_iobinding.export import export_pipeline
from optimum_iobinding.export.deep_cache import WEIGHTS_FILE, shallow_graph
from optimum_iobinding.export.tiny import build_tiny_random_pipeline, build_tiny_random_xl_pipeline
from optimum_iobinding.layout import DEEP_CACHE_FULL_PART, DEEP_CACHE_SHALLOW_PART

BUILDERS = {"sd": build_tiny_random_pipeline, "xl": build_tiny_random_xl_pipeline}
# (family, optimize, fp16): the unfused fp32 exports are the pipeline tests' (shared); ORT's CPU fusions in fp32 and
# fp16; SDXL (its conditioning inputs)
VARIANTS = [("sd", None, False), ("sd", "cpu", False), ("sd", "cpu", True), ("xl", None, False)]
BRANCHES = range(6)  # the tiny UNets have two down blocks: branches 0 … 5


def shared_deep_cache_export(shared_export, family: str = "sd") -> Path:
    """The tiny random ``family`` pipeline's export with DeepCache's parts (unfused fp32), shared with the pipeline
    tests."""
    return shared_export(
        f"{family}-deep-cache",
        lambda target: export_pipeline(None, target, tiny_random=family, step_cache=True, progress=False),
    )


@pytest.fixture(scope="module")
def sd_folder(shared_export):
    return shared_deep_cache_export(shared_export)


@pytest.fixture(
    scope="module", params=VARIANTS, ids=lambda v: f"{v[0]}-{v[1] or 'unfused'}-{'fp16' if v[2] else 'fp32'}"
)
def exported(request, shared_export):
    """(family, the torch pipeline, its UNet's folder of a step-cache export)."""
    family, optimize, fp16 = request.param
    if optimize is None and not fp16:
        folder = shared_deep_cache_export(shared_export, family)
    else:  # made once per run, whichever test process asks first
        folder = shared_export(
            f"{family}-deep-cache-unet-{optimize}-{'fp16' if fp16 else 'fp32'}",
            lambda target: export_pipeline(
                None,
                target,
                tiny_random=family,
                optimize=optimize,
                fp16=fp16,
                components=["unet"],
                progress=False,
                step_cache=True,
            ),
        )
    return family, BUILDERS[family](), folder / "unet"


def unet_inputs(family: str, seed: int) -> Dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    inputs = {"sample": torch.randn(2, 4, 8, 8, generator=generator)}
    if family == "xl":
        inputs.update(
            encoder_hidden_states=torch.randn(2, 77, 64, generator=generator),
            text_embeds=torch.randn(2, 32, generator=generator),
            time_ids=torch.tensor([[64.0, 64.0, 0.0, 0.0, 64.0, 64.0]] * 2),
        )
    else:
        inputs["encoder_hidden_states"] = torch.randn(2, 77, 32, generator=generator)
    return inputs


def torch_unet(torch_pipe, inputs: Dict[str, torch.Tensor], timestep: torch.Tensor) -> torch.Tensor:
    added = {key: inputs[key] for key in ("text_embeds", "time_ids") if key in inputs} or None
    with torch.no_grad():
        return torch_pipe.unet(
            inputs["sample"], timestep, encoder_hidden_states=inputs["encoder_hidden_states"], added_cond_kwargs=added
        ).sample


def session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def run(model: ort.InferenceSession, values: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    types = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
    feed = {value.name: np.asarray(values[value.name]).astype(types[value.type]) for value in model.get_inputs()}
    return dict(zip([value.name for value in model.get_outputs()], model.run(None, feed)))


def as_arrays(inputs: Dict[str, torch.Tensor], timestep: torch.Tensor) -> Dict[str, np.ndarray]:
    return {**{name: value.numpy() for name, value in inputs.items()}, "timestep": timestep.reshape(1).numpy()}


def feature_of(shallow: ort.InferenceSession, model: ort.InferenceSession) -> str:
    (feature,) = {value.name for value in shallow.get_inputs()} - {value.name for value in model.get_inputs()}
    return feature


def test_over_the_full_steps_feature_each_shallow_part_computes_the_deepcache_helpers_shallow_step(exported):
    family, torch_pipe, folder = exported
    scheduler = torch_pipe.scheduler
    scheduler.set_timesteps(4)
    first, second = scheduler.timesteps[0], scheduler.timesteps[1]
    full_inputs, shallow_inputs = unet_inputs(family, 0), unet_inputs(family, 1)
    model, full = session(folder / "model.onnx"), session(folder / DEEP_CACHE_FULL_PART)
    computed = run(full, as_arrays(full_inputs, first))
    for branch in BRANCHES:
        helper = DeepCacheSDHelper(pipe=torch_pipe)
        helper.set_params(cache_interval=3, cache_branch_id=branch)
        helper.enable()
        try:
            torch_unet(torch_pipe, full_inputs, first)  # the full step, which the helper caches
            expected = torch_unet(torch_pipe, shallow_inputs, second).numpy()
        finally:
            helper.disable()
        shallow = session(folder / DEEP_CACHE_SHALLOW_PART.format(branch=branch))
        feature = feature_of(shallow, model)
        got = run(shallow, {**as_arrays(shallow_inputs, second), feature: computed[feature]})["out_sample"]
        tolerance = 3e-2 if got.dtype == np.float16 else 1e-4
        np.testing.assert_allclose(
            got.astype(np.float32), expected, atol=tolerance * float(np.abs(expected).max()), err_msg=f"branch {branch}"
        )


def test_on_the_full_steps_own_inputs_the_parts_compute_the_whole_unet(exported):
    family, torch_pipe, folder = exported
    torch_pipe.scheduler.set_timesteps(4)
    values = as_arrays(unet_inputs(family, 2), torch_pipe.scheduler.timesteps[1])
    model, full = session(folder / "model.onnx"), session(folder / DEEP_CACHE_FULL_PART)
    (expected,) = model.run(
        None,
        {
            value.name: values[value.name].astype(np.float16 if "16" in value.type else np.float32)
            for value in model.get_inputs()
        },
    )
    computed = run(full, values)
    tolerance = 1e-2 if expected.dtype == np.float16 else 1e-5
    scale = tolerance * float(np.abs(expected.astype(np.float32)).max())
    np.testing.assert_allclose(computed["out_sample"].astype(np.float32), expected.astype(np.float32), atol=scale)
    for branch in BRANCHES:
        shallow = session(folder / DEEP_CACHE_SHALLOW_PART.format(branch=branch))
        feature = feature_of(shallow, model)
        got = run(shallow, {**values, feature: computed[feature]})["out_sample"]
        np.testing.assert_allclose(
            got.astype(np.float32), expected.astype(np.float32), atol=scale, err_msg=f"branch {branch}"
        )


def test_model_onnx_keeps_the_unets_outputs_and_every_part_reads_its_one_weights_file(exported):
    _, _, folder = exported
    whole = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    assert [value.name for value in whole.graph.output] == ["out_sample"]
    weights = {tensor.name for tensor in whole.graph.initializer if uses_external_data(tensor)}
    assert weights and (folder / WEIGHTS_FILE).is_file() and not (folder / "weights.pb").exists()
    parts = [DEEP_CACHE_FULL_PART, *(DEEP_CACHE_SHALLOW_PART.format(branch=branch) for branch in BRANCHES)]
    assert sorted(path.name for path in folder.glob("*.onnx")) == sorted(["model.onnx", *parts])
    for name in parts:
        part = onnx.load(str(folder / name), load_external_data=False)
        external = [tensor for tensor in part.graph.initializer if uses_external_data(tensor)]
        assert {entry.value for tensor in external for entry in tensor.external_data if entry.key == "location"} == {
            WEIGHTS_FILE
        }, name
        assert {tensor.name for tensor in external} <= weights
        # the graph alone: no weight is copied into a part's file
        assert (folder / name).stat().st_size < (folder / WEIGHTS_FILE).stat().st_size
    full = onnx.load(str(folder / DEEP_CACHE_FULL_PART), load_external_data=False)
    assert {tensor.name for tensor in full.graph.initializer if uses_external_data(tensor)} == weights


def test_model_onnx_computes_what_the_plain_export_computes(tiny_folder, sd_folder):
    folder = sd_folder
    values = {name: value.numpy() for name, value in unet_inputs("sd", 3).items()}
    values["timestep"] = np.array([501.0], np.float32)
    (expected,) = session(tiny_folder / "unet" / "model.onnx").run(None, values)
    (got,) = session(folder / "unet" / "model.onnx").run(None, values)
    np.testing.assert_allclose(got, expected, atol=1e-6)


def test_the_shallow_parts_leave_the_deep_blocks_out(sd_folder):
    def nodes(name):
        return list(onnx.load(str(sd_folder / "unet" / name), load_external_data=False).graph.node)

    shallow = {branch: nodes(DEEP_CACHE_SHALLOW_PART.format(branch=branch)) for branch in BRANCHES}
    assert any("/mid_block/" in node.name for node in nodes(DEEP_CACHE_FULL_PART))
    assert not [node.name for part in shallow.values() for node in part if "/mid_block/" in node.name]
    # branch 0 runs no layer of a down block (the time embedding, which the exporter names after the first resnet that
    # computes it, is shared) and only the last up block
    assert not [
        node.name
        for node in shallow[0]
        if "/down_blocks.1/" in node.name
        or "/up_blocks.0/" in node.name
        or ("/down_blocks.0/" in node.name and node.op_type == "Conv")
    ]
    assert [len(shallow[branch]) for branch in BRANCHES] == sorted(len(shallow[branch]) for branch in BRANCHES)


def test_each_feature_is_sized_before_a_run(sd_folder):
    folder = sd_folder
    full = IOBindingORTModel(folder / "unet" / DEEP_CACHE_FULL_PART)
    shapes = infer_output_shapes(
        full, {"sample": (2, 4, 16, 24), "timestep": (1,), "encoder_hidden_states": (2, 77, 32)}
    )
    # the last up block (32 channels at the sample's size) and the first (64 at half of it)
    assert shapes == {
        "out_sample": (2, 4, 16, 24),
        "deep_features.up_blocks.1.resnets.1": (2, 32, 16, 24),
        "deep_features.up_blocks.1.resnets.0": (2, 64, 16, 24),
        "deep_features.up_blocks.0.resnets.1": (2, 64, 8, 12),
        "deep_features.up_blocks.0.resnets.0": (2, 64, 8, 12),
    }


def test_an_export_without_step_cache_writes_no_parts(tiny_folder):
    assert not list((tiny_folder / "unet").glob("deep_cache_*"))


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(tiny_random="controlnet"), "got a ControlNet pipeline"),
        (dict(tiny_random="sd", controlnet=["lllyasviel/sd-controlnet-canny"]), "got a ControlNet pipeline"),
        (dict(tiny_vae=True), "got a VAE alone"),
    ],
    ids=["controlnet-pipeline", "controlnet-argument", "vae-alone"],
)
def test_step_cache_is_refused_by_name_before_any_export(tmp_path, arguments, message):
    with pytest.raises(
        ArgumentError,
        match=r"step_cache: expected an SD3, FLUX.1 or Wan pipeline \(First-Block Cache's "
        r"parts\) or a Stable Diffusion 1.x/2.x, SDXL or LCM pipeline without a "
        r"ControlNet \(DeepCache's parts\), " + message,
    ):
        export_pipeline(None, tmp_path / "out", progress=False, step_cache=True, **arguments)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_unet_of_blocks_deepcache_does_not_number_is_refused_by_name(tmp_path):
    from diffusers import UNet2DConditionModel

    torch_pipe = build_tiny_random_pipeline()
    torch_pipe.unet = UNet2DConditionModel(
        **{**torch_pipe.unet.config, "up_block_types": ("AttnUpBlock2D", "UpBlock2D")}
    )
    with pytest.raises(
        ArgumentError,
        match=r"step_cache: expected a UNet of .* got down blocks \['DownBlock2D', "
        r"'CrossAttnDownBlock2D'\] and up blocks \['AttnUpBlock2D', 'UpBlock2D'\]",
    ):
        export_pipeline(None, tmp_path / "out", torch_pipeline=torch_pipe, progress=False, step_cache=True)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_feature_that_is_no_output_of_the_graph_is_refused_by_name(sd_folder):
    folder = sd_folder
    model = onnx.load(str(folder / "unet" / DEEP_CACHE_FULL_PART), load_external_data=False)
    with pytest.raises(ArgumentError, match=r"feature: expected one of the graph's outputs .* got 'nowhere'"):
        shallow_graph(model, "nowhere", ["out_sample"])
