"""Latent Consistency Models (LCM): few-step text-to-image with a UNet that takes the guidance scale as an embedding
(``timestep_cond``) instead of a second, unconditional batch — the loop where the host's per-step overhead weighs
most, so the device loop and CUDA graphs matter most."""

from __future__ import annotations

import math
from typing import Optional


import torch

from ..families import family
from .arguments import Embeds, Generator, Latents, Prompt, StepEndCallback, TensorNames
from .core import on_device_stream
from .clip_unet import ClipUNetPipeline
from .denoisers import UNetDenoiser
from .loop import Guidance, denoise

LCM = family("lcm")


def guidance_scale_embedding(w: torch.Tensor, embedding_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Sinusoidal embedding of ``w * 1000`` (one row per value), the guidance conditioning LCM UNets are trained
    with (Meng et al., "On Distillation of Guided Diffusion Models"; diffusers' ``get_guidance_scale_embedding``)."""
    half = embedding_dim // 2
    frequencies = torch.exp(torch.arange(half, dtype=dtype) * -(math.log(10000.0) / (half - 1)))
    angles = (w.to(dtype) * 1000.0)[:, None] * frequencies[None, :]
    embedding = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if embedding_dim % 2 == 1:
        embedding = torch.nn.functional.pad(embedding, (0, 1))
    return embedding


class OnnxLatentConsistencyModelPipeline(ClipUNetPipeline):
    """Text-to-image with an LCM UNet (``timestep_cond`` input) and ``LCMScheduler``, with the arguments of diffusers'
    ``LatentConsistencyModelPipeline``: no unconditional batch (guidance goes in as an embedding), the scheduler's
    denoised prediction decoded after the last of a few steps."""

    family = LCM
    denoiser_part = UNetDenoiser

    @on_device_stream
    def __call__(
        self,
        prompt: Prompt = None,
        height: Optional[int] = LCM.defaults.size,
        width: Optional[int] = LCM.defaults.size,
        num_inference_steps: int = LCM.defaults.steps,
        original_inference_steps: Optional[int] = None,
        guidance_scale: float = LCM.defaults.guidance_scale,
        num_images_per_prompt: int = 1,
        generator: Generator = None,
        latents: Latents = None,
        prompt_embeds: Embeds = None,
        output_type: str = "pil",
        return_dict: bool = True,
        callback_on_step_end: StepEndCallback = None,
        callback_on_step_end_tensor_inputs: TensorNames = ("latents",),
    ):
        """Generates images in a few steps. ``guidance_scale`` is embedded (``w = guidance_scale - 1``), not applied
        as classifier-free guidance, so the UNet runs once per step on the prompt batch alone.

        Returns:
            ``StableDiffusionPipelineOutput(images, nsfw_content_detected=None)``, or a tuple without return_dict.
        """
        self.check_inputs(
            prompt=prompt,
            prompt_embeds=prompt_embeds,
            height=height,
            width=width,
            num_inference_steps=num_inference_steps,
            output_type=output_type,
            guidance_scale=guidance_scale,
            num_images_per_prompt=num_images_per_prompt,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
            generator=generator,
        )
        batch_size = self.batch_size_of(prompt, prompt_embeds)
        prompt_embeds = self.encode_prompt(prompt, num_images_per_prompt, False, prompt_embeds=prompt_embeds)
        rows = batch_size * num_images_per_prompt

        timesteps = self.set_timesteps(num_inference_steps, original_inference_steps=original_inference_steps)
        latents = self.initial_noise(rows, height, width, prompt_embeds.dtype, generator, latents)

        w = torch.full((rows,), guidance_scale - 1.0)
        timestep_cond = guidance_scale_embedding(w, self.denoiser.time_cond_proj_dim).to(
            self.device, prompt_embeds.dtype
        )
        # guidance goes in as the UNet's timestep_cond: one batch, no classifier-free guidance
        denoised = denoise(
            self.denoiser,
            latents,
            timesteps,
            tensors={"prompt_embeds": prompt_embeds},
            guidance=Guidance(),
            inputs={"timestep_cond": timestep_cond},
            step_kwargs=self.scheduler_step_kwargs(generator, 0.0),
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
            return_denoised=True,
        )
        return self.finish(denoised.to(prompt_embeds.dtype), output_type, return_dict)
