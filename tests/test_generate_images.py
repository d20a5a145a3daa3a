"""``generate`` with images and LoRAs: ``--image`` (image to image, FLUX.1 Kontext's reference, Fill's and
inpainting's image), ``--mask``, ``--control-image`` (ControlNet, FLUX.1 Control), ``--strength`` and ``--lora
PATH[:SCALE]``, each image the same as the Python pipeline's with the same arguments (CPU execution provider), and
each option a family cannot take refused by name before any model loads."""

from __future__ import annotations

import re

import numpy as np
import PIL.Image
import pytest

from optimum_iobinding import (
    OnnxFluxControlPipeline,
    OnnxFluxFillPipeline,
    OnnxFluxKontextPipeline,
    OnnxStableDiffusionControlNetImg2ImgPipeline,
    OnnxStableDiffusionControlNetPipeline,
    OnnxStableDiffusionPipeline,
)
from optimum_iobinding.cli import main
from tests.commands import error_line

PROMPT = "a red castle in the forest"
CPU = ["--provider", "CPUExecutionProvider", "--steps", "2", "--seed", "3"]


def picture(path, width: int, height: int, seed: int = 0):
    pixels = (np.random.default_rng(seed).random((height, width, 3)) * 255).astype(np.uint8)
    PIL.Image.fromarray(pixels).save(path)
    return str(path)


