"""Step caching: a denoising loop that runs only part of its model on some steps and reuses what an earlier step
computed for the rest (First-Block Cache for diffusion transformers, :mod:`.block_cache`; DeepCache for UNets,
:mod:`.deep_cache`). A denoiser with a cache enabled calls it instead of its model at every step; the cache decides
what each step runs, from parts of the model exported beside it that read the model's own weights."""

from __future__ import annotations

import abc
from typing import Any, Dict, List, Optional

import torch

from ..runtime.model import IOBindingORTModel


def config_shown(config: Any) -> str:
    """A config in a refusal: its class, and its repr where that is one short line (a config dataclass of many
    fields prints several lines)."""
    shown = repr(config)
    if "\n" in shown or len(shown) > 80:
        return type(config).__name__
    return shown if shown.startswith(type(config).__name__) else f"{type(config).__name__} {shown}"


class StepCache(abc.ABC):
    """What a denoiser's loop calls at each step in place of its model while a cache is enabled.

    ``computed`` lists, for the last loop, whether each step ran the whole model (``True``) or reused a cached part
    (``False``); benchmarks and tests read it."""

    #: the model whose CUDA-graph input buffers the loop may write the step's inputs into (``None``: none)
    feed_model: Optional[IOBindingORTModel] = None

    def __init__(self) -> None:
        self.computed: List[bool] = []

    @property
    @abc.abstractmethod
    def config(self) -> object:
        """The config the cache was enabled with."""

    def start(self, steps: int, groups: int = 1) -> None:
        """A loop of ``steps`` steps begins: what an earlier loop cached is forgotten. ``groups``: how many equal
        slices of a step's batch (its rows in order: a guided batch's negative prompts, then its positive ones) the
        cache decides apart, as diffusers does where it calls the model once per slice; a cache that decides alike
        for every row ignores it."""
        self.computed = []

    def switch(self, model: IOBindingORTModel) -> bool:
        """A later stage of the loop (:class:`~.loop.Stage`: Wan 2.2's low-noise expert) runs ``model`` from the
        next step on: whether the cache runs it (then with a state of its own, as diffusers' hook on each model has;
        ``computed`` goes on), or the stage runs the model whole (``False``, the default)."""
        return False

    @abc.abstractmethod
    def __call__(self, step: int, inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
        """The model's output (its first) for step ``step`` of the loop, given the model's inputs."""

    @property
    def skipped_steps(self) -> int:
        """How many steps of the last loop reused a cached part."""
        return self.computed.count(False)
