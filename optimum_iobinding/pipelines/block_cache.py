"""First-Block Cache for the diffusion transformers (SD3's MMDiT, FLUX.1, Wan's video transformers), with diffusers'
config and rule.

Every step runs the transformer's first block (``transformer/head.onnx``: the embeddings and the first block). Its
residual (its output image tokens minus its input) is compared with the residual of the last step that ran every
block: where ``mean|r − r_last| / mean|r_last|`` is above ``FirstBlockCacheConfig.threshold`` the other blocks run
(``body.onnx``) and their residual (the last block's image tokens minus the first block's) is kept; otherwise they are
skipped and the kept residual is added to the first block's output. The final norm and projection always run
(``out.onnx``). This is diffusers' ``apply_first_block_cache`` rule and state (``FBCHeadBlockHook``,
``FBCBlockHook``): the first step always computes, the compared residual changes only on steps that compute, and the
same steps are skipped.

The decision is one read back per step (it chooses whether the blocks' graph runs): the host waits for the first
block, not for the step before it, and a skipped step's last part is queued before the read, so the GPU does not
wait for the host after it. The parts are graphs of the transformer's own weights (:meth:`IOBindingORTModel.part`):
on CUDA one copy of them serves the whole model and every part, each part captured as a CUDA graph of its own.

Where diffusers calls the transformer once per prompt kind, each call with a state of its own (Wan's negative and
positive prompts, in cache contexts ``"uncond"`` and ``"cond"``), the rule decides each slice of the guided batch
apart (:meth:`FirstBlockCache.start`'s ``groups``): a step where one slice computes and the other does not runs the
blocks for the whole batch and gives the other slice its stand-in, each slice's state changing only where it
computes, as diffusers' two calls do. Elsewhere a batch is decided as one (SD3, whose diffusers pipeline batches its
guidance; FLUX.1's true CFG, where diffusers, which runs the two prompts as separate calls with a state each, may skip
one and not the other).

Wan 2.2's two experts each have their parts (``transformer_2/head.onnx`` …) and a state of their own: the low-noise
expert's first step computes, as diffusers' hook on ``transformer_2`` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import ArgumentError, ArgumentTypeError
from ..layout import FIRST_BLOCK_CACHE_PARTS, FIRST_BLOCK_MARKS, missing_first_block_cache_parts
from ..runtime.cuda_policy import DEVICE_SETUP
from ..runtime.model import IOBindingORTModel
from .arguments import is_real
from .caching import StepCache, config_shown

# the part graphs in the transformer's folder and the values they hand each other (export/step_cache.py writes them)
PART_FILES = FIRST_BLOCK_CACHE_PARTS
FIRST_BLOCK_INPUT, FIRST_BLOCK_OUTPUT, _, BLOCKS_OUTPUT = FIRST_BLOCK_MARKS
EXPORT_HINT = (
    "export the pipeline with First-Block Cache's parts: `optimum-iobinding export --step-cache …` or "
    "export_pipeline(…, step_cache=True)"
)


def first_block_cache_config_class() -> type:
    """diffusers' ``FirstBlockCacheConfig`` (diffusers ≥ 0.35)."""
    from diffusers.hooks import FirstBlockCacheConfig

    return FirstBlockCacheConfig


def first_block_cache_for(
    denoiser: Any, config: Any, models: Optional[Sequence[IOBindingORTModel]] = None
) -> "FirstBlockCache":
    """The First-Block Cache of a transformer denoiser (:class:`~.denoisers.FlowTransformer`) for ``config``, over
    ``models`` (the transformers of the loop's stages in order, each with its parts; default: the denoiser's).

    Raises:
        ArgumentTypeError: ``config`` is not diffusers' ``FirstBlockCacheConfig``.
        ArgumentError: its threshold is not a number ≥ 0, or a transformer's folder lacks the parts.
    """
    config_class = first_block_cache_config_class()
    if not isinstance(config, config_class):
        raise ArgumentTypeError(
            "config",
            f"expected diffusers.hooks.FirstBlockCacheConfig(threshold=…) for "
            f"{type(denoiser.pipe).__name__}, got {config_shown(config)}",
        )
    threshold = config.threshold
    if not is_real(threshold) or not threshold >= 0:
        raise ArgumentError("config", f"FirstBlockCacheConfig.threshold: expected a number ≥ 0, got {threshold!r}")
    stages = []
    for model in [denoiser.model] if models is None else models:
        folder = Path(model.model_path).parent if getattr(model, "model_path", None) else None
        missing = list(PART_FILES) if folder is None else missing_first_block_cache_parts(folder)
        if missing:
            where = f"{folder}" if folder is not None else "the transformer's session (made outside a folder)"
            raise ArgumentError(
                "config",
                f"First-Block Cache runs the transformer's parts {list(PART_FILES)}, but "
                f"{where} lacks {missing}; {EXPORT_HINT}",
            )
        stages.append(TransformerParts(model, *(model.part(folder / name) for name in PART_FILES)))
    return FirstBlockCache(config, stages)


