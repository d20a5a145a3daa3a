"""What the Stable Diffusion 1.x/2.x families declare alike (text-to-image, img2img, inpainting, LCM, ControlNet,
the stream): diffusers' ONNX folder (one CLIP, a UNet, the VAE), the UNet denoiser, one CLIP prompt encoder,
runtime LoRA, and diffusers' ONNX model_index.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional, Tuple

import torch

from ..layout import write_model_index
from .arguments import Embeds, Prompt, StepEndCallback, TensorNames
from .components import VAE_COMPONENTS, module, onnx, tokenizer
from .core import OnnxDiffusionPipeline, Warmup
from .denoisers import UNetDenoiser
from .lora import LoraLoaderMixin
from .prompts import CLIPPrompt

# diffusers' ONNX Stable Diffusion folder (its safety checker and feature extractor are accepted and never run)
STABLE_DIFFUSION_COMPONENTS = (
    onnx("text_encoder"),
    tokenizer("tokenizer"),
    onnx("unet"),
    *VAE_COMPONENTS,
    module("safety_checker"),
    module("feature_extractor"),
)


class ClipUNetPipeline(LoraLoaderMixin, Warmup, OnnxDiffusionPipeline):
    """The declaration of a CLIP + UNet family; each family adds its ``__call__``."""

    declared_components = STABLE_DIFFUSION_COMPONENTS
    denoiser_part = UNetDenoiser
    prompt_part = CLIPPrompt
    settings = {"requires_safety_checker": False}
    model_cpu_offload_seq = "text_encoder->unet->vae_decoder"
    # the class a saved folder's model_index.json names: diffusers' ONNX pipeline, which loads it too
    index_class_name = "OnnxStableDiffusionPipeline"

    def checked_text_embeddings(
        self,
        prompt: Prompt,
        negative_prompt: Prompt,
        prompt_embeds: Embeds,
        negative_prompt_embeds: Embeds,
        height: int,
        width: int,
        num_inference_steps: Any,
        guidance_scale: Any,
        num_images_per_prompt: Any,
        output_type: Any,
        callback_steps: Optional[int] = None,
        strength: Optional[float] = None,
        callback_on_step_end: StepEndCallback = None,
        callback_on_step_end_tensor_inputs: TensorNames = ("latents",),
    ) -> Tuple[torch.Tensor, int]:
        """A call's first steps: every argument refused before any work (:meth:`check_inputs`), then the text
        embeddings on the device (``[negative; positive]`` when ``guidance_scale > 1``). Returns them and the
        number of prompts."""
        self.check_inputs(
            prompt,
            height,
            width,
            num_inference_steps,
            callback_steps,
            negative_prompt,
            prompt_embeds,
            negative_prompt_embeds,
            output_type,
            strength,
            guidance_scale=guidance_scale,
            num_images_per_prompt=num_images_per_prompt,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
        )
        embeddings = self.encode_prompt(
            prompt, num_images_per_prompt, guidance_scale > 1.0, negative_prompt, prompt_embeds, negative_prompt_embeds
        )
        return embeddings, self.batch_size_of(prompt, prompt_embeds)

    def write_model_index(self, target: Path, written: List[str]) -> None:
        write_model_index(
            target, type(self.scheduler).__name__, type(self.tokenizer).__name__, written, self.index_class_name
        )
