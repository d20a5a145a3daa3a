"""IOBindingORTModel: runs an ONNX model through ONNX Runtime IO binding with torch tensors bound by ``data_ptr()``.

The model is the public face over the runtime's parts: its options (:mod:`.options`, resolved once), the session
recipe (:mod:`.session`), the owned weights (:mod:`.weights`), the graph pool (:mod:`.graph_pool`: input signature →
captured CUDA graph or fixed-shape session) and input conversion (:mod:`.inputs`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
from collections import OrderedDict
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import onnxruntime as ort
import torch

from ..errors import ArgumentError, ArgumentTypeError
from ..layout import LORA_MAP_NAME, cold_start_part_files, read_json_object
from .cuda_policy import DEVICE_SETUP, DISABLE_SYNC_RUN_OPTION
from .dtypes import ORT_TO_TORCH, TORCH_TO_ONNX, tensor_of_ort_value
from . import timeline
from .graph_pool import CudaGraphRunner, FixedShapeSession, GraphPool, signature_of
from .part_chain import PartChain
from .hub import (
    check_hub_kwargs,
    check_model_file,
    external_data_locations,
    keywords_of,
    load_declared_graph,
    load_graph,
    resolve_model_file,
)
from .inputs import InputValue, as_checked_tensor, check_input_names, numpy_bits, to_bindable
from .options import (
    MODEL_SETTINGS,
    NOT_GIVEN,
    CudaGraphSetting,
    ModelOptions,
    ProviderOptionsSpec,
    ProviderSpec,
    given_settings,
    provider_device,
)
from .session import SessionRecipe, create_session, declared_types
from .shapes import inferencer_from_model_proto, inferencer_from_session

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"


def session_device(session: ort.InferenceSession) -> torch.device:
    """The torch device where the session's first execution provider keeps its tensors."""
    providers = session.get_providers()
    by_name = session.get_provider_options()
    return provider_device(providers, [by_name.get(providers[0], {})])


def output_byte_limit(device: torch.device) -> Tuple[int, str]:
    """The most bytes one output buffer may take, and what that is: on CUDA the device's free memory (the driver's,
    plus what torch's allocator holds unused), on the CPU the host's available memory. A larger output could never
    be allocated (or would push the host into swap): :class:`~optimum_iobinding.runtime.shapes.ShapeInferencer`
    refuses it, naming the output, before anything is allocated."""
    if device.type == "cuda":
        with DEVICE_SETUP.setup():  # a memory query is no call to make beside a graph capture
            free, _ = torch.cuda.mem_get_info(device)
        unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free + unused, f"the free memory of {device}"
    return available_host_memory()


