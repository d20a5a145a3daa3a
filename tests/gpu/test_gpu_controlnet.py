"""The SDXL and FLUX.1 ControlNet families on the GPU (skipped without CUDA; run on the GPU machine): under
``cuda_graph=True`` the denoiser (SDXL's UNet, FLUX.1's transformer) replays a graph and so does each ControlNet, the
images are the CPU provider's (one ControlNet and two, each with its scale and window; FLUX.1's true CFG and a union
ControlNet's mode), a second call makes no session, and FLUX.1's loop with its ControlNets makes the host wait for
nothing."""

from __future__ import annotations

import warnings

import numpy as np
import PIL.Image
import pytest
import torch

from optimum_iobinding import OnnxFluxControlNetPipeline, OnnxStableDiffusionXLControlNetPipeline
from optimum_iobinding.bench.probes import host_waits
from optimum_iobinding.export import export_pipeline
from optimum_iobinding.pipelines.codec import pack_latents
from optimum_iobinding.pipelines.loop import denoise

pytestmark = pytest.mark.gpu

CUDA = "CUDAExecutionProvider"
# exact comparisons: without TF32, fp32 matmuls and convolutions on Hopper round like the CPU's
EXACT = {"use_tf32": "0"}
TOLERANCE = 1e-3  # CUDA's fp32 kernels against the CPU's: rounding, not a different computation
PROMPTS = ["a photo of an astronaut riding a horse", "a red castle in the forest"]


def seeded(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def picture(seed: int = 0, height: int = 64, width: int = 48) -> PIL.Image.Image:
    pixels = np.random.default_rng(seed).random((height, width, 3))
    return PIL.Image.fromarray((pixels * 255).astype(np.uint8))


def load(pipeline_class, folder, provider=CUDA, **options):
    if provider == CUDA:
        options.setdefault("provider_options", EXACT)
    pipe = pipeline_class.from_pretrained(folder, provider=provider, **options)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def folders(shared_export):
    """The tiny random SDXL and FLUX.1 ControlNet pipelines' exports with two ControlNets (FLUX.1's second a union
    one)."""
    from optimum_iobinding.export.tiny import (
        build_tiny_random_flux_controlnet_pipeline,
        build_tiny_random_xl_controlnet_pipeline,
    )

    return {
        "xl": shared_export(
            "gpu-xl-controlnet-two",
            lambda t: export_pipeline(None, t, torch_pipeline=build_tiny_random_xl_controlnet_pipeline(controlnets=2)),
        ),
        "flux": shared_export(
            "gpu-flux-controlnet-two",
            lambda t: export_pipeline(
                None, t, torch_pipeline=build_tiny_random_flux_controlnet_pipeline(controlnets=("plain", "union"))
            ),
        ),
    }


CASES = {
    "xl": (
        OnnxStableDiffusionXLControlNetPipeline,
        "unet",
        dict(
            image=[picture(3, 64, 64), picture(4, 64, 64)],
            controlnet_conditioning_scale=[0.7, 1.2],
            control_guidance_start=[0.0, 0.25],
            control_guidance_end=[0.5, 1.0],
            num_inference_steps=4,
            output_type="np",
        ),
    ),
    "flux": (
        OnnxFluxControlNetPipeline,
        "transformer",
        dict(
            control_image=[picture(3), picture(4)],
            control_mode=[None, 2],
            controlnet_conditioning_scale=[0.7, 1.2],
            control_guidance_start=[0.0, 0.25],
            control_guidance_end=[0.5, 1.0],
            negative_prompt="a blue sky",
            true_cfg_scale=2.0,
            height=64,
            width=48,
            num_inference_steps=4,
            max_sequence_length=16,
            output_type="np",
        ),
    ),
}


@pytest.mark.parametrize("key", list(CASES))
def test_the_denoiser_and_the_controlnets_replay_graphs_and_give_the_cpus_images(folders, key):
    pipeline_class, denoiser, arguments = CASES[key]
    pipe = load(pipeline_class, folders[key], cuda_graph=True)
    assert getattr(pipe, denoiser).options.cuda_graph is True
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback of the denoiser would warn
        made = pipe(prompt=PROMPTS, generator=seeded(), **arguments).images
    assert getattr(pipe, denoiser).graph_signatures and not getattr(pipe, denoiser).graph_fallbacks
    for name in ("controlnet", "controlnet_1"):
        assert getattr(pipe, name).graph_signatures, f"{name} was not captured"
    on_cpu = load(pipeline_class, folders[key], provider="CPUExecutionProvider")
    np.testing.assert_allclose(made, on_cpu(prompt=PROMPTS, generator=seeded(), **arguments).images, atol=TOLERANCE)
    # a second call replays the graphs captured by the first: no session, no new signature
    signatures, created = len(getattr(pipe, denoiser).graph_signatures), pipe.sessions_created
    np.testing.assert_array_equal(pipe(prompt=PROMPTS, generator=seeded(), **arguments).images, made)
    assert (len(getattr(pipe, denoiser).graph_signatures), pipe.sessions_created) == (signatures, created)


def test_the_host_enqueues_a_flux_loop_with_its_controlnets_without_waiting(folders):
    pipe = load(OnnxFluxControlNetPipeline, folders["flux"])
    with torch.cuda.stream(pipe.stream):
        tensors, text_ids, guidance = pipe.text_tensors(
            prompt=PROMPTS[0],
            prompt_2=None,
            negative_prompt="a blue sky",
            negative_prompt_2=None,
            true_cfg_scale=2.0,
            prompt_embeds=None,
            pooled_prompt_embeds=None,
            negative_prompt_embeds=None,
            negative_pooled_prompt_embeds=None,
            num_images_per_prompt=1,
            max_sequence_length=16,
        )
        conditions = pipe.control_conditions([picture(3), picture(4)], 64, 48, 1, 1, seeded())
        latents = pack_latents(pipe.prepare_latents((1, pipe.latent_channels, 8, 6), torch.float32, seeded()))
        inputs = pipe.transformer_inputs(text_ids, pipe.position_ids(4, 3), 2, 3.5)

        def loop():
            timesteps = pipe.denoiser.timesteps(4, image_seq_len=12)
            samples = pipe.controlnet_step_inputs(
                conditions,
                [None, 1],
                timesteps,
                [0.7, 1.2],
                [0.0, 0.25],
                [0.5, 1.0],
                guidance,
                inputs,
                tensors["pooled_prompt_embeds"],
                3.5,
            )
            return denoise(
                pipe.denoiser,
                latents,
                timesteps,
                tensors=tensors,
                guidance=guidance,
                inputs=inputs,
                step_inputs=samples,
            )

        loop()  # warm up: capture
        torch.cuda.synchronize()
        waits = host_waits(loop)
    assert waits == [], "\n".join(f"{waits.count(w)}× {w}" for w in sorted(set(waits)))
    torch.cuda.synchronize()
