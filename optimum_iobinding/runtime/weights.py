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
from typing import Any, Dict, List, NamedTuple, Optional, Tuple, Union

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

    On CUDA each array is copied into one of two pinned staging buffers (made on first use) and uploaded from there
    asynchronously, while the next arrays fill the other buffer: one host copy per weight instead of a copy into a
    writable array and the driver's own staging of a pageable upload, and the host's copying overlaps the transfers.
    Arrays larger than a buffer go up directly; a weight read from a file goes through the buffers a buffer's size at
    a time. Elsewhere (or with ``staging_bytes=0``) each array becomes a writable copy and a file's bytes are read
    into the tensor itself. :meth:`finish` waits until every upload is done."""

    def __init__(self, device: torch.device, staging_bytes: int = 64 << 20, staged: Optional[bool] = None):
        self.device = device
        self.cuda = device.type == "cuda"
        # staged=True off CUDA runs the same path through unpinned buffers (for tests on any machine)
        self.staging_bytes = staging_bytes if (self.cuda if staged is None else staged) else 0
        self.buffers: List[torch.Tensor] = []  # made on first use: pinning host memory takes time
        self.done: List[Optional[Any]] = [None, None]  # the event after each buffer's last upload
        self.current, self.offset = 0, 0

    def _room(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of the current staging buffer (the other one where they do not fit), taken."""
        if not self.buffers:
            self.buffers = [torch.empty(self.staging_bytes, dtype=torch.uint8, pin_memory=self.cuda) for _ in range(2)]
        if self.offset + nbytes > self.staging_bytes:
            self._switch()
        staged = self.buffers[self.current][self.offset : self.offset + nbytes]
        self.offset += _aligned(nbytes)  # the next piece starts aligned for any element type
        return staged

    def put(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """``array`` (may be read-only; ``dtype`` is its element type as torch names it) on the device."""
        if not self.staging_bytes or array.nbytes > self.staging_bytes:
            return torch.from_numpy(np.array(array, copy=True)).view(dtype).to(self.device)
        staged = self._room(array.nbytes)
        staged.numpy()[:] = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
        target = torch.empty(array.shape, dtype=dtype, device=self.device)
        target.copy_(staged.view(dtype).view(array.shape), non_blocking=self.cuda)
        return target

    def read(self, handle: Any, offset: int, target: torch.Tensor) -> int:
        """Reads the bytes at ``offset`` of the open file ``handle`` into ``target`` (contiguous bytes, ``torch.uint8``,
        on the device) and gives how many there were: fewer than the target's where the file ends first. Through the
        staging buffers a buffer's size at a time, each piece uploaded as it is read: the one host copy, where
        :meth:`put` of the bytes read would make two. Without staging, straight into a tensor on the CPU."""
        nbytes = target.numel()
        if not self.staging_bytes:
            host = target if target.device.type == "cpu" else torch.empty(nbytes, dtype=torch.uint8)
            got = _read_into(handle, offset, host.numpy())
            if host is not target and got == nbytes:
                target.copy_(host)
            return got
        done = 0
        while done < nbytes:
            count = min(nbytes - done, self.staging_bytes)
            staged = self._room(count)
            got = _read_into(handle, offset + done, staged.numpy())
            if got != count:
                return done + got
            target[done : done + count].copy_(staged, non_blocking=self.cuda)
            done += count
        return done

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


def _aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of 256: where the next piece of a buffer starts, aligned for any element
    type (and as a device allocation is)."""
    return -(-nbytes // 256) * 256


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
    read_threads: Optional[int] = None,
) -> Dict[str, torch.Tensor]:
    """The model's float initializers of at least ``min_elements`` elements (and its folded biases, see
    :data:`~optimum_iobinding.layout.FOLDED_BIASES_KEY`), as torch tensors on ``device``.

    Weights in external data files are read straight from their files (the graph is parsed without them): no second
    full parse of a multi-GB model next to ORT's own. ``model``: ``source`` already parsed (:func:`parse_model`). On
    CUDA the weights go up through pinned staging buffers of ``staging_bytes`` in all (:class:`WeightUploader`),
    those of external data files read from the file straight into them by ``read_threads`` threads (default
    :data:`READ_THREADS` on CUDA, one elsewhere), each reading its share of the bytes in file order into buffers of
    its own and uploading on a stream of its own: one thread copying from the file cache is slower than the upload."""
    if device.type == "cuda" and device.index is None:  # the reading threads' current device is not the caller's
        device = torch.device("cuda", torch.cuda.current_device())
    model = parse_model(source) if model is None else model
    base = None if isinstance(source, bytes) else os.path.dirname(os.path.abspath(source))
    weights: Dict[str, Optional[torch.Tensor]] = {}  # in the model's order; those read from files filled in below
    reads: List[_Read] = []
    folded = {fold["bias"] for fold in folded_biases(model)}  # owned whatever their size: LoRA changes them
    inline: List[Tuple[str, np.ndarray, torch.dtype]] = []
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        for initializer in model.graph.initializer:
            if initializer.data_type not in _OWNED_TYPES:
                continue
            shape = tuple(initializer.dims)
            elements = math.prod(shape)
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
                offset, needed = int(info.get("offset", 0)), elements * dtype.itemsize
                length = int(info.get("length", needed))
                if length != needed:
                    raise ArgumentError(
                        location,
                        f"initializer {initializer.name!r} needs {needed} bytes at offset {offset}, the model "
                        f"declares {length}",
                    )
                reads.append(_Read(initializer.name, location, offset, shape, _TORCH_OF_ONNX[initializer.data_type]))
                weights[initializer.name] = None
                continue
            if initializer.raw_data:
                array = np.frombuffer(initializer.raw_data, dtype=dtype).reshape(shape)
            else:
                array = numpy_helper.to_array(initializer, base_dir=base or "")
                if initializer.data_type == onnx.TensorProto.BFLOAT16:
                    array = np.asarray(array).view(np.uint16)
                array = np.asarray(array, dtype=dtype)
            inline.append((initializer.name, array, _TORCH_OF_ONNX[initializer.data_type]))
        # the weights inside the .onnx: staging buffers no larger than they need (pinned memory stays with torch)
        uploader = WeightUploader(device, min(staging_bytes, _aligned(sum(array.nbytes for _, array, _ in inline))))
        for name, array, dtype in inline:
            weights[name] = uploader.put(array, dtype)
        uploader.finish()
        del uploader
        threads = read_threads if read_threads is not None else READ_THREADS if device.type == "cuda" else 1
        weights.update(_read_weights(reads, device, staging_bytes, max(1, threads)))
    return weights  # type: ignore[return-value]


# the threads that read owned weights from external data files at once, on CUDA (load_owned_weights)
READ_THREADS = 4


class _Read(NamedTuple):
    """A weight to read from an external data file: its name, the file, where in it, its shape and element type."""

    name: str
    location: str
    offset: int
    shape: Tuple[int, ...]
    dtype: torch.dtype


def _read_weights(reads: List[_Read], device: torch.device, staging_bytes: int, threads: int) -> Dict[str, Any]:
    """The weights of ``reads`` on ``device``, read by up to ``threads`` threads, each its share of the bytes (the
    reads in order, cut where the bytes before reach a thread's share) with staging buffers of its own
    (``staging_bytes`` among all) and, on CUDA, a stream of its own. The tensors are views of one allocation made
    here, on the caller's stream (whose memory it stays), and each thread's uploads have ended when it does. A
    thread's failure stops the others at their next weight; the failure of the earliest share is raised, once every
    thread has ended."""
    sizes = [math.prod(read.shape) * read.dtype.itemsize for read in reads]
    # one allocation for all, each weight 256-byte aligned in it: none of the caching allocator's rounding per tensor,
    # and no device allocation per weight
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + _aligned(size))
    flat = torch.empty(starts[-1], dtype=torch.uint8, device=device)
    targets = [flat[start : start + size] for start, size in zip(starts, sizes)]
    count = max(1, min(threads, len(reads)))
    shares: List[List[int]] = [[] for _ in range(count)]
    total, before = max(sum(sizes), 1), 0
    for index, size in enumerate(sizes):
        shares[min(count - 1, before * count // total)].append(index)
        before += size
    shares = [share for share in shares if share]
    errors: List[Optional[BaseException]] = [None for _ in shares]

    caller = torch.cuda.current_stream(device) if device.type == "cuda" else None
    # a power of two, as torch pins host memory, and not below a page
    per_thread = max(4096, 1 << max(0, (staging_bytes // len(shares or [0])).bit_length() - 1))
    failed = threading.Event()  # one thread's failure stops the others at their next weight

    def read_share(number: int) -> None:
        handles: Dict[str, Any] = {}
        side = None
        try:
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                # a stream of the high-priority pool: the models' own streams come from the other one
                side = torch.cuda.Stream(device, priority=-1) if caller is not None and len(shares) > 1 else None
                if side is not None:  # the targets' memory may be freed by work that the caller's stream still runs
                    side.wait_stream(caller)
                with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                    uploader = WeightUploader(device, per_thread if staging_bytes else 0)
                    for index in shares[number]:
                        if failed.is_set():
                            return
                        read = reads[index]
                        if read.location not in handles:
                            handles[read.location] = open(read.location, "rb", buffering=0)  # into our buffers
                        got = uploader.read(handles[read.location], read.offset, targets[index])
                        if got != sizes[index]:
                            raise ArgumentError(
                                read.location,
                                f"initializer {read.name!r} needs {sizes[index]} bytes at offset {read.offset}, the "
                                f"file gives {got}",
                            )
                    uploader.finish()  # this thread's stream: its weights are on the device when it ends
        except BaseException as error:  # raised by the caller
            errors[number] = error
            failed.set()
        finally:
            try:
                if side is not None:  # queued copies write into the targets, which the caller frees on a failure
                    side.synchronize()
            except BaseException as error:
                errors[number] = errors[number] or error
            for handle in handles.values():
                handle.close()

    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        if len(shares) == 1:
            read_share(0)
        else:
            workers = [
                threading.Thread(target=read_share, args=(number,), name=f"read weights {number}")
                for number in range(len(shares))
            ]
            try:
                for worker in workers:
                    worker.start()
            except BaseException:  # an interrupt: the threads stop at their next weight
                failed.set()
                raise
            finally:  # the threads end, and their copies, before the caller goes on
                for worker in workers:
                    if worker.ident is not None:  # started
                        worker.join()
    for error in errors:
        if error is not None:
            raise error
    return {read.name: target.view(read.dtype).view(read.shape) for read, target in zip(reads, targets)}


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
