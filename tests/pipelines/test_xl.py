"""SDXL on the tiny random SDXL pipeline, CPU execution provider: our ONNX pipelines against diffusers' torch
pipelines on the same weights (exported here), with and without binding."""

from __future__ import annotations

import json

import numpy as np
import PIL.Image
import pytest
import torch

from optimum_iobinding import OnnxStableDiffusionXLImg2ImgPipeline, OnnxStableDiffusionXLPipeline
from optimum_iobinding.export import export_pipeline
from optimum_iobinding.export.tiny import build_tiny_random_xl_pipeline

SIZE = 64
PROMPT = "a photo of an astronaut riding a horse"
# fp32 ONNX Runtime vs fp32 torch on the CPU, a few steps: rounding only
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def xl(xl_folder):
    """diffusers' torch SDXL pipeline with the weights of the tiny random export (the builder is seeded) and the
    export."""
    torch_pipe = build_tiny_random_xl_pipeline()
    torch_pipe.set_progress_bar_config(disable=True)
    return torch_pipe, xl_folder


@pytest.fixture(scope="module")
def refiner(tmp_path_factory):
    """SDXL's refiner layout: only the second text encoder, aesthetic score in time_ids (5 values)."""
    from diffusers import StableDiffusionXLImg2ImgPipeline, UNet2DConditionModel

    base = build_tiny_random_xl_pipeline()
    torch.manual_seed(3)
    unet = UNet2DConditionModel(
        **{**base.unet.config, "projection_class_embeddings_input_dim": 5 * 8 + 32, "cross_attention_dim": 32}
    )  # only the second encoder's states
    torch_pipe = StableDiffusionXLImg2ImgPipeline(
        vae=base.vae,
        text_encoder=None,
        text_encoder_2=base.text_encoder_2,
        tokenizer=None,
        tokenizer_2=base.tokenizer_2,
        unet=unet,
        scheduler=base.scheduler,
        requires_aesthetics_score=True,
    )
    torch_pipe.set_progress_bar_config(disable=True)
    folder = export_pipeline(None, tmp_path_factory.mktemp("xl") / "refiner", torch_pipeline=torch_pipe, progress=False)
    return torch_pipe, folder


