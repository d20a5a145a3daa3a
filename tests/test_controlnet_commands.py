"""The SDXL and FLUX.1 ControlNet families from the command line: ``export MODEL --controlnet FOLDER`` makes a folder of
the family's ControlNet pipeline (SDXL's UNet taking the ControlNet's residuals, FLUX.1's transformer taking its block
samples), and ``generate --control-image`` on such a folder makes the image its Python pipeline makes with the same
arguments (CPU execution provider), the family table routing the control image (``families.image_route``)."""

from __future__ import annotations

import numpy as np
import PIL.Image

from optimum_iobinding import OnnxFluxControlNetPipeline, OnnxStableDiffusionXLControlNetPipeline
from optimum_iobinding.cli import main

PROMPT = "a red castle in the forest"


def picture(path, width: int, height: int, seed: int = 0) -> str:
    pixels = (np.random.default_rng(seed).random((height, width, 3)) * 255).astype(np.uint8)
    PIL.Image.fromarray(pixels).save(path)
    return str(path)


def exported(tmp_path, capsys, kind: str, controlnet) -> str:
    """``export --tiny-random KIND --controlnet FOLDER`` of ``controlnet`` (a diffusers ControlNet, saved first)."""
    controlnet.save_pretrained(tmp_path / f"{kind}-net")
    out = tmp_path / f"{kind}-onnx"
    argv = ["export", "--tiny-random", kind, "--controlnet", str(tmp_path / f"{kind}-net"), "--output", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    return str(out)


def generated(tmp_path, capsys, folder: str, control: str) -> np.ndarray:
    out = tmp_path / "out.png"
    argv = ["generate", PROMPT, "--model", folder, "--control-image", control, "--out", str(out)]
    argv += ["--provider", "CPUExecutionProvider", "--steps", "2", "--seed", "3"]
    assert main(argv) == 0, capsys.readouterr().err
    with PIL.Image.open(out) as image:
        return np.asarray(image.convert("RGB"))


def called(pipe_class, folder: str, **arguments) -> np.ndarray:
    pipe = pipe_class.from_pretrained(folder, provider="CPUExecutionProvider")
    pipe.set_progress_bar_config(disable=True)
    image = pipe(prompt=PROMPT, num_inference_steps=2, generator=np.random.RandomState(3), **arguments).images[0]
    return np.asarray(image)


def test_export_with_a_controlnet_makes_each_familys_folder_and_generate_takes_its_control_image(tmp_path, capsys):
    from optimum_iobinding.export.tiny import (
        build_tiny_random_controlnet,
        build_tiny_random_flux_controlnet,
        build_tiny_random_flux_pipeline,
        build_tiny_random_xl_pipeline,
    )

    control = picture(tmp_path / "control.png", 48, 64)
    with PIL.Image.open(control) as image:
        rgb = image.convert("RGB")
    xl = exported(tmp_path, capsys, "xl", build_tiny_random_controlnet(build_tiny_random_xl_pipeline().unet, 10))
    made = generated(tmp_path, capsys, xl, control)
    assert made.shape == (64, 48, 3)
    assert np.array_equal(made, called(OnnxStableDiffusionXLControlNetPipeline, xl, image=rgb, height=64, width=48))
    transformer = build_tiny_random_flux_pipeline(guidance_embeds=True).transformer
    flux = exported(tmp_path, capsys, "flux-dev", build_tiny_random_flux_controlnet(transformer, 10))
    made = generated(tmp_path, capsys, flux, control)
    expected = called(OnnxFluxControlNetPipeline, flux, control_image=rgb, height=64, width=48)
    assert made.shape == (64, 48, 3) and np.array_equal(made, expected)


def test_generate_gives_a_union_controlnet_its_mode_and_refuses_a_mode_where_none_is_taken(tmp_path, capsys):
    from optimum_iobinding.export.tiny import build_tiny_random_flux_controlnet, build_tiny_random_flux_pipeline

    control = picture(tmp_path / "control.png", 32, 32)
    with PIL.Image.open(control) as image:
        rgb = image.convert("RGB")
    transformer = build_tiny_random_flux_pipeline(guidance_embeds=True).transformer
    flux = exported(tmp_path, capsys, "flux-dev", build_tiny_random_flux_controlnet(transformer, 10, kind="union"))
    argv = ["generate", PROMPT, "--model", flux, "--control-image", control, "--out", str(tmp_path / "none.png")]
    argv += ["--provider", "CPUExecutionProvider", "--steps", "2", "--seed", "3"]
    assert main(argv) == 2  # a union ControlNet needs a mode
    assert "--control-mode: expected one of the union ControlNet's modes (0 … 2)" in capsys.readouterr().err
    made = {}
    for mode in (1, 2):
        out = tmp_path / f"mode-{mode}.png"
        argv = ["generate", PROMPT, "--model", flux, "--control-image", control, "--control-mode", str(mode)]
        argv += ["--out", str(out), "--provider", "CPUExecutionProvider", "--steps", "2", "--seed", "3"]
        assert main(argv) == 0, capsys.readouterr().err
        with PIL.Image.open(out) as image:
            made[mode] = np.asarray(image.convert("RGB"))
        expected = called(OnnxFluxControlNetPipeline, flux, control_image=rgb, control_mode=mode, height=32, width=32)
        assert np.array_equal(made[mode], expected)
    assert not np.array_equal(made[1], made[2])
    # a family without union ControlNets: refused before any model loads, naming the option
    argv = ["generate", PROMPT, "--control-mode", "1", "--out", str(tmp_path / "sd.png"), "--steps", "1"]
    assert main(argv) == 2
    assert "--control-mode: expected none for OnnxStableDiffusionPipeline" in capsys.readouterr().err
