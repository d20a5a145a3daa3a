"""The real-time stream with ControlNets, tiny random ControlNet exports (one and two ControlNets), CPU execution
provider: one step against diffusers' torch ``StableDiffusionControlNetImg2ImgPipeline`` on the same weights (a fixed
control image, one per frame, two ControlNets with their scales, guidance), a stream batch in which each frame keeps
its own control image, what loading such a folder as a stream gives, and the refusals."""

from __future__ import annotations

import diffusers
import pytest
import torch

from optimum_iobinding import OnnxStreamDiffusionControlNetPipeline, OnnxStreamDiffusionPipeline
from optimum_iobinding.export.tiny import build_tiny_random_controlnet_pipeline

SIZE = 64
PROMPT = "a photo of an astronaut riding a horse"
TOLERANCE = 1e-4
SEED = 3
TURBO = {"timestep_spacing": "trailing"}  # SD-Turbo's Euler ancestral: 2 steps at strength 0.5 are one step


@pytest.fixture(scope="module")
def reference(vae_encodes_its_mode):
    """``reference(controlnets)``: diffusers' torch ControlNet img2img pipeline with the exported weights (the
    builders are seeded; its VAE encoder giving the mode, as the export's does)."""

    def build(controlnets: int = 1):
        pipe = build_tiny_random_controlnet_pipeline(controlnets=controlnets)
        pipe = vae_encodes_its_mode(diffusers.StableDiffusionControlNetImg2ImgPipeline(**pipe.components))
        pipe.scheduler = diffusers.EulerAncestralDiscreteScheduler.from_config(pipe.scheduler.config, **TURBO)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    return build


def stream_for(folder):
    stream = OnnxStreamDiffusionPipeline.from_pretrained(folder)
    stream.scheduler = diffusers.EulerAncestralDiscreteScheduler.from_config(stream.scheduler.config, **TURBO)
    return stream


