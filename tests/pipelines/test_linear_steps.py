"""A multistep scheduler's traced steps (pipelines/linear_steps.py) against the scheduler's own steps: diffusers'
UniPC in each of its configurations the trace takes (and the ones it must refuse), and the loop running them instead
of ``scheduler.step`` on the tiny random SD pipeline, CPU execution provider."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import diffusers

from optimum_iobinding.pipelines.linear_steps import LinearSteps

CONFIGS = {
    "default": {},
    "order-3": dict(solver_order=3),
    "bh1": dict(solver_type="bh1"),
    "v-prediction": dict(prediction_type="v_prediction"),
    "flow-wan": dict(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0),
    "predict-noise": dict(predict_x0=False),
    "no-corrector-at-2": dict(disable_corrector=[2]),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_traced_steps_equal_the_schedulers_own(config):
    scheduler = diffusers.UniPCMultistepScheduler(**CONFIGS[config])
    scheduler.set_timesteps(12)
    traced = LinearSteps.of(scheduler, scheduler.timesteps)
    assert traced is not None
    reference = copy.deepcopy(scheduler)
    generator = torch.Generator().manual_seed(3)
    sample = torch.randn(2, 4, 8, 8, generator=generator)
    ours = sample.clone()
    for index, t in enumerate(scheduler.timesteps[:-1]):  # the last step divides by a zero sigma in some configs
        model_output = torch.randn(2, 4, 8, 8, generator=generator)
        sample = reference.step(model_output, t, sample, return_dict=False)[0]
        ours = traced.step(index, model_output, ours)
        torch.testing.assert_close(ours, sample, atol=1e-4, rtol=1e-5)
    assert scheduler.step_index is None  # the pipeline's scheduler is left as it was


def test_a_step_that_is_not_linear_in_its_inputs_or_not_listed_is_not_traced():
    thresholding = diffusers.UniPCMultistepScheduler(thresholding=True)
    thresholding.set_timesteps(4)
    assert LinearSteps.of(thresholding, thresholding.timesteps) is None  # the trace does not match: refused
    ancestral = diffusers.EulerAncestralDiscreteScheduler()
    ancestral.set_timesteps(4)
    assert LinearSteps.of(ancestral, ancestral.timesteps) is None  # noise from a generator
    unipc = diffusers.UniPCMultistepScheduler()
    unipc.set_timesteps(4)
    assert LinearSteps.of(unipc, unipc.timesteps, {"generator": torch.Generator()}) is None


def test_the_loop_runs_unipcs_traced_steps_and_the_image_is_the_schedulers_own(sd, monkeypatch):
    from optimum_iobinding import OnnxStableDiffusionPipeline
    from optimum_iobinding.pipelines import linear_steps

    torch_pipe, folder = sd
    pipe = OnnxStableDiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    calls = []

    class UniPCMultistepScheduler(diffusers.UniPCMultistepScheduler):  # diffusers' own, its steps counted
        def step(self, *args, **kwargs):
            if self is pipe.scheduler:  # not the trace's copies
                calls.append(1)
            return super().step(*args, **kwargs)

    pipe.scheduler = UniPCMultistepScheduler.from_config(pipe.scheduler.config)
    arguments = dict(num_inference_steps=5, height=64, width=64, output_type="np")
    traced = pipe("a cat", generator=np.random.RandomState(0), **arguments).images
    assert calls == []  # every step traced (the trace's own runs use copies of the scheduler)
    monkeypatch.setattr(linear_steps, "TRACED_SCHEDULERS", ())  # the scheduler's own steps
    own = pipe("a cat", generator=np.random.RandomState(0), **arguments).images
    assert len(calls) == 5
    np.testing.assert_allclose(traced, own, atol=1e-5)
