"""The runtime: :class:`IOBindingORTModel` and what it stands on (options resolved once, owned weights, the session
recipe, the graph pool, CUDA policy, input conversion, output-shape inference).

The public names load on first use, so that importing a light module of the runtime (``runtime.providers``: the
provider names, onnxruntime alone) does not import torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_names

_PUBLIC_NAMES = {
    "IOBindingORTModel": ".model",
    "ModelOptions": ".options",
    "PipelineOptions": ".options",
    "infer_output_shapes": ".shapes",
}

__all__ = ["IOBindingORTModel", "ModelOptions", "PipelineOptions", "infer_output_shapes"]

if TYPE_CHECKING:  # what type checkers and editors see; at run time each name comes from __getattr__
    from .model import IOBindingORTModel
    from .options import ModelOptions, PipelineOptions
    from .shapes import infer_output_shapes


__getattr__, __dir__ = lazy_names(__name__, _PUBLIC_NAMES, globals())
