"""optimum-iobinding: Stable Diffusion on ONNX Runtime with every tensor of the denoising loop on the device."""

from typing import Any

from .integrations.optimum import accelerate
from .pipelines.tiling import TiledVAE
from .runtime.model import IOBindingORTModel
from .runtime.options import ModelOptions, PipelineOptions
from .runtime.shapes import infer_output_shapes

__version__ = "0.1.0"

_PIPELINES = (
    "OnnxStableDiffusionPipeline",
    "OnnxStableDiffusionImg2ImgPipeline",
    "OnnxStableDiffusionInpaintPipeline",
    "OnnxStableDiffusionXLPipeline",
    "OnnxStableDiffusionXLImg2ImgPipeline",
    "OnnxLatentConsistencyModelPipeline",
    "OnnxStableDiffusionControlNetPipeline",
    "OnnxStableDiffusionControlNetImg2ImgPipeline",
    "OnnxStreamDiffusionPipeline",
    "OnnxStableDiffusion3Pipeline",
    "OnnxFluxPipeline",
)

__all__ = ["IOBindingORTModel", "ModelOptions", "PipelineOptions", "infer_output_shapes", "TiledVAE", "accelerate", "__version__", *_PIPELINES]


def __getattr__(name: str) -> Any:
    # the pipelines import diffusers and transformers: only pay for that when they are used
    if name in _PIPELINES:
        from . import pipelines

        return getattr(pipelines, name)
    raise AttributeError(f"module 'optimum_iobinding' has no attribute {name!r}")
