"""Element types: ORT type strings ↔ torch dtypes ↔ ONNX element types, the conversions done silently, and the
zero-copy exchange of tensors between ORT and torch (DLPack)."""

from __future__ import annotations

from typing import Dict

import onnxruntime as ort
import torch
from onnx import TensorProto

# ORT type string → torch dtype, for every tensor type this package binds.
ORT_TO_TORCH: Dict[str, torch.dtype] = {
    "tensor(float)": torch.float32,
    "tensor(float16)": torch.float16,
    "tensor(bfloat16)": torch.bfloat16,
    "tensor(double)": torch.float64,
    "tensor(int64)": torch.int64,
    "tensor(int32)": torch.int32,
    "tensor(int16)": torch.int16,
    "tensor(int8)": torch.int8,
    "tensor(uint8)": torch.uint8,
    "tensor(bool)": torch.bool,
}

# torch dtype → ONNX element type, as IOBinding.bind_input/bind_output take it.
TORCH_TO_ONNX: Dict[torch.dtype, int] = {
    torch.float32: TensorProto.FLOAT,
    torch.float16: TensorProto.FLOAT16,
    torch.bfloat16: TensorProto.BFLOAT16,
    torch.float64: TensorProto.DOUBLE,
    torch.int64: TensorProto.INT64,
    torch.int32: TensorProto.INT32,
    torch.int16: TensorProto.INT16,
    torch.int8: TensorProto.INT8,
    torch.uint8: TensorProto.UINT8,
    torch.bool: TensorProto.BOOL,
}


def conversion_allowed(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether a value of ``source`` dtype is cast to ``target`` silently.

    Silent: any float to any float (a float32 latent for a float16 model), any integer to any integer
    (int64 token ids for an int32 ``input_ids``), and integer or bool to float (an integer timestep for a float
    ``timestep`` input). An error: float to integer (would truncate), anything but bool to bool, bool to integer,
    and complex to anything.
    """
    if source == target:
        return True
    if source.is_complex or target == torch.bool or source == torch.bool and not target.is_floating_point:
        return False
    if target.is_floating_point:
        return True
    return not source.is_floating_point


# recent onnxruntime releases give OrtValue the DLPack protocol; older ones only through its C binding
_ORT_VALUE_HAS_DLPACK = hasattr(ort.OrtValue, "__dlpack__") and hasattr(ort.OrtValue, "from_dlpack")


def tensor_of_ort_value(value: ort.OrtValue) -> torch.Tensor:
    """A torch tensor over ``value``'s memory (zero copy; the DLPack capsule keeps ORT's buffer alive). Bool
    tensors come as uint8, as DLPack carries them."""
    if _ORT_VALUE_HAS_DLPACK:
        return torch.from_dlpack(value)
    return torch.from_dlpack(value._ortvalue)  # older onnxruntime: the C binding's DLPack, the only one it has


def ort_value_of_tensor(tensor: torch.Tensor) -> ort.OrtValue:
    """An OrtValue over ``tensor``'s memory (zero copy): ORT reads and the caller owns."""
    if _ORT_VALUE_HAS_DLPACK:
        return ort.OrtValue.from_dlpack(tensor)
    # older onnxruntime: the C binding's DLPack, the only one it has
    return ort.OrtValue(ort.capi._pybind_state.OrtValue.from_dlpack(tensor.__dlpack__(), tensor.dtype == torch.bool))
