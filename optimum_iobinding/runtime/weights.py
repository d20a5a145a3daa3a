"""The one owner of a model's owned weights: whether its float weights are torch tensors the project owns, and those
tensors.

With owned weights the float initializers of the model live once on the device as torch tensors, and every session
uses them in place (``SessionOptions.add_initializer`` with OrtValues made through DLPack): a new session adds its
activations, never another copy of the weights, and an in-place change of a weight (runtime LoRA) is seen by every
session's next run (CUDA graphs included: the addresses do not move). :class:`OwnedWeights` decides when they are
loaded (from the start, on first need, or never) and hands them to each new session's options.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import numpy_helper

from ..errors import ArgumentError
from ..layout import folded_biases
from .cuda_policy import DEVICE_SETUP
from . import timeline
from .dtypes import TORCH_TO_ONNX, ort_value_of_tensor
from .session_options import require_config_entry, require_optimization_level_at_most

# Float initializers with at least this many elements become owned weights. Smaller ones (scales, epsilons, the
# constants of shape arithmetic) stay with each session: ORT may plan them on the CPU, where it refuses a user buffer
# on the device ("Cannot use user supplied initializer ... planned memory location is different").
OWNED_WEIGHT_MIN_ELEMENTS = 1024
_OWNED_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}

# why owned weights on the CPU need a setting: {} says what the setting would do otherwise
_OWNED_ON_CPU = (
    "owned weights on the CPU (share_weights=True, a second session of the model, runtime LoRA), read in "
    "place by every session so that an in-place change reaches the output ({})"
)

_TORCH_OF_ONNX = {onnx_type: torch_dtype for torch_dtype, onnx_type in TORCH_TO_ONNX.items()}
_NUMPY_OF_ONNX = {
    onnx.TensorProto.FLOAT: "float32",
    onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.BFLOAT16: "uint16",
    onnx.TensorProto.DOUBLE: "float64",
}


def parse_model(source: Union[str, bytes]) -> onnx.ModelProto:
    """The model of an .onnx path (its external weights left on disk) or of model bytes."""
    with timeline.step(f"parse {source_name(source)}"):
        if isinstance(source, bytes):
            return onnx.load_from_string(source)
        return onnx.load(source, load_external_data=False)


def source_name(source: Union[str, bytes, None]) -> str:
    """How log lines and the timeline name a model's source."""
    return source if isinstance(source, str) else "model bytes" if source is not None else "a given session"


