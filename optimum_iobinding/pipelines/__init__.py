"""The pipelines: diffusers' ``__call__`` surface over ONNX components, the denoising loop on the device."""

from .auto import pipeline_class_for, resolve_model_folder
from .controlnet import OnnxStableDiffusionControlNetImg2ImgPipeline, OnnxStableDiffusionControlNetPipeline
from .controlnet_xl import OnnxStableDiffusionXLControlNetPipeline
from .flux import OnnxFluxPipeline
from .flux_control import OnnxFluxControlPipeline
from .flux_controlnet import OnnxFluxControlNetPipeline
from .flux_fill import OnnxFluxFillPipeline
from .flux_kontext import OnnxFluxKontextPipeline
from .img2img import OnnxStableDiffusionImg2ImgPipeline
from .inpaint import OnnxStableDiffusionInpaintPipeline
from .latent_consistency import OnnxLatentConsistencyModelPipeline
from .components import load_numpy_pipeline
from .core import OnnxDiffusionPipeline
from .stable_diffusion import OnnxStableDiffusionPipeline
from .stable_diffusion_3 import OnnxStableDiffusion3Pipeline
from .stable_diffusion_xl import OnnxStableDiffusionXLImg2ImgPipeline, OnnxStableDiffusionXLPipeline
from .stream import OnnxStreamDiffusionPipeline
from .wan import OnnxWanPipeline
from .wan_i2v import OnnxWanImageToVideoPipeline


__all__ = [
    "pipeline_class_for",
    "resolve_model_folder",
    "load_numpy_pipeline",
    "OnnxDiffusionPipeline",
    "OnnxStableDiffusionPipeline",
    "OnnxStableDiffusionImg2ImgPipeline",
    "OnnxStableDiffusionInpaintPipeline",
    "OnnxStableDiffusionXLPipeline",
    "OnnxStableDiffusionXLImg2ImgPipeline",
    "OnnxLatentConsistencyModelPipeline",
    "OnnxStableDiffusionControlNetPipeline",
    "OnnxStableDiffusionControlNetImg2ImgPipeline",
    "OnnxStableDiffusionXLControlNetPipeline",
    "OnnxStreamDiffusionPipeline",
    "OnnxStableDiffusion3Pipeline",
    "OnnxFluxPipeline",
    "OnnxFluxKontextPipeline",
    "OnnxFluxFillPipeline",
    "OnnxFluxControlPipeline",
    "OnnxFluxControlNetPipeline",
    "OnnxWanPipeline",
    "OnnxWanImageToVideoPipeline",
]
