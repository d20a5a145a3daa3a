"""A multistep scheduler's steps as linear maps read off the scheduler itself, applied on the device without a host
wait.

diffusers' ``UniPCMultistepScheduler`` (Wan's default, and ``--scheduler unipc``) makes the host wait at every step:
it builds small tensors of its coefficients on the latents' device from Python lists (a copy from pageable memory,
which waits for the stream) and solves its corrector's system with ``torch.linalg.solve`` there (which waits for the
result). Its coefficients depend on the sigmas alone; its step is linear in the sample, the model output and the state
it keeps (the last sample, the last model outputs).

So before a loop :meth:`LinearSteps.of` runs a copy of the scheduler on the host, step by step, with *coefficient
vectors* in place of tensors: at each step the sample, the model output and every state tensor the scheduler holds
are unit vectors ``(1, K, 1)``, one per basis element, and what the step returns (and leaves in its state) is, value
for value, the coefficients of that output over them. The loop then computes each output on the device as a sum of
its inputs times those numbers — the scheduler's own arithmetic, none of it re-implemented. Before it is used, the
trace is checked against the scheduler's own steps on random inputs; a scheduler whose step is not linear in them
(noise drawn from a generator, dynamic thresholding) gives no trace and runs its own steps.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

__all__ = ["LinearSteps", "TRACED_SCHEDULERS"]

# the schedulers whose own step makes the host wait and whose step is linear in its inputs and state
TRACED_SCHEDULERS = ("UniPCMultistepScheduler",)
# how far the trace may be from the scheduler's own step on random inputs of unit scale (float32 arithmetic in both)
_TOLERANCE = 1e-4
Terms = Tuple[Tuple[str, float], ...]  # (input name, coefficient), the non-zero ones


@dataclass(frozen=True)
class _Step:
    """One step's linear map: the next sample and each state tensor the scheduler keeps after the step, as terms over
    the step's inputs: ``"sample"``, ``"model_output"`` and the state names the step before left."""

    sample: Terms
    state: Tuple[Tuple[str, Terms], ...]


