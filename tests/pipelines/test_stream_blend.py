"""Prompt and seed blending on the stream, tiny random SD pipeline, CPU execution provider: a blend of prompts against
diffusers' img2img given the blended text embeddings, a blend of seeds against the one-step rule written out with the
blended noise, updates without a new prepare, and the refusals."""

from __future__ import annotations

import math

import diffusers
import pytest
import torch
from diffusers.utils.torch_utils import randn_tensor

from .test_stream import PROMPT, SEED, SIZE, TOLERANCE, TURBO, frames_of, stream_for

OTHER = "a red castle in the forest"


def embeddings_of(torch_pipe, text):
    with torch.no_grad():
        return torch_pipe.encode_prompt(text, "cpu", 1, False)[0]


def test_a_blend_of_prompts_equals_diffusers_img2img_with_the_blended_embeddings(sd):
    torch_pipe, folder = sd
    stream = stream_for(folder, TURBO)
    stream.prepare([(PROMPT, 3.0), (OTHER, 1.0)], seed=SEED, height=SIZE, width=SIZE)
    frame = frames_of(1)[0]
    blended = 0.75 * embeddings_of(torch_pipe, PROMPT) + 0.25 * embeddings_of(torch_pipe, OTHER)
    pipe = diffusers.StableDiffusionImg2ImgPipeline.from_pipe(torch_pipe)
    pipe.scheduler = getattr(diffusers, TURBO[0]).from_config(torch_pipe.scheduler.config, **TURBO[1])
    pipe.set_progress_bar_config(disable=True)
    expected = pipe(
        prompt_embeds=blended,
        image=frame[None] / 2 + 0.5,
        num_inference_steps=2,
        strength=0.5,
        guidance_scale=0.0,
        generator=torch.Generator().manual_seed(SEED),
        output_type="pt",
    ).images[0]
    torch.testing.assert_close(stream(frame), expected * 2 - 1, atol=TOLERANCE, rtol=0)


def test_update_prompt_with_a_blend_moves_between_prompts_in_place(sd):
    _, folder = sd
    stream = stream_for(folder, TURBO)
    stream.prepare(PROMPT, seed=SEED, height=SIZE, width=SIZE)
    frame = frames_of(1)[0]
    alone = stream(frame)
    before = stream.unet_inputs["encoder_hidden_states"]
    stream.update_prompt([(PROMPT, 1.0), (OTHER, 0.0)])  # a weight of 0: the first prompt alone
    torch.testing.assert_close(stream(frame), alone, atol=1e-6, rtol=0)
    stream.update_prompt([(PROMPT, 0.5), (OTHER, 0.5)])
    halfway = stream(frame)
    assert stream.unet_inputs["encoder_hidden_states"] is before  # the same tensor: nothing captured again
    stream.update_prompt(OTHER)
    other = stream(frame)
    assert (halfway - alone).abs().max() > 1e-3 and (halfway - other).abs().max() > 1e-3


def one_step_with_noise(torch_pipe, frame, timestep, alphas_cumprod, noise):
    """The stream's one step written out with the given noise: noise the frame's latents, predict x0, decode."""
    vae, unet = torch_pipe.vae, torch_pipe.unet
    scaling = vae.config.scaling_factor
    alpha = alphas_cumprod[int(timestep)]
    with torch.no_grad():
        latents = vae.encode(frame[None]).latent_dist.mode() * scaling
        sample = alpha.sqrt() * latents + (1 - alpha).sqrt() * noise
        eps = unet(sample, timestep, encoder_hidden_states=embeddings_of(torch_pipe, PROMPT)).sample
        x0 = (sample - (1 - alpha).sqrt() * eps) / alpha.sqrt()
        return vae.decode(x0 / scaling).sample[0].clamp(-1, 1)


def noise_of(seed):
    return randn_tensor((1, 4, SIZE // 8, SIZE // 8), generator=torch.Generator().manual_seed(seed))


def test_a_blend_of_seeds_is_the_unit_variance_mix_of_their_noises(sd):
    torch_pipe, folder = sd
    stream = stream_for(folder, TURBO)
    stream.prepare(PROMPT, seed=[(SEED, 2.0), (SEED + 1, 1.0)], height=SIZE, width=SIZE)
    frame = frames_of(1)[0]
    noise = (2.0 * noise_of(SEED) + 1.0 * noise_of(SEED + 1)) / math.sqrt(5.0)
    expected = one_step_with_noise(torch_pipe, frame, stream.timesteps[0], stream.scheduler.alphas_cumprod, noise)
    torch.testing.assert_close(stream(frame), expected, atol=TOLERANCE, rtol=0)
    # update_seed writes another noise in place: the same as a fresh prepare with that seed
    stream.update_seed(SEED + 1)
    updated = stream(frame)
    stream.prepare(PROMPT, seed=SEED + 1, height=SIZE, width=SIZE)
    torch.testing.assert_close(updated, stream(frame), atol=0, rtol=0)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            dict(prompt=[]),
            TypeError,
            r"prompt: expected a str \(a stream has one prompt\) or a list of \(str, weight\)",
        ),
        (
            dict(prompt=[("a", -1.0)]),
            ValueError,
            r"prompt: expected a finite weight ≥ 0 beside a str, got -1.0 at index 0",
        ),
        (dict(prompt=[("a", 0.0), ("b", 0)]), ValueError, r"prompt: expected weights that sum to more than 0"),
        (dict(prompt=[(3, 1.0)]), ValueError, r"prompt: expected .* got 3 in the pair at index 0"),
        (dict(seed=[(1, math.inf)]), ValueError, r"seed: expected a finite weight ≥ 0 beside a seed, got inf"),
        (
            dict(seed=[(-1, 1.0)]),
            ValueError,
            r"seed: expected an integer in \[0, 2\*\*64\) or a list .* got -1 in the pair",
        ),
        (dict(seed=[1, 2]), TypeError, r"seed: expected .* got 1 at index 0"),
    ],
)
def test_bad_blends_are_refused_by_name(sd, kwargs, error, match):
    stream = stream_for(sd[1], TURBO)
    arguments = dict(prompt=PROMPT, seed=SEED, height=SIZE, width=SIZE)
    arguments.update(kwargs)
    with pytest.raises(error, match=match):
        stream.prepare(**arguments)
    assert not stream.prepared