def available_host_memory() -> Tuple[int, str]:
    """The host memory a new allocation can have without swapping: Linux's MemAvailable, else the physical memory,
    else a fixed 1 TiB."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "the host's available memory"
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "the host's physical memory"
    except (ValueError, OSError, AttributeError):
        return 1 << 40, "a fixed bound of 1 TiB"


class IOBindingORTModel:
    """An ONNX model run by ONNX Runtime with torch tensors bound in place: torch in, torch out, on ``self.device``.

    Offers the surface of diffusers' ``OnnxRuntimeModel`` (``from_pretrained``, ``save_pretrained``, ``load_model``,
    ``__call__(**inputs)``) without depending on it.

    Inputs (``io_binding=True``): a torch tensor already on ``self.device``, of the input's dtype and contiguous, is
    bound as it is: no copy. Anything else is converted once (see :mod:`optimum_iobinding.runtime.inputs`), and the
    converted tensor is held until the run ends.

    Outputs:
        A list of torch tensors on ``self.device`` in the session's output order. Outputs live in buffers allocated
        once per input-shape signature and reused by later calls with the same shapes: **a later call overwrites
        what an earlier one returned** (clone what you keep, or pass ``reuse_outputs=False`` for fresh tensors).
        At most ``max_output_signatures`` signatures per thread keep buffers (least recently used dropped first).
        An output is never bound to an input's memory: a call whose input is an earlier output gets fresh output
        tensors. An output whose shape depends on the data is allocated by ORT and handed over via DLPack.

    Threads: one lock per model serializes binding and running; reused output buffers belong to the thread that
    made them (``threading.local``: they die with it, and a later thread never gets them), so calls from several
    threads never overwrite each other's results. A captured CUDA graph has one set of output buffers, shared by
    every thread: clone what you keep before another thread calls (pipelines serialize their calls). On CUDA with
    ``io_binding=True``, a model made from a file makes and runs its sessions on one thread of its own (its recipe's
    :class:`~optimum_iobinding.runtime.session_thread.SessionThread`; the caller waits for each call's host part):
    ORT's CUDA provider keeps a context of device memory per thread that touches a session, so one per session,
    whichever threads call. A model made from a given session runs it in the calling thread.

    CUDA (``io_binding=True``): provider options default to :data:`~optimum_iobinding.runtime.cuda_policy.CUDA_DIFFUSION_DEFAULTS`
    (the user's win); the model runs on one CUDA stream (``stream``, else its own) with
    ``disable_synchronize_execution_providers=1``: no host synchronization anywhere in a call. Each input signature
    gets an entry of its own in the graph pool: with ``cuda_graph`` a CUDA graph captured on its first run and
    replayed after (new inputs are copied into its fixed input buffers; its outputs are always the same tensors).
    The graphs of all signatures live in one session with dynamic dims (selected by ``gpu_graph_id``) and share its
    arena: the device holds the activations of the largest signature, not the sum. Where ORT refuses such a session
    (a node left on the CPU), each signature gets a session whose free dims are fixed to its shapes. Where capture is
    off or fails, a fixed-shape session runs the signature without a graph (its convolutions keep the algorithms
    chosen for that shape, which ORT searches again whenever a session's shape changes). All of them use one copy of
    the weights: the one session loads them itself from the file; where a second session is needed (a signature ORT
    cannot capture in it, a model ORT refuses as one session, :meth:`own_weights` for runtime LoRA), they become
    tensors the project owns, read by every session (``share_weights``).

    With ``io_binding=False`` the model runs plain ``session.run`` on numpy arrays — the numpy baseline — and returns
    CPU torch tensors.

    A ``model.onnx`` with cold-start parts beside it (``cold_part_0.onnx`` …, an export's ``cold_start_parts``) runs
    through them in turn (:mod:`~optimum_iobinding.runtime.part_chain`, :attr:`cold_start_parts`): each part a model
    of its own with this one's settings and stream, their sessions and first runs made side by side; the whole
    model's session is made only if asked for (:attr:`session`).

    Args:
        session_or_path: a path to an .onnx file, or an ``onnxruntime.InferenceSession``.
        provider, provider_options, sess_options, io_binding, reuse_outputs, max_output_signatures, stream,
            cuda_graph, max_graph_signatures, share_weights: the model's settings, each declared with its default
            and its meaning in :class:`~optimum_iobinding.runtime.options.ModelOptions`; a setting not given takes
            its default. With a session, only ``io_binding``, ``reuse_outputs``, ``max_output_signatures``,
            ``cuda_graph`` and ``max_graph_signatures`` apply (the session was made with the rest).
        config: the component's config (``from_pretrained`` reads the ``config.json`` beside the model, as optimum
            writes it); pipelines read scaling factors and channel counts from it.
        options: the settings resolved already (:meth:`ModelOptions.resolve
            <optimum_iobinding.runtime.options.ModelOptions.resolve>`, what pipelines pass); give either
            ``options`` or the settings, not both.
    """

    SIBLING_SETTINGS = MODEL_SETTINGS

    def __init__(
        self,
        session_or_path: Union[ort.InferenceSession, str, os.PathLike],
        *,
        provider: ProviderSpec = NOT_GIVEN,
        provider_options: ProviderOptionsSpec = NOT_GIVEN,
        sess_options: Optional[ort.SessionOptions] = NOT_GIVEN,
        io_binding: bool = NOT_GIVEN,
        reuse_outputs: bool = NOT_GIVEN,
        max_output_signatures: int = NOT_GIVEN,
        config: Optional[Dict[str, Any]] = None,
        stream: Optional["torch.cuda.Stream"] = NOT_GIVEN,
        cuda_graph: CudaGraphSetting = NOT_GIVEN,
        max_graph_signatures: Optional[int] = NOT_GIVEN,
        share_weights: Optional[bool] = NOT_GIVEN,
        options: Optional[ModelOptions] = None,
    ):
        settings = dict(
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
            options = ModelOptions.alone(options, given_settings(**settings))
        if isinstance(session_or_path, _Recipe):  # a sibling: the recipe (and its weights) of another model
            recipe, session = session_or_path.recipe, None
            options = options or recipe.options
        elif isinstance(session_or_path, ort.InferenceSession):
            session = session_or_path
            if options is None:
                options = ModelOptions.of_session(
                    session,
                    io_binding,
                    reuse_outputs=reuse_outputs,
                    max_output_signatures=max_output_signatures,
                    cuda_graph=cuda_graph,
                    max_graph_signatures=max_graph_signatures,
                    stream=stream,
                )
            recipe = SessionRecipe.for_session(session, options)
        elif isinstance(session_or_path, (str, os.PathLike)):
            check_model_file(os.fspath(session_or_path))  # missing or empty: named before any option is resolved
            options = options or ModelOptions.resolve(**settings)
            recipe = SessionRecipe(os.fspath(session_or_path), options)
            session = None
        else:
            raise TypeError(
                "session_or_path: expected an onnxruntime.InferenceSession or a path to an .onnx file, "
                f"got {type(session_or_path).__name__}"
            )
        device = recipe.device
        io_binding = options.io_binding
        # CUDA: the stream ORT runs on (ours, or the one the given session was created with); None means ORT's own
        # stream, which costs a host synchronization before and after every run.
        stream_in_use = recipe.stream if device.type == "cuda" and io_binding else None
        pool_possible = device.type == "cuda" and io_binding and stream_in_use is not None and recipe.can_create
        if options.cuda_graph is True and not pool_possible:
            if device.type != "cuda" or not io_binding:
                raise ArgumentError(
                    "cuda_graph",
                    f"needs a CUDA session with io_binding=True, got device {device} and io_binding={io_binding}",
                )
            if stream_in_use is None:
                raise ArgumentError(
                    "cuda_graph",
                    "needs the session's stream; create the model from a path (or a session "
                    "made with the provider option user_compute_stream)",
                )
            raise ArgumentError(
                "cuda_graph",
                "the session was created from neither a path nor bytes, so no session "
                "with fixed dims can be made for a graph",
            )
        weights = recipe.weights
        keeps_pool = pool_possible and (options.cuda_graph is not False or weights.owned or weights.on_need)
        # the cold-start parts beside a component's model.onnx run the model (:mod:`.part_chain`): no whole session
        # (a model made from a given session runs that session)
        parts = (
            cold_start_part_files(Path(recipe.source).parent)
            if session is None and isinstance(recipe.source, str) and os.path.basename(recipe.source) == "model.onnx"
            else []
        )
        if session is None and not (keeps_pool and isinstance(recipe.source, str)) and not parts:
            session = recipe.create()
        if session is not None:
            input_types = {i.name: i.type for i in session.get_inputs()}
            output_types = {o.name: o.type for o in session.get_outputs()}
            shape_inferencer = inferencer_from_session(session, recipe.source)
        else:
            # the graph pool runs every signature: the plain dynamic session is made only if a signature needs it, and
            # what the model declares is read from the file: its inputs and outputs alone, unless the weights are
            # owned from the start (then the whole graph, which the weights load from instead of parsing it again)
            with timeline.step(f"parse {recipe.source} (declared inputs)"):
                graph_only = load_graph(recipe.source) if weights.owned else load_declared_graph(recipe.source)
            input_types, output_types = declared_types(graph_only)
            shape_inferencer = inferencer_from_model_proto(graph_only, recipe.source)
            if weights.owned:
                weights.adopt(graph_only)
            del graph_only
        input_dtypes = {name: ORT_TO_TORCH.get(kind) for name, kind in input_types.items()}
        output_dtypes = {name: ORT_TO_TORCH.get(kind) for name, kind in output_types.items()}
        for kind, dtypes, types in (("input", input_dtypes, input_types), ("output", output_dtypes, output_types)):
            for name, dtype in dtypes.items():
                if dtype is None:
                    raise TypeError(
                        f"{kind} {name!r} has type {types[name]}; IOBindingORTModel supports tensors of "
                        f"{sorted(t[7:-1] for t in ORT_TO_TORCH)}"
                    )
        self.options = options
        self._recipe = recipe
        self._session = session
        self._device = device
        self._input_dtypes: Dict[str, torch.dtype] = input_dtypes  # type: ignore[assignment]
        self._output_dtypes: Dict[str, torch.dtype] = output_dtypes  # type: ignore[assignment]
        self.io_binding = io_binding
        self.reuse_outputs = options.reuse_outputs
        self.max_output_signatures = options.max_output_signatures
        self.model_path: Optional[str] = recipe.source if isinstance(recipe.source, str) else None
        self.config: Dict[str, Any] = dict(config or {})
        self.shape_inferencer = shape_inferencer
        # every new input signature's outputs are sized against the device's memory before any is allocated
        shape_inferencer.bound_outputs(
            {name: dtype.itemsize for name, dtype in self._output_dtypes.items()}, lambda: output_byte_limit(device)
        )
        self._ort_device_type = "cuda" if device.type == "cuda" else "cpu"
        self._ort_device_id = device.index or 0
        self._thread_state = threading.local()  # per thread: its reused output buffers
        self._binding = session.io_binding() if io_binding and session is not None else None
        self._lock = threading.Lock()
        self._stream = stream_in_use
        self._run_options = ort.RunOptions()
        if self._stream is not None:
            self._run_options.add_run_config_entry(DISABLE_SYNC_RUN_OPTION, "1")
        self.cuda_graph: CudaGraphSetting = options.cuda_graph if pool_possible else False
        self.max_graph_signatures = options.max_graph_signatures
        self._pool: Optional[GraphPool] = None
        if keeps_pool:
            self._pool = GraphPool(
                recipe,
                self.cuda_graph,
                self.max_graph_signatures,
                output_dtypes,
                self._run_options,
                name=self.model_path or "model",
            )
        self._run_watchers: List[List[RunRecord]] = []
        self._preparing: Optional[threading.Thread] = None  # prepare's thread, while it builds the session
        self._chain: Optional[PartChain] = None  # set before the parts are made: making one may own the weights
        if parts:
            self._chain = PartChain([str(path) for path in parts], self._part_model, shared=weights.owned)

    def _options_with(self, method: str, changes: Mapping[str, Any]) -> ModelOptions:
        """This model's options (its settings as they are now) with ``changes``, settings among
        :attr:`SIBLING_SETTINGS`; one that is not is refused in ``method``'s name."""
        unknown = sorted(set(changes) - set(self.SIBLING_SETTINGS))
        if unknown:
            raise ArgumentTypeError(method, f"expected settings among {list(self.SIBLING_SETTINGS)}, got {unknown}")
        return self.options.replace(**{**self.options.settings(), "cuda_graph": self.cuda_graph, **changes})

    def sibling(self, **changes: Any) -> "IOBindingORTModel":
        """A new model from the same recipe (file, providers, options, CUDA stream and owned weights), with sessions
        of its own.

        Args:
            changes: settings to differ from this model's, among ``reuse_outputs``, ``max_output_signatures``,
                ``cuda_graph`` and ``max_graph_signatures``.
        """
        options = self._options_with("sibling", changes)
        if not self._recipe.can_create:
            raise RuntimeError(
                "sibling: the session was created from neither a path nor bytes, so it cannot be created again"
            )
        if self._pool is not None and self._recipe.weights.on_need:
            self.own_weights()  # the sibling's sessions and this model's read one copy of the weights
        return IOBindingORTModel(_Recipe(self._recipe), config=self.config, options=options)

    def part(self, path: Union[str, os.PathLike], **changes: Any) -> "IOBindingORTModel":
        """A model of another graph that names this model's weights (a part cut out of this model's graph at export,
        reading the same weights file), whose sessions read the weights this model's sessions read: one copy on the
        device. It has sessions, CUDA graphs and output buffers of its own, and this model's settings and stream.

        Where this model's weights are owned (runtime LoRA owns them, on any device) or would be owned on need (CUDA
        with the graph pool, the default) the part's sessions read those tensors, owned from now on
        (:meth:`own_weights`): a change made in place (a LoRA) reaches the part too. Elsewhere (the CPU without
        LoRA, ``share_weights=False``) the part loads its weights from the file itself, as every session there does;
        weights owned later are not the part's (make the part again). ``changes``: settings of the part to differ
        from this model's, as for :meth:`sibling`.

        Raises:
            ArgumentError: ``path`` is not a file.
            ArgumentTypeError: a setting not among :meth:`sibling`'s.
            RuntimeError: this model's session was made outside (it cannot be created again).
        """
        check_model_file(os.fspath(path))
        options = self._options_with("part", changes)
        if not self._recipe.can_create:
            raise RuntimeError(
                "part: the session was created from neither a path nor bytes, so the weights it read "
                "cannot be shared with another graph"
            )
        recipe = SessionRecipe(os.fspath(path), options)
        weights = self._recipe.weights
        if weights.owned or (self._pool is not None and weights.on_need):
            self.own_weights()
            recipe.weights = weights  # ORT ignores the initializers a part's graph does not name
        return IOBindingORTModel(_Recipe(recipe), config=self.config, options=options)

    def _part_model(self, path: str, shared: bool) -> "IOBindingORTModel":
        """A cold-start part's model (:mod:`.part_chain`): reading this model's owned weights where ``shared``
        (:meth:`part`), loading its own from the file otherwise; this model's settings and stream either way."""
        # the parts' outputs are their graphs' buffers, which the next parts' graphs read (a clone of the last part's
        # where this model gives fresh tensors)
        if shared:
            return self.part(path, reuse_outputs=True)
        return IOBindingORTModel(path, config=self.config, options=self._options_with("part", {"reuse_outputs": True}))

    def cold_start_part_shapes(self, input_shapes: Mapping[str, Sequence[int]]) -> List[Dict[str, Tuple[int, ...]]]:
        """Each cold-start part's input shapes for a call with these (this model's input shapes), known before any run
        from the declared dims of the parts before it; empty where the model runs as one graph."""
        check_input_names(input_shapes, self.input_names)
        return self._chain.input_shapes(input_shapes) if self._chain is not None else []

    @property
    def cold_start_parts(self) -> List["IOBindingORTModel"]:
        """The models of the cold-start parts that run this model, in order (:mod:`.part_chain`: the parts an export
        writes beside a UNet's ``model.onnx``); empty where the model runs as one graph."""
        return list(self._chain.models) if self._chain is not None else []

    # ----------------------------------------------------------------------------------------------------- loading
    @staticmethod
    def load_model(
        path: Union[str, os.PathLike],
        provider: ProviderSpec = NOT_GIVEN,
        sess_options: Optional[ort.SessionOptions] = NOT_GIVEN,
        provider_options: ProviderOptionsSpec = NOT_GIVEN,
    ) -> ort.InferenceSession:
        """Creates an ``onnxruntime.InferenceSession`` for ``path`` with the given provider(s), as diffusers does
        (not given: the defaults of :class:`~optimum_iobinding.runtime.options.ModelOptions`).

        Raises:
            FileNotFoundError: no file at ``path``.
            ValueError: the provider is not available, or ORT cannot load the file.
        """
        options = ModelOptions.resolve(provider, provider_options, sess_options, io_binding=False)
        return create_session(os.fspath(path), options.providers, options.provider_options, options.sess_options)

    @classmethod
    def from_pretrained(
        cls,
        model_id: Union[str, os.PathLike],
        subfolder: Optional[str] = None,
        file_name: str = "model.onnx",
        provider: ProviderSpec = NOT_GIVEN,
        provider_options: ProviderOptionsSpec = NOT_GIVEN,
        sess_options: Optional[ort.SessionOptions] = NOT_GIVEN,
        io_binding: bool = NOT_GIVEN,
        reuse_outputs: bool = NOT_GIVEN,
        stream: Optional["torch.cuda.Stream"] = NOT_GIVEN,
        cuda_graph: CudaGraphSetting = NOT_GIVEN,
        max_graph_signatures: Optional[int] = NOT_GIVEN,
        share_weights: Optional[bool] = NOT_GIVEN,
        max_output_signatures: int = NOT_GIVEN,
        options: Optional[ModelOptions] = None,
        **hub_kwargs: Any,
    ) -> "IOBindingORTModel":
        """Loads ``model_id/subfolder/file_name`` (a file, a local folder or a Hugging Face Hub id).

        Args:
            model_id: an .onnx file, a folder holding one, or a hub repository id.
            subfolder: folder inside ``model_id`` (a pipeline's component folder, say).
            file_name: the model's file name inside that folder.
            provider, provider_options, sess_options, io_binding, reuse_outputs, stream, cuda_graph,
                max_graph_signatures, share_weights, max_output_signatures, options: as for the constructor.
            **hub_kwargs: passed to ``huggingface_hub.snapshot_download`` for hub ids (revision, token, cache_dir,
                local_files_only, force_download, proxies, local_dir).

        Returns:
            The loaded model.
        """
        check_hub_kwargs("IOBindingORTModel.from_pretrained", hub_kwargs, keywords_of(cls.from_pretrained))
        options = ModelOptions.resolve(  # checked before anything is downloaded
            provider,
            provider_options,
            sess_options,
            io_binding,
            reuse_outputs,
            max_output_signatures,
            cuda_graph,
            max_graph_signatures,
            share_weights,
            stream,
            options=options,
        )
        path = resolve_model_file(model_id, subfolder, file_name, **hub_kwargs)
        config = read_json_object(os.path.join(os.path.dirname(path), CONFIG_NAME))
        return cls(path, config=config, options=options)

    def save_pretrained(
        self, save_directory: Union[str, os.PathLike], file_name: str = "model.onnx", overwrite: bool = False
    ) -> str:
        """Writes the model, every external-data file it references, its cold-start parts, config and LoRA map (if
        any) into ``save_directory``. A file of the same name already there is an error unless ``overwrite=True`` (a save
        onto the model's own files leaves them as they are); each file is written beside its place and renamed
        into it, so a failed save never leaves half a file. Cold-start parts there past the model's own, which the
        saved ``model.onnx`` would run through, count as such files: ``overwrite=True`` removes them.

        Returns:
            The path of the written .onnx file.
        """
        directory = Path(save_directory)
        if directory.exists() and not directory.is_dir():
            raise FileExistsError(f"save_directory: expected a folder, got the file {str(directory)!r}")
        target = directory / file_name
        source = self.model_path
        writes: List[Tuple[Optional[str], Path, Optional[bytes]]] = []  # (file to copy, target, or bytes to write)
        if source is None:
            if not isinstance(self._recipe.source, bytes):
                raise ArgumentError("save_pretrained", "this session was created from neither a path nor bytes")
            writes.append((None, target, self._recipe.source))
        else:
            writes.append((source, target, None))
            for location in external_data_locations(source):
                writes.append((os.path.join(os.path.dirname(source), location), directory / location, None))
            for part in self._chain.paths if self._chain is not None else ():  # they read the same weights files
                writes.append((part, directory / os.path.basename(part), None))
            lora_map = os.path.join(os.path.dirname(source), LORA_MAP_NAME)  # where LoRA finds each layer's weight
            if os.path.isfile(lora_map):
                writes.append((lora_map, directory / LORA_MAP_NAME, None))
        if self.config:
            writes.append((None, directory / CONFIG_NAME, json.dumps(self.config, indent=2, sort_keys=True).encode()))
        same = {
            path
            for copy_from, path, data in writes
            if path.exists()
            and (os.path.samefile(copy_from, path) if copy_from is not None else path.read_bytes() == data)
        }
        existing = [str(path) for _, path, _ in writes if path.exists() and path not in same]
        # cold-start parts there past this model's own (none, or fewer): the saved model.onnx would run through them
        ours = len(self._chain.paths) if self._chain is not None and source is not None else 0
        # (none where the saved model.onnx is the file already there: the parts there were made from it)
        stale = cold_start_part_files(directory)[ours:] if file_name == "model.onnx" and target not in same else []
        existing += [str(path) for path in stale]
        if existing and not overwrite:
            raise FileExistsError(
                f"save_directory: expected no files named like the model's there, got "
                f"{existing}; pass overwrite=True to replace them"
            )
        directory.mkdir(parents=True, exist_ok=True)
        for path in stale:  # overwrite=True: the folder's parts are this model's now (the first one out first)
            path.unlink()
        for copy_from, path, data in writes:
            if path in same:
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            scratch = path.with_name(path.name + ".partial")
            if data is not None:
                scratch.write_bytes(data)
            else:
                shutil.copyfile(copy_from, scratch)
            os.replace(scratch, path)
        return str(target)

    # -------------------------------------------------------------------------------------------------- properties
    @property
    def session(self) -> ort.InferenceSession:
        """The model's dynamic session (all shapes, no graph): the same object for the model's whole life. With a
        graph pool (CUDA) it is created on first use: every signature runs in a graph or fixed-shape session of the
        pool, and this one only where both fail."""
        if self._session is None:
            with self._lock:
                if self._session is None:
                    if self._pool is not None:  # a second session of the recipe: one copy of the weights for both
                        self._pool.before_another_session("it needs its dynamic session")
                    session = self._recipe.create()
                    self._binding = session.io_binding() if self.io_binding else None
                    self._session = session
        return self._session

    @property
    def device(self) -> torch.device:
        """``cuda:N`` for the CUDA and TensorRT providers, ``cpu`` otherwise."""
        return self._device

    @property
    def providers(self) -> List[str]:
        return list(self._recipe.providers)

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

    @property
    def input_dims(self) -> Dict[str, Optional[List[Union[int, str, None]]]]:
        """Each input's declared dims as ORT reports them: ``int`` (static), ``str`` (named) or ``None``."""
        return {name: None if dims is None else list(dims) for name, dims in self.shape_inferencer.input_dims.items()}

    @property
    def output_dims(self) -> Dict[str, Optional[List[Union[int, str, None]]]]:
        """Each output's declared dims as ORT reports them: ``int`` (static), ``str`` (named) or ``None``."""
        return {name: None if dims is None else list(dims) for name, dims in self.shape_inferencer.output_dims.items()}

    @property
    def stream(self) -> Optional["torch.cuda.Stream"]:
        """The CUDA stream ORT runs this model on (``None`` on the CPU or for a session without one)."""
        return self._stream

    @property
    def sessions_created(self) -> int:
        """How many ORT sessions this model's recipe has created (its siblings' included): a service that has
        warmed up creates none."""
        return self._recipe.sessions_created + (self._chain.sessions_created if self._chain is not None else 0)

    @property
    def session_creation_log(self) -> List[Tuple[str, float]]:
        """Each session creation of this model's recipe: ``("session", seconds)``, or ``("refused", seconds)`` for
        an attempt ORT refused (the one graph session of a model with a node on the CPU)."""
        return list(self._recipe.creation_log) + (self._chain.session_creation_log if self._chain is not None else [])

    @property
    def graph_signatures(self) -> List[Dict[str, Tuple[int, ...]]]:
        """The input shapes captured as CUDA graphs (least recently used first)."""
        return [dict(signature) for signature in self._pool.captured] if self._pool is not None else []

    @property
    def signatures(self) -> List[Dict[str, Tuple[int, ...]]]:
        """Every input signature with an entry in the graph pool (captured or not)."""
        if self._pool is None:
            return []
        with self._pool.lock:
            return [dict(signature) for signature in self._pool.entries]

    @property
    def graph_fallbacks(self) -> Dict[Tuple, str]:
        """Signature → why it runs without a CUDA graph (a model run as its cold-start parts: each part's, the part's
        number first in the key)."""
        if self._chain is not None:
            return self._chain.graph_fallbacks
        return dict(self._pool.fallbacks) if self._pool is not None else {}

    @property
    def keeps_session_per_signature(self) -> bool:
        """Whether each input signature runs apart from the others (the graph pool, on CUDA): in a graph of its own
        or a fixed-shape session, so that a shape change never makes ORT search convolution algorithms again."""
        return self._pool is not None

    def own_weights(self) -> Dict[str, torch.Tensor]:
        """:attr:`owned_weights`, made so where the model was created without them (the default everywhere until a
        second session or runtime LoRA needs them): sessions that loaded the weights themselves are dropped, and
        the next run creates its session anew around the owned tensors (once; on CUDA its graphs are captured
        again). Runtime LoRA changes these tensors in place.

        Raises:
            RuntimeError: the model keeps captured graphs or fixed-shape sessions without owned weights
                (``share_weights=False`` on CUDA), or its session cannot be created again.
        """
        weights = self._recipe.weights
        if not weights.owned:
            if self._pool is not None and not weights.on_need:
                raise RuntimeError(
                    "own_weights: this model keeps per-signature sessions without owned weights "
                    "(share_weights=False); create it with share_weights=True (or the default)"
                )
            if not self._recipe.can_create:
                raise RuntimeError(
                    "own_weights: the session was created from neither a path nor bytes, so it "
                    "cannot be created again around owned weights"
                )
            with self._lock:
                if self._pool is not None:
                    self._pool.own_weights("own_weights() was called")
                else:
                    weights.start_owning()
                self._session = None
                self._binding = None
        if self._chain is not None:  # the parts read the owned tensors from now on: a change in place reaches them
            self._chain.share_weights()
        return self._recipe.weights.tensors

    @property
    def owned_weights(self) -> Dict[str, torch.Tensor]:
        """The weights every session of this model reads, by initializer name (empty unless ``share_weights``).
        Change them in place only: their addresses are bound into the sessions and captured graphs."""
        return self._recipe.weights.tensors

    @property
    def output_signatures(self) -> int:
        """How many input signatures keep reused output buffers in the calling thread."""
        return len(self._thread_buffers())

    def graph_runner(self, input_shapes: Mapping[str, Sequence[int]]) -> Optional[CudaGraphRunner]:
        """The captured graph of these input shapes, or ``None`` (benchmarks replay it alone; none for a model run as
        its cold-start parts, each of which has its own)."""
        if self._pool is None or self._chain is not None:
            return None
        with self._pool.lock:
            entry = self._pool.entries.get(signature_of(input_shapes))
        return entry if isinstance(entry, CudaGraphRunner) else None

    def graph_input_buffers(self, input_shapes: Mapping[str, Sequence[int]]) -> Optional[Dict[str, torch.Tensor]]:
        """The tensors the CUDA graph of these input shapes reads its inputs from, by input name, or ``None`` where
        these shapes have no graph (yet: a signature's graph exists from its first call).

        A call that passes one of these tensors as that very input skips its copy: a loop can write an input
        straight into it (``torch.cat(..., out=buffer)``) or copy an input that stays the same over many calls once.
        Write them on the model's stream (or one ordered with it): the graph reads them when it replays, and a call
        passing other tensors overwrites them. They belong to whoever calls the model, as its reused outputs do. A
        model run as its cold-start parts gives its first part's, for the inputs that part reads."""
        if self._chain is not None:
            return self._chain.first_part_buffers(input_shapes)
        runner = self.graph_runner(input_shapes)
        return dict(runner.input_buffers) if runner is not None else None

    def adopt_graph_inputs(
        self, input_shapes: Mapping[str, Sequence[int]], buffers: Mapping[str, torch.Tensor]
    ) -> bool:
        """Makes the CUDA graph of these input shapes now, reading the inputs named in ``buffers`` from those very
        tensors instead of buffers of its own (:meth:`graph_input_buffers` then returns them): another model's reused
        outputs, say, which the graph's first call then reads without a copy and without the device holding them
        twice. Later calls passing other tensors copy into them, as into any graph input buffer.

        Args:
            input_shapes: every input's shape, by name (the graph's signature).
            buffers: some of those inputs, by name: contiguous tensors on :attr:`device` of the input's dtype and
                shape.

        Returns:
            Whether the graph reads them: ``False`` where the model captures no graph, these shapes have an entry
            already (made by an earlier call, which keeps its own buffers), ORT refused the graph, or a tensor was
            made in ``torch.inference_mode`` (a later call outside it could not copy into it).

        Raises:
            ArgumentTypeError, ArgumentError: a buffer that is not such a tensor, or an unknown or missing name.
        """
        try:
            check_input_names(input_shapes, self.input_names)
        except ValueError as error:
            raise ArgumentError("input_shapes", str(error)) from error
        unknown = [name for name in buffers if name not in self.input_names]
        if unknown:
            raise ArgumentError("buffers", f"expected some of the model's inputs {self.input_names}, got {unknown}")
        shapes = {name: tuple(int(d) for d in shape) for name, shape in input_shapes.items()}
        for name, tensor in buffers.items():
            if not isinstance(tensor, torch.Tensor):
                raise ArgumentTypeError(f"buffers[{name!r}]", f"expected a torch tensor, got {type(tensor).__name__}")
            expected = (shapes[name], self._input_dtypes[name], self.device)
            if (tuple(tensor.shape), tensor.dtype, tensor.device) != expected or not tensor.is_contiguous():
                raise ArgumentError(
                    f"buffers[{name!r}]",
                    f"expected a contiguous tensor of shape {shapes[name]} and dtype {expected[1]} on {self.device}, "
                    f"got {'one' if tensor.is_contiguous() else 'a non-contiguous one'} of shape {tuple(tensor.shape)} "
                    f"and dtype {tensor.dtype} on {tensor.device}",
                )
        if self._chain is not None:  # the first part's graph reads those of its inputs
            return self._chain.adopt_first_part_inputs(shapes, buffers)
        pool = self._pool
        if pool is None or not self.cuda_graph or any(tensor.is_inference() for tensor in buffers.values()):
            return False
        with self._lock, torch.cuda.stream(self._stream):
            if signature_of(shapes) in pool.entries:
                return False
            entry = self._new_entry(shapes, dict(buffers))
        return isinstance(entry, CudaGraphRunner) and all(
            entry.input_buffers[name] is tensor for name, tensor in buffers.items()
        )

    def _new_entry(
        self, input_shapes: Mapping[str, Tuple[int, ...]], input_buffers: Optional[Mapping[str, torch.Tensor]] = None
    ) -> Union[CudaGraphRunner, FixedShapeSession, None]:
        """The graph pool's entry of these input shapes, made here where it is not made yet (a device set-up: a
        runner's buffers are allocated). Called holding the model's lock (first, then the set-up: a call of this model
        that holds the lock may wait in the capture's gate for the set-ups to end), on the model's stream."""
        specs = {name: (shape, self._input_dtypes[name]) for name, shape in input_shapes.items()}
        output_shapes = self.shape_inferencer(input_shapes)
        with DEVICE_SETUP.setup():
            return self._pool.entry(self.shape_inferencer.input_dims, specs, output_shapes, input_buffers)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(path={self.model_path!r}, device={self.device}, providers={self.providers}, "
            f"io_binding={self.io_binding}, cuda_graph={self.cuda_graph!r}, inputs={self.input_names}, "
            f"outputs={self.output_names})"
        )

    # ------------------------------------------------------------------------------------------------------ warm-up
    def prepare(self, wait: bool = True) -> Optional[threading.Thread]:
        """Creates, ahead of the first call, the session that needs no input shapes: on CUDA the one session whose
        graphs every signature shares (nothing where the model keeps a session per signature, or has its session
        already). ``wait=False`` builds it in a background thread, which is returned: ORT releases the GIL while it
        builds a session, so a pipeline makes its components' sessions while an earlier component runs. A call that
        needs the session meanwhile waits for it; a session ORT refuses is reported as a call would report it."""
        if self._chain is not None:  # each part's, side by side
            threads = self._chain.prepare(wait)
            return threads[0] if threads else None
        pool = self._pool
        if pool is None or not pool.one_session or pool.shared_tried:
            return None
        if wait:
            pool.shared_session()
            return None
        building = self._preparing
        if building is not None and building.is_alive():  # an earlier prepare's thread builds it
            return None
        # not a daemon: the interpreter waits for a session being built rather than tearing ORT down under it
        thread = self._preparing = threading.Thread(target=pool.shared_session, name=f"prepare {self.model_path}")
        thread.start()
        return thread

    def prepare_signature(self, input_shapes: Mapping[str, Sequence[int]]) -> Optional[threading.Thread]:
        """Starts, in a background thread, what the first call with these input shapes would make before its capture:
        the session (where not made yet), the signature's graph runner and ORT's run without a graph (cuDNN's plans
        for each convolution and attention shape, the arena's memory); the capture stays with that first call, which
        waits for the thread. A pipeline starts its VAE decoder's this way when the denoising loop starts. Returns the
        thread, or ``None`` where the model captures no graph or these shapes have run already."""
        if self._chain is not None:  # each part's graph, linked, and first run (side by side for the first)
            check_input_names(input_shapes, self.input_names)
            return self._chain.prepare_signature(input_shapes)
        pool = self._pool
        if pool is None or not self.cuda_graph:
            return None
        check_input_names(input_shapes, self.input_names)
        shapes = {name: tuple(int(d) for d in shape) for name, shape in input_shapes.items()}
        signature = signature_of(input_shapes)
        if signature in pool.entries:  # read without the pool's lock, which a build holds
            made = pool.entries.get(signature)
            # a graph made ahead (adopt_graph_inputs) that can run once without capturing, and has not: warmed below
            if not (isinstance(made, CudaGraphRunner) and made.warm_options is not None and not made.first_run_made):
                return None

        def prepare() -> None:
            try:
                make()
            except Exception as error:  # the first call with these shapes makes them again, and reports what fails
                logger.debug("%s: preparing %s failed: %s", self.model_path, dict(input_shapes), error)

        def make() -> None:
            with self._lock, torch.cuda.stream(self._stream):
                entry = self._new_entry(shapes)
                if isinstance(entry, CudaGraphRunner) and not entry.first_run_made:
                    entry.warm()

        # not a daemon: the interpreter waits for a run being made rather than tearing ORT down under it
        thread = threading.Thread(target=prepare, name=f"prepare signature {self.model_path}")
        thread.start()
        return thread

    def warmup(self, *input_shapes: Mapping[str, Sequence[int]], runs: int = 3) -> None:
        """Runs each set of input shapes ``runs`` times on placeholder inputs, so that its session is created, its
        convolution algorithms chosen and its CUDA graph captured before the first real call.

        Args:
            input_shapes: one mapping of input name → shape per signature.
            runs: runs per signature (ORT captures a graph after a first regular run).
        """
        for shapes in input_shapes:
            check_input_names(shapes, self.input_names)
            inputs = {
                name: torch.zeros(tuple(shape), dtype=self._input_dtypes[name], device=self.device)
                for name, shape in shapes.items()
            }
            for _ in range(runs):
                self(**inputs)

    # ------------------------------------------------------------------------------------------------------ running
    def __call__(self, **inputs: InputValue) -> List[torch.Tensor]:
        """Runs the model. Keyword arguments are the model's inputs by name; returns its outputs in session order.

        On CUDA the run is enqueued on the model's stream after the caller's pending work, and the caller's stream
        waits for it: results are ready for whatever the caller enqueues next, and the host never waits.
        """
        check_input_names(inputs, self.input_names)
        index = timeline.run_index(self)
        if index is None:
            results = self._run(inputs)
        else:
            with timeline.step(f"run {index} {self.model_path} (host)"):
                results = self._run(inputs)
            timeline.ran(self, index)
        for watcher in self._run_watchers:
            watcher.append(
                RunRecord(
                    {name: value.data_ptr() for name, value in inputs.items() if isinstance(value, torch.Tensor)},
                    [tensor.data_ptr() for tensor in results],
                    {name: tuple(np.shape(value)) for name, value in inputs.items()},
                )
            )
        return results

    @contextlib.contextmanager
    def watch_runs(self) -> Iterator[List["RunRecord"]]:
        """Records every call while the block runs: the addresses of the torch tensors it was given and of the
        outputs it returned (:class:`RunRecord`), for tests and benchmarks that check where a loop's tensors live
        (graph input buffers written in place, output buffers reused)."""
        records: List[RunRecord] = []
        self._run_watchers.append(records)
        try:
            yield records
        finally:
            self._run_watchers.remove(records)

    def _run(self, inputs: Mapping[str, InputValue]) -> List[torch.Tensor]:
        if self._chain is not None:
            outputs = self._chain.run(inputs)
            return outputs if self.reuse_outputs else [tensor.clone() for tensor in outputs]
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

    def _run_bound(self, inputs: Mapping[str, InputValue]) -> List[torch.Tensor]:
        # `bound` holds every tensor whose pointer is bound until the run has returned (converted temporaries too).
        bound = {
            name: to_bindable(name, value, self._input_dtypes[name], self._device) for name, value in inputs.items()
        }
        input_shapes = {name: tuple(tensor.shape) for name, tensor in bound.items()}
        output_shapes = self.shape_inferencer(input_shapes)
        session = binding = None
        if self._pool is not None:
            specs = {name: (input_shapes[name], tensor.dtype) for name, tensor in bound.items()}
            entry = self._pool.entry(self.shape_inferencer.input_dims, specs, output_shapes)
            if isinstance(entry, CudaGraphRunner):
                with self._lock:
                    try:
                        outputs = entry.run(bound)
                    except Exception as error:  # the capture failed on its first run
                        entry = self._pool.drop(signature_of(input_shapes), str(error))
                    else:
                        results = [outputs[name] for name in self.output_names]
                        return results if self.reuse_outputs else [tensor.clone() for tensor in results]
            if entry is not None:
                session, binding = entry.session, entry.binding
        if session is None:
            session = self.session
            binding = self._binding
        outputs = self._output_tensors(input_shapes, output_shapes, bound)
        with self._lock:
            try:
                for name, tensor in bound.items():
                    binding.bind_input(
                        name,
                        self._ort_device_type,
                        self._ort_device_id,
                        TORCH_TO_ONNX[tensor.dtype],
                        list(tensor.shape),
                        tensor.data_ptr(),
                    )
                for name, tensor in outputs.items():
                    if tensor is None:  # data-dependent or empty: ORT allocates it on the device
                        binding.bind_output(name, self._ort_device_type, self._ort_device_id)
                    else:
                        binding.bind_output(
                            name,
                            self._ort_device_type,
                            self._ort_device_id,
                            TORCH_TO_ONNX[tensor.dtype],
                            list(tensor.shape),
                            tensor.data_ptr(),
                        )
                if self._device.type == "cuda" and self._stream is None:
                    # ORT runs on a stream of its own: what torch wrote must be complete before it reads.
                    torch.cuda.current_stream(self._device).synchronize()
                self._recipe.run(session, binding, self._run_options)
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

    def _thread_buffers(self) -> "OrderedDict[Tuple, Dict[str, Optional[torch.Tensor]]]":
        buffers = getattr(self._thread_state, "buffers", None)
        if buffers is None:
            buffers = self._thread_state.buffers = OrderedDict()
        return buffers

    def _output_tensors(
        self,
        input_shapes: Mapping[str, Tuple[int, ...]],
        output_shapes: Mapping[str, Optional[Tuple[int, ...]]],
        bound_inputs: Mapping[str, torch.Tensor],
    ) -> Dict[str, Optional[torch.Tensor]]:
        """The output tensors to bind, in session order; ``None`` where ORT must allocate. Buffers are kept per
        thread and input signature: a call never overwrites what a call from another thread is still reading."""
        signature = tuple(sorted(input_shapes.items()))
        kept = self._thread_buffers()
        cached = kept.get(signature) if self.reuse_outputs else None
        if cached is not None:
            input_storages = {t.untyped_storage().data_ptr() for t in bound_inputs.values() if t.numel()}
            if not any(
                t is not None and t.numel() and t.untyped_storage().data_ptr() in input_storages
                for t in cached.values()
            ):
                kept.move_to_end(signature)
                return cached
            # an input is an earlier output: never bind an output onto an input
        buffers: Dict[str, Optional[torch.Tensor]] = {}
        for name in self._output_dtypes:
            shape = output_shapes[name]
            if shape is None or 0 in shape:  # ORT refuses a null pointer, which an empty tensor has
                buffers[name] = None
            else:
                buffers[name] = torch.empty(shape, dtype=self._output_dtypes[name], device=self._device)
        if self.reuse_outputs:
            kept[signature] = buffers
            kept.move_to_end(signature)
            while len(kept) > self.max_output_signatures:
                kept.popitem(last=False)
        return buffers

    @staticmethod
    def _from_ort_value(value: ort.OrtValue, dtype: torch.dtype) -> torch.Tensor:
        tensor = tensor_of_ort_value(value)  # zero copy; the capsule keeps ORT's buffer alive
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
                name: ort.OrtValue.ortvalue_from_numpy_with_onnx_type(numpy_bits(t), TORCH_TO_ONNX[t.dtype])
                for name, t in arrays.items()
            }
            values = self.session.run_with_ort_values(self.output_names, feed)
            return [self._from_ort_value(v, self._output_dtypes[n]).clone() for v, n in zip(values, self.output_names)]
        results = self.session.run(None, {name: t.numpy() for name, t in arrays.items()})
        return [torch.from_numpy(np.asarray(r)) for r in results]


@dataclass
class RunRecord:
    """One call seen by :meth:`IOBindingORTModel.watch_runs`: ``data_ptr()`` of each torch input by name, and of each
    output in order; the shape of each input by name."""

    inputs: Dict[str, int]
    outputs: List[int]
    input_shapes: Dict[str, Tuple[int, ...]] = field(default_factory=dict)


class _Recipe:
    """Hands another model's recipe to the constructor (a sibling shares its sessions' recipe and weights)."""

    def __init__(self, recipe: SessionRecipe):
        self.recipe = recipe
