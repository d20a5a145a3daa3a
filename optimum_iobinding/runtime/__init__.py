"""The runtime: :class:`IOBindingORTModel` and what it stands on (options resolved once, owned weights, the session
recipe, the graph pool, CUDA policy, input conversion, output-shape inference).

The public names load on first use, so that importing a light module of the runtime (``runtime.providers``: the
provider names, onnxruntime alone) does not import torch."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any, List

_PUBLIC_NAMES = {"IOBindingORTModel": ".model", "ModelOptions": ".options", "PipelineOptions": ".options",
                 "infer_output_shapes": ".shapes"}

__all__ = ["IOBindingORTModel", "ModelOptions", "PipelineOptions", "infer_output_shapes"]

if TYPE_CHECKING:  # what type checkers and editors see; at run time each name comes from __getattr__
    from .model import IOBindingORTModel
    from .options import ModelOptions, PipelineOptions
    from .shapes import infer_output_shapes


def __getattr__(name: str) -> Any:
    module = _PUBLIC_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'optimum_iobinding.runtime' has no attribute {name!r}")
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value  # found here from now on, without this function
    return value


def __dir__() -> List[str]:
    return sorted({*globals(), *_PUBLIC_NAMES})
