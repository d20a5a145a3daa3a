"""IOBindingORTModel: runs an ONNX model through ONNX Runtime IO binding with torch tensors bound by ``data_ptr()``."""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import onnx
import onnxruntime as ort
import torch

from .dtypes import ORT_TO_TORCH, TORCH_TO_ONNX, conversion_allowed
from .cuda import (
    DISABLE_SYNC_RUN_OPTION,
    CudaGraphRunner,
    free_dimension_overrides,
    stream_of_session,
    tensorrt_profile_options,
    with_diffusion_defaults,
    with_stream,
)
from .shapes import inferencer_from_session

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
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
InputValue = Union[torch.Tensor, np.ndarray, np.generic, int, float, bool]


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
        extra = [provider_options] if isinstance(provider_options, dict) else list(provider_options)
        if len(extra) != len(names):
            raise ValueError(
                f"provider_options: expected {len(names)} dict(s), one per provider {names}, got {len(extra)}"
            )
        options = [{**given, **paired} for given, paired in zip(extra, options)]
    if io_binding and names and names[0] in UNBINDABLE_PROVIDERS:
        raise ValueError(f"provider: {names[0]!r} with io_binding=True: {UNBINDABLE_PROVIDERS[names[0]]}")
    available = ort.get_available_providers()
    for name in names:
        if name not in available:
            hint = " (install onnxruntime-gpu: pip install 'optimum-iobinding[gpu]')" if "CUDA" in name or "Tensorrt" in name else ""
            raise ValueError(f"provider: {name!r} is not available in this onnxruntime build{hint}; available: {available}")
    return names, [{key: str(value) for key, value in opts.items()} for opts in options]


def create_session(
    path_or_bytes: Union[str, bytes],
    providers: Sequence[str],
    provider_options: Sequence[Dict[str, str]],
    sess_options: Optional[ort.SessionOptions] = None,
) -> ort.InferenceSession:
    """``onnxruntime.InferenceSession`` with errors that name the file."""
    if isinstance(path_or_bytes, str) and not os.path.isfile(path_or_bytes):
        raise FileNotFoundError(f"path: expected an .onnx file, found nothing at {path_or_bytes!r}")
    try:
        return ort.InferenceSession(path_or_bytes, sess_options=sess_options, providers=list(providers),
                                    provider_options=list(provider_options))
    except Exception as error:  # ORT's own exception types are not importable in a stable place
        where = repr(path_or_bytes) if isinstance(path_or_bytes, str) else "the model bytes"
        raise ValueError(f"path: onnxruntime could not load {where}: {error}") from error


def session_device(session: ort.InferenceSession) -> torch.device:
    """The torch device where the session's first execution provider keeps its tensors."""
    provider = session.get_providers()[0]
    if provider in GPU_PROVIDERS:
        options = session.get_provider_options().get(provider, {})
        return torch.device("cuda", int(options.get("device_id", 0)))
    return torch.device("cpu")


