"""The behaviour contract (test_contract.py) held to the real-time stream, where it applies to a pipeline whose
``prepare`` takes the prompt and whose call takes a frame: a refused ``prepare`` runs no component; the same seed gives
the same frame and another seed another one; a save/load round trip gives the same frames; and ``cuda_graph=True``
binds the family's denoiser. On the tiny random Stable Diffusion export, CPU execution provider."""

from __future__ import annotations

import diffusers
import pytest
import torch

from optimum_iobinding.families import family
from optimum_iobinding.pipelines.stream import OnnxStreamDiffusionPipeline

PROMPT = "a photo of an astronaut riding a horse"
SIZE = 64


def frame() -> torch.Tensor:
    """A float frame (3, SIZE, SIZE) in [-1, 1]."""
    return torch.rand(3, SIZE, SIZE, generator=torch.Generator().manual_seed(0)) * 2 - 1


def prepared(stream: OnnxStreamDiffusionPipeline, seed: int = 0) -> OnnxStreamDiffusionPipeline:
    stream.prepare(PROMPT, seed=seed, height=SIZE, width=SIZE)
    return stream


@pytest.fixture
def stream(tiny_folder):
    """A stream on the tiny export with SD-Turbo's scheduler (trailing timesteps: ``prepare``'s default of 2 steps
    at strength 0.5 is one UNet step at t = 499, so each frame comes out of its own call)."""
    stream = OnnxStreamDiffusionPipeline.from_pretrained(tiny_folder)
    stream.scheduler = diffusers.EulerAncestralDiscreteScheduler.from_config(
        stream.scheduler.config, timestep_spacing="trailing"
    )
    return stream


def test_a_refused_prepare_runs_no_component(stream, refused_runs_nothing):
    assert refused_runs_nothing(
        stream,
        ValueError,
        "num_inference_steps: expected a positive integer, got 0",
        lambda: stream.prepare(PROMPT, num_inference_steps=0, height=SIZE, width=SIZE),
    )


def test_the_same_seed_gives_the_same_frame_and_another_another_one(stream):
    first = prepared(stream, seed=0)(frame())
    torch.testing.assert_close(prepared(stream, seed=0)(frame()), first, atol=0, rtol=0)
    assert not torch.equal(prepared(stream, seed=1)(frame()), first)


def test_a_saved_stream_loads_again_and_gives_the_same_frame(stream, tmp_path):
    expected = prepared(stream)(frame())
    stream.save_pretrained(tmp_path / "saved")
    again = OnnxStreamDiffusionPipeline.from_pretrained(tmp_path / "saved")
    torch.testing.assert_close(prepared(again)(frame()), expected, atol=1e-6, rtol=0)


def test_cuda_graph_true_binds_the_streams_denoiser(tiny_folder):
    denoiser = OnnxStreamDiffusionPipeline.denoiser_component()
    assert denoiser == family("stream").denoiser == "unet"
    # on the CPU no graph can be captured: True is an error for the denoiser only
    with pytest.raises(ValueError, match="cuda_graph: needs a CUDA session with io_binding=True, got device cpu"):
        OnnxStreamDiffusionPipeline.from_pretrained(tiny_folder, cuda_graph=True)
    with pytest.raises(ValueError, match="cuda_graph: needs a CUDA session"):
        OnnxStreamDiffusionPipeline.from_pretrained(
            tiny_folder, cuda_graph=True, component_options={"vae_decoder": {"cuda_graph": "auto"}}
        )
    stream = OnnxStreamDiffusionPipeline.from_pretrained(
        tiny_folder, cuda_graph=True, component_options={denoiser: {"cuda_graph": "auto"}}
    )
    assert all(model.cuda_graph is False for model in stream.onnx_models.values())
