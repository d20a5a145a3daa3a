"""FLUX.1 Kontext (image editing) on ONNX Runtime, the loop on the device: diffusers' ``FluxKontextPipeline``. The
reference image's packed latents go into the transformer as extra tokens after the latent tokens, with position ids
of their own (first id 1), and the transformer's prediction for them is sliced off; the transformer has FLUX.1's ONNX
interface, so a Kontext folder is told apart by its model_index.json class name."""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..errors import ArgumentError
from ..families import family
from .arguments import (
    Embeds,
    Generator,
    Latents,
    Prompt,
    StepEndCallback,
    TensorNames,
    check_sequence_length,
    is_integer,
    is_real,
)
from .codec import pack_latents
from .core import on_device_stream
from .flux import MAX_SEQUENCE_LENGTH, FluxFamilyPipeline, image_rows
from .img2img import ImageInput
from .loop import denoise

logger = logging.getLogger(__name__)

FLUX_KONTEXT = family("flux-kontext")
# diffusers' default: the output's area in pixels, whatever height and width say (they give the aspect ratio)
MAX_AREA = 1024**2
# the first position id of the reference image's tokens (the latents' is 0)
REFERENCE_IMAGE_ID = 1.0
# the (width, height) sizes a reference image is resized to: None, diffusers' Kontext resolutions, read when an image
# is first resized (diffusers' Kontext module imports transformers' image processors, which warn without torchvision:
# importing this package for another family need not import them)
PREFERRED_KONTEXT_RESOLUTIONS: Optional[List[Tuple[int, int]]] = None


def preferred_resolutions() -> List[Tuple[int, int]]:
    """The sizes a reference image may be resized to, as (width, height): diffusers' Kontext resolutions unless
    ``PREFERRED_KONTEXT_RESOLUTIONS`` is set."""
    if PREFERRED_KONTEXT_RESOLUTIONS is not None:
        return PREFERRED_KONTEXT_RESOLUTIONS
    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS as resolutions

    return list(resolutions)