class IOBindingORTModel:
    """An ONNX model run by ONNX Runtime with torch tensors bound in place: torch in, torch out, on ``self.device``.

    Offers the surface of diffusers' ``OnnxRuntimeModel`` (``from_pretrained``, ``save_pretrained``, ``load_model``,
    ``__call__(**inputs)``) without depending on it.

    Inputs (``io_binding=True``):
        * a torch tensor already on ``self.device``, of the input's dtype and contiguous, is bound as it is: no copy;
        * anything else is converted once, and the converted tensor is held until the run ends. Silent conversions:
          a move between CPU and the session's device; ``.contiguous()``; a numpy array or Python/numpy scalar
          (a scalar becomes a 0-d tensor); a dtype cast float→float (e.g. float32 → float16), int→int (int64 →
          int32) and int/bool→float. Errors: float→int, anything→bool, bool→int, complex, a CUDA tensor on another
          GPU than the session's, any other Python type, wrong rank, a static dim mismatch, unknown or missing inputs.

    Outputs:
        A list of torch tensors on ``self.device`` in the session's output order. Outputs live in buffers allocated
        once per input-shape signature and reused by later calls with the same shapes: **a later call overwrites
        what an earlier one returned** (clone what you keep, or pass ``reuse_outputs=False`` for fresh tensors).
        At most ``max_output_signatures`` (thread, signature) pairs keep buffers (least recently used dropped
        first), which bounds the memory that alternating shapes can take. An output
        is never bound to an input's memory: a call whose input is an earlier output gets fresh output tensors.
        An output whose shape depends on the data is allocated by ORT on the device and handed over via DLPack.

    Threads: one lock per model serializes binding and running; reused output buffers are kept per thread, so calls
    from several threads never overwrite each other's results. With ``cuda_graph`` the graph's output buffers are
    shared by every thread: clone what you keep before another thread calls (pipelines serialize their calls).

    With ``io_binding=False`` the model runs plain ``session.run`` on numpy arrays — the numpy baseline — and returns
    CPU torch tensors.

    Args:
        session_or_path: an ``onnxruntime.InferenceSession`` or a path to an .onnx file.
        provider: execution provider name, ``(name, options)`` pair or list of them; default CPU.
        provider_options: options dict (or list of dicts aligned with the providers).
        sess_options: ``onnxruntime.SessionOptions``.
        io_binding: bind torch tensors (default) or run the numpy baseline.
        reuse_outputs: reuse output buffers per input-shape signature (default) or return fresh tensors.
        max_output_signatures: how many input-shape signatures keep their output buffers.
        config: the component's config (``from_pretrained`` reads the ``config.json`` beside the model, as optimum
            writes it); pipelines read scaling factors and channel counts from it.
        stream: CUDA only: the torch stream ORT runs on (``user_compute_stream``); by default the model makes its
            own. Pipelines pass one stream to all their components.
        cuda_graph: CUDA only: run each input signature through a CUDA graph — a session with its free dims fixed
            to those shapes (so every node lands on the GPU), fixed input/output buffers that new inputs are copied
            into, captured on the first run and replayed after. Outputs are then always the same tensors. A
            signature whose capture fails runs without a graph, after one warning saying why.
        max_graph_sessions: how many signatures keep a graph session (each holds the weights once more).

    CUDA: provider options default to :data:`~optimum_iobinding.cuda.CUDA_DIFFUSION_DEFAULTS` (the user's win), and
    runs use ``disable_synchronize_execution_providers=1``: no host synchronization anywhere in a call.
    """

    def __init__(
        self,
        session_or_path: Union[ort.InferenceSession, str, os.PathLike],
        *,
        provider: ProviderSpec = None,
        provider_options: Union[Dict[str, Any], Sequence[Dict[str, Any]], None] = None,
        sess_options: Optional[ort.SessionOptions] = None,
        io_binding: bool = True,
        reuse_outputs: bool = True,
        max_output_signatures: int = 8,
        config: Optional[Dict[str, Any]] = None,
        stream: Optional["torch.cuda.Stream"] = None,
        cuda_graph: bool = False,
        max_graph_sessions: int = 2,
    ):
        if max_output_signatures < 1:
            raise ValueError(f"max_output_signatures: expected an integer ≥ 1, got {max_output_signatures}")
        if max_graph_sessions < 1:
            raise ValueError(f"max_graph_sessions: expected an integer ≥ 1, got {max_graph_sessions}")
        if isinstance(session_or_path, ort.InferenceSession):
            session = session_or_path
            providers = session.get_providers()
            options_by_name = session.get_provider_options()
            provider_option_list = [dict(options_by_name.get(name, {})) for name in providers]
            recipe_sess_options = getattr(session, "_sess_options", None)
            if stream is not None:
                raise ValueError("stream: a stream is set when a session is created; pass a path (or create the "
                                 "session with the provider option user_compute_stream) instead of a session")
        elif isinstance(session_or_path, (str, os.PathLike)):
            providers, provider_option_list = normalize_providers(provider, provider_options, io_binding)
            if io_binding and providers[0] in CUDA_LIKE_PROVIDERS:
                provider_option_list = with_diffusion_defaults(providers, provider_option_list)
                if stream is None:
                    stream = torch.cuda.Stream(torch.device("cuda", int(provider_option_list[0].get("device_id", 0))))
                provider_option_list = with_stream(providers, provider_option_list, stream)
            session = create_session(os.fspath(session_or_path), providers, provider_option_list, sess_options)
            recipe_sess_options = sess_options
        else:
            raise TypeError(
                "session_or_path: expected an onnxruntime.InferenceSession or a path to an .onnx file, "
                f"got {type(session_or_path).__name__}"
            )
        input_dtypes = {i.name: ORT_TO_TORCH.get(i.type) for i in session.get_inputs()}
        output_dtypes = {o.name: ORT_TO_TORCH.get(o.type) for o in session.get_outputs()}
        for kind, dtypes, args in (("input", input_dtypes, session.get_inputs()), ("output", output_dtypes, session.get_outputs())):
            for arg in args:
                if dtypes[arg.name] is None:
                    raise TypeError(
                        f"{kind} {arg.name!r} has type {arg.type}; IOBindingORTModel supports tensors of "
                        f"{sorted(t[7:-1] for t in ORT_TO_TORCH)}"
                    )
        device = session_device(session)
        if io_binding and session.get_providers()[0] in UNBINDABLE_PROVIDERS:
            raise ValueError(f"session: {session.get_providers()[0]!r} with io_binding=True: "
                             f"{UNBINDABLE_PROVIDERS[session.get_providers()[0]]}")
        if io_binding and device.type == "cpu" and session.get_providers()[0] != "CPUExecutionProvider":
            raise ValueError(
                f"provider: IOBindingORTModel binds torch tensors on CPU or CUDA devices; "
                f"{session.get_providers()[0]!r} is neither (use CUDAExecutionProvider or CPUExecutionProvider, "
                "or io_binding=False)"
            )
        self._session = session
        self._device = device
        self._input_dtypes: Dict[str, torch.dtype] = input_dtypes  # type: ignore[assignment]
        self._output_dtypes: Dict[str, torch.dtype] = output_dtypes  # type: ignore[assignment]
        self.io_binding = io_binding
        self.reuse_outputs = reuse_outputs
        self.max_output_signatures = max_output_signatures
        self.model_path: Optional[str] = getattr(session, "_model_path", None)
        self.config: Dict[str, Any] = dict(config or {})
        self.shape_inferencer = inferencer_from_session(session)
        self._ort_device_type = "cuda" if device.type == "cuda" else "cpu"
        self._ort_device_id = device.index or 0
        self._output_buffers: "OrderedDict[Tuple, Dict[str, torch.Tensor]]" = OrderedDict()
        self._binding = session.io_binding() if io_binding else None
        self._lock = threading.Lock()
        # CUDA: the stream ORT runs on (ours, or the one the given session was created with); None means ORT's own
        # stream, which costs a host synchronization before and after every run.
        self._stream = None
        if device.type == "cuda" and io_binding:
            self._stream = stream if stream is not None else stream_of_session(session, device)
        self._run_options = ort.RunOptions()
        if self._stream is not None:
            self._run_options.add_run_config_entry(DISABLE_SYNC_RUN_OPTION, "1")
        if cuda_graph and (device.type != "cuda" or not io_binding):
            raise ValueError(f"cuda_graph: needs a CUDA session with io_binding=True, got device {device} and "
                             f"io_binding={io_binding}")
        if cuda_graph and self._stream is None:
            raise ValueError("cuda_graph: needs the session's stream; create the model from a path (or a session "
                             "made with the provider option user_compute_stream)")
        self.cuda_graph = cuda_graph
        self.max_graph_sessions = max_graph_sessions
        self._session_recipe = (self.model_path or getattr(session, "_model_bytes", None), list(providers),
                                provider_option_list, recipe_sess_options)
        self._graph_runners: "OrderedDict[Tuple, CudaGraphRunner]" = OrderedDict()
        self._graph_disabled: Dict[Tuple, str] = {}

    SIBLING_SETTINGS = ("reuse_outputs", "max_output_signatures", "cuda_graph", "max_graph_sessions")

    def sibling(self, **changes: Any) -> "IOBindingORTModel":
        """A new model on the same file (or bytes), providers, provider options, session options and CUDA stream,
        with a session of its own: its own copy of the weights on the device and its own kernel state.

        What it is for: ORT's CUDA convolutions choose their cuDNN algorithms again whenever a session's input shape
        changes, even back to a shape it has run before — measured on an H100 with onnxruntime-gpu 1.31.1 for the
        SD1.5 VAE decoder (fp16, 64×64 latents): 22 ms per call while the shape repeats, 0.7–1 s per call while four
        shapes alternate (EXHAUSTIVE search; ~95 ms with HEURISTIC; benchmarks/vae_shapes.py). A caller that
        alternates a few shapes, as tiled decoding does, is fast with one sibling per shape.

        Args:
            changes: settings to differ from this model's, among ``reuse_outputs``, ``max_output_signatures``,
                ``cuda_graph`` and ``max_graph_sessions``.
        """
        unknown = sorted(set(changes) - set(self.SIBLING_SETTINGS))
        if unknown:
            raise TypeError(f"sibling: expected settings among {list(self.SIBLING_SETTINGS)}, got {unknown}")
        source, providers, options, sess_options = self._session_recipe
        if source is None:
            raise RuntimeError("sibling: the session was created from neither a path nor bytes, so it cannot be "
                               "created again")
        settings = {name: getattr(self, name) for name in self.SIBLING_SETTINGS}
        settings.update(changes)
        session = create_session(source, providers, options, copy_session_options(sess_options))
        # the options carry this model's user_compute_stream: the sibling runs on the same CUDA stream
        return IOBindingORTModel(session, io_binding=self.io_binding, config=self.config, **settings)

    # ----------------------------------------------------------------------------------------------------- loading
    @staticmethod
    def load_model(
        path: Union[str, os.PathLike],
        provider: ProviderSpec = None,
        sess_options: Optional[ort.SessionOptions] = None,
        provider_options: Union[Dict[str, Any], Sequence[Dict[str, Any]], None] = None,
    ) -> ort.InferenceSession:
        """Creates an ``onnxruntime.InferenceSession`` for ``path`` with the given provider(s), as diffusers does.

        Raises:
            FileNotFoundError: no file at ``path``.
            ValueError: the provider is not available, or ORT cannot load the file.
        """
        providers, options = normalize_providers(provider, provider_options)
        return create_session(os.fspath(path), providers, options, sess_options)

    @classmethod
    def from_pretrained(
        cls,
        model_id: Union[str, os.PathLike],
        subfolder: Optional[str] = None,
        file_name: str = "model.onnx",
        provider: ProviderSpec = None,
        provider_options: Union[Dict[str, Any], Sequence[Dict[str, Any]], None] = None,
        sess_options: Optional[ort.SessionOptions] = None,
        io_binding: bool = True,
        reuse_outputs: bool = True,
        stream: Optional["torch.cuda.Stream"] = None,
        cuda_graph: bool = False,
        **hub_kwargs: Any,
    ) -> "IOBindingORTModel":
        """Loads ``model_id/subfolder/file_name`` (a file, a local folder or a Hugging Face Hub id).

        Args:
            model_id: an .onnx file, a folder holding one, or a hub repository id.
            subfolder: folder inside ``model_id`` (e.g. ``"unet"``).
            file_name: the model's file name inside that folder.
            provider, provider_options, sess_options, io_binding, reuse_outputs, stream, cuda_graph: as for the
                constructor.
            **hub_kwargs: passed to ``huggingface_hub.snapshot_download`` for hub ids (revision, token, cache_dir,
                local_files_only).

        Returns:
            The loaded model.
        """
        path = resolve_model_file(model_id, subfolder, file_name, **hub_kwargs)
        config_path = os.path.join(os.path.dirname(path), CONFIG_NAME)
        config = json.loads(Path(config_path).read_text()) if os.path.isfile(config_path) else None
        return cls(
            path,
            provider=provider,
            provider_options=provider_options,
            sess_options=sess_options,
            io_binding=io_binding,
            reuse_outputs=reuse_outputs,
            config=config,
            stream=stream,
            cuda_graph=cuda_graph,
        )

    def save_pretrained(self, save_directory: Union[str, os.PathLike], file_name: str = "model.onnx") -> str:
        """Writes the model, every external-data file it references, and its config (if any) into
        ``save_directory``.

        Returns:
            The path of the written .onnx file.
        """
        save_directory = os.fspath(save_directory)
        os.makedirs(save_directory, exist_ok=True)
        target = os.path.join(save_directory, file_name)
        if self.config:
            Path(save_directory, CONFIG_NAME).write_text(json.dumps(self.config, indent=2, sort_keys=True))
        if self.model_path is None:
            model_bytes = getattr(self.session, "_model_bytes", None)
            if model_bytes is None:
                raise ValueError("save_pretrained: this session was created from neither a path nor bytes")
            Path(target).write_bytes(model_bytes)
            return target
        source = os.path.abspath(self.model_path)
        if os.path.abspath(target) != source:
            shutil.copyfile(source, target)
        source_dir = os.path.dirname(source)
        for location in external_data_locations(source):
            source_file = os.path.join(source_dir, location)
            target_file = os.path.join(save_directory, location)
            if os.path.abspath(source_file) != os.path.abspath(target_file):
                os.makedirs(os.path.dirname(target_file), exist_ok=True)
                shutil.copyfile(source_file, target_file)
        return target

    # -------------------------------------------------------------------------------------------------- properties
    @property
    def session(self) -> ort.InferenceSession:
        """The ORT session (with ``cuda_graph``, the most recent graph session once one runs)."""
        if self._session is None and self._graph_runners:
            return next(reversed(self._graph_runners.values())).session
        return self._main_session()

    @property
    def device(self) -> torch.device:
        """``cuda:N`` for the CUDA and TensorRT providers, ``cpu`` otherwise."""
        return self._device

    @property
    def providers(self) -> List[str]:
        return self.session.get_providers()

    @property
    def input_names(self) -> List[str]:
        return list(self._input_dtypes)

    @property
    def output_names(self) -> List[str]:
        return list(self._output_dtypes)

    @property
    def input_dtypes(self) -> Dict[str, torch.dtype]:
        return dict(self._input_dtypes)

    @property
    def output_dtypes(self) -> Dict[str, torch.dtype]:
        return dict(self._output_dtypes)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(path={self.model_path!r}, device={self.device}, providers={self.providers}, "
            f"io_binding={self.io_binding}, inputs={self.input_names}, outputs={self.output_names})"
        )

    # ------------------------------------------------------------------------------------------------------ running
    def __call__(self, **inputs: InputValue) -> List[torch.Tensor]:
        """Runs the model. Keyword arguments are the model's inputs by name; returns its outputs in session order.

        On CUDA the run is enqueued on the model's stream after the caller's pending work, and the caller's stream
        waits for it: results are ready for whatever the caller enqueues next, and the host never waits.
        """
        self._check_input_names(inputs)
        if not self.io_binding:
            return self._run_without_binding(inputs)
        if self._stream is None:
            return self._run_bound(inputs)
        caller = torch.cuda.current_stream(self._device)
        if caller != self._stream:
            self._stream.wait_stream(caller)
        with torch.cuda.stream(self._stream):
            results = self._run_bound(inputs)
        if caller != self._stream:
            caller.wait_stream(self._stream)
        return results

    @property
    def stream(self) -> Optional["torch.cuda.Stream"]:
        """The CUDA stream ORT runs this model on (``None`` on the CPU or for a session without one)."""
        return self._stream

    def _run_bound(self, inputs: Mapping[str, InputValue]) -> List[torch.Tensor]:
        # `bound` holds every tensor whose pointer is bound until the run has returned (converted temporaries too).
        bound = {name: self._to_bindable(name, value) for name, value in inputs.items()}
        input_shapes = {name: tuple(tensor.shape) for name, tensor in bound.items()}
        output_shapes = self.shape_inferencer(input_shapes)
        if self.cuda_graph:
            results = self._run_graph(bound, input_shapes, output_shapes)
            if results is not None:
                return results
        outputs = self._output_tensors(input_shapes, output_shapes, bound)
        with self._lock:
            session = self._main_session()
            binding = self._binding
            try:
                for name, tensor in bound.items():
                    binding.bind_input(
                        name, self._ort_device_type, self._ort_device_id, TORCH_TO_ONNX[tensor.dtype],
                        list(tensor.shape), tensor.data_ptr(),
                    )
                for name, tensor in outputs.items():
                    if tensor is None:  # data-dependent or empty: ORT allocates it on the device
                        binding.bind_output(name, self._ort_device_type, self._ort_device_id)
                    else:
                        binding.bind_output(
                            name, self._ort_device_type, self._ort_device_id, TORCH_TO_ONNX[tensor.dtype],
                            list(tensor.shape), tensor.data_ptr(),
                        )
                if self._device.type == "cuda" and self._stream is None:
                    # ORT runs on a stream of its own: what torch wrote must be complete before it reads.
                    torch.cuda.current_stream(self._device).synchronize()
                session.run_with_iobinding(binding, self._run_options)
                results = []
                ort_values = None
                for index, (name, tensor) in enumerate(outputs.items()):
                    if tensor is None:
                        if ort_values is None:
                            ort_values = binding.get_outputs()
                        tensor = self._from_ort_value(ort_values[index], self._output_dtypes[name])
                    results.append(tensor)
            finally:
                # Never leave raw pointers behind in the binding once the tensors they point to may be freed.
                binding.clear_binding_inputs()
                binding.clear_binding_outputs()
        del bound
        return results

    # ------------------------------------------------------------------------------------------------ CUDA graphs
    def _run_graph(
        self,
        bound: Mapping[str, torch.Tensor],
        input_shapes: Mapping[str, Tuple[int, ...]],
        output_shapes: Mapping[str, Optional[Tuple[int, ...]]],
    ) -> Optional[List[torch.Tensor]]:
        """Runs through the CUDA graph of this input signature; ``None`` where this signature cannot have one."""
        signature = tuple(sorted(input_shapes.items()))
        if signature in self._graph_disabled:
            return None
        with self._lock:
            runner = self._graph_runners.get(signature)
            try:
                if runner is None:
                    runner = self._new_graph_runner(bound, input_shapes, output_shapes)
                    self._graph_runners[signature] = runner
                    while len(self._graph_runners) > self.max_graph_sessions:
                        self._graph_runners.popitem(last=False)
                self._graph_runners.move_to_end(signature)
                outputs = runner.run(bound)
            except Exception as error:  # capture refused (nodes left on the CPU, unsupported op): run without
                self._graph_runners.pop(signature, None)
                self._graph_disabled[signature] = str(error)
                warnings.warn(
                    f"{self.model_path or 'model'}: no CUDA graph for input shapes {dict(input_shapes)}; running "
                    f"without one. Why: {error}", RuntimeWarning, stacklevel=4,
                )
                return None
        results = [outputs[name] for name in self.output_names]
        return results if self.reuse_outputs else [tensor.clone() for tensor in results]

    def _new_graph_runner(
        self,
        bound: Mapping[str, torch.Tensor],
        input_shapes: Mapping[str, Tuple[int, ...]],
        output_shapes: Mapping[str, Optional[Tuple[int, ...]]],
    ) -> CudaGraphRunner:
        dynamic = [name for name, shape in output_shapes.items() if shape is None]
        if dynamic:
            raise RuntimeError(f"output {dynamic[0]!r} has a data-dependent shape, which a graph cannot replay")
        overrides, problems = free_dimension_overrides(self.shape_inferencer.input_dims, input_shapes)
        source, providers, options, base_sess_options = self._session_recipe
        if source is None:
            raise RuntimeError("the session was created from neither a path nor bytes, so it cannot be re-created "
                               "with fixed dims")
        sess_options = copy_session_options(base_sess_options)
        for dim, size in overrides.items():
            sess_options.add_free_dimension_override_by_name(dim, size)
        graph_options = [dict(opts) for opts in options]
        if providers[0] == "TensorrtExecutionProvider":
            graph_options[0].update(trt_cuda_graph_enable="1", **tensorrt_profile_options(input_shapes))
        else:
            graph_options[0]["enable_cuda_graph"] = "1"
        # The model's weights live once on the GPU: the plain session goes before the graph session loads (it is
        # re-created if a signature ever needs it).
        self._session = None
        self._binding = None  # an IOBinding holds its session (and so the weights) alive
        try:
            session = create_session(source, providers, graph_options, sess_options)
        except ValueError as error:
            raise RuntimeError(f"{error}{'; ' + '; '.join(problems) if problems else ''}") from error
        return CudaGraphRunner(
            session,
            {name: (tuple(input_shapes[name]), bound[name].dtype) for name in input_shapes},
            {name: (tuple(output_shapes[name]), self._output_dtypes[name]) for name in self.output_names},
            self._device,
            self._run_options,
        )

    def _main_session(self) -> ort.InferenceSession:
        """The plain session (all shapes, no graph), re-created if graph sessions replaced it."""
        if self._session is None:
            source, providers, options, sess_options = self._session_recipe
            self._session = create_session(source, providers, options, sess_options)
            self._binding = self._session.io_binding()
        return self._session

    def _check_input_names(self, inputs: Mapping[str, Any]) -> None:
        for name in inputs:
            if name not in self._input_dtypes:
                raise ValueError(f"unknown input {name!r}: the model's inputs are {self.input_names}")
        for name in self._input_dtypes:
            if name not in inputs:
                raise ValueError(
                    f"missing input {name!r}: the model's inputs are {self.input_names}, got {sorted(inputs)}"
                )

    def _to_bindable(self, name: str, value: InputValue) -> torch.Tensor:
        """Returns ``value`` as a contiguous tensor of the input's dtype on the session's device (the same tensor if
        it already is one)."""
        expected = self._input_dtypes[name]
        tensor = as_checked_tensor(name, value, expected)
        check_input_device(name, tensor.device, self._device)
        tensor = tensor.detach().to(device=self._device, dtype=expected)
        return tensor.contiguous()

    def _output_tensors(
        self,
        input_shapes: Mapping[str, Tuple[int, ...]],
        output_shapes: Mapping[str, Optional[Tuple[int, ...]]],
        bound_inputs: Mapping[str, torch.Tensor],
    ) -> Dict[str, Optional[torch.Tensor]]:
        """The output tensors to bind, in session order; ``None`` where ORT must allocate. Buffers are kept per
        thread and input signature: a call never overwrites what a call from another thread is still reading."""
        signature = (threading.get_ident(), tuple(sorted(input_shapes.items())))
        with self._lock:
            cached = self._output_buffers.get(signature) if self.reuse_outputs else None
            if cached is not None:
                input_storages = {t.untyped_storage().data_ptr() for t in bound_inputs.values() if t.numel()}
                if any(t is not None and t.numel() and t.untyped_storage().data_ptr() in input_storages
                       for t in cached.values()):
                    cached = None  # an input is an earlier output: never bind an output onto an input
                else:
                    self._output_buffers.move_to_end(signature)
                    return cached
        buffers: Dict[str, Optional[torch.Tensor]] = {}
        for name in self._output_dtypes:
            shape = output_shapes[name]
            if shape is None or 0 in shape:  # ORT refuses a null pointer, which an empty tensor has
                buffers[name] = None
            else:
                buffers[name] = torch.empty(shape, dtype=self._output_dtypes[name], device=self._device)
        if self.reuse_outputs:
            with self._lock:
                self._output_buffers[signature] = buffers
                self._output_buffers.move_to_end(signature)
                while len(self._output_buffers) > self.max_output_signatures:
                    self._output_buffers.popitem(last=False)
        return buffers

    @staticmethod
    def _from_ort_value(value: ort.OrtValue, dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.from_dlpack(value._ortvalue)  # zero copy; the capsule keeps ORT's buffer alive
        if tensor.dtype != dtype:  # ORT exports bool as uint8 over DLPack
            tensor = tensor.view(dtype)
        return tensor

    def _run_without_binding(self, inputs: Mapping[str, InputValue]) -> List[torch.Tensor]:
        """The numpy baseline: inputs to CPU numpy, ``session.run``, outputs wrapped as CPU torch tensors."""
        arrays = {}
        for name, value in inputs.items():
            expected = self._input_dtypes[name]
            tensor = as_checked_tensor(name, value, expected)
            arrays[name] = tensor.detach().to(device="cpu", dtype=expected).contiguous()
        self.shape_inferencer({name: tuple(t.shape) for name, t in arrays.items()})  # same shape errors as binding
        if any(t.dtype == torch.bfloat16 for t in arrays.values()) or torch.bfloat16 in self._output_dtypes.values():
            # numpy has no bfloat16: feed OrtValues instead of arrays
            feed = {
                name: ort.OrtValue.ortvalue_from_numpy_with_onnx_type(_numpy_bits(t), TORCH_TO_ONNX[t.dtype])
                for name, t in arrays.items()
            }
            values = self.session.run_with_ort_values(self.output_names, feed)
            return [self._from_ort_value(v, self._output_dtypes[n]).clone() for v, n in zip(values, self.output_names)]
        results = self.session.run(None, {name: t.numpy() for name, t in arrays.items()})
        return [torch.from_numpy(np.asarray(r)) for r in results]


def copy_session_options(base: Optional[ort.SessionOptions]) -> ort.SessionOptions:
    """A new ``SessionOptions`` with the settings of ``base`` that matter here (the user's object is never changed)."""
    copy = ort.SessionOptions()
    if base is not None:
        for attribute in ("graph_optimization_level", "intra_op_num_threads", "inter_op_num_threads", "execution_mode",
                          "log_severity_level", "log_verbosity_level", "enable_mem_pattern", "enable_mem_reuse",
                          "enable_cpu_mem_arena", "use_deterministic_compute"):
            setattr(copy, attribute, getattr(base, attribute))
    return copy


def check_input_device(name: str, device: torch.device, session_device: torch.device) -> None:
    """Refuses tensors that would need a silent copy between GPUs (or live on a device ORT cannot read)."""
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"input {name!r}: expected a CPU or CUDA tensor, got one on {device}")
    if device.type == "cuda" and session_device.type == "cuda" and device.index != session_device.index:
        raise ValueError(
            f"input {name!r}: expected a tensor on {session_device} (the session's device) or on the CPU, "
            f"got one on {device}; move it with .to({str(session_device)!r}) if the copy is intended"
        )


