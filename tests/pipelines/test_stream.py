"""The real-time stream pipeline on tiny random pipelines, CPU execution provider: one step against diffusers' torch
img2img pipelines (SD-Turbo's and other schedulers, guidance, a tiny VAE, LCM), several steps against a reference
written here from the scheduler's ``alphas_cumprod``, the stream batch against step-by-step frames, prompt updates,
every kind of frame, and the errors."""

from __future__ import annotations

import numpy as np
import PIL.Image
import pytest
import torch
import diffusers
from diffusers.utils.torch_utils import randn_tensor

from optimum_iobinding import OnnxStreamDiffusionPipeline
from optimum_iobinding.export import export_pipeline
from optimum_iobinding.export.tiny import build_tiny_random_tiny_vae

SIZE = 64  # 8×8 latents
PROMPT = "a photo of an astronaut riding a horse"
TOLERANCE = 1e-4
SEED = 3
# SD-Turbo's scheduler: trailing timesteps, so that num_inference_steps=2, strength=0.5 is one step at t=499
TURBO = ("EulerAncestralDiscreteScheduler", {"timestep_spacing": "trailing"})


@pytest.fixture(scope="module")
def tiny_vae(vae_folder):
    """A tiny random AutoencoderTiny and a folder of its export alone (vae_encoder/ and vae_decoder/): the builder is
    seeded."""
    return build_tiny_random_tiny_vae(), vae_folder


@pytest.fixture(scope="module")
def turbo(sd):
    """A stream prepared with SD-Turbo's recipe (one step), for the tests that leave it as it was."""
    stream = stream_for(sd[1], TURBO)
    stream.prepare(PROMPT, seed=SEED, height=SIZE, width=SIZE)
    return stream


def stream_for(folder, scheduler=None, **kwargs):
    stream = OnnxStreamDiffusionPipeline.from_pretrained(folder, **kwargs)
    if scheduler is not None:
        name, overrides = scheduler
        stream.scheduler = getattr(diffusers, name).from_config(stream.scheduler.config, **overrides)
    return stream


def frames_of(count, seed=0):
    """Float frames (3, SIZE, SIZE) in [-1, 1]."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.rand(3, SIZE, SIZE, generator=generator) * 2 - 1 for _ in range(count)]


def diffusers_img2img(torch_pipe, frame, scheduler, pipeline_class=None, vae=None, **kwargs):
    """diffusers' own img2img pipeline on the same weights: a [-1, 1] frame in, a [-1, 1] image out."""
    pipeline_class = pipeline_class or diffusers.StableDiffusionImg2ImgPipeline
    pipe = pipeline_class.from_pipe(torch_pipe, **({"vae": vae} if vae is not None else {}))
    if scheduler is not None:
        name, overrides = scheduler
        pipe.scheduler = getattr(diffusers, name).from_config(torch_pipe.scheduler.config, **overrides)
    pipe.set_progress_bar_config(disable=True)
    image = pipe(
        PROMPT, image=frame[None] / 2 + 0.5, generator=torch.Generator().manual_seed(SEED), output_type="pt", **kwargs
    ).images
    return image[0] * 2 - 1


# ------------------------------------------------------------------------------------------ against diffusers
@pytest.mark.parametrize(
    "scheduler",
    [
        TURBO,
        ("EulerDiscreteScheduler", {"timestep_spacing": "trailing"}),
        ("EulerDiscreteScheduler", {"timestep_spacing": "trailing", "prediction_type": "v_prediction"}),
        ("DDIMScheduler", {"timestep_spacing": "trailing", "set_alpha_to_one": True}),
        ("DPMSolverMultistepScheduler", {"timestep_spacing": "trailing"}),
    ],
    ids=["euler-ancestral", "euler", "euler-v", "ddim", "dpm++"],
)
def test_one_step_equals_diffusers_img2img(sd, scheduler):
    torch_pipe, folder = sd
    frame = frames_of(1)[0]
    expected = diffusers_img2img(torch_pipe, frame, scheduler, strength=0.5, num_inference_steps=2, guidance_scale=0.0)
    stream = stream_for(folder, scheduler)
    stream.prepare(PROMPT, num_inference_steps=2, strength=0.5, seed=SEED, height=SIZE, width=SIZE)
    assert len(stream.timesteps) == 1
    torch.testing.assert_close(stream(frame), expected, atol=TOLERANCE, rtol=0)


