"""FLUX.1 Fill (inpainting and outpainting) on ONNX Runtime, the loop on the device: diffusers' ``FluxFillPipeline``.
Its transformer takes, beside each packed latent token's values, the masked image's packed latents and the packed
mask (every VAE-factor × VAE-factor block of mask pixels as values of its latent pixel): 384 values per token for
FLUX.1 Fill, concatenated on the channels at every step, inside the transformer's captured graph."""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional, Tuple

import torch
from diffusers.image_processor import VaeImageProcessor

from ..errors import ArgumentError
from ..families import family
from .arguments import Embeds, Generator, Latents, Prompt, StepEndCallback, TensorNames, no_denoising_step
from .codec import pack_latents
from .core import on_device_stream
from .denoisers import FluxDenoiser
from .flux import MAX_SEQUENCE_LENGTH, FluxFamilyPipeline, image_rows
from .img2img import ImageInput, inpainting_warmup_images
from .loop import Guidance, denoise
from .transfer import tensor_of

FLUX_FILL = family("flux-fill")


def fill_widths(latent_channels: int, vae_scale_factor: int) -> Dict[str, int]:
    """What FLUX.1 Fill's transformer takes per token beside the packed latents, and how many values of each."""
    return {
        "the masked image's packed latents": 4 * latent_channels,
        f"the packed mask: {vae_scale_factor} × {vae_scale_factor} pixels a latent pixel": 4 * vae_scale_factor**2,
    }


