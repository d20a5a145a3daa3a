"""FLUX.1 with ControlNets (``OnnxFluxControlNetPipeline``) on the tiny random FLUX.1 ControlNet pipelines, CPU
execution provider: images equal to diffusers' torch ``FluxControlNetPipeline`` on the same weights with one
ControlNet and with two (an InstantX-style one and a union one, each with its scale, guidance window and mode), with
true CFG, and with an XLabs-style ControlNet (pixels in, its samples repeated over the transformer's blocks); the
arguments it refuses by name before any component runs; its folder detected by model_index.json's class name and by
its transformer's inputs. The behaviour contract: test_contract.py; generate: tests/test_controlnet_commands.py."""

from __future__ import annotations

import json
import shutil

import numpy as np
import PIL.Image
import pytest
import torch

from optimum_iobinding import OnnxFluxControlNetPipeline, OnnxFluxPipeline
from optimum_iobinding.errors import ArgumentError
from optimum_iobinding.families import detect, family
from optimum_iobinding.pipelines.auto import denoiser_inputs, pipeline_class_for

PROMPTS = ["a photo of an astronaut riding a horse", "a red castle in the forest"]
HEIGHT, WIDTH = 64, 48  # 4 × 3 tokens: not square, so rows and columns cannot be swapped
CALL = dict(height=HEIGHT, width=WIDTH, num_inference_steps=2, max_sequence_length=16, output_type="np")
TOLERANCE = 1e-4  # fp32 ONNX Runtime vs fp32 torch on the CPU: rounding only