def test_one_step_with_the_numpy_baseline_equals_diffusers_img2img(sd):
    torch_pipe, folder = sd
    frame = frames_of(1)[0]
    expected = diffusers_img2img(torch_pipe, frame, TURBO, strength=0.5, num_inference_steps=2, guidance_scale=0.0)
    stream = stream_for(folder, TURBO, io_binding=False)
    stream.prepare(PROMPT, seed=SEED, height=SIZE, width=SIZE)
    torch.testing.assert_close(stream(frame), expected, atol=TOLERANCE, rtol=0)


def test_guidance_above_one_is_classifier_free_guidance_with_the_negative_prompt(sd):
    torch_pipe, folder = sd
    frame = frames_of(1)[0]
    expected = diffusers_img2img(
        torch_pipe, frame, TURBO, strength=0.5, num_inference_steps=2, guidance_scale=3.0, negative_prompt="a red car"
    )
    unguided = diffusers_img2img(torch_pipe, frame, TURBO, strength=0.5, num_inference_steps=2, guidance_scale=0.0)
    stream = stream_for(folder, TURBO)
    stream.prepare(PROMPT, negative_prompt="a red car", guidance_scale=3.0, seed=SEED, height=SIZE, width=SIZE)
    got = stream(frame)
    torch.testing.assert_close(got, expected, atol=TOLERANCE, rtol=0)
    assert (got - unguided).abs().max() > 100 * TOLERANCE  # the guidance did change the image


