"""SDXL with ControlNets (``OnnxStableDiffusionXLControlNetPipeline``) on the tiny random SDXL ControlNet pipeline,
CPU execution provider: images equal to diffusers' torch ``StableDiffusionXLControlNetPipeline`` on the same weights
with one ControlNet and with two (each its own scale and guidance window), guess mode and SDXL's micro-conditioning;
the arguments it refuses by name before any component runs; its folder detected by model_index.json's class name and
by its UNet's inputs. The behaviour contract: test_contract.py; generate: tests/test_controlnet_commands.py."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from optimum_iobinding import OnnxStableDiffusionXLControlNetPipeline, OnnxStableDiffusionXLPipeline
from optimum_iobinding.errors import ArgumentError
from optimum_iobinding.families import detect, family
from optimum_iobinding.pipelines.auto import denoiser_inputs, pipeline_class_for

PROMPT = "a photo of a cat"
TOLERANCE = 1e-4  # fp32 ONNX Runtime vs fp32 torch on the CPU: rounding only


def control_image(seed: int = 3, size: int = 64, batch: int = 1) -> torch.Tensor:
    return torch.rand(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))


def run(pipe, **kwargs) -> np.ndarray:
    kwargs = {"prompt": PROMPT, "num_inference_steps": 2, "output_type": "np", **kwargs}
    return pipe(generator=torch.Generator().manual_seed(0), **kwargs).images


def without_second_controlnet(two, target) -> None:
    """The folder of the pipeline with its first ControlNet only (the UNet takes the same residuals)."""
    shutil.copytree(two, target, ignore=lambda folder, names: ["controlnet_1"] if "controlnet_1" in names else [])
    index = json.loads((target / "model_index.json").read_text())
    index.pop("controlnet_1")
    (target / "model_index.json").write_text(json.dumps(index))


@pytest.fixture(scope="module")
def xl(shared_export):
    """Diffusers' torch pipelines with the first ControlNet ("one") and with both ("two"), and their exports (the
    builder is seeded: the same weights in every module)."""
    from diffusers import StableDiffusionXLControlNetPipeline

    from optimum_iobinding.export import export_pipeline
    from optimum_iobinding.export.tiny import build_tiny_random_xl_controlnet_pipeline

    two = build_tiny_random_xl_controlnet_pipeline(controlnets=2)
    one = StableDiffusionXLControlNetPipeline(**{**two.components, "controlnet": two.controlnet.nets[0]})
    folders = {"two": shared_export("xl-controlnet-two", lambda t: export_pipeline(None, t, torch_pipeline=two))}
    folders["one"] = shared_export("xl-controlnet-one", lambda t: without_second_controlnet(folders["two"], t))
    for pipe in (one, two):
        pipe.set_progress_bar_config(disable=True)
    return {"one": one, "two": two}, folders


def load(folder, **options) -> OnnxStableDiffusionXLControlNetPipeline:
    pipe = OnnxStableDiffusionXLControlNetPipeline.from_pretrained(folder, **options)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def ours(xl):
    """Our pipelines of both folders, loaded once."""
    return {name: load(folder) for name, folder in xl[1].items()}


# ------------------------------------------------------------------------------------------------ equal images
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"guidance_scale": 1.0},
        {"guess_mode": True, "controlnet_conditioning_scale": 0.7},
        {"control_guidance_start": 0.5, "control_guidance_end": 1.0},  # the second step only
        {"original_size": (96, 80), "crops_coords_top_left": (4, 8), "target_size": (64, 48)},
        {"negative_original_size": (32, 32), "negative_target_size": (48, 48), "guidance_scale": 3.0},
    ],
    ids=["default", "no-guidance", "guess-mode", "window", "micro-conditioning", "negative-conditioning"],
)
def test_one_controlnet_gives_diffusers_images(xl, ours, kwargs):
    torch_pipes, _ = xl
    expected = run(torch_pipes["one"], image=control_image(), **kwargs)
    np.testing.assert_allclose(run(ours["one"], image=control_image(), **kwargs), expected, atol=TOLERANCE)


def test_the_controlnet_matters_and_a_scale_of_zero_is_sdxls_own_image(xl, ours):
    from diffusers import StableDiffusionXLPipeline

    torch_pipes, _ = xl
    accepted = set(StableDiffusionXLPipeline._get_signature_keys(StableDiffusionXLPipeline)[0])
    plain = StableDiffusionXLPipeline(**{k: v for k, v in torch_pipes["one"].components.items() if k in accepted})
    plain.set_progress_bar_config(disable=True)
    unguided = run(ours["one"], image=control_image(), controlnet_conditioning_scale=0.0)
    np.testing.assert_allclose(unguided, run(plain, height=64, width=64), atol=TOLERANCE)
    assert np.abs(unguided - run(ours["one"], image=control_image())).max() > 1e-2


def test_prompts_in_a_batch_and_a_pil_control_image_of_another_size_give_diffusers_images(xl, ours):
    from PIL import Image

    pil = Image.fromarray((control_image(size=96)[0].permute(1, 2, 0).numpy() * 255).astype(np.uint8))
    kwargs = dict(prompt=["a cat", "a dog"], num_images_per_prompt=2, height=64, width=64, image=pil)
    got = run(ours["one"], **kwargs)
    assert got.shape == (4, 64, 64, 3)
    np.testing.assert_allclose(got, run(xl[0]["one"], **kwargs), atol=TOLERANCE)


@pytest.mark.parametrize("io_binding", [True, False])
def test_two_controlnets_each_with_its_scale_and_window_give_diffusers_images(xl, ours, io_binding):
    kwargs = dict(
        image=[control_image(3), control_image(4)],
        controlnet_conditioning_scale=[0.7, 1.2],
        control_guidance_start=[0.0, 0.5],  # the first ControlNet at the first step, the second at the second
        control_guidance_end=[0.5, 1.0],
    )
    pipe = ours["two"] if io_binding else load(xl[1]["two"], io_binding=False)
    np.testing.assert_allclose(run(pipe, **kwargs), run(xl[0]["two"], **kwargs), atol=TOLERANCE)


# ------------------------------------------------------------------------------------------------------ refusals
REFUSALS = [
    ("one", {"image": None}, "image: expected a control image"),
    ("one", {"image": torch.rand(1, 4, 64, 64)}, "image: expected a control image with 3 channels"),
    ("one", {"controlnet_conditioning_scale": [1.0, 0.5]}, "controlnet_conditioning_scale: expected 1 values"),
    ("one", {"control_guidance_start": 0.8, "control_guidance_end": 0.2}, "control_guidance_start: expected each"),
    ("one", {"guess_mode": "yes"}, "guess_mode: expected True or False"),
    ("one", {"original_size": (64,)}, r"original_size: expected \(height, width\)"),
    ("one", {"prompt_2": ["a", "b"]}, "prompt_2: expected"),
    ("two", {"image": control_image()}, "image: expected a list of 2 control images"),
    ("two", {"control_guidance_end": [1.0, 0.5, 0.2]}, "control_guidance_end: expected 2 values"),
]


@pytest.mark.parametrize(
    "folder, changes, message", REFUSALS, ids=[f"{folder}-{next(iter(changes))}" for folder, changes, _ in REFUSALS]
)
def test_bad_arguments_are_refused_by_name_before_any_component_runs(
    ours, folder, changes, message, refused_runs_nothing
):
    pipe = ours[folder]
    images = control_image() if folder == "one" else [control_image(3), control_image(4)]
    arguments = {"image": images, **changes}
    assert refused_runs_nothing(pipe, (ArgumentError, TypeError), message, lambda: run(pipe, **arguments))


def test_a_folder_without_a_controlnet_is_refused_naming_what_it_lacks(xl, tmp_path):
    shutil.copytree(xl[1]["one"], tmp_path / "plain", ignore=shutil.ignore_patterns("controlnet"))
    with pytest.raises(FileNotFoundError, match="component 'controlnet' is missing"):
        OnnxStableDiffusionXLControlNetPipeline.from_pretrained(tmp_path / "plain")


# ----------------------------------------------------------------------------------------------------- detection
def test_its_folder_is_detected_by_class_name_and_by_its_unets_inputs(xl):
    folder = xl[1]["two"]
    record = family("sdxl-controlnet")
    assert json.loads((folder / "model_index.json").read_text())["_class_name"] == "StableDiffusionXLControlNetPipeline"
    assert pipeline_class_for(folder, text_to_image=False) is OnnxStableDiffusionXLControlNetPipeline
    with pytest.raises(ArgumentError, match="is an SDXL ControlNet folder .*: use OnnxStableDiffusionXLControlNet"):
        pipeline_class_for(folder)
    inputs, channels = denoiser_inputs(folder)
    folders = [entry.name for entry in folder.iterdir() if entry.is_dir()]
    assert detect(None, inputs, channels, folders) is record
    assert detect("SomeFinetunedXLPipeline", inputs, channels, folders) is record
    with pytest.raises(ArgumentError, match="unet: expected inputs"):
        OnnxStableDiffusionXLPipeline.from_pretrained(folder)
