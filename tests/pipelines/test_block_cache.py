"""First-Block Cache on the diffusion transformers (``pipe.enable_cache(FirstBlockCacheConfig(threshold=…))``), on the
tiny random FLUX.1 and SD3 pipelines exported with their parts (``step_cache=True``), CPU execution provider: FLUX.1
skips the steps diffusers' own hook skips on its torch pipeline and gives its images; SD3 (which diffusers' hook does
not run) follows the same rule written out here; disabling gives the uncached images back; bad configs are refused by
name."""

from __future__ import annotations

from typing import Any, List

import numpy as np
import pytest
import torch
from diffusers.hooks import FirstBlockCacheConfig

from optimum_iobinding import OnnxFluxPipeline, OnnxStableDiffusion3Pipeline, OnnxStableDiffusionPipeline
from optimum_iobinding.errors import ArgumentError, ArgumentTypeError
from optimum_iobinding.export.tiny import build_tiny_random_flux_pipeline, build_tiny_random_sd3_pipeline

PROMPT = "a photo of an astronaut riding a horse"
FLUX_CALL = dict(height=64, width=48, num_inference_steps=6, max_sequence_length=16, output_type="np")
SD3_CALL = dict(height=64, width=48, num_inference_steps=6, guidance_scale=5.0, output_type="np")
TOLERANCE = 1e-4  # fp32 ONNX Runtime vs fp32 torch on the CPU: rounding only
# thresholds for the tiny random models: one under every step's change (every step computes), one between them (the
# tests check that it skips some steps and computes others), one over all of them (only the first step computes)
NEVER, SOME, ALWAYS = 0.05, 0.3, 10.0


