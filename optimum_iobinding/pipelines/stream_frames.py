"""What a real-time stream does with its frames around the models: which kinds of frame it takes (and so which kind it
gives back), how a frame reaches the device and an output leaves it, the conversions to and from the VAE's NCHW
[-1, 1] images, and the torch arithmetic between two model calls replayed as a CUDA graph."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple, Union

import numpy as np
import PIL.Image
import torch
import torch.nn.functional as F

from ..errors import ArgumentError, ArgumentTypeError
from ..runtime.cuda_policy import DEVICE_SETUP

FrameInput = Union[torch.Tensor, np.ndarray, PIL.Image.Image]

# what a frame may be, for error messages
_FRAME_KINDS = (
    "a torch tensor (float (3, height, width) or (1, 3, height, width) in [-1, 1], or uint8 (height, "
    "width, 3)), a numpy uint8 array (height, width, 3) or a PIL image"
)


@dataclass(frozen=True)
class FrameKind:
    """What a frame came as, and so what its output goes back as.

    Attributes:
        container: ``"torch"``, ``"numpy"`` or ``"pil"``.
        device: where a torch frame lived (the CPU for numpy and PIL frames).
        dtype: ``torch.uint8`` (HWC, 0–255) or a float dtype (NCHW in [-1, 1]).
        batched: a float torch frame given as ``(1, 3, height, width)`` rather than ``(3, height, width)``.
    """

    container: str
    device: torch.device
    dtype: torch.dtype
    batched: bool = False

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"


def read_frame(
    frame: Any, device: torch.device, name: str = "frame"
) -> Tuple[Union[torch.Tensor, np.ndarray], FrameKind]:
    """Checks a frame and gives it in one of two layouts, without copying: uint8 ``(height, width, 3)`` (numpy for
    numpy and PIL frames, else torch) or a float torch tensor ``(1, 3, height, width)``; with its :class:`FrameKind`.

    Args:
        frame: the frame (see :data:`FrameInput`). A PIL image of another mode than RGB is converted to RGB.
        device: the pipeline's device: a CUDA frame on another GPU is refused (no silent copy between GPUs).
        name: how errors name the frame.

    Raises:
        TypeError: not a kind of frame the stream takes, or a dtype it does not (integers other than uint8, bool).
        ValueError: another layout or number of channels, an empty frame, a tensor on another GPU.
    """
    if isinstance(frame, PIL.Image.Image):
        if 0 in frame.size:
            raise ArgumentError(name, f"expected a non-empty image, got {frame.width} × {frame.height} pixels")
        rgb = frame if frame.mode == "RGB" else frame.convert("RGB")
        return np.array(rgb), FrameKind("pil", torch.device("cpu"), torch.uint8)
    if isinstance(frame, np.ndarray):
        if frame.dtype != np.uint8:
            raise ArgumentTypeError(
                name,
                f"expected a numpy array of dtype uint8 (height, width, 3), got dtype "
                f"{frame.dtype}; give float images as torch tensors in [-1, 1]",
            )
        _check_hwc(name, tuple(frame.shape), "numpy array")
        return frame, FrameKind("numpy", torch.device("cpu"), torch.uint8)
    if not isinstance(frame, torch.Tensor):
        raise ArgumentTypeError(name, f"expected {_FRAME_KINDS}, got {type(frame).__name__}")
    if frame.layout != torch.strided or frame.is_nested:
        raise ArgumentTypeError(
            name,
            f"expected a dense torch tensor, got a {str(frame.layout)[6:]} one"
            if not frame.is_nested
            else f"{name}: expected a dense torch tensor, got a nested one",
        )
    if frame.device.type not in ("cpu", "cuda"):
        raise ArgumentError(name, f"expected a CPU or CUDA tensor, got one on {frame.device}")
    if frame.device.type == "cuda" and device.type == "cuda" and frame.device.index != device.index:
        raise ArgumentError(
            name,
            f"expected a tensor on {device} (the pipeline's device) or on the CPU, got one on "
            f"{frame.device}; move it with .to({str(device)!r}) if the copy is intended",
        )
    shape = tuple(frame.shape)
    if frame.dtype == torch.uint8:
        _check_hwc(name, shape, "uint8 tensor")
        return frame.detach(), FrameKind("torch", frame.device, torch.uint8)
    if not frame.dtype.is_floating_point:
        raise ArgumentTypeError(
            name, f"expected a float tensor in [-1, 1] or a uint8 tensor (height, width, 3), got dtype {frame.dtype}"
        )
    if len(shape) not in (3, 4) or (len(shape) == 4 and shape[0] != 1) or shape[-3] != 3:
        one = " (one frame a call)" if len(shape) == 4 and shape[0] != 1 else ""
        raise ArgumentError(
            name,
            f"expected a float tensor of shape (3, height, width) or (1, 3, height, width){one}, got shape {shape}",
        )
    if 0 in shape:
        raise ArgumentError(name, f"expected a non-empty frame, got shape {shape}")
    batched = len(shape) == 4
    return frame.detach().reshape(1, *shape[-3:]), FrameKind("torch", frame.device, frame.dtype, batched)


def _check_hwc(name: str, shape: Tuple[int, ...], what: str) -> None:
    if len(shape) != 3 or shape[2] != 3:
        raise ArgumentError(name, f"expected a {what} of shape (height, width, 3) (RGB), got shape {shape}")
    if 0 in shape:
        raise ArgumentError(name, f"expected a non-empty frame, got shape {shape}")


# ------------------------------------------------------------------------------------------------- conversions
def to_vae_input(source: torch.Tensor, image: torch.Tensor) -> None:
    """Writes a frame into the VAE encoder's input ``image`` (NCHW in [-1, 1], its dtype and size): uint8 HWC frames
    are scaled as diffusers' image processor scales them (``x / 255 * 2 - 1``); a frame of another size is resized
    to ``image``'s by bilinear interpolation with antialiasing (stretched: no crop)."""
    if source.dtype == torch.uint8:
        pixels = (source.permute(2, 0, 1)[None].float() / 255.0) * 2.0 - 1.0
    else:
        pixels = source.float()
    if tuple(pixels.shape[-2:]) != tuple(image.shape[-2:]):
        pixels = F.interpolate(
            pixels, size=tuple(image.shape[-2:]), mode="bilinear", align_corners=False, antialias=True
        )
    image.copy_(pixels)


