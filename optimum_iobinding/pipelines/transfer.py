"""Tensors onto the pipeline's device without making the host wait."""

from __future__ import annotations

from typing import Any, Union

import numpy as np
import torch

from ..errors import ArgumentError
from ..runtime.cuda_policy import DEVICE_SETUP


def tensor_of(value: Union[torch.Tensor, np.ndarray], name: str = "tensor") -> torch.Tensor:
    """Given embeddings or latents (the argument ``name``) as a torch tensor: a numpy array is wrapped (one of the
    other byte order is converted to the native one first, as the models' inputs are); a tensor on the meta device,
    which holds no values, is refused by name."""
    if isinstance(value, np.ndarray) and not value.dtype.isnative:
        value = value.astype(value.dtype.newbyteorder("="))
    tensor = torch.as_tensor(value)
    check_holds_values(tensor, name)
    return tensor


def check_holds_values(tensor: torch.Tensor, name: str) -> None:
    """Refuses by ``name`` a tensor on the meta device, which holds no values to compute with."""
    if tensor.is_meta:
        raise ArgumentError(name, "expected a tensor holding values, got one on the meta device")


def upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` (on the host) on ``device`` without making the host wait: to CUDA through pinned memory, an
    asynchronous copy ordered on the current stream (a copy from pageable memory waits for the stream's pending work:
    in a server, for the batch running on the GPU). Elsewhere a plain ``.to(device)``."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    with DEVICE_SETUP.setup():  # pinning may allocate, which a graph capture in another thread must not see
        pinned = tensor.pin_memory()
    return pinned.to(device, non_blocking=True)


def on_cpu(generator: Any) -> bool:
    """Whether a torch generator (or the first of a list) draws on the CPU."""
    first = generator[0] if isinstance(generator, list) else generator
    return first.device.type == "cpu"