def seeded(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def step_cache_export(shared_export, name: str, torch_pipe) -> Any:
    def write(folder) -> None:
        from optimum_iobinding.export import export_pipeline

        export_pipeline(None, folder, torch_pipeline=torch_pipe, progress=False, step_cache=True)

    torch_pipe.set_progress_bar_config(disable=True)
    return torch_pipe, shared_export(name, write)


@pytest.fixture(scope="module", params=["schnell", "dev"])
def flux(request, shared_export):
    """Diffusers' tiny random FLUX.1 pipeline (schnell, then dev) and its export with the parts."""
    torch_pipe = build_tiny_random_flux_pipeline(0, guidance_embeds=request.param == "dev")
    return step_cache_export(shared_export, f"{request.param}-step-cache", torch_pipe)


@pytest.fixture(scope="module")
def sd3(shared_export):
    return step_cache_export(shared_export, "sd3-step-cache", build_tiny_random_sd3_pipeline())


def load(cls, folder, io_binding: bool = True):
    pipe = cls.from_pretrained(folder, io_binding=io_binding)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def mixed(computed: List[bool]) -> bool:
    return computed[0] and any(computed) and not all(computed)


# ------------------------------------------------------------------------------------------- FLUX.1 vs diffusers
def diffusers_cached(torch_pipe, threshold: float, **call: Any):
    """Diffusers' torch pipeline with its own First-Block Cache hook: its images and which steps ran every block
    (the last block's output projection runs only on those)."""
    ran: List[int] = []
    tail = torch_pipe.transformer.single_transformer_blocks[-1]
    handle = tail.proj_out.register_forward_hook(lambda *_: ran.append(len(calls)))
    calls: List[int] = []
    counter = torch_pipe.transformer.register_forward_pre_hook(lambda *_: calls.append(1))
    torch_pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    try:
        images = torch_pipe(PROMPT, generator=seeded(), **call).images
    finally:
        torch_pipe.transformer.disable_cache()
        handle.remove()
        counter.remove()
    return images, [step + 1 in ran for step in range(len(calls))]


@pytest.mark.parametrize("threshold", [NEVER, SOME, ALWAYS])
def test_flux_with_first_block_cache_skips_diffusers_steps_and_gives_its_image(flux, threshold):
    torch_pipe, folder = flux
    pipe = load(OnnxFluxPipeline, folder)
    pipe.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    ours = pipe(PROMPT, generator=seeded(), **FLUX_CALL).images
    theirs, computed = diffusers_cached(torch_pipe, threshold, **FLUX_CALL)
    assert pipe.step_cache.computed == computed
    assert {NEVER: all(computed), SOME: mixed(computed), ALWAYS: computed == [True] + [False] * 5}[threshold]
    np.testing.assert_allclose(ours, theirs, atol=TOLERANCE)


def test_a_skipped_step_changes_the_image_and_the_numpy_baseline_caches_alike(flux):
    _, folder = flux
    images = {}
    for io_binding in (True, False):
        pipe = load(OnnxFluxPipeline, folder, io_binding)
        pipe.enable_cache(FirstBlockCacheConfig(threshold=SOME))
        images[io_binding] = pipe(PROMPT, generator=seeded(), **FLUX_CALL).images
        assert pipe.step_cache.skipped_steps > 0
        pipe.disable_cache()
        images["uncached"] = pipe(PROMPT, generator=seeded(), **FLUX_CALL).images
    np.testing.assert_allclose(images[True], images[False], atol=TOLERANCE)
    assert np.abs(images[True] - images["uncached"]).max() > 1e-3


def test_disabling_the_cache_gives_the_uncached_image_back_exactly(flux):
    _, folder = flux
    pipe = load(OnnxFluxPipeline, folder)
    assert pipe.step_cache is None  # off by default
    before = pipe(PROMPT, generator=seeded(), **FLUX_CALL).images
    pipe.enable_cache(FirstBlockCacheConfig(threshold=ALWAYS))
    pipe(PROMPT, generator=seeded(), **FLUX_CALL)
    pipe.disable_cache()
    assert pipe.step_cache is None
    np.testing.assert_array_equal(pipe(PROMPT, generator=seeded(), **FLUX_CALL).images, before)


def test_a_saved_pipeline_keeps_the_first_block_cache_parts(flux, tmp_path):
    """``save_pretrained`` writes the parts beside the transformer: the saved folder caches as the export does."""
    _, folder = flux
    load(OnnxFluxPipeline, folder).save_pretrained(tmp_path / "saved")
    images = []
    for source in (folder, tmp_path / "saved"):
        pipe = load(OnnxFluxPipeline, source)
        pipe.enable_cache(FirstBlockCacheConfig(threshold=SOME))
        images.append(pipe(PROMPT, generator=seeded(), **FLUX_CALL).images)
    np.testing.assert_array_equal(images[0], images[1])


def test_enabling_a_cache_over_an_enabled_one_is_refused_as_diffusers_refuses_it(flux):
    _, folder = flux
    pipe = load(OnnxFluxPipeline, folder)
    pipe.enable_cache(FirstBlockCacheConfig(threshold=SOME))
    with pytest.raises(
        ValueError, match=r"enable_cache: expected no cache enabled, got FirstBlockCacheConfig enabled "
    ):
        pipe.enable_cache(FirstBlockCacheConfig(threshold=NEVER))
    assert pipe.step_cache.config.threshold == SOME  # the first one stays
    pipe.disable_cache()
    pipe.enable_cache(FirstBlockCacheConfig(threshold=NEVER))
    assert pipe.step_cache.config.threshold == NEVER


def test_each_call_starts_with_a_full_step(flux):
    _, folder = flux
    pipe = load(OnnxFluxPipeline, folder)
    pipe.enable_cache(FirstBlockCacheConfig(threshold=ALWAYS))
    first = pipe(PROMPT, generator=seeded(), **FLUX_CALL).images
    second = pipe(PROMPT, generator=seeded(), **FLUX_CALL).images
    assert pipe.step_cache.computed == [True] + [False] * 5
    np.testing.assert_array_equal(first, second)


# ---------------------------------------------------------------------------------------- SD3: the rule written out
class FirstBlockRule:
    """diffusers' First-Block Cache rule on its torch SD3 transformer, by hooks: the first block's residual against
    the one of the last full step decides; a skipped step passes the other blocks' inputs through and gives the final
    norm the first block's output plus the last full step's residual of the other blocks."""

    def __init__(self, transformer, threshold: float):
        self.threshold = threshold
        self.last_residual = self.tail = None
        self.computed: List[bool] = []
        blocks = transformer.transformer_blocks
        self.handles = [
            blocks[0].register_forward_pre_hook(self.remember_input, with_kwargs=True),
            blocks[0].register_forward_hook(self.decide),
            transformer.norm_out.register_forward_pre_hook(self.before_norm),
            *(block.register_forward_hook(self.pass_through, with_kwargs=True) for block in blocks[1:]),
        ]

    def remember_input(self, module, args, kwargs) -> None:
        self.input = kwargs["hidden_states"]

    def decide(self, module, args, output) -> None:
        self.first_output = output[1]
        residual = self.first_output - self.input
        compute = self.last_residual is None or bool(
            (residual - self.last_residual).abs().mean() / self.last_residual.abs().mean() > self.threshold
        )
        if compute:
            self.last_residual = residual
        self.computed.append(compute)

    def pass_through(self, module, args, kwargs, output):
        if self.computed[-1]:
            return output
        return output[0], kwargs["hidden_states"]

    def before_norm(self, module, args):
        hidden_states, *rest = args
        if self.computed[-1]:
            self.tail = hidden_states - self.first_output
            return None
        return (self.first_output + self.tail, *rest)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@pytest.mark.parametrize("threshold", [NEVER, SOME, ALWAYS])
def test_sd3_with_first_block_cache_follows_the_rule_and_gives_its_image(sd3, threshold):
    torch_pipe, folder = sd3
    pipe = load(OnnxStableDiffusion3Pipeline, folder)
    pipe.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    ours = pipe(PROMPT, generator=seeded(), **SD3_CALL).images
    rule = FirstBlockRule(torch_pipe.transformer, threshold)
    try:
        theirs = torch_pipe(PROMPT, generator=seeded(), **SD3_CALL).images
    finally:
        rule.remove()
    assert pipe.step_cache.computed == rule.computed
    assert {NEVER: all(rule.computed), SOME: mixed(rule.computed), ALWAYS: rule.computed == [True] + [False] * 5}[
        threshold
    ]
    np.testing.assert_allclose(ours, theirs, atol=TOLERANCE)


# ------------------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize(
    "config, error, message",
    [
        (
            {"threshold": 0.1},
            ArgumentTypeError,
            r"config: expected diffusers.hooks.FirstBlockCacheConfig\(threshold=…\) "
            r"for OnnxFluxPipeline, got dict",
        ),
        (FirstBlockCacheConfig(threshold=-0.1), ArgumentError, r"threshold: expected a number ≥ 0, got -0.1"),
        (FirstBlockCacheConfig(threshold="0.1"), ArgumentError, r"threshold: expected a number ≥ 0, got '0.1'"),
    ],
)
def test_a_bad_first_block_cache_config_is_refused_by_name_and_changes_nothing(flux, config, error, message):
    _, folder = flux
    pipe = load(OnnxFluxPipeline, folder)
    with pytest.raises(error, match=message):
        pipe.enable_cache(config)
    assert pipe.step_cache is None


