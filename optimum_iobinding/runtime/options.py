"""Every option of a model and of a pipeline, validated and normalized once, and handed down as one object.

:class:`ModelOptions` holds what an :class:`~optimum_iobinding.IOBindingORTModel` is made with (providers and their
options, ``sess_options``, ``io_binding``, CUDA graphs, weight sharing, output reuse, the CUDA stream);
:class:`PipelineOptions` holds a pipeline's: one :class:`ModelOptions` for all its components, one CUDA stream, and
each component's own settings (``component_options``). Nothing below this module checks an option again: the
session recipe, the graph pool and the model read the resolved values.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import onnxruntime as ort
import torch

from .cuda_policy import with_diffusion_defaults, with_stream

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
CudaGraphSetting = Union[bool, str]

# the settings a model's sibling and a pipeline's component may set apart from the others
MODEL_SETTINGS = ("cuda_graph", "reuse_outputs", "max_output_signatures", "max_graph_signatures")
COMPONENT_SETTINGS = MODEL_SETTINGS + ("share_weights",)


# ---------------------------------------------------------------------------------------------- single options
def normalize_providers(
    provider: ProviderSpec,
    provider_options: ProviderOptionsSpec = None,
    io_binding: bool = False,
) -> Tuple[List[str], List[Dict[str, str]]]:
    """Turns the ways users name providers into ORT's two aligned lists, and checks the build has them.

    ``provider`` may be one name, a ``(name, options)`` pair, or a list of either, as ``InferenceSession`` takes
    them; ``None`` means ``"CPUExecutionProvider"``, as in diffusers. ``provider_options`` is one dict (for a single
    provider) or a list aligned with the providers; options given in pairs win over it. With ``io_binding`` a first
    provider whose memory torch cannot address (DirectML) is refused, saying what to use instead.
    """
    if provider is None:
        provider = "CPUExecutionProvider"
    if isinstance(provider, str) or (isinstance(provider, tuple) and len(provider) == 2 and isinstance(provider[1], dict)):
        provider = [provider]
    if not isinstance(provider, (list, tuple)):
        raise TypeError(f"provider: expected a provider name, a (name, options dict) pair or a list of them, "
                        f"got {type(provider).__name__} {provider!r}")
    if not provider:
        raise ValueError("provider: expected at least one execution provider, got an empty list")
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
            raise TypeError(f"provider: expected a provider name or a (name, options dict) pair, got {entry!r}")
    if provider_options is not None:
        if not isinstance(provider_options, (dict, list, tuple)) or (
                not isinstance(provider_options, dict) and not all(isinstance(o, dict) for o in provider_options)):
            raise TypeError(f"provider_options: expected a dict or a list of dicts, got {provider_options!r}")
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
            hint = " (install onnxruntime-gpu: pip install 'optimum-iobinding[gpu]')" if "CUDA" in name or "Tensorrt" in name else ""
            raise ValueError(f"provider: {name!r} is not available in this onnxruntime build{hint}; available: {available}")
    return names, [{key: str(value) for key, value in opts.items()} for opts in options]


def check_bindable(first_provider: str, io_binding: bool) -> None:
    """With ``io_binding`` the first provider's memory must be one torch can address."""
    if io_binding and first_provider in UNBINDABLE_PROVIDERS:
        raise ValueError(f"provider: {first_provider!r} with io_binding=True: {UNBINDABLE_PROVIDERS[first_provider]}")


def provider_device(providers: Sequence[str], provider_options: Sequence[Mapping[str, Any]]) -> torch.device:
    """The torch device where the first execution provider keeps its tensors."""
    if providers[0] in GPU_PROVIDERS:
        return torch.device("cuda", int((provider_options[0] if provider_options else {}).get("device_id", 0)))
    return torch.device("cpu")


def check_sess_options(sess_options: Any) -> Optional[ort.SessionOptions]:
    if sess_options is not None and not isinstance(sess_options, ort.SessionOptions):
        raise TypeError(f"sess_options: expected an onnxruntime.SessionOptions or None, got "
                        f"{type(sess_options).__name__} {sess_options!r}")
    return sess_options


def check_cuda_graph_setting(value: Any) -> CudaGraphSetting:
    if value is True or value is False or value == "auto":
        return value
    raise ValueError(f"cuda_graph: expected 'auto', True or False, got {value!r}")


def _check_settings(settings: Mapping[str, Any]) -> None:
    """The model-level settings among ``settings``, each checked by the one rule that applies to it."""
    if "io_binding" in settings and not isinstance(settings["io_binding"], bool):
        raise TypeError(f"io_binding: expected True or False, got {settings['io_binding']!r}")
    if "reuse_outputs" in settings and not isinstance(settings["reuse_outputs"], bool):
        raise TypeError(f"reuse_outputs: expected True or False, got {settings['reuse_outputs']!r}")
    if "cuda_graph" in settings:
        check_cuda_graph_setting(settings["cuda_graph"])
    value = settings.get("max_output_signatures", 1)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"max_output_signatures: expected an integer ≥ 1, got {value!r}")
    value = settings.get("max_graph_signatures")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"max_graph_signatures: expected None or an integer ≥ 1, got {value!r}")
    value = settings.get("share_weights")
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"share_weights: expected None, True or False, got {value!r}")


