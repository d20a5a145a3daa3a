"""What the Stable Diffusion 1.x/2.x families declare alike (text-to-image, img2img, inpainting, LCM, ControlNet,
the stream): diffusers' ONNX folder (one CLIP, a UNet, the VAE), the UNet denoiser, one CLIP prompt encoder,
runtime LoRA, and the checks and prompt encoding their calls start with."""

from __future__ import annotations

from typing import Any, Tuple

import torch

from .arguments import Embeds, Prompt
from .components import VAE_COMPONENTS, module, onnx, tokenizer
from .core import OnnxDiffusionPipeline, Warmup
from .denoisers import UNetDenoiser
from .loop import Guidance
from .ip_adapter import IPAdapterMixin
from .lora import LoraLoaderMixin
from .prompts import CLIPPrompt

# diffusers' ONNX Stable Diffusion folder (its safety checker and feature extractor are accepted and never run), and
# the image encoder of an export for IP-Adapter
STABLE_DIFFUSION_COMPONENTS = (
    onnx("text_encoder"),
    tokenizer("tokenizer"),
    onnx("unet"),
    *VAE_COMPONENTS,
    module("safety_checker"),
    module("feature_extractor"),
    onnx("image_encoder", optional=True),
)


class ClipUNetPipeline(IPAdapterMixin, LoraLoaderMixin, Warmup, OnnxDiffusionPipeline):
    """The declaration of a CLIP + UNet family; each family adds its ``__call__`` (IP-Adapter: where the UNet was
    exported for it, :class:`~.ip_adapter.IPAdapterMixin`)."""

    declared_components = STABLE_DIFFUSION_COMPONENTS
    denoiser_part = UNetDenoiser
    prompt_part = CLIPPrompt
    settings = {"requires_safety_checker": False}
    model_cpu_offload_seq = "text_encoder->unet->vae_decoder"

    def checked_text_embeddings(
        self,
        *,
        prompt: Prompt,
        negative_prompt: Prompt,
        prompt_embeds: Embeds,
        negative_prompt_embeds: Embeds,
        num_images_per_prompt: Any,
        guidance_scale: Any,
        text_to_image: bool = False,
        **call: Any,
    ) -> Tuple[torch.Tensor, int]:
        """A call's first steps: every argument refused before any work (:meth:`check_inputs`; ``call``: the shared
        arguments of :meth:`check_call`), then the text embeddings on the device (``[negative; positive]`` when
        ``guidance_scale > 1``). Returns them and the number of prompts. ``text_to_image``: the call denoises noise of
        its ``height`` × ``width``, so the UNet's first run can start before the prompt is encoded
        (:meth:`~.denoisers.UNetDenoiser.prepare_first_step`)."""
        self.check_inputs(
            prompt=prompt,
            negative_prompt=negative_prompt,
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            num_images_per_prompt=num_images_per_prompt,
            guidance_scale=guidance_scale,
            **call,
        )
        if text_to_image and self.prepare_in_background:
            self.denoiser.prepare_first_step(
                self.batch_size_of(prompt, prompt_embeds) * num_images_per_prompt,
                call["height"],
                call["width"],
                Guidance.classifier_free(guidance_scale),
                (self.tokenizer.model_max_length, None) if prompt_embeds is None else tuple(prompt_embeds.shape[1:]),
            )
        embeddings = self.encode_prompt(
            prompt, num_images_per_prompt, guidance_scale > 1.0, negative_prompt, prompt_embeds, negative_prompt_embeds
        )
        return embeddings, self.batch_size_of(prompt, prompt_embeds)
