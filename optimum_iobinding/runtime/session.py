"""The session recipe: how every ONNX Runtime session of one model is made, and how many were.

Every session of a model (the plain one, the graph pool's, its siblings') comes from :meth:`SessionRecipe.create`
with the model's resolved :class:`~optimum_iobinding.runtime.options.ModelOptions` (providers, their options with the
stream, ``sess_options``) and its :class:`~optimum_iobinding.runtime.weights.OwnedWeights`, and is counted.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, TypeVar, Union

import onnx
import onnxruntime as ort

from ..errors import ArgumentError
from .cuda_policy import DEVICE_SETUP
from .hub import check_model_file, unreadable_reason
from .options import ModelOptions
from .session_options import copy_session_options
from .session_thread import SessionThread
from .shared_arena import SHARED_ARENAS, USE_ENV_ALLOCATORS, WEIGHTS_APART
from .shapes import session_source
from . import timeline
from .weights import OwnedWeights, source_name

T = TypeVar("T")

logger = logging.getLogger(__name__)

# fused operators of ORT's transformer optimizer (com.microsoft) that ONNX Runtime runs on the GPU only: a model
# exported with the CUDA fusions holds them, and the CPU provider refuses the session ("Could not find an
# implementation for NhwcConv")
GPU_ONLY_OPERATORS = frozenset({"NhwcConv", "GroupNorm", "SkipGroupNorm", "BiasSplitGelu", "BiasAdd"})
GPU_PROVIDERS = frozenset({"CUDAExecutionProvider", "TensorrtExecutionProvider", "ROCMExecutionProvider"})


def gpu_only_operators(path: str) -> List[str]:
    """The operators of :data:`GPU_ONLY_OPERATORS` the ONNX model at ``path`` holds (its graph read without its
    weights), in order; none where it cannot be read."""
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception:  # noqa: BLE001 — an unreadable file has its own reason
        return []
    return sorted(
        {
            node.op_type
            for node in model.graph.node
            if node.domain == "com.microsoft" and node.op_type in GPU_ONLY_OPERATORS
        }
    )


def create_session(
    path_or_bytes: Union[str, bytes],
    providers: Sequence[str],
    provider_options: Sequence[Dict[str, str]],
    sess_options: Optional[ort.SessionOptions] = None,
) -> ort.InferenceSession:
    """``onnxruntime.InferenceSession`` with errors that name the file (and say so where it is no ONNX model)."""
    if isinstance(path_or_bytes, str):
        check_model_file(path_or_bytes)
    try:
        return ort.InferenceSession(
            path_or_bytes, sess_options=sess_options, providers=list(providers), provider_options=list(provider_options)
        )
    except Exception as error:  # ORT's own exception types are not importable in a stable place
        if not isinstance(path_or_bytes, str):
            raise ArgumentError("path", f"onnxruntime could not load the model bytes: {error}") from error
        gpu_only = [] if GPU_PROVIDERS & set(providers) else gpu_only_operators(path_or_bytes)
        if gpu_only:
            raise ArgumentError(
                "path",
                f"{path_or_bytes!r} was exported for CUDA (it holds {', '.join(gpu_only)}, which ONNX Runtime runs on "
                f"CUDA only: an export with --optimize cuda), so {providers[0]} cannot run it; export the model again "
                "with --optimize cpu, or run it with CUDAExecutionProvider",
            ) from error
        reason = unreadable_reason(path_or_bytes)
        if reason is not None:
            raise ArgumentError(
                "path",
                f"{path_or_bytes!r} is not a readable ONNX model: {reason} (onnxruntime could not "
                f"load {path_or_bytes!r} either: {error})",
            ) from error
        raise ArgumentError("path", f"onnxruntime could not load {path_or_bytes!r}: {error}") from error


_ORT_TYPE_NAMES = {
    onnx.TensorProto.FLOAT: "float",
    onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.BFLOAT16: "bfloat16",
    onnx.TensorProto.DOUBLE: "double",
    onnx.TensorProto.INT64: "int64",
    onnx.TensorProto.INT32: "int32",
    onnx.TensorProto.INT16: "int16",
    onnx.TensorProto.INT8: "int8",
    onnx.TensorProto.UINT8: "uint8",
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


class SessionRecipe:
    """Everything needed to create a session of one model, decided once, and the count of sessions made.

    Args:
        source: the .onnx path or the model bytes (``None`` for a session given from outside, which cannot be
            created again).
        options: the model's resolved options (providers with the stream, ``sess_options``, ``share_weights``).
    """

    def __init__(self, source: Union[str, bytes, None], options: ModelOptions):
        self.source = source
        self.options = options
        self.providers = list(options.providers)
        self.provider_options = [dict(o) for o in options.provider_options]
        self.sess_options = options.sess_options
        self.device = options.device
        self.stream = options.stream
        self.weights = OwnedWeights(source, self.device, options.share_weights)
        self._lock = threading.Lock()
        # CUDA with IO binding: every session of the recipe made and run on one thread (one ORT thread context per
        # session); a session given from outside was made in its caller's thread and keeps running there, and the
        # numpy baseline (io_binding=False) runs as diffusers' pipeline does, in the caller's
        bound = self.device.type == "cuda" and options.io_binding and source is not None
        self.thread: Optional[SessionThread] = SessionThread(source_name(source)) if bound else None
        self.sessions_created = 0
        # (what, seconds) per attempt: "session" for a session made, "refused" for one ORT refused
        self.creation_log: List[Tuple[str, float]] = []

    @classmethod
    def for_session(cls, session: ort.InferenceSession, options: ModelOptions) -> "SessionRecipe":
        """The recipe a given session was made with (as far as ORT tells it), to create more like it."""
        recipe = cls(session_source(session), options)
        recipe.thread = None
        recipe.sessions_created = 1
        return recipe

    @property
    def can_create(self) -> bool:
        return self.source is not None

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
        # the user's own object where nothing is added to it; otherwise a copy, since an addition cannot be taken
        # back and would reach every later session made with the user's object (see session_options)
        adds = self.sess_options is None or bool(free_dims) or self.weights.owned
        sess_options = copy_session_options(self.sess_options) if adds else self.sess_options
        if quiet and self.sess_options is None:
            sess_options.log_severity_level = 4  # fatal only
        graph = (provider_updates or {}).get("enable_cuda_graph") == "1"
        if graph and self.sess_options is None:
            # a captured graph replays without allocating, so ORT's memory pattern saves it nothing, and it costs a
            # block per input shape (the first run's tensors planned into one allocation, made at the second run, the
            # capture) that the arena's chunks freed by the first run cannot serve: the memory held twice
            sess_options.enable_mem_pattern = False
        for dim, size in (free_dims or {}).items():
            sess_options.add_free_dimension_override_by_name(dim, int(size))
        if isinstance(self.source, str):
            check_model_file(self.source)
        try:
            if adds:
                self.weights.add_to(sess_options)  # owned weights: the file is parsed here, before ORT sees it
        except Exception as error:
            reason = unreadable_reason(self.source) if isinstance(self.source, str) else None
            if reason is None:
                raise
            raise ArgumentError("path", f"{self.source!r} is not a readable ONNX model: {reason}") from error
        options = [dict(o) for o in self.provider_options]
        if provider_updates:
            options[0].update(provider_updates)
        start = time.perf_counter()
        try:
            what = (
                f"session {source_name(self.source)}{' graph' if (provider_updates or {}).get('enable_cuda_graph') else ''}"
                f"{' fixed dims' if free_dims else ''}"
            )
            with DEVICE_SETUP.build() if self.device.type == "cuda" else contextlib.nullcontext(), timeline.step(what):
                # decided inside the build gate, where no capture can start (see shared_arena)
                device_index = self.device.index or 0
                shared = self.device.type == "cuda" and SHARED_ARENAS.may_join(
                    device_index,
                    self.providers[0],
                    options[0],
                    graph=graph,
                    user_sess_options=self.sess_options is not None,
                )
                if shared:
                    sess_options.add_session_config_entry(USE_ENV_ALLOCATORS, "1")
                    sess_options.add_session_config_entry(WEIGHTS_APART, "1")
                made = False
                try:
                    session = self.on_thread(create_session, self.source, self.providers, options, sess_options)
                    made = True
                finally:  # an interrupt too: counted as made or not, never left a member
                    if shared:
                        if made:
                            SHARED_ARENAS.joined(device_index, session)
                        else:
                            SHARED_ARENAS.not_made(device_index)
        except Exception:
            with self._lock:
                self.creation_log.append(("refused", time.perf_counter() - start))
            raise
        with self._lock:
            self.sessions_created += 1
            self.creation_log.append(("session", time.perf_counter() - start))
        return session

    def on_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` (an ORT call: making or running one of the recipe's sessions) on the recipe's
        :class:`~.session_thread.SessionThread`, where it has one; here otherwise."""
        thread = self.thread
        return fn(*args) if thread is None else thread.call(fn, *args)

    def run(self, session: ort.InferenceSession, binding: Any, run_options: Any) -> None:
        """``session.run_with_iobinding(binding, run_options)`` on the recipe's thread (:meth:`on_thread`)."""
        self.on_thread(session.run_with_iobinding, binding, run_options)