# ---------------------------------------------------------------------------------------------------- a model
@dataclass(frozen=True)
class ModelOptions:
    """How a model runs, resolved once (:meth:`resolve`, :meth:`of_session`); see
    :class:`~optimum_iobinding.IOBindingORTModel` for each setting's meaning.

    Attributes:
        providers, provider_options: ORT's aligned lists; on a CUDA-like first provider with binding the options
            hold the diffusion defaults (under the user's own) and the stream (``user_compute_stream``).
        stream: the CUDA stream every session of the model runs on (``None`` off CUDA, without binding, or for a
            session made elsewhere without ``user_compute_stream``).
        share_weights: ``True``, ``False``, or ``None`` (own the weights on first need), already narrowed to
            ``False`` where no graph pool can need them.
    """

    providers: Tuple[str, ...]
    provider_options: Tuple[Dict[str, str], ...]
    sess_options: Optional[ort.SessionOptions] = None
    io_binding: bool = True
    reuse_outputs: bool = True
    max_output_signatures: int = 8
    cuda_graph: CudaGraphSetting = "auto"
    max_graph_signatures: Optional[int] = None
    share_weights: Optional[bool] = None
    stream: Optional["torch.cuda.Stream"] = field(default=None, compare=False)

    @classmethod
    def resolve(
        cls,
        provider: ProviderSpec = None,
        provider_options: ProviderOptionsSpec = None,
        sess_options: Optional[ort.SessionOptions] = None,
        io_binding: bool = True,
        reuse_outputs: bool = True,
        max_output_signatures: int = 8,
        cuda_graph: CudaGraphSetting = "auto",
        max_graph_signatures: Optional[int] = None,
        share_weights: Optional[bool] = None,
        stream: Optional["torch.cuda.Stream"] = None,
    ) -> "ModelOptions":
        """Checks every option (errors name it, say what was expected and what came) and normalizes the providers:
        on a CUDA-like first provider with ``io_binding``, the diffusion defaults go under the user's options and
        the sessions run on ``stream`` (a new one where none is given)."""
        _check_settings(dict(io_binding=io_binding, reuse_outputs=reuse_outputs, cuda_graph=cuda_graph,
                             max_output_signatures=max_output_signatures, max_graph_signatures=max_graph_signatures,
                             share_weights=share_weights))
        check_sess_options(sess_options)
        providers, options = normalize_providers(provider, provider_options, io_binding)
        cuda_like = io_binding and providers[0] in CUDA_LIKE_PROVIDERS
        if stream is not None and not cuda_like:
            raise ValueError(f"stream: a CUDA stream needs a CUDA-like provider with io_binding=True, got "
                             f"{providers[0]!r} with io_binding={io_binding}")
        device = provider_device(providers, options)
        if io_binding and device.type == "cpu" and providers[0] != "CPUExecutionProvider":
            raise ValueError(f"provider: IOBindingORTModel binds torch tensors on CPU or CUDA devices; "
                             f"{providers[0]!r} is neither (use CUDAExecutionProvider or CPUExecutionProvider, or "
                             "io_binding=False)")
        if cuda_like:
            options = with_diffusion_defaults(providers, options)
            if stream is None:
                stream = torch.cuda.Stream(device)
            options = with_stream(providers, options, stream)
        if share_weights is None and not cuda_like:
            share_weights = False  # no graph pool can need a second session's copy of the weights
        return cls(tuple(providers), tuple(options), sess_options, io_binding, reuse_outputs, max_output_signatures,
                   cuda_graph, max_graph_signatures, share_weights, stream)

    @classmethod
    def of_session(cls, session: ort.InferenceSession, io_binding: bool = True, **settings: Any) -> "ModelOptions":
        """The options a session made elsewhere runs with (its providers and stream, as far as ORT tells them),
        with the model-level ``settings``; its weights are its own (``share_weights=False``)."""
        _check_settings(dict(io_binding=io_binding, **settings))
        if settings.get("stream") is not None:
            raise ValueError("stream: a stream is set when a session is created; pass a path (or create the session "
                             "with the provider option user_compute_stream) instead of a session")
        settings.pop("stream", None)
        settings.pop("share_weights", None)
        providers = session.get_providers()
        by_name = session.get_provider_options()
        options = [dict(by_name.get(name, {})) for name in providers]
        check_bindable(providers[0], io_binding)
        device = provider_device(providers, options)
        if io_binding and device.type == "cpu" and providers[0] != "CPUExecutionProvider":
            raise ValueError(f"provider: IOBindingORTModel binds torch tensors on CPU or CUDA devices; "
                             f"{providers[0]!r} is neither (use CUDAExecutionProvider or CPUExecutionProvider, or "
                             "io_binding=False)")
        stream = None
        handle = options[0].get("user_compute_stream")
        if io_binding and providers[0] in CUDA_LIKE_PROVIDERS and handle and int(handle) != 0:
            stream = torch.cuda.ExternalStream(int(handle), device=device)
        return cls(tuple(providers), tuple(options), getattr(session, "_sess_options", None), io_binding,
                   share_weights=False, stream=stream, **settings)

    def replace(self, **settings: Any) -> "ModelOptions":
        """These options with some model-level ``settings`` changed (a sibling's, a component's), checked."""
        unknown = sorted(set(settings) - set(COMPONENT_SETTINGS))
        if unknown:
            raise TypeError(f"settings: expected names among {list(COMPONENT_SETTINGS)}, got {unknown}")
        _check_settings(settings)
        if settings.get("share_weights", self.share_weights) is None and not self.cuda_like:
            settings["share_weights"] = False
        return dataclasses.replace(self, **settings)

    @property
    def device(self) -> torch.device:
        """``cuda:N`` for the CUDA-like and ROCm-like providers, ``cpu`` otherwise."""
        return provider_device(self.providers, self.provider_options)

    @property
    def cuda_like(self) -> bool:
        """Whether the model binds on a CUDA-like provider: the diffusion defaults, one stream, CUDA graphs."""
        return self.io_binding and self.providers[0] in CUDA_LIKE_PROVIDERS

    def settings(self) -> Dict[str, Any]:
        """The model-level settings, by name (what a sibling inherits)."""
        return {name: getattr(self, name) for name in MODEL_SETTINGS}