class WeightUploader:
    """Host arrays (:meth:`put`) and weights in files (:meth:`read`) → tensors on ``device``.

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
        self.buffers = (
            [torch.empty(staging_bytes, dtype=torch.uint8, pin_memory=self.cuda) for _ in range(2)]
            if self.staging_bytes
            else []
        )
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

    def read(
        self, handle: Any, offset: int, shape: Tuple[int, ...], dtype: torch.dtype
    ) -> Tuple[Optional[torch.Tensor], int]:
        """The weight of ``shape`` and element type ``dtype`` stored at ``offset`` of the open file ``handle``, on the
        device, and the bytes read: read straight into a staging buffer where it fits (the one host copy, where
        :meth:`put` of the bytes read would make two), else into memory of its own. ``None`` where the file ends
        before the weight does."""
        nbytes = math.prod(shape) * dtype.itemsize
        if not self.staging_bytes or nbytes > self.staging_bytes:
            host = torch.empty(nbytes, dtype=torch.uint8)
            got = _read_into(handle, offset, host.numpy())
            return (host.view(dtype).view(shape).to(self.device) if got == nbytes else None), got
        if self.offset + nbytes > self.staging_bytes:
            self._switch()
        staged = self.buffers[self.current][self.offset : self.offset + nbytes]
        got = _read_into(handle, offset, staged.numpy())
        if got != nbytes:
            return None, got
        self.offset += -(-nbytes // 256) * 256
        target = torch.empty(shape, dtype=dtype, device=self.device)
        target.copy_(staged.view(dtype).view(shape), non_blocking=self.cuda)
        return target, got

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


def _read_into(handle: Any, offset: int, target: np.ndarray) -> int:
    """Reads the bytes at ``offset`` of the open file ``handle`` into ``target`` (bytes, contiguous) until it is full
    or the file ends; the bytes read."""
    view = memoryview(target).cast("B")
    handle.seek(offset)
    got = 0
    while got < len(view):
        count = handle.readinto(view[got:])
        if not count:
            break
        got += count
    return got


def load_owned_weights(
    source: Union[str, bytes],
    device: torch.device,
    min_elements: int = OWNED_WEIGHT_MIN_ELEMENTS,
    model: Optional[onnx.ModelProto] = None,
    staging_bytes: int = 64 << 20,
) -> Dict[str, torch.Tensor]:
    """The model's float initializers of at least ``min_elements`` elements (and its folded biases, see
    :data:`~optimum_iobinding.layout.FOLDED_BIASES_KEY`), as torch tensors on ``device``.

    Weights in external data files are read straight from their files (the graph is parsed without them), each
    file opened once: no second full parse of a multi-GB model next to ORT's own. ``model``: ``source`` already
    parsed (:func:`parse_model`). On CUDA the weights go up through pinned staging buffers of ``staging_bytes``
    (:class:`WeightUploader`), those of external data files read from the file straight into them."""
    model = parse_model(source) if model is None else model
    base = None if isinstance(source, bytes) else os.path.dirname(os.path.abspath(source))
    weights: Dict[str, torch.Tensor] = {}
    files: Dict[str, Any] = {}
    folded = {fold["bias"] for fold in folded_biases(model)}  # owned whatever their size: LoRA changes them
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        uploader = WeightUploader(device, staging_bytes)
        try:
            for initializer in model.graph.initializer:
                if initializer.data_type not in _OWNED_TYPES:
                    continue
                shape = tuple(initializer.dims)
                elements = 1
                for dim in shape:
                    elements *= dim
                if elements < min_elements and initializer.name not in folded:
                    continue
                dtype = np.dtype(_NUMPY_OF_ONNX[initializer.data_type])
                if initializer.data_location == onnx.TensorProto.EXTERNAL and base is not None:
                    info = {entry.key: entry.value for entry in initializer.external_data}
                    location = os.path.normpath(os.path.join(base, info["location"]))
                    if os.path.commonpath([base, location]) != base:  # as onnx's own loader refuses it
                        raise ArgumentError(
                            source,
                            f"initializer {initializer.name!r} names external data outside "
                            f"the model's folder: {info['location']!r}",
                        )
                    if location not in files:
                        files[location] = open(location, "rb", buffering=0)  # read into the buffers given
                    offset, needed = int(info.get("offset", 0)), elements * dtype.itemsize
                    length = int(info.get("length", needed))
                    tensor, got = (
                        uploader.read(files[location], offset, shape, _TORCH_OF_ONNX[initializer.data_type])
                        if length == needed
                        else (None, length)
                    )
                    if tensor is None:
                        raise ArgumentError(
                            location,
                            f"initializer {initializer.name!r} needs {needed} bytes at offset {offset}, the "
                            f"{'file gives' if length == needed else 'model declares'} {got}",
                        )
                    weights[initializer.name] = tensor
                    continue
                if initializer.raw_data:
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


class OwnedWeights:
    """Whether one model's float weights are owned tensors, and the tensors (shared by every session of the model,
    its siblings' included).

    Args:
        source: the .onnx path or the model bytes (``None``: a session made elsewhere, whose weights are its own).
        device: where the tensors live.
        share_weights: ``True``: owned from the first session on; ``None``: each session loads them from the source
            until :meth:`start_owning` (called before a second session is made, and for runtime LoRA): ONNX
            Runtime's own loading puts a single session up sooner; ``False``: never.
    """

    def __init__(self, source: Union[str, bytes, None], device: torch.device, share_weights: Optional[bool]):
        self.source = source
        self.device = device
        self.owned = bool(share_weights) and source is not None
        self.on_need = share_weights is None and source is not None
        self._tensors: Optional[Dict[str, torch.Tensor]] = None
        self._values: Dict[str, ort.OrtValue] = {}
        self._parsed: Optional[onnx.ModelProto] = None  # the source parsed by the model, until the tensors load
        self._lock = threading.Lock()

    @property
    def tensors(self) -> Dict[str, torch.Tensor]:
        """The owned weights by initializer name (empty unless owned); loaded on first use."""
        if not self.owned:
            return {}
        with self._lock:
            if self._tensors is None:
                model, self._parsed = self._parsed, None
                with DEVICE_SETUP.setup() if self.device.type == "cuda" else contextlib.nullcontext():
                    with timeline.step(f"weights {source_name(self.source)}"):
                        self._tensors = load_owned_weights(self.source, self.device, model=model)
                self._values = {name: ort_value_of_tensor(tensor) for name, tensor in self._tensors.items()}
        return self._tensors

    @property
    def parse_kept(self) -> bool:
        """Whether a parse of the source is held for the tensors to load from (:meth:`adopt`)."""
        return self._parsed is not None

    def start_owning(self) -> None:
        """From now on every new session reads the owned weights (loaded by the next session). Sessions made before
        keep the weights they loaded: whoever holds them drops them (the graph pool does)."""
        with self._lock:
            if self.source is None:
                raise RuntimeError(
                    "the session was created from neither a path nor bytes, so its weights cannot be "
                    "loaded as owned tensors"
                )
            self.owned = True
            self.on_need = False

    def adopt(self, model: onnx.ModelProto) -> None:
        """``model``, the source already parsed (by the model reading its declared inputs), is kept until the owned
        weights load and read from instead of parsing the file again (for a large model whose weights are inside its
        .onnx, the parse is a long piece of the first call's critical path). Until then the parse holds host memory
        the size of the file; where the weights are owned on need, a session that loads them itself releases it
        (:meth:`release_parse`). Nothing is kept where the weights are never owned or are loaded already."""
        with self._lock:
            if (self.owned or self.on_need) and self._tensors is None:
                self._parsed = model

    def release_parse(self) -> None:
        """Drops the parse kept by :meth:`adopt` where the weights are not owned (a session loaded them itself)."""
        with self._lock:
            if not self.owned:
                self._parsed = None

    def add_to(self, sess_options: ort.SessionOptions) -> None:
        """Makes a new session read the owned weights (nothing unless they are owned); ``sess_options`` is the
        session's own copy. On the CPU a setting of the user's there that would keep the session from reading them
        in place is refused by name."""
        if not self.owned:
            return
        self.tensors  # noqa: B018 — loads them once
        if self.device.type == "cpu":
            # the CPU EP would otherwise prepack (copy) MatMul/Conv weights, and miss in-place changes
            require_config_entry(
                sess_options,
                "session.disable_prepacking",
                "1",
                _OWNED_ON_CPU.format("prepacking copies the MatMul and Conv weights"),
            )
            # so would the layout optimizations above EXTENDED (NCHWc convolutions reorder a copy of the weights):
            # an in-place change of the owned Conv weights would then not reach the model's output
            require_optimization_level_at_most(
                sess_options,
                ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
                _OWNED_ON_CPU.format("layout optimizations reorder a copy of the Conv weights"),
            )
        for name, value in self._values.items():
            sess_options.add_initializer(name, value)
