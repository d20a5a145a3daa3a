"""What a pipeline call's arguments are: the kinds of generator, and the predicates its checks use."""

from __future__ import annotations

from typing import Any, List, Union

import numpy as np
import torch

Generator = Union[np.random.RandomState, torch.Generator, List[torch.Generator], None]


def is_torch_generator(generator: Any) -> bool:
    """A torch.Generator, or a non-empty list of them (one per image)."""
    if isinstance(generator, list):
        return bool(generator) and all(isinstance(g, torch.Generator) for g in generator)
    return isinstance(generator, torch.Generator)


def is_integer(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_real(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))

