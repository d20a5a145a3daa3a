"""The server's image families and LoRAs, in a replica's generator in this process (no Ray; its two steps: checking a
request, running a batch): FLUX.1 Kontext, Fill and Control, ControlNet and inpainting folders take their images
(``image``, ``mask``, ``control_image``) and answer each request the image of a single pipeline call with its seed;
LoRAs load at start (``loras``, ``serve --lora``) and a request's ``loras`` picks their weights; each image or LoRA a
folder cannot take is refused naming the field."""

from __future__ import annotations

import base64
import io
from dataclasses import asdict

import numpy as np
import PIL.Image
import pytest
import torch

from optimum_iobinding.errors import ArgumentError
from optimum_iobinding.families import family_of_class, pipeline_class
from optimum_iobinding.serve import ImageGenerator, ServeConfig
from optimum_iobinding.serve.schema import decode_image, decode_mask

STEPS = 2


def png(pixels: np.ndarray) -> str:
    buffer = io.BytesIO()
    PIL.Image.fromarray(pixels).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def picture(width: int, height: int, seed: int = 0) -> str:
    return png((np.random.default_rng(seed).random((height, width, 3)) * 255).astype(np.uint8))


def white_square(width: int, height: int) -> str:
    pixels = np.zeros((height, width), np.uint8)
    pixels[height // 4 : 3 * height // 4, width // 4 : 3 * width // 4] = 255
    return png(pixels)


def replica(folder, **settings) -> ImageGenerator:
    settings = {
        **dict(model=str(folder), device="cpu", max_batch_size=2, steps=STEPS, warmup_batch_sizes=[]),
        **settings,
    }
    return ImageGenerator(asdict(ServeConfig(**settings)))


def single_call(pipe, request: dict, **images) -> np.ndarray:
    """The image of one call of ``pipe`` with the request's seed, as the server makes its pixels."""
    pipe.set_progress_bar_config(disable=True)
    image = pipe(
        prompt=request["prompt"],
        num_inference_steps=STEPS,
        guidance_scale=request.get("guidance", 7.5),
        generator=torch.Generator().manual_seed(request["seed"]),
        output_type="np",
        **images,
    ).images[0]
    return (np.clip(image, 0, 1) * 255).round().astype(np.uint8)


def answered(generator: ImageGenerator, *requests: dict) -> list:
    answers = generator.run_batch([generator.complete_request(dict(request)) for request in requests])
    assert all("images" in answer for answer in answers), answers
    return [answer["images"][0] for answer in answers]


@pytest.fixture(scope="module")
def flux_folders(shared_export):
    from optimum_iobinding.export import export_pipeline

    def exported(kind):  # the pipelines' tests share the same exports
        return shared_export(
            f"tiny-random-{kind}", lambda target: export_pipeline(None, target, tiny_random=kind, progress=False)
        )

    return exported


@pytest.mark.parametrize("kind", ["flux-kontext", "flux-fill", "flux-control"])
def test_a_flux_variant_folder_takes_its_images_and_answers_each_request_its_single_call_image(
    flux_folders, kind, monkeypatch
):
    """(Kontext's reference image goes to the nearest of its preferred resolutions, a megapixel each: small ones
    here.)"""
    import optimum_iobinding.pipelines.flux_kontext as kontext

    monkeypatch.setattr(kontext, "PREFERRED_KONTEXT_RESOLUTIONS", [(32, 32), (48, 32), (32, 48)])
    folder = flux_folders(kind)
    generator = replica(folder, guidance=3.5, warmup_batch_sizes=[1], warmup_sizes=[32])
    record = family_of_class(type(generator.pipe).__name__)
    width, height = 48, 32
    fields = {
        "flux-kontext": dict(image=picture(width, height)),
        "flux-fill": dict(image=picture(width, height), mask=white_square(width, height)),
        "flux-control": dict(control_image=picture(width, height)),
    }[kind]
    assert generator.info()["images"] == sorted(fields)
    requests = [dict(prompt=f"a castle {i}", seed=7 + i, guidance=3.5, **fields) for i in range(2)]
    images = answered(generator, *requests)
    pipe = pipeline_class(record).from_pretrained(folder)
    arguments = dict(height=height, width=width)
    if "image" in fields:
        arguments["image"] = decode_image(fields["image"])[None]
    if "mask" in fields:
        arguments["mask_image"] = decode_mask(fields["mask"], (width, height))[None]
    if "control_image" in fields:
        arguments["control_image"] = decode_image(fields["control_image"])[None]
    if kind == "flux-kontext":
        arguments["max_area"] = width * height
    for request, image in zip(requests, images):
        assert image.shape == (height, width, 3)
        assert np.abs(image.astype(int) - single_call(pipe, request, **arguments).astype(int)).max() <= 1


def test_a_controlnet_folder_takes_a_control_image_and_with_an_image_runs_its_image_to_image(controlnet_folders):
    folder = controlnet_folders["one"]
    generator = replica(folder)
    control, start = picture(32, 32), picture(32, 32, seed=1)
    request = dict(prompt="a house", seed=3, control_image=control)
    (image,) = answered(generator, request)
    pipe = generator.pipe
    expected = single_call(pipe, request, image=decode_image(control)[None], height=32, width=32)
    assert np.abs(image.astype(int) - expected.astype(int)).max() <= 1
    request = dict(request, image=start, strength=0.7)
    (image,) = answered(generator, request)
    arguments = dict(image=decode_image(start)[None], control_image=decode_image(control)[None], strength=0.7)
    expected = single_call(pipe.image_to_image(), request, height=32, width=32, **arguments)
    assert np.abs(image.astype(int) - expected.astype(int)).max() <= 1


def test_a_mask_field_inpaints_on_the_pipelines_inpainting_sibling(tiny_folder):
    generator = replica(tiny_folder)
    request = dict(prompt="a lake", seed=5, image=picture(32, 32), mask=white_square(32, 32))
    (image,) = answered(generator, request)
    arguments = dict(
        image=decode_image(request["image"])[None], mask_image=decode_mask(request["mask"], (32, 32))[None]
    )
    expected = single_call(generator.pipe.inpainting(), request, strength=1.0, height=32, width=32, **arguments)
    assert np.abs(image.astype(int) - expected.astype(int)).max() <= 1


@pytest.fixture(scope="module")
def two_loras(tmp_path_factory):
    """Two random LoRAs of the tiny Stable Diffusion pipeline: ``a.safetensors`` (the UNet) and ``b.safetensors``
    (the UNet and the text encoder)."""
    from optimum_iobinding.export.tiny import build_tiny_random_pipeline, random_lora_layers, save_lora

    pipe, folder = build_tiny_random_pipeline(), tmp_path_factory.mktemp("loras")
    files = []
    for name, seed, text in (("a", 1, ()), ("b", 2, ("q_proj",))):
        layers = {"unet": random_lora_layers(pipe.unet, ["to_q", "to_v"], 4, seed)}
        if text:
            layers["text_encoder"] = random_lora_layers(pipe.text_encoder, text, 2, seed + 1000)
        saved = save_lora(folder / name, **layers) / "pytorch_lora_weights.safetensors"
        files.append(saved.rename(folder / f"{name}.safetensors"))
    return files


def test_loras_load_at_start_and_each_request_gets_its_weights_in_one_batch(tiny_folder, two_loras):
    a, b = two_loras
    generator = replica(tiny_folder, loras=[f"{a}:0.5", str(b)])
    assert generator.info()["loras"] == {"a": 0.5, "b": 1.0}
    requests = [
        dict(prompt="a dog", seed=1, size=32),  # the service's weights
        dict(prompt="a dog", seed=1, size=32, loras={"b": 0.25}),  # b alone, a quarter
        dict(prompt="a dog", seed=1, size=32, loras={}),  # none
    ]
    images = answered(generator, *requests)
    pipe = pipeline_class(family_of_class(type(generator.pipe).__name__)).from_pretrained(tiny_folder)
    pipe.load_lora_weights(str(a), adapter_name="a")
    pipe.load_lora_weights(str(b), adapter_name="b")
    for weights, image in zip([[0.5, 1.0], [0.0, 0.25], [0.0, 0.0]], images):
        pipe.set_adapters(["a", "b"], adapter_weights=weights)
        expected = single_call(pipe, requests[0], height=32, width=32)
        assert np.abs(image.astype(int) - expected.astype(int)).max() <= 1
    assert not np.array_equal(images[0], images[2])
    with pytest.raises(ArgumentError, match=r"loras: expected names among \['a', 'b'\], got \['c'\]"):
        generator.complete_request(dict(prompt="x", loras={"c": 1.0}))


@pytest.mark.parametrize(
    "kind, fields, message",
    [
        ("sd", dict(control_image=True), r"control_image: expected none for OnnxStableDiffusionPipeline \("),
        ("flux-fill", dict(image=True), r"mask: expected an image for OnnxFluxFillPipeline"),
        ("flux-control", dict(image=True), r"image: expected none for OnnxFluxControlPipeline"),
        ("flux-kontext", dict(image=True, strength=0.5), r"strength: expected none for OnnxFluxKontextPipeline"),
        ("sd", dict(loras={"a": 1}), r"loras: expected names among none: the service loaded no LoRA, got \['a'\]"),
        (
            "flux-control",
            dict(control_image="bad"),
            r"control_image: expected a base64 PNG or JPEG, got text that is no",
        ),
        ("flux-control", dict(control_mode=1), r"control_mode: expected it beside a control image \(control_image\)"),
        (
            "flux-control",
            dict(control_image=True, control_mode=1),
            r"control_mode: expected none for OnnxFluxControlPipeline \(.* takes no union ControlNet's mode\)",
        ),
    ],
    ids=[
        "control-to-sd",
        "fill-without-mask",
        "image-to-control",
        "kontext-strength",
        "no-loras",
        "bad-control",
        "mode-alone",
        "mode-to-control",
    ],
)
def test_an_image_or_lora_the_folder_cannot_take_is_refused_naming_the_field(
    tiny_folder, flux_folders, kind, fields, message
):
    generator = replica(tiny_folder if kind == "sd" else flux_folders(kind))
    fields = {name: picture(32, 32) if value is True else value for name, value in fields.items()}
    with pytest.raises(ArgumentError, match=message):
        generator.complete_request(dict(prompt="x", seed=0, **fields))


def test_a_union_controlnet_folder_takes_each_requests_control_mode(shared_export):
    from optimum_iobinding.export import export_pipeline
    from optimum_iobinding.export.tiny import build_tiny_random_flux_controlnet_pipeline

    folder = shared_export(
        "flux-controlnet-union",
        lambda target: export_pipeline(
            None,
            target,
            torch_pipeline=build_tiny_random_flux_controlnet_pipeline(controlnets=("union",)),
            progress=False,
        ),
    )
    generator = replica(folder, guidance=3.5)
    control = picture(32, 32)
    requests = [dict(prompt="a house", seed=3, guidance=3.5, control_image=control, control_mode=m) for m in (1, 2)]
    images = [answered(generator, request)[0] for request in requests]
    with pytest.raises(ArgumentError, match=r"control_mode: expected one of the union ControlNet's modes \(0 … 2\)"):
        generator.complete_request(dict(requests[0], control_mode=None))  # refused before any batch
    for request, image in zip(requests, images):
        arguments = dict(control_image=decode_image(control)[None], control_mode=request["control_mode"])
        expected = single_call(generator.pipe, request, height=32, width=32, **arguments)
        assert np.abs(image.astype(int) - expected.astype(int)).max() <= 1
    assert not np.array_equal(images[0], images[1])  # the mode reached the ControlNet (a tiny one: a small change)


def test_a_lora_the_family_cannot_take_or_a_bad_spec_fails_before_any_replica_starts(tmp_path, capsys):
    from optimum_iobinding.cli import main

    with pytest.raises(ArgumentError, match=r"loras: expected PATH\[:SCALE\] with a finite SCALE, got 'x:inf'"):
        ServeConfig(model="m", loras=["x:inf"])
    assert main(["serve", str(tmp_path), "--lora", str(tmp_path / "none.safetensors")]) == 2
    assert "--lora: expected an existing LoRA file or folder, or a hub id" in capsys.readouterr().err


def test_a_pixel_limit_below_the_default_size_fails_the_replica_naming_it(tiny_folder):
    """A request without a size makes the default size: a limit below it would refuse every such request."""
    with pytest.raises(
        ArgumentError, match=r"max_pixels_per_image: expected at least 256×256 = 65536 pixels .* got 10"
    ):
        replica(tiny_folder, max_pixels_per_image=10)
    assert ServeConfig(model="m", max_pixels_per_image=4096).limits(64).max_pixels_per_image == 4096


def test_a_lora_that_cannot_be_read_fails_the_replica_naming_loras(tiny_folder, tmp_path):
    (tmp_path / "notes.safetensors").write_text("no LoRA")
    with pytest.raises(ArgumentError, match=r"^loras: .*notes\.safetensors: "):
        replica(tiny_folder, loras=[str(tmp_path / "notes.safetensors")])