def _numpy_bits(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


def as_tensor(name: str, value: InputValue, expected: torch.dtype) -> torch.Tensor:
    """Wraps a torch tensor, numpy array or Python/numpy scalar as a torch tensor, without copying where possible."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        if value.dtype == object or value.dtype.kind not in "biuf":
            raise TypeError(f"input {name!r}: expected a numeric numpy array for dtype {expected}, got dtype {value.dtype}")
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        return torch.from_numpy(np.asarray(value))
    if isinstance(value, (bool, int, float)):
        python_dtype = torch.bool if isinstance(value, bool) else torch.int64 if isinstance(value, int) else torch.float64
        if not conversion_allowed(python_dtype, expected):
            raise TypeError(f"input {name!r}: expected dtype {expected}, got Python {type(value).__name__} {value!r}")
        return torch.tensor(value, dtype=expected)
    raise TypeError(
        f"input {name!r}: expected a torch.Tensor, numpy.ndarray or Python scalar, got {type(value).__name__}"
    )


def as_checked_tensor(name: str, value: InputValue, expected: torch.dtype) -> torch.Tensor:
    """:func:`as_tensor`, refusing a dtype that does not convert to ``expected`` without loss."""
    tensor = as_tensor(name, value, expected)
    if tensor.dtype != expected and not conversion_allowed(tensor.dtype, expected):
        raise TypeError(f"input {name!r}: expected dtype {expected}, got {tensor.dtype}, which does not convert "
                        "without loss (cast it explicitly if intended)")
    return tensor


def external_data_locations(model_path: Union[str, os.PathLike]) -> List[str]:
    """The relative paths of the external-data files an .onnx file references, in first-use order."""
    model = onnx.load(os.fspath(model_path), load_external_data=False)
    locations: "OrderedDict[str, None]" = OrderedDict()
    for tensor in _all_tensors(model.graph):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            for entry in tensor.external_data:
                if entry.key == "location":
                    locations[entry.value] = None
    return list(locations)


def _all_tensors(graph: onnx.GraphProto):
    """Initializers and tensor attributes of a graph and of its subgraphs (If/Loop/Scan bodies)."""
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors
            if attribute.HasField("g"):
                yield from _all_tensors(attribute.g)
            for subgraph in attribute.graphs:
                yield from _all_tensors(subgraph)


def resolve_model_file(
    model_id: Union[str, os.PathLike], subfolder: Optional[str], file_name: str, **hub_kwargs: Any
) -> str:
    """Finds ``model_id[/subfolder]/file_name`` locally, or downloads that folder from the Hugging Face Hub."""
    model_id = os.fspath(model_id)
    if os.path.isfile(model_id):
        return model_id
    if os.path.isdir(model_id):
        path = os.path.join(model_id, subfolder or "", file_name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"model_id: expected {file_name!r} in {os.path.join(model_id, subfolder or '')!r}, "
                                    f"found no such file")
        return path
    if model_id.count("/") > 1 or model_id.startswith((".", "/")):
        raise FileNotFoundError(f"model_id: {model_id!r} is neither a local file or folder nor a hub repository id")
    from huggingface_hub import snapshot_download

    pattern = f"{subfolder}/*" if subfolder else "*"
    folder = snapshot_download(model_id, allow_patterns=[pattern], **hub_kwargs)
    path = os.path.join(folder, subfolder or "", file_name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model_id: hub repository {model_id!r} has no {os.path.join(subfolder or '', file_name)!r}")
    return path