@dataclass(frozen=True)
class TransformerParts:
    """A transformer and its First-Block Cache parts: ``head`` takes the transformer's inputs, ``body`` runs the
    blocks after the first, ``out`` the final norm and projection."""

    model: IOBindingORTModel
    head: IOBindingORTModel
    body: IOBindingORTModel
    out: IOBindingORTModel

    def check(self) -> None:
        """The parts must hand each other what First-Block Cache reads, and a skipped step's out part may read only
        the transformer's inputs, the head's outputs and the blocks' output.

        Raises:
            ArgumentError: naming the values that are not where they should be."""
        head_outputs = set(self.head.output_names)
        wanted = {
            FIRST_BLOCK_INPUT: head_outputs,
            FIRST_BLOCK_OUTPUT: head_outputs,
            BLOCKS_OUTPUT: set(self.body.output_names),
        }
        lacking = [name for name, names in wanted.items() if name not in names]
        known = set(self.model.input_names) | head_outputs | {BLOCKS_OUTPUT}
        lacking += [name for name in self.out.input_names if name not in known]
        lacking += [name for name in self.body.input_names if name not in set(self.model.input_names) | head_outputs]
        if lacking:
            raise ArgumentError(
                "config",
                f"the parts beside {self.model.model_path!r} do not fit together (values "
                f"{lacking} are not where First-Block Cache expects them); {EXPORT_HINT}",
            )


