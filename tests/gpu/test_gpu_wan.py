"""Wan on the GPU (skipped without CUDA; run on the GPU machine): the tiny random Wan pipelines exported in float32,
run on the CUDA execution provider with ``cuda_graph=True`` — the transformer captured (Wan 2.2: each expert), the
VAE's chunk graphs captured, the denoising loop enqueued without a host wait, the frames and latents equal to the CPU
provider's."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from optimum_iobinding import OnnxWanPipeline
from optimum_iobinding.bench.probes import host_waits
from optimum_iobinding.pipelines.loop import Guidance, denoise

pytestmark = pytest.mark.gpu

CUDA = "CUDAExecutionProvider"
# exact comparisons: without TF32, fp32 matmuls and convolutions on Hopper round like the CPU's
EXACT = {"use_tf32": "0"}
PROMPTS = ["a photo of a cat", "a red castle in the forest"]
SEQUENCE = 16
# 9 frames of 32 × 32: 3 latent frames of 4 × 4 (the VAE's first chunk, then two of its chunk graph)
CALL = dict(height=32, width=32, num_frames=9, num_inference_steps=4, max_sequence_length=SEQUENCE)
TOLERANCE = 1e-3


def exported(shared_export, name, torch_pipe, components=None):
    """The float32 export of ``torch_pipe`` (``components`` of it, default all), made once per test run as ``name``."""
    from optimum_iobinding.export import export_pipeline

    torch_pipe.set_progress_bar_config(disable=True)
    if components is not None:
        components = [name for name in components if getattr(torch_pipe, name, None) is not None]
    return shared_export(
        name,
        lambda target: export_pipeline(None, target, torch_pipeline=torch_pipe, components=components, progress=False),
    )


@pytest.fixture(scope="module")
def wan(shared_export):
    """The tiny random Wan 2.1 pipeline exported whole (UMT5, the transformer, the VAE), float32."""
    from optimum_iobinding.export.tiny import build_tiny_random_wan_pipeline

    return exported(shared_export, "gpu-tiny-wan", build_tiny_random_wan_pipeline())


@pytest.fixture(scope="module")
def wan22(shared_export):
    """The tiny random Wan 2.2 pipeline (two experts, switched at a boundary ratio of 0.875), without its VAE."""
    from optimum_iobinding.export.tiny import build_tiny_random_wan_pipeline

    return exported(
        shared_export,
        "gpu-tiny-wan2.2-without-vae",
        build_tiny_random_wan_pipeline(two_experts=True),
        ("text_encoder", "transformer", "transformer_2"),
    )


def load(folder, provider=CUDA, **kwargs):
    if provider == CUDA:
        kwargs.setdefault("provider_options", EXACT)
    pipe = OnnxWanPipeline.from_pretrained(folder, provider=provider, **kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def seeded(seed=0):
    return torch.Generator().manual_seed(seed)


def flow_match_euler(pipe):
    """diffusers' flow-matching Euler scheduler (Wan 2.2 TI2V's, diffusers' Wan tests'), in place of Wan 2.1's UniPC."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=7.0)
    return pipe


def test_with_cuda_graph_true_the_transformer_is_captured_and_the_frames_equal_the_cpu_pipelines(
    wan, captures_the_transformer_as_required
):
    pipe = load(wan, cuda_graph=True)
    video = {}
    captures_the_transformer_as_required(
        pipe, lambda: video.setdefault("cuda", pipe(PROMPTS, generator=seeded(), output_type="np", **CALL).frames)
    )
    expected = load(wan, provider="CPUExecutionProvider")(PROMPTS, generator=seeded(), output_type="np", **CALL).frames
    assert pipe.device.type == "cuda" and video["cuda"].shape == (2, 9, 32, 32, 3)
    np.testing.assert_allclose(video["cuda"], expected, atol=TOLERANCE)
    # classifier-free guidance: the negative and the positive prompts' rows in one transformer call
    assert [signature["hidden_states"] for signature in pipe.transformer.graph_signatures] == [(4, 16, 3, 4, 4)]


