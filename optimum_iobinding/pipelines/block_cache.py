"""First-Block Cache for the diffusion transformers (SD3's MMDiT, FLUX.1), with diffusers' config and rule.

Every step runs the transformer's first block (``transformer/head.onnx``: the embeddings and the first block). Its
residual (its output image tokens minus its input) is compared with the residual of the last step that ran every
block: where ``mean|r − r_last| / mean|r_last|`` is above ``FirstBlockCacheConfig.threshold`` the other blocks run
(``body.onnx``) and their residual (the last block's image tokens minus the first block's) is kept; otherwise they are
skipped and the kept residual is added to the first block's output. The final norm and projection always run
(``out.onnx``). This is diffusers' ``apply_first_block_cache`` rule and state (``FBCHeadBlockHook``,
``FBCBlockHook``): the first step always computes, the compared residual changes only on steps that compute, and the
same steps are skipped.

The decision is one boolean the host reads back per step (it chooses whether the blocks' graph runs): the host waits
for the first block, not for the step before it, and a skipped step's last part is queued before the read, so the GPU
does not wait for the host after it. The parts are graphs of the transformer's own weights
(:meth:`IOBindingORTModel.part`): on CUDA one copy of them serves the whole model and every part, each part captured
as a CUDA graph of its own.

A batch is decided as one: with FLUX.1's true CFG (negative and positive prompts in one batch) a step is skipped only
where the rule over the whole batch says so, where diffusers, which runs the two prompts as separate calls with a
state each, may skip one and not the other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from ..errors import ArgumentError, ArgumentTypeError
from ..layout import FIRST_BLOCK_CACHE_PARTS, FIRST_BLOCK_MARKS
from ..runtime.cuda_policy import DEVICE_SETUP
from ..runtime.model import IOBindingORTModel
from .arguments import is_real
from .caching import StepCache

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


def first_block_cache_for(denoiser: Any, config: Any) -> "FirstBlockCache":
    """The First-Block Cache of a transformer denoiser (:class:`~.denoisers.FlowTransformer`) for ``config``.

    Raises:
        ArgumentTypeError: ``config`` is not diffusers' ``FirstBlockCacheConfig``.
        ArgumentError: its threshold is not a number ≥ 0, or the transformer's folder lacks the parts.
    """
    config_class = first_block_cache_config_class()
    if not isinstance(config, config_class):
        raise ArgumentTypeError(
            "config",
            f"expected diffusers.hooks.FirstBlockCacheConfig(threshold=…) for "
            f"{type(denoiser.pipe).__name__}, got {type(config).__name__} {config!r}",
        )
    threshold = config.threshold
    if not is_real(threshold) or not threshold >= 0:
        raise ArgumentError("config", f"FirstBlockCacheConfig.threshold: expected a number ≥ 0, got {threshold!r}")
    model = denoiser.model
    folder = Path(model.model_path).parent if getattr(model, "model_path", None) else None
    missing = [name for name in PART_FILES if folder is None or not (folder / name).is_file()]
    if missing:
        where = f"{folder}" if folder is not None else "the transformer's session (made outside a folder)"
        raise ArgumentError(
            "config",
            f"First-Block Cache runs the transformer's parts {list(PART_FILES)}, but "
            f"{where} lacks {missing}; {EXPORT_HINT}",
        )
    parts = [model.part(folder / name) for name in PART_FILES]
    return FirstBlockCache(config, model, *parts)


class FirstBlockCache(StepCache):
    """The transformer's step as its parts (see the module docstring), deciding per step whether the blocks after
    the first run. ``feed_model`` is the head: it takes the transformer's inputs."""

    def __init__(
        self,
        config: Any,
        model: IOBindingORTModel,
        head: IOBindingORTModel,
        body: IOBindingORTModel,
        out: IOBindingORTModel,
    ):
        super().__init__()
        self._config = config
        self.threshold = float(config.threshold)
        self.head, self.body, self.out = head, body, out
        self.feed_model = head
        head_outputs = set(head.output_names)
        wanted = {
            FIRST_BLOCK_INPUT: head_outputs,
            FIRST_BLOCK_OUTPUT: head_outputs,
            BLOCKS_OUTPUT: set(body.output_names),
        }
        lacking = [name for name, names in wanted.items() if name not in names]
        # a skipped step runs the out part without the body: it may read only the transformer's inputs, the head's
        # outputs and the blocks' output
        known = set(model.input_names) | head_outputs | {BLOCKS_OUTPUT}
        lacking += [name for name in out.input_names if name not in known]
        lacking += [name for name in body.input_names if name not in set(model.input_names) | head_outputs]
        if lacking:
            raise ArgumentError(
                "config",
                f"the parts beside {model.model_path!r} do not fit together (values "
                f"{lacking} are not where First-Block Cache expects them); {EXPORT_HINT}",
            )
        self.last_residual: Optional[torch.Tensor] = None  # the first block's residual at the last full step
        # the threshold times its absolute sum (the rule's means share one count), made once per full step
        self.last_bound: Optional[torch.Tensor] = None
        self.tail_residual: Optional[torch.Tensor] = None  # the other blocks' residual at the last full step
        self._out_buffers: Optional[Dict[str, torch.Tensor]] = None  # the out part's graph inputs, once it has one
        # on CUDA: the decision's pinned host copy, the event after its copy, and the device value it copies
        self._host_flag: Optional[torch.Tensor] = None
        self._flag_copied: Optional[Any] = None
        self._flag_of: Optional[torch.Tensor] = None

    @property
    def config(self) -> Any:
        return self._config

    def start(self, steps: int) -> None:
        super().start(steps)
        self.last_residual = self.tail_residual = None
        self._out_buffers = None

    def exceeded(self, residual: torch.Tensor) -> torch.Tensor:
        """diffusers' rule after the first step: whether the first block's residual changed by more than the threshold
        since the last full step (mean absolute change over the mean absolute last residual; both means count the
        same elements, so sums are compared), as a boolean on the device: one reduction, accumulated in float32,
        queued and not read. On CUDA its copy to pinned host memory is queued right behind it, so that
        :meth:`should_compute` waits for the decision and not for what is queued after it."""
        change = torch.linalg.vector_norm(residual - self.last_residual, ord=1, dtype=torch.float32)
        exceeded = change > self.last_bound
        if exceeded.is_cuda:
            with torch.cuda.device(exceeded.device):  # the copy and the event on the decision's device and stream
                if self._host_flag is None:
                    # pinning may allocate, which a graph capture in another thread must not see; a normal tensor
                    # even inside inference mode: a later call outside it writes into it
                    with DEVICE_SETUP.setup(), torch.inference_mode(False):
                        self._host_flag = torch.empty((), dtype=torch.bool, pin_memory=True)
                    self._flag_copied = torch.cuda.Event()
                self._host_flag.copy_(exceeded, non_blocking=True)
                self._flag_copied.record(torch.cuda.current_stream(exceeded.device))
            self._flag_of = exceeded
        return exceeded

    def should_compute(self, exceeded: torch.Tensor) -> bool:
        """Whether the other blocks run: :meth:`exceeded` read back, the one value a step reads (on CUDA: the host
        waits for its copy only, not for the kernels queued after it)."""
        if exceeded is self._flag_of:
            self._flag_copied.synchronize()
            self._flag_of = None
            return bool(self._host_flag.item())
        return bool(exceeded.item())

    def _remember(self, residual: torch.Tensor) -> None:
        """Keeps a full step's first-block residual and the threshold times its absolute sum (on the device: nothing
        is read back; a later step compares with it without another kernel)."""
        self.last_residual = residual
        self.last_bound = torch.linalg.vector_norm(residual, ord=1, dtype=torch.float32) * self.threshold

    @staticmethod
    def _run(model: IOBindingORTModel, values: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        outputs = model(**{name: values[name] for name in model.input_names})
        return dict(zip(model.output_names, outputs))

    def __call__(self, step: int, inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
        values: Dict[str, Any] = dict(inputs)
        values.update(self._run(self.head, values))
        first_output = values[FIRST_BLOCK_OUTPUT]
        residual = first_output - values[FIRST_BLOCK_INPUT]
        if self.tail_residual is not None:
            exceeded = self.exceeded(residual)
            # the skipped step's result is queued before the decision is read: the GPU runs the out part while the
            # host waits for the decision, instead of waiting for the host to launch it after (a full step runs
            # the out part again, on the blocks' output)
            buffer = (self._out_buffers or {}).get(BLOCKS_OUTPUT)
            same = buffer is not None and buffer.shape == first_output.shape and buffer.dtype == first_output.dtype
            values[BLOCKS_OUTPUT] = torch.add(first_output, self.tail_residual, out=buffer if same else None)
            skipped = self._run_out(values)
            if not self.should_compute(exceeded):
                self.computed.append(False)
                return skipped
        values.update(self._run(self.body, values))
        # new tensors: the parts' outputs are buffers their next runs overwrite
        self.tail_residual = values[BLOCKS_OUTPUT] - first_output
        self._remember(residual)
        self.computed.append(True)
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
        """The head, body and out models (for warm-up and benchmarks)."""
        return [self.head, self.body, self.out]
