"""FLUX.1's image-conditioned variants on their tiny random pipelines, CPU execution provider: Kontext (a reference
image's tokens beside the latents'), Fill (masked image and mask on the channels) and Control (a control image's
latents on the channels) against diffusers' torch ``FluxKontextPipeline``, ``FluxFillPipeline`` and
``FluxControlPipeline`` on the same weights; the arguments each refuses by name; First-Block Cache and runtime LoRA on
them. Detection of their folders: tests/test_families.py; the behaviour contract: test_contract.py."""

from __future__ import annotations

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers.hooks import FirstBlockCacheConfig

from optimum_iobinding import OnnxFluxControlPipeline, OnnxFluxFillPipeline, OnnxFluxKontextPipeline, OnnxFluxPipeline
from optimum_iobinding.errors import ArgumentError

PROMPTS = ["a photo of an astronaut riding a horse", "a red castle in the forest"]
HEIGHT, WIDTH = 64, 48  # 4 × 3 tokens: not square, so rows and columns cannot be swapped
CALL = dict(height=HEIGHT, width=WIDTH, num_inference_steps=2, max_sequence_length=16, output_type="np")
TOLERANCE = 1e-4  # fp32 ONNX Runtime vs fp32 torch on the CPU: rounding only
CLASSES = {"kontext": OnnxFluxKontextPipeline, "fill": OnnxFluxFillPipeline, "control": OnnxFluxControlPipeline}


