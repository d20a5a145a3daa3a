"""Where a torch model's weights went in its ONNX export, for LoRA at run time.

A LoRA changes a layer's weight ``W`` (torch layout: ``(out, in)`` for a Linear, ``(out, in, kh, kw)`` for a Conv2d)
by ``scale · B @ A``. In the ONNX file that weight is an initializer in one of several forms: as it was (Conv, Gemm
with ``transB``), transposed (the exporter's MatMul takes ``(in, out)``), packed with its neighbours by ONNX Runtime's
attention fusion (Q, K and V side by side in one ``(in, k·out)`` MatMul weight, contiguous or interleaved per head),
in NHWC order (the CUDA fusion's NhwcConv), and in float16 after the float16 conversion. :func:`weight_map` finds
each Linear and Conv2d weight of the torch module among the final initializers by value, and records the form as a
:class:`WeightPlace`; the export writes the map beside the model as ``lora_map.json``. At run time a view of the
owned initializer in torch layout (:func:`torch_layout_view`) takes the updated weight in place.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import onnx
import torch
from onnx import numpy_helper

LORA_MAP_NAME = "lora_map.json"
LORA_MAP_VERSION = 1
# how closely an initializer must hold a torch weight to be taken for it: float16 rounding (2^-11 relative) with
# room, and the float16 converter's clamping of tiny magnitudes; weights of different layers differ far more
_RTOL, _ATOL = 2e-3, 1e-6


@dataclass(frozen=True)
class WeightPlace:
    """Where (part of) an initializer holds one torch weight.

    Attributes:
        initializer: the initializer's name.
        layout: ``"same"`` (the torch layout), ``"transposed"`` (a Linear weight as ``(in, out)``), ``"nhwc"`` (a
            Conv2d weight as ``(out, kh, kw, in)``) or ``"packed"`` (a Linear weight, transposed, as part ``index``
            of ``parts`` packed side by side in an ``(in, parts·out)`` weight: per head, ``heads`` blocks of
            ``parts`` × ``out / heads`` columns; ``heads`` 1 is plain concatenation).
    """

    initializer: str
    layout: str
    parts: int = 1
    index: int = 0
    heads: int = 1


def _float_initializers(model: onnx.ModelProto, base_dir: Optional[Union[str, Path]]) -> Dict[str, np.ndarray]:
    arrays = {}
    for initializer in model.graph.initializer:
        if initializer.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE):
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


def _places_of(weight: np.ndarray, by_shape: Dict[Tuple[int, ...], List[Tuple[str, np.ndarray]]]) -> List[WeightPlace]:
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


def _lora_layers(module: torch.nn.Module) -> Iterator[Tuple[str, torch.nn.Module]]:
    for name, layer in module.named_modules():
        if isinstance(layer, (torch.nn.Linear, torch.nn.Conv2d)) and name:
            yield name, layer


def weight_map(module: torch.nn.Module, model: onnx.ModelProto,
               base_dir: Optional[Union[str, Path]] = None) -> Dict[str, List[WeightPlace]]:
    """Each Linear and Conv2d layer of ``module`` (by its module name, as LoRA files name layers) → the places of its
    weight among ``model``'s initializers (usually one; several where ONNX Runtime copied it). Layers whose weight
    was not found (folded into another computation) are left out."""
    arrays = _float_initializers(model, base_dir)
    by_shape: Dict[Tuple[int, ...], List[Tuple[str, np.ndarray]]] = {}
    for name, array in arrays.items():
        by_shape.setdefault(tuple(array.shape), []).append((name, array))
    found: Dict[str, List[WeightPlace]] = {}
    with torch.no_grad():
        for name, layer in _lora_layers(module):
            places = _places_of(layer.weight.detach().float().cpu().numpy(), by_shape)
            if places:
                found[name] = places
    return found


def write_weight_map(places: Dict[str, List[WeightPlace]], folder: Union[str, Path], layers: Sequence[str]) -> Path:
    """Writes ``lora_map.json`` into ``folder``: the places, and the layers the torch module had without a place."""
    missing = sorted(set(layers) - set(places))
    path = Path(folder) / LORA_MAP_NAME
    path.write_text(json.dumps({"version": LORA_MAP_VERSION,
                                "layers": {name: [asdict(place) for place in found]
                                           for name, found in sorted(places.items())},
                                "not_found": missing}, indent=1))
    return path


def read_weight_map(folder: Union[str, Path]) -> Tuple[Dict[str, List[WeightPlace]], List[str]]:
    """The places and the layers without one, from the ``lora_map.json`` in ``folder``.

    Raises:
        FileNotFoundError: the folder has no map (an export made before LoRA support: export again).
        ValueError: the map is of another version or malformed.
    """
    path = Path(folder) / LORA_MAP_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no {LORA_MAP_NAME}; it is written by optimum-iobinding's export, which "
                                "records where each layer's weight went. Export the model again to use LoRA with it")
    try:
        data = json.loads(path.read_text())
        if data.get("version") != LORA_MAP_VERSION:
            raise ValueError(f"version {data.get('version')!r}, expected {LORA_MAP_VERSION}")
        places = {name: [WeightPlace(**place) for place in found] for name, found in data["layers"].items()}
        return places, list(data.get("not_found", []))
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: not a LoRA map this version reads: {error}") from None


def torch_layout_view(tensor: torch.Tensor, place: WeightPlace, shape: Sequence[int]) -> torch.Tensor:
    """A view of ``tensor`` (the initializer) in the torch layout ``shape`` of the weight at ``place``: writing into
    it (``copy_``) writes the initializer in place. A packed weight interleaved per head is not one strided view in
    torch layout; for it the view has the layout ``(in, heads, out / heads)`` and :func:`to_view_layout` says how
    to write into it."""
    if place.layout == "same":
        return tensor
    if place.layout == "transposed":
        return tensor.t()
    if place.layout == "nhwc":
        return tensor.permute(0, 3, 1, 2)
    if place.layout == "packed":
        out_features, in_features = shape
        blocks = tensor.view(in_features, place.heads, place.parts, out_features // place.heads)
        if place.heads == 1:
            return blocks[:, 0, place.index, :].t()
        return blocks[:, :, place.index, :]
    raise ValueError(f"place: unknown layout {place.layout!r}")


def to_view_layout(weight: torch.Tensor, place: WeightPlace) -> torch.Tensor:
    """``weight`` (torch layout) in the layout of :func:`torch_layout_view`'s view of ``place``."""
    if place.layout == "packed" and place.heads > 1:
        out_features, in_features = weight.shape
        return weight.t().reshape(in_features, place.heads, out_features // place.heads)
    return weight
