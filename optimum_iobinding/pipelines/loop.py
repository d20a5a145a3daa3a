"""The one denoising loop (:func:`denoise`) every family runs, and what it stands on: the CUDA-graph input feed,
step-end callbacks and their checks, guidance and its rescaling.

The loop is a skeleton; a denoiser (:mod:`.denoisers`: UNet, MMDiT, FLUX.1, Wan) fills it through named hooks — the
name of its latent input, how a step scales it, its timestep input, how its conditioning inputs are made from the
loop's tensors, the axis of its channels — and a family adds per-call hooks by keyword: extra input channels (an
inpainting UNet's mask and masked image, FLUX.1 Fill's and Control's conditioning latents), extra tokens whose
prediction is sliced off (FLUX.1 Kontext's reference image), per-step inputs (a ControlNet's residuals), an after-step
(inpainting's blending), the guidance mode (:class:`Guidance`), later stages run by another model at another guidance
scale (:class:`Stage`: Wan 2.2's low-noise expert), the step cache (the denoiser's, enabled on the pipeline). The
real-time stream does not run it: its frame is a fixed few-step schedule whose scheduler arithmetic is precomputed once
per stream and captured with the UNet (:mod:`.stream_plan`), where this loop asks the scheduler at every step."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch

from ..errors import ArgumentError, ArgumentTypeError
from ..runtime.model import IOBindingORTModel
from .arguments import is_real
from .linear_steps import LinearSteps

# The loop's tensors a step-end callback may ask for (callback_on_step_end_tensor_inputs) and give back replaced.
CALLBACK_TENSOR_INPUTS = ("latents", "prompt_embeds")


def check_callback_arguments(
    callback_on_step_end: Any, tensor_inputs: Any, allowed: Sequence[str] = CALLBACK_TENSOR_INPUTS
) -> None:
    """Refuses, before any work, a step-end callback that is not callable and tensor names the loop does not have
    (``allowed``: the ones it has), listing the ones it has (as diffusers refuses them)."""
    if callback_on_step_end is not None and not callable(callback_on_step_end):
        raise ArgumentTypeError(
            "callback_on_step_end",
            f"expected a callable (pipe, step, timestep, tensors) -> dict, got "
            f"{type(callback_on_step_end).__name__} {callback_on_step_end!r}",
        )
    names = None
    if not isinstance(tensor_inputs, (str, bytes)):
        try:
            names = list(tensor_inputs)
        except TypeError:
            pass
    if names is None:
        raise ArgumentTypeError(
            "callback_on_step_end_tensor_inputs",
            f"expected a list of tensor names among "
            f"{list(allowed)}, got {type(tensor_inputs).__name__} {tensor_inputs!r}",
        ) from None
    unknown = [name for name in names if not isinstance(name, str) or name not in allowed]
    if unknown:
        raise ArgumentError(
            "callback_on_step_end_tensor_inputs", f"expected names among {list(allowed)}, got {unknown}"
        )


def callback_name(callback: Any) -> str:
    return getattr(callback, "__qualname__", None) or type(callback).__name__


def replaced_tensors(
    callback: Any,
    step: int,
    returned: Any,
    current: Mapping[str, torch.Tensor],
    allowed: Sequence[str] = CALLBACK_TENSOR_INPUTS,
) -> Dict[str, torch.Tensor]:
    """The loop's tensors after a step-end callback: ``current``, with what the callback returned in place of them.

    A callback returns a dict (or ``None``: nothing replaced) whose keys are among ``allowed`` (the loop's tensors
    a callback may replace, by default :data:`CALLBACK_TENSOR_INPUTS`) and whose values are float torch tensors of the replaced tensor's shape. One on another device or of another
    float dtype is moved and cast (as the loop's own would be); anything else is refused, naming the callback, the
    step and the key — a numpy array included (diffusers' loop takes tensors only)."""
    if returned is None:
        return dict(current)
    name = callback_name(callback)
    if not isinstance(returned, Mapping):
        raise ArgumentTypeError(
            "callback_on_step_end",
            f"expected {name} to return a dict of tensors (or None), got {type(returned).__name__} at step {step}",
        )
    unknown = [key for key in returned if key not in allowed]
    if unknown:
        raise ArgumentError(
            "callback_on_step_end",
            f"expected {name} to return keys among {list(allowed)}, got {unknown} at step {step}",
        )
    result = dict(current)
    for key, value in returned.items():
        old = current[key]
        expected = f"a float torch.Tensor of shape {tuple(old.shape)}"
        if not isinstance(value, torch.Tensor):
            raise ArgumentTypeError(
                "callback_on_step_end",
                f"{name} returned {key!r} as {type(value).__name__} at step {step}, expected {expected}",
            )
        if value.layout != torch.strided or value.is_nested or not value.dtype.is_floating_point:
            raise ArgumentTypeError(
                "callback_on_step_end",
                f"{name} returned {key!r} of dtype {value.dtype} and layout "
                f"{value.layout} at step {step}, expected {expected}",
            )
        if tuple(value.shape) != tuple(old.shape):
            raise ArgumentError(
                "callback_on_step_end",
                f"{name} returned {key!r} of shape {tuple(value.shape)} at step {step}, expected {expected}",
            )
        result[key] = value.to(device=old.device, dtype=old.dtype)
    return result


def rescale_noise_cfg(noise_cfg: torch.Tensor, noise_pred_text: torch.Tensor, guidance_rescale: float) -> torch.Tensor:
    """Guided noise rescaled to the text branch's per-sample standard deviation, mixed back by ``guidance_rescale``
    (the correction of "Common Diffusion Noise Schedules and Sample Steps are Flawed", as diffusers applies it)."""
    dims = list(range(1, noise_pred_text.ndim))
    std_text = noise_pred_text.std(dim=dims, keepdim=True)
    std_cfg = noise_cfg.std(dim=dims, keepdim=True)
    rescaled = noise_cfg * (std_text / std_cfg)
    return guidance_rescale * rescaled + (1 - guidance_rescale) * noise_cfg


class GraphFeed:
    """Writes a denoising loop's UNet inputs straight into the tensors the UNet's CUDA graph reads them from
    (:meth:`IOBindingORTModel.graph_input_buffers`), where the loop's input shapes have a graph: the guidance batch
    is concatenated into the graph's ``sample`` input, and the inputs that stay the same over the loop (the prompt
    embeddings, SDXL's conditioning) are copied in once instead of once a step.

    A step of the captured loop is the UNet graph plus a few small kernels (the guidance batch, guidance, the
    scheduler's update, the graph's input copies). Each one saved shortens the step on the GPU, where a small UNet's
    step is not much longer than those kernels together.
    Where the shapes have no graph (off CUDA, ``cuda_graph=False``, a graph ORT refused) it changes nothing. The
    buffers are looked up once, after the loop's first call (a signature's graph exists from its first call on).
    A constant input is copied again when the loop passes another tensor, and after every step callback (which may
    have changed it in place: torch's version counter cannot say so under ``torch.inference_mode``)."""

    def __init__(self, model: Optional[IOBindingORTModel]):
        self.model = model
        self.buffers: Optional[Dict[str, torch.Tensor]] = None
        self.looked_up = False
        self.held: Dict[str, torch.Tensor] = {}  # input → the tensor whose values its buffer holds

    def learn(self, inputs: Dict[str, torch.Tensor]) -> None:
        """After the loop's first call: the graph buffers of its input shapes, if any."""
        if not self.looked_up:
            self.looked_up = True
            if isinstance(self.model, IOBindingORTModel):
                self.buffers = self.model.graph_input_buffers(
                    {name: tuple(value.shape) for name, value in inputs.items()}
                )

    def _buffer(
        self, name: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device
    ) -> Optional[torch.Tensor]:
        buffer = (self.buffers or {}).get(name)
        if buffer is None or tuple(buffer.shape) != tuple(shape) or buffer.dtype != dtype or buffer.device != device:
            return None
        return buffer

    def cat(self, name: str, tensors: List[torch.Tensor], dim: int = 0) -> torch.Tensor:
        """``torch.cat(tensors, dim)``, written into the graph's ``name`` input where there is one to take it."""
        shape = list(tensors[0].shape)
        shape[dim] = sum(tensor.shape[dim] for tensor in tensors)
        first = tensors[0]
        same_kind = all(tensor.dtype == first.dtype and tensor.device == first.device for tensor in tensors)
        buffer = self._buffer(name, shape, first.dtype, first.device) if same_kind else None
        if buffer is None:
            return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim)
        self.held.pop(name, None)
        return torch.cat(tensors, dim, out=buffer)

    def same(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The graph's ``name`` input holding ``tensor``'s values: copied in unless it holds this very tensor's
        already (copied since the last :meth:`forget`)."""
        if not isinstance(tensor, torch.Tensor):
            return tensor
        buffer = self._buffer(name, tensor.shape, tensor.dtype, tensor.device)
        if buffer is None:
            return tensor
        if self.held.get(name) is not tensor:
            buffer.copy_(tensor, non_blocking=True)
            self.held[name] = tensor
        return buffer

    def forget(self) -> None:
        """Code outside the loop ran (a step callback) and may have changed any input in place: copy them again."""
        self.held.clear()


@dataclass(frozen=True)
class Guidance:
    """How a loop guides its prediction.

    Attributes:
        scale: the guidance scale.
        batched: classifier-free guidance in one batch — the negative rows, then the positive ones: the latents go in
            twice and the prediction is ``uncond + scale · (text − uncond)`` (SD's CFG, FLUX.1's true CFG). Otherwise
            the prediction is used as it comes: no guidance, or guidance embedded as a model input that the family
            feeds with the others (LCM's ``timestep_cond``, FLUX.1 dev's ``guidance``).
        rescale: diffusers' ``guidance_rescale`` (rescales the guided prediction towards the text branch's standard
            deviation, "Common Diffusion Noise Schedules and Sample Steps are Flawed" §3.4).
    """

    scale: float = 1.0
    batched: bool = False
    rescale: float = 0.0

    @classmethod
    def classifier_free(cls, scale: float, rescale: float = 0.0) -> "Guidance":
        """Classifier-free guidance where ``scale > 1`` (as diffusers decides), none otherwise.

        Raises:
            ArgumentError: ``rescale`` (``guidance_rescale``) is not a number in [0, 1]."""
        if not is_real(rescale) or not 0.0 <= rescale <= 1.0:
            raise ArgumentError("guidance_rescale", f"expected a number in [0, 1], got {rescale!r}")
        return cls(float(scale), bool(math.isfinite(scale) and scale > 1.0), float(rescale))

    @property
    def copies(self) -> int:
        """How many times the latents go into the model per step."""
        return 2 if self.batched else 1

    def apply(self, prediction: torch.Tensor) -> torch.Tensor:
        """The guided prediction of a batched call's output (negative rows, then positive)."""
        uncond, text = prediction.chunk(2)
        # uncond + scale * (text - uncond) in one kernel (diffusers' three)
        guided = torch.lerp(uncond, text, self.scale)
        return rescale_noise_cfg(guided, text, self.rescale) if self.rescale > 0.0 else guided


@dataclass(frozen=True)
class Stage:
    """A later stage of a loop: from step ``start`` on, the loop calls ``model`` (the pipeline's other denoiser of the
    same inputs: Wan 2.2's low-noise expert) and guides its prediction by ``guidance``, which batches as the first
    stage's does (the conditioning is made once; only the scale changes: diffusers guides both of Wan 2.2's experts
    where the first guidance scale is above 1)."""

    start: int
    model: Any
    guidance: Guidance


StepInputs = Callable[[int, torch.Tensor, torch.Tensor], Dict[str, torch.Tensor]]


def denoise(
    denoiser: Any,
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    *,
    tensors: Mapping[str, torch.Tensor],
    guidance: Guidance,
    inputs: Optional[Mapping[str, torch.Tensor]] = None,
    step_kwargs: Optional[Mapping[str, Any]] = None,
    callback: Optional[Callable[[int, Any, torch.Tensor], None]] = None,
    callback_steps: int = 1,
    callback_on_step_end: Optional[Callable[..., Any]] = None,
    callback_on_step_end_tensor_inputs: Sequence[str] = ("latents",),
    extra_channels: Optional[torch.Tensor] = None,
    extra_tokens: Optional[torch.Tensor] = None,
    step_inputs: Optional[StepInputs] = None,
    after_step: Optional[Callable[[int, torch.Tensor], torch.Tensor]] = None,
    stages: Sequence[Stage] = (),
    return_denoised: bool = False,
) -> torch.Tensor:
    """The denoising loop: per step the denoiser's model (or its enabled step cache), guidance, the scheduler's step,
    the step-end callbacks. Every tensor stays on the pipeline's device and nothing makes the host wait: the latent
    batch is written straight into the model's CUDA-graph input, the conditioning copied into its inputs once
    (:class:`GraphFeed`), the timesteps made once on the device.

    Args:
        denoiser: the pipeline's denoiser part; its hooks: ``sample_input`` (the latents' input name),
            ``channel_dim`` (the axis of the latents' channels), ``scale_model_input(latents, t)``,
            ``timestep_inputs(timesteps, rows, latent_shape)``, ``conditioning(tensors, guidance)`` (its
            conditioning inputs from the loop's tensors), ``copies_unguided_output``, ``step_model``.
        latents: the initial latents (scaled by the scheduler's initial sigma, or noised).
        timesteps: the scheduler's timesteps to run (its timesteps set).
        tensors: the loop's tensors beside the latents that its conditioning is made of (``prompt_embeds`` and the
            family's others, ``[negative; positive]`` where the denoiser expects them so); a step-end callback may ask
            for and replace those the family allows.
        guidance: how the prediction is guided (:class:`Guidance`).
        inputs: further model inputs, the same every step (SDXL's ``text_embeds`` and ``time_ids``, LCM's
            ``timestep_cond``, FLUX.1's position ids and ``guidance``), already batched for guidance.
        step_kwargs: the scheduler step's keyword arguments (``eta``, a generator).
        callback, callback_steps: diffusers' legacy ``callback(step, t, latents)`` every ``callback_steps`` steps.
        callback_on_step_end, callback_on_step_end_tensor_inputs: diffusers' step-end callback and the tensors it
            gets (checked by the pipeline before any work).
        extra_channels: concatenated to the scaled latents on the channels (the denoiser's ``channel_dim``: an
            inpainting UNet's mask and masked image latents; FLUX.1 Fill's packed masked image latents and mask,
            FLUX.1 Control's packed control image latents), already batched for guidance.
        extra_tokens: packed tokens appended after the latent tokens (dim 1: FLUX.1 Kontext's reference image
            latents), already batched for guidance; the model's prediction for them is sliced off before guidance and
            the scheduler step.
        step_inputs: ``step_inputs(i, model_input, prompt_embeds) -> {name: tensor}``: further inputs made each step
            from the scaled model input (a ControlNet's residuals).
        after_step: ``after_step(i, latents) -> latents`` after each scheduler step (inpainting's blending).
        stages: the loop's later stages (:class:`Stage`), each from its ``start`` step on: another model of the same
            inputs at another guidance scale (Wan 2.2's low-noise expert), through the step cache where it runs
            that model too (:meth:`~.caching.StepCache.switch`).
        return_denoised: return the last step's denoised prediction (the second output of ``LCMScheduler.step``),
            as diffusers' LCM pipeline decodes, instead of its next sample.

    Returns:
        The denoised latents.
    """
    scheduler = denoiser.pipe.scheduler
    denoiser.pipe.prepare_decode(latents)  # the VAE decoder's first run, beside the loop
    tensors = dict(tensors)
    constant = dict(inputs or {})
    step_kwargs = dict(step_kwargs or {})
    sample = denoiser.sample_input
    timestep_rows = denoiser.timestep_inputs(timesteps, latents.shape[0] * guidance.copies, tuple(latents.shape))
    run, fed = denoiser.step_model(len(timesteps), guidance=guidance)
    feed = GraphFeed(fed)
    conditioning = denoiser.conditioning(tensors, guidance)
    later = {stage.start: stage for stage in stages}
    if any(stage.guidance.copies != guidance.copies for stage in stages):
        raise ArgumentError(
            "stages", "expected guidance that batches as the first stage's (the conditioning is made once)"
        )
    # a scheduler whose own step makes the host wait (UniPC) runs as its traced linear maps (:mod:`.linear_steps`)
    traced = None if return_denoised else LinearSteps.of(scheduler, timesteps, step_kwargs)
    denoised = latents
    for i, t in enumerate(denoiser.pipe.progress_bar(timesteps)):
        if i in later:  # another model from this step on: its own run and graph feed
            run, fed = denoiser.step_model(len(timesteps) - i, later[i].model)
            feed = GraphFeed(fed)
            guidance = later[i].guidance
        # scaled before the guidance batch is made (an elementwise scale by the step's scalar: the same values), so
        # that the batch can be written straight into the model graph's input
        scaled = denoiser.scale_model_input(latents, t)
        copies = [scaled] * guidance.copies
        if extra_channels is None and extra_tokens is None:
            model_input = feed.cat(sample, copies)
        else:
            model_input = torch.cat(copies) if guidance.batched else scaled
        per_step = step_inputs(i, model_input, tensors["prompt_embeds"]) if step_inputs is not None else {}
        if extra_channels is not None:
            parts = [model_input, extra_channels]
            channels = denoiser.channel_dim
            model_input = torch.cat(parts, channels) if extra_tokens is not None else feed.cat(sample, parts, channels)
        if extra_tokens is not None:
            model_input = feed.cat(sample, [model_input, extra_tokens], dim=1)
        step = {
            sample: model_input,
            "timestep": timestep_rows[i],
            **{name: feed.same(name, value) for name, value in conditioning.items()},
            **{name: feed.same(name, value) for name, value in constant.items()},
            **per_step,
        }
        prediction = run(i, step)
        feed.learn(step)
        if extra_tokens is not None:  # the prediction of the latent tokens only (a view: no copy)
            prediction = prediction[:, : latents.shape[1]]
        if guidance.batched:
            prediction = guidance.apply(prediction)
        elif denoiser.copies_unguided_output:
            # multistep schedulers keep model outputs across steps: never hand them the model's reused buffer
            prediction = prediction.clone()
        if traced is not None:
            latents = traced.step(i, prediction, latents)
        else:
            output = scheduler.step(prediction, t, latents, **step_kwargs, return_dict=False)
            latents = output[0]
            if return_denoised:
                denoised = output[1]
        if after_step is not None:
            latents = after_step(i, latents)
        if callback is not None and i % callback_steps == 0:
            callback(i // getattr(scheduler, "order", 1), t, latents)
            feed.forget()
        if callback_on_step_end is not None:
            replaced = denoiser.step_end(
                callback_on_step_end, callback_on_step_end_tensor_inputs, i, t, {"latents": latents, **tensors}, feed
            )
            latents = replaced.pop("latents")
            if any(replaced[name] is not value for name, value in tensors.items()):
                tensors = replaced
                conditioning = denoiser.conditioning(tensors, guidance)
    return denoised if return_denoised else latents