def to_output_frame(image: torch.Tensor, frame: torch.Tensor) -> None:
    """Writes the VAE decoder's output (NCHW, about [-1, 1]) into an output frame: uint8 ``(height, width, 3)``
    rounded as diffusers' ``numpy_to_pil`` rounds, or float ``(1, 3, height, width)`` clamped to [-1, 1]."""
    if frame.dtype == torch.uint8:
        frame.copy_(((image[0].float() / 2 + 0.5).clamp(0, 1) * 255).round().permute(1, 2, 0))
    else:
        frame.copy_(image.float().clamp(-1, 1))


def output_layout(kind: FrameKind, height: int, width: int) -> Tuple[Tuple[int, ...], torch.dtype]:
    """The shape and dtype of the device tensor a frame of ``kind`` gets its output written into."""
    if kind.dtype == torch.uint8:
        return (height, width, 3), torch.uint8
    return (1, 3, height, width), kind.dtype


def hand_out(tensor: torch.Tensor, kind: FrameKind) -> Any:
    """An output as the frame of ``kind`` came: the same container, dtype, rank and device."""
    if kind.container == "numpy":
        return tensor.numpy()
    if kind.container == "pil":
        return PIL.Image.fromarray(tensor.numpy())
    if kind.dtype != torch.uint8 and not kind.batched:
        tensor = tensor[0]
    if tensor.device != kind.device:
        tensor = tensor.to(kind.device)
    return tensor


