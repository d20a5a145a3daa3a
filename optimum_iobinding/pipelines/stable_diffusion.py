"""Text to image: diffusers' ``OnnxStableDiffusionPipeline`` with its denoising loop on the device."""

from __future__ import annotations

from typing import Any, Optional


from ..families import family
from .arguments import Embeds, Generator, Latents, Prompt, StepCallback, StepEndCallback, TensorNames
from .clip_unet import ClipUNetPipeline
from .core import on_device_stream
from .loop import Guidance, denoise

SD = family("sd")


class OnnxStableDiffusionPipeline(ClipUNetPipeline):
    """Text-to-image Stable Diffusion on ONNX Runtime.

    ``OnnxStableDiffusionPipeline.from_pretrained(folder, provider="CUDAExecutionProvider", io_binding=True)`` keeps
    text embeddings, latents, noise predictions, guidance and the scheduler step on the GPU as torch tensors; only
    the final image is downloaded. ``io_binding=False`` is diffusers' numpy pipeline.
    """

    family = SD

    @on_device_stream
    def __call__(
        self,
        prompt: Prompt = None,
        height: Optional[int] = SD.defaults.size,
        width: Optional[int] = SD.defaults.size,
        num_inference_steps: int = SD.defaults.steps,
        guidance_scale: float = SD.defaults.guidance_scale,
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
        ip_adapter_image: Any = None,
        ip_adapter_image_embeds: Any = None,
    ):
        """Generates images from text, with the arguments of diffusers' ``OnnxStableDiffusionPipeline``.

        ``generator`` is a numpy ``RandomState`` (the same initial noise as diffusers' ONNX pipeline for the same
        seed) or a ``torch.Generator``. ``callback(step, t, latents)`` gets torch latents on the device;
        ``callback_on_step_end(pipe, step, t, tensors)`` works as in diffusers' torch pipelines and may return
        replacements for ``latents`` or ``prompt_embeds``. ``output_type`` is "pil", "np", "pt" or "latent".
        ``ip_adapter_image`` / ``ip_adapter_image_embeds``: the image prompt of a loaded IP-Adapter
        (:meth:`load_ip_adapter`), as in diffusers.

        Returns:
            ``StableDiffusionPipelineOutput(images, nsfw_content_detected=None)``, or a tuple without return_dict.
        """
        # 1. check inputs; 2. text embeddings and the image prompt, on the device
        self.check_image_prompt(ip_adapter_image, ip_adapter_image_embeds)
        height = self.default_image_size if height is None else height
        width = self.default_image_size if width is None else width
        prompt_embeds, batch_size = self.checked_text_embeddings(
            prompt=prompt,
            negative_prompt=negative_prompt,
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            num_images_per_prompt=num_images_per_prompt,
            guidance_scale=guidance_scale,
            text_to_image=True,
            height=height,
            width=width,
            num_inference_steps=num_inference_steps,
            output_type=output_type,
            callback_steps=callback_steps,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
            generator=generator,
            callback=callback,
        )

        image_prompt = self.image_prompt_inputs(
            ip_adapter_image, ip_adapter_image_embeds, batch_size * num_images_per_prompt, guidance_scale > 1.0
        )

        # 3. timesteps and initial noise
        timesteps = self.set_timesteps(num_inference_steps)
        latents = self.initial_noise(
            batch_size * num_images_per_prompt, height, width, prompt_embeds.dtype, generator, latents
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
