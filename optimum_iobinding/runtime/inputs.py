"""Input conversion and checks: what a caller passes to an ONNX model, as the tensor ORT will read.

Silent conversions: a move between the CPU and the session's device; ``.contiguous()``; a numpy array or Python /
numpy scalar (a scalar becomes a 0-d tensor); a numpy array of the other byte order (``>f4`` on a little-endian
machine) to the native one (the same values: what a caller reading such data from a file means); a dtype cast
float→float, int→int (values checked to fit) and int/bool→float. Errors: float→int, anything→bool, bool→int,
complex, numpy's ``longdouble`` (float96/float128: torch has no such dtype, and its range exceeds float64's), a
sparse, nested or quantized tensor (``.to_dense()`` / ``.dequantize()`` say whether that copy is meant), integers out
of the input dtype's range, a CUDA tensor on another GPU than the session's, any other Python type, unknown or
missing inputs.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence, Union

import numpy as np
import torch

from .dtypes import conversion_allowed

InputValue = Union[torch.Tensor, np.ndarray, np.generic, int, float, bool]


def check_input_names(inputs: Mapping[str, Any], declared: Sequence[str]) -> None:
    """Refuses unknown and missing inputs, naming them and the model's inputs."""
    for name in inputs:
        if name not in declared:
            raise ValueError(f"unknown input {name!r}: the model's inputs are {list(declared)}")
    for name in declared:
        if name not in inputs:
            raise ValueError(f"missing input {name!r}: the model's inputs are {list(declared)}, got {sorted(inputs)}")


def check_input_device(name: str, device: torch.device, session_device: torch.device) -> None:
    """Refuses tensors that would need a silent copy between GPUs (or live on a device ORT cannot read)."""
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"input {name!r}: expected a CPU or CUDA tensor, got one on {device}")
    if device.type == "cuda" and session_device.type == "cuda" and device.index != session_device.index:
        raise ValueError(
            f"input {name!r}: expected a tensor on {session_device} (the session's device) or on the CPU, "
            f"got one on {device}; move it with .to({str(session_device)!r}) if the copy is intended"
        )


def as_tensor(name: str, value: InputValue, expected: torch.dtype) -> torch.Tensor:
    """Wraps a torch tensor, numpy array or Python/numpy scalar as a torch tensor, without copying where possible."""
    if isinstance(value, torch.Tensor):
        check_dense(name, value)
        return value
    if isinstance(value, np.ndarray):
        if value.dtype == object or value.dtype.kind not in "biuf":
            raise TypeError(
                f"input {name!r}: expected a numeric numpy array for dtype {expected}, got dtype {value.dtype}"
            )
        return torch.from_numpy(np.ascontiguousarray(native_numpy(name, value)))
    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        return torch.from_numpy(native_numpy(name, np.asarray(value)))
    if isinstance(value, (bool, int, float)):
        python_dtype = (
            torch.bool if isinstance(value, bool) else torch.int64 if isinstance(value, int) else torch.float64
        )
        if not conversion_allowed(python_dtype, expected):
            raise TypeError(f"input {name!r}: expected dtype {expected}, got Python {type(value).__name__} {value!r}")
        if python_dtype == torch.int64 and not expected.is_floating_point:
            _check_range(name, value, value, expected)
        return torch.tensor(value, dtype=expected)
    raise TypeError(
        f"input {name!r}: expected a torch.Tensor, numpy.ndarray or Python scalar, got {type(value).__name__}"
    )


def check_dense(name: str, tensor: torch.Tensor) -> None:
    """Refuses tensors ORT cannot read as one block of memory: sparse, nested and quantized ones."""
    if tensor.layout != torch.strided:
        raise TypeError(
            f"input {name!r}: expected a dense (strided) tensor, got a {str(tensor.layout)[6:]} tensor; "
            "call .to_dense() if the copy is intended"
        )
    if tensor.is_nested:
        raise TypeError(
            f"input {name!r}: expected a dense (strided) tensor, got a nested tensor; pad it to one shape "
            "(torch.nested.to_padded_tensor) if intended"
        )
    if tensor.is_quantized:
        raise TypeError(
            f"input {name!r}: expected a tensor of a plain dtype, got the quantized {tensor.dtype}; call "
            ".dequantize() if intended"
        )


def native_numpy(name: str, array: np.ndarray) -> np.ndarray:
    """``array`` in the machine's byte order (a copy where it is the other one), refusing dtypes torch lacks."""
    if array.dtype.kind == "f" and array.dtype.itemsize > 8:
        raise TypeError(
            f"input {name!r}: expected a numpy dtype torch can hold (float16/32/64, int8-64, uint8-64, "
            f"bool), got {array.dtype} (numpy's longdouble); cast it with .astype(np.float64) if intended"
        )
    if not array.dtype.isnative:
        return array.astype(array.dtype.newbyteorder("="))
    return array


def check_integer_range(name: str, tensor: torch.Tensor, expected: torch.dtype) -> None:
    """Refuses integers that would wrap when cast to the narrower integer dtype ``expected`` (300 → 44 as uint8)."""
    if tensor.dtype.is_floating_point or expected.is_floating_point or expected == torch.bool or tensor.numel() == 0:
        return
    info, given = torch.iinfo(expected), torch.iinfo(tensor.dtype)
    if given.min >= info.min and given.max <= info.max:
        return  # every value fits: nothing to look at
    if tensor.dtype in _UNSIGNED_WIDE:  # torch has no min/max kernels for these (they come from numpy)
        values = tensor.detach().cpu().numpy()
        _check_range(name, int(values.min()), int(values.max()), expected)
        return
    _check_range(name, int(tensor.min()), int(tensor.max()), expected)


_UNSIGNED_WIDE = tuple(getattr(torch, name) for name in ("uint16", "uint32", "uint64") if hasattr(torch, name))


def _check_range(name: str, low: int, high: int, expected: torch.dtype) -> None:
    info = torch.iinfo(expected)
    if low < info.min or high > info.max:
        raise ValueError(
            f"input {name!r}: expected values in [{info.min}, {info.max}] (the model's {expected}), "
            f"got values in [{low}, {high}]"
        )


def as_checked_tensor(name: str, value: InputValue, expected: torch.dtype) -> torch.Tensor:
    """:func:`as_tensor`, refusing a dtype that does not convert to ``expected`` without loss."""
    tensor = as_tensor(name, value, expected)
    if tensor.dtype != expected:
        if not conversion_allowed(tensor.dtype, expected):
            raise TypeError(
                f"input {name!r}: expected dtype {expected}, got {tensor.dtype}, which does not convert "
                "without loss (cast it explicitly if intended)"
            )
        check_integer_range(name, tensor, expected)
    return tensor


def to_bindable(name: str, value: InputValue, expected: torch.dtype, device: torch.device) -> torch.Tensor:
    """``value`` as a contiguous tensor of ``expected`` dtype on ``device`` (the same tensor if it already is one)."""
    tensor = as_checked_tensor(name, value, expected)
    check_input_device(name, tensor.device, device)
    return tensor.detach().to(device=device, dtype=expected).contiguous()


def numpy_bits(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values as numpy (bfloat16 as its raw uint16 bits, which numpy lacks)."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()
