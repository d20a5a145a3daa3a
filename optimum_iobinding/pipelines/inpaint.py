"""Inpainting: diffusers' ``OnnxStableDiffusionInpaintPipeline`` with its denoising loop on the device."""

from __future__ import annotations

from typing import Any, Dict, Optional


import numpy as np
import torch
import torch.nn.functional as F
from diffusers.image_processor import VaeImageProcessor

from ..errors import ArgumentError
from ..families import family
from .arguments import Embeds, Generator, Latents, Prompt, StepCallback, StepEndCallback, TensorNames
from .clip_unet import ClipUNetPipeline
from .components import declared_dim
from .core import on_device_stream
from .latents import expand_to_batch
from .img2img import ImageInput, inpainting_warmup_images
from .loop import Guidance, denoise

INPAINT = family("inpaint")


class OnnxStableDiffusionInpaintPipeline(ClipUNetPipeline):
    """Inpainting on ONNX Runtime: repaints where ``mask_image`` is white.

    An inpainting UNet (9 input channels: latents, mask, masked-image latents) is conditioned on the mask, as in
    diffusers' ONNX inpaint pipeline; a plain UNet (4 channels) keeps the unmasked area by blending the noised
    original latents in after every step, as diffusers' torch inpaint pipeline does.
    """

    family = INPAINT
    encodes_images = True

    @property
    def mask_processor(self) -> VaeImageProcessor:
        return VaeImageProcessor(
            vae_scale_factor=self.vae_scale_factor, do_normalize=False, do_binarize=True, do_convert_grayscale=True
        )

    @property
    def unet_in_channels(self) -> int:
        return int(self.unet.config.get("in_channels") or declared_dim(self.unet, "sample", 1) or self.latent_channels)

    def warmup_images(self, height: int, width: int) -> Dict[str, Any]:
        return inpainting_warmup_images(height, width)

    @on_device_stream
    def __call__(
        self,
        prompt: Prompt = None,
        image: ImageInput = None,
        mask_image: ImageInput = None,
        height: Optional[int] = INPAINT.defaults.size,
        width: Optional[int] = INPAINT.defaults.size,
        strength: float = 1.0,
        num_inference_steps: int = INPAINT.defaults.steps,
        guidance_scale: float = INPAINT.defaults.guidance_scale,
        negative_prompt: Prompt = None,
        num_images_per_prompt: int = 1,
        eta: float = 0.0,
        generator: Generator = None,
        latents: Latents = None,
        prompt_embeds: Embeds = None,
        negative_prompt_embeds: Embeds = None,
        output_type: str = "pil",
        return_dict: bool = True,
        callback: StepCallback = None,
        callback_steps: int = 1,
        callback_on_step_end: StepEndCallback = None,
        callback_on_step_end_tensor_inputs: TensorNames = ("latents",),
    ):
        """Repaints the white area of ``mask_image`` in ``image`` as ``prompt`` says; arguments as diffusers'
        ``OnnxStableDiffusionInpaintPipeline``, plus ``strength`` (as in diffusers' torch pipeline, default 1: start
        from pure noise) and ``callback_on_step_end``."""
        # 1. check inputs; 2. text embeddings, on the device
        if image is None or mask_image is None:
            raise ArgumentError(
                "image and mask_image",
                "expected both, got "
                f"{'no image' if image is None else 'an image'} and "
                f"{'no mask_image' if mask_image is None else 'a mask_image'}",
            )
        image_size = self.check_image(image, "image", resized=True)
        mask_size = self.check_image(mask_image, "mask_image", resized=True, mask=True)
        if image_size != mask_size:
            first = mask_image[0] if isinstance(mask_image, list) else mask_image
            # an array's shape says how it was read: a 3-d one is (batch, height, width), as diffusers reads a mask
            layout = ""
            if isinstance(first, (np.ndarray, torch.Tensor)):
                layout = f" (shape {tuple(first.shape)}" + (
                    ", read as (batch, height, width); give a (height, width) mask)" if first.ndim == 3 else ")"
                )
            raise ArgumentError(
                "mask_image",
                f"expected the size of image (height × width {image_size[0]} × "
                f"{image_size[1]}), got {mask_size[0]} × {mask_size[1]}{layout}",
            )
        prompt_embeds, batch_size = self.checked_text_embeddings(
            prompt=prompt,
            negative_prompt=negative_prompt,
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            num_images_per_prompt=num_images_per_prompt,
            guidance_scale=guidance_scale,
            height=height,
            width=width,
            num_inference_steps=num_inference_steps,
            output_type=output_type,
            strength=strength,
            callback_steps=callback_steps,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
            generator=generator,
            callback=callback,
        )
        dtype = prompt_embeds.dtype

        # 3. image, mask and their latents
        image = self.image_processor.preprocess(image, height=height, width=width).to(self.device)
        mask = self.mask_processor.preprocess(mask_image, height=height, width=width).to(self.device)
        latent_size = (height // self.vae_scale_factor, width // self.vae_scale_factor)
        mask_latents = F.interpolate(mask, size=latent_size).to(dtype)
        mask_latents = expand_to_batch(mask_latents, batch_size, num_images_per_prompt, "mask_image")
        image_latents = self.encode_image(image, generator).to(dtype)
        image_latents = expand_to_batch(image_latents, batch_size, num_images_per_prompt, "image")

        # 4. timesteps and initial latents: pure noise at full strength, else the noised image
        timesteps = self.strength_timesteps(num_inference_steps, strength)
        shape = (batch_size * num_images_per_prompt, self.latent_channels, *latent_size)
        noise = self.prepare_latents(shape, dtype, generator, latents)
        if strength == 1.0:
            latents = noise * self.scheduler.init_noise_sigma
        else:
            latents = self.scheduler.add_noise(image_latents, noise, timesteps[:1].repeat(shape[0]))

        unet_extra_channels = None
        after_step = None
        if self.unet_in_channels == self.latent_channels + 1 + self.latent_channels:
            masked_image_latents = self.encode_image(image * (mask < 0.5), generator).to(dtype)
            masked_image_latents = expand_to_batch(masked_image_latents, batch_size, num_images_per_prompt, "image")
            unet_extra_channels = torch.cat([mask_latents, masked_image_latents], dim=1)
            if guidance_scale > 1.0:  # the guidance batch
                unet_extra_channels = torch.cat([unet_extra_channels] * 2)
        elif self.unet_in_channels == self.latent_channels:

            def keep_unmasked(i: int, step_latents: torch.Tensor) -> torch.Tensor:
                # keep the unmasked area: the original latents, noised to where the next step starts
                known = image_latents
                if i < len(timesteps) - 1:
                    known = self.scheduler.add_noise(image_latents, noise, timesteps[i + 1 : i + 2].repeat(shape[0]))
                return (1 - mask_latents) * known + mask_latents * step_latents

            after_step = keep_unmasked
        else:
            raise ArgumentError(
                "unet",
                f"expected {self.latent_channels} input channels (a plain UNet) or "
                f"{2 * self.latent_channels + 1} (an inpainting UNet), got {self.unet_in_channels}",
            )

        # 5. denoising loop: every tensor stays on self.device
        latents = denoise(
            self.denoiser,
            latents,
            timesteps,
            tensors={"prompt_embeds": prompt_embeds},
            guidance=Guidance.classifier_free(guidance_scale),
            step_kwargs=self.scheduler_step_kwargs(generator, eta),
            callback=callback,
            callback_steps=callback_steps,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
            extra_channels=unet_extra_channels,
            after_step=after_step,
        )

        # 6. decode: only now does anything leave the device
        return self.finish(latents, output_type, return_dict)
