"""Stable Diffusion pipelines whose denoising loop runs on the device."""

from .base import OnnxStableDiffusionPipelineBase
from .img2img import OnnxStableDiffusionImg2ImgPipeline
from .inpaint import OnnxStableDiffusionInpaintPipeline
from .latent_consistency import OnnxLatentConsistencyModelPipeline
from .stable_diffusion import OnnxStableDiffusionPipeline
from .stable_diffusion_xl import OnnxStableDiffusionXLImg2ImgPipeline, OnnxStableDiffusionXLPipeline

__all__ = [
    "OnnxStableDiffusionPipelineBase",
    "OnnxStableDiffusionPipeline",
    "OnnxStableDiffusionImg2ImgPipeline",
    "OnnxStableDiffusionInpaintPipeline",
    "OnnxStableDiffusionXLPipeline",
    "OnnxStableDiffusionXLImg2ImgPipeline",
    "OnnxLatentConsistencyModelPipeline",
]
