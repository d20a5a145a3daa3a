"""What every denoising loop shares: the CUDA-graph input feed, step-end callbacks and their checks, guidance
rescaling. The loops themselves belong to the denoisers (:mod:`.denoisers`)."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

from ..errors import ArgumentError, ArgumentTypeError
from ..runtime.model import IOBindingORTModel

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
    try:
        if isinstance(tensor_inputs, (str, bytes)):
            raise TypeError
        names = list(tensor_inputs)
    except TypeError:
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