def frame(seed=0):
    """A float frame (3, SIZE, SIZE) in [-1, 1]."""
    return torch.rand(3, SIZE, SIZE, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def control(seed=0):
    """A float control image (1, 3, SIZE, SIZE) in [0, 1]."""
    return torch.rand(1, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(100 + seed))


def diffusers_img2img(pipe, image, control_image, **kwargs):
    """diffusers' ControlNet img2img, one step (no guidance unless given): a [-1, 1] frame in, a [-1, 1] image out."""
    kwargs.setdefault("guidance_scale", 0.0)
    images = pipe(
        PROMPT,
        image=image[None] / 2 + 0.5,
        control_image=control_image,
        strength=0.5,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(SEED),
        output_type="pt",
        **kwargs,
    ).images
    return images[0] * 2 - 1


def test_a_controlnet_folder_loads_as_the_controlnet_stream(controlnet_folders):
    stream = stream_for(controlnet_folders["two"])
    assert type(stream) is OnnxStreamDiffusionControlNetPipeline and len(stream.controlnets) == 2


@pytest.mark.parametrize(
    "call",
    [dict(guidance_scale=0.0), dict(guidance_scale=3.0, negative_prompt="a red car")],
    ids=["no-guidance", "guidance"],
)
def test_one_step_with_a_fixed_control_image_equals_diffusers(controlnet_folders, reference, call):
    expected = diffusers_img2img(reference(), frame(), control(), controlnet_conditioning_scale=0.7, **call)
    stream = stream_for(controlnet_folders["one"])
    stream.prepare(
        PROMPT, seed=SEED, height=SIZE, width=SIZE, control_image=control(), controlnet_conditioning_scale=0.7, **call
    )
    torch.testing.assert_close(stream(frame(0)), expected, atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(stream(frame(0)), expected, atol=TOLERANCE, rtol=0)  # the same control again


def test_each_frames_own_control_image_equals_diffusers_with_it(controlnet_folders, reference):
    pipe = reference()
    stream = stream_for(controlnet_folders["one"])
    stream.prepare(PROMPT, seed=SEED, height=SIZE, width=SIZE)
    outputs = [stream(frame(k), control_image=control(k)) for k in range(2)]
    for k, output in enumerate(outputs):
        torch.testing.assert_close(output, diffusers_img2img(pipe, frame(k), control(k)), atol=TOLERANCE, rtol=0)
    again = stream(frame(1))  # no control image: the last one given
    torch.testing.assert_close(again, outputs[1], atol=TOLERANCE, rtol=0)
    assert (diffusers_img2img(pipe, frame(1), control(0)) - outputs[1]).abs().max() > 10 * TOLERANCE  # it counts


def test_two_controlnets_each_with_its_control_image_and_scale_equal_diffusers(controlnet_folders, reference):
    images, scales = [control(0), control(1)], [0.6, 1.2]
    expected = diffusers_img2img(reference(2), frame(), images, controlnet_conditioning_scale=scales)
    stream = stream_for(controlnet_folders["two"])
    stream.prepare(
        PROMPT, seed=SEED, height=SIZE, width=SIZE, control_image=images, controlnet_conditioning_scale=scales
    )
    torch.testing.assert_close(stream(frame()), expected, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("guidance_scale", [0.0, 3.0], ids=["no-guidance", "guidance"])
def test_in_a_stream_batch_each_frame_keeps_its_control_image_through_its_steps(controlnet_folders, guidance_scale):
    outputs = {}
    for stream_batch in (False, True):
        stream = stream_for(controlnet_folders["one"])
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
        outputs[stream_batch] = [stream(frame(k), control_image=control(k)) for k in range(4)] + stream.flush()
    batched = outputs[True][2:]
    assert outputs[True][:2] == [None, None] and len(batched) == len(outputs[False]) == 4
    for got, expected in zip(batched, outputs[False]):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_a_frame_without_any_control_image_is_refused_before_any_work(controlnet_folders, refused_runs_nothing):
    stream = stream_for(controlnet_folders["one"])
    stream.prepare(PROMPT, seed=SEED, height=SIZE, width=SIZE)
    message = "control_image: expected a control image with the frame"
    assert refused_runs_nothing(stream, ValueError, message, lambda: stream(frame()))
    with pytest.raises(ValueError, match="control_image: frames\\(\\) gives every frame the last control image"):
        list(stream.frames([frame()]))
    with pytest.raises(ValueError, match="control_image: expected a list of 2 control images"):
        two = stream_for(controlnet_folders["two"])
        two.prepare(PROMPT, seed=SEED, height=SIZE, width=SIZE, control_image=control())
    with pytest.raises(ValueError, match="controlnet_conditioning_scale: expected 2 values"):
        two.prepare(PROMPT, seed=SEED, height=SIZE, width=SIZE, controlnet_conditioning_scale=[1.0, 1.0, 1.0])


def test_the_similarity_filter_keeps_a_frame_that_brings_a_new_control_image(controlnet_folders, reference):
    stream = stream_for(controlnet_folders["one"])
    stream.prepare(PROMPT, seed=SEED, height=SIZE, width=SIZE, control_image=control(0), similarity_threshold=0.5)
    stream(frame(0))
    new = stream(frame(0), control_image=control(1))  # the same pixels: the filter alone would skip it
    assert stream.skipped_frames == 0
    torch.testing.assert_close(new, diffusers_img2img(reference(), frame(0), control(1)), atol=TOLERANCE, rtol=0)
    stream(frame(0))  # no new control image: skipped
    assert stream.skipped_frames == 1


def test_a_refused_control_image_leaves_the_stream_as_it_was_prepared(controlnet_folders):
    stream = stream_for(controlnet_folders["one"])
    stream.prepare(PROMPT, seed=SEED, height=SIZE, width=SIZE, control_image=control(0))
    before = stream(frame())
    with pytest.raises(ValueError, match="control_image: expected a control image with 3 channels"):
        stream.prepare(PROMPT, seed=SEED, height=SIZE, width=SIZE, control_image=torch.rand(1, 4, SIZE, SIZE))
    torch.testing.assert_close(stream(frame()), before, atol=0, rtol=0)


def test_a_pooled_controlnet_under_guidance_is_refused_naming_it(controlnet_folders, tmp_path):
    import json
    import shutil

    folder = shutil.copytree(controlnet_folders["one"], tmp_path / "pooled")
    config = json.loads((folder / "controlnet" / "config.json").read_text())
    (folder / "controlnet" / "config.json").write_text(json.dumps({**config, "global_pool_conditions": True}))
    stream = stream_for(folder)
    with pytest.raises(ValueError, match="controlnet: a ControlNet with global_pool_conditions"):
        stream.prepare(PROMPT, seed=SEED, height=SIZE, width=SIZE, control_image=control(), guidance_scale=3.0)
    stream.prepare(PROMPT, seed=SEED, height=SIZE, width=SIZE, control_image=control())  # unguided: as diffusers
