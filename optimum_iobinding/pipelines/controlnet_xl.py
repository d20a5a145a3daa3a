"""SDXL with ControlNets on ONNX Runtime, the loop on the device: diffusers' ``StableDiffusionXLControlNetPipeline``.

The folder (``optimum-iobinding export SDXL --controlnet ID``, or the export of a torch
``StableDiffusionXLControlNetPipeline``) is optimum's SDXL layout with ``controlnet`` (``controlnet_1`` … for
multi-ControlNet) beside a UNet exported to take their residuals. An SDXL ControlNet is conditioned as its UNet is
(``text_embeds`` and ``time_ids`` beside the text states); each takes its conditioning scale as one factor per residual
(:mod:`.controlnet`), so one captured graph of each serves every scale, guess mode and guidance window."""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional, Tuple, Union

from ..families import SDXL_TIME_IDS, family
from .arguments import Embeds, Generator, Latents, Prompt, StepEndCallback, TensorNames
from .components import onnx
from .controlnet import ControlNetUNet, UNetControlNets
from .core import on_device_stream
from .img2img import ImageInput
from .loop import Guidance, denoise
from .stable_diffusion_xl import XL_COMPONENTS, OnnxStableDiffusionXLPipelineBase

SDXL_CONTROLNET = family("sdxl-controlnet")


class OnnxStableDiffusionXLControlNetPipeline(UNetControlNets, OnnxStableDiffusionXLPipelineBase):
    """SDXL text-to-image guided by one or several ControlNets on ONNX Runtime, with the arguments of diffusers'
    ``StableDiffusionXLControlNetPipeline`` (``image``, ``controlnet_conditioning_scale``, ``guess_mode``,
    ``control_guidance_start``/``control_guidance_end``: lists for multi-ControlNet; SDXL's prompts and
    micro-conditioning) and its output, ``StableDiffusionXLPipelineOutput``."""

    family = SDXL_CONTROLNET
    base_components = XL_COMPONENTS
    declared_components = XL_COMPONENTS + (onnx("controlnet"),)
    denoiser_part = functools.partial(ControlNetUNet, default_sample_size=128)

    def warmup_images(self, height: int, width: int) -> Dict[str, Any]:
        return {"image": self.blank_control_images(height, width)}

    @property
    def unet_dtype(self) -> Any:
        """The dtype of the UNet's ``time_ids`` (the micro-conditioning is made in it, before the prompts)."""
        return self.unet.input_dtypes[SDXL_TIME_IDS]

    @on_device_stream
    def __call__(
        self,
        prompt: Prompt = None,
        prompt_2: Prompt = None,
        image: ImageInput = None,
        height: Optional[int] = None,
        width: Optional[int] = None,
        num_inference_steps: int = SDXL_CONTROLNET.defaults.steps,
        guidance_scale: float = SDXL_CONTROLNET.defaults.guidance_scale,
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
        controlnet_conditioning_scale: Union[float, List[float]] = 1.0,
        guess_mode: bool = False,
        control_guidance_start: Union[float, List[float]] = 0.0,
        control_guidance_end: Union[float, List[float]] = 1.0,
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
        """Generates images from text guided by control images, with the arguments of diffusers'
        ``StableDiffusionXLControlNetPipeline``.

        ``image``: the control image — PIL, numpy (H, W, 3) in [0, 1], a float tensor (B, 3, H, W) in [0, 1], or a
        list of them (one per prompt); for multi-ControlNet a list with one such entry per ControlNet. ``height``
        and ``width`` default to the control image's size, and so do ``original_size`` and ``target_size``.
        ``controlnet_conditioning_scale``, ``guess_mode`` and ``control_guidance_start``/``_end`` as the Stable
        Diffusion ControlNet pipeline's (per-ControlNet lists for multi-ControlNet); the negative micro-conditioning
        applies where both ``negative_original_size`` and ``negative_target_size`` are given, as diffusers has it.

        Returns:
            ``StableDiffusionXLPipelineOutput(images)``, or a tuple without return_dict.
        """
        # 1. check inputs (the size once the control images give it)
        self.check_image_prompt(ip_adapter_image, ip_adapter_image_embeds)
        scales, starts, ends = self.check_control_arguments(
            controlnet_conditioning_scale, control_guidance_start, control_guidance_end
        )
        guess_mode = self._controlnet_guess_mode(guess_mode)
        for value in (height, width):
            if value is not None:
                self.check_size(height or value, width or value)
        self.check_inputs(
            prompt=prompt,
            negative_prompt=negative_prompt,
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            height=self.size_multiple,
            width=self.size_multiple,
            num_inference_steps=num_inference_steps,
            output_type=output_type,
            guidance_scale=guidance_scale,
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
        images = self.prepare_control_images(
            image, "image", height, width, batch_size, num_images_per_prompt, do_classifier_free_guidance, guess_mode
        )
        height, width = images[0].shape[-2:]
        if self.device.type == "cpu":  # the size the control images gave, before any component runs
            self.check_fits(height, width, batch_size * num_images_per_prompt, guidance_scale)
        original_size = original_size or (height, width)
        target_size = target_size or (height, width)
        add_time_ids = self.time_ids(original_size, crops_coords_top_left, target_size, 0.0, self.unet_dtype)
        negative_time_ids = add_time_ids
        if negative_original_size is not None and negative_target_size is not None:
            negative_time_ids = self.time_ids(
                negative_original_size, negative_crops_coords_top_left, negative_target_size, 0.0, self.unet_dtype
            )

        # 2. text: both encoders' penultimate states, the second's pooled projection
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

        # 3. timesteps and initial noise
        timesteps = self.set_timesteps(num_inference_steps)
        rows = batch_size * num_images_per_prompt
        latents = self.initial_noise(rows, height, width, prompt_embeds.dtype, generator, latents)

        # 4. size conditioning, made once: the UNet's and the ControlNets' (guess mode: their text half)
        conditioning = self.unet_conditioning(
            pooled,
            add_time_ids.to(prompt_embeds.dtype),
            negative_time_ids.to(prompt_embeds.dtype),
            rows,
            do_classifier_free_guidance,
        )

        # 5. denoising loop, the ControlNets' residuals made each step: every tensor stays on self.device
        residuals = self.controlnet_step_inputs(
            images, timesteps, scales, starts, ends, guess_mode, do_classifier_free_guidance, conditioning
        )
        latents = denoise(
            self.denoiser,
            latents,
            timesteps,
            tensors={"prompt_embeds": prompt_embeds},
            guidance=Guidance.classifier_free(guidance_scale),
            inputs={
                **conditioning,
                **self.image_prompt_inputs(
                    ip_adapter_image, ip_adapter_image_embeds, rows, do_classifier_free_guidance
                ),
            },
            step_kwargs=self.scheduler_step_kwargs(generator, eta),
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
            step_inputs=residuals,
        )

        # 6. decode: only now does anything leave the device
        return self.finish(latents, output_type, return_dict)