# ------------------------------------------------------------------------------------------ captured arithmetic
class CapturedStage:
    """Torch arithmetic between two model calls, run on the current stream and replayed as a CUDA graph.

    ``fn(*tensors)`` reads some of the tensors it is given and writes its results into others (in place); it must
    not wait on the host. With graphs, the first call with a set of tensor addresses runs ``fn`` once and captures it
    (the capture waits for the device once); later calls with the same addresses replay the graph: one launch. The
    models' CUDA-graph buffers keep their addresses, so a stream captures each stage once per ``prepare``. A new set
    of addresses (a frame of another kind or size, a model whose graph was captured again) is captured anew; the
    least recently used of ``max_graphs`` are dropped. Without graphs (the CPU, ``cuda_graph=False``) ``fn`` just runs.
    """

    def __init__(self, fn: Callable[..., None], graphs: bool, max_graphs: int = 8):
        self.fn = fn
        self.graphs = graphs
        self.max_graphs = max_graphs
        self._captured: "OrderedDict[Tuple, Tuple[torch.cuda.CUDAGraph, Tuple[torch.Tensor, ...]]]" = OrderedDict()
        self.captures = 0  # how many graphs were captured so far

    def __call__(self, *tensors: torch.Tensor) -> None:
        if not self.graphs:
            self.fn(*tensors)
            return
        key = tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in tensors)
        entry = self._captured.get(key)
        if entry is not None:
            self._captured.move_to_end(key)
            entry[0].replay()
            return
        self.fn(*tensors)  # this call's result; also any lazy initialization, which a capture must not see
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.current_stream()
        with DEVICE_SETUP.capture(), torch.cuda.graph(graph, stream=stream):
            self.fn(*tensors)
        # the tensors are held with the graph: their memory must not be reused while it may replay
        self._captured[key] = (graph, tensors)
        self.captures += 1
        while len(self._captured) > self.max_graphs:
            self._captured.popitem(last=False)


# -------------------------------------------------------------------------------------------- host and device
@dataclass
class PendingFrame:
    """An output on its way: a fresh device tensor (ready for whatever the caller's stream runs next), or a pinned
    host tensor whose download ``arrived`` records."""

    kind: FrameKind
    tensor: torch.Tensor
    arrived: Optional["torch.cuda.Event"] = None

    @property
    def waits(self) -> bool:
        """Whether handing it out makes the host wait for the device (a host output of a CUDA pipeline)."""
        return self.arrived is not None

    def result(self) -> Any:
        """The output, as its frame came (the host waits for its download first, if it has one)."""
        if self.arrived is not None:
            self.arrived.synchronize()
        return hand_out(self.tensor, self.kind)

    def again(self) -> "PendingFrame":
        """The same output once more, in a tensor of its own (the caller may hold both): a device copy on the current
        stream, or a host copy once the download has arrived."""
        if self.arrived is not None:
            self.arrived.synchronize()
        return PendingFrame(self.kind, self.tensor.clone())


