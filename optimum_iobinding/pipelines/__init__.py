"""Stable Diffusion pipelines whose denoising loop runs on the device."""

from .base import OnnxStableDiffusionPipelineBase
from .stable_diffusion import OnnxStableDiffusionPipeline

__all__ = ["OnnxStableDiffusionPipelineBase", "OnnxStableDiffusionPipeline"]