def test_a_tiny_vae_folder_replaces_the_folders_vae_and_equals_diffusers_with_that_autoencoder(sd, tiny_vae):
    torch_pipe, folder = sd
    vae, tiny_folder = tiny_vae
    frame = frames_of(1)[0]
    expected = diffusers_img2img(
        torch_pipe, frame, TURBO, vae=vae, strength=0.5, num_inference_steps=2, guidance_scale=0.0
    )
    stream = stream_for(folder, TURBO, tiny_vae=tiny_folder)
    assert str(tiny_folder) in stream.vae_encoder.model_path and str(tiny_folder) in stream.vae_decoder.model_path
    assert stream.vae_scaling_factor == 1.0
    stream.prepare(PROMPT, seed=SEED, height=SIZE, width=SIZE)
    torch.testing.assert_close(stream(frame), expected, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("steps,stream_batch", [(1, True), (2, False), (3, True)])
def test_an_lcm_folder_equals_diffusers_lcm_img2img(lcm, steps, stream_batch):
    # LCM's img2img draws the noise for each step after the first from the generator: the stream's fixed noise of
    # that step is the same draw, so its re-noising rule gives diffusers' images exactly
    torch_pipe, folder = lcm
    frames = frames_of(3)
    expected = [
        diffusers_img2img(
            torch_pipe,
            frame,
            None,
            diffusers.LatentConsistencyModelImg2ImgPipeline,
            strength=0.5,
            num_inference_steps=steps,
            guidance_scale=6.0,
        )
        for frame in frames
    ]
    stream = stream_for(folder)
    stream.prepare(
        PROMPT,
        num_inference_steps=steps,
        strength=0.5,
        guidance_scale=6.0,
        seed=SEED,
        height=SIZE,
        width=SIZE,
        stream_batch=stream_batch,
    )
    assert len(stream.timesteps) == steps
    got = [out for out in (stream(frame) for frame in frames) if out is not None] + stream.flush()
    for image, reference in zip(got, expected, strict=True):
        torch.testing.assert_close(image, reference, atol=TOLERANCE, rtol=0)


def reference_steps(torch_pipe, frame, timesteps, alphas_cumprod, seed):
    """StreamDiffusion's rule written out: noise the frame's latents to the first timestep, predict x0, re-noise it to
    the next timestep with that step's own noise (successive draws of one generator), and decode the last x0."""
    vae, unet = torch_pipe.vae, torch_pipe.unet
    scaling = vae.config.scaling_factor
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        embeddings = torch_pipe.encode_prompt(PROMPT, "cpu", 1, False)[0]
        latents = vae.encode(frame[None]).latent_dist.mode() * scaling
        noises = [randn_tensor(latents.shape, generator=generator) for _ in timesteps]
        x0 = latents
        for index, t in enumerate(timesteps):
            alpha = alphas_cumprod[int(t)]
            sample = alpha.sqrt() * x0 + (1 - alpha).sqrt() * noises[index]
            eps = unet(sample, t, encoder_hidden_states=embeddings).sample
            x0 = (sample - (1 - alpha).sqrt() * eps) / alpha.sqrt()
        return vae.decode(x0 / scaling).sample[0].clamp(-1, 1)


@pytest.mark.parametrize("stream_batch", [False, True])
def test_several_steps_re_noise_each_prediction_with_the_streams_fixed_noise(sd, stream_batch):
    torch_pipe, folder = sd
    stream = stream_for(folder, TURBO)
    stream.prepare(
        PROMPT, num_inference_steps=4, strength=0.75, seed=SEED, height=SIZE, width=SIZE, stream_batch=stream_batch
    )
    assert stream.timesteps == [749.0, 499.0, 249.0]
    frames = frames_of(2)
    got = [out for out in (stream(frame) for frame in frames) if out is not None] + stream.flush()
    for frame, image in zip(frames, got, strict=True):
        expected = reference_steps(torch_pipe, frame, stream.timesteps, stream.scheduler.alphas_cumprod, SEED)
        torch.testing.assert_close(image, expected, atol=TOLERANCE, rtol=0)


# ---------------------------------------------------------------------------------------------- stream batch
@pytest.mark.parametrize("steps", [2, 3])
def test_a_stream_batch_gives_the_step_by_step_outputs_k_minus_one_frames_later(sd, steps):
    _, folder = sd
    frames = frames_of(5, seed=1)
    outputs = {}
    for stream_batch in (False, True):
        stream = stream_for(folder, TURBO)
        stream.prepare(
            PROMPT,
            num_inference_steps=steps * 2,
            strength=0.5,
            seed=SEED,
            height=SIZE,
            width=SIZE,
            stream_batch=stream_batch,
        )
        assert len(stream.timesteps) == steps
        outputs[stream_batch] = [stream(frame) for frame in frames]
        assert stream.frames_in_flight == (steps - 1 if stream_batch else 0)
        outputs[stream_batch] += stream.flush()
        assert stream.frames_in_flight == 0
    assert outputs[True][: steps - 1] == [None] * (steps - 1)
    batched = outputs[True][steps - 1 :]
    assert len(batched) == len(frames) == len(outputs[False])
    for got, expected in zip(batched, outputs[False]):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_frames_yields_one_output_per_frame_in_order_equal_to_one_call_at_a_time(sd):
    _, folder = sd
    stream = stream_for(folder, TURBO)
    stream.prepare(PROMPT, num_inference_steps=6, strength=0.5, seed=SEED, height=SIZE, width=SIZE)
    frames = [np.asarray((frame.permute(1, 2, 0) / 2 + 0.5) * 255, dtype=np.uint8) for frame in frames_of(5)]
    one_by_one = [out for out in (stream(frame) for frame in frames) if out is not None] + stream.flush()
    streamed = list(stream.frames(iter(frames)))
    assert len(streamed) == len(frames)
    for got, expected in zip(streamed, one_by_one):
        np.testing.assert_array_equal(got, expected)
    early = stream.frames(frames)
    next(early)
    early.close()  # stopping early drops what was in flight: the stream takes new frames
    assert stream.frames_in_flight == 0


# ------------------------------------------------------------------------------------------------- prompts
def test_update_prompt_equals_a_fresh_prepare_and_keeps_the_unets_input_where_it_is(sd):
    _, folder = sd
    frames = frames_of(4)
    stream = stream_for(folder, TURBO)
    stream.prepare("a red car", num_inference_steps=4, strength=0.5, seed=SEED, height=SIZE, width=SIZE)
    assert len(stream.timesteps) == 2
    with stream.unet.watch_runs() as runs:
        stream(frames[0])
        stream.update_prompt(PROMPT)
        stream(frames[1])
    assert len(runs) == 2 and runs[0].inputs["encoder_hidden_states"] == runs[1].inputs["encoder_hidden_states"]
    # frame 0 took the old prompt for its first step; frames 1 to 3 the new one at both steps
    updated = [stream(frame) for frame in frames[2:]] + stream.flush()
    stream.prepare(PROMPT, num_inference_steps=4, strength=0.5, seed=SEED, height=SIZE, width=SIZE)
    fresh = [stream(frame) for frame in frames] + stream.flush()
    torch.testing.assert_close(updated, fresh[2:], atol=0, rtol=0)


def test_unet_inputs_are_what_every_frames_unet_call_is_given(sd):
    _, folder = sd
    stream = stream_for(folder, TURBO)
    assert stream.unet_inputs == {}
    stream.prepare(PROMPT, num_inference_steps=4, strength=0.5, seed=SEED, height=SIZE, width=SIZE)
    inputs = stream.unet_inputs
    assert sorted(inputs) == sorted(stream.unet.input_names) and inputs["sample"].shape[0] == len(stream.timesteps)
    with stream.unet.watch_runs() as runs:
        for frame in frames_of(3):
            stream(frame)
    addresses = {name: tensor.data_ptr() for name, tensor in inputs.items()}
    assert len(runs) == 3 and all(run.inputs == addresses for run in runs)


# -------------------------------------------------------------------------------------------------- frames
def test_every_kind_of_frame_comes_back_as_it_came(turbo):
    stream = turbo
    float_frame = frames_of(1)[0]
    pixels = ((float_frame.permute(1, 2, 0) / 2 + 0.5) * 255).round().to(torch.uint8)
    as_float = pixels.permute(2, 0, 1).float() / 255 * 2 - 1  # what the uint8 frames carry

    from_numpy = stream(pixels.numpy())
    assert isinstance(from_numpy, np.ndarray) and from_numpy.dtype == np.uint8 and from_numpy.shape == (SIZE, SIZE, 3)
    from_pil = stream(PIL.Image.fromarray(pixels.numpy()))
    assert isinstance(from_pil, PIL.Image.Image) and from_pil.mode == "RGB" and from_pil.size == (SIZE, SIZE)
    from_tensor = stream(pixels)
    assert from_tensor.dtype == torch.uint8 and from_tensor.shape == (SIZE, SIZE, 3)
    chw = stream(as_float)
    assert chw.dtype == torch.float32 and chw.shape == (3, SIZE, SIZE) and chw.abs().max() <= 1
    nchw = stream(as_float[None].double())
    assert nchw.dtype == torch.float64 and nchw.shape == (1, 3, SIZE, SIZE)
    half = stream(as_float.half())
    assert half.dtype == torch.float16 and half.shape == (3, SIZE, SIZE)

    rounded = ((chw / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0)
    for uint8_output in (from_numpy, np.asarray(from_pil), from_tensor.numpy()):
        np.testing.assert_array_equal(uint8_output, rounded.numpy())
    torch.testing.assert_close(nchw[0].float(), chw, atol=1e-6, rtol=0)


def test_a_frame_of_another_size_is_resized_on_the_device_to_the_prepared_size(turbo):
    stream = turbo
    frame = torch.rand(3, 48, 80, generator=torch.Generator().manual_seed(5)) * 2 - 1
    resized = torch.nn.functional.interpolate(
        frame[None], size=(SIZE, SIZE), mode="bilinear", align_corners=False, antialias=True
    )[0]
    got = stream(frame)
    assert got.shape == (3, SIZE, SIZE)
    torch.testing.assert_close(got, stream(resized), atol=1e-6, rtol=0)


def test_an_output_the_caller_holds_is_not_overwritten_by_later_frames(turbo):
    stream = turbo
    first_frame, second_frame = frames_of(2)
    first = stream(first_frame)
    kept = first.clone()
    stream(second_frame)
    torch.testing.assert_close(first, kept, atol=0, rtol=0)


# -------------------------------------------------------------------------------------------------- errors
def test_a_frame_before_prepare_is_refused_naming_prepare(sd):
    _, folder = sd
    stream = stream_for(folder)
    for call in (
        lambda: stream(frames_of(1)[0]),
        stream.flush,
        lambda: stream.frames([]),
        lambda: stream.update_prompt("x"),
    ):
        with pytest.raises(RuntimeError, match=r"prepare\(prompt"):
            call()


@pytest.mark.parametrize(
    "frame,error,match",
    [
        ([np.zeros((SIZE, SIZE, 3), np.uint8)], TypeError, "frame: expected a torch tensor .* got list"),
        (np.zeros((SIZE, SIZE, 3), np.float32), TypeError, "frame: expected a numpy array of dtype uint8"),
        (
            np.zeros((SIZE, SIZE, 4), np.uint8),
            ValueError,
            r"frame: expected a numpy array of shape \(height, width, 3\)",
        ),
        (np.zeros((3, SIZE, SIZE), np.uint8), ValueError, r"got shape \(3, 64, 64\)"),
        (
            torch.zeros(3, SIZE, SIZE, dtype=torch.int32),
            TypeError,
            "frame: expected a float tensor .* got dtype torch.int32",
        ),
        (torch.zeros(2, 3, SIZE, SIZE), ValueError, r"\(one frame a call\), got shape \(2, 3, 64, 64\)"),
        (torch.zeros(4, SIZE, SIZE), ValueError, r"frame: expected a float tensor of shape \(3, height, width\)"),
        (torch.zeros(3, 0, SIZE), ValueError, "frame: expected a non-empty frame"),
        (torch.zeros(SIZE, SIZE, 3, dtype=torch.uint8).to_sparse(), TypeError, "frame: expected a dense torch tensor"),
    ],
)
def test_a_wrong_frame_is_refused_naming_what_was_expected(turbo, frame, error, match):
    with pytest.raises(error, match=match):
        turbo(frame)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(prompt=["a", "b"]), TypeError, "prompt: expected a str"),
        (dict(negative_prompt=["a"]), TypeError, "negative_prompt: expected a str"),
        (dict(seed=-1), ValueError, r"seed: expected an integer in \[0, 2\*\*64\)"),
        (dict(seed=1.5), ValueError, "seed: expected an integer"),
        (dict(strength=0.0), ValueError, "strength: 0.0 of 2 steps leaves no denoising step"),
        (dict(strength=1.5), ValueError, r"strength: expected a value in \[0, 1\]"),
        (dict(num_inference_steps=0), ValueError, "num_inference_steps: expected a positive integer"),
        (dict(height=72), ValueError, "height and width: expected multiples of"),
        (dict(guidance_scale=float("nan")), ValueError, "guidance_scale: expected a finite number"),
        (dict(stream_batch="yes"), TypeError, "stream_batch: expected True or False"),
    ],
)
def test_bad_prepare_arguments_are_refused_before_any_work(turbo, kwargs, error, match):
    stream = turbo
    arguments = {**dict(prompt=PROMPT, seed=SEED, height=SIZE, width=SIZE), **kwargs}
    with pytest.raises(error, match=match):
        stream.prepare(**arguments)
    assert stream.prepared  # the stream prepared before is left as it was
    assert stream(frames_of(1)[0]).shape == (3, SIZE, SIZE)