def test_the_vae_decodes_chunk_by_chunk_in_captured_graphs_and_replays_them_for_the_next_video(wan):
    pipe = load(wan, cuda_graph=True)
    first = pipe(PROMPTS[0], generator=seeded(), output_type="np", **CALL).frames
    decoder = pipe.codec.video.decoder  # the first chunk's graph and every later chunk's, the cache between them
    for model in (decoder.first, decoder.chunk):
        assert model.graph_signatures and not model.graph_fallbacks, model.graph_fallbacks
    # every later chunk has one signature (the cache's shapes do not change): one graph, replayed chunk after chunk
    assert len(decoder.chunk.graph_signatures) == 1
    with decoder.first.watch_runs() as first_runs, decoder.chunk.watch_runs() as chunk_runs:
        again = pipe(PROMPTS[0], generator=seeded(), output_type="np", **CALL).frames
    assert (len(first_runs), len(chunk_runs)) == (1, 2)
    assert len(decoder.chunk.graph_signatures) == 1
    np.testing.assert_allclose(again, first, atol=1e-5)
    # the cache twice, not three times: the chunk graph reads it where the first graph writes it, no copy between
    buffers = decoder.chunk.graph_input_buffers(decoder.chunk.graph_signatures[0])
    present = first_runs[0].outputs[1:]
    assert [buffers[name].data_ptr() for name in decoder.past_names] == present
    assert [chunk_runs[0].inputs[name] for name in decoder.past_names] == present


def test_a_tiled_decode_captures_each_tile_shape_and_equals_the_cpu_pipelines(wan):
    sizes = dict(tile_sample_min_height=16, tile_sample_min_width=16, tile_sample_stride_height=8,
                 tile_sample_stride_width=8)  # fmt: skip
    pipes = {provider: load(wan, provider=provider) for provider in (CUDA, "CPUExecutionProvider")}
    videos = {}
    for provider, pipe in pipes.items():
        pipe.enable_vae_tiling(**sizes)
        videos[provider] = pipe(PROMPTS[0], generator=seeded(), output_type="np", **CALL).frames
    np.testing.assert_allclose(videos[CUDA], videos["CPUExecutionProvider"], atol=TOLERANCE)
    decoder = pipes[CUDA].codec.video.decoder  # a tile and the smaller tiles at the edges: a graph each
    for model in (decoder.first, decoder.chunk):
        assert len(model.graph_signatures) >= 2 and not model.graph_fallbacks, model.graph_fallbacks


def test_wan22s_two_experts_are_each_captured_and_the_latents_equal_the_cpu_pipelines(wan22):
    # the denoiser (transformer) must be captured with cuda_graph=True; the low-noise expert is asked to be too
    pipe = load(wan22, cuda_graph=True, component_options={"transformer_2": {"cuda_graph": True}})
    call = dict(CALL, guidance_scale=4.0, guidance_scale_2=2.0, output_type="latent")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # an expert run without a graph would warn
        with pipe.transformer.watch_runs() as high, pipe.transformer_2.watch_runs() as low:
            latents = pipe(PROMPTS, generator=seeded(), **call).frames
    # UniPC's timesteps 999, 900, 750, 500: two at or above the boundary (875), two below
    assert (len(high), len(low)) == (2, 2)
    for expert in (pipe.transformer, pipe.transformer_2):
        assert [signature["hidden_states"] for signature in expert.graph_signatures] == [(4, 16, 3, 4, 4)]
        assert not expert.graph_fallbacks
    expected = load(wan22, provider="CPUExecutionProvider")(PROMPTS, generator=seeded(), **call).frames
    np.testing.assert_allclose(latents.cpu().numpy(), expected.numpy(), atol=TOLERANCE)


@pytest.mark.parametrize(
    "fixture, scheduler",
    [
        ("wan", "euler"),
        ("wan22", "euler"),
        # diffusers' UniPC makes the host wait in its own step (a copy from pageable memory, torch.linalg.solve on
        # the latents' device): the loop runs its traced steps (pipelines/linear_steps.py)
        ("wan", "unipc"),
    ],
)
def test_the_host_enqueues_the_whole_wan_loop_without_waiting(request, fixture, scheduler):
    pipe = load(request.getfixturevalue(fixture), cuda_graph=True)
    if scheduler == "euler":
        flow_match_euler(pipe)
    guidance = Guidance.classifier_free(5.0)
    with torch.cuda.stream(pipe.stream):
        embeds, negative = pipe.encode_prompt(PROMPTS[0], None, True, 1, max_sequence_length=SEQUENCE)
        latents = pipe.prepare_latents(pipe.latent_video_shape(1, 9, 32, 32), torch.float32, seeded())

        def loop():
            timesteps = pipe.set_timesteps(4)
            return denoise(
                pipe.denoiser,
                latents,
                timesteps,
                tensors={"prompt_embeds": embeds, "negative_prompt_embeds": negative},
                guidance=guidance,
                stages=pipe.expert_stages(timesteps, guidance, 3.0),
            )

        loop()  # warm up: capture (Wan 2.2: each expert at its steps)
        torch.cuda.synchronize()
        waits = host_waits(loop)
    assert waits == [], "\n".join(f"{waits.count(w)}× {w}" for w in sorted(set(waits)))
    torch.cuda.synchronize()
    experts = [pipe.transformer] + ([pipe.transformer_2] if pipe.transformer_2 is not None else [])
    assert all(expert.graph_signatures for expert in experts)
