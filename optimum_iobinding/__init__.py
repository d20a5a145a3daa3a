"""optimum-iobinding: Stable Diffusion on ONNX Runtime with every tensor of the denoising loop on the device."""

from .model import IOBindingORTModel
from .shapes import infer_output_shapes

__version__ = "0.1.0"

__all__ = ["IOBindingORTModel", "infer_output_shapes", "__version__"]
