"""The real-time stream on an SDXL folder (SDXL-Turbo's recipe: one step), tiny random SDXL export, CPU execution
provider: against diffusers' torch ``StableDiffusionXLImg2ImgPipeline`` on the same weights (one step, with and
without guidance, a tiny VAE, a blend of prompts), and what loading an SDXL folder as a stream gives."""

from __future__ import annotations

import diffusers
import pytest
import torch

from optimum_iobinding import OnnxStreamDiffusionPipeline, OnnxStreamDiffusionXLPipeline
from optimum_iobinding.export.tiny import build_tiny_random_tiny_vae, build_tiny_random_xl_pipeline

SIZE = 64  # 8×8 latents
PROMPT = "a photo of an astronaut riding a horse"
TOLERANCE = 1e-4
SEED = 3
# SDXL-Turbo's scheduler: Euler ancestral with trailing timesteps, so that 2 steps at strength 0.5 are one step
TURBO = {"timestep_spacing": "trailing"}


@pytest.fixture(scope="module")
def xl(xl_folder, vae_encodes_its_mode):
    """diffusers' torch SDXL pipeline with the weights of the tiny random export (the builder is seeded; its VAE
    encoder giving the mode, as the export's does) and the export."""
    torch_pipe = build_tiny_random_xl_pipeline()
    torch_pipe.set_progress_bar_config(disable=True)
    return vae_encodes_its_mode(torch_pipe), xl_folder


def stream_for(folder, **kwargs):
    stream = OnnxStreamDiffusionPipeline.from_pretrained(folder, **kwargs)
    stream.scheduler = diffusers.EulerAncestralDiscreteScheduler.from_config(stream.scheduler.config, **TURBO)
    return stream


