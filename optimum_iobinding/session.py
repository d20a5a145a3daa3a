"""The session recipe: how every ONNX Runtime session of one model is made.

Providers are normalized once, CUDA-like providers get the diffusion defaults and one CUDA stream once, and every
session of the model (the plain one, one per captured input signature, siblings) comes from :meth:`SessionRecipe.
create`, which counts them. With owned weights the float initializers of the model live once on the device as torch
tensors the project owns, and every session uses them in place (``SessionOptions.add_initializer`` with OrtValues made
through DLPack): a new session adds its activations, never another copy of the weights, and an in-place change of a
weight is seen by every session's next run (CUDA graphs included: the addresses do not move).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import numpy_helper

from .cuda import DEVICE_SETUP, with_diffusion_defaults, with_stream
from .dtypes import TORCH_TO_ONNX

logger = logging.getLogger(__name__)

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

# Float initializers with at least this many elements become owned weights. Smaller ones (scales, epsilons, the
# constants of shape arithmetic) stay with each session: ORT may plan them on the CPU, where it refuses a user buffer
# on the device ("Cannot use user supplied initializer ... planned memory location is different").
OWNED_WEIGHT_MIN_ELEMENTS = 1024
_OWNED_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}


def normalize_providers(
    provider: ProviderSpec,
    provider_options: Union[Dict[str, Any], Sequence[Dict[str, Any]], None] = None,
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
    if io_binding and names[0] in UNBINDABLE_PROVIDERS:
        raise ValueError(f"provider: {names[0]!r} with io_binding=True: {UNBINDABLE_PROVIDERS[names[0]]}")
    available = ort.get_available_providers()
    for name in names:
        if name not in available:
            hint = " (install onnxruntime-gpu: pip install 'optimum-iobinding[gpu]')" if "CUDA" in name or "Tensorrt" in name else ""
            raise ValueError(f"provider: {name!r} is not available in this onnxruntime build{hint}; available: {available}")
    return names, [{key: str(value) for key, value in opts.items()} for opts in options]


def check_sess_options(sess_options: Any) -> Optional[ort.SessionOptions]:
    if sess_options is not None and not isinstance(sess_options, ort.SessionOptions):
        raise TypeError(f"sess_options: expected an onnxruntime.SessionOptions or None, got "
                        f"{type(sess_options).__name__} {sess_options!r}")
    return sess_options


def create_session(
    path_or_bytes: Union[str, bytes],
    providers: Sequence[str],
    provider_options: Sequence[Dict[str, str]],
    sess_options: Optional[ort.SessionOptions] = None,
) -> ort.InferenceSession:
    """``onnxruntime.InferenceSession`` with errors that name the file."""
    check_sess_options(sess_options)
    if isinstance(path_or_bytes, str) and not os.path.isfile(path_or_bytes):
        raise FileNotFoundError(f"path: expected an .onnx file, found nothing at {path_or_bytes!r}")
    try:
        return ort.InferenceSession(path_or_bytes, sess_options=sess_options, providers=list(providers),
                                    provider_options=list(provider_options))
    except Exception as error:  # ORT's own exception types are not importable in a stable place
        where = repr(path_or_bytes) if isinstance(path_or_bytes, str) else "the model bytes"
        raise ValueError(f"path: onnxruntime could not load {where}: {error}") from error


def copy_session_options(base: Optional[ort.SessionOptions]) -> ort.SessionOptions:
    """A new ``SessionOptions`` with the settings of ``base`` that matter here (the user's object is never changed)."""
    copy = ort.SessionOptions()
    if base is not None:
        for attribute in ("graph_optimization_level", "intra_op_num_threads", "inter_op_num_threads", "execution_mode",
                          "log_severity_level", "log_verbosity_level", "enable_mem_pattern", "enable_mem_reuse",
                          "enable_cpu_mem_arena", "use_deterministic_compute"):
            setattr(copy, attribute, getattr(base, attribute))
    return copy


def session_device(providers: Sequence[str], provider_options: Sequence[Mapping[str, Any]]) -> torch.device:
    """The torch device where the first execution provider keeps its tensors."""
    if providers[0] in GPU_PROVIDERS:
        return torch.device("cuda", int((provider_options[0] if provider_options else {}).get("device_id", 0)))
    return torch.device("cpu")


def stream_from_options(providers: Sequence[str], provider_options: Sequence[Mapping[str, Any]],
                        device: torch.device) -> Optional["torch.cuda.Stream"]:
    """The stream a session was created with (``user_compute_stream``), wrapped for torch; ``None`` if it has none."""
    handle = (provider_options[0] if provider_options else {}).get("user_compute_stream")
    if providers[0] not in CUDA_LIKE_PROVIDERS or not handle or int(handle) == 0:
        return None
    return torch.cuda.ExternalStream(int(handle), device=device)


_TORCH_OF_ONNX = {onnx_type: torch_dtype for torch_dtype, onnx_type in TORCH_TO_ONNX.items()}
_NUMPY_OF_ONNX = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16",
                  onnx.TensorProto.BFLOAT16: "uint16", onnx.TensorProto.DOUBLE: "float64"}