# ------------------------------------------------------------------------------------------------- a pipeline
_EXTRA_CONTROLNET = re.compile(r"controlnet_[1-9][0-9]*")


@dataclass(frozen=True)
class PipelineOptions:
    """A pipeline's options, resolved once before anything is downloaded or loaded: one :class:`ModelOptions` for
    every component (one CUDA stream for all of them and the loop's torch ops), and each component's own settings.

    Attributes:
        model: what every component shares.
        component_options: component → its own settings (checked), over the pipeline-wide ones.
    """

    model: ModelOptions
    component_options: Dict[str, Dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def resolve(
        cls,
        components: Sequence[str],
        provider: ProviderSpec = None,
        provider_options: ProviderOptionsSpec = None,
        sess_options: Optional[ort.SessionOptions] = None,
        io_binding: bool = True,
        cuda_graph: CudaGraphSetting = "auto",
        component_options: Optional[Dict[str, Dict[str, Any]]] = None,
    ) -> "PipelineOptions":
        """Checks every option, the per-component ones included, against the pipeline's ``components``."""
        check_cuda_graph_setting(cuda_graph)
        given = dict(component_options or {})
        if not all(isinstance(value, dict) for value in given.values()):
            raise TypeError(f"component_options: expected a dict of dicts (component → settings), got {given!r}")
        unknown = sorted(name for name in set(given) - set(components)
                         if not (_EXTRA_CONTROLNET.fullmatch(name) and "controlnet" in components))
        if unknown:
            raise ValueError(f"component_options: expected components among {list(components)}, got {unknown}")
        for name, settings in given.items():
            wrong = sorted(set(settings) - set(COMPONENT_SETTINGS))
            if wrong:
                raise ValueError(f"component_options[{name!r}]: expected settings among {list(COMPONENT_SETTINGS)}, "
                                 f"got {wrong}")
            try:
                _check_settings(settings)
            except (TypeError, ValueError) as error:
                raise type(error)(f"component_options[{name!r}]: {error}") from None
        model = ModelOptions.resolve(provider, provider_options, sess_options, io_binding, cuda_graph=cuda_graph)
        return cls(model, {name: dict(settings) for name, settings in given.items()})

    def for_component(self, name: str) -> ModelOptions:
        """The options of component ``name``: the pipeline's, with its own settings over them. ``cuda_graph=True``
        keeps its meaning from before graphs were the default: the UNet must be captured (a fallback warns); the
        other components capture where they can, silently."""
        default = self.model.cuda_graph if self.model.cuda_graph is not True or name == "unet" else "auto"
        own = self.component_options.get(name)
        if own is None and name.startswith("controlnet_"):
            own = self.component_options.get("controlnet")
        return self.model.replace(**{"cuda_graph": default, **(own or {})})

    @property
    def stream(self) -> Optional["torch.cuda.Stream"]:
        return self.model.stream
