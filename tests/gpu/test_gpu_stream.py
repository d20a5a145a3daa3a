"""The real-time stream on the GPU (skipped without CUDA; SD, SDXL, with ControlNets): the host enqueues frames without
waiting, prepare makes every session and graph the frames use, the captured path equals the uncaptured one and the
CPU's, and frames() equals one call at a time."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import diffusers

from optimum_iobinding.bench.probes import host_waits

pytestmark = pytest.mark.gpu

CUDA = "CUDAExecutionProvider"
# exact comparisons: without TF32, fp32 convolutions and matmuls on Hopper round like the CPU's
EXACT = {"use_tf32": "0"}
SIZE = 64
PROMPT = "a photo of an astronaut riding a horse"
TURBO = ("EulerAncestralDiscreteScheduler", {"timestep_spacing": "trailing"})
# about a second of GPU time at the H100's clock: longer than the host takes to enqueue a few frames
SLEEP_CYCLES = 2_000_000_000


@pytest.fixture(scope="module")
def folders(tiny_folder, vae_folder, lcm, xl_folder, controlnet_folders, shared_export):
    """Each stream's folder and options: Stable Diffusion, with the tiny VAE, LCM, SDXL (with the tiny VAE), one and
    two ControlNets (a fixed control image each), SDXL with a ControlNet."""
    from optimum_iobinding.export import export_pipeline
    from optimum_iobinding.export.tiny import build_tiny_random_xl_controlnet_pipeline

    control = torch.rand(1, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(7))
    xl_controlnet = shared_export(  # the CPU test's export (tests/pipelines/test_stream_xl_controlnet.py)
        "xl-controlnet-stream",
        lambda t: export_pipeline(None, t, torch_pipeline=build_tiny_random_xl_controlnet_pipeline(), progress=False),
    )
    return {
        "xl-controlnet": (xl_controlnet, {"control_image": control}),
        "sd": (tiny_folder, {}),
        "tiny-vae": (tiny_folder, {"tiny_vae": vae_folder}),
        "lcm": (lcm[1], {}),
        "xl": (xl_folder, {}),
        "xl-tiny-vae": (xl_folder, {"tiny_vae": vae_folder}),
        "controlnet": (controlnet_folders["one"], {"control_image": control}),
        "controlnet-two": (
            controlnet_folders["two"],
            {"control_image": [control, control.flip(-1)], "controlnet_conditioning_scale": [0.6, 1.2]},
        ),
    }


PREPARE_OPTIONS = ("control_image", "controlnet_conditioning_scale")  # the others are from_pretrained's


def prepared(
    folder, steps=2, strength=0.5, guidance_scale=0.0, stream_batch=True, provider=CUDA, cfg_type="full", **kwargs
):
    from optimum_iobinding import OnnxStreamDiffusionPipeline

    if provider == CUDA:
        kwargs.setdefault("provider_options", EXACT)
    prepare_options = {name: kwargs.pop(name) for name in PREPARE_OPTIONS if name in kwargs}
    stream = OnnxStreamDiffusionPipeline.from_pretrained(folder, provider=provider, **kwargs)
    if "timestep_cond" not in stream.unet.input_names:
        name, overrides = TURBO
        stream.scheduler = getattr(diffusers, name).from_config(stream.scheduler.config, **overrides)
    stream.prepare(
        PROMPT,
        num_inference_steps=steps,
        strength=strength,
        guidance_scale=guidance_scale,
        seed=3,
        height=SIZE,
        width=SIZE,
        stream_batch=stream_batch,
        cfg_type=cfg_type,
        **prepare_options,
    )
    return stream


def cuda_frames(count, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.rand(3, SIZE, SIZE, generator=generator) * 2 - 1).cuda() for _ in range(count)]


def run(stream, frames):
    """Every frame's output, in order (the stream batch's late ones flushed)."""
    return [out for out in (stream(frame) for frame in frames) if out is not None] + stream.flush()


CASES = {  # (folder, steps, strength, guidance, stream batch)
    "turbo-one-step": ("sd", 2, 0.5, 0.0, True),
    "three-steps-stream-batch": ("sd", 6, 0.5, 0.0, True),
    "three-steps-one-at-a-time": ("sd", 6, 0.5, 0.0, False),
    "guidance-stream-batch": ("sd", 4, 0.5, 3.0, True),
    "tiny-vae": ("tiny-vae", 4, 0.5, 0.0, True),
    "lcm": ("lcm", 2, 0.5, 6.0, True),
    "rcfg-self-one-step": ("sd", 2, 0.5, 1.8, True),
    "rcfg-initialize-stream-batch": ("sd", 4, 0.5, 1.8, True),
    "xl-turbo-one-step": ("xl", 2, 0.5, 0.0, True),
    "xl-guidance-stream-batch": ("xl-tiny-vae", 4, 0.5, 3.0, True),
    "controlnet-one-step": ("controlnet", 2, 0.5, 0.0, True),
    "controlnets-guidance-stream-batch": ("controlnet-two", 4, 0.5, 3.0, True),
    "xl-controlnet-guidance-stream-batch": ("xl-controlnet", 4, 0.5, 3.0, True),
}
# the guidance type of a case (default "full"): StreamDiffusion's residual guidance, its stock noise on the device
CFG_TYPES = {"rcfg-self-one-step": "self", "rcfg-initialize-stream-batch": "initialize"}
STATEFUL = ("rcfg-self-one-step",)  # a frame's output depends on the frames before it (the stock noise)


def launches_held(stream, call, most=32):
    """How many calls of ``call`` the host enqueues behind the pipeline's busy stream before one waits for the device.

    That bound is the CUDA driver's, not the pipeline's: the driver holds only so many launches of some graphs in
    flight (measured on the H100 and H200: the 7th launch of the tiny UNet's batch-4 graph waits until the 1st has run,
    its batch-1 graph and the VAE's take 24 and more), as any bounded queue makes its producer wait. ``most``: if none
    waits by then."""
    torch.cuda.synchronize()
    with torch.cuda.stream(stream.stream):
        torch.cuda._sleep(SLEEP_CYCLES)
        slept = torch.cuda.Event()
        slept.record()
        for count in range(most):
            call()
            if slept.query():  # this call waited for the device to reach it
                break
        else:
            count = most
    torch.cuda.synchronize()
    return count


@pytest.mark.parametrize("case", list(CASES))
def test_the_host_enqueues_frames_without_waiting(folders, case):
    name, steps, strength, guidance, stream_batch = CASES[case]
    folder, options = folders[name]
    options = dict(options, cfg_type=CFG_TYPES.get(case, "full"))
    stream = prepared(folder, steps, strength, guidance, stream_batch, **options)
    # "self" carries its stock noise from frame to frame: the same frames again come out otherwise, so the expected
    # outputs are a twin stream's first run (the others: this stream's own earlier run)
    reference = prepared(folder, steps, strength, guidance, stream_batch, **options) if case in STATEFUL else stream
    k = len(stream.timesteps)
    # how many frames the host enqueues behind a busy stream before one waits: the driver's bound on launches in flight
    # (each frame's graphs: VAE encoder, ControlNets, UNet, VAE decoder), measured with whole frames of a stream
    # prepared alike (this one, its pending frames flushed after, where no state carries from frame to frame)
    meter = prepared(folder, steps, strength, guidance, stream_batch, **options) if case in STATEFUL else stream
    (frame,) = cuda_frames(1, seed=1)
    meter(frame), meter.flush()  # once through, so that nothing in the measured frames is a first time
    held = launches_held(meter, lambda: meter(frame))
    meter.flush()
    assert held >= 1, "a frame waited for the device before the host enqueued the next"
    # a stream batch's flush adds k − 1 steps after the frames; one frame at a time runs its k steps inside the frame
    count = min(6, held - (k - 1)) if stream_batch and k > 1 else min(6, held)
    assert count >= 1, f"the driver holds {held} frames in flight; a stream batch of {k} steps needs more"
    frames = cuda_frames(count)
    expected = [out.clone() for out in run(reference, frames)]
    torch.cuda.synchronize()
    with torch.cuda.stream(stream.stream):
        torch.cuda._sleep(SLEEP_CYCLES)  # the pipeline's stream is busy: a frame whose host work waited would wait here
        busy = torch.cuda.Event()
        busy.record()
    enqueued = time.perf_counter()
    got = run(stream, frames)
    still_busy, enqueued = not busy.query(), time.perf_counter() - enqueued
    torch.cuda.synchronize()
    waits = host_waits(lambda: run(stream, frames))  # the profiler's view of the same, the flush included
    assert waits == [], "\n".join(f"{waits.count(w)}× {w}" for w in sorted(set(waits)))
    assert still_busy, (
        f"the host waited for the GPU while it enqueued {count} frames in {enqueued:.3f} s (the driver holds {held} "
        "frames in flight)"
    )
    assert len(got) == count and all(out.is_cuda for out in got)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


@pytest.mark.parametrize("case", ["turbo-one-step", "three-steps-stream-batch", "three-steps-one-at-a-time"])
def test_no_session_or_graph_is_made_after_prepare(folders, case):
    name, steps, strength, guidance, stream_batch = CASES[case]
    folder, options = folders[name]
    stream = prepared(folder, steps, strength, guidance, stream_batch, **options)
    models = stream.onnx_models

    def made():
        return (
            stream.sessions_created,
            {name: len(model.graph_signatures) for name, model in models.items()},
            {name: len(model.signatures) for name, model in models.items()},
            stream.captured_graphs,
        )

    after_prepare = made()
    uncaptured = [name for name, model in models.items() if not model.graph_signatures]
    assert stream.captured_graphs > 0 and uncaptured == [], after_prepare
    uint8 = [((frame.permute(1, 2, 0) / 2 + 0.5) * 255).round().to(torch.uint8) for frame in cuda_frames(3)]
    for frames in (cuda_frames(3), uint8, [frame.cpu().numpy() for frame in uint8]):
        run(stream, frames)
    stream.update_prompt("a red car")
    run(stream, cuda_frames(2))
    torch.cuda.synchronize()
    assert made() == after_prepare


@pytest.mark.parametrize("case", list(CASES))
def test_captured_outputs_equal_the_uncaptured_stream_and_the_cpus(folders, case):
    name, steps, strength, guidance, stream_batch = CASES[case]
    folder, options = folders[name]
    options = dict(options, cfg_type=CFG_TYPES.get(case, "full"))
    frames = cuda_frames(4, seed=1)
    captured = run(prepared(folder, steps, strength, guidance, stream_batch, **options), frames)
    uncaptured_stream = prepared(folder, steps, strength, guidance, stream_batch, cuda_graph=False, **options)
    uncaptured = run(uncaptured_stream, frames)
    assert uncaptured_stream.captured_graphs == 0
    on_cpu = run(
        prepared(folder, steps, strength, guidance, stream_batch, provider="CPUExecutionProvider", **options),
        [frame.cpu() for frame in frames],
    )
    torch.testing.assert_close(captured, uncaptured, atol=1e-4, rtol=0)
    torch.testing.assert_close([out.cpu() for out in captured], on_cpu, atol=1e-3, rtol=0)


@pytest.mark.parametrize("case", ["turbo-one-step", "three-steps-stream-batch"])
def test_frames_with_numpy_frames_equals_one_call_at_a_time(folders, case):
    name, steps, strength, guidance, stream_batch = CASES[case]
    folder, options = folders[name]
    stream = prepared(folder, steps, strength, guidance, stream_batch, **options)
    frames = [
        np.asarray(((frame.permute(1, 2, 0) / 2 + 0.5) * 255).round().to(torch.uint8).cpu())
        for frame in cuda_frames(7, seed=2)
    ]
    one_by_one = run(stream, frames)
    streamed = list(stream.frames(frames))
    assert len(streamed) == len(frames)
    for got, expected in zip(streamed, one_by_one):
        assert isinstance(got, np.ndarray) and got.dtype == np.uint8
        np.testing.assert_array_equal(got, expected)


def test_an_output_the_caller_holds_is_not_overwritten_by_later_frames(folders):
    folder, options = folders["sd"]
    stream = prepared(folder, **options)
    frames = cuda_frames(3, seed=4)
    first = stream(frames[0])
    kept = first.clone()
    for frame in frames[1:]:
        stream(frame)
    torch.cuda.synchronize()
    torch.testing.assert_close(first, kept, atol=0, rtol=0)


def test_the_similarity_filter_decides_on_the_device_as_on_the_cpu(folders):
    from optimum_iobinding import OnnxStreamDiffusionPipeline

    folder, _ = folders["sd"]
    generator = torch.Generator().manual_seed(2)
    clip = [torch.rand(3, SIZE, SIZE, generator=generator) * 2 - 1]
    for _ in range(15):  # similarities about 0.98: skip probabilities near one half
        clip.append((clip[-1] + 0.12 * torch.randn(3, SIZE, SIZE, generator=generator)).clamp(-1, 1))
    outputs, skipped = {}, {}
    for provider in (CUDA, "CPUExecutionProvider"):
        options = {"provider_options": EXACT} if provider == CUDA else {}
        stream = OnnxStreamDiffusionPipeline.from_pretrained(folder, provider=provider, **options)
        name, overrides = TURBO
        stream.scheduler = getattr(diffusers, name).from_config(stream.scheduler.config, **overrides)
        stream.prepare(PROMPT, seed=3, height=SIZE, width=SIZE, similarity_threshold=0.95)
        device = "cuda" if provider == CUDA else "cpu"
        outputs[provider] = [stream(frame.to(device)).cpu() for frame in clip]
        skipped[provider] = stream.skipped_frames
    assert 0 < skipped[CUDA] == skipped["CPUExecutionProvider"] < len(clip) - 1
    torch.testing.assert_close(outputs[CUDA], outputs["CPUExecutionProvider"], atol=1e-3, rtol=0)