class FrameCopies:
    """Brings frames to the device and outputs back, for a pipeline on ``device``.

    Each frame layout (dtype and size) has one device staging tensor, which the captured preprocessing reads. A CUDA
    frame is copied into it on the pipeline's stream. A host frame (numpy, PIL, CPU tensor) on a CUDA pipeline goes
    through one of two pinned buffers, then up on an upload stream: the upload waits only until the previous frame's
    preprocessing has read the staging tensor, so it travels while that frame is denoised and decoded. A host output
    comes down on a download stream (a second one: on one copy stream the next upload would queue behind this
    frame's download, which waits for the whole frame), into a fresh pinned tensor (torch's caching host allocator:
    the caller may keep it), and the next write of the device output waits on the device, not on the host, for that
    download. Nothing comes from or goes to pageable memory on CUDA. On the CPU every copy is a plain one.
    """

    def __init__(self, device: torch.device, max_layouts: int = 8):
        self.device = device
        self.on_cuda = device.type == "cuda"
        self.max_layouts = max_layouts
        self.upload_stream: Optional["torch.cuda.Stream"] = torch.cuda.Stream(device) if self.on_cuda else None
        self.download_stream: Optional["torch.cuda.Stream"] = torch.cuda.Stream(device) if self.on_cuda else None
        self._staging: "OrderedDict[Tuple, torch.Tensor]" = OrderedDict()
        self._staging_read: Dict[int, "torch.cuda.Event"] = {}  # staging address → its last reader is done
        self._pinned: Dict[Tuple, Tuple[torch.Tensor, Optional["torch.cuda.Event"]]] = {}
        self._slot = 0
        self._output_read: Dict[int, "torch.cuda.Event"] = {}  # output address → its last download is done

    def staging(self, dtype: torch.dtype, shape: Tuple[int, ...]) -> torch.Tensor:
        """The device tensor frames of this layout wait in for the preprocessing."""
        key = (dtype, tuple(shape))
        tensor = self._staging.get(key)
        if tensor is None:
            with torch.inference_mode(False):  # written in place by later calls, in or out of inference mode
                tensor = torch.zeros(shape, dtype=dtype, device=self.device)
            self._staging[key] = tensor
            while len(self._staging) > self.max_layouts:
                _, dropped = self._staging.popitem(last=False)
                self._staging_read.pop(dropped.data_ptr(), None)
                for slot in (0, 1):
                    self._pinned.pop(self._pinned_key(dropped, slot), None)
        self._staging.move_to_end(key)
        return tensor

    def bring(self, source: Union[torch.Tensor, np.ndarray]) -> torch.Tensor:
        """``source`` (from :func:`read_frame`) in its staging tensor, ordered before the current stream's next work."""
        staging = self.staging(_torch_dtype(source), tuple(source.shape))
        host = isinstance(source, np.ndarray) or source.device.type == "cpu"
        if not (self.on_cuda and host):
            if isinstance(source, np.ndarray):
                staging.numpy()[...] = source  # the CPU pipeline: one host copy
            else:
                staging.copy_(source)  # on the pipeline's stream (a CUDA frame), or a plain copy
            return staging
        compute = torch.cuda.current_stream(self.device)
        pinned = self._pinned_slot(staging)
        if isinstance(source, np.ndarray):
            pinned.numpy()[...] = source
        else:
            pinned.copy_(source)
        read = self._staging_read.get(staging.data_ptr())
        if read is not None:
            self.upload_stream.wait_event(read)
        with torch.cuda.stream(self.upload_stream):
            staging.copy_(pinned, non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record(self.upload_stream)
        compute.wait_event(arrived)
        self._pinned[self._pinned_key(staging, self._slot)] = (pinned, arrived)
        return staging

    def read(self, staging: torch.Tensor) -> None:
        """The current stream's work so far has read ``staging``: the next upload into it may start after it."""
        if self.on_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._staging_read[staging.data_ptr()] = event

    def before_write(self, output: torch.Tensor) -> None:
        """Orders the current stream's next write of ``output`` after its last download (no host wait)."""
        done = self._output_read.pop(output.data_ptr(), None)
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)

    def take(self, output: torch.Tensor, to_host: bool) -> Tuple[torch.Tensor, Optional["torch.cuda.Event"]]:
        """A copy of ``output`` that the caller may keep: a fresh device tensor from torch's caching allocator, or
        (``to_host`` on CUDA) a fresh pinned host tensor and the event of its download."""
        if not (self.on_cuda and to_host):
            return output.clone(), None
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        with DEVICE_SETUP.setup():  # pinning may allocate, which a graph capture in another thread must not see
            host = torch.empty(output.shape, dtype=output.dtype, pin_memory=True)
        self.download_stream.wait_event(ready)
        with torch.cuda.stream(self.download_stream):
            host.copy_(output, non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record(self.download_stream)
        self._output_read[output.data_ptr()] = arrived
        return host, arrived

    def _pinned_key(self, staging: torch.Tensor, slot: int) -> Tuple:
        return (slot, staging.dtype, tuple(staging.shape))

    def _pinned_slot(self, staging: torch.Tensor) -> torch.Tensor:
        """The next of the layout's two pinned buffers, once the upload that last read it has completed (two frames
        ago: long done, unless the host outruns the copies)."""
        self._slot ^= 1
        key = self._pinned_key(staging, self._slot)
        pinned, sent = self._pinned.get(key, (None, None))
        if pinned is None:
            with DEVICE_SETUP.setup():
                pinned = torch.empty(staging.shape, dtype=staging.dtype, pin_memory=True)
        elif sent is not None:
            sent.synchronize()
        return pinned


def _torch_dtype(source: Union[torch.Tensor, np.ndarray]) -> torch.dtype:
    return torch.uint8 if isinstance(source, np.ndarray) else source.dtype
