"""Step caching on the GPU (skipped without CUDA; run on the GPU machine): First-Block Cache (tiny FLUX.1; tiny Wan 2.2,
each expert's parts, the guided halves deciding apart) and DeepCache (tiny SD and SDXL) with ``cuda_graph=True``:
every part is captured, the parts read the model's own weights (one copy on the device), and the cached images are
the CPU's."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from diffusers.hooks import FirstBlockCacheConfig

from optimum_iobinding import (
    DeepCacheConfig,
    OnnxFluxPipeline,
    OnnxStableDiffusionPipeline,
    OnnxStableDiffusionXLPipeline,
    OnnxWanPipeline,
)
from optimum_iobinding.export import export_pipeline
from optimum_iobinding.export.tiny import build_tiny_random_flux_pipeline, build_tiny_random_wan_pipeline

pytestmark = pytest.mark.gpu

CUDA = "CUDAExecutionProvider"
EXACT = {"use_tf32": "0"}  # fp32 matmuls and convolutions round like the CPU's
TOLERANCE = 1e-3
FLUX_CALL = dict(height=64, width=48, num_inference_steps=6, max_sequence_length=16, output_type="np")
SD_CALL = dict(height=64, width=64, num_inference_steps=6, output_type="np")


@pytest.fixture(scope="module")
def flux_parts(tmp_path_factory):
    return export_pipeline(
        None,
        tmp_path_factory.mktemp("flux") / "out",
        progress=False,
        step_cache=True,
        torch_pipeline=build_tiny_random_flux_pipeline(0, guidance_embeds=False),
    )


@pytest.fixture(scope="module")
def wan22_parts(tmp_path_factory):
    return export_pipeline(
        None,
        tmp_path_factory.mktemp("wan22") / "out",
        progress=False,
        step_cache=True,
        components=["text_encoder", "transformer", "transformer_2"],
        torch_pipeline=build_tiny_random_wan_pipeline(two_experts=True),
    )


@pytest.fixture(scope="module")
def sd_parts(tmp_path_factory):
    return export_pipeline(
        None, tmp_path_factory.mktemp("sd") / "out", tiny_random="sd", progress=False, step_cache=True
    )


@pytest.fixture(scope="module")
def xl_parts(tmp_path_factory):
    return export_pipeline(
        None, tmp_path_factory.mktemp("xl") / "out", tiny_random="xl", progress=False, step_cache=True
    )


def load(cls, folder, provider, **kwargs):
    extra = dict(provider_options=EXACT, cuda_graph=True) if provider == CUDA else {}
    pipe = cls.from_pretrained(folder, provider=provider, **extra, **kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_captured(pipe, call):
    """``call()`` with every part of the cache captured and no fallback warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        result = call()
    for part in pipe.step_cache.parts:
        assert part.graph_signatures and not part.graph_fallbacks
        # one copy of the weights: the part's owned tensors are the denoiser's own
        weights, own = part.owned_weights, pipe.denoiser.model.owned_weights
        assert weights and all(tensor.data_ptr() == own[name].data_ptr() for name, tensor in weights.items())
    return result


@pytest.mark.parametrize("threshold", [0.05, 0.3, 10.0])
def test_first_block_cache_on_cuda_captures_every_part_and_gives_the_cpus_image(flux_parts, threshold):
    images, computed = {}, {}
    for provider in (CUDA, "CPUExecutionProvider"):
        pipe = load(OnnxFluxPipeline, flux_parts, provider)
        pipe.enable_cache(FirstBlockCacheConfig(threshold=threshold))

        def call():
            return pipe("a red castle", generator=torch.Generator().manual_seed(0), **FLUX_CALL).images

        images[provider] = run_captured(pipe, call) if provider == CUDA else call()
        computed[provider] = pipe.step_cache.computed
    assert computed[CUDA] == computed["CPUExecutionProvider"]
    np.testing.assert_allclose(images[CUDA], images["CPUExecutionProvider"], atol=TOLERANCE)


