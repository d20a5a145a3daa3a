"""SDXL text-to-image and image-to-image on ONNX Runtime, the loop on the device: optimum's SDXL export layout (two
text encoders with their hidden states; a UNet taking the pooled text embedding ``text_embeds`` and ``time_ids``)."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np
import PIL.Image
import torch
from diffusers.pipelines.stable_diffusion_xl import StableDiffusionXLPipelineOutput

from ..errors import ArgumentError, ModelFileError
from ..families import SDXL_TEXT_EMBEDS, SDXL_TIME_IDS, family
from ..layout import write_xl_model_index
from .arguments import Embeds, Generator, Latents, Prompt, StepEndCallback, TensorNames
from .components import VAE_COMPONENTS, declared_dim, onnx, tokenizer
from .core import OnnxDiffusionPipeline, Warmup, on_device_stream
from .denoisers import UNetDenoiser
from .ip_adapter import IPAdapterMixin
from .lora import LoraLoaderMixin
from .loop import Guidance, denoise
from .prompts import CLIPPairPrompt

# optimum's SDXL folder (the refiner has no first text encoder)
XL_COMPONENTS = (
    onnx("text_encoder", optional=True),
    onnx("text_encoder_2"),
    tokenizer("tokenizer", optional=True),
    tokenizer("tokenizer_2"),
    onnx("unet"),
    *VAE_COMPONENTS,
    onnx("image_encoder", optional=True),  # IP-Adapter's, where the export has one
)
SDXL, SDXL_IMG2IMG = family("sdxl"), family("sdxl-img2img")


class OnnxStableDiffusionXLPipelineBase(IPAdapterMixin, LoraLoaderMixin, Warmup, OnnxDiffusionPipeline):
    """The declaration SDXL's pipelines share: two tokenizers and text encoders (the refiner has only the second),
    the penultimate hidden states of both concatenated, the second's pooled projection, and the size/crop/aesthetic
    conditioning ``time_ids``."""

    declared_components = XL_COMPONENTS
    denoiser_part = functools.partial(UNetDenoiser, default_sample_size=128)
    prompt_part = CLIPPairPrompt
    settings = {"force_zeros_for_empty_prompt": True, "requires_aesthetics_score": False}
    model_cpu_offload_seq = "text_encoder->text_encoder_2->unet->vae_decoder"
    output_class = StableDiffusionXLPipelineOutput

    @property
    def time_ids_length(self) -> Optional[int]:
        """How many micro-conditioning values the UNet's ``time_ids`` takes (``None``: dynamic)."""
        return declared_dim(self.unet, SDXL_TIME_IDS, 1)

    def check_inputs_xl(
        self,
        prompt: Prompt,
        prompt_2: Prompt,
        negative_prompt: Prompt,
        negative_prompt_2: Prompt,
        prompt_embeds: Any,
        negative_prompt_embeds: Any,
        pooled_prompt_embeds: Any,
        negative_pooled_prompt_embeds: Any,
    ) -> None:
        """What SDXL adds to :meth:`check_inputs`, refused before any work: the second prompts (a str or a list of
        str, one per prompt) and the pooled embeddings (``(batch, width)``, the width the UNet's ``text_embeds``
        declares, one row per row of the hidden states)."""
        prompts = self.batch_size_of(prompt, prompt_embeds) if prompt is not None or prompt_embeds is not None else None
        if prompt_embeds is not None and pooled_prompt_embeds is None:
            raise ArgumentError(
                "pooled_prompt_embeds", "expected them with prompt_embeds (SDXL's UNet takes both), got None"
            )
        for name, texts, rival, rival_name in (
            ("prompt_2", prompt_2, prompt_embeds, "prompt_embeds"),
            ("negative_prompt_2", negative_prompt_2, negative_prompt_embeds, "negative_prompt_embeds"),
        ):
            if texts is None:
                continue
            if rival is not None:
                raise ArgumentError(f"{name} and {rival_name}", "expected at most one of them, got both")
            # a single negative_prompt_2 goes with every prompt
            self.check_texts(name, texts, prompts, broadcast=name == "negative_prompt_2")
        if (
            isinstance(negative_prompt, list)
            and isinstance(negative_prompt_2, list)
            and len(negative_prompt) != len(negative_prompt_2)
        ):
            raise ArgumentError(
                "negative_prompt_2",
                f"expected {len(negative_prompt)} prompts (as many as negative_prompt), got {len(negative_prompt_2)}",
            )
        for name, pooled, embeds in (
            ("pooled_prompt_embeds", pooled_prompt_embeds, prompt_embeds),
            ("negative_pooled_prompt_embeds", negative_pooled_prompt_embeds, negative_prompt_embeds),
        ):
            if pooled is None:
                continue
            self.check_embeds(name, pooled, 2, "(batch, width)", "text_embeds")
            if embeds is not None and pooled.shape[0] != embeds.shape[0]:
                raise ArgumentError(
                    name,
                    f"expected {embeds.shape[0]} rows like {name.replace('pooled_', '')}, got "
                    f"shape {tuple(pooled.shape)}",
                )
            if embeds is None:
                raise ArgumentError(name, f"expected it with {name.replace('pooled_', '')}, got it alone")

    # ------------------------------------------------------------------------------------------ conditioning
    def time_ids(
        self,
        original_size: Tuple[int, int],
        crops_coords_top_left: Tuple[int, int],
        target_size: Tuple[int, int],
        aesthetic_score: float,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """SDXL's micro-conditioning: original size, crop corner, then target size (base) or aesthetic score
        (refiner, ``requires_aesthetics_score``), as one row."""
        for name, pair in (
            ("original_size", original_size),
            ("crops_coords_top_left", crops_coords_top_left),
            ("target_size", target_size),
        ):
            if (
                not isinstance(pair, (tuple, list))
                or len(pair) != 2
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in pair)
            ):
                raise ArgumentError(name, f"expected (height, width): two numbers, got {pair!r}")
        if not isinstance(aesthetic_score, (int, float)) or not math.isfinite(aesthetic_score):
            raise ArgumentError("aesthetic_score", f"expected a finite number, got {aesthetic_score!r}")
        if self.config.requires_aesthetics_score:
            values = list(original_size) + list(crops_coords_top_left) + [aesthetic_score]
        else:
            values = list(original_size) + list(crops_coords_top_left) + list(target_size)
        if self.time_ids_length is not None and len(values) != self.time_ids_length:
            hint = (
                "set requires_aesthetics_score" if self.time_ids_length == 5 else "unset requires_aesthetics_score"
            ) + " in model_index.json"
            raise ModelFileError(
                "unet time_ids",
                f"the UNet takes {self.time_ids_length} values, the pipeline makes {len(values)}: {hint}",
            )
        return torch.tensor([values], dtype=dtype)

    def unet_conditioning(
        self,
        pooled: torch.Tensor,
        add_time_ids: torch.Tensor,
        negative_time_ids: torch.Tensor,
        rows: int,
        do_classifier_free_guidance: bool,
    ) -> Dict[str, torch.Tensor]:
        """``text_embeds`` and ``time_ids`` for every UNet row, on the device, made once before the loop."""
        positive = add_time_ids.repeat(rows, 1)
        time_ids = torch.cat([negative_time_ids.repeat(rows, 1), positive]) if do_classifier_free_guidance else positive
        return {SDXL_TEXT_EMBEDS: pooled, SDXL_TIME_IDS: time_ids.to(self.device)}

    def write_model_index(self, target: Path, written: List[str]) -> None:
        modules = {
            "text_encoder": "CLIPTextModel" if "text_encoder" in written else None,
            "text_encoder_2": "CLIPTextModelWithProjection",
        }
        for name in ("tokenizer", "tokenizer_2"):
            modules[name] = type(getattr(self, name)).__name__ if getattr(self, name, None) is not None else None
        write_xl_model_index(
            target,
            self.family.index_class_name,
            type(self.scheduler).__name__,
            modules,
            self.config.force_zeros_for_empty_prompt,
            self.config.requires_aesthetics_score,
            [name for name in written if name.startswith("controlnet")],
        )