def test_a_folder_exported_without_the_parts_says_how_to_export_them(schnell):
    _, folder = schnell
    pipe = load(OnnxFluxPipeline, folder)
    with pytest.raises(
        ArgumentError,
        match=r"lacks \['head.onnx', 'body.onnx', 'out.onnx'\]; export the pipeline "
        r"with First-Block Cache's parts: `optimum-iobinding export --step-cache",
    ):
        pipe.enable_cache(FirstBlockCacheConfig(threshold=0.1))
    assert pipe.step_cache is None


def test_a_unet_pipeline_refuses_first_block_cache_by_name(tiny_folder):
    pipe = OnnxStableDiffusionPipeline.from_pretrained(tiny_folder)
    with pytest.raises(ArgumentTypeError, match="config: expected .*DeepCacheConfig.*got FirstBlockCacheConfig"):
        pipe.enable_cache(FirstBlockCacheConfig(threshold=0.1))
    assert pipe.step_cache is None


def test_a_config_of_another_cache_is_named_by_its_class_in_one_line(flux):
    """diffusers' FasterCacheConfig prints many lines: the refusal names its class only."""
    from diffusers.hooks import FasterCacheConfig

    pipe = load(OnnxFluxPipeline, flux[1])
    with pytest.raises(ArgumentTypeError) as refused:
        pipe.enable_cache(FasterCacheConfig())
    assert str(refused.value).endswith("got FasterCacheConfig") and "\n" not in str(refused.value)


def test_the_stream_pipeline_cannot_cache_steps(tiny_folder):
    from optimum_iobinding import OnnxStreamDiffusionPipeline

    pipe = OnnxStreamDiffusionPipeline.from_pretrained(tiny_folder)
    with pytest.raises((ArgumentError, ArgumentTypeError), match="config: .*OnnxStreamDiffusionPipeline"):
        pipe.enable_cache(FirstBlockCacheConfig(threshold=0.1))