def white_square(path, width: int, height: int):
    pixels = np.zeros((height, width), np.uint8)
    pixels[height // 4 : 3 * height // 4, width // 4 : 3 * width // 4] = 255
    PIL.Image.fromarray(pixels).save(path)
    return str(path)


def generated(tmp_path, capsys, *argv) -> np.ndarray:
    out = tmp_path / "out.png"
    assert main(["generate", PROMPT, *CPU, "--out", str(out), *argv]) == 0, capsys.readouterr().err
    with PIL.Image.open(out) as image:
        return np.asarray(image.convert("RGB"))


def called(pipe, **arguments) -> np.ndarray:
    pipe.set_progress_bar_config(disable=True)
    image = pipe(prompt=PROMPT, num_inference_steps=2, generator=np.random.RandomState(3), **arguments).images[0]
    return np.asarray(image)


@pytest.fixture
def loads(monkeypatch):
    """The pipelines loaded while the test runs (none, where a refusal comes first): loading is stopped."""
    import optimum_iobinding.pipelines.core as core

    loaded = []
    monkeypatch.setattr(core.OnnxDiffusionPipeline, "from_pretrained", classmethod(lambda *a, **k: loaded.append(a)))
    return loaded


def rgb(path, width=None, height=None):
    image = PIL.Image.open(path).convert("RGB")
    return image if width is None else image.resize((width, height))


def test_an_image_runs_image_to_image_at_its_own_size_and_a_mask_inpainting(tiny_folder, tmp_path, capsys):
    """At the image's size rounded down to what the UNet runs (multiples of 16: 48 × 40 → 48 × 32)."""
    image, mask = picture(tmp_path / "in.png", 48, 40), white_square(tmp_path / "mask.png", 48, 40)
    pipe = OnnxStableDiffusionPipeline.from_pretrained(tiny_folder, provider="CPUExecutionProvider")
    sized = rgb(image, 48, 32)
    img2img = generated(tmp_path, capsys, "--model", str(tiny_folder), "--image", image, "--strength", "0.6")
    assert np.array_equal(img2img, called(pipe.image_to_image(), image=sized, strength=0.6))
    inpainted = generated(tmp_path, capsys, "--model", str(tiny_folder), "--image", image, "--mask", mask)
    mask_image = PIL.Image.open(mask).convert("L").resize((48, 32))
    expected = called(pipe.inpainting(), image=sized, mask_image=mask_image, height=32, width=48)
    assert inpainted.shape[:2] == (32, 48) and np.array_equal(inpainted, expected)


def test_height_and_width_resize_the_image(tiny_folder, tmp_path, capsys):
    image = picture(tmp_path / "in.png", 48, 40)
    made = generated(tmp_path, capsys, "--model", str(tiny_folder), "--image", image, "--height", "32", "--width", "64")
    pipe = OnnxStableDiffusionPipeline.from_pretrained(tiny_folder, provider="CPUExecutionProvider").image_to_image()
    assert made.shape[:2] == (32, 64) and np.array_equal(made, called(pipe, image=rgb(image, 64, 32)))


@pytest.fixture(scope="module")
def flux_folders(shared_export):
    from optimum_iobinding.export import export_pipeline

    def exported(kind):  # the pipelines' tests share the same exports
        return shared_export(
            f"tiny-random-{kind}", lambda target: export_pipeline(None, target, tiny_random=kind, progress=False)
        )

    return exported


def test_flux_fill_takes_image_and_mask_and_control_its_control_image(flux_folders, tmp_path, capsys):
    image, mask = picture(tmp_path / "in.png", 48, 64), white_square(tmp_path / "mask.png", 48, 64)
    fill, control = flux_folders("flux-fill"), flux_folders("flux-control")
    made = generated(tmp_path, capsys, "--model", str(fill), "--image", image, "--mask", mask)
    pipe = OnnxFluxFillPipeline.from_pretrained(fill, provider="CPUExecutionProvider")
    expected = called(pipe, image=rgb(image), mask_image=PIL.Image.open(mask).convert("L"), height=64, width=48)
    assert np.array_equal(made, expected)
    made = generated(tmp_path, capsys, "--model", str(control), "--control-image", image)
    pipe = OnnxFluxControlPipeline.from_pretrained(control, provider="CPUExecutionProvider")
    assert np.array_equal(made, called(pipe, control_image=rgb(image), height=64, width=48))


def test_flux_kontext_makes_the_size_asked_for(flux_folders, tmp_path, capsys, monkeypatch):
    """FLUX.1 Kontext's height and width give an aspect ratio and ``max_area`` the pixels (about a megapixel by
    default): ``generate`` asks for the size its options say. (The reference image goes to the nearest of Kontext's
    preferred resolutions, a megapixel each: a few small ones here.)"""
    import optimum_iobinding.pipelines.flux_kontext as kontext

    monkeypatch.setattr(kontext, "PREFERRED_KONTEXT_RESOLUTIONS", [(32, 32), (64, 32), (32, 64)])
    folder, image = flux_folders("flux-kontext"), picture(tmp_path / "in.png", 48, 32)
    made = generated(tmp_path, capsys, "--model", str(folder), "--image", image, "--height", "32", "--width", "64")
    pipe = OnnxFluxKontextPipeline.from_pretrained(folder, provider="CPUExecutionProvider")
    expected = called(pipe, image=rgb(image, 64, 32), height=32, width=64, max_area=64 * 32)
    assert made.shape[:2] == (32, 64) and np.array_equal(made, expected)


def test_a_controlnet_folder_takes_a_control_image_and_with_an_image_runs_image_to_image(
    controlnet_folders, tmp_path, capsys
):
    folder, control, image = controlnet_folders["one"], picture(tmp_path / "c.png", 32, 32), None
    image = picture(tmp_path / "in.png", 32, 32, seed=1)
    pipe = OnnxStableDiffusionControlNetPipeline.from_pretrained(folder, provider="CPUExecutionProvider")
    made = generated(tmp_path, capsys, "--model", str(folder), "--control-image", control)
    assert np.array_equal(made, called(pipe, image=rgb(control), height=32, width=32))
    made = generated(tmp_path, capsys, "--model", str(folder), "--control-image", control, "--image", image)
    sibling = pipe.image_to_image()
    assert isinstance(sibling, OnnxStableDiffusionControlNetImg2ImgPipeline)
    assert np.array_equal(made, called(sibling, image=rgb(image), control_image=rgb(control), height=32, width=32))


def test_loras_load_as_adapters_at_their_scales(tiny_folder, make_lora, tmp_path, capsys):
    from optimum_iobinding.export.tiny import build_tiny_random_pipeline

    torch_pipe = build_tiny_random_pipeline()
    first = make_lora(torch_pipe, tmp_path / "a", 1, ["to_q", "to_v"])
    second = make_lora(torch_pipe, tmp_path / "b", 2, ["to_k"], text_targets=["q_proj"])
    argv = ["--model", str(tiny_folder), "--height", "32", "--width", "32"]
    made = generated(tmp_path, capsys, *argv, "--lora", f"{first}:0.5", "--lora", str(second))
    pipe = OnnxStableDiffusionPipeline.from_pretrained(tiny_folder, provider="CPUExecutionProvider")
    plain = called(pipe, height=32, width=32)
    pipe.load_lora_weights(str(first), adapter_name="a")
    pipe.load_lora_weights(str(second), adapter_name="b")
    pipe.set_adapters(["a", "b"], adapter_weights=[0.5, 1.0])
    assert np.array_equal(made, called(pipe, height=32, width=32)) and not np.array_equal(made, plain)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--mask", "{mask}"], r"--mask: expected it beside --image \(the image it repaints\), got a mask alone"),
        (["--control-image", "{image}"], r"--control-image: expected none for OnnxStableDiffusionPipeline \("),
        (["--image", "{tmp}/none.png"], r"--image: expected an image file \(PNG, JPEG, …\), got '.*none.png': no such"),
        (["--image", "{mask}", "--mask", "{small}"], r"--mask: expected the size of --image, 48x40, got 24x20"),
        (["--image", "{text}"], r"--image: expected an image file Pillow reads \(PNG, JPEG, …\), got '.*t.txt'"),
        (["--strength", "1.5"], r"--strength: expected a number in \(0, 1\], got 1.5"),
        (["--lora", "{tmp}/missing.safetensors"], r"--lora: expected an existing LoRA file or folder, or a hub id"),
        (
            ["--lora", "missing.safetensors"],
            r"--lora: expected an existing LoRA .*, got 'missing.safetensors': no such",
        ),
        (["--lora", "lora/nope.safetensors"], r"--lora: expected an existing LoRA .*'lora/nope.safetensors': no such"),
        (["--lora", "{tmp}:abc"], r"--lora: expected PATH\[:SCALE\] with a number for SCALE, got 'abc' after '.*'"),
    ],
    ids=[
        "mask-alone",
        "control-on-sd",
        "missing",
        "mask-size",
        "no-image",
        "strength",
        "lora-missing",
        "lora-file-name",
        "lora-relative",
        "lora-scale",
    ],
)
def test_an_image_option_the_folder_cannot_take_is_refused_before_its_model_loads(
    tiny_folder, tmp_path, capsys, loads, argv, message
):
    paths = {
        "image": picture(tmp_path / "in.png", 48, 40),
        "mask": white_square(tmp_path / "mask.png", 48, 40),
        "small": white_square(tmp_path / "small.png", 24, 20),
        "tmp": str(tmp_path),
        "text": str(tmp_path / "t.txt"),
    }
    (tmp_path / "t.txt").write_text("no image")
    argv = [part.format(**paths) for part in argv]
    assert main(["generate", "--model", str(tiny_folder), "--out", str(tmp_path / "o.png"), *argv]) == 2
    assert not loads and re.search(message, error_line(capsys))


