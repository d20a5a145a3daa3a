"""DeepCache on the UNet pipelines (``pipe.enable_cache(DeepCacheConfig(cache_interval=…, cache_branch_id=…))``), on the
tiny random SD, SDXL and LCM pipelines exported with their parts, CPU execution provider: each against diffusers'
torch pipeline with the ``DeepCache`` package's ``DeepCacheSDHelper`` on the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from DeepCache import DeepCacheSDHelper
from diffusers import DDIMScheduler

from optimum_iobinding import (
    DeepCacheConfig,
    OnnxLatentConsistencyModelPipeline,
    OnnxStableDiffusionControlNetPipeline,
    OnnxStableDiffusionImg2ImgPipeline,
    OnnxStableDiffusionPipeline,
    OnnxStableDiffusionXLPipeline,
    OnnxStreamDiffusionPipeline,
)
from optimum_iobinding.errors import ArgumentError, ArgumentTypeError
from optimum_iobinding.export import export_pipeline
from optimum_iobinding.export.tiny import (
    build_tiny_random_lcm_pipeline,
    build_tiny_random_pipeline,
    build_tiny_random_xl_pipeline,
)

SIZE = 64
PROMPT = "a photo of an astronaut riding a horse"
# fp32 ONNX Runtime vs fp32 torch on the CPU, a few steps: rounding only (the other families' oracle tests' bound)
TOLERANCE = 1e-4
CONFIGS = [(2, 0), (2, 1), (3, 0), (3, 1)]


def exported_with_parts(shared_export, kind, build):
    """Diffusers' torch pipeline ``build()`` and the tiny random ``kind`` pipeline's export with DeepCache's parts,
    shared as ``<kind>-deep-cache`` (the builders are seeded: the torch pipeline has the export's weights)."""
    torch_pipe = build()
    torch_pipe.set_progress_bar_config(disable=True)
    folder = shared_export(
        f"{kind}-deep-cache",
        lambda target: export_pipeline(None, target, tiny_random=kind, step_cache=True, progress=False),
    )
    return torch_pipe, folder


@pytest.fixture(scope="module")
def sd(shared_export, vae_encodes_its_mode):
    torch_pipe, folder = exported_with_parts(shared_export, "sd", build_tiny_random_pipeline)
    return vae_encodes_its_mode(torch_pipe), folder


@pytest.fixture(scope="module")
def xl(shared_export):
    return exported_with_parts(shared_export, "xl", build_tiny_random_xl_pipeline)


@pytest.fixture(scope="module")
def lcm(shared_export):
    return exported_with_parts(shared_export, "lcm", build_tiny_random_lcm_pipeline)


def load(pipeline_class, folder, **kwargs):
    pipe = pipeline_class.from_pretrained(folder, **kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def latents_for(seed=0):
    return torch.randn(1, 4, SIZE // 8, SIZE // 8, generator=torch.Generator().manual_seed(seed))


def with_deepcache_helper(torch_pipe, interval, branch, call):
    """``call()`` with the ``DeepCache`` package's helper enabled on ``torch_pipe`` (enabled afresh: it counts steps
    from its first call)."""
    helper = DeepCacheSDHelper(pipe=torch_pipe)
    helper.set_params(cache_interval=interval, cache_branch_id=branch)
    helper.enable()
    try:
        return call()
    finally:
        helper.disable()


def cached(pipe, interval, branch, call):
    pipe.enable_cache(DeepCacheConfig(cache_interval=interval, cache_branch_id=branch))
    try:
        return call()
    finally:
        pipe.disable_cache()


# ------------------------------------------------------------------------------------- the images of the helper
@pytest.mark.parametrize("interval, branch", CONFIGS, ids=[f"interval{i}-branch{b}" for i, b in CONFIGS])
def test_sd_with_deep_cache_matches_diffusers_with_the_deepcache_helper(sd, interval, branch):
    torch_pipe, folder = sd
    arguments = dict(height=SIZE, width=SIZE, num_inference_steps=5, latents=latents_for(), output_type="np")
    expected = with_deepcache_helper(torch_pipe, interval, branch, lambda: torch_pipe(PROMPT, **arguments).images)
    plain = torch_pipe(PROMPT, **arguments).images
    pipe = load(OnnxStableDiffusionPipeline, folder)
    got = cached(pipe, interval, branch, lambda: pipe(PROMPT, **arguments).images)
    np.testing.assert_allclose(got, expected, atol=TOLERANCE)
    assert np.abs(expected - plain).max() > 100 * TOLERANCE  # the cache changed the image: the test can tell


@pytest.mark.parametrize("interval, branch", CONFIGS, ids=[f"interval{i}-branch{b}" for i, b in CONFIGS])
def test_sdxl_with_deep_cache_matches_diffusers_with_the_deepcache_helper(xl, interval, branch):
    torch_pipe, folder = xl
    arguments = dict(
        height=SIZE, width=SIZE, num_inference_steps=4, guidance_scale=5.0, latents=latents_for(), output_type="np"
    )
    expected = with_deepcache_helper(torch_pipe, interval, branch, lambda: torch_pipe(PROMPT, **arguments).images)
    pipe = load(OnnxStableDiffusionXLPipeline, folder)
    got = cached(pipe, interval, branch, lambda: pipe(PROMPT, **arguments).images)
    np.testing.assert_allclose(got, expected, atol=TOLERANCE)


def test_lcm_with_deep_cache_matches_diffusers_with_the_deepcache_helper(lcm):
    torch_pipe, folder = lcm
    arguments = dict(
        height=SIZE, width=SIZE, num_inference_steps=4, guidance_scale=8.5, latents=latents_for(), output_type="np"
    )
    expected = with_deepcache_helper(
        torch_pipe, 2, 0, lambda: torch_pipe(PROMPT, generator=torch.Generator().manual_seed(3), **arguments).images
    )
    pipe = load(OnnxLatentConsistencyModelPipeline, folder)
    got = cached(pipe, 2, 0, lambda: pipe(PROMPT, generator=torch.Generator().manual_seed(3), **arguments).images)
    np.testing.assert_allclose(got, expected, atol=TOLERANCE)


def test_img2img_with_deep_cache_counts_steps_from_its_first_and_matches_diffusers_with_the_deepcache_helper(sd):
    from diffusers import StableDiffusionImg2ImgPipeline

    torch_pipe, folder = sd
    torch_img2img = StableDiffusionImg2ImgPipeline(**torch_pipe.components)
    # set after construction, as on ours: diffusers' constructor turns a DDIM config's default clip_sample off
    torch_img2img.scheduler = DDIMScheduler.from_config(torch_pipe.scheduler.config)
    torch_img2img.set_progress_bar_config(disable=True)
    image = torch.rand(1, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(1))
    arguments = dict(
        image=image, strength=0.6, num_inference_steps=5, generator=torch.Generator().manual_seed(2), output_type="np"
    )
    expected = with_deepcache_helper(torch_img2img, 2, 0, lambda: torch_img2img(PROMPT, **arguments).images)
    pipe = load(OnnxStableDiffusionImg2ImgPipeline, folder)
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    arguments["generator"] = torch.Generator().manual_seed(2)
    got = cached(pipe, 2, 0, lambda: (pipe(PROMPT, **arguments).images, pipe.step_cache.computed))
    np.testing.assert_allclose(got[0], expected, atol=TOLERANCE)
    assert got[1] == [True, False, True]  # 0.6 of 5 steps: the last three, the first of them whole


def test_the_numpy_baseline_with_deep_cache_gives_the_bound_pipelines_image(sd):
    _, folder = sd
    arguments = dict(height=SIZE, width=SIZE, num_inference_steps=4, latents=latents_for(), output_type="np")
    images = []
    for io_binding in (True, False):
        pipe = load(OnnxStableDiffusionPipeline, folder, io_binding=io_binding)
        images.append(cached(pipe, 2, 1, lambda: pipe(PROMPT, **arguments).images))
    np.testing.assert_allclose(images[0], images[1], atol=TOLERANCE)


# ---------------------------------------------------------------------------------------------- the schedule
@pytest.mark.parametrize(
    "scheduler, interval, expected",
    [
        ("ddim", 2, [True, False, True, False, True]),
        ("ddim", 3, [True, False, False, True, False]),
        # PNDM runs its second timestep twice: the helper numbers the third step by that timestep's first position (1)
        ("pndm", 2, [True, False, False, False, True, False]),
        ("pndm", 3, [True, False, False, True, False, False]),
    ],
    ids=["ddim-interval2", "ddim-interval3", "pndm-interval2", "pndm-interval3"],
)
def test_computed_shows_which_steps_ran_the_whole_unet(sd, scheduler, interval, expected):
    _, folder = sd
    pipe = load(OnnxStableDiffusionPipeline, folder)
    if scheduler == "ddim":
        pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    pipe.enable_cache(DeepCacheConfig(cache_interval=interval))
    pipe(PROMPT, height=SIZE, width=SIZE, num_inference_steps=5, latents=latents_for(), output_type="latent")
    assert pipe.step_cache.computed == expected
    assert pipe.step_cache.skipped_steps == expected.count(False)


def test_caching_is_off_by_default(sd):
    _, folder = sd
    pipe = load(OnnxStableDiffusionPipeline, folder)
    assert pipe.step_cache is None


def test_a_saved_pipeline_keeps_the_deep_cache_parts(sd, tmp_path):
    """``save_pretrained`` writes the full and shallow parts beside the UNet: the saved folder caches as the export."""
    _, folder = sd
    load(OnnxStableDiffusionPipeline, folder).save_pretrained(tmp_path / "saved")
    arguments = dict(height=SIZE, width=SIZE, num_inference_steps=4, latents=latents_for(), output_type="np")
    images = []
    for source in (folder, tmp_path / "saved"):
        pipe = load(OnnxStableDiffusionPipeline, source)
        images.append(cached(pipe, 2, 1, lambda pipe=pipe: pipe(PROMPT, **arguments).images))
    assert np.array_equal(images[0], images[1])


def test_disable_cache_gives_the_uncached_image_back_exactly(sd):
    _, folder = sd
    pipe = load(OnnxStableDiffusionPipeline, folder)
    arguments = dict(height=SIZE, width=SIZE, num_inference_steps=4, latents=latents_for(), output_type="np")
    uncached = pipe(PROMPT, **arguments).images
    pipe.enable_cache(DeepCacheConfig(cache_interval=2))
    assert isinstance(pipe.step_cache.config, DeepCacheConfig)
    with_cache = pipe(PROMPT, **arguments).images
    pipe.disable_cache()
    assert pipe.step_cache is None
    assert not np.array_equal(with_cache, uncached)
    assert np.array_equal(pipe(PROMPT, **arguments).images, uncached)


def test_an_interval_of_one_runs_every_step_whole_and_gives_the_uncached_image(sd):
    _, folder = sd
    pipe = load(OnnxStableDiffusionPipeline, folder)
    arguments = dict(height=SIZE, width=SIZE, num_inference_steps=4, latents=latents_for(), output_type="np")
    uncached = pipe(PROMPT, **arguments).images
    got = cached(pipe, 1, 0, lambda: (pipe(PROMPT, **arguments).images, pipe.step_cache.computed))
    assert got[1] == [True] * 5  # PNDM's four steps are five calls
    np.testing.assert_allclose(got[0], uncached, atol=1e-6)


# -------------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "settings, error, message",
    [
        (dict(cache_interval=0), ArgumentError, r"cache_interval: expected an integer ≥ 1, got 0"),
        (dict(cache_interval=2.0), ArgumentTypeError, r"cache_interval: expected an integer ≥ 1, got float 2.0"),
        (dict(cache_branch_id=-1), ArgumentError, r"cache_branch_id: expected an integer ≥ 0, got -1"),
        (dict(cache_branch_id=True), ArgumentTypeError, r"cache_branch_id: expected an integer ≥ 0, got bool True"),
    ],
    ids=["interval-0", "interval-float", "branch-negative", "branch-bool"],
)
def test_a_config_out_of_range_or_of_the_wrong_type_is_refused_by_name(settings, error, message):
    with pytest.raises(error, match=message):
        DeepCacheConfig(**settings)


def test_a_branch_the_unet_lacks_is_refused_by_name_and_leaves_caching_as_it_was(sd):
    _, folder = sd
    pipe = load(OnnxStableDiffusionPipeline, folder)
    with pytest.raises(
        ArgumentError,
        match=r"cache_branch_id: expected one of this UNet's branches "
        r"\[0, 1, 2, 3, 4, 5\], got 6",
    ):
        pipe.enable_cache(DeepCacheConfig(cache_branch_id=6))
    assert pipe.step_cache is None


@pytest.mark.parametrize("config", [{"cache_interval": 3}, "deepcache"], ids=["dict", "str"])
def test_a_config_that_is_not_a_deep_cache_config_is_refused_by_name(sd, config):
    _, folder = sd
    pipe = load(OnnxStableDiffusionPipeline, folder)
    with pytest.raises(ArgumentTypeError, match=r"config: expected optimum_iobinding.DeepCacheConfig"):
        pipe.enable_cache(config)


def test_a_folder_exported_without_the_parts_says_how_to_export_them(tiny_folder):
    pipe = load(OnnxStableDiffusionPipeline, tiny_folder)
    with pytest.raises(ArgumentError, match=r"config: DeepCache runs the UNet's parts .* lacks them; .*--step-cache"):
        pipe.enable_cache(DeepCacheConfig())


def test_a_controlnet_pipeline_refuses_deep_cache_by_name(controlnet_folders):
    pipe = load(OnnxStableDiffusionControlNetPipeline, controlnet_folders["one"])
    with pytest.raises(
        ArgumentError,
        match=r"config: expected a Stable Diffusion 1.x/2.x, SDXL or LCM pipeline for "
        r"DeepCache, got OnnxStableDiffusionControlNetPipeline \(a ControlNet",
    ):
        pipe.enable_cache(DeepCacheConfig())


def test_the_stream_pipeline_refuses_deep_cache_by_name(sd):
    _, folder = sd
    stream = OnnxStreamDiffusionPipeline.from_pretrained(folder)
    with pytest.raises(ArgumentError, match=r"config: .* got OnnxStreamDiffusionPipeline \(the stream pipeline"):
        stream.enable_cache(DeepCacheConfig())


@pytest.mark.parametrize("lora_first", [True, False], ids=["lora-then-cache", "cache-then-lora"])
def test_a_runtime_lora_reaches_the_cached_steps_whichever_comes_first(sd, make_lora, tmp_path, lora_first):
    torch_pipe, folder = sd
    lora = make_lora(build_tiny_random_pipeline(), tmp_path / "lora", 1, ["to_q", "to_v", "conv1"])
    pipe = load(OnnxStableDiffusionPipeline, folder)
    call = dict(num_inference_steps=4, height=SIZE, width=SIZE, output_type="np")
    if lora_first:
        pipe.load_lora_weights(lora, adapter_name="a")
    pipe.enable_cache(DeepCacheConfig(cache_interval=2, cache_branch_id=0))
    if not lora_first:
        pipe.load_lora_weights(lora, adapter_name="a")
    ours = pipe(PROMPT, latents=latents_for(), **call).images
    assert pipe.step_cache.skipped_steps > 0
    torch_pipe.load_lora_weights(lora, adapter_name="a")
    try:
        theirs = with_deepcache_helper(
            torch_pipe, 2, 0, lambda: torch_pipe(PROMPT, latents=latents_for(), **call).images
        )
    finally:
        torch_pipe.unload_lora_weights()
    np.testing.assert_allclose(ours, theirs, atol=TOLERANCE)
