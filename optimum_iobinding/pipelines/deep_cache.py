"""DeepCache for the Stable Diffusion UNets (SD 1.x/2.x, SDXL, LCM), with the ``DeepCache`` package's names and rule.

``pipe.enable_cache(DeepCacheConfig(cache_interval=3, cache_branch_id=0))``: every ``cache_interval``-th step runs
the whole UNet and keeps the deep features at branch ``cache_branch_id``; the steps between run only the shallow
branch over the kept features (Ma et al., "DeepCache: Accelerating Diffusion Models for Free"). The names and the
rule are those of ``DeepCache.DeepCacheSDHelper.set_params(cache_interval, cache_branch_id)`` with its uniform skip
mode, so the images are those of diffusers' torch pipeline with that helper enabled:

- **Which steps run whole.** The helper numbers a step by the position of its timestep in the scheduler's schedule
  (the first position holding that value) and runs whole the steps whose number, counted from the loop's first step,
  is a multiple of ``cache_interval``: the first step always. Where the timesteps are distinct (DDIM, Euler,
  DPM-Solver, LCM …) that is every ``cache_interval``-th step from the first; PNDM's schedule repeats its second
  timestep, so its third step counts as its second (and a second-order scheduler's repeated timesteps likewise). The
  schedule is on the host before the loop starts: which part a step runs is known in advance, and nothing is read
  back from the device.
- **Which branch.** ``cache_branch_id = 3 × block + layer``: down block ``block`` and the up block of the same depth,
  and a layer in them (see :mod:`optimum_iobinding.export.deep_cache`, which writes the parts). Branch 0 is the
  shallowest: the first convolution, the last up block's last resnet (and its attention) and the output layers.
  A UNet of ``n`` down blocks has branches ``0 … 3n − 1``.
- **What is kept.** The hidden states the first resnet the shallow branch runs in its up block concatenates with
  its skip connection, as the full step computed them; everything else a shallow step needs (the time embedding,
  the shallow down blocks, the skip connections) it computes from its own inputs, as the helper's shallow step does.

The parts are graphs of the UNet's own weights beside its ``model.onnx`` (``export --step-cache``): the full one
(the whole UNet, with every branch's feature as an extra output) and one shallow graph per branch
(:meth:`IOBindingORTModel.part`: on CUDA one copy of the weights serves the UNet and its parts, each part captured
as a CUDA graph of its own). On CUDA the kept feature is copied once per full step into the shallow graph's input
buffer, which every shallow step then reads in place.

The helper counts a step from the first call after ``enable()``; here every call counts from its own first step
(the same, for a helper enabled before each call). ControlNet pipelines and the stream pipeline do not cache: a
ControlNet's residuals go into the deep blocks and the mid block, which a shallow step skips, and the stream
pipeline runs a loop of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from ..errors import ArgumentError, ArgumentTypeError
from ..layout import DEEP_CACHE_FULL_PART, DEEP_CACHE_SHALLOW_PART, deep_cache_shallow_parts
from ..runtime.model import IOBindingORTModel
from .arguments import is_integer
from .caching import StepCache, config_shown

# the part graphs in the UNet's folder (export/deep_cache.py writes them)
FULL_PART = DEEP_CACHE_FULL_PART
EXPORT_HINT = (
    "export the pipeline with DeepCache's parts: `optimum-iobinding export --step-cache …` or "
    "export_pipeline(…, step_cache=True)"
)
# why the UNet families whose records name no DeepCache (Family.step_cache) have none
REFUSAL_REASONS = {
    "controlnet": "a ControlNet's residuals go into the deep blocks and the mid block, which a shallow step skips",
    "controlnet-img2img": "a ControlNet's residuals go into the deep blocks and the mid block, which a shallow step "
    "skips",
    "stream": "the stream pipeline runs a few-step loop of its own",
}


@dataclass(frozen=True)
class DeepCacheConfig:
    """DeepCache's settings, with the ``DeepCache`` package's names and meaning (``DeepCacheSDHelper.set_params``).

    Args:
        cache_interval: every ``cache_interval``-th step runs the whole UNet (the first step always); 1 runs every
            step whole.
        cache_branch_id: where the shallow branch ends: ``3 × block + layer`` (0, the default, is the shallowest;
            a UNet of ``n`` down blocks has ``0 … 3n − 1``).

    Raises:
        ArgumentTypeError: a setting that is not an integer.
        ArgumentError: ``cache_interval`` below 1 or ``cache_branch_id`` below 0 (a branch the UNet lacks is refused
            when the cache is enabled on a pipeline).
    """

    cache_interval: int = 3
    cache_branch_id: int = 0

    def __post_init__(self) -> None:
        for name, least in (("cache_interval", 1), ("cache_branch_id", 0)):
            value = getattr(self, name)
            if not is_integer(value):
                raise ArgumentTypeError(name, f"expected an integer ≥ {least}, got {type(value).__name__} {value!r}")
            if value < least:
                raise ArgumentError(name, f"expected an integer ≥ {least}, got {value}")


def deep_cache_for(denoiser: Any, config: Any) -> "DeepCache":
    """The DeepCache of a UNet denoiser (:class:`~.denoisers.UNetDenoiser`) for ``config``, over the parts beside
    its ``model.onnx``.

    Raises:
        ArgumentTypeError: ``config`` is not a :class:`DeepCacheConfig`.
        ArgumentError: a ControlNet or stream pipeline; a folder without the parts; a branch the UNet lacks.
    """
    pipe_name = type(denoiser.pipe).__name__
    if not isinstance(config, DeepCacheConfig):
        raise ArgumentTypeError(
            "config",
            f"expected optimum_iobinding.DeepCacheConfig(cache_interval=…, "
            f"cache_branch_id=…) for {pipe_name}, got {config_shown(config)}",
        )
    record = denoiser.pipe.family
    if record.step_cache != "deepcache":
        refused = REFUSAL_REASONS.get(record.key, f"the {record.title} family has no DeepCache")
        raise ArgumentError(
            "config",
            f"expected a Stable Diffusion 1.x/2.x, SDXL or LCM pipeline for DeepCache, got {pipe_name} ({refused})",
        )
    model = denoiser.model
    folder = Path(model.model_path).parent if getattr(model, "model_path", None) else None
    branches = {} if folder is None else deep_cache_shallow_parts(folder)
    if folder is None or not (folder / FULL_PART).is_file() or not branches:
        where = f"{folder}" if folder is not None else "the UNet's session (made outside a folder)"
        raise ArgumentError(
            "config",
            f"DeepCache runs the UNet's parts {FULL_PART} and {DEEP_CACHE_SHALLOW_PART.format(branch='<branch>')}, "
            f"but {where} lacks them; {EXPORT_HINT}",
        )
    branch = config.cache_branch_id
    if branch not in branches:
        raise ArgumentError("cache_branch_id", f"expected one of this UNet's branches {sorted(branches)}, got {branch}")
    return DeepCache(config, denoiser, model.part(folder / FULL_PART), model.part(branches[branch]))


class DeepCache(StepCache):
    """The UNet's step as DeepCache's parts (see the module docstring): the full part on the steps the schedule says,
    the shallow part over the kept feature on the others. ``feed_model`` is the full part: it takes the UNet's
    inputs, and its CUDA-graph input buffers exist from the loop's first step (a full one) on."""

    def __init__(self, config: DeepCacheConfig, denoiser: Any, full: IOBindingORTModel, shallow: IOBindingORTModel):
        super().__init__()
        self._config = config
        self.denoiser = denoiser
        self.full, self.shallow = full, shallow
        self.feed_model = full
        model = denoiser.model
        features = [name for name in shallow.input_names if name not in model.input_names]
        lacking = [
            name for name in shallow.input_names if name not in model.input_names and name not in full.output_names
        ]
        if (
            len(features) != 1
            or lacking
            or full.output_names[0] != model.output_names[0]
            or shallow.output_names[0] != model.output_names[0]
        ):
            raise ArgumentError(
                "config",
                f"the parts beside {model.model_path!r} do not fit together (the shallow "
                f"part takes {shallow.input_names}, the full part gives "
                f"{full.output_names}); {EXPORT_HINT}",
            )
        self.feature_name = features[0]
        self.feature: Optional[torch.Tensor] = None  # the kept feature: the last full step's
        self.full_steps: List[bool] = []

    @property
    def config(self) -> DeepCacheConfig:
        return self._config

    def schedule(self, steps: int) -> List[bool]:
        """Which of a loop's ``steps`` steps run whole: DeepCache's rule (the module docstring) over the loop's
        timesteps, the last ``steps`` of the scheduler's schedule (an image-to-image loop starts inside it)."""
        interval = self._config.cache_interval
        timesteps = [float(t) for t in torch.as_tensor(self.denoiser.pipe.scheduler.timesteps).tolist()]
        if len(timesteps) < steps:  # a loop not over the schedule's tail: steps are counted as they come
            return [step % interval == 0 for step in range(steps)]
        positions = [timesteps.index(t) for t in timesteps[len(timesteps) - steps :]]
        return [(position - positions[0]) % interval == 0 for position in positions]

    def start(self, steps: int, groups: int = 1) -> None:
        super().start(steps, groups)
        self.feature = None
        self.full_steps = self.schedule(steps)

    def __call__(self, step: int, inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
        whole = self.feature is None or (
            self.full_steps[step] if step < len(self.full_steps) else step % self._config.cache_interval == 0
        )
        self.computed.append(whole)
        if whole:
            outputs = dict(
                zip(self.full.output_names, self.full(**{name: inputs[name] for name in self.full.input_names}))
            )
            # the full part's output buffer: its next run (the next full step) is the next to write it
            self.feature = outputs[self.feature_name]
            return outputs[self.full.output_names[0]]
        values = {name: inputs[name] for name in self.shallow.input_names if name != self.feature_name}
        shapes = {
            **{name: tuple(value.shape) for name, value in values.items()},
            self.feature_name: tuple(self.feature.shape),
        }
        buffer = (self.shallow.graph_input_buffers(shapes) or {}).get(self.feature_name)
        if buffer is not None and buffer is not self.feature:
            # copied into the shallow graph's input once per full step; the shallow steps after read it in place
            buffer.copy_(self.feature, non_blocking=True)
            self.feature = buffer
        values[self.feature_name] = self.feature
        return self.shallow(**values)[0]

    @property
    def parts(self) -> List[IOBindingORTModel]:
        """The full and shallow models (for warm-up and benchmarks)."""
        return [self.full, self.shallow]
