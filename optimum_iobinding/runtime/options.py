"""Every option of a model and of a pipeline, with its default, validated and normalized once, and handed down as
one object.

:class:`ModelOptions` declares what an :class:`~optimum_iobinding.IOBindingORTModel` is made with, each setting with
its default and its doc (providers and their options, ``sess_options``, ``io_binding``, CUDA graphs, weight sharing,
output reuse, the CUDA stream); a setting given as a keyword defaults to :data:`NOT_GIVEN`, which
:meth:`ModelOptions.resolve` fills from there;
:class:`PipelineOptions` holds a pipeline's: one :class:`ModelOptions` for all its components, one CUDA stream, and
each component's own settings (``component_options``). Nothing below this module checks an option again: the
session recipe, the graph pool and the model read the resolved values.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import onnxruntime as ort
import torch

from ..errors import ArgumentError, ArgumentTypeError
from .cuda_policy import with_diffusion_defaults, with_stream
from .providers import (
    CUDA_LIKE_PROVIDERS,
    DEFAULT_PROVIDER,
    GPU_PROVIDERS,
    ProviderOptionsSpec,
    ProviderSpec,
    check_bindable,
    normalize_providers,
)

CudaGraphSetting = Union[bool, str]

# the settings a model's sibling and a pipeline's component may set apart from the others
MODEL_SETTINGS = ("cuda_graph", "reuse_outputs", "max_output_signatures", "max_graph_signatures")
COMPONENT_SETTINGS = MODEL_SETTINGS + ("share_weights",)
# every setting a model takes as a keyword (ModelOptions.resolve's, in its order)
MODEL_KEYWORDS = (
    "provider",
    "provider_options",
    "sess_options",
    "io_binding",
    "reuse_outputs",
    "max_output_signatures",
    "cuda_graph",
    "max_graph_signatures",
    "share_weights",
    "stream",
)


def provider_device(providers: Sequence[str], provider_options: Sequence[Mapping[str, Any]]) -> torch.device:
    """The torch device where the first execution provider keeps its tensors."""
    if providers[0] in GPU_PROVIDERS:
        return torch.device("cuda", int((provider_options[0] if provider_options else {}).get("device_id", 0)))
    return torch.device("cpu")


def check_sess_options(sess_options: Any) -> Optional[ort.SessionOptions]:
    if sess_options is not None and not isinstance(sess_options, ort.SessionOptions):
        raise ArgumentTypeError(
            "sess_options",
            f"expected an onnxruntime.SessionOptions or None, got {type(sess_options).__name__} {sess_options!r}",
        )
    return sess_options


def check_cuda_graph_setting(value: Any) -> CudaGraphSetting:
    if value is True or value is False or value == "auto":
        return value
    raise ArgumentError("cuda_graph", f"expected 'auto', True or False, got {value!r}")


def _check_settings(settings: Mapping[str, Any]) -> None:
    """The model-level settings among ``settings``, each checked by the one rule that applies to it."""
    if "io_binding" in settings and not isinstance(settings["io_binding"], bool):
        raise ArgumentTypeError("io_binding", f"expected True or False, got {settings['io_binding']!r}")
    if "reuse_outputs" in settings and not isinstance(settings["reuse_outputs"], bool):
        raise ArgumentTypeError("reuse_outputs", f"expected True or False, got {settings['reuse_outputs']!r}")
    if "cuda_graph" in settings:
        check_cuda_graph_setting(settings["cuda_graph"])
    if "max_output_signatures" in settings:
        value = settings["max_output_signatures"]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ArgumentError("max_output_signatures", f"expected an integer ≥ 1, got {value!r}")
    value = settings.get("max_graph_signatures")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ArgumentError("max_graph_signatures", f"expected None or an integer ≥ 1, got {value!r}")
    value = settings.get("share_weights")
    if value is not None and not isinstance(value, bool):
        raise ArgumentTypeError("share_weights", f"expected None, True or False, got {value!r}")


# ---------------------------------------------------------------------------------------------------- a model
class _NotGiven:
    """The default of every setting given as a keyword: "not given", so that its value comes from the one place
    defaults are written, :class:`ModelOptions`."""

    _instance: Optional["_NotGiven"] = None

    def __new__(cls) -> "_NotGiven":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "NOT_GIVEN"

    def __reduce__(self) -> str:
        return "NOT_GIVEN"


NOT_GIVEN: Any = _NotGiven()


def given_settings(**settings: Any) -> Dict[str, Any]:
    """The settings a caller actually gave: those not :data:`NOT_GIVEN`, and for ``provider`` and
    ``provider_options`` those not ``None`` either (``None`` asks for their default)."""
    return {
        name: value
        for name, value in settings.items()
        if value is not NOT_GIVEN and not (value is None and name in ("provider", "provider_options"))
    }


@dataclass(frozen=True)
class ModelOptions:
    """Every setting of an :class:`~optimum_iobinding.IOBindingORTModel`, with its default and its meaning, declared
    once. A model is given either these options (what pipelines pass) or the settings as keywords
    (``IOBindingORTModel.from_pretrained(path, provider=..., cuda_graph=...)``); a keyword not given takes the
    default below. :meth:`resolve` checks the settings (each error names its setting, says what was expected and
    what came) and normalizes the providers, once; nothing below it checks an option again.

    Attributes:
        providers: the execution providers, in ORT's order, given as ``provider``: a name, a ``(name, options)``
            pair or a list of them; not given or ``None``: ``"CPUExecutionProvider"`` (as in diffusers).
        provider_options: one dict per provider, given as ``provider_options`` (one dict for a single provider, or
            a list aligned with the providers; options given in pairs win). On a CUDA-like first provider with
            binding they hold :data:`~optimum_iobinding.runtime.cuda_policy.CUDA_DIFFUSION_DEFAULTS` under the
            user's own options, and the stream (``user_compute_stream``).
        sess_options: the user's ``onnxruntime.SessionOptions``, kept whole and never changed: a session to which
            the project adds nothing is made from it as given, one to which it adds something (fixed dims, owned
            weights) from a copy with every property and every session config entry ORT documents; a setting
            there that owned weights must override is refused by name (see
            :mod:`~optimum_iobinding.runtime.session_options`).
        io_binding: ``True``: bind torch tensors in place; ``False``: run plain ``session.run`` on numpy arrays
            and return CPU torch tensors — diffusers' numpy baseline.
        reuse_outputs: ``True``: output buffers are allocated once per input-shape signature and reused, so a later
            call overwrites what an earlier one returned (clone what you keep); ``False``: fresh tensors each call.
        max_output_signatures: how many input-shape signatures per thread keep their reused output buffers (least
            recently used dropped first).
        cuda_graph: ``"auto"``: on CUDA capture each signature where it can and run without a graph where it
            cannot (one INFO log line says why), elsewhere silently no graph; ``True``: the same, but a fallback is
            a ``RuntimeWarning`` and a model that cannot have graphs at all (CPU, no binding) is an error;
            ``False``: never.
        max_graph_signatures: how many signatures keep their graph-pool entry (least recently used go first);
            ``None``: all of them, bounded by memory.
        share_weights: ``True``: keep the float weights once as torch tensors on the device, read by every session
            of the model (an in-place change is seen by every session's next run, graphs included). ``None``: where
            the model keeps a graph pool (CUDA with binding) the one graph session loads the weights itself, and
            they become owned on first need (a second session, runtime LoRA); elsewhere never unless asked
            (:meth:`~optimum_iobinding.IOBindingORTModel.own_weights`); resolved to ``False`` where no graph pool
            can need them. ``False``: never (each session loads its own copy).
        stream: CUDA only: the torch stream ORT runs on (``user_compute_stream``); not given: the model makes its
            own. Pipelines pass one stream to all their components. ``None`` off CUDA and without binding.
    """

    providers: Tuple[str, ...] = (DEFAULT_PROVIDER,)
    provider_options: Tuple[Dict[str, str], ...] = ({},)
    sess_options: Optional[ort.SessionOptions] = None
    io_binding: bool = True
    reuse_outputs: bool = True
    max_output_signatures: int = 8
    cuda_graph: CudaGraphSetting = "auto"
    max_graph_signatures: Optional[int] = None
    share_weights: Optional[bool] = None
    stream: Optional["torch.cuda.Stream"] = field(default=None, compare=False)

    @classmethod
    def default(cls, name: str) -> Any:
        """The default of setting ``name`` (``provider`` is the default ``providers``)."""
        return getattr(cls, "providers" if name == "provider" else name)

    @classmethod
    def resolve(
        cls,
        provider: ProviderSpec = NOT_GIVEN,
        provider_options: ProviderOptionsSpec = NOT_GIVEN,
        sess_options: Optional[ort.SessionOptions] = NOT_GIVEN,
        io_binding: bool = NOT_GIVEN,
        reuse_outputs: bool = NOT_GIVEN,
        max_output_signatures: int = NOT_GIVEN,
        cuda_graph: CudaGraphSetting = NOT_GIVEN,
        max_graph_signatures: Optional[int] = NOT_GIVEN,
        share_weights: Optional[bool] = NOT_GIVEN,
        stream: Optional["torch.cuda.Stream"] = NOT_GIVEN,
        *,
        options: Optional["ModelOptions"] = None,
    ) -> "ModelOptions":
        """The settings given, over the defaults, checked and normalized: on a CUDA-like first provider with
        ``io_binding``, the diffusion defaults go under the user's provider options and the sessions run on
        ``stream`` (a new one where none is given).

        Args:
            provider, provider_options, sess_options, io_binding, reuse_outputs, max_output_signatures, cuda_graph,
                max_graph_signatures, share_weights, stream: the settings (see the class); not given: the default.
            options: options resolved already, returned as they are; a setting given beside them (other than its
                default) is refused, since it would be lost.

        Raises:
            TypeError, ValueError: a setting is wrong (the error names it), or ``options`` come with settings.
        """
        given = given_settings(
            provider=provider,
            provider_options=provider_options,
            sess_options=sess_options,
            io_binding=io_binding,
            reuse_outputs=reuse_outputs,
            max_output_signatures=max_output_signatures,
            cuda_graph=cuda_graph,
            max_graph_signatures=max_graph_signatures,
            share_weights=share_weights,
            stream=stream,
        )
        if options is not None:
            return cls.alone(options, given)
        _check_settings(given)
        settings = {name: given.get(name, cls.default(name)) for name in MODEL_KEYWORDS}
        # provider_options not given: none beside the providers' own (the default providers' options align only
        # with the default providers)
        settings["provider_options"] = given.get("provider_options")
        io_binding, stream, share_weights = settings["io_binding"], settings["stream"], settings["share_weights"]
        check_sess_options(settings["sess_options"])
        providers, provider_opts = normalize_providers(settings["provider"], settings["provider_options"], io_binding)
        cuda_like = io_binding and providers[0] in CUDA_LIKE_PROVIDERS
        if stream is not None and not cuda_like:
            raise ArgumentError(
                "stream",
                f"a CUDA stream needs a CUDA-like provider with io_binding=True, got "
                f"{providers[0]!r} with io_binding={io_binding}",
            )
        device = provider_device(providers, provider_opts)
        _check_device(providers[0], device, io_binding)
        if cuda_like:
            provider_opts = with_diffusion_defaults(providers, provider_opts)
            if stream is None:
                stream = torch.cuda.Stream(device)
            provider_opts = with_stream(providers, provider_opts, stream)
        if share_weights is None and not cuda_like:
            share_weights = False  # no graph pool can need a second session's copy of the weights
        return cls(
            tuple(providers),
            tuple(provider_opts),
            settings["sess_options"],
            io_binding,
            settings["reuse_outputs"],
            settings["max_output_signatures"],
            settings["cuda_graph"],
            settings["max_graph_signatures"],
            share_weights,
            stream,
        )

    @classmethod
    def alone(cls, options: Any, given: Mapping[str, Any]) -> "ModelOptions":
        """``options``, checked to be resolved options given without settings beside them (``given``, as
        :func:`given_settings` returns them): a setting other than its default would be lost."""
        if not isinstance(options, ModelOptions):
            raise ArgumentTypeError("options", f"expected a ModelOptions, got {type(options).__name__}")
        beside = sorted(
            name for name, value in given.items() if value is not cls.default(name) and value != cls.default(name)
        )
        if beside:
            raise ArgumentTypeError("options", f"expected either options or the settings {beside}, got both")
        return options

    @classmethod
    def of_session(cls, session: ort.InferenceSession, io_binding: bool = NOT_GIVEN, **settings: Any) -> "ModelOptions":
        """The options a session made elsewhere runs with (its providers and stream, as far as ORT tells them),
        with the model-level ``settings`` given (the others take their defaults); its weights are its own
        (``share_weights=False``)."""
        given = given_settings(io_binding=io_binding, **settings)
        _check_settings(given)
        if given.get("stream") is not None:
            raise ArgumentError(
                "stream",
                "a stream is set when a session is created; pass a path (or create the session "
                "with the provider option user_compute_stream) instead of a session",
            )
        given.pop("stream", None)
        given.pop("share_weights", None)
        io_binding = given.pop("io_binding", cls.io_binding)
        providers = session.get_providers()
        by_name = session.get_provider_options()
        options = [dict(by_name.get(name, {})) for name in providers]
        check_bindable(providers[0], io_binding)
        device = provider_device(providers, options)
        _check_device(providers[0], device, io_binding)
        stream = None
        handle = options[0].get("user_compute_stream")
        if io_binding and providers[0] in CUDA_LIKE_PROVIDERS and handle and int(handle) != 0:
            stream = torch.cuda.ExternalStream(int(handle), device=device)
        return cls(
            tuple(providers),
            tuple(options),
            session.get_session_options(),
            io_binding,
            share_weights=False,
            stream=stream,
            **given,
        )

    def replace(self, **settings: Any) -> "ModelOptions":
        """These options with some model-level ``settings`` changed (a sibling's, a component's), checked."""
        unknown = sorted(set(settings) - set(COMPONENT_SETTINGS))
        if unknown:
            raise ArgumentTypeError("settings", f"expected names among {list(COMPONENT_SETTINGS)}, got {unknown}")
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


def _check_device(first_provider: str, device: torch.device, io_binding: bool) -> None:
    if io_binding and device.type == "cpu" and first_provider != "CPUExecutionProvider":
        raise ArgumentError(
            "provider",
            f"IOBindingORTModel binds torch tensors on CPU or CUDA devices; "
            f"{first_provider!r} is neither (use CUDAExecutionProvider or CPUExecutionProvider, or "
            "io_binding=False)",
        )


# ------------------------------------------------------------------------------------------------- a pipeline
_NUMBERED_COPY = re.compile(r"(.+)_[1-9][0-9]*")


@dataclass(frozen=True)
class PipelineOptions:
    """A pipeline's options, resolved once before anything is downloaded or loaded: one :class:`ModelOptions` for
    every component (one CUDA stream for all of them and the loop's torch ops), and each component's own settings.

    Attributes:
        model: what every component shares.
        component_options: component → its own settings (checked), over the pipeline-wide ones.
        components: the pipeline's components, by name.
        numbered: those of ``components`` that may come in numbered copies (``name_1``, ``name_2`` …, not declared
            themselves); a copy without settings of its own takes its component's.
    """

    model: ModelOptions
    component_options: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    components: Tuple[str, ...] = ()
    numbered: Tuple[str, ...] = ()

    @classmethod
    def resolve(
        cls,
        components: Sequence[str],
        provider: ProviderSpec = NOT_GIVEN,
        provider_options: ProviderOptionsSpec = NOT_GIVEN,
        sess_options: Optional[ort.SessionOptions] = NOT_GIVEN,
        io_binding: bool = NOT_GIVEN,
        cuda_graph: CudaGraphSetting = NOT_GIVEN,
        component_options: Optional[Dict[str, Dict[str, Any]]] = None,
        numbered: Sequence[str] = (),
    ) -> "PipelineOptions":
        """Checks every option, the per-component ones included, against the pipeline's ``components``.

        Args:
            components: the pipeline's components, by name.
            provider, provider_options, sess_options, io_binding, cuda_graph: every component's settings (see
                :class:`ModelOptions`); not given: the defaults.
            component_options: component → its own settings, among ``cuda_graph``, ``reuse_outputs``,
                ``max_output_signatures``, ``max_graph_signatures`` and ``share_weights``.
            numbered: those of ``components`` that may come in numbered copies (``name_1`` …), whose settings
                ``component_options`` may give apart.
        """
        if cuda_graph is not NOT_GIVEN:
            check_cuda_graph_setting(cuda_graph)
        given = dict(component_options or {})
        if not all(isinstance(value, dict) for value in given.values()):
            raise ArgumentTypeError(
                "component_options", f"expected a dict of dicts (component → settings), got {given!r}"
            )
        numbered = tuple(numbered)
        if not set(numbered) <= set(components):
            raise ArgumentError(
                "numbered",
                f"expected components among {list(components)}, got {sorted(set(numbered) - set(components))}",
            )
        unknown = sorted(name for name in set(given) - set(components) if _copy_of(name, components, numbered) is None)
        if unknown:
            raise ArgumentError("component_options", f"expected components among {list(components)}, got {unknown}")
        for name, settings in given.items():
            wrong = sorted(set(settings) - set(COMPONENT_SETTINGS))
            if wrong:
                raise ValueError(
                    f"component_options[{name!r}]: expected settings among {list(COMPONENT_SETTINGS)}, got {wrong}"
                )
            try:
                _check_settings(settings)
            except (TypeError, ValueError) as error:
                where = f"component_options[{name!r}]"
                if isinstance(error, ArgumentError):  # the same kind of refusal, of the component's option
                    raise type(error)(where, str(error)) from None
                raise type(error)(f"{where}: {error}") from None
        model = ModelOptions.resolve(provider, provider_options, sess_options, io_binding, cuda_graph=cuda_graph)
        return cls(model, {name: dict(settings) for name, settings in given.items()}, tuple(components), numbered)

    def for_component(self, name: str, must_capture: bool = False) -> ModelOptions:
        """The options of component ``name``: the pipeline's, with its own settings over them.

        Args:
            name: the component.
            must_capture: whether this is the component the pipeline needs captured (its denoiser). With the
                pipeline's ``cuda_graph=True`` it gets ``True`` (a signature that runs without a graph warns; a
                model that cannot have graphs is an error), the other components ``"auto"``: they capture where
                they can, silently. Settings of the component's own win over both.
        """
        cuda_graph = self.model.cuda_graph
        if cuda_graph is True and not must_capture:
            cuda_graph = "auto"
        own = self.component_options.get(name)
        if own is None:
            base = _copy_of(name, self.components, self.numbered)
            own = self.component_options.get(base) if base is not None else None
        return self.model.replace(**{"cuda_graph": cuda_graph, **(own or {})})

    @property
    def stream(self) -> Optional["torch.cuda.Stream"]:
        return self.model.stream


def _copy_of(name: str, components: Sequence[str], numbered: Sequence[str]) -> Optional[str]:
    """The component ``name`` is a numbered copy of (``name_1`` … of one of ``numbered``, and not itself among
    ``components``), or ``None``."""
    match = _NUMBERED_COPY.fullmatch(name)
    if match is None or name in components or match.group(1) not in numbered:
        return None
    return match.group(1)