def frame(seed=0):
    """A float frame (3, SIZE, SIZE) in [-1, 1]."""
    return torch.rand(3, SIZE, SIZE, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def diffusers_img2img(torch_pipe, image, vae=None, **kwargs):
    """diffusers' SDXL img2img on the same weights, SDXL-Turbo's one step: a [-1, 1] frame in, a [-1, 1] image out."""
    pipe = diffusers.StableDiffusionXLImg2ImgPipeline.from_pipe(torch_pipe, **({"vae": vae} if vae is not None else {}))
    pipe.scheduler = diffusers.EulerAncestralDiscreteScheduler.from_config(torch_pipe.scheduler.config, **TURBO)
    pipe.set_progress_bar_config(disable=True)
    kwargs.setdefault("prompt", PROMPT)
    images = pipe(
        image=image[None] / 2 + 0.5,
        strength=0.5,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(SEED),
        output_type="pt",
        **kwargs,
    ).images
    return images[0] * 2 - 1


def test_an_sdxl_folder_loads_as_the_sdxl_stream_with_sdxls_conditioning(xl):
    _, folder = xl
    stream = stream_for(folder)
    assert type(stream) is OnnxStreamDiffusionXLPipeline
    stream.prepare(PROMPT, seed=SEED, height=SIZE, width=SIZE, guidance_scale=3.0)
    inputs = stream.unet_inputs
    assert inputs["time_ids"].tolist() == [[SIZE, SIZE, 0, 0, SIZE, SIZE]] * 2  # a negative row and a text row
    assert inputs["text_embeds"].shape[0] == inputs["encoder_hidden_states"].shape[0] == 2
    assert torch.equal(inputs["text_embeds"][0], torch.zeros_like(inputs["text_embeds"][0]))  # no negative prompt


@pytest.mark.parametrize(
    "call",
    [dict(guidance_scale=0.0), dict(guidance_scale=3.0, negative_prompt="a red car"), dict(guidance_scale=3.0)],
    ids=["no-guidance", "negative-prompt", "zeros-for-the-empty-negative"],
)
def test_one_step_equals_diffusers_sdxl_img2img(xl, call):
    torch_pipe, folder = xl
    expected = diffusers_img2img(torch_pipe, frame(), **call)
    stream = stream_for(folder)
    stream.prepare(PROMPT, seed=SEED, height=SIZE, width=SIZE, **call)
    assert len(stream.timesteps) == 1
    torch.testing.assert_close(stream(frame()), expected, atol=TOLERANCE, rtol=0)


def test_a_tiny_vae_replaces_the_sdxl_vae_and_equals_diffusers_with_that_autoencoder(xl, vae_folder):
    torch_pipe, folder = xl
    expected = diffusers_img2img(torch_pipe, frame(), vae=build_tiny_random_tiny_vae(), guidance_scale=0.0)
    stream = stream_for(folder, tiny_vae=vae_folder)
    assert str(vae_folder) in stream.vae_decoder.model_path
    stream.prepare(PROMPT, seed=SEED, height=SIZE, width=SIZE)
    torch.testing.assert_close(stream(frame()), expected, atol=TOLERANCE, rtol=0)


def test_a_prompt_blend_averages_both_embeddings_and_equals_diffusers_given_them(xl):
    torch_pipe, folder = xl
    blend = [("a photo of a cat", 0.75), ("an oil painting of a dog", 0.25)]
    encoded = [torch_pipe.encode_prompt(text, device="cpu", do_classifier_free_guidance=False) for text, _ in blend]
    embeds = sum(weight * parts[0] for parts, (_, weight) in zip(encoded, blend))
    pooled = sum(weight * parts[2] for parts, (_, weight) in zip(encoded, blend))
    expected = diffusers_img2img(
        torch_pipe, frame(), prompt=None, prompt_embeds=embeds, pooled_prompt_embeds=pooled, guidance_scale=0.0
    )
    stream = stream_for(folder)
    stream.prepare(blend, seed=SEED, height=SIZE, width=SIZE)
    torch.testing.assert_close(stream(frame()), expected, atol=TOLERANCE, rtol=0)
    single = stream_for(folder)
    single.prepare(blend[0][0], seed=SEED, height=SIZE, width=SIZE)
    assert (single(frame()) - expected).abs().max() > 100 * TOLERANCE  # the second prompt did count


def test_a_saved_sdxl_stream_loads_again_as_one_and_gives_the_same_frame(xl, tmp_path):
    _, folder = xl
    stream = stream_for(folder)
    stream.prepare(PROMPT, seed=SEED, height=SIZE, width=SIZE)
    expected = stream(frame())
    stream.save_pretrained(tmp_path / "saved")
    again = stream_for(tmp_path / "saved")
    assert type(again) is OnnxStreamDiffusionXLPipeline
    again.prepare(PROMPT, seed=SEED, height=SIZE, width=SIZE)
    torch.testing.assert_close(again(frame()), expected, atol=1e-6, rtol=0)


def test_an_sdxl_lora_on_the_unet_and_second_text_encoder_equals_diffusers_with_it(
    xl, tmp_path, make_lora, vae_encodes_its_mode
):
    _, folder = xl
    targets = dict(unet_targets=["to_q", "to_v"], text_targets=["q_proj"], text_encoder="text_encoder_2")
    make_lora(build_tiny_random_xl_pipeline(), tmp_path / "lora", 3, **targets)
    stream = stream_for(folder)
    stream.prepare(PROMPT, seed=SEED, height=SIZE, width=SIZE)
    base = stream(frame())
    stream.load_lora_weights(str(tmp_path / "lora"), adapter_name="x")
    stream.update_prompt(PROMPT)  # the text encoder's LoRA reaches the prompt's embeddings once it is encoded again
    reference = vae_encodes_its_mode(build_tiny_random_xl_pipeline())
    reference.load_lora_weights(str(tmp_path / "lora"), adapter_name="x")
    got = stream(frame())
    torch.testing.assert_close(got, diffusers_img2img(reference, frame(), guidance_scale=0.0), atol=TOLERANCE, rtol=0)
    assert (got - base).abs().max() > 100 * TOLERANCE


@pytest.fixture(scope="module")
def refiner(tmp_path_factory, vae_encodes_its_mode):
    """SDXL's refiner layout (only the second text encoder; the aesthetic score in time_ids) and its export."""
    from diffusers import UNet2DConditionModel

    from optimum_iobinding.export import export_pipeline

    base = build_tiny_random_xl_pipeline()
    torch.manual_seed(3)
    unet = UNet2DConditionModel(
        **{**base.unet.config, "projection_class_embeddings_input_dim": 5 * 8 + 32, "cross_attention_dim": 32}
    )
    torch_pipe = diffusers.StableDiffusionXLImg2ImgPipeline(
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
    return vae_encodes_its_mode(torch_pipe), folder


def test_a_refiner_folder_streams_with_the_aesthetic_scores_of_its_rows(refiner):
    torch_pipe, folder = refiner
    call = dict(guidance_scale=3.0, negative_prompt="a red car")
    expected = diffusers_img2img(torch_pipe, frame(), **call)
    stream = stream_for(folder)
    stream.prepare(PROMPT, seed=SEED, height=SIZE, width=SIZE, **call)
    assert stream.unet_inputs["time_ids"].tolist() == [[SIZE, SIZE, 0, 0, 2.5], [SIZE, SIZE, 0, 0, 6.0]]
    torch.testing.assert_close(stream(frame()), expected, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("guidance_scale", [0.0, 3.0], ids=["no-guidance", "guidance"])
def test_an_sdxl_stream_batch_gives_the_step_by_step_outputs_two_frames_later(xl, guidance_scale):
    _, folder = xl
    outputs = {}
    for stream_batch in (False, True):
        stream = stream_for(folder)
        stream.prepare(
            PROMPT,
            num_inference_steps=6,
            strength=0.5,
            guidance_scale=guidance_scale,
            seed=SEED,
            height=SIZE,
            width=SIZE,
            stream_batch=stream_batch,
        )
        outputs[stream_batch] = [stream(frame(k)) for k in range(4)] + stream.flush()
    assert outputs[True][:2] == [None, None]
    for got, expected in zip(outputs[True][2:], outputs[False], strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