class LinearSteps:
    """A traced scheduler's steps for one loop (see the module's docstring); :meth:`step` is the scheduler's
    ``step(model_output, t, sample)[0]`` of the loop's ``i``-th step, its state kept here as device tensors."""

    def __init__(self, steps: Sequence[_Step]):
        self.steps = list(steps)
        self.state: Dict[str, torch.Tensor] = {}

    @classmethod
    def of(cls, scheduler: Any, timesteps: Any, step_kwargs: Optional[Mapping[str, Any]] = None) -> "LinearSteps":
        """The traced steps of ``scheduler`` over ``timesteps`` (host values), or ``None`` where it is not traced: a
        scheduler not in :data:`TRACED_SCHEDULERS`, keyword arguments for its step (a generator: noise), or a trace
        that does not match its own steps."""
        if type(scheduler).__name__ not in TRACED_SCHEDULERS or step_kwargs:
            return None
        if not isinstance(timesteps, torch.Tensor) or timesteps.device.type != "cpu":
            return None  # a schedule on the device would make the host wait to be read
        key = (
            type(scheduler),
            json.dumps(dict(scheduler.config), sort_keys=True, default=str),
            tuple(float(t) for t in timesteps),
            getattr(scheduler, "begin_index", None),
            getattr(scheduler, "step_index", None),
        )
        steps = _traced(key, scheduler, timesteps)
        return None if steps is None else cls(steps)

    def step(self, index: int, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        """The next sample of step ``index`` (the scheduler's state moves on here)."""
        step = self.steps[index]
        values = {"sample": sample, "model_output": model_output, **self.state}
        self.state = {name: _combine(terms, values, sample) for name, terms in step.state}
        return _combine(step.sample, values, sample)


def _combine(terms: Terms, values: Mapping[str, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """``Σ coefficient · value`` in ``like``'s dtype: a new tensor (never one of the inputs: the model's output buffer
    is reused by its next call)."""
    if not terms:
        return torch.zeros_like(like)
    (name, coefficient), *rest = terms
    out = values[name].to(like.dtype) * coefficient
    for name, coefficient in rest:
        out.add_(values[name].to(like.dtype), alpha=coefficient)
    return out


# the last traces, by scheduler class, config, timesteps and position (a pipeline's calls repeat them)
_TRACES: Dict[Tuple, Optional[List[_Step]]] = {}


def _traced(key: Tuple, scheduler: Any, timesteps: torch.Tensor) -> Optional[List[_Step]]:
    """The steps of ``scheduler`` over ``timesteps`` from where it is (copies of it are run; it is left as it was),
    checked, cached by ``key``."""
    if key not in _TRACES:
        try:
            steps = _trace(scheduler, timesteps)
            _TRACES[key] = steps if _matches(scheduler, timesteps, steps) else None
        except Exception:  # anything the trace cannot follow: the scheduler runs its own steps
            _TRACES[key] = None
        while len(_TRACES) > 32:
            _TRACES.pop(next(iter(_TRACES)))
    return _TRACES[key]


def _state_names(scheduler: Any, shape: Tuple[int, ...]) -> List[str]:
    """The scheduler's state tensors of ``shape``: attributes, or items of list attributes (``"model_outputs.1"``)."""
    names = []
    for attribute, value in vars(scheduler).items():
        if isinstance(value, torch.Tensor) and tuple(value.shape) == shape:
            names.append(attribute)
        elif isinstance(value, list):
            names.extend(
                f"{attribute}.{index}"
                for index, item in enumerate(value)
                if isinstance(item, torch.Tensor) and tuple(item.shape) == shape
            )
    return names


def _get(scheduler: Any, name: str) -> torch.Tensor:
    attribute, _, index = name.partition(".")
    value = getattr(scheduler, attribute)
    return value[int(index)] if index else value


def _set(scheduler: Any, name: str, value: torch.Tensor) -> None:
    attribute, _, index = name.partition(".")
    if index:
        getattr(scheduler, attribute)[int(index)] = value
    else:
        setattr(scheduler, attribute, value)


def _trace(scheduler: Any, timesteps: torch.Tensor) -> List[_Step]:
    probe = copy.deepcopy(scheduler)
    state: List[str] = _state_names(probe, (1, 1, 1))  # none before the first step, unless it was used before
    steps = []
    for t in timesteps:
        inputs = ["sample", "model_output", *state]
        shape = (1, len(inputs), 1)

        def unit(position: int) -> torch.Tensor:
            vector = torch.zeros(shape, dtype=torch.float64)
            vector[0, position, 0] = 1.0
            return vector

        for position, name in enumerate(state, start=2):
            _set(probe, name, unit(position))
        output = probe.step(unit(1), t, unit(0), return_dict=False)[0]
        after = _state_names(probe, shape)

        def terms(vector: torch.Tensor) -> Terms:
            coefficients = vector.reshape(-1).tolist()
            return tuple((inputs[j], float(c)) for j, c in enumerate(coefficients) if c != 0.0)

        steps.append(_Step(terms(output), tuple((name, terms(_get(probe, name))) for name in after)))
        state = after
    return steps


def _matches(scheduler: Any, timesteps: torch.Tensor, steps: Sequence[_Step]) -> bool:
    """Whether the trace gives the scheduler's own steps on random inputs (float32, a small latent)."""
    reference = copy.deepcopy(scheduler)
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn(1, 4, 3, generator=generator)
    traced = LinearSteps(steps)
    ours = sample
    for index, t in enumerate(timesteps):
        model_output = torch.randn(1, 4, 3, generator=generator)
        sample = reference.step(model_output, t, sample, return_dict=False)[0]
        ours = traced.step(index, model_output, ours)
        if not torch.allclose(ours, sample, atol=_TOLERANCE, rtol=_TOLERANCE, equal_nan=True):
            return False
    return True