def parse_model(source: Union[str, bytes]) -> onnx.ModelProto:
    """The model of an .onnx path (its external weights left on disk) or of model bytes."""
    if isinstance(source, bytes):
        return onnx.load_from_string(source)
    return onnx.load(source, load_external_data=False)


class _WeightUploader:
    """Host arrays → tensors on ``device``.

    On CUDA each array is copied into one of two pinned staging buffers and uploaded from there asynchronously,
    while the next arrays fill the other buffer: one host copy per weight instead of a copy into a writable array and
    the driver's own staging of a pageable upload, and the host's copying overlaps the transfers. Arrays larger
    than a buffer go up directly. Elsewhere (or with ``staging_bytes=0``) each array becomes a writable copy.
    :meth:`finish` waits until every upload is done."""

    def __init__(self, device: torch.device, staging_bytes: int = 64 << 20, staged: Optional[bool] = None):
        self.device = device
        self.cuda = device.type == "cuda"
        # staged=True off CUDA runs the same path through unpinned buffers (for tests on any machine)
        self.staging_bytes = staging_bytes if (self.cuda if staged is None else staged) else 0
        self.buffers = [torch.empty(staging_bytes, dtype=torch.uint8, pin_memory=self.cuda)
                        for _ in range(2)] if self.staging_bytes else []
        self.done: List[Optional[Any]] = [None, None]  # the event after each buffer's last upload
        self.current, self.offset = 0, 0

    def put(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """``array`` (may be read-only; ``dtype`` is its element type as torch names it) on the device."""
        if not self.staging_bytes or array.nbytes > self.staging_bytes:
            return torch.from_numpy(np.array(array, copy=True)).view(dtype).to(self.device)
        if self.offset + array.nbytes > self.staging_bytes:
            self._switch()
        staged = self.buffers[self.current][self.offset : self.offset + array.nbytes]
        staged.numpy()[:] = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
        self.offset += -(-array.nbytes // 256) * 256  # the next array starts aligned for any element type
        target = torch.empty(array.shape, dtype=dtype, device=self.device)
        target.copy_(staged.view(dtype).view(array.shape), non_blocking=self.cuda)
        return target

    def _switch(self) -> None:
        if self.cuda:
            self.done[self.current] = torch.cuda.Event()
            self.done[self.current].record()
        self.current, self.offset = 1 - self.current, 0
        if self.done[self.current] is not None:
            self.done[self.current].synchronize()  # its uploads have left the buffer: it can be refilled

    def finish(self) -> None:
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()


def load_owned_weights(source: Union[str, bytes], device: torch.device,
                       min_elements: int = OWNED_WEIGHT_MIN_ELEMENTS,
                       model: Optional[onnx.ModelProto] = None,
                       staging_bytes: int = 64 << 20) -> Dict[str, torch.Tensor]:
    """The model's float initializers of at least ``min_elements`` elements, as torch tensors on ``device``.

    Weights in external data files are read straight from their files (the graph is parsed without them), each
    file opened once: no second full parse of a multi-GB model next to ORT's own. ``model``: ``source`` already
    parsed (:func:`parse_model`). On CUDA the weights go up through pinned staging buffers of ``staging_bytes``
    (:class:`_WeightUploader`)."""
    model = parse_model(source) if model is None else model
    base = None if isinstance(source, bytes) else os.path.dirname(os.path.abspath(source))
    weights: Dict[str, torch.Tensor] = {}
    files: Dict[str, Any] = {}
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        uploader = _WeightUploader(device, staging_bytes)
        try:
            for initializer in model.graph.initializer:
                if initializer.data_type not in _OWNED_TYPES:
                    continue
                shape = tuple(initializer.dims)
                elements = 1
                for dim in shape:
                    elements *= dim
                if elements < min_elements:
                    continue
                dtype = np.dtype(_NUMPY_OF_ONNX[initializer.data_type])
                if initializer.data_location == onnx.TensorProto.EXTERNAL and base is not None:
                    info = {entry.key: entry.value for entry in initializer.external_data}
                    location = os.path.normpath(os.path.join(base, info["location"]))
                    if os.path.commonpath([base, location]) != base:  # as onnx's own loader refuses it
                        raise ValueError(f"{source}: initializer {initializer.name!r} names external data outside "
                                         f"the model's folder: {info['location']!r}")
                    if location not in files:
                        files[location] = open(location, "rb")
                    handle = files[location]
                    handle.seek(int(info.get("offset", 0)))
                    length = int(info.get("length", elements * dtype.itemsize))
                    data = handle.read(length)
                    if len(data) != elements * dtype.itemsize:
                        raise ValueError(f"{location}: initializer {initializer.name!r} needs "
                                         f"{elements * dtype.itemsize} bytes at offset {info.get('offset', 0)}, the "
                                         f"file gives {len(data)}")
                    array = np.frombuffer(data, dtype=dtype).reshape(shape)
                elif initializer.raw_data:
                    array = np.frombuffer(initializer.raw_data, dtype=dtype).reshape(shape)
                else:
                    array = numpy_helper.to_array(initializer, base_dir=base or "")
                    if initializer.data_type == onnx.TensorProto.BFLOAT16:
                        array = np.asarray(array).view(np.uint16)
                    array = np.asarray(array, dtype=dtype)
                weights[initializer.name] = uploader.put(array, _TORCH_OF_ONNX[initializer.data_type])
            uploader.finish()
        finally:
            for handle in files.values():
                handle.close()
    return weights


_ORT_TYPE_NAMES = {
    onnx.TensorProto.FLOAT: "float", onnx.TensorProto.FLOAT16: "float16", onnx.TensorProto.BFLOAT16: "bfloat16",
    onnx.TensorProto.DOUBLE: "double", onnx.TensorProto.INT64: "int64", onnx.TensorProto.INT32: "int32",
    onnx.TensorProto.INT16: "int16", onnx.TensorProto.INT8: "int8", onnx.TensorProto.UINT8: "uint8",
    onnx.TensorProto.BOOL: "bool",
}


def declared_types(model: onnx.ModelProto) -> Tuple[Dict[str, str], Dict[str, str]]:
    """The graph's inputs and outputs with their types as ORT names them (``"tensor(float16)"``), in order; graph
    inputs that are initializers (older IR versions list them) are not inputs to feed."""
    initializers = {tensor.name for tensor in model.graph.initializer}

    def type_of(value: onnx.ValueInfoProto) -> str:
        if not value.type.HasField("tensor_type"):
            return value.type.WhichOneof("value") or "unknown"
        elem = value.type.tensor_type.elem_type
        return f"tensor({_ORT_TYPE_NAMES.get(elem, onnx.TensorProto.DataType.Name(elem).lower())})"

    inputs = {value.name: type_of(value) for value in model.graph.input if value.name not in initializers}
    outputs = {value.name: type_of(value) for value in model.graph.output}
    return inputs, outputs


def _ort_value_of(tensor: torch.Tensor) -> ort.OrtValue:
    """An OrtValue over ``tensor``'s memory (zero copy): ORT reads and the caller owns."""
    return ort.OrtValue(ort.capi._pybind_state.OrtValue.from_dlpack(tensor.__dlpack__(), False))


class SessionRecipe:
    """Everything needed to create a session of one model, decided once.

    Args:
        source: the .onnx path or the model bytes (``None`` for a session given from outside, which cannot be
            created again).
        providers, provider_options: ORT's aligned lists, already normalized.
        sess_options: the user's ``SessionOptions`` (never changed: each session gets a copy).
        stream: the CUDA stream the sessions run on (already in the provider options as ``user_compute_stream``).
        share_weights: ``True``: keep the float weights once as owned torch tensors on the device, used by every
            session; ``False``: each session loads them from the source; ``None``: each session loads them from the
            source until :meth:`start_owning` (the graph pool calls it before it makes a second session, and
            ``own_weights()`` for runtime LoRA): ONNX Runtime's own loading puts a single session up sooner.
    """

    def __init__(
        self,
        source: Union[str, bytes, None],
        providers: Sequence[str],
        provider_options: Sequence[Dict[str, str]],
        sess_options: Optional[ort.SessionOptions] = None,
        stream: Optional["torch.cuda.Stream"] = None,
        share_weights: Optional[bool] = False,
    ):
        self.source = source
        self.providers = list(providers)
        self.provider_options = [dict(options) for options in provider_options]
        self.sess_options = check_sess_options(sess_options)
        self.device = session_device(self.providers, self.provider_options)
        self.stream = stream
        self.share_weights = bool(share_weights) and source is not None
        # the weights become owned when a second session is needed (share_weights=None)
        self.owns_on_need = share_weights is None and source is not None
        self._weights: Optional[Dict[str, torch.Tensor]] = None
        self._weight_values: Dict[str, ort.OrtValue] = {}
        self._parsed: Optional[onnx.ModelProto] = None  # the source parsed by the model, until the weights load
        self._lock = threading.Lock()
        self.sessions_created = 0
        # (what, seconds) per attempt: "session" for a session made, "refused" for one ORT refused
        self.creation_log: List[Tuple[str, float]] = []

    @classmethod
    def for_path(
        cls,
        path: Union[str, os.PathLike],
        provider: ProviderSpec = None,
        provider_options: Union[Dict[str, Any], Sequence[Dict[str, Any]], None] = None,
        sess_options: Optional[ort.SessionOptions] = None,
        io_binding: bool = True,
        stream: Optional["torch.cuda.Stream"] = None,
        share_weights: Optional[bool] = None,
    ) -> "SessionRecipe":
        """The recipe for an .onnx file: providers normalized, CUDA defaults and the stream added (with
        ``io_binding``); ``share_weights=None`` owns the weights on first need where a model keeps a graph pool
        (CUDA-like providers with ``io_binding``), and never elsewhere unless asked (:meth:`start_owning`)."""
        check_sess_options(sess_options)
        providers, options = normalize_providers(provider, provider_options, io_binding)
        cuda_like = io_binding and providers[0] in CUDA_LIKE_PROVIDERS
        if stream is not None and not cuda_like:
            raise ValueError(f"stream: a CUDA stream needs a CUDA-like provider with io_binding=True, got "
                             f"{providers[0]!r} with io_binding={io_binding}")
        if cuda_like:
            options = with_diffusion_defaults(providers, options)
            if stream is None:
                stream = torch.cuda.Stream(session_device(providers, options))
            options = with_stream(providers, options, stream)
        if share_weights is None and not cuda_like:
            share_weights = False
        return cls(os.fspath(path), providers, options, sess_options, stream, share_weights)

    @classmethod
    def for_session(cls, session: ort.InferenceSession, io_binding: bool = True) -> "SessionRecipe":
        """The recipe a given session was made with (as far as ORT tells it), to create more like it."""
        providers = session.get_providers()
        by_name = session.get_provider_options()
        options = [dict(by_name.get(name, {})) for name in providers]
        source = getattr(session, "_model_path", None) or getattr(session, "_model_bytes", None)
        device = session_device(providers, options)
        stream = stream_from_options(providers, options, device) if io_binding else None
        recipe = cls(source, providers, options, getattr(session, "_sess_options", None), stream, share_weights=False)
        recipe.sessions_created = 1
        return recipe

    @property
    def can_create(self) -> bool:
        return self.source is not None

    @property
    def weights(self) -> Dict[str, torch.Tensor]:
        """The owned weights by initializer name (empty without ``share_weights``); loaded on first use."""
        if not self.share_weights:
            return {}
        with self._lock:
            if self._weights is None:
                model, self._parsed = self._parsed, None
                with self._device_setup():
                    self._weights = load_owned_weights(self.source, self.device, model=model)
                self._weight_values = {name: _ort_value_of(tensor) for name, tensor in self._weights.items()}
        return self._weights

    def start_owning(self) -> None:
        """From now on every new session reads the owned weights (loaded on the next :meth:`create`). Sessions made
        before keep the weights they loaded: whoever holds them drops them (the graph pool does)."""
        with self._lock:
            if self.source is None:
                raise RuntimeError("the session was created from neither a path nor bytes, so its weights cannot be "
                                   "loaded as owned tensors")
            self.share_weights = True
            self.owns_on_need = False

    def release_parse(self) -> None:
        """Drops the parse kept by :meth:`adopt` where the weights are not owned (a session loaded them itself)."""
        with self._lock:
            if not self.share_weights:
                self._parsed = None

    def _device_setup(self) -> Any:
        """Held while sessions are built and weights uploaded on CUDA: never beside a graph capture
        (:data:`~optimum_iobinding.cuda.DEVICE_SETUP`)."""
        return DEVICE_SETUP.setup() if self.device.type == "cuda" else contextlib.nullcontext()

    def adopt(self, model: onnx.ModelProto) -> None:
        """``model``, the source already parsed (by the model reading its declared inputs), is kept until the owned
        weights load and read from instead of parsing the file again. On the SD1.5 fp16 UNet, whose 1.7 GB of
        weights are inside its .onnx, loading the weights (a parse included) was the longest piece of the first
        image's critical path on the H100: 1.67 s. Until then the parse holds host memory the size of the file (a
        model never called keeps it: a text-to-image pipeline's VAE encoder); where the weights are owned on need, a
        session that loads them itself releases it (:meth:`release_parse`). Nothing is kept where the weights are
        never owned or are loaded already."""
        with self._lock:
            if (self.share_weights or self.owns_on_need) and self._weights is None:
                self._parsed = model

    def create(
        self,
        free_dims: Optional[Mapping[str, int]] = None,
        provider_updates: Optional[Mapping[str, str]] = None,
        quiet: bool = False,
    ) -> ort.InferenceSession:
        """A new session of the model.

        Args:
            free_dims: named input dims to fix (``add_free_dimension_override_by_name``).
            provider_updates: options added to the first provider's (e.g. ``enable_cuda_graph``).
            quiet: an attempt whose refusal the caller reports itself: unless the user gave ``sess_options``,
                ORT's own log lines for it (warnings and the refusal's error line) are not printed.
        """
        if self.source is None:
            raise RuntimeError("the session was created from neither a path nor bytes, so it cannot be created again")
        sess_options = copy_session_options(self.sess_options)
        if quiet and self.sess_options is None:
            sess_options.log_severity_level = 4  # fatal only
        for dim, size in (free_dims or {}).items():
            sess_options.add_free_dimension_override_by_name(dim, int(size))
        if self.share_weights:
            self.weights  # noqa: B018 — loads them once
            if self.device.type == "cpu":
                # the CPU EP would otherwise prepack (copy) MatMul/Conv weights, and miss in-place changes
                sess_options.add_session_config_entry("session.disable_prepacking", "1")
                # so would the layout optimizations above EXTENDED (NCHWc convolutions reorder a copy of the
                # weights): measured, a change of the owned Conv weights then barely reached the UNet's output
                extended = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
                if int(sess_options.graph_optimization_level) > int(extended):
                    sess_options.graph_optimization_level = extended
            for name, value in self._weight_values.items():
                sess_options.add_initializer(name, value)
        options = [dict(o) for o in self.provider_options]
        if provider_updates:
            options[0].update(provider_updates)
        start = time.perf_counter()
        try:
            with self._device_setup():
                session = create_session(self.source, self.providers, options, sess_options)
        except Exception:
            with self._lock:
                self.creation_log.append(("refused", time.perf_counter() - start))
            raise
        with self._lock:
            self.sessions_created += 1
            self.creation_log.append(("session", time.perf_counter() - start))
        return session