def seeded(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def picture(seed: int = 0, height: int = HEIGHT, width: int = WIDTH) -> PIL.Image.Image:
    pixels = np.random.default_rng(seed).random((height, width, 3))
    return PIL.Image.fromarray((pixels * 255).astype(np.uint8))


def run(pipe, **kwargs) -> np.ndarray:
    return pipe(**{"prompt": PROMPTS[0], **CALL, **kwargs}, generator=seeded()).images


def without_second_controlnet(two, target) -> None:
    """The folder of the pipeline with its first ControlNet only (the transformer takes the same samples)."""
    shutil.copytree(two, target, ignore=lambda folder, names: ["controlnet_1"] if "controlnet_1" in names else [])
    index = json.loads((target / "model_index.json").read_text())
    index.pop("controlnet_1")
    (target / "model_index.json").write_text(json.dumps(index))


@pytest.fixture(scope="module")
def flux(shared_export, vae_encodes_its_mode):
    """Diffusers' torch pipelines (their VAE encoder giving the mode, as the export's does) with the first ControlNet
    ("one"), with it and a union one ("two"), and with an XLabs-style one ("xlabs"), and their exports (the builder
    is seeded: the same weights in every module)."""
    from diffusers import FluxControlNetPipeline

    from optimum_iobinding.export import export_pipeline
    from optimum_iobinding.export.tiny import (
        build_tiny_random_flux_controlnet,
        build_tiny_random_flux_controlnet_pipeline,
    )

    two = vae_encodes_its_mode(build_tiny_random_flux_controlnet_pipeline(controlnets=("plain", "union")))
    components = two.components
    xlabs_net = build_tiny_random_flux_controlnet(two.transformer, seed=20, kind="xlabs")
    pipes = {
        "one": FluxControlNetPipeline(**{**components, "controlnet": two.controlnet.nets[0]}),
        "two": two,
        "xlabs": FluxControlNetPipeline(**{**components, "controlnet": xlabs_net}),
    }
    folders = {
        name: shared_export(
            f"flux-controlnet-{name}", lambda t, pipe=pipes[name]: export_pipeline(None, t, torch_pipeline=pipe)
        )
        for name in ("two", "xlabs")
    }
    folders["one"] = shared_export("flux-controlnet-one", lambda t: without_second_controlnet(folders["two"], t))
    for pipe in pipes.values():
        pipe.set_progress_bar_config(disable=True)
    return pipes, folders


def load(folder, **options) -> OnnxFluxControlNetPipeline:
    pipe = OnnxFluxControlNetPipeline.from_pretrained(folder, **options)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def ours(flux):
    """Our pipelines of the folders, loaded once."""
    return {name: load(folder) for name, folder in flux[1].items()}


# ------------------------------------------------------------------------------------------------ equal images
@pytest.mark.parametrize(
    "kwargs",
    [
        # the second step only, at its scale, and the packed latents (the loop's, before the VAE)
        {"controlnet_conditioning_scale": 0.8, "control_guidance_start": 0.5, "output_type": "latent"},
        {"negative_prompt": "a blue sky", "true_cfg_scale": 2.5},
        {"prompt": PROMPTS, "num_images_per_prompt": 2, "control_image": [picture(1), picture(2)]},
    ],
    ids=["scale-window-latents", "true-cfg", "batch"],
)
def test_one_controlnet_gives_diffusers_images(flux, ours, kwargs):
    arguments = {"control_image": picture(), **kwargs}
    got, expected = run(ours["one"], **arguments), run(flux[0]["one"], **arguments)
    if isinstance(got, torch.Tensor):
        got, expected = got.numpy(), expected.numpy()
    np.testing.assert_allclose(got, expected, atol=TOLERANCE)


def test_the_controlnet_matters_and_a_scale_of_zero_is_fluxs_own_image(flux, ours):
    from diffusers import FluxPipeline

    accepted = set(FluxPipeline._get_signature_keys(FluxPipeline)[0])
    plain = FluxPipeline(**{k: v for k, v in flux[0]["one"].components.items() if k in accepted})
    plain.set_progress_bar_config(disable=True)
    unguided = run(ours["one"], control_image=picture(), controlnet_conditioning_scale=0.0, guidance_scale=3.5)
    np.testing.assert_allclose(unguided, run(plain, guidance_scale=3.5), atol=TOLERANCE)
    assert np.abs(unguided - run(ours["one"], control_image=picture(), guidance_scale=3.5)).max() > 1e-2


@pytest.mark.parametrize("io_binding", [True, False])
def test_two_controlnets_each_with_its_scale_window_and_mode_give_diffusers_images(flux, ours, io_binding):
    arguments = dict(
        control_image=[picture(3), picture(4)],
        controlnet_conditioning_scale=[0.7, 1.2],
        control_guidance_start=[0.0, 0.5],  # the first ControlNet at the first step, the second at the second
        control_guidance_end=[0.5, 1.0],
        control_mode=[None, 2],
    )
    pipe = ours["two"] if io_binding else load(flux[1]["two"], io_binding=False)
    got = run(pipe, **arguments)
    np.testing.assert_allclose(got, run(flux[0]["two"], **arguments), atol=TOLERANCE)
    assert np.abs(got - run(pipe, **{**arguments, "control_mode": [None, 0]})).max() > 1e-3  # the mode matters


def test_two_controlnets_at_every_step_with_true_cfg_give_diffusers_images(flux, ours):
    arguments = dict(
        control_image=[picture(3), picture(4)],
        controlnet_conditioning_scale=[0.7, 1.2],
        control_mode=[None, 1],
        negative_prompt="a blue sky",
        true_cfg_scale=2.5,
        num_inference_steps=3,
    )
    pipe = ours["two"]
    with pipe.transformer.watch_runs() as runs:
        got = run(pipe, **arguments)
    np.testing.assert_allclose(got, run(flux[0]["two"], **arguments), atol=TOLERANCE)
    samples = [name for name in runs[0].inputs if name.startswith("controlnet_")]
    assert samples and len(runs) == 3  # one transformer call a step: both prompts' rows in one batch
    # the summed, doubled samples the transformer reads are at the same addresses at every step
    assert all(record.inputs[name] == runs[0].inputs[name] for record in runs for name in samples)


@pytest.fixture(scope="module")
def union(flux, shared_export):
    """A folder of the union ControlNet alone, and diffusers' pipeline of it as ``FluxMultiControlNetModel([union])``
    (one union model run once per condition)."""
    from diffusers import FluxControlNetPipeline
    from diffusers.models import FluxMultiControlNetModel

    from optimum_iobinding.export import export_pipeline

    two = flux[0]["two"]
    net = two.controlnet.nets[1]
    alone = FluxControlNetPipeline(**{**two.components, "controlnet": net})
    folder = shared_export("flux-controlnet-union", lambda t: export_pipeline(None, t, torch_pipeline=alone))
    multi = FluxControlNetPipeline(**{**two.components, "controlnet": FluxMultiControlNetModel([net])})
    multi.set_progress_bar_config(disable=True)
    return multi, load(folder)


def test_one_union_controlnet_with_a_mode_per_condition_gives_diffusers_images(union):
    theirs, pipe = union
    arguments = dict(
        control_image=[picture(3), picture(4)],
        control_mode=[0, 2],
        controlnet_conditioning_scale=[0.7, 1.2],
        # as lists: diffusers runs as many conditions as it has windows (a single start and end run the first alone)
        control_guidance_start=[0.0, 0.0],
        control_guidance_end=[1.0, 1.0],
    )
    got = run(pipe, **arguments)
    np.testing.assert_allclose(got, run(theirs, **arguments), atol=TOLERANCE)
    first_alone = run(pipe, control_image=picture(3), control_mode=0, controlnet_conditioning_scale=0.7)
    assert np.abs(got - first_alone).max() > 1e-3  # the second condition matters
    with pytest.raises(
        ValueError,
        match=r"control_image: expected a list of 2 control images \(one per ControlNet, or per condition of a union one\)",
    ):
        run(pipe, control_image=picture(3), control_mode=[0, 2])


def test_an_xlabs_controlnet_takes_pixels_and_gives_diffusers_image(flux, ours):
    arguments = dict(control_image=picture(5), controlnet_conditioning_scale=0.9)
    np.testing.assert_allclose(run(ours["xlabs"], **arguments), run(flux[0]["xlabs"], **arguments), atol=TOLERANCE)


# ------------------------------------------------------------------------------------------------------ refusals
REFUSALS = [
    ("one", {"control_image": None}, "control_image: expected a control image"),
    ("one", {"control_image": torch.zeros(1, 3, 32, 32)}, r"control_image: expected a tensor of shape \(rows, 3, 64"),
    ("one", {"control_image": [picture()] * 3, "prompt": PROMPTS}, "control_image: expected 1 or 2 images"),
    ("one", {"control_image": np.zeros((3, HEIGHT, WIDTH, 3)), "prompt": PROMPTS}, "control_image: expected 1 or 2"),
    ("one", {"controlnet_conditioning_scale": [1.0, 0.5]}, "controlnet_conditioning_scale: expected 1 values"),
    ("one", {"control_guidance_start": 0.8, "control_guidance_end": 0.2}, "control_guidance_start: expected each"),
    ("one", {"control_mode": [0]}, "control_mode: expected an int or None for one ControlNet"),
    ("two", {"control_mode": None}, r"control_mode\[1\]: expected one of the union ControlNet's modes \(0 … 2\)"),
    ("two", {"control_mode": [None, 3]}, r"control_mode\[1\]: expected one of the union ControlNet's modes"),
    ("two", {"control_mode": [None, 1, 1]}, "control_mode: expected 2 values"),
    ("two", {"control_image": picture()}, "control_image: expected a list of 2 control images"),
    ("two", {"control_guidance_end": [1.0, 0.5, 0.2]}, "control_guidance_end: expected 2 values"),
]


@pytest.mark.parametrize(
    "folder, changes, message", REFUSALS, ids=[f"{folder}-{next(iter(changes))}" for folder, changes, _ in REFUSALS]
)
def test_bad_arguments_are_refused_by_name_before_any_component_runs(
    ours, folder, changes, message, refused_runs_nothing
):
    pipe = ours[folder]
    images = picture() if folder == "one" else [picture(3), picture(4)]
    arguments = {"control_image": images, **({"control_mode": [None, 1]} if folder == "two" else {}), **changes}
    assert refused_runs_nothing(pipe, (ArgumentError, TypeError), message, lambda: run(pipe, **arguments))


def test_first_block_cache_is_refused_naming_the_config(ours):
    from diffusers.hooks import FirstBlockCacheConfig

    with pytest.raises(ArgumentError, match="config: OnnxFluxControlNetPipeline cannot cache steps"):
        ours["one"].enable_cache(FirstBlockCacheConfig(threshold=0.1))


# ----------------------------------------------------------------------------------------------------- detection
def test_its_folder_is_detected_by_class_name_and_by_its_transformers_inputs(flux):
    folder = flux[1]["two"]
    record = family("flux-controlnet")
    assert json.loads((folder / "model_index.json").read_text())["_class_name"] == "FluxControlNetPipeline"
    assert pipeline_class_for(folder, text_to_image=False) is OnnxFluxControlNetPipeline
    with pytest.raises(ArgumentError, match="is a FLUX.1 ControlNet folder .*: use OnnxFluxControlNetPipeline"):
        pipeline_class_for(folder)
    inputs, channels = denoiser_inputs(folder)
    assert detect(None, inputs, channels) is record
    assert detect("SomeFluxPipeline", inputs, channels) is record
    with pytest.raises(ArgumentError, match="transformer: expected inputs"):
        OnnxFluxPipeline.from_pretrained(folder)


@pytest.mark.parametrize("kind", ["xl-controlnet", "flux-controlnet"])
def test_step_cache_is_refused_for_a_controlnet_export_before_anything_is_built(tmp_path, monkeypatch, kind):
    import optimum_iobinding.export.export as export_module
    from optimum_iobinding.export import export_pipeline

    monkeypatch.setattr(export_module, "TINY_RANDOM_KINDS", {kind: lambda: pytest.fail("built before the refusal")})
    with pytest.raises(ArgumentError, match="step_cache: expected .* got a ControlNet pipeline"):
        export_pipeline(None, tmp_path / "out", tiny_random=kind, step_cache=True, progress=False)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------------- LoRA
def test_a_transformer_lora_gives_diffusers_image(flux, tmp_path):
    from optimum_iobinding.export.tiny import random_lora_layers, save_lora

    torch_pipe = flux[0]["one"]
    layers = random_lora_layers(torch_pipe.transformer, ("to_q", "to_v", "proj_out"), 4, 1)
    lora = str(save_lora(tmp_path / "lora", transformer=layers))
    pipe = load(flux[1]["one"])
    before = run(pipe, control_image=picture())
    try:
        for each in (torch_pipe, pipe):
            each.load_lora_weights(lora, adapter_name="a")
            each.set_adapters(["a"], adapter_weights=[0.8])
        got = run(pipe, control_image=picture())
        np.testing.assert_allclose(got, run(torch_pipe, control_image=picture()), atol=TOLERANCE)
    finally:
        torch_pipe.unload_lora_weights()  # the module's torch pipeline
    assert np.abs(got - before).max() > 1e-2
