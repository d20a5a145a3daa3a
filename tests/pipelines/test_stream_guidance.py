"""The stream's guidance types (StreamDiffusion's ``cfg_type``) on the tiny random SD pipeline, CPU execution
provider: residual classifier-free guidance ("self", "initialize") against StreamDiffusion's own formulas, written out
here from its pipeline (prepare, encode_image, predict_x0_batch, unet_step, scheduler_step_batch) over diffusers'
torch UNet and VAE on the same weights, with one step and with a stream batch of two; "none" and "full"; the
refusals."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers.utils.torch_utils import randn_tensor

from .test_stream import PROMPT, SEED, SIZE, TOLERANCE, TURBO, frames_of, stream_for

# SD-Turbo's scheduler: 2 steps at strength 0.5 is one step (t = 499); 4 at 0.5 two (499, 249)
RECIPES = {1: dict(num_inference_steps=2, strength=0.5), 2: dict(num_inference_steps=4, strength=0.5)}


def streamdiffusion(torch_pipe, frames, timesteps, alphas_cumprod, cfg_type, guidance_scale, delta):
    """StreamDiffusion's ``__call__`` with ``use_denoising_batch=True`` and ``frame_buffer_size=1``, its scheduler's
    ``c_skip = 0``, ``c_out = 1`` (an ε scheduler without a boundary condition), and the stream's noise drawn per step
    from one generator as the stream draws it. Returns its output for every call (a stream batch of k gives frame
    n − k + 1's at call n; the first k − 1 outputs belong to no frame)."""
    vae, unet = torch_pipe.vae, torch_pipe.unet
    scaling = vae.config.scaling_factor
    k = len(timesteps)
    alpha = torch.stack([alphas_cumprod[int(t)].sqrt() for t in timesteps]).reshape(k, 1, 1, 1)
    beta = torch.stack([(1 - alphas_cumprod[int(t)]).sqrt() for t in timesteps]).reshape(k, 1, 1, 1)
    t_list = torch.tensor(timesteps)
    generator = torch.Generator().manual_seed(SEED)
    init_noise = torch.cat([randn_tensor((1, 4, SIZE // 8, SIZE // 8), generator=generator) for _ in range(k)])
    stock = torch.zeros_like(init_noise)  # prepare: stock_noise = zeros_like(init_noise)
    buffer = torch.zeros_like(init_noise[1:])  # prepare: x_t_latent_buffer = zeros
    one = torch.ones_like(alpha[:1])
    outputs = []
    with torch.no_grad():
        text, negative = torch_pipe.encode_prompt(PROMPT, "cpu", 1, True)
        embeds = text.repeat(k, 1, 1)
        if cfg_type == "initialize":
            embeds = torch.cat([negative, embeds])
        for frame in frames:
            latent = vae.encode(frame[None]).latent_dist.mode() * scaling
            x_t = alpha[:1] * latent + beta[:1] * init_noise[:1]  # encode_image: add_noise(…, init_noise[0], 0)
            if k > 1:  # predict_x0_batch
                x_t = torch.cat([x_t, buffer])
                stock = torch.cat([init_noise[:1], stock[:-1]])
            # unet_step
            if cfg_type == "initialize":
                x_in, t_in = torch.cat([x_t[:1], x_t]), torch.cat([t_list[:1], t_list])
            else:
                x_in, t_in = x_t, t_list
            model_pred = unet(x_in, t_in, encoder_hidden_states=embeds).sample
            if cfg_type == "initialize":
                text_pred = model_pred[1:]
                stock = torch.cat([model_pred[:1], stock[1:]])
            else:
                text_pred = model_pred
            uncond = stock * delta
            model_pred = uncond + guidance_scale * (text_pred - uncond)
            denoised = (x_t - beta * model_pred) / alpha  # scheduler_step_batch: c_out · F_θ + c_skip · x_t
            delta_x = (beta * stock - beta * model_pred) / alpha
            delta_x = torch.cat([alpha[1:], one]) * delta_x / torch.cat([beta[1:], one])
            stock = torch.cat([init_noise[1:], init_noise[:1]]) + delta_x
            if k > 1:
                buffer = alpha[1:] * denoised[:-1] + beta[1:] * init_noise[1:]
            outputs.append(vae.decode(denoised[-1:] / scaling).sample[0].clamp(-1, 1))
    return outputs


@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("cfg_type", ["self", "initialize"])
def test_residual_guidance_equals_streamdiffusions_formulas(sd, cfg_type, steps):
    torch_pipe, folder = sd
    stream = stream_for(folder, TURBO)
    stream.prepare(
        PROMPT,
        guidance_scale=1.8,
        cfg_type=cfg_type,
        delta=0.7,
        seed=SEED,
        height=SIZE,
        width=SIZE,
        **RECIPES[steps],
    )
    frames = frames_of(4, seed=5)
    got = [out for out in (stream(frame) for frame in frames) if out is not None] + stream.flush()
    expected = streamdiffusion(
        torch_pipe, frames, stream.timesteps, stream.scheduler.alphas_cumprod, cfg_type, 1.8, 0.7
    )
    expected = expected[steps - 1 :]  # the first k − 1 calls give no frame's output
    assert len(got) == len(frames) and len(expected) == len(frames) - steps + 1
    for image, reference in zip(got, expected):
        torch.testing.assert_close(image, reference, atol=TOLERANCE, rtol=0)
    # "self" with one step: the stock noise carries from frame to frame, so the same frame later in the stream comes
    # out otherwise ("initialize" sets it from the frame's own negative prediction first)
    if steps == 1 and cfg_type == "self":
        again = stream(frames[0])
        assert (again - got[0]).abs().max() > 1e-3


def test_the_unet_batch_of_each_guidance_type(sd):
    _, folder = sd
    stream = stream_for(folder, TURBO)
    rows = {}
    for cfg_type in ("none", "full", "self", "initialize"):
        stream.prepare(PROMPT, guidance_scale=2.0, cfg_type=cfg_type, seed=SEED, height=SIZE, width=SIZE, **RECIPES[2])
        rows[cfg_type] = stream.unet_inputs["sample"].shape[0]
    # two steps in a stream batch: a row per step, twice for "full", one negative row more for "initialize"
    assert rows == {"none": 2, "full": 4, "self": 2, "initialize": 3}


def test_guidance_type_none_ignores_the_guidance_scale(sd):
    _, folder = sd
    frame = frames_of(1)[0]
    outputs = []
    for guidance_scale, cfg_type in ((0.0, "full"), (3.0, "none")):
        stream = stream_for(folder, TURBO)
        stream.prepare(PROMPT, guidance_scale=guidance_scale, cfg_type=cfg_type, seed=SEED, height=SIZE, width=SIZE)
        outputs.append(stream(frame))
    torch.testing.assert_close(outputs[0], outputs[1], atol=0, rtol=0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(cfg_type="residual"), r"cfg_type: expected one of 'none', 'full', 'self', 'initialize', got 'residual'"),
        (dict(cfg_type="self", delta=math.nan), r"delta: expected a finite number, got nan"),
        (dict(cfg_type="self", delta="1"), r"delta: expected a finite number, got '1'"),
        (
            dict(cfg_type="self", num_inference_steps=4, strength=0.5, stream_batch=False),
            r"cfg_type: 'self' over 2 steps expects the stream batch .*, got the stream batch off",
        ),
    ],
)
def test_bad_guidance_arguments_are_refused_by_name(sd, kwargs, match):
    stream = stream_for(sd[1], TURBO)
    with pytest.raises(ValueError, match=match):
        stream.prepare(PROMPT, guidance_scale=2.0, seed=SEED, height=SIZE, width=SIZE, **kwargs)
    assert stream.frames_in_flight == 0 and not stream.prepared


def test_residual_guidance_refuses_a_scheduler_that_does_not_predict_noise(sd):
    stream = stream_for(
        sd[1], ("EulerDiscreteScheduler", {"timestep_spacing": "trailing", "prediction_type": "v_prediction"})
    )
    with pytest.raises(ValueError, match=r"cfg_type: 'initialize' expects a scheduler with prediction_type='epsilon'"):
        stream.prepare(PROMPT, guidance_scale=2.0, cfg_type="initialize", seed=SEED, height=SIZE, width=SIZE)
