"""The real-time SDXL stream with ControlNets, a tiny random SDXL ControlNet export, CPU execution provider: one step
against diffusers' torch ``StableDiffusionXLControlNetImg2ImgPipeline`` on the same weights (with and without
guidance, a control image per frame), a stream batch in which each frame keeps its own control image, and what
loading such a folder as a stream gives."""

from __future__ import annotations

import diffusers
import pytest
import torch

from optimum_iobinding import OnnxStreamDiffusionXLControlNetPipeline
from optimum_iobinding.export.tiny import build_tiny_random_xl_controlnet_pipeline

# the ControlNet stream's tests' frames, control images, stream and diffusers reference (SD-Turbo's one step)
from tests.pipelines.test_stream_controlnet import (
    PROMPT,
    SEED,
    SIZE,
    TOLERANCE,
    TURBO,
    control,
    diffusers_img2img,
    frame,
    stream_for,
)


@pytest.fixture(scope="module")
def folder(shared_export):
    from optimum_iobinding.export import export_pipeline

    return shared_export(
        "xl-controlnet-stream",
        lambda t: export_pipeline(None, t, torch_pipeline=build_tiny_random_xl_controlnet_pipeline(), progress=False),
    )


@pytest.fixture
def reference(vae_encodes_its_mode):
    pipe = build_tiny_random_xl_controlnet_pipeline()
    pipe = vae_encodes_its_mode(diffusers.StableDiffusionXLControlNetImg2ImgPipeline(**pipe.components))
    pipe.scheduler = diffusers.EulerAncestralDiscreteScheduler.from_config(pipe.scheduler.config, **TURBO)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize(
    "call",
    [dict(guidance_scale=0.0), dict(guidance_scale=3.0, negative_prompt="a red car")],
    ids=["no-guidance", "guidance"],
)
def test_an_sdxl_controlnet_stream_equals_diffusers_sdxl_controlnet_img2img(folder, reference, call):
    stream = stream_for(folder)
    assert type(stream) is OnnxStreamDiffusionXLControlNetPipeline
    expected = diffusers_img2img(reference, frame(), control(), controlnet_conditioning_scale=0.7, **call)
    stream.prepare(
        PROMPT, seed=SEED, height=SIZE, width=SIZE, control_image=control(), controlnet_conditioning_scale=0.7, **call
    )
    torch.testing.assert_close(stream(frame()), expected, atol=TOLERANCE, rtol=0)
    # a control image per frame: the next frame's own
    expected = diffusers_img2img(reference, frame(1), control(1), controlnet_conditioning_scale=0.7, **call)
    torch.testing.assert_close(stream(frame(1), control_image=control(1)), expected, atol=TOLERANCE, rtol=0)
    assert set(stream.control_inputs[0]) >= {"text_embeds", "time_ids"}


def test_a_stream_batch_keeps_each_frames_control_image(folder):
    """Three steps in a stream batch give, k − 1 frames late, what the same stream gives one step after another."""
    outputs = {}
    for batched in (True, False):
        stream = stream_for(folder)
        stream.prepare(
            PROMPT, num_inference_steps=6, strength=0.5, seed=SEED, height=SIZE, width=SIZE, stream_batch=batched
        )
        got = [stream(frame(i), control_image=control(i)) for i in range(4)]
        if batched:
            got = [out for out in got if out is not None] + stream.flush()
        outputs[batched] = got
    for batched, one_by_one in zip(outputs[True], outputs[False]):
        torch.testing.assert_close(batched, one_by_one, atol=TOLERANCE, rtol=0)
