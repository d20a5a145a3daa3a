"""optimum-iobinding: Stable Diffusion on ONNX Runtime with every tensor of the denoising loop on the device."""

from typing import TYPE_CHECKING

from .families import public_pipeline_names
from .lazy import lazy_names

__version__ = "0.1.0"

# every pipeline class, as the family descriptions name them (optimum_iobinding.families: the standard library only)
_PIPELINE_MODULES = public_pipeline_names()
_PIPELINES = tuple(_PIPELINE_MODULES)

# Each public name and the module that defines it, imported on its first use: the pipelines bring diffusers,
# transformers and torch, the runtime onnxruntime, and `import optimum_iobinding` (the command line's --help, a
# module that needs only the version) should pay for none of them.
_PUBLIC_NAMES = {
    "IOBindingORTModel": ".runtime.model",
    "ModelOptions": ".runtime.options",
    "PipelineOptions": ".runtime.options",
    "infer_output_shapes": ".runtime.shapes",
    "TiledVAE": ".pipelines.tiling",
    "DeepCacheConfig": ".pipelines.deep_cache",
    "accelerate": ".integrations.optimum",
    **_PIPELINE_MODULES,
}

__all__ = [
    "IOBindingORTModel",
    "ModelOptions",
    "PipelineOptions",
    "infer_output_shapes",
    "TiledVAE",
    "DeepCacheConfig",
    "accelerate",
    "__version__",
    *_PIPELINES,
]

if TYPE_CHECKING:  # what type checkers and editors see; at run time each name comes from __getattr__
    from .pipelines import *  # noqa: F403 (every pipeline class: pipelines.__all__)
    from .integrations.optimum import accelerate
    from .pipelines.deep_cache import DeepCacheConfig
    from .pipelines.tiling import TiledVAE
    from .runtime.model import IOBindingORTModel
    from .runtime.options import ModelOptions, PipelineOptions
    from .runtime.shapes import infer_output_shapes


__getattr__, __dir__ = lazy_names(__name__, _PUBLIC_NAMES, globals())