class OnnxFluxKontextPipeline(FluxFamilyPipeline):
    """FLUX.1 Kontext on ONNX Runtime, with the arguments of diffusers' ``FluxKontextPipeline``: edits ``image`` as
    the prompt says (without an image it makes one from the prompt, as FLUX.1 does).

    As in diffusers the output's size is ``height`` × ``width`` scaled to ``max_area`` pixels (1024² by default:
    height and width give the aspect ratio), and the reference image is resized to the Kontext resolution nearest its
    aspect ratio (``_auto_resize=False``: its own size, rounded down to a multiple of 16). The reference image's
    latents (the VAE encoder's mode, as diffusers' ``sample_mode="argmax"``) are packed into tokens appended to the
    latent tokens at every step, inside the transformer's captured graph; true CFG (``true_cfg_scale`` > 1 with a
    negative prompt) runs negative and positive in one batch.
    """

    family = FLUX_KONTEXT
    encodes_images = True

    def warmup_arguments(self) -> Dict[str, Callable[[Any], None]]:
        """``max_sequence_length`` (see :class:`~.flux.FluxFamilyPipeline`) and ``_auto_resize``: whether the calls
        resize their reference images to a Kontext resolution, which makes the image tokens' count."""

        def check_auto_resize(value: Any) -> None:
            if not isinstance(value, bool):
                raise ArgumentError("_auto_resize", f"expected True or False, got {value!r}")

        return {
            "max_sequence_length": lambda value: check_sequence_length(value, MAX_SEQUENCE_LENGTH),
            "_auto_resize": check_auto_resize,
        }

    def warmup_images(self, height: int, width: int) -> Dict[str, Any]:
        """A blank reference image of the size, and ``max_area`` that keeps the output at it."""
        return {"image": torch.zeros(1, 3, height, width), "height": height, "width": width, "max_area": height * width}

    # ------------------------------------------------------------------------------------------------- checks
    def fitted_size(self, height: Any, width: Any, max_area: Any) -> Tuple[int, int]:
        """The output's height and width as diffusers makes them: ``height`` × ``width``'s aspect ratio at
        ``max_area`` pixels, rounded down to the size multiple (a warning where they change, as diffusers')."""
        for name, value in (("height", height), ("width", width)):
            if not is_integer(value) or value <= 0:
                raise ArgumentError(name, f"expected a positive integer, got {value!r}")
        if not is_real(max_area) or not max_area > 0:
            raise ArgumentError("max_area", f"expected a positive number of pixels, got {max_area!r}")
        multiple = self.size_multiple
        aspect_ratio = width / height
        fitted_width = round((max_area * aspect_ratio) ** 0.5) // multiple * multiple
        fitted_height = round((max_area / aspect_ratio) ** 0.5) // multiple * multiple
        if fitted_width == 0 or fitted_height == 0:
            raise ArgumentError(
                "max_area",
                f"expected room for {multiple} × {multiple} pixels at least at the aspect ratio of {height} × "
                f"{width}, got {max_area!r}",
            )
        if (fitted_height, fitted_width) != (height, width):
            logger.warning(
                "height and width adjusted to %d and %d: %d × %d at max_area %s",
                fitted_height,
                fitted_width,
                height,
                width,
                max_area,
            )
        return fitted_height, fitted_width

    def reference_size(self, image: Any, auto_resize: bool) -> Tuple[int, int]:
        """The size the reference image is resized to, as diffusers chooses it: the Kontext resolution nearest its
        aspect ratio (``auto_resize``), else its own size; either rounded down to the size multiple."""
        if not isinstance(auto_resize, bool):
            raise ArgumentError("_auto_resize", f"expected True or False, got {auto_resize!r}")
        height, width = self.check_image(image, "image", resized=True)  # the first image's, whatever its layout
        multiple = self.size_multiple  # rounded down first: diffusers reads the aspect ratio of the rounded size
        height, width = height // multiple * multiple, width // multiple * multiple
        if auto_resize and height and width:
            _, width, height = min((abs(width / height - w / h), w, h) for w, h in preferred_resolutions())
        if height == 0 or width == 0:
            raise ArgumentError(
                "image",
                f"expected at least {multiple} × {multiple} pixels (one packed latent token), got a smaller one",
            )
        return height, width

    # ---------------------------------------------------------------------------------------- the reference
    def are_latents(self, image: Any) -> bool:
        """Whether ``image`` is given as latents, as diffusers takes them: a tensor of the latents' channels,
        ``(batch, channels, height, width)``, scaled (refused by name unless its height and width are even)."""
        if not (isinstance(image, torch.Tensor) and image.ndim == 4 and image.shape[1] == self.latent_channels):
            return False
        if image.shape[2] % 2 or image.shape[3] % 2 or 0 in image.shape:
            raise ArgumentError(
                "image",
                f"expected latents of an even, non-zero height and width (2×2 packing), got {tuple(image.shape)}",
            )
        return True

    def reference_latents(
        self, image: Any, size: Optional[Tuple[int, int]], image_count: int
    ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The reference image's packed latents for every image of the call (diffusers' tiling: the images given,
        repeated as a whole), and their position ids; ``(None, None)`` without an image. ``size``: what the image is
        resized to (``None``: it is latents)."""
        if image is None:
            return None, None
        if size is None:
            latents = image.to(device=self.device, dtype=self.latent_dtype)
        else:  # diffusers' sample_mode="argmax": the mode, whatever the generator
            latents = self.image_latents(self.pixels(image, *size), generator=None)
        latents = self.tiled(latents, image_count, "image")
        ids = self.position_ids(latents.shape[2] // 2, latents.shape[3] // 2, first=REFERENCE_IMAGE_ID)
        return pack_latents(latents), ids

    # --------------------------------------------------------------------------------------------------- call
    @on_device_stream
    def __call__(
        self,
        image: ImageInput = None,
        prompt: Prompt = None,
        prompt_2: Prompt = None,
        negative_prompt: Prompt = None,
        negative_prompt_2: Prompt = None,
        true_cfg_scale: float = 1.0,
        height: Optional[int] = None,
        width: Optional[int] = None,
        num_inference_steps: int = FLUX_KONTEXT.defaults.steps,
        sigmas: Optional[List[float]] = None,
        guidance_scale: float = FLUX_KONTEXT.defaults.guidance_scale,
        num_images_per_prompt: int = 1,
        generator: Generator = None,
        latents: Latents = None,
        prompt_embeds: Embeds = None,
        pooled_prompt_embeds: Embeds = None,
        negative_prompt_embeds: Embeds = None,
        negative_pooled_prompt_embeds: Embeds = None,
        output_type: str = "pil",
        return_dict: bool = True,
        joint_attention_kwargs: Optional[Dict[str, Any]] = None,
        callback_on_step_end: StepEndCallback = None,
        callback_on_step_end_tensor_inputs: TensorNames = ("latents",),
        max_sequence_length: int = MAX_SEQUENCE_LENGTH,
        max_area: int = MAX_AREA,
        _auto_resize: bool = True,
    ):
        """Edits ``image`` (PIL, numpy HWC in [0, 1], a torch NCHW tensor in [0, 1], latents of the VAE's channels,
        or a list) as ``prompt`` says, with the arguments of diffusers' ``FluxKontextPipeline`` (IP-Adapter aside);
        see the class. ``latents`` are packed, ``(batch, tokens, 4 × latent channels)``; ``output_type="latent"``
        returns them packed too.

        Returns:
            ``FluxPipelineOutput(images)``, or ``(images,)`` without ``return_dict``.
        """
        # 1. check inputs: the output's size fitted to max_area, the reference image's size
        height, width = self.fitted_size(
            self.default_image_size if height is None else height,
            self.default_image_size if width is None else width,
            max_area,
        )
        self.check_inputs_flux(
            prompt=prompt,
            prompt_2=prompt_2,
            negative_prompt=negative_prompt,
            negative_prompt_2=negative_prompt_2,
            true_cfg_scale=true_cfg_scale,
            prompt_embeds=prompt_embeds,
            pooled_prompt_embeds=pooled_prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            negative_pooled_prompt_embeds=negative_pooled_prompt_embeds,
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
        reference_size = None
        if image is not None and not self.are_latents(image):
            reference_size = self.reference_size(image, _auto_resize)
        batch_size = self.batch_size_of(prompt, prompt_embeds)
        image_count = self.image_count(batch_size, num_images_per_prompt, generator)
        if image is not None:
            self.check_tiling(image_rows(image), image_count, "image")

        # 2. prompt embeddings (the negative prompt's with true CFG), on the device
        tensors, text_ids, guidance = self.text_tensors(
            prompt=prompt,
            prompt_2=prompt_2,
            negative_prompt=negative_prompt,
            negative_prompt_2=negative_prompt_2,
            true_cfg_scale=true_cfg_scale,
            prompt_embeds=prompt_embeds,
            pooled_prompt_embeds=pooled_prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            negative_pooled_prompt_embeds=negative_pooled_prompt_embeds,
            num_images_per_prompt=num_images_per_prompt,
            max_sequence_length=max_sequence_length,
        )

        # 3. the reference image's packed latents and position ids; the initial noise and the latents' ids
        reference, reference_ids = self.reference_latents(image, reference_size, image_count)
        latent_height, latent_width = self.latent_size(height, width)
        latents = self.initial_latents(image_count, latent_height, latent_width, generator, latents)
        image_ids = self.position_ids(latent_height // 2, latent_width // 2)
        if reference is not None:
            image_ids = torch.cat([image_ids, reference_ids])

        # 4. timesteps (shifted for the latent tokens alone, as diffusers), the transformer's constant inputs
        timesteps = self.denoiser.timesteps(num_inference_steps, latents.shape[1], sigmas)
        inputs = self.transformer_inputs(text_ids, image_ids, image_count * guidance.copies, guidance_scale)

        # 5. the denoising loop: the reference tokens follow the latent tokens, their prediction sliced off
        latents = denoise(
            self.denoiser,
            latents,
            timesteps,
            tensors=tensors,
            guidance=guidance,
            inputs=inputs,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
            extra_tokens=None if reference is None else torch.cat([reference] * guidance.copies),
        )

        # 6. decode: only now does anything leave the device
        return self.finish(latents, output_type, return_dict, (latent_height, latent_width))