class FirstBlockCache(StepCache):
    """The transformer's step as its parts (see the module docstring), deciding per step whether the blocks after
    the first run. ``feed_model`` is the running transformer's head: it takes the transformer's inputs.

    Args:
        config: diffusers' ``FirstBlockCacheConfig``.
        stages: each transformer of the loop's stages with its parts (one; Wan 2.2's two experts), in order.
    """

    def __init__(self, config: Any, stages: Sequence[TransformerParts]):
        super().__init__()
        self._config = config
        self.threshold = float(config.threshold)
        for stage in stages:
            stage.check()
        self.stages = list(stages)
        #: per step of the last loop, per slice of its batch (:meth:`start`'s ``groups``), whether the slice's rows
        #: took the blocks' output (``computed``: whether the blocks ran for any)
        self.computed_by_group: List[Tuple[bool, ...]] = []
        self.groups = 1
        # on CUDA: the decision's pinned host copy, the event after its copy, and the device value it copies
        self._host_flag: Optional[torch.Tensor] = None
        self._flag_copied: Optional[Any] = None
        self._flag_of: Optional[torch.Tensor] = None
        self._use(self.stages[0])

    def _use(self, stage: TransformerParts) -> None:
        """Runs ``stage``'s parts from the next step on, with a state of their own (the first step computes)."""
        self.head, self.body, self.out = stage.head, stage.body, stage.out
        self.feed_model = stage.head
        self.last_residual: Optional[torch.Tensor] = None  # the first block's residual at the last full step
        # per group, the threshold times its residual's absolute sum (the rule's means share one count), made once
        # per full step
        self.last_bound: Optional[torch.Tensor] = None
        self.tail_residual: Optional[torch.Tensor] = None  # the other blocks' residual at the last full step
        self._out_buffers: Optional[Dict[str, torch.Tensor]] = None  # the out part's graph inputs, once it has one

    @property
    def config(self) -> Any:
        return self._config

    def start(self, steps: int, groups: int = 1) -> None:
        super().start(steps, groups)
        self.groups = groups
        self.computed_by_group = []
        self._use(self.stages[0])

    def switch(self, model: IOBindingORTModel) -> bool:
        """Runs the parts of ``model`` (a later stage's transformer: Wan 2.2's low-noise expert) where the cache has
        them, with a state of its own."""
        stage = next((stage for stage in self.stages if stage.model is model), None)
        if stage is None:
            return False
        self._use(stage)
        return True

    def _group_sums(self, values: torch.Tensor) -> torch.Tensor:
        """The absolute sum of each group's rows of ``values``, accumulated in float32."""
        return torch.linalg.vector_norm(
            values.unflatten(0, (self.groups, -1)).flatten(1), ord=1, dim=1, dtype=torch.float32
        )

    def exceeded(self, residual: torch.Tensor) -> torch.Tensor:
        """diffusers' rule after the first step: whether the first block's residual changed by more than the threshold
        since the last full step (mean absolute change over the mean absolute last residual; both means count the
        same elements, so sums are compared), per group, as booleans on the device: one reduction, accumulated in
        float32, queued and not read. On CUDA their copy to pinned host memory is queued right behind it, so that
        :meth:`should_compute` waits for the decision and not for what is queued after it."""
        exceeded = self._group_sums(residual - self.last_residual) > self.last_bound
        if exceeded.is_cuda:
            with torch.cuda.device(exceeded.device):  # the copy and the event on the decision's device and stream
                if self._host_flag is None or self._host_flag.shape != exceeded.shape:
                    # pinning may allocate, which a graph capture in another thread must not see; a normal tensor
                    # even inside inference mode: a later call outside it writes into it
                    with DEVICE_SETUP.setup(), torch.inference_mode(False):
                        self._host_flag = torch.empty(exceeded.shape, dtype=torch.bool, pin_memory=True)
                    self._flag_copied = torch.cuda.Event()
                self._host_flag.copy_(exceeded, non_blocking=True)
                self._flag_copied.record(torch.cuda.current_stream(exceeded.device))
            self._flag_of = exceeded
        return exceeded

    def should_compute(self, exceeded: torch.Tensor) -> Tuple[bool, ...]:
        """Whether the other blocks run, per group: :meth:`exceeded` read back, the one read of a step (on CUDA: the
        host waits for its copy only, not for the kernels queued after it)."""
        if exceeded is self._flag_of:
            self._flag_copied.synchronize()
            self._flag_of = None
            return tuple(bool(flag) for flag in self._host_flag.tolist())
        return tuple(bool(flag) for flag in exceeded.tolist())

    def _remember(self, residual: torch.Tensor) -> None:
        """Keeps a full step's first-block residual and the threshold times each group's absolute sum of it (on the
        device: nothing is read back; a later step compares with it without another kernel)."""
        self.last_residual = residual
        self.last_bound = self._group_sums(residual) * self.threshold

    @staticmethod
    def _run(model: IOBindingORTModel, values: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        outputs = model(**{name: values[name] for name in model.input_names})
        return dict(zip(model.output_names, outputs))

    def __call__(self, step: int, inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
        values: Dict[str, Any] = dict(inputs)
        values.update(self._run(self.head, values))
        first_output = values[FIRST_BLOCK_OUTPUT]
        residual = first_output - values[FIRST_BLOCK_INPUT]
        computing = (True,) * self.groups
        if self.tail_residual is not None:
            exceeded = self.exceeded(residual)
            # the skipped step's result is queued before the decision is read: the GPU runs the out part while the
            # host waits for the decision, instead of waiting for the host to launch it after (a full step runs
            # the out part again, on the blocks' output)
            buffer = (self._out_buffers or {}).get(BLOCKS_OUTPUT)
            same = buffer is not None and buffer.shape == first_output.shape and buffer.dtype == first_output.dtype
            values[BLOCKS_OUTPUT] = torch.add(first_output, self.tail_residual, out=buffer if same else None)
            skipped = self._run_out(values)
            computing = self.should_compute(exceeded)
            if not any(computing):
                self.computed.append(False)
                self.computed_by_group.append(computing)
                return skipped
            stand_in = values[BLOCKS_OUTPUT]
        values.update(self._run(self.body, values))
        # new tensors: the parts' outputs are buffers their next runs overwrite
        tail_residual = values[BLOCKS_OUTPUT] - first_output
        if not all(computing):  # the groups that skip keep their state and take the stand-in, as diffusers' calls
            rows = exceeded.repeat_interleave(first_output.shape[0] // self.groups)
            rows = rows.view(-1, *([1] * (first_output.ndim - 1)))
            values[BLOCKS_OUTPUT] = torch.where(rows, values[BLOCKS_OUTPUT], stand_in)
            tail_residual = torch.where(rows, tail_residual, self.tail_residual)
            residual = torch.where(rows, residual, self.last_residual)
        self.tail_residual = tail_residual
        self._remember(residual)
        self.computed.append(True)
        self.computed_by_group.append(computing)
        return self._run_out(values)

    def _run_out(self, values: Dict[str, Any]) -> torch.Tensor:
        """The out part on ``values``; after its first run, its graph's input buffers are known (a skipped step
        writes the blocks' stand-in straight into them)."""
        inputs = {name: values[name] for name in self.out.input_names}
        output = self.out(**inputs)[0]
        if self._out_buffers is None:
            self._out_buffers = (
                self.out.graph_input_buffers({name: tuple(value.shape) for name, value in inputs.items()}) or {}
            )
        return output

    @property
    def parts(self) -> List[IOBindingORTModel]:
        """The head, body and out models of every transformer (for warm-up and benchmarks)."""
        return [part for stage in self.stages for part in (stage.head, stage.body, stage.out)]