class OnnxFluxFillPipeline(FluxFamilyPipeline):
    """FLUX.1 Fill on ONNX Runtime, with the arguments of diffusers' ``FluxFillPipeline``: repaints where
    ``mask_image`` is white (inpainting; a mask around the image outpaints). ``strength`` < 1 starts from the image
    noised to that point of the schedule, as diffusers does."""

    family = FLUX_FILL
    encodes_images = True
    denoiser_part = functools.partial(FluxDenoiser, extra_widths=fill_widths)

    @property
    def mask_processor(self) -> VaeImageProcessor:
        """diffusers' FluxFillPipeline mask processor: grayscale, binarized, not normalized."""
        return VaeImageProcessor(
            vae_scale_factor=self.vae_scale_factor * 2,
            vae_latent_channels=self.latent_channels,
            do_normalize=False,
            do_binarize=True,
            do_convert_grayscale=True,
        )

    def warmup_images(self, height: int, width: int) -> Dict[str, Any]:
        """A blank image and a full mask of the size."""
        return inpainting_warmup_images(height, width)

    # ------------------------------------------------------------------------------------------------- checks
    def check_fill_images(self, image: Any, mask_image: Any, masked_image_latents: Any, strength: Any) -> None:
        """The image arguments, refused by name before any work: an image and its mask (diffusers' ``image`` with
        ``mask_image``), or the conditioning given as ``masked_image_latents`` instead (then no image: the loop
        starts from noise, at ``strength`` 1)."""
        if masked_image_latents is not None:
            if image is not None or mask_image is not None:
                given = "image" if image is not None else "mask_image"
                raise ArgumentError(
                    f"{given} and masked_image_latents", f"expected masked_image_latents alone, got {given} too"
                )
            if strength != 1.0:
                raise ArgumentError(
                    "strength", f"expected 1 with masked_image_latents (no image to start from), got {strength!r}"
                )
            return
        if image is None or mask_image is None:
            raise ArgumentError(
                "image and mask_image",
                f"expected both (or masked_image_latents), got {'no image' if image is None else 'an image'} and "
                f"{'no mask_image' if mask_image is None else 'a mask_image'}",
            )
        self.check_image(image, "image", resized=True)
        self.check_image(mask_image, "mask_image", resized=True, mask=True)

    # ---------------------------------------------------------------------------------------------- the mask
    def conditioning(
        self,
        pixels: torch.Tensor,
        mask_image: Any,
        image_count: int,
        latent_size: Tuple[int, int],
        generator: Generator,
    ) -> torch.Tensor:
        """What the transformer takes beside each latent token, as diffusers makes it: the masked image's packed
        latents, then the mask's pixels of each latent pixel packed the same way, for every image of the call."""
        height, width = pixels.shape[-2:]
        mask = self.mask_processor.preprocess(mask_image, height=height, width=width).to(self.device, torch.float32)
        tiled_mask = self.tiled(mask, image_count, "mask_image")  # refused before the masked image is encoded
        if 1 not in (len(mask), len(pixels)) and len(mask) != len(pixels):
            raise ArgumentError("mask_image", f"expected 1 mask or one per image ({len(pixels)}), got {len(mask)}")
        masked = self.image_latents(pixels * (1 - mask), generator)
        masked = pack_latents(self.tiled(masked, image_count, "image"))
        mask = tiled_mask[:, 0]
        factor = self.vae_scale_factor
        latent_height, latent_width = latent_size
        # each factor × factor block of mask pixels becomes the channels of its latent pixel
        mask = mask.view(image_count, latent_height, factor, latent_width, factor).permute(0, 2, 4, 1, 3)
        mask = mask.reshape(image_count, factor * factor, latent_height, latent_width)
        return torch.cat([masked, pack_latents(mask).to(self.latent_dtype)], dim=-1)

    # --------------------------------------------------------------------------------------------------- call
    @on_device_stream
    def __call__(
        self,
        prompt: Prompt = None,
        prompt_2: Prompt = None,
        image: ImageInput = None,
        mask_image: ImageInput = None,
        masked_image_latents: Latents = None,
        height: Optional[int] = None,
        width: Optional[int] = None,
        strength: float = 1.0,
        num_inference_steps: int = FLUX_FILL.defaults.steps,
        sigmas: Optional[List[float]] = None,
        guidance_scale: float = FLUX_FILL.defaults.guidance_scale,
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
        """Repaints the white area of ``mask_image`` in ``image`` (PIL, numpy HWC in [0, 1], torch NCHW in [0, 1],
        or lists: one for every prompt or one per prompt) as ``prompt`` says, with the arguments of diffusers'
        ``FluxFillPipeline``; see the class. ``masked_image_latents`` (packed: the masked image's latents and the
        packed mask, as the transformer takes them) may replace ``image`` and ``mask_image``. ``latents`` are packed,
        ``(batch, tokens, 4 × latent channels)``; ``output_type="latent"`` returns them packed too.

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
            strength=strength,
            joint_attention_kwargs=joint_attention_kwargs,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
        )
        self.check_fill_images(image, mask_image, masked_image_latents, strength)
        batch_size = self.batch_size_of(prompt, prompt_embeds)
        image_count = self.image_count(batch_size, num_images_per_prompt, generator)
        for name, given in (("image", image), ("mask_image", mask_image)):
            if given is not None:
                self.check_tiling(image_rows(given), image_count, name)
        latent_height, latent_width = self.latent_size(height, width)
        tokens = (latent_height // 2) * (latent_width // 2)
        if masked_image_latents is not None:
            masked_image_latents = self.given_conditioning(masked_image_latents, image_count, tokens)

        # 2. timesteps: the schedule's last strength of it, as diffusers' FluxFillPipeline cuts it (before any
        # component runs: a strength that leaves no step is refused)
        timesteps = self.denoiser.timesteps(num_inference_steps, tokens, sigmas)
        start = int(max(len(timesteps) - min(len(timesteps) * strength, len(timesteps)), 0)) * self.scheduler.order
        timesteps = timesteps[start:]
        self.scheduler.set_begin_index(start)
        if len(timesteps) == 0:
            raise no_denoising_step(strength, num_inference_steps)

        # 3. prompt embeddings, on the device
        prompt_embeds, pooled_prompt_embeds, text_ids = self.encode_prompt(
            prompt, prompt_2, num_images_per_prompt, prompt_embeds, pooled_prompt_embeds, max_sequence_length
        )

        # 4. the initial latents: the image's noised to the first step (pure noise at strength 1), or given
        pixels = self.pixels(image, height, width) if image is not None else None
        if latents is not None:
            latents = self.given_latents(latents, image_count, tokens)
        elif pixels is None:  # masked_image_latents alone: strength 1
            latents = self.initial_latents(image_count, latent_height, latent_width, generator, None)
        else:  # the image encoded before the noise is drawn, as diffusers does (a sampling encoder draws first)
            start_latents = self.tiled(self.image_latents(pixels, generator), image_count, "image")
            noise = self.noise(image_count, latent_height, latent_width, generator)
            sigma = self.scheduler.sigmas[start]  # a CPU scalar: no host wait
            latents = pack_latents(sigma * noise + (1.0 - sigma) * start_latents)

        # 5. the masked image's latents and the mask, concatenated to the latent tokens' values at every step
        if masked_image_latents is None:
            masked_image_latents = self.conditioning(
                pixels, mask_image, image_count, (latent_height, latent_width), generator
            )
        image_ids = self.position_ids(latent_height // 2, latent_width // 2)
        inputs = self.transformer_inputs(text_ids, image_ids, image_count, guidance_scale)

        # 6. the denoising loop: every tensor stays on self.device
        latents = denoise(
            self.denoiser,
            latents,
            timesteps,
            tensors={"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled_prompt_embeds},
            guidance=Guidance(),
            inputs=inputs,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
            extra_channels=masked_image_latents,
        )

        # 7. decode: only now does anything leave the device
        return self.finish(latents, output_type, return_dict, (latent_height, latent_width))

    def given_conditioning(self, masked_image_latents: Latents, image_count: int, tokens: int) -> torch.Tensor:
        """Given ``masked_image_latents`` on the device, refused by name unless of the transformer's extra width
        per token, for every image (or one for all)."""
        given = tensor_of(masked_image_latents, "masked_image_latents")
        width = sum(fill_widths(self.latent_channels, self.vae_scale_factor).values())
        if given.ndim != 3 or given.shape[1:] != (tokens, width) or given.shape[0] not in (1, image_count):
            raise ArgumentError(
                "masked_image_latents",
                f"expected packed latents and mask of shape ({image_count}, {tokens}, {width}) (batch, tokens, the "
                f"transformer's values per token beyond the latents'), got {tuple(given.shape)}",
            )
        return given.to(self.device, self.latent_dtype).expand(image_count, -1, -1).contiguous()
