"""The runtime: :class:`IOBindingORTModel` and what it stands on (options resolved once, owned weights, the session
recipe, the graph pool, CUDA policy, input conversion, output-shape inference)."""

from .model import IOBindingORTModel
from .options import ModelOptions, PipelineOptions
from .shapes import infer_output_shapes

__all__ = ["IOBindingORTModel", "ModelOptions", "PipelineOptions", "infer_output_shapes"]