def seeded(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def picture(height: int, width: int, seed: int = 0) -> PIL.Image.Image:
    pixels = np.random.default_rng(seed).random((height, width, 3))
    return PIL.Image.fromarray((pixels * 255).astype(np.uint8))


def mask(height: int = HEIGHT, width: int = WIDTH) -> PIL.Image.Image:
    white = np.zeros((height, width), np.uint8)
    white[height // 4 : 3 * height // 4, width // 3 :] = 255
    return PIL.Image.fromarray(white)


def images_of(key: str):
    """The image arguments of a call of variant ``key``: Kontext's reference image (smaller than the output, of its
    own aspect ratio: 2 × 3 tokens), Fill's image and mask, Control's control image."""
    if key == "kontext":
        return dict(image=picture(32, 48), max_area=HEIGHT * WIDTH, _auto_resize=False)
    if key == "fill":
        return dict(image=picture(HEIGHT, WIDTH), mask_image=mask())
    return dict(control_image=picture(HEIGHT, WIDTH))


def load(cls, folder, **options):
    pipe = cls.from_pretrained(folder, **options)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(params=list(CLASSES))
def variant(request):
    """(its key, diffusers' torch pipeline, its export) of each variant in turn."""
    torch_pipe, folder = request.getfixturevalue(request.param)
    return request.param, torch_pipe, folder


# -------------------------------------------------------------------------------------------- against diffusers
def test_each_variant_gives_diffusers_images_and_packed_latents(variant):
    key, torch_pipe, folder = variant
    pipe = load(CLASSES[key], folder)
    arguments = dict(CALL, **images_of(key), num_images_per_prompt=2, guidance_scale=4.0)
    ours = pipe(prompt=PROMPTS, generator=seeded(), **arguments).images
    theirs = torch_pipe(prompt=PROMPTS, generator=seeded(), **arguments).images
    assert ours.shape == (4, HEIGHT, WIDTH, 3)
    np.testing.assert_allclose(ours, theirs, atol=TOLERANCE)
    latent = dict(arguments, output_type="latent")
    ours = pipe(prompt=PROMPTS, generator=seeded(), **latent).images
    theirs = torch_pipe(prompt=PROMPTS, generator=seeded(), **latent).images
    assert tuple(ours.shape) == (4, (HEIGHT // 16) * (WIDTH // 16), 64)
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), atol=TOLERANCE)


def test_kontext_with_true_cfg_gives_diffusers_image_and_the_numpy_baseline_gives_it_too(kontext):
    torch_pipe, folder = kontext
    arguments = dict(CALL, **images_of("kontext"), negative_prompt=["a blue sky", "a dog"], true_cfg_scale=2.5)
    theirs = torch_pipe(prompt=PROMPTS, generator=seeded(), **arguments).images
    for io_binding in (True, False):
        ours = load(OnnxFluxKontextPipeline, folder, io_binding=io_binding)(
            prompt=PROMPTS, generator=seeded(), **arguments
        ).images
        np.testing.assert_allclose(ours, theirs, atol=TOLERANCE, err_msg=f"io_binding={io_binding}")


def test_kontext_fits_the_size_to_max_area_and_runs_without_an_image_as_diffusers_does(kontext):
    torch_pipe, folder = kontext
    arguments = dict(CALL, max_area=32 * 32)  # 64 × 48 at 1024 pixels: 37 × 28, rounded down to 32 × 16
    ours = load(OnnxFluxKontextPipeline, folder)(prompt=PROMPTS[0], generator=seeded(), **arguments).images
    theirs = torch_pipe(prompt=PROMPTS[0], generator=seeded(), **arguments).images
    assert ours.shape == theirs.shape == (1, 32, 16, 3)
    np.testing.assert_allclose(ours, theirs, atol=TOLERANCE)


def test_kontext_resizes_the_reference_to_the_kontext_resolution_nearest_its_aspect_ratio(kontext):
    pipe = load(OnnxFluxKontextPipeline, kontext[1])
    assert pipe.reference_size(picture(HEIGHT, WIDTH), True) == (1184, 880)  # 3 : 4, as diffusers picks it
    assert pipe.reference_size(picture(HEIGHT + 5, WIDTH + 7), False) == (HEIGHT, WIDTH)  # its own, rounded down
    # the aspect ratio of the size rounded down to the multiple, as diffusers reads it (284 / 256 would pick 1104 wide)
    assert pipe.reference_size(picture(256, 284), True) == (1024, 1024)


def test_fill_from_a_partly_noised_image_gives_diffusers_image(fill):
    torch_pipe, folder = fill
    arguments = dict(CALL, **images_of("fill"), strength=0.6, num_inference_steps=3)
    np.testing.assert_allclose(
        load(OnnxFluxFillPipeline, folder)(prompt=PROMPTS[0], generator=seeded(), **arguments).images,
        torch_pipe(prompt=PROMPTS[0], generator=seeded(), **arguments).images,
        atol=TOLERANCE,
    )


def test_fill_takes_diffusers_masked_image_latents_in_place_of_the_image_and_mask(fill):
    torch_pipe, folder = fill
    pixels = torch_pipe.image_processor.preprocess(picture(HEIGHT, WIDTH), height=HEIGHT, width=WIDTH)
    white = torch_pipe.mask_processor.preprocess(mask(), height=HEIGHT, width=WIDTH)
    with torch.no_grad():
        packed_mask, masked = torch_pipe.prepare_mask_latents(
            white, pixels * (1 - white), 1, 16, 1, HEIGHT, WIDTH, torch.float32, torch.device("cpu"), None
        )
    pipe = load(OnnxFluxFillPipeline, folder)
    given = pipe(
        prompt=PROMPTS[0], masked_image_latents=torch.cat([masked, packed_mask], dim=-1), generator=seeded(), **CALL
    ).images
    np.testing.assert_allclose(
        given, pipe(prompt=PROMPTS[0], **images_of("fill"), generator=seeded(), **CALL).images, atol=TOLERANCE
    )


def test_kontext_with_first_block_cache_skips_diffusers_steps_and_gives_its_image(kontext, shared_export):
    """First-Block Cache over the latent and reference tokens (the parts of a folder exported with them): where
    only the first step computes, the others reuse its residual, as diffusers' hook on the transformer does."""
    from optimum_iobinding.export import export_pipeline

    torch_pipe, _ = kontext
    folder = shared_export(
        "flux-kontext-step-cache",
        lambda target: export_pipeline(None, target, tiny_random="flux-kontext", step_cache=True, progress=False),
    )
    arguments = dict(CALL, **images_of("kontext"), num_inference_steps=3)
    pipe = load(OnnxFluxKontextPipeline, folder)
    pipe.enable_cache(FirstBlockCacheConfig(threshold=10.0))
    ours = pipe(prompt=PROMPTS[0], generator=seeded(), **arguments).images
    # diffusers' hook on its transformer, in the cache context FluxPipeline sets (its Kontext pipeline sets none)
    torch_pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=10.0))
    try:
        with torch_pipe.transformer.cache_context("cond"):
            theirs = torch_pipe(prompt=PROMPTS[0], generator=seeded(), **arguments).images
    finally:
        torch_pipe.transformer.disable_cache()
    assert pipe.step_cache.computed == [True, False, False]
    np.testing.assert_allclose(ours, theirs, atol=TOLERANCE)


