"""Where a torch model's weights went in its ONNX export, found by value, for LoRA at run time.

A LoRA changes a layer's weight ``W`` (torch layout: ``(out, in)`` for a Linear, ``(out, in, kh, kw)`` for a Conv2d)
by ``scale · B @ A``. In the ONNX file that weight is an initializer in one of several forms: as it was (Conv, Gemm
with ``transB``), transposed (the exporter's MatMul takes ``(in, out)``), packed with its neighbours by ONNX Runtime's
attention fusion (Q, K and V side by side in one ``(in, k·out)`` MatMul weight, contiguous or interleaved per head),
in NHWC order (the CUDA fusion's NhwcConv), and in float16 or bfloat16 after the precision conversion.
:func:`weight_map` finds each Linear and Conv2d weight of the torch module among the final initializers by value, and
records the form as a :class:`~optimum_iobinding.layout.WeightPlace`; the export writes the map beside the model as
``lora_map.json`` (:func:`~optimum_iobinding.layout.write_weight_map`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple, Union

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from ..layout import WeightPlace

# how closely an initializer must hold a torch weight to be taken for it: float16 rounding (2^-11 relative) with
# room, and the float16 converter's clamping of tiny magnitudes; weights of different layers differ far more
_RTOL, _ATOL = 2e-3, 1e-6


def _float_initializers(model: onnx.ModelProto, base_dir: Optional[Union[str, Path]]) -> Dict[str, np.ndarray]:
    arrays = {}
    for initializer in model.graph.initializer:
        if initializer.data_type in (
            onnx.TensorProto.FLOAT,
            onnx.TensorProto.FLOAT16,
            onnx.TensorProto.BFLOAT16,
            onnx.TensorProto.DOUBLE,
        ):
            arrays[initializer.name] = numpy_helper.to_array(initializer, base_dir=str(base_dir or ""))
    return arrays


def _close(candidate: np.ndarray, weight: np.ndarray) -> bool:
    """Whether ``candidate`` holds ``weight`` (its first row decides for almost every other candidate)."""
    if candidate.shape != weight.shape:
        return False
    for rows in (slice(0, 1), slice(None)):
        expected = weight[rows].astype(candidate.dtype).astype(np.float32)
        if not np.allclose(candidate[rows].astype(np.float32), expected, rtol=_RTOL, atol=_ATOL):
            return False
    return True


def places_of(weight: np.ndarray, by_shape: Dict[Tuple[int, ...], List[Tuple[str, np.ndarray]]]) -> List[WeightPlace]:
    """Every place of one torch weight among the candidate arrays, in each form the export can give it.

    Args:
        weight: the layer's weight in torch layout, ``(out, in)`` or ``(out, in, kh, kw)``.
        by_shape: candidate arrays (initializer name, values) grouped by their shape.

    Returns:
        One :class:`~optimum_iobinding.layout.WeightPlace` per array that holds the weight (same, transposed,
        packed with its Q/K/V neighbours, or NHWC); empty if none does.
    """
    places = []
    if weight.ndim == 2:
        out_features, in_features = weight.shape
        for name, array in by_shape.get((out_features, in_features), []):
            if _close(array, weight):
                places.append(WeightPlace(name, "same"))
        for name, array in by_shape.get((in_features, out_features), []):
            if _close(array, weight.T):
                places.append(WeightPlace(name, "transposed"))
        first_column = weight[:, 0]
        for parts in (2, 3):
            for name, array in by_shape.get((in_features, parts * out_features), []):
                place = None
                for heads in [h for h in range(1, out_features + 1) if out_features % h == 0]:
                    first_row = array[0].reshape(heads, parts, out_features // heads)
                    for index in range(parts):
                        if not _close(first_row[:, index, :].reshape(out_features), first_column):
                            continue
                        blocks = array.reshape(in_features, heads, parts, out_features // heads)
                        if _close(blocks[:, :, index, :].reshape(in_features, out_features), weight.T):
                            place = WeightPlace(name, "packed", parts, index, heads)
                            break
                    if place is not None:
                        places.append(place)
                        break
    elif weight.ndim == 4:
        for name, array in by_shape.get(weight.shape, []):
            if _close(array, weight):
                places.append(WeightPlace(name, "same"))
        nhwc = np.ascontiguousarray(weight.transpose(0, 2, 3, 1))
        if nhwc.shape != weight.shape or not np.array_equal(nhwc, weight):  # else found as "same" already
            for name, array in by_shape.get(nhwc.shape, []):
                if _close(array, nhwc):
                    places.append(WeightPlace(name, "nhwc"))
    return places


def lora_layers(module: torch.nn.Module) -> Iterator[Tuple[str, torch.nn.Module]]:
    """The layers a LoRA can change (Linear and Conv2d), by module name."""
    for name, layer in module.named_modules():
        if isinstance(layer, (torch.nn.Linear, torch.nn.Conv2d)) and name:
            yield name, layer


def weight_map(
    module: torch.nn.Module, model: onnx.ModelProto, base_dir: Optional[Union[str, Path]] = None
) -> Dict[str, List[WeightPlace]]:
    """Each Linear and Conv2d layer of ``module`` (by its module name, as LoRA files name layers) → the places of its
    weight among ``model``'s initializers (usually one; several where ONNX Runtime copied it). Layers whose weight
    was not found (folded into another computation) are left out."""
    arrays = _float_initializers(model, base_dir)
    by_shape: Dict[Tuple[int, ...], List[Tuple[str, np.ndarray]]] = {}
    for name, array in arrays.items():
        by_shape.setdefault(tuple(array.shape), []).append((name, array))
    found: Dict[str, List[WeightPlace]] = {}
    with torch.no_grad():
        for name, layer in lora_layers(module):
            places = places_of(layer.weight.detach().float().cpu().numpy(), by_shape)
            if places:
                found[name] = places
    return found