class OnnxStableDiffusionXLImg2ImgPipeline(OnnxStableDiffusionXLPipelineBase):
    """SDXL image-to-image (also the refiner, whose folder has only ``text_encoder_2`` and sets
    ``requires_aesthetics_score``), with the arguments of diffusers' ``StableDiffusionXLImg2ImgPipeline``."""

    family = SDXL_IMG2IMG
    encodes_images = True

    @on_device_stream
    def __call__(
        self,
        prompt: Prompt = None,
        prompt_2: Prompt = None,
        image: Union[PIL.Image.Image, np.ndarray, torch.Tensor, List[PIL.Image.Image], None] = None,
        strength: float = 0.3,
        num_inference_steps: int = SDXL_IMG2IMG.defaults.steps,
        guidance_scale: float = SDXL_IMG2IMG.defaults.guidance_scale,
        negative_prompt: Prompt = None,
        negative_prompt_2: Prompt = None,
        num_images_per_prompt: int = 1,
        eta: float = 0.0,
        generator: Generator = None,
        prompt_embeds: Embeds = None,
        negative_prompt_embeds: Embeds = None,
        pooled_prompt_embeds: Embeds = None,
        negative_pooled_prompt_embeds: Embeds = None,
        output_type: str = "pil",
        return_dict: bool = True,
        guidance_rescale: float = 0.0,
        original_size: Optional[Tuple[int, int]] = None,
        crops_coords_top_left: Tuple[int, int] = (0, 0),
        target_size: Optional[Tuple[int, int]] = None,
        aesthetic_score: float = 6.0,
        negative_aesthetic_score: float = 2.5,
        clip_skip: Optional[int] = None,
        callback_on_step_end: StepEndCallback = None,
        callback_on_step_end_tensor_inputs: TensorNames = ("latents",),
        ip_adapter_image: Any = None,
        ip_adapter_image_embeds: Any = None,
    ):
        """Transforms ``image`` guided by text; ``strength`` in [0, 1] says how much of the schedule runs.
        ``ip_adapter_image`` / ``ip_adapter_image_embeds``: the image prompt of a loaded IP-Adapter.

        Returns:
            ``StableDiffusionXLPipelineOutput(images)``, or a tuple without return_dict.
        """
        self.check_image_prompt(ip_adapter_image, ip_adapter_image_embeds)
        pixels = self.start_image(image)
        height, width = pixels.shape[-2:]
        self.check_inputs(
            prompt=prompt,
            negative_prompt=negative_prompt,
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            height=height,
            width=width,
            num_inference_steps=num_inference_steps,
            output_type=output_type,
            strength=strength,
            guidance_scale=guidance_scale,
            guidance_rescale=guidance_rescale,
            num_images_per_prompt=num_images_per_prompt,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
            generator=generator,
        )
        self.check_inputs_xl(
            prompt,
            prompt_2,
            negative_prompt,
            negative_prompt_2,
            prompt_embeds,
            negative_prompt_embeds,
            pooled_prompt_embeds,
            negative_pooled_prompt_embeds,
        )
        batch_size = self.batch_size_of(prompt, prompt_embeds)
        do_classifier_free_guidance = guidance_scale > 1.0
        prompt_embeds, pooled = self.encode_prompt(
            prompt,
            prompt_2,
            num_images_per_prompt,
            do_classifier_free_guidance,
            negative_prompt,
            negative_prompt_2,
            prompt_embeds,
            negative_prompt_embeds,
            pooled_prompt_embeds,
            negative_pooled_prompt_embeds,
            clip_skip,
        )
        rows = batch_size * num_images_per_prompt

        # the image's latents, noised to where the shortened schedule starts
        timesteps = self.strength_timesteps(num_inference_steps, strength)
        latents = self.noised_image_latents(
            pixels, timesteps, generator, batch_size, num_images_per_prompt, prompt_embeds.dtype
        )

        original_size = original_size or (height, width)
        target_size = target_size or (height, width)
        add_time_ids = self.time_ids(
            original_size, crops_coords_top_left, target_size, aesthetic_score, prompt_embeds.dtype
        )
        negative_time_ids = self.time_ids(
            original_size, crops_coords_top_left, target_size, negative_aesthetic_score, prompt_embeds.dtype
        )
        conditioning = self.unet_conditioning(
            pooled, add_time_ids, negative_time_ids, rows, do_classifier_free_guidance
        )
        latents = denoise(
            self.denoiser,
            latents,
            timesteps,
            tensors={"prompt_embeds": prompt_embeds},
            guidance=Guidance.classifier_free(guidance_scale, guidance_rescale),
            inputs={
                **conditioning,
                **self.image_prompt_inputs(
                    ip_adapter_image, ip_adapter_image_embeds, rows, do_classifier_free_guidance
                ),
            },
            step_kwargs=self.scheduler_step_kwargs(generator, eta),
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
        )
        return self.finish(latents, output_type, return_dict)


