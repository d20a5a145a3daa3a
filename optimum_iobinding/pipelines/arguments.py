"""What a pipeline call's arguments are: the kinds of generator, the predicates its checks use, and the checks more
than one pipeline makes."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import numpy as np
import torch

from ..errors import ArgumentError, ArgumentTypeError

Generator = Union[np.random.RandomState, torch.Generator, List[torch.Generator], None]
# the kinds of a call's other arguments, named once for every family's signature
Prompt = Union[str, List[str], None]
Embeds = Optional[Union[torch.Tensor, np.ndarray]]
Latents = Optional[Union[torch.Tensor, np.ndarray]]
StepCallback = Optional[Callable[[int, int, torch.Tensor], None]]
StepEndCallback = Optional[Callable[..., Dict[str, Any]]]
TensorNames = Sequence[str]


def is_torch_generator(generator: Any) -> bool:
    """A torch.Generator, or a non-empty list of them (one per image)."""
    if isinstance(generator, list):
        return bool(generator) and all(isinstance(g, torch.Generator) for g in generator)
    return isinstance(generator, torch.Generator)


def generator_kinds(unit: str = "image") -> str:
    """What a call takes as its ``generator``, in a refusal's words."""
    return f"a numpy RandomState, a torch.Generator or a list of torch.Generators (one per {unit})"


def check_generator(generator: Any, prompts: int, per_prompt: int, unit: str = "image") -> int:
    """Refuses, before any work, a ``generator`` the call cannot draw its noise from: ``None``, a numpy
    ``RandomState`` or a ``torch.Generator`` pass; a list must hold one ``torch.Generator`` per ``unit`` (``prompts``
    × ``per_prompt``, the call's ``num_{unit}s_per_prompt``), as diffusers' pipelines take it. Returns that count."""
    count = prompts * per_prompt
    if generator is None or isinstance(generator, (np.random.RandomState, torch.Generator)):
        return count
    if not isinstance(generator, list):
        raise ArgumentTypeError("generator", f"expected {generator_kinds(unit)}, got {type(generator).__name__}")
    wrong = next((item for item in generator if not isinstance(item, torch.Generator)), None)
    if wrong is not None:
        raise ArgumentTypeError(
            "generator",
            f"expected a list of torch.Generators (one per {unit}; a numpy RandomState is given alone), got a list "
            f"holding {type(wrong).__name__}",
        )
    if len(generator) != count:
        raise ArgumentError(
            "generator",
            f"expected one torch.Generator per {unit} ({count}: {prompts} prompt{'s' if prompts != 1 else ''} × "
            f"num_{unit}s_per_prompt {per_prompt}), got a list of {len(generator)}",
        )
    return count


def no_denoising_step(strength: float, num_inference_steps: int) -> ArgumentError:
    """The refusal of a ``strength`` whose part of ``num_inference_steps`` holds no step."""
    steps = f"{num_inference_steps} step{'s' if num_inference_steps != 1 else ''}"
    return ArgumentError(
        "strength",
        f"{strength} of {steps} leaves no denoising step (the steps times the strength must reach 1); raise the "
        "steps or the strength",
    )


def is_integer(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_real(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def check_sequence_length(max_sequence_length: Any, maximum: int) -> None:
    """Refuses a T5 prompt length that is not an integer in ``[1, maximum]`` (diffusers' check_inputs refuses more
    than its pipeline's maximum), naming the argument."""
    if not is_integer(max_sequence_length) or not 1 <= max_sequence_length <= maximum:
        raise ArgumentError(
            "max_sequence_length", f"expected an integer in [1, {maximum}] (T5 tokens), got {max_sequence_length!r}"
        )
