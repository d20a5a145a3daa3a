"""What the Stable Diffusion 1.x/2.x families declare alike (text-to-image, img2img, inpainting, LCM, ControlNet,
the stream): diffusers' ONNX folder (one CLIP, a UNet, the VAE), the UNet denoiser, one CLIP prompt encoder,
runtime LoRA, and diffusers' ONNX model_index.json."""

from __future__ import annotations

from pathlib import Path
from typing import List

from ..layout import write_model_index
from .components import module, onnx, tokenizer
from .core import OnnxDiffusionPipeline, Warmup
from .denoisers import UNetDenoiser
from .lora import LoraLoaderMixin
from .prompts import CLIPPrompt

# diffusers' ONNX Stable Diffusion folder (its safety checker and feature extractor are accepted and never run)
STABLE_DIFFUSION_COMPONENTS = (onnx("vae_encoder", optional=True), onnx("vae_decoder"), onnx("text_encoder"),
                               tokenizer("tokenizer"), onnx("unet"), module("safety_checker"),
                               module("feature_extractor"))


class ClipUNetPipeline(LoraLoaderMixin, Warmup, OnnxDiffusionPipeline):
    """The declaration of a CLIP + UNet family; each family adds its ``__call__``."""

    declared_components = STABLE_DIFFUSION_COMPONENTS
    denoiser_part = UNetDenoiser
    prompt_part = CLIPPrompt
    settings = {"requires_safety_checker": False}
    model_cpu_offload_seq = "text_encoder->unet->vae_decoder"
    # the class a saved folder's model_index.json names: diffusers' ONNX pipeline, which loads it too
    index_class_name = "OnnxStableDiffusionPipeline"

    def write_model_index(self, target: Path, written: List[str]) -> None:
        write_model_index(target, type(self.scheduler).__name__, type(self.tokenizer).__name__, written,
                          self.index_class_name)