class OnnxStableDiffusionXLPipeline(OnnxStableDiffusionXLPipelineBase):
    """SDXL text-to-image with the arguments of diffusers' ``StableDiffusionXLPipeline``: every tensor of the loop
    stays on the UNet's device with ``io_binding=True``; on CUDA every component replays its CUDA graphs by default (``cuda_graph="auto"``)."""

    family = SDXL

    @on_device_stream
    def __call__(
        self,
        prompt: Prompt = None,
        prompt_2: Prompt = None,
        height: Optional[int] = None,
        width: Optional[int] = None,
        num_inference_steps: int = SDXL.defaults.steps,
        guidance_scale: float = SDXL.defaults.guidance_scale,
        negative_prompt: Prompt = None,
        negative_prompt_2: Prompt = None,
        num_images_per_prompt: int = 1,
        eta: float = 0.0,
        generator: Generator = None,
        latents: Latents = None,
        prompt_embeds: Embeds = None,
        negative_prompt_embeds: Embeds = None,
        pooled_prompt_embeds: Embeds = None,
        negative_pooled_prompt_embeds: Embeds = None,
        output_type: str = "pil",
        return_dict: bool = True,
        guidance_rescale: float = 0.0,
        original_size: Optional[Tuple[int, int]] = None,
        crops_coords_top_left: Tuple[int, int] = (0, 0),
        target_size: Optional[Tuple[int, int]] = None,
        negative_original_size: Optional[Tuple[int, int]] = None,
        negative_crops_coords_top_left: Tuple[int, int] = (0, 0),
        negative_target_size: Optional[Tuple[int, int]] = None,
        clip_skip: Optional[int] = None,
        callback_on_step_end: StepEndCallback = None,
        callback_on_step_end_tensor_inputs: TensorNames = ("latents",),
        ip_adapter_image: Any = None,
        ip_adapter_image_embeds: Any = None,
    ):
        """Generates images from text. ``height``/``width`` default to the UNet's sample size × the VAE factor
        (1024 for SDXL). ``generator`` is a numpy ``RandomState`` or a ``torch.Generator``. ``ip_adapter_image`` /
        ``ip_adapter_image_embeds``: the image prompt of a loaded IP-Adapter (:meth:`load_ip_adapter`).

        Returns:
            ``StableDiffusionXLPipelineOutput(images)``, or a tuple without return_dict.
        """
        self.check_image_prompt(ip_adapter_image, ip_adapter_image_embeds)
        height = self.default_image_size if height is None else height
        width = self.default_image_size if width is None else width
        self.check_inputs(
            prompt=prompt,
            negative_prompt=negative_prompt,
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            height=height,
            width=width,
            num_inference_steps=num_inference_steps,
            output_type=output_type,
            guidance_scale=guidance_scale,
            guidance_rescale=guidance_rescale,
            num_images_per_prompt=num_images_per_prompt,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
            generator=generator,
        )
        self.check_inputs_xl(
            prompt,
            prompt_2,
            negative_prompt,
            negative_prompt_2,
            prompt_embeds,
            negative_prompt_embeds,
            pooled_prompt_embeds,
            negative_pooled_prompt_embeds,
        )
        batch_size = self.batch_size_of(prompt, prompt_embeds)
        do_classifier_free_guidance = guidance_scale > 1.0

        # 1. text: both encoders' penultimate states, the second's pooled projection
        prompt_embeds, pooled = self.encode_prompt(
            prompt,
            prompt_2,
            num_images_per_prompt,
            do_classifier_free_guidance,
            negative_prompt,
            negative_prompt_2,
            prompt_embeds,
            negative_prompt_embeds,
            pooled_prompt_embeds,
            negative_pooled_prompt_embeds,
            clip_skip,
        )

        # 2. timesteps and initial noise
        timesteps = self.set_timesteps(num_inference_steps)
        rows = batch_size * num_images_per_prompt
        latents = self.initial_noise(rows, height, width, prompt_embeds.dtype, generator, latents)

        # 3. size conditioning, made once
        original_size = original_size or (height, width)
        target_size = target_size or (height, width)
        add_time_ids = self.time_ids(original_size, crops_coords_top_left, target_size, 0.0, prompt_embeds.dtype)
        negative_time_ids = (
            add_time_ids
            if negative_original_size is None and negative_target_size is None
            else self.time_ids(
                negative_original_size or original_size,
                negative_crops_coords_top_left,
                negative_target_size or target_size,
                0.0,
                prompt_embeds.dtype,
            )
        )
        conditioning = self.unet_conditioning(
            pooled, add_time_ids, negative_time_ids, rows, do_classifier_free_guidance
        )

        # 4. denoising loop on the device
        latents = denoise(
            self.denoiser,
            latents,
            timesteps,
            tensors={"prompt_embeds": prompt_embeds},
            guidance=Guidance.classifier_free(guidance_scale, guidance_rescale),
            inputs={
                **conditioning,
                **self.image_prompt_inputs(
                    ip_adapter_image, ip_adapter_image_embeds, rows, do_classifier_free_guidance
                ),
            },
            step_kwargs=self.scheduler_step_kwargs(generator, eta),
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
        )
        return self.finish(latents, output_type, return_dict)