@pytest.mark.parametrize(
    "kind, argv, message",
    [
        ("flux-kontext", [], r"--image: expected an image for OnnxFluxKontextPipeline \(FLUX.1 Kontext"),
        ("flux-fill", ["--image", "{image}"], r"--mask: expected an image for OnnxFluxFillPipeline"),
        ("flux-control", ["--image", "{image}"], r"--image: expected none for OnnxFluxControlPipeline"),
        ("flux-kontext", ["--image", "{image}", "--strength", "0.5"], r"--strength: expected none for OnnxFluxKontext"),
    ],
    ids=["kontext-without-image", "fill-without-mask", "control-with-image", "kontext-strength"],
)
def test_a_flux_variant_asks_for_the_images_it_needs_by_option(
    flux_folders, tmp_path, capsys, loads, kind, argv, message
):
    folder = flux_folders(kind)
    argv = [part.format(image=picture(tmp_path / "in.png", 48, 64)) for part in argv]
    assert main(["generate", "--model", str(folder), "--out", str(tmp_path / "o.png"), *argv]) == 2
    assert not loads and re.search(message, error_line(capsys))


def test_guidance_for_a_flux_schnell_folder_is_refused_and_a_dev_folder_takes_it(flux_folders, tmp_path, capsys):
    """FLUX.1 schnell's transformer takes no guidance scale: --guidance changed nothing there, silently."""
    out = tmp_path / "o.png"
    argv = [
        "generate",
        "a cat",
        "--guidance",
        "9",
        "--steps",
        "1",
        "--height",
        "32",
        "--width",
        "32",
        "--out",
        str(out),
    ]
    schnell = flux_folders("flux")
    assert main([*argv, "--model", str(schnell)]) == 2
    assert error_line(capsys) == (
        f"optimum-iobinding: error: --guidance: expected none for {str(schnell)!r}, whose transformer takes no guidance "
        "scale (FLUX.1 schnell: guidance-distilled; dev takes one), got 9"
    )
    assert not out.exists()
    assert main([*argv, "--model", str(flux_folders("flux-dev"))]) == 0 and out.is_file()
