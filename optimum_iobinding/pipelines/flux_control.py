"""FLUX.1 Control (FLUX.1 Canny, Depth) on ONNX Runtime, the loop on the device: diffusers' ``FluxControlPipeline``.
Its transformer takes, beside each packed latent token's values, the control image's packed latents: 128 values per
token for FLUX.1 Canny/Depth, concatenated on the channels at every step, inside the transformer's captured graph."""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional

import torch

from ..errors import ArgumentError, ArgumentTypeError
from ..families import family
from .arguments import Embeds, Generator, Latents, Prompt, StepEndCallback, TensorNames
from .codec import pack_latents
from .core import on_device_stream
from .denoisers import FluxDenoiser
from .flux import MAX_SEQUENCE_LENGTH, FluxFamilyPipeline
from .img2img import ImageInput
from .loop import Guidance, denoise

FLUX_CONTROL = family("flux-control")


def control_widths(latent_channels: int, vae_scale_factor: int) -> Dict[str, int]:
    """What FLUX.1 Control's transformer takes per token beside the packed latents, and how many values of it."""
    return {"the control image's packed latents": 4 * latent_channels}


class OnnxFluxControlPipeline(FluxFamilyPipeline):
    """FLUX.1 Control (Canny, Depth) on ONNX Runtime, with the arguments of diffusers' ``FluxControlPipeline``: the
    image follows ``control_image`` (an edge map, a depth map), whose latents the transformer takes beside the
    latents'."""

    family = FLUX_CONTROL
    encodes_images = True
    denoiser_part = functools.partial(FluxDenoiser, extra_widths=control_widths)

    def warmup_images(self, height: int, width: int) -> Dict[str, Any]:
        """A blank control image of the size."""
        return {"control_image": torch.zeros(1, 3, height, width), "height": height, "width": width}

    # ------------------------------------------------------------------------------------------------- checks
    def check_control_image(self, control_image: Any, height: int, width: int, batch: int) -> None:
        """The control image, refused by name before any work: an image (PIL, numpy, a list: one for every prompt or
        one per prompt), or as diffusers takes a tensor as it is: pixels in [-1, 1] of the call's size ``(batch, 3,
        height, width)``, or packed latents ``(batch, tokens, 4 × latent channels)``."""
        if control_image is None:
            raise ArgumentError(
                "control_image", "expected an image the output follows (an edge or depth map), got None"
            )
        if not isinstance(control_image, torch.Tensor):
            self.check_image(control_image, "control_image", resized=True)
            self.check_control_count(len(control_image) if isinstance(control_image, list) else 1, batch)
            return
        latent_height, latent_width = self.latent_size(height, width)
        tokens = (latent_height // 2) * (latent_width // 2)
        if control_image.ndim == 4:
            expected, rows = (3, height, width), "(batch, 3, height, width): pixels in [-1, 1]"
        elif control_image.ndim == 3:
            expected, rows = (tokens, 4 * self.latent_channels), "(batch, tokens, 4 × latent channels): packed latents"
        else:
            raise ArgumentTypeError(
                "control_image",
                f"expected a tensor of pixels or packed latents, got shape {tuple(control_image.shape)}",
            )
        if tuple(control_image.shape[1:]) != expected or control_image.shape[0] not in (1, batch):
            raise ArgumentError(
                "control_image",
                f"expected a tensor of shape ({batch if batch == 1 else f'{batch} or 1'}, "
                f"{', '.join(map(str, expected))}) {rows}, "
                f"got {tuple(control_image.shape)}",
            )

    @staticmethod
    def check_control_count(count: int, batch: int) -> None:
        """One control image for every prompt, or one per prompt (``batch``: the prompts)."""
        if count not in (1, batch):
            raise ArgumentError(
                "control_image",
                f"expected {'1 image' if batch == 1 else f'1 or {batch} images (one for every prompt or one per prompt)'}, "
                f"got {count}",
            )

    # -------------------------------------------------------------------------------------- the control image
    def control_latents(
        self,
        control_image: Any,
        height: int,
        width: int,
        image_count: int,
        num_images_per_prompt: int,
        generator: Generator,
    ) -> torch.Tensor:
        """The control image's packed latents for every image of the call, as diffusers makes them: one image for
        every prompt or one per prompt (each ``num_images_per_prompt`` times), encoded (sampled with a torch
        generator where the VAE encoder gives a distribution) and packed; a 3-d tensor is packed latents already."""
        if isinstance(control_image, torch.Tensor):
            pixels = control_image.to(self.device, torch.float32)
        else:
            pixels = self.pixels(control_image, height, width)
        self.check_control_count(pixels.shape[0], image_count // num_images_per_prompt)  # a numpy batch's
        repeats = image_count if pixels.shape[0] == 1 else num_images_per_prompt
        pixels = pixels.repeat_interleave(repeats, dim=0)
        if pixels.ndim == 3:
            return pixels.to(self.latent_dtype)
        return pack_latents(self.image_latents(pixels, generator))

    # --------------------------------------------------------------------------------------------------- call
    @on_device_stream
    def __call__(
        self,
        prompt: Prompt = None,
        prompt_2: Prompt = None,
        control_image: ImageInput = None,
        height: Optional[int] = None,
        width: Optional[int] = None,
        num_inference_steps: int = FLUX_CONTROL.defaults.steps,
        sigmas: Optional[List[float]] = None,
        guidance_scale: float = FLUX_CONTROL.defaults.guidance_scale,
        num_images_per_prompt: int = 1,
        generator: Generator = None,
        latents: Latents = None,
        prompt_embeds: Embeds = None,
        pooled_prompt_embeds: Embeds = None,
        output_type: str = "pil",
        return_dict: bool = True,
        joint_attention_kwargs: Optional[Dict[str, Any]] = None,
        callback_on_step_end: StepEndCallback = None,
        callback_on_step_end_tensor_inputs: TensorNames = ("latents",),
        max_sequence_length: int = MAX_SEQUENCE_LENGTH,
    ):
        """Generates images that follow ``control_image`` as ``prompt`` says, with the arguments of diffusers'
        ``FluxControlPipeline``; see the class and :meth:`check_control_image`. ``latents`` are packed, ``(batch,
        tokens, 4 × latent channels)``; ``output_type="latent"`` returns them packed too.

        Returns:
            ``FluxPipelineOutput(images)``, or ``(images,)`` without ``return_dict``.
        """
        # 1. check inputs
        height = self.default_image_size if height is None else height
        width = self.default_image_size if width is None else width
        self.check_inputs_flux(
            prompt=prompt,
            prompt_2=prompt_2,
            prompt_embeds=prompt_embeds,
            pooled_prompt_embeds=pooled_prompt_embeds,
            max_sequence_length=max_sequence_length,
            height=height,
            width=width,
            num_inference_steps=num_inference_steps,
            sigmas=sigmas,
            guidance_scale=guidance_scale,
            num_images_per_prompt=num_images_per_prompt,
            output_type=output_type,
            joint_attention_kwargs=joint_attention_kwargs,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
        )
        batch_size = self.batch_size_of(prompt, prompt_embeds)
        image_count = self.image_count(batch_size, num_images_per_prompt, generator)
        self.check_control_image(control_image, height, width, batch_size)

        # 2. prompt embeddings, on the device
        prompt_embeds, pooled_prompt_embeds, text_ids = self.encode_prompt(
            prompt, prompt_2, num_images_per_prompt, prompt_embeds, pooled_prompt_embeds, max_sequence_length
        )

        # 3. the control image's packed latents (encoded before the noise is drawn, as diffusers does), the noise
        control = self.control_latents(control_image, height, width, image_count, num_images_per_prompt, generator)
        latent_height, latent_width = self.latent_size(height, width)
        latents = self.initial_latents(image_count, latent_height, latent_width, generator, latents)
        image_ids = self.position_ids(latent_height // 2, latent_width // 2)

        # 4. timesteps, the transformer's constant inputs
        timesteps = self.denoiser.timesteps(num_inference_steps, latents.shape[1], sigmas)
        inputs = self.transformer_inputs(text_ids, image_ids, image_count, guidance_scale)

        # 5. the denoising loop: the control latents concatenated to the latent tokens' values at every step
        latents = denoise(
            self.denoiser,
            latents,
            timesteps,
            tensors={"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled_prompt_embeds},
            guidance=Guidance(),
            inputs=inputs,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
            extra_channels=control,
        )

        # 6. decode: only now does anything leave the device
        return self.finish(latents, output_type, return_dict, (latent_height, latent_width))
