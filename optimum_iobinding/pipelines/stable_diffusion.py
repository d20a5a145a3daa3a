"""Text to image: diffusers' ``OnnxStableDiffusionPipeline`` with its denoising loop on the device."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Union

import numpy as np
import torch
from diffusers.pipelines.stable_diffusion import StableDiffusionPipelineOutput

from .base import Generator, OnnxStableDiffusionPipelineBase


class OnnxStableDiffusionPipeline(OnnxStableDiffusionPipelineBase):
    """Text-to-image Stable Diffusion on ONNX Runtime.

    ``OnnxStableDiffusionPipeline.from_pretrained(folder, provider="CUDAExecutionProvider", io_binding=True)`` keeps
    text embeddings, latents, noise predictions, guidance and the scheduler step on the GPU as torch tensors; only
    the final image is downloaded. ``io_binding=False`` is diffusers' numpy pipeline.
    """

    @torch.no_grad()
    def __call__(
        self,
        prompt: Union[str, List[str], None] = None,
        height: Optional[int] = 512,
        width: Optional[int] = 512,
        num_inference_steps: int = 50,
        guidance_scale: float = 7.5,
        negative_prompt: Union[str, List[str], None] = None,
        num_images_per_prompt: int = 1,
        eta: float = 0.0,
        generator: Generator = None,
        latents: Optional[Union[torch.Tensor, np.ndarray]] = None,
        prompt_embeds: Optional[Union[torch.Tensor, np.ndarray]] = None,
        negative_prompt_embeds: Optional[Union[torch.Tensor, np.ndarray]] = None,
        output_type: str = "pil",
        return_dict: bool = True,
        callback: Optional[Callable[[int, int, torch.Tensor], None]] = None,
        callback_steps: int = 1,
        callback_on_step_end: Optional[Callable[..., Dict[str, Any]]] = None,
        callback_on_step_end_tensor_inputs: List[str] = ("latents",),
    ):
        """Generates images from text, with the arguments of diffusers' ``OnnxStableDiffusionPipeline``.

        ``generator`` is a numpy ``RandomState`` (the same initial noise as diffusers' ONNX pipeline for the same
        seed) or a ``torch.Generator``. ``callback(step, t, latents)`` gets torch latents on the device;
        ``callback_on_step_end(pipe, step, t, tensors)`` works as in diffusers' torch pipelines and may return
        replacements for ``latents`` or ``prompt_embeds``. ``output_type`` is "pil", "np", "pt" or "latent".

        Returns:
            ``StableDiffusionPipelineOutput(images, nsfw_content_detected=None)``, or a tuple without return_dict.
        """
        # 1. check inputs
        self.check_inputs(prompt, height, width, num_inference_steps, callback_steps, negative_prompt,
                          prompt_embeds, negative_prompt_embeds)
        if prompt is not None:
            batch_size = 1 if isinstance(prompt, str) else len(prompt)
        else:
            batch_size = prompt_embeds.shape[0]
        do_classifier_free_guidance = guidance_scale > 1.0

        # 2. text embeddings, on the device
        prompt_embeds = self.encode_prompt(prompt, num_images_per_prompt, do_classifier_free_guidance,
                                           negative_prompt, prompt_embeds, negative_prompt_embeds)

        # 3. initial noise and timesteps
        latents_shape = (batch_size * num_images_per_prompt, self.latent_channels,
                         height // self.vae_scale_factor, width // self.vae_scale_factor)
        latents = self.prepare_latents(latents_shape, prompt_embeds.dtype, generator, latents)
        self.scheduler.set_timesteps(num_inference_steps, device=self.device)
        timesteps = self.scheduler.timesteps
        latents = latents * self.scheduler.init_noise_sigma
        unet_batch = latents.shape[0] * (2 if do_classifier_free_guidance else 1)
        timestep_inputs = self.timestep_inputs(timesteps, unet_batch)
        step_kwargs = self.scheduler_step_kwargs(generator, eta)

        # 4. denoising loop: every tensor stays on self.device
        for i, t in enumerate(self.progress_bar(timesteps)):
            latent_model_input = torch.cat([latents] * 2) if do_classifier_free_guidance else latents
            latent_model_input = self.scheduler.scale_model_input(latent_model_input, t)
            noise_pred = self.unet(sample=latent_model_input, timestep=timestep_inputs[i],
                                   encoder_hidden_states=prompt_embeds)[0]
            if do_classifier_free_guidance:
                noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
                noise_pred = noise_pred_uncond + guidance_scale * (noise_pred_text - noise_pred_uncond)
            else:
                # multistep schedulers keep model outputs across steps: never hand them the reused UNet buffer
                noise_pred = noise_pred.clone()
            latents = self.scheduler.step(noise_pred, t, latents, **step_kwargs, return_dict=False)[0]

            tensors = self.run_callbacks(self, i, t, latents, callback, callback_steps, callback_on_step_end,
                                         {k: v for k, v in (("latents", latents), ("prompt_embeds", prompt_embeds))
                                          if k in callback_on_step_end_tensor_inputs})
            latents = tensors.get("latents", latents)
            prompt_embeds = tensors.get("prompt_embeds", prompt_embeds)

        # 5. decode; only now does anything leave the device
        if output_type == "latent":
            image = latents
        else:
            image = self.postprocess(self.decode_latents(latents), output_type)
        self.maybe_free_model_hooks()
        if not return_dict:
            return (image, None)
        return StableDiffusionPipelineOutput(images=image, nsfw_content_detected=None)
