"""Few-step models on tiny random pipelines, CPU execution provider: LCM (guidance as a ``timestep_cond`` embedding,
the scheduler's denoised prediction decoded) and SD-Turbo's recipe (guidance 0, one to four trailing Euler-ancestral
steps), each against diffusers' torch pipeline on the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from optimum_iobinding import OnnxLatentConsistencyModelPipeline, OnnxStableDiffusionPipeline
from optimum_iobinding.pipelines.latent_consistency import guidance_scale_embedding

SIZE = 64
PROMPT = "a photo of an astronaut riding a horse"
TOLERANCE = 1e-4


def latents_for(rows=1, seed=0):
    return torch.randn(rows, 4, SIZE // 8, SIZE // 8, generator=torch.Generator().manual_seed(seed))


def test_the_guidance_embedding_is_diffusers_one(lcm):
    torch_pipe, _ = lcm
    w = torch.tensor([0.0, 3.5, 7.5])
    for dim in (32, 33, 256):
        np.testing.assert_allclose(
            guidance_scale_embedding(w, dim), torch_pipe.get_guidance_scale_embedding(w, embedding_dim=dim), atol=1e-6
        )


@pytest.mark.parametrize("io_binding", [True, False])
@pytest.mark.parametrize("steps,guidance", [(1, 8.5), (4, 8.5), (2, 1.0)])
def test_lcm_matches_diffusers_latent_consistency_pipeline(lcm, io_binding, steps, guidance):
    torch_pipe, folder = lcm
    latents = latents_for()
    expected = torch_pipe(
        PROMPT,
        height=SIZE,
        width=SIZE,
        num_inference_steps=steps,
        guidance_scale=guidance,
        latents=latents,
        generator=torch.Generator().manual_seed(3),
        output_type="np",
    ).images
    pipe = OnnxLatentConsistencyModelPipeline.from_pretrained(folder, io_binding=io_binding)
    pipe.set_progress_bar_config(disable=True)
    got = pipe(
        PROMPT,
        height=SIZE,
        width=SIZE,
        num_inference_steps=steps,
        guidance_scale=guidance,
        latents=latents,
        generator=torch.Generator().manual_seed(3),
        output_type="np",
    ).images
    np.testing.assert_allclose(got, expected, atol=TOLERANCE)


def test_lcm_runs_the_unet_once_per_step_on_the_prompt_batch_alone(lcm):
    _, folder = lcm
    pipe = OnnxLatentConsistencyModelPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    batches = []
    unet = pipe.unet

    class Recording:
        def __getattr__(self, name):
            return getattr(unet, name)

        def __call__(self, **inputs):
            batches.append(inputs["sample"].shape[0])
            return unet(**inputs)

    pipe.unet = Recording()
    pipe(PROMPT, height=SIZE, width=SIZE, num_inference_steps=4, num_images_per_prompt=2, latents=latents_for(2))
    assert batches == [2, 2, 2, 2]


def test_an_lcm_folder_in_the_sd_pipeline_says_which_pipeline_to_use(lcm):
    _, folder = lcm
    with pytest.raises(ValueError, match="OnnxLatentConsistencyModelPipeline"):
        OnnxStableDiffusionPipeline.from_pretrained(folder)


def test_an_sd_folder_in_the_lcm_pipeline_names_the_missing_input(sd):
    _, folder = sd
    with pytest.raises(ValueError, match="timestep_cond"):
        OnnxLatentConsistencyModelPipeline.from_pretrained(folder)


@pytest.mark.parametrize("steps", [1, 4])
def test_turbo_recipe_matches_diffusers(sd, steps):
    """SD-Turbo's use: no guidance, trailing timesteps, Euler ancestral (its noise drawn from the torch generator)."""
    from diffusers import EulerAncestralDiscreteScheduler

    torch_pipe, folder = sd
    scheduler_config = dict(torch_pipe.scheduler.config, timestep_spacing="trailing")
    torch_pipe.scheduler = EulerAncestralDiscreteScheduler.from_config(scheduler_config)
    latents = latents_for()
    expected = torch_pipe(
        PROMPT,
        height=SIZE,
        width=SIZE,
        num_inference_steps=steps,
        guidance_scale=0.0,
        latents=latents,
        generator=torch.Generator().manual_seed(5),
        output_type="np",
    ).images
    pipe = OnnxStableDiffusionPipeline.from_pretrained(folder)
    pipe.scheduler = EulerAncestralDiscreteScheduler.from_config(scheduler_config)
    pipe.set_progress_bar_config(disable=True)
    got = pipe(
        PROMPT,
        height=SIZE,
        width=SIZE,
        num_inference_steps=steps,
        guidance_scale=0.0,
        latents=latents,
        generator=torch.Generator().manual_seed(5),
        output_type="np",
    ).images
    np.testing.assert_allclose(got, expected, atol=TOLERANCE)


def test_cli_generate_picks_the_lcm_pipeline_from_the_folder(lcm, tmp_path, capsys):
    from optimum_iobinding.cli import main as cli_main

    _, folder = lcm
    out = tmp_path / "lcm.png"
    assert (
        cli_main(
            [
                "generate",
                "a cat",
                "--model",
                str(folder),
                "--steps",
                "2",
                "--guidance",
                "1.5",
                "--height",
                "64",
                "--width",
                "64",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert "OnnxLatentConsistencyModelPipeline" in capsys.readouterr().out and out.is_file()
