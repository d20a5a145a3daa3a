"""The real-time stream on the GPU (skipped without CUDA): the host enqueues frames without waiting, prepare makes
every session and graph the frames use, the captured path equals the uncaptured one and the CPU's, and frames()
equals one call at a time."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import diffusers

from conftest import requires_cuda
from optimum_iobinding.bench.probes import host_waits

pytestmark = requires_cuda

CUDA = "CUDAExecutionProvider"
# exact comparisons: without TF32, fp32 convolutions and matmuls on Hopper round like the CPU's
EXACT = {"use_tf32": "0"}
SIZE = 64
PROMPT = "a photo of an astronaut riding a horse"
TURBO = ("EulerAncestralDiscreteScheduler", {"timestep_spacing": "trailing"})
# about a second of GPU time at the H100's clock: longer than the host takes to enqueue a few frames
SLEEP_CYCLES = 2_000_000_000


@pytest.fixture(scope="module")
def folders(tiny_folder, tmp_path_factory):
    from optimum_iobinding.export import export_pipeline

    lcm = export_pipeline(None, tmp_path_factory.mktemp("gpu-stream") / "lcm", tiny_random="lcm", progress=False)
    tiny_vae = export_pipeline(None, tmp_path_factory.mktemp("gpu-stream") / "taesd", tiny_vae=True, progress=False)
    return {"sd": (tiny_folder, {}), "tiny-vae": (tiny_folder, {"tiny_vae": tiny_vae}), "lcm": (lcm, {})}


def prepared(folder, steps=2, strength=0.5, guidance_scale=0.0, stream_batch=True, provider=CUDA, **kwargs):
    from optimum_iobinding import OnnxStreamDiffusionPipeline

    if provider == CUDA:
        kwargs.setdefault("provider_options", EXACT)
    stream = OnnxStreamDiffusionPipeline.from_pretrained(folder, provider=provider, **kwargs)
    if "timestep_cond" not in stream.unet.input_names:
        name, overrides = TURBO
        stream.scheduler = getattr(diffusers, name).from_config(stream.scheduler.config, **overrides)
    stream.prepare(PROMPT, num_inference_steps=steps, strength=strength, guidance_scale=guidance_scale, seed=3,
                   height=SIZE, width=SIZE, stream_batch=stream_batch)
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
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_host_enqueues_frames_without_waiting(folders, case):
    name, steps, strength, guidance, stream_batch = CASES[case]
    folder, options = folders[name]
    stream = prepared(folder, steps, strength, guidance, stream_batch, **options)
    frames = cuda_frames(6)
    expected = [out.clone() for out in run(stream, frames)]
    torch.cuda.synchronize()
    with torch.cuda.stream(stream.stream):
        torch.cuda._sleep(SLEEP_CYCLES)  # the pipeline's stream is busy: a frame whose host work waited would wait here
        busy = torch.cuda.Event()
        busy.record()
    got = run(stream, frames)
    still_busy = not busy.query()
    torch.cuda.synchronize()
    waits = host_waits(lambda: run(stream, frames))  # the profiler's view of the same, the flush included
    assert waits == [], "\n".join(f"{waits.count(w)}× {w}" for w in sorted(set(waits)))
    assert still_busy, "the host waited for the GPU while it enqueued the frames"
    assert all(out.is_cuda for out in got)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


@pytest.mark.parametrize("case", ["turbo-one-step", "three-steps-stream-batch", "three-steps-one-at-a-time"])
def test_no_session_or_graph_is_made_after_prepare(folders, case):
    name, steps, strength, guidance, stream_batch = CASES[case]
    folder, options = folders[name]
    stream = prepared(folder, steps, strength, guidance, stream_batch, **options)
    models = stream.onnx_models

    def made():
        return (stream.sessions_created, {name: len(model.graph_signatures) for name, model in models.items()},
                {name: len(model.signatures) for name, model in models.items()}, stream.captured_graphs)

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
    frames = cuda_frames(4, seed=1)
    captured = run(prepared(folder, steps, strength, guidance, stream_batch, **options), frames)
    uncaptured_stream = prepared(folder, steps, strength, guidance, stream_batch, cuda_graph=False, **options)
    uncaptured = run(uncaptured_stream, frames)
    assert uncaptured_stream.captured_graphs == 0
    on_cpu = run(prepared(folder, steps, strength, guidance, stream_batch, provider="CPUExecutionProvider", **options),
                 [frame.cpu() for frame in frames])
    torch.testing.assert_close(captured, uncaptured, atol=1e-4, rtol=0)
    torch.testing.assert_close([out.cpu() for out in captured], on_cpu, atol=1e-3, rtol=0)


@pytest.mark.parametrize("case", ["turbo-one-step", "three-steps-stream-batch"])
def test_frames_with_numpy_frames_equals_one_call_at_a_time(folders, case):
    name, steps, strength, guidance, stream_batch = CASES[case]
    folder, options = folders[name]
    stream = prepared(folder, steps, strength, guidance, stream_batch, **options)
    frames = [np.asarray(((frame.permute(1, 2, 0) / 2 + 0.5) * 255).round().to(torch.uint8).cpu())
              for frame in cuda_frames(7, seed=2)]
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
