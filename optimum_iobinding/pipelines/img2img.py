"""Image to image: diffusers' ``OnnxStableDiffusionImg2ImgPipeline`` with its denoising loop on the device."""

from __future__ import annotations

from typing import Any, Dict, List, Union

import numpy as np
import PIL.Image
import torch

from ..families import family
from .arguments import Embeds, Generator, Prompt, StepCallback, StepEndCallback, TensorNames
from .clip_unet import ClipUNetPipeline
from .core import on_device_stream
from .loop import Guidance, denoise

SD_IMG2IMG = family("sd-img2img")

ImageInput = Union[torch.Tensor, np.ndarray, PIL.Image.Image, List[Any]]


def inpainting_warmup_images(height: int, width: int) -> Dict[str, Any]:
    """The images an inpainting family's warm-up call takes: a blank image and a full mask of the size."""
    return {
        "image": torch.zeros(1, 3, height, width),
        "mask_image": torch.ones(1, 1, height, width),
        "height": height,
        "width": width,
    }


class OnnxStableDiffusionImg2ImgPipeline(ClipUNetPipeline):
    """Image-to-image Stable Diffusion on ONNX Runtime; needs the folder's ``vae_encoder``."""

    family = SD_IMG2IMG
    encodes_images = True

    @on_device_stream
    def __call__(
        self,
        prompt: Prompt = None,
        image: ImageInput = None,
        strength: float = 0.8,
        num_inference_steps: int = SD_IMG2IMG.defaults.steps,
        guidance_scale: float = SD_IMG2IMG.defaults.guidance_scale,
        negative_prompt: Prompt = None,
        num_images_per_prompt: int = 1,
        eta: float = 0.0,
        generator: Generator = None,
        prompt_embeds: Embeds = None,
        negative_prompt_embeds: Embeds = None,
        output_type: str = "pil",
        return_dict: bool = True,
        callback: StepCallback = None,
        callback_steps: int = 1,
        callback_on_step_end: StepEndCallback = None,
        callback_on_step_end_tensor_inputs: TensorNames = ("latents",),
        ip_adapter_image: Any = None,
        ip_adapter_image_embeds: Any = None,
    ):
        """Transforms ``image`` (PIL, numpy HWC in [0, 1], or torch NCHW in [-1, 1]) as ``prompt`` says; arguments
        as diffusers' ``OnnxStableDiffusionImg2ImgPipeline``, plus ``callback_on_step_end`` and a loaded IP-Adapter's
        ``ip_adapter_image`` / ``ip_adapter_image_embeds``. ``strength`` in [0, 1] is how much of the schedule runs
        (1: ignore the image's content)."""
        # 1. check inputs; 2. text embeddings and the image prompt, on the device
        self.check_image_prompt(ip_adapter_image, ip_adapter_image_embeds)
        image = self.start_image(image)
        height, width = image.shape[-2:]
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

        image_prompt = self.image_prompt_inputs(
            ip_adapter_image, ip_adapter_image_embeds, batch_size * num_images_per_prompt, guidance_scale > 1.0
        )

        # 3. timesteps for this strength; the image's latents noised to the first of them
        timesteps = self.strength_timesteps(num_inference_steps, strength)
        latents = self.noised_image_latents(
            image, timesteps, generator, batch_size, num_images_per_prompt, prompt_embeds.dtype
        )

        # 4. denoising loop: every tensor stays on self.device
        latents = denoise(
            self.denoiser,
            latents,
            timesteps,
            tensors={"prompt_embeds": prompt_embeds},
            inputs=image_prompt,
            guidance=Guidance.classifier_free(guidance_scale),
            step_kwargs=self.scheduler_step_kwargs(generator, eta),
            callback=callback,
            callback_steps=callback_steps,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
        )

        # 5. decode: only now does anything leave the device
        return self.finish(latents, output_type, return_dict)
