"""Stable Diffusion pipelines whose denoising loop runs on the device."""

from .base import OnnxStableDiffusionPipelineBase
from .img2img import OnnxStableDiffusionImg2ImgPipeline
from .inpaint import OnnxStableDiffusionInpaintPipeline
from .stable_diffusion import OnnxStableDiffusionPipeline

__all__ = [
    "OnnxStableDiffusionPipelineBase",
    "OnnxStableDiffusionPipeline",
    "OnnxStableDiffusionImg2ImgPipeline",
    "OnnxStableDiffusionInpaintPipeline",
]
