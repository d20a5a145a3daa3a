"""torch → ONNX: exporting a diffusers pipeline to the ONNX folder layout, ORT's fusions and float16, where each LoRA
layer's weight went, and tiny random models built offline."""

from .export import export_pipeline
from .tiny import TINY_RANDOM_KINDS

__all__ = ["export_pipeline", "TINY_RANDOM_KINDS"]