def test_a_scheduler_that_is_not_variance_preserving_is_refused(sd):
    _, folder = sd
    stream = stream_for(folder)
    stream.scheduler = diffusers.EDMEulerScheduler()
    with pytest.raises(ValueError, match="scheduler: expected a variance-preserving noise schedule"):
        stream.prepare(PROMPT, seed=SEED, height=SIZE, width=SIZE)


def test_frames_with_frames_of_earlier_calls_in_flight_is_refused_naming_flush(sd):
    _, folder = sd
    stream = stream_for(folder, TURBO)
    stream.prepare(PROMPT, num_inference_steps=4, strength=0.5, seed=SEED, height=SIZE, width=SIZE)
    assert stream(frames_of(1)[0]) is None
    with pytest.raises(RuntimeError, match=r"frames: expected an empty stream batch, got 1 frames .* flush\(\)"):
        stream.frames([])
    assert len(stream.flush()) == 1


def test_warmup_points_to_prepare(sd):
    _, folder = sd
    with pytest.raises(TypeError, match=r"warms up in prepare\(prompt"):
        stream_for(folder).warmup(heights=SIZE)


def test_a_tiny_vae_folder_without_both_components_is_refused_naming_it(sd, tiny_vae, tmp_path):
    _, folder = sd
    _, tiny_folder = tiny_vae
    partial = tmp_path / "partial"
    (partial / "vae_encoder").mkdir(parents=True)
    (partial / "vae_encoder" / "model.onnx").write_bytes((tiny_folder / "vae_encoder" / "model.onnx").read_bytes())
    with pytest.raises(
        FileNotFoundError,
        match=r"tiny_vae: expected an AutoencoderTiny export .* without "
        r"vae_decoder/model.onnx",
    ):
        OnnxStreamDiffusionPipeline.from_pretrained(folder, tiny_vae=partial)
    with pytest.raises(TypeError, match="tiny_vae: expected a folder or hub id"):
        OnnxStreamDiffusionPipeline.from_pretrained(folder, tiny_vae=3)
    with pytest.raises(FileNotFoundError, match="tiny_vae: expected an existing local folder or a hub repository id"):
        OnnxStreamDiffusionPipeline.from_pretrained(folder, tiny_vae=str(tmp_path / "none" / "here"))


def test_a_full_vae_given_as_the_tiny_vae_is_refused_naming_it(sd):
    """The pipeline's folder itself holds a full VAE (AutoencoderKL): as a tiny VAE it would decode with the tiny
    one's scaling and make wrong frames without an error."""
    _, folder = sd
    with pytest.raises(ValueError, match=r"tiny_vae: expected an AutoencoderTiny export .* whose vae_encoder is an "):
        OnnxStreamDiffusionPipeline.from_pretrained(folder, tiny_vae=folder)


def test_a_tiny_vae_of_other_latent_channels_is_refused_naming_it(sd, tmp_path):
    _, folder = sd
    other = export_pipeline(
        None, tmp_path / "taesd8", tiny_vae=build_tiny_random_tiny_vae(latent_channels=8), progress=False
    )
    with pytest.raises(
        ValueError,
        match=r"tiny_vae: .* expected a VAE with 4 latent channels \(the UNet's sample "
        r"channels\), got 8",
    ):
        OnnxStreamDiffusionPipeline.from_pretrained(folder, tiny_vae=other)