def test_a_transformer_lora_on_fill_gives_diffusers_image_and_disabling_it_the_base_one(fill, tmp_path):
    from optimum_iobinding.export.tiny import random_lora_layers, save_lora

    torch_pipe, folder = fill
    targets = ["x_embedder", "to_q", "to_v", "proj_out"]  # x_embedder: the layer taking the 384 values per token
    lora = save_lora(tmp_path / "lora", transformer=random_lora_layers(torch_pipe.transformer, targets, 4, 7))
    arguments = dict(CALL, **images_of("fill"))
    pipe = load(OnnxFluxFillPipeline, folder)
    base = pipe(prompt=PROMPTS[0], generator=seeded(), **arguments).images
    pipe.load_lora_weights(str(lora), adapter_name="style")
    torch_pipe.load_lora_weights(str(lora), adapter_name="style")
    try:
        theirs = torch_pipe(prompt=PROMPTS[0], generator=seeded(), **arguments).images
    finally:
        torch_pipe.unload_lora_weights()
    ours = pipe(prompt=PROMPTS[0], generator=seeded(), **arguments).images
    np.testing.assert_allclose(ours, theirs, atol=TOLERANCE)
    assert np.abs(ours - base).max() > 1e-2
    pipe.disable_lora()
    np.testing.assert_allclose(pipe(prompt=PROMPTS[0], generator=seeded(), **arguments).images, base, atol=1e-5)


# ------------------------------------------------------------------------------------------------- refusals
REFUSALS = [
    ("kontext", dict(image="a cat.png"), TypeError, r"image: expected a PIL image, a numpy array or a torch tensor"),
    ("kontext", dict(max_area=0), ValueError, r"max_area: expected a positive number of pixels, got 0"),
    ("kontext", dict(_auto_resize="yes"), ValueError, r"_auto_resize: expected True or False, got 'yes'"),
    ("kontext", dict(image=[picture(32, 48)] * 3), ValueError, r"image: expected a number of images that divides 2"),
    ("kontext", dict(image=torch.zeros(1, 16, 3, 4)), ValueError, r"image: expected latents of an even"),
    ("fill", dict(mask_image=None), ValueError, r"image and mask_image: expected both \(or masked_image_latents\)"),
    ("fill", dict(masked_image_latents=torch.zeros(1, 12, 320)), ValueError, r"image and masked_image_latents: "),
    ("fill", dict(strength=1.5), ValueError, r"strength: expected a value in \[0, 1\], got 1.5"),
    ("fill", dict(strength=0.0), ValueError, r"strength: 0.0 of 2 steps leaves no denoising step"),
    ("fill", dict(mask_image=[mask()] * 3), ValueError, r"mask_image: expected a number of images that divides 2"),
    ("control", dict(control_image=None), ValueError, r"control_image: expected an image the output follows"),
    (
        "control",
        dict(control_image=torch.zeros(1, 3, 32, 32)),
        ValueError,
        r"control_image: expected a tensor of shape",
    ),
    ("control", dict(control_image=[picture(HEIGHT, WIDTH)] * 3), ValueError, r"control_image: expected 1 or 2 images"),
    ("control", dict(negative_prompt="a dog"), TypeError, r"unexpected keyword argument 'negative_prompt'"),
]


@pytest.mark.parametrize(
    "key, changes, error, message", REFUSALS, ids=[f"{key}-{next(iter(changes))}" for key, changes, *_ in REFUSALS]
)
def test_bad_arguments_are_refused_by_name_before_any_component_runs(
    request, key, changes, error, message, refused_runs_nothing
):
    _, folder = request.getfixturevalue(key)
    pipe = load(CLASSES[key], folder)
    arguments = {**CALL, **images_of(key), **changes}
    assert refused_runs_nothing(pipe, error, message, lambda: pipe(prompt=PROMPTS, generator=seeded(), **arguments))


def test_fill_masked_image_latents_alone_are_refused_unless_of_the_transformers_width_or_at_full_strength(fill):
    pipe = load(OnnxFluxFillPipeline, fill[1])
    with pytest.raises(ArgumentError, match=r"masked_image_latents: expected packed latents and mask of shape"):
        pipe(prompt=PROMPTS[0], masked_image_latents=torch.zeros(1, 12, 64), **CALL)
    with pytest.raises(ArgumentError, match=r"strength: expected 1 with masked_image_latents"):
        pipe(prompt=PROMPTS[0], masked_image_latents=torch.zeros(1, 12, 320), strength=0.5, **CALL)


def test_a_transformer_of_another_token_width_is_refused_naming_the_pipeline_it_needs(kontext, fill):
    with pytest.raises(
        ArgumentError,
        match=r"transformer: expected hidden_states of 64 values per token .* got 384 "
        r".*use OnnxFluxFillPipeline",
    ):
        load(OnnxFluxPipeline, fill[1])
    with pytest.raises(
        ArgumentError,
        match=r"transformer: expected hidden_states of 384 values per token \(the packed "
        r"latents' 4 × 16 \+ 64 \(the masked image's packed latents\) \+ 256 .* got 64 .*use OnnxFluxPipeline",
    ):
        load(OnnxFluxFillPipeline, kontext[1])
    with pytest.raises(ArgumentError, match=r"expected hidden_states of 128 values per token .* got 384 .*Fill"):
        load(OnnxFluxControlPipeline, fill[1])
