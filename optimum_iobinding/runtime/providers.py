"""Execution providers by the names users give them: normalized into ORT's two aligned lists, checked against this
build, a short or misspelled name answered with ORT's own. Only onnxruntime is imported here, so that a command line
can check ``--provider`` before it imports torch."""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import onnxruntime as ort

from ..errors import ArgumentError, ArgumentTypeError, close_matches

DEFAULT_PROVIDER = "CPUExecutionProvider"  # as diffusers' ONNX pipelines
# Execution providers whose memory is a CUDA device that torch can address as ``cuda:N``; they get the diffusion
# defaults, the shared stream and CUDA graphs.
CUDA_LIKE_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")
# AMD GPUs: a ROCm build of torch addresses them as ``cuda:N`` too, so their tensors bind the same way (device type
# "cuda", the provider's device_id). Untested here (no AMD GPU): no shared stream or graphs — ORT runs on its own
# stream after the caller's stream is synchronized, as for a CUDA session created without user_compute_stream.
ROCM_LIKE_PROVIDERS = ("ROCMExecutionProvider", "MIGraphXExecutionProvider")
GPU_PROVIDERS = CUDA_LIKE_PROVIDERS + ROCM_LIKE_PROVIDERS
# Providers whose device memory torch cannot address: nothing to bind a data_ptr to.
UNBINDABLE_PROVIDERS = {
    "DmlExecutionProvider": (
        "DirectML device memory has no torch device, so torch tensors cannot be bound to it by data_ptr. Use "
        "io_binding=False (session.run on numpy arrays, which ORT copies to the DirectML device: what diffusers' and "
        "optimum's DirectML pipelines do), or CUDAExecutionProvider on NVIDIA / ROCMExecutionProvider or "
        "MIGraphXExecutionProvider on AMD GPUs with io_binding=True"
    ),
}

ProviderSpec = Union[str, Tuple[str, Dict[str, Any]], Sequence[Union[str, Tuple[str, Dict[str, Any]]]], None]
ProviderOptionsSpec = Union[Dict[str, Any], Sequence[Dict[str, Any]], None]


# ---------------------------------------------------------------------------------------------- single options
def normalize_providers(
    provider: ProviderSpec,
    provider_options: ProviderOptionsSpec = None,
    io_binding: bool = False,
) -> Tuple[List[str], List[Dict[str, str]]]:
    """Turns the ways users name providers into ORT's two aligned lists, and checks the build has them.

    ``provider`` may be one name, a ``(name, options)`` pair, or a list of either, as ``InferenceSession`` takes
    them; ``None`` means :data:`DEFAULT_PROVIDER`, as in diffusers. ``provider_options`` is one dict (for a single
    provider) or a list aligned with the providers; options given in pairs win over it. With ``io_binding`` a first
    provider whose memory torch cannot address (DirectML) is refused, saying what to use instead.
    """
    if provider is None:
        provider = DEFAULT_PROVIDER
    if isinstance(provider, str) or (
        isinstance(provider, tuple) and len(provider) == 2 and isinstance(provider[1], dict)
    ):
        provider = [provider]
    if not isinstance(provider, (list, tuple)):
        raise ArgumentTypeError(
            "provider",
            f"expected a provider name, a (name, options dict) pair or a list of them, "
            f"got {type(provider).__name__} {provider!r}",
        )
    if not provider:
        raise ArgumentError("provider", "expected at least one execution provider, got an empty list")
    names: List[str] = []
    options: List[Dict[str, Any]] = []
    for entry in provider:
        if isinstance(entry, str):
            names.append(entry)
            options.append({})
        elif isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str) and isinstance(entry[1], dict):
            names.append(entry[0])
            options.append(dict(entry[1]))
        else:
            raise ArgumentTypeError(
                "provider", f"expected a provider name or a (name, options dict) pair, got {entry!r}"
            )
    if provider_options is not None:
        if not isinstance(provider_options, (dict, list, tuple)) or (
            not isinstance(provider_options, dict) and not all(isinstance(o, dict) for o in provider_options)
        ):
            raise ArgumentTypeError("provider_options", f"expected a dict or a list of dicts, got {provider_options!r}")
        extra = [provider_options] if isinstance(provider_options, dict) else list(provider_options)
        if len(extra) != len(names):
            raise ValueError(
                f"provider_options: expected {len(names)} dict(s), one per provider {names}, got {len(extra)}"
            )
        options = [{**given, **paired} for given, paired in zip(extra, options)]
    check_bindable(names[0], io_binding)
    available = ort.get_available_providers()
    for name in names:
        if name not in available:
            raise ArgumentError("provider", unavailable_provider_reason(name, available))
    return names, [{key: str(value) for key, value in opts.items()} for opts in options]


def unavailable_provider_reason(name: str, available: Sequence[str]) -> str:
    """Why ``name`` cannot be used: a provider this build lacks (and how to get the CUDA ones), or a name that is no
    provider at all (a short name such as ``"cuda"``, a misspelling), then with the provider it likely means."""
    known = list(dict.fromkeys([*ort.get_all_providers(), *GPU_PROVIDERS, *UNBINDABLE_PROVIDERS]))
    reason = f"{name!r} is not available in this onnxruntime build"
    meant: Optional[str] = name
    if name not in known:
        meant = likely_provider(name, known)
        reason += f" (it is no execution provider onnxruntime knows{f'; did you mean {meant}?' if meant else ''})"
    if meant is not None and meant not in available and ("CUDA" in meant or "Tensorrt" in meant):
        reason += (
            f"; to use {meant} install onnxruntime-gpu in place of onnxruntime (both are the module onnxruntime): "
            "pip uninstall -y onnxruntime && pip install 'optimum-iobinding[gpu]'"
        )
    return f"{reason}; available: {list(available)}"


def likely_provider(name: str, known: Sequence[str]) -> Optional[str]:
    """The provider of ``known`` that ``name`` likely means, or ``None``: a short name (``"cuda"``, ``"tensorrt"``,
    ``"cpu"``: ORT's name without ``ExecutionProvider``, in any case), a misspelled one, or a misspelled full name."""
    stems = {
        provider[: -len("ExecutionProvider")].casefold(): provider
        for provider in known
        if provider.endswith("ExecutionProvider")
    }
    stem = re.split("execution", name, maxsplit=1, flags=re.IGNORECASE)[0].casefold()
    if stem in stems:
        return stems[stem]
    matches = close_matches(stem, stems, n=1, cutoff=0.75)
    if matches:
        return stems[matches[0]]
    if len(stem) < len(name):  # the suffix is there: the stem alone decides
        return None
    matches = close_matches(name, known, n=1, cutoff=0.85)  # the suffix misspelled too
    return matches[0] if matches else None


def check_bindable(first_provider: str, io_binding: bool) -> None:
    """With ``io_binding`` the first provider's memory must be one torch can address."""
    if io_binding and first_provider in UNBINDABLE_PROVIDERS:
        raise ArgumentError(
            "provider", f"{first_provider!r} with io_binding=True: {UNBINDABLE_PROVIDERS[first_provider]}"
        )