@pytest.mark.parametrize("family, interval, branch", [("sd", 2, 0), ("sd", 3, 1), ("xl", 3, 0)])
def test_deepcache_on_cuda_captures_every_part_and_gives_the_cpus_image(request, family, interval, branch):
    cls, folder = {"sd": (OnnxStableDiffusionPipeline, "sd_parts"), "xl": (OnnxStableDiffusionXLPipeline, "xl_parts")}[
        family
    ]
    folder = request.getfixturevalue(folder)
    images = {}
    for provider in (CUDA, "CPUExecutionProvider"):
        pipe = load(cls, folder, provider)
        pipe.enable_cache(DeepCacheConfig(cache_interval=interval, cache_branch_id=branch))

        def call():
            return pipe("a red castle", generator=torch.Generator().manual_seed(0), **SD_CALL).images

        images[provider] = run_captured(pipe, call) if provider == CUDA else call()
        assert pipe.step_cache.skipped_steps > 0
    np.testing.assert_allclose(images[CUDA], images["CPUExecutionProvider"], atol=TOLERANCE)


@pytest.mark.parametrize("family", ["flux", "sd"])
def test_a_cached_pipeline_on_cuda_gives_the_uncached_image_back_after_disable_cache_in_the_same_session(
    request, family
):
    cls, folder, config, call_args = {
        "flux": (OnnxFluxPipeline, "flux_parts", FirstBlockCacheConfig(threshold=10.0), FLUX_CALL),
        "sd": (OnnxStableDiffusionPipeline, "sd_parts", DeepCacheConfig(cache_interval=3), SD_CALL),
    }[family]
    pipe = load(cls, request.getfixturevalue(folder), CUDA)
    model = pipe.denoiser.model

    def call():
        return pipe("a red castle", generator=torch.Generator().manual_seed(0), **call_args).images

    before = call()
    assert model.owned_weights  # owned from the load: the parts read them without a new session of the denoiser
    sessions = model.sessions_created
    pipe.enable_cache(config)
    cached = call()
    pipe.disable_cache()
    np.testing.assert_array_equal(call(), before)
    assert not np.array_equal(cached, before)
    assert model.sessions_created == sessions


def test_wan_first_block_cache_on_cuda_captures_each_experts_parts_and_gives_the_cpus_latents(wan22_parts):
    latents, computed = {}, {}
    for provider in (CUDA, "CPUExecutionProvider"):
        pipe = load(OnnxWanPipeline, wan22_parts, provider)
        pipe.enable_cache(FirstBlockCacheConfig(threshold=0.1))
        embeds, negative = pipe.encode_prompt("a red castle", "blurry", True, 1, max_sequence_length=16)

        def call():
            return pipe(
                prompt_embeds=embeds,
                negative_prompt_embeds=negative * 20,  # far from the prompt's: the halves decide apart at some steps
                generator=torch.Generator().manual_seed(0),
                height=16,
                width=16,
                num_frames=5,
                num_inference_steps=6,
                guidance_scale_2=2.0,
                max_sequence_length=16,
                output_type="latent",
            ).frames

        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            latents[provider] = call().cpu().numpy()
        computed[provider] = pipe.step_cache.computed_by_group
        if provider == CUDA:
            for stage in pipe.step_cache.stages:
                own = stage.model.owned_weights
                for part in (stage.head, stage.body, stage.out):
                    assert part.graph_signatures and not part.graph_fallbacks
                    assert all(tensor.data_ptr() == own[name].data_ptr() for name, tensor in part.owned_weights.items())
    assert computed[CUDA] == computed["CPUExecutionProvider"]
    steps = computed[CUDA]
    assert (False, False) in steps and any(len(set(groups)) == 2 for groups in steps)  # skipped and split steps
    np.testing.assert_allclose(latents[CUDA], latents["CPUExecutionProvider"], atol=TOLERANCE)