def load(pipeline_class, folder, io_binding=True):
    pipe = pipeline_class.from_pretrained(folder, io_binding=io_binding)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def initial_latents(seed=0):
    return np.random.RandomState(seed).randn(1, 4, SIZE // 8, SIZE // 8).astype(np.float32)


def test_the_export_has_optimums_sdxl_layout(xl):
    _, folder = xl
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionXLPipeline"
    assert index["text_encoder_2"] == ["transformers", "CLIPTextModelWithProjection"]
    for name in ("text_encoder", "text_encoder_2", "unet", "vae_encoder", "vae_decoder"):
        assert (folder / name / "model.onnx").is_file() and (folder / name / "config.json").is_file()
    assert (folder / "tokenizer_2" / "vocab.json").is_file()
    pipe = load(OnnxStableDiffusionXLPipeline, folder)
    assert [arg.name for arg in pipe.unet.session.get_inputs()] == [
        "sample",
        "timestep",
        "encoder_hidden_states",
        "text_embeds",
        "time_ids",
    ]
    assert pipe.text_encoder_2.output_names[:2] == ["text_embeds", "last_hidden_state"]


@pytest.mark.parametrize("io_binding", [True, False])
@pytest.mark.parametrize(
    "call",
    [
        dict(guidance_scale=5.0),
        dict(guidance_scale=5.0, negative_prompt="blurry", prompt_2="an oil painting"),
        dict(guidance_scale=1.0),
        dict(guidance_scale=7.0, guidance_rescale=0.7, original_size=(128, 96), crops_coords_top_left=(8, 4)),
        dict(guidance_scale=5.0, clip_skip=1),
    ],
    ids=["cfg", "negative-and-prompt-2", "no-cfg", "rescale-and-size-conditioning", "clip-skip"],
)
def test_txt2img_matches_diffusers_torch_sdxl(xl, io_binding, call):
    torch_pipe, folder = xl
    latents = initial_latents()
    expected = torch_pipe(
        PROMPT,
        height=SIZE,
        width=SIZE,
        num_inference_steps=3,
        latents=torch.from_numpy(latents),
        output_type="np",
        **call,
    ).images
    got = load(OnnxStableDiffusionXLPipeline, folder, io_binding)(
        PROMPT, height=SIZE, width=SIZE, num_inference_steps=3, latents=latents, output_type="np", **call
    ).images
    assert got.shape == expected.shape == (1, SIZE, SIZE, 3)
    np.testing.assert_allclose(got, expected, atol=TOLERANCE)


def test_two_prompts_and_two_images_per_prompt_come_out_in_diffusers_order(xl):
    torch_pipe, folder = xl
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(4, 4, SIZE // 8, SIZE // 8, generator=generator)
    prompts = [PROMPT, "a red bicycle"]
    expected = torch_pipe(
        prompts,
        height=SIZE,
        width=SIZE,
        num_inference_steps=2,
        num_images_per_prompt=2,
        latents=latents,
        output_type="np",
    ).images
    got = load(OnnxStableDiffusionXLPipeline, folder)(
        prompts,
        height=SIZE,
        width=SIZE,
        num_inference_steps=2,
        num_images_per_prompt=2,
        latents=latents,
        output_type="np",
    ).images
    np.testing.assert_allclose(got, expected, atol=TOLERANCE)


def test_prompt_embeds_without_pooled_embeds_are_refused(xl):
    _, folder = xl
    pipe = load(OnnxStableDiffusionXLPipeline, folder)
    with pytest.raises(ValueError, match="pooled_prompt_embeds"):
        pipe(prompt_embeds=torch.zeros(1, 77, 64), height=SIZE, width=SIZE, num_inference_steps=1)


def test_an_sd_folder_is_refused_by_the_sdxl_pipeline(tmp_path):
    folder = export_pipeline(None, tmp_path / "sd", tiny_random=True, progress=False)
    with pytest.raises(FileNotFoundError, match="text_encoder_2"):
        OnnxStableDiffusionXLPipeline.from_pretrained(folder)


def image_latents(torch_pipe, image):
    """What our export's vae_encoder returns (the latent distribution's mode), scaled: diffusers' img2img takes
    4-channel latents as they are instead of sampling from the encoder's distribution."""
    pixels = torch_pipe.image_processor.preprocess(image)
    with torch.no_grad():
        return torch_pipe.vae.encode(pixels).latent_dist.mode() * torch_pipe.vae.config.scaling_factor


def start_image(seed=0):
    return PIL.Image.fromarray((np.random.default_rng(seed).random((SIZE, SIZE, 3)) * 255).astype(np.uint8))


@pytest.mark.parametrize("io_binding", [True, False])
def test_img2img_matches_diffusers_torch_sdxl_img2img(xl, io_binding):
    from diffusers import StableDiffusionXLImg2ImgPipeline

    torch_pipe, folder = xl
    torch_img2img = StableDiffusionXLImg2ImgPipeline(**torch_pipe.components)
    torch_img2img.set_progress_bar_config(disable=True)
    image = start_image()
    expected = torch_img2img(
        PROMPT,
        image=image_latents(torch_pipe, image),
        strength=0.6,
        num_inference_steps=5,
        generator=torch.Generator().manual_seed(1),
        output_type="np",
    ).images
    got = load(OnnxStableDiffusionXLImg2ImgPipeline, folder, io_binding)(
        PROMPT,
        image=image,
        strength=0.6,
        num_inference_steps=5,
        generator=torch.Generator().manual_seed(1),
        output_type="np",
    ).images
    np.testing.assert_allclose(got, expected, atol=TOLERANCE)


def test_the_refiner_layout_runs_with_its_aesthetic_score(refiner):
    torch_pipe, folder = refiner
    assert not (folder / "text_encoder").exists()
    pipe = load(OnnxStableDiffusionXLImg2ImgPipeline, folder)
    assert pipe.text_encoder is None and pipe.config.requires_aesthetics_score and pipe.time_ids_length == 5
    image = start_image(1)
    expected = torch_pipe(
        PROMPT,
        image=image_latents(torch_pipe, image),
        strength=0.5,
        num_inference_steps=4,
        aesthetic_score=7.0,
        generator=torch.Generator().manual_seed(2),
        output_type="np",
    ).images
    got = pipe(
        PROMPT,
        image=image,
        strength=0.5,
        num_inference_steps=4,
        aesthetic_score=7.0,
        generator=torch.Generator().manual_seed(2),
        output_type="np",
    ).images
    np.testing.assert_allclose(got, expected, atol=TOLERANCE)


def test_a_mismatched_aesthetics_setting_names_the_fix(refiner, tmp_path):
    import shutil

    _, folder = refiner
    copy = tmp_path / "refiner"
    shutil.copytree(folder, copy)
    index = json.loads((copy / "model_index.json").read_text())
    index["requires_aesthetics_score"] = False
    (copy / "model_index.json").write_text(json.dumps(index))
    pipe = load(OnnxStableDiffusionXLImg2ImgPipeline, copy)
    with pytest.raises(ValueError, match="requires_aesthetics_score"):
        pipe(PROMPT, image=start_image(), strength=0.5, num_inference_steps=2)


def test_save_pretrained_round_trips(xl, tmp_path):
    _, folder = xl
    pipe = load(OnnxStableDiffusionXLPipeline, folder)
    pipe.save_pretrained(tmp_path / "saved")
    again = load(OnnxStableDiffusionXLPipeline, tmp_path / "saved")
    kwargs = dict(height=SIZE, width=SIZE, num_inference_steps=2, latents=initial_latents(), output_type="np")
    np.testing.assert_array_equal(pipe(PROMPT, **kwargs).images, again(PROMPT, **kwargs).images)


def test_the_cli_exports_a_tiny_sdxl_offline(tmp_path):
    from optimum_iobinding.cli import main as cli_main

    assert cli_main(["export", "--tiny-random", "xl", "--output", str(tmp_path / "xl")]) == 0
    pipe = load(OnnxStableDiffusionXLPipeline, tmp_path / "xl")
    image = pipe(PROMPT, height=SIZE, width=SIZE, num_inference_steps=2, output_type="np").images
    assert image.shape == (1, SIZE, SIZE, 3)


@pytest.mark.slow
def test_an_ort_fused_sdxl_export_matches_the_plain_one(xl, tmp_path):
    torch_pipe, folder = xl
    fused = export_pipeline(None, tmp_path / "fused", torch_pipeline=torch_pipe, optimize="cpu", progress=False)
    kwargs = dict(height=SIZE, width=SIZE, num_inference_steps=2, latents=initial_latents(), output_type="np")
    np.testing.assert_allclose(
        load(OnnxStableDiffusionXLPipeline, fused)(PROMPT, **kwargs).images,
        load(OnnxStableDiffusionXLPipeline, folder)(PROMPT, **kwargs).images,
        atol=TOLERANCE,
    )


def test_cli_generate_picks_the_sdxl_pipeline_from_the_folder(xl, tmp_path, capsys):
    from optimum_iobinding.cli import main as cli_main

    _, folder = xl
    out = tmp_path / "xl.png"
    assert (
        cli_main(
            [
                "generate",
                "a cat",
                "--model",
                str(folder),
                "--steps",
                "1",
                "--height",
                "64",
                "--width",
                "64",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert "OnnxStableDiffusionXLPipeline" in capsys.readouterr().out and out.is_file()
