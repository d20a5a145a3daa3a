"""Frames in and out: video files and folders of images, read and written on background threads.

:func:`open_frames` reads a video file (anything FFmpeg decodes) or a folder of images (in natural order:
``frame2.png`` before ``frame10.png``) and yields numpy HWC uint8 RGB frames; :class:`FrameWriter` writes frames
(numpy, torch on the CPU or the GPU, PIL) to a video file (``.mp4``/``.mkv``/``.mov``: H.264; ``.webm``: VP9) or to a
folder of PNGs (a path without an extension). Both keep the codec on a thread of its own behind a bounded queue, so
the thread that feeds the GPU waits on the codec only when the codec cannot keep up, and a full queue holds the
producer back instead of filling the memory. Tooling for the ``stream`` command and the benchmarks: runtime/ and
pipelines/ never import it (a layering contract in setup.cfg).

Why this library: PyAV (FFmpeg's libraries in this process) rather than imageio-ffmpeg (an ``ffmpeg`` child process
fed through pipes). Both encode at the same speed and CPU cost, and imageio-ffmpeg decodes faster in wall time (its
child converts to RGB beside the decoder) for more CPU per frame; either keeps far ahead of a real-time stream
(benchmarks/video_codec_bench.py compares them; docs/streams.md gives the figures). What decided: PyAV reports
rate, frame count and size without parsing a child's stderr, fails with exceptions naming the cause rather than a
broken pipe, stops without a process to kill, and its manylinux wheel is the smaller.

Sizes: ``open_frames(..., size=...)`` fits every frame to one size by scaling it to cover the size and cropping the
centre (no distortion, nothing letterboxed); without ``size`` every frame must have the first one's size. H.264 and
VP9 store colour at half resolution (yuv420p), so a video file needs an even width and height: the writer refuses an
odd size with an error saying so rather than padding or cropping silently (a folder of PNGs takes any size).

Writing is atomic: frames go to a hidden folder beside the target (``.NAME.partial-XXXX``), and only when every frame
was written and the file closed without an error is the result renamed to the target. An error or an interruption
(``KeyboardInterrupt``) on the way leaves no partial file and the target as it was; an existing target is refused
unless ``overwrite=True``.
"""

from __future__ import annotations

import math
import numbers
import os
import queue
import re
import shutil
import sys
import tempfile
import threading
import weakref
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import numpy as np

from .layout import check_output_folder, replace_folder, unwritable_reason

Size = Union[int, Tuple[int, int]]

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")
# what the writer encodes to, by extension: the FFmpeg encoder and its options. x264's "veryfast" keeps up with a
# real-time stream on a few cores at CRF 18 (visually lossless); libvpx-vp9's realtime mode likewise.
VIDEO_ENCODERS: Dict[str, Tuple[str, Dict[str, str]]] = {
    ".mp4": ("libx264", {"crf": "18", "preset": "veryfast"}),
    ".mkv": ("libx264", {"crf": "18", "preset": "veryfast"}),
    ".mov": ("libx264", {"crf": "18", "preset": "veryfast"}),
    ".webm": ("libvpx-vp9", {"crf": "32", "b": "0", "deadline": "realtime", "cpu-used": "8", "row-mt": "1"}),
}
PIXEL_FORMAT = "yuv420p"  # what players play; it halves the colour planes, hence even sizes
PNG_COMPRESS_LEVEL = 1  # zlib's fastest level: PNGs a little larger, written much faster than at the default 6
FRAME_FILE_PATTERN = "{:06d}.png"
DEFAULT_QUEUE_FRAMES = 8
# how often a thread blocked on a queue looks whether the other side stopped (a stop never waits longer)
_POLL_S = 0.05
_READER_THREAD, _WRITER_THREAD = "optimum-iobinding frame reader", "optimum-iobinding frame writer"


def _import_av(argument: str, path: Path, what: str):
    try:
        import av
    except ImportError as error:
        raise ImportError(
            f"{argument}: {what} {str(path)!r} needs PyAV, which is not installed: pip install "
            "'optimum-iobinding[video]' (folders of images need no PyAV)"
        ) from error
    return av


def natural_key(name: str) -> List[Union[str, int]]:
    """Sort key putting ``frame2.png`` before ``frame10.png`` (digit runs compare as numbers, the rest caseless)."""
    return [int(part) if part.isdigit() else part.lower() for part in re.split(r"(\d+)", name)]


def _check_size(size: Optional[Size], argument: str = "size") -> Optional[Tuple[int, int]]:
    """``size`` as (width, height): an int is a square."""
    if size is None:
        return None
    pair = (size, size) if isinstance(size, numbers.Integral) else size
    if (
        not isinstance(pair, (tuple, list))
        or len(pair) != 2
        or not all(isinstance(side, numbers.Integral) and not isinstance(side, bool) and side > 0 for side in pair)
    ):
        raise ValueError(
            f"{argument}: expected a positive int (a square) or a (width, height) pair of positive ints, got {size!r}"
        )
    return int(pair[0]), int(pair[1])


def _cover(source: Tuple[int, int], target: Tuple[int, int]) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    """The size to scale ``source`` (width, height) to so that it covers ``target``, and the top-left corner of the
    centred ``target``-sized crop of it."""
    scale = max(target[0] / source[0], target[1] / source[1])
    scaled = (max(target[0], round(source[0] * scale)), max(target[1], round(source[1] * scale)))
    return scaled, ((scaled[0] - target[0]) // 2, (scaled[1] - target[1]) // 2)


def _size_text(width: int, height: int) -> str:
    return f"{width}×{height}"


# ------------------------------------------------------------------------------------------ background threads
class _Failure:
    """An exception raised on a background thread, carried across the queue to be raised on the other side."""

    def __init__(self, error: BaseException):
        self.error = error


_END = object()


def _put(items: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Puts ``item`` unless ``stop`` is set first; blocks while the queue is full."""
    while not stop.is_set():
        try:
            items.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _in_background(make_items: Callable[[], Iterator[np.ndarray]], queue_frames: int) -> Iterator[np.ndarray]:
    """Iterates ``make_items()`` on a thread of its own, at most ``queue_frames`` items ahead of the consumer.

    The thread starts on the first ``next``. When the consumer stops early (``break``, ``close()``, an exception,
    the iterator collected), the thread is told to stop and joined before this returns: no thread outlives the
    iteration. An exception on the thread is raised here, in order, after the items before it.
    """
    items: queue.Queue = queue.Queue(maxsize=queue_frames)
    stop = threading.Event()

    def produce() -> None:
        try:
            iterator = make_items()
            try:
                for item in iterator:
                    if not _put(items, item, stop):
                        return
            finally:
                close = getattr(iterator, "close", None)
                if close is not None:
                    close()
        except BaseException as error:  # carried over and raised on the consumer's side
            _put(items, _Failure(error), stop)
            return
        _put(items, _END, stop)

    thread = threading.Thread(target=produce, name=_READER_THREAD, daemon=True)
    thread.start()
    try:
        while True:
            try:
                item = items.get(timeout=_POLL_S)
            except queue.Empty:
                if not thread.is_alive() and items.empty():
                    raise RuntimeError(f"{_READER_THREAD} ended without its last item")
                continue
            if item is _END:
                return
            if isinstance(item, _Failure):
                raise item.error
            yield item
    finally:
        stop.set()
        thread.join()


# ------------------------------------------------------------------------------------------------------ reading
class FrameReader:
    """Frames of a video file or a folder of images, made by :func:`open_frames` (which checks the source first).

    Iterating yields numpy arrays of shape (height, width, 3), uint8, RGB, decoded on a background thread at most
    ``queue_frames`` frames ahead. Each iteration starts from the first frame; a ``break`` or :meth:`close` (or the
    end of a ``with`` block) stops the thread before returning.

    Attributes:
        path: the source.
        kind: ``"video"`` or ``"images"``.
        fps: frames per second of a video (``None`` for a folder of images: they carry no rate).
        frame_count: the number of frames where the source says (the container's count; a folder's image count),
            else ``None`` (WebM, for one, does not store it).
        width, height: the size of every frame yielded.
        source_width, source_height: the size of the source's first frame.
    """

    def __init__(
        self,
        path: Path,
        kind: str,
        fps: Optional[float],
        frame_count: Optional[int],
        size: Tuple[int, int],
        source_size: Tuple[int, int],
        fit: bool,
        image_files: Tuple[Path, ...],
        queue_frames: int,
        argument: str,
        size_argument: str = "size=",
    ):
        self.path, self.kind, self.fps, self.frame_count = path, kind, fps, frame_count
        self.width, self.height = size
        self.source_width, self.source_height = source_size
        self._fit, self._image_files, self._queue_frames, self._argument = fit, image_files, queue_frames, argument
        self._size_argument = size_argument  # what the caller's user passes to fit every frame to one size
        # weak: a `for` loop that breaks drops its iterator, and with it the thread, at once
        self._iterations: "weakref.WeakSet[Iterator[np.ndarray]]" = weakref.WeakSet()

    @property
    def size(self) -> Tuple[int, int]:
        """(width, height) of every frame yielded."""
        return self.width, self.height

    def __repr__(self) -> str:
        count = "?" if self.frame_count is None else self.frame_count
        rate = "" if self.fps is None else f", {self.fps:.3f} fps"
        return (
            f"FrameReader({str(self.path)!r}, {self.kind}, {count} frames of "
            f"{_size_text(self.width, self.height)}{rate})"
        )

    def __iter__(self) -> Iterator[np.ndarray]:
        make = self._video_frames if self.kind == "video" else self._image_frames
        iteration = _in_background(make, self._queue_frames)
        self._iterations.add(iteration)
        return iteration

    def close(self) -> None:
        """Stops every iteration still running (its thread joined); call it from the thread that iterates."""
        for iteration in list(self._iterations):
            iteration.close()

    def __enter__(self) -> "FrameReader":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def _mismatch(self, index: int, width: int, height: int, file: Optional[Path] = None) -> ValueError:
        where = f"frame {index}" + (f" ({file.name})" if file is not None else "")
        return ValueError(
            f"{self._argument}: expected every frame of {str(self.path)!r} at the first one's size "
            f"{_size_text(self.width, self.height)}, got {_size_text(width, height)} at {where}; pass {self._size_argument} to "
            "fit every frame to one size"
        )

    def _video_frames(self) -> Iterator[np.ndarray]:
        av = _import_av(self._argument, self.path, "reading the video")
        with av.open(str(self.path)) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"  # frame and slice threads: FFmpeg's fastest decoding
            index = 0
            try:
                for index, frame in enumerate(container.decode(stream)):
                    if (frame.width, frame.height) == self.size:
                        yield frame.to_ndarray(format="rgb24")
                    elif self._fit:
                        (width, height), (left, top) = _cover((frame.width, frame.height), self.size)
                        array = frame.to_ndarray(format="rgb24", width=width, height=height, interpolation="BICUBIC")
                        yield np.ascontiguousarray(array[top : top + self.height, left : left + self.width])
                    else:
                        raise self._mismatch(index, frame.width, frame.height)
            except av.error.FFmpegError as error:
                raise ValueError(
                    f"{self._argument}: expected a video FFmpeg can decode, got {str(self.path)!r}, "
                    f"which fails after frame {index}: {error}"
                ) from error

    def _image_frames(self) -> Iterator[np.ndarray]:
        for index, file in enumerate(self._image_files):
            image = _open_image(file, self._argument)
            if image.size != self.size:
                if not self._fit:
                    raise self._mismatch(index, *image.size, file=file)
                from PIL import Image, ImageOps

                image = ImageOps.fit(image, self.size, method=Image.Resampling.BICUBIC)
            yield np.asarray(image)


def _open_image(file: Path, argument: str):
    """The image at ``file`` as RGB (alpha dropped, grey and palette images expanded), decoded now."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(file) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as error:
        raise ValueError(f"{argument}: expected an image PIL can read, got {str(file)!r}: {error}") from error


def open_frames(
    path: Union[str, os.PathLike],
    size: Optional[Size] = None,
    *,
    queue_frames: int = DEFAULT_QUEUE_FRAMES,
    argument: str = "path",
    size_argument: str = "size=",
) -> FrameReader:
    """Opens a video file or a folder of images for reading frames, checking it first (its first frame decoded).

    Args:
        path: a video file (any container and codec FFmpeg decodes) or a folder of images (``.png``, ``.jpg``,
            ``.jpeg``, ``.webp``, ``.bmp``, ``.tif``, ``.tiff``; other and hidden files in it are ignored), read in
            natural order of their names.
        size: ``None`` to keep the source's size (every frame must then have the first one's), an int for a square,
            or (width, height): every frame scaled to cover it and cropped at the centre.
        queue_frames: how many decoded frames may wait for the consumer.
        argument: the name errors give the path (``INPUT`` for a command line).
        size_argument: how errors name ``size``, what fits frames of several sizes to one (``--size`` for a command
            line).

    Returns:
        a :class:`FrameReader`: iterate it for numpy (height, width, 3) uint8 RGB frames; ``fps``, ``frame_count``,
        ``width`` and ``height`` describe them.

    Raises:
        FileNotFoundError: nothing at ``path``.
        PermissionError: ``path`` cannot be read.
        ValueError: not a video (or an image) that can be decoded, no video stream, no frames, a bad ``size``.
        ImportError: a video file and PyAV is not installed.
    """
    target = _check_size(size)
    if not isinstance(queue_frames, numbers.Integral) or isinstance(queue_frames, bool) or queue_frames < 1:
        raise ValueError(f"queue_frames: expected a positive int, got {queue_frames!r}")
    source = Path(path).expanduser()
    if not source.exists():
        raise FileNotFoundError(
            f"{argument}: expected a video file or a folder of images, got {str(source)!r}: no such file or folder"
        )
    if not os.access(source, os.R_OK | (os.X_OK if source.is_dir() else 0)):
        raise PermissionError(
            f"{argument}: expected a readable video file or folder of images, got {str(source)!r}, "
            "which this user may not read"
        )
    if source.is_dir():
        return _open_image_folder(source, target, int(queue_frames), argument, size_argument)
    return _open_video(source, target, int(queue_frames), argument, size_argument)


def _open_image_folder(
    folder: Path, size: Optional[Tuple[int, int]], queue_frames: int, argument: str, size_argument: str = "size="
) -> FrameReader:
    entries = sorted(os.listdir(folder), key=natural_key)
    files = tuple(
        folder / name
        for name in entries
        if Path(name).suffix.lower() in IMAGE_EXTENSIONS and not name.startswith(".") and (folder / name).is_file()
    )
    if not files:
        raise ValueError(
            f"{argument}: expected a video file or a folder holding images "
            f"({', '.join(IMAGE_EXTENSIONS)}), got the folder {str(folder)!r} with no frames: "
            f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}, none of them an image"
        )
    first = _open_image(files[0], argument)
    return FrameReader(
        folder,
        "images",
        None,
        len(files),
        size or first.size,
        first.size,
        size is not None,
        files,
        queue_frames,
        argument,
        size_argument,
    )


def _open_video(
    file: Path, size: Optional[Tuple[int, int]], queue_frames: int, argument: str, size_argument: str = "size="
) -> FrameReader:
    av = _import_av(argument, file, "reading the video")
    expected = "a video file or a folder of images"
    try:
        with av.open(str(file)) as container:
            if not container.streams.video:
                kinds = sorted({stream.type for stream in container.streams}) or ["no streams"]
                raise ValueError(
                    f"{argument}: expected {expected}, got {str(file)!r}, a {container.format.name} "
                    f"file with no video stream (it holds: {', '.join(kinds)})"
                )
            stream = container.streams.video[0]
            first = next(iter(container.decode(stream)), None)
            if first is None:
                raise ValueError(f"{argument}: expected {expected}, got {str(file)!r}, a video with no frames")
            rate = stream.average_rate or stream.guessed_rate or stream.base_rate
            fps = float(rate) if rate else None
            frame_count = stream.frames or None
            source_size = (first.width, first.height)
    except av.error.EOFError as error:  # a container that ends before its first packet: an empty video
        raise ValueError(f"{argument}: expected {expected}, got {str(file)!r}, a video with no frames") from error
    except av.error.PermissionError as error:
        raise PermissionError(
            f"{argument}: expected a readable video file, got {str(file)!r}, which this user may not read"
        ) from error
    except av.error.FFmpegError as error:
        raise ValueError(
            f"{argument}: expected {expected}, got {str(file)!r}, which FFmpeg cannot read as a video: "
            f"{error.strerror or error}"
        ) from error
    return FrameReader(
        file,
        "video",
        fps,
        frame_count,
        size or source_size,
        source_size,
        size is not None,
        (),
        queue_frames,
        argument,
        size_argument,
    )


# ------------------------------------------------------------------------------------------------------ writing
class _CudaFrame:
    """A frame on its way from the GPU: the copy into pinned host memory is queued on the caller's stream; the
    writer's thread waits for ``copied`` before reading ``host``. ``device`` stays referenced until then, so that
    the caching allocator cannot hand its memory to another tensor while the copy is pending."""

    def __init__(self, device: Any, host: Any, copied: Any):
        self.device, self.host, self.copied = device, host, copied

    def numpy(self) -> np.ndarray:
        self.copied.synchronize()
        return self.host.numpy()


class _VideoSink:
    """A video file being encoded (on the writer's thread only): opened with the first frame's size."""

    def __init__(self, file: Path, fps: Fraction, encoder: str, options: Dict[str, str]):
        self.file, self.fps, self.encoder, self.options = file, fps, encoder, options
        self.container = self.stream = None

    def write(self, index: int, frame: np.ndarray) -> None:
        import av

        if self.container is None:
            self.container = av.open(str(self.file), "w")
            self.stream = self.container.add_stream(self.encoder, rate=self.fps)
            self.stream.options = dict(self.options)
            self.stream.height, self.stream.width = frame.shape[:2]
            self.stream.pix_fmt = PIXEL_FORMAT
            self.stream.codec_context.thread_type = "AUTO"
        video_frame = av.VideoFrame.from_ndarray(frame, format="rgb24")
        video_frame.pts, video_frame.time_base = index, 1 / self.fps
        self.container.mux(self.stream.encode(video_frame))

    def finish(self) -> None:
        self.container.mux(self.stream.encode(None))  # the frames the encoder still holds
        container, self.container = self.container, None
        container.close()

    def discard(self) -> None:
        if self.container is not None:
            container, self.container = self.container, None
            try:
                container.close()
            except Exception:  # the file is deleted next: a failure to finish it changes nothing
                pass


class _PngSink:
    """A folder of PNGs being written (on the writer's thread only)."""

    def __init__(self, folder: Path):
        self.folder = folder

    def write(self, index: int, frame: np.ndarray) -> None:
        from PIL import Image

        Image.fromarray(frame).save(self.folder / FRAME_FILE_PATTERN.format(index), compress_level=PNG_COMPRESS_LEVEL)

    def finish(self) -> None:
        pass

    def discard(self) -> None:
        pass


def _encode(sink: Any, items: queue.Queue, stop: threading.Event, state: Dict[str, Any]) -> None:
    """The writer's thread: hands queued frames to ``sink`` until the end mark (then finishes it) or ``stop``."""
    index = 0
    try:
        while True:
            try:
                item = items.get(timeout=_POLL_S)
            except queue.Empty:
                if stop.is_set():
                    sink.discard()
                    return
                continue
            if item is _END:
                sink.finish()
                state["finished"] = True
                return
            if stop.is_set():
                sink.discard()
                return
            sink.write(index, item.numpy() if isinstance(item, _CudaFrame) else item)
            index += 1
    except BaseException as error:  # raised to the caller by the next write() or close()
        state["error"], state["failed_at"] = error, index
        sink.discard()


class FrameWriter:
    """Writes frames to a video file or a folder of PNGs, encoding on a background thread; the target appears only
    when :meth:`close` succeeds (atomic: nothing partial is ever at ``path``).

    ``path``'s extension picks the output: ``.mp4``, ``.mkv``, ``.mov`` (H.264), ``.webm`` (VP9), or none for a
    folder of PNGs named ``000000.png``, ``000001.png`` … Use it as a context manager: leaving the block normally
    closes it (the target appears), leaving it with an exception aborts it (nothing is written).

    Args:
        path: the file or folder to write.
        fps: frames per second of a video (:attr:`FrameReader.fps` of the input); ignored for PNGs.
        overwrite: replace an existing target (only once the new one is whole); refused otherwise.
        codec_options: FFmpeg encoder options replacing the defaults of :data:`VIDEO_ENCODERS` (e.g.
            ``{"crf": "0", "preset": "ultrafast"}``); video only.
        queue_frames: how many frames may wait for the encoder before :meth:`write` waits.
        argument: the name errors give the path (``OUTPUT`` for a command line).

    Raises:
        ValueError: an unsupported extension, a bad ``fps`` or ``codec_options``, a video encoder FFmpeg lacks.
        FileExistsError: the target exists and ``overwrite`` is false.
        IsADirectoryError: a video file's path is a folder.
        ImportError: a video file and PyAV is not installed.
    """

    def __init__(
        self,
        path: Union[str, os.PathLike],
        fps: Union[float, Fraction] = 30.0,
        *,
        overwrite: bool = False,
        codec_options: Optional[Dict[str, str]] = None,
        queue_frames: int = DEFAULT_QUEUE_FRAMES,
        argument: str = "path",
        overwrite_argument: str = "overwrite=True",
    ):
        self.path = Path(path).expanduser()
        self._argument, self._overwrite = argument, bool(overwrite)
        self._overwrite_argument = overwrite_argument  # what the caller's user passes to replace it (an option)
        self.frames_written = 0
        suffix = self.path.suffix.lower()
        if suffix in VIDEO_ENCODERS:
            self.kind = "video"
            self._encoder, self._options = self._check_video_target(suffix, codec_options)
            self.fps = self._check_fps(fps)
        elif not suffix and (not str(path).endswith(".") or self.path.name in ("", ".", "..")):
            self.kind = "images"
            if codec_options:
                raise ValueError(
                    f"codec_options: expected none for a folder of PNGs ({str(self.path)!r}), got "
                    f"{codec_options!r}; give the path a video extension ({', '.join(VIDEO_ENCODERS)})"
                )
            check_output_folder(
                self.path, overwrite=self._overwrite, argument=argument, overwrite_argument=overwrite_argument
            )
            self._check_parent()
            self.fps = self._check_fps(fps)
        else:
            raise ValueError(
                f"{argument}: expected a video file ({', '.join(VIDEO_ENCODERS)}) or a folder for PNG "
                f"frames (a path without an extension), got {str(path)!r}"
            )
        if not isinstance(queue_frames, numbers.Integral) or isinstance(queue_frames, bool) or queue_frames < 1:
            raise ValueError(f"queue_frames: expected a positive int, got {queue_frames!r}")
        self._queue_frames = int(queue_frames)
        self._frame_size: Optional[Tuple[int, int]] = None
        self._scratch: Optional[Path] = None
        self._thread: Optional[threading.Thread] = None
        self._items: queue.Queue = queue.Queue(maxsize=self._queue_frames)
        self._stop = threading.Event()
        self._state: Dict[str, Any] = {}
        self._done = False

    # -------------------------------------------------------------------------------------------- checks
    def _check_video_target(self, suffix: str, codec_options: Optional[Dict[str, str]]):
        av = _import_av(self._argument, self.path, "writing the video")
        encoder, options = VIDEO_ENCODERS[suffix]
        try:
            av.codec.Codec(encoder, "w")
        except Exception as error:
            raise ValueError(
                f"{self._argument}: {str(self.path)!r} needs FFmpeg's {encoder} encoder, which this PyAV "
                f"lacks ({error}); write another format ({', '.join(VIDEO_ENCODERS)}) or a folder of "
                "PNGs"
            ) from error
        if codec_options is not None:
            if not isinstance(codec_options, dict) or not all(
                isinstance(key, str) and isinstance(value, str) for key, value in codec_options.items()
            ):
                raise ValueError(
                    f"codec_options: expected a dict of FFmpeg option names to string values (e.g. "
                    f"{{'crf': '18'}}), got {codec_options!r}"
                )
            options = {**options, **codec_options}
        if self.path.is_dir():
            raise IsADirectoryError(f"{self._argument}: expected a video file name, got the folder {str(self.path)!r}")
        if self.path.exists() and not self._overwrite:
            raise FileExistsError(
                f"{self._argument}: expected a new file, got the existing file {str(self.path)!r}; "
                f"pass {self._overwrite_argument} to replace it, or choose another name"
            )
        self._check_parent()
        return encoder, options

    def _check_parent(self) -> None:
        """The nearest existing folder above ``path`` is a folder that takes a new file (the rest is made), asked by
        writing one (:func:`~optimum_iobinding.layout.unwritable_reason`: a permission bit does not say it for root,
        a read-only mount or /proc)."""
        parent = self.path.absolute().parent
        problem = unwritable_reason(parent)
        if problem is not None:
            blocked = next(folder for folder in [parent, *parent.parents] if folder.exists())
            raise (PermissionError if blocked.is_dir() else NotADirectoryError)(
                f"{self._argument}: expected a path in a writable folder, got {str(self.path)!r}, but {problem}"
            )

    def _check_fps(self, fps: Union[float, Fraction]) -> Fraction:
        if not isinstance(fps, numbers.Real) or isinstance(fps, bool) or not math.isfinite(fps) or fps <= 0:
            raise ValueError(f"fps: expected a positive finite number of frames per second, got {fps!r}")
        # a float like 29.97002997 (NTSC's 30000/1001 read back as a float) becomes that fraction again
        return Fraction(fps).limit_denominator(100_000)

    def _host_frame(self, frame: Any) -> Union[np.ndarray, _CudaFrame]:
        """``frame`` as a private (height, width, 3) uint8 array the caller may reuse its own buffer after, or a
        CUDA frame whose copy to the host is queued."""
        torch = sys.modules.get("torch")
        index = self.frames_written
        if torch is not None and isinstance(frame, torch.Tensor):
            return self._torch_frame(torch, frame, index)
        if isinstance(frame, np.ndarray):
            self._check_array(frame.dtype == np.uint8, frame.shape, frame.dtype, index)
            return np.array(frame, copy=True, order="C")
        pil = sys.modules.get("PIL.Image")
        if pil is not None and isinstance(frame, pil.Image):
            return np.asarray(frame.convert("RGB")).copy()
        raise TypeError(
            f"frame: expected a numpy array, a torch tensor or a PIL image, got {type(frame).__name__} "
            f"(frame {index} of {str(self.path)!r})"
        )

    def _check_array(self, uint8: bool, shape: Tuple[int, ...], dtype: Any, index: int) -> None:
        rgb = len(shape) == 3 and shape[2] == 3
        if not uint8 or not rgb:
            hint = (
                "; a float image in [0, 1] converts with (x * 255).round().astype(np.uint8)"
                if rgb
                else "; a grayscale (height, width) one with np.stack([x] * 3, axis=-1)"
                if len(shape) == 2
                else ""
            )
            raise ValueError(
                f"frame: expected (height, width, 3) uint8 RGB, got shape {tuple(shape)} {dtype} (frame "
                f"{index} of {str(self.path)!r}){hint}"
            )

    def _torch_frame(self, torch: Any, frame: Any, index: int) -> Union[np.ndarray, _CudaFrame]:
        if frame.dtype == torch.uint8:
            self._check_array(True, tuple(frame.shape), frame.dtype, index)
            frame = frame.detach()
        elif frame.is_floating_point():
            chw = frame.shape[1:] if frame.dim() == 4 and frame.shape[0] == 1 else frame.shape
            if len(chw) != 3 or chw[0] != 3:
                raise ValueError(
                    f"frame: expected a float tensor (3, height, width) or (1, 3, height, width) in "
                    f"[0, 1] (diffusers' output_type='pt') or a (height, width, 3) uint8 one, got shape "
                    f"{tuple(frame.shape)} {frame.dtype} (frame {index} of {str(self.path)!r})"
                )
            # converted where it is (on the GPU: a quarter of the bytes cross the bus)
            frame = (frame.detach().reshape(chw).clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0)
        else:
            raise ValueError(
                f"frame: expected a uint8 (height, width, 3) tensor or a float (3, height, width) one, "
                f"got {frame.dtype} (frame {index} of {str(self.path)!r})"
            )
        frame = frame.contiguous()
        if frame.device.type == "cuda":
            with torch.cuda.device(frame.device):  # the current stream and the event of the frame's own device
                host = torch.empty(frame.shape, dtype=torch.uint8, pin_memory=True)
                host.copy_(frame, non_blocking=True)  # queued on the caller's current stream, after what made frame
                copied = torch.cuda.Event()
                copied.record()
            return _CudaFrame(frame, host, copied)
        return frame.cpu().numpy().copy()

    # -------------------------------------------------------------------------------------------- writing
    def write(self, frame: Any) -> None:
        """Queues one frame for encoding; waits only while ``queue_frames`` frames are already waiting.

        Args:
            frame: a numpy (height, width, 3) uint8 RGB array; a torch tensor, uint8 (height, width, 3) or float
                (3, height, width) / (1, 3, height, width) in [0, 1], on the CPU or a CUDA device (copied on the
                calling thread's current stream, which must be the stream that made it or be ordered after it,
                without waiting for it); or a PIL image. The frame is copied: the caller may reuse its buffer.
                Every frame must have the first one's size.

        Raises:
            ValueError: a frame of the wrong kind or size, an odd size for a video file.
            RuntimeError: the encoder failed (on its thread) or the writer is closed.
        """
        if self._done:
            raise RuntimeError(f"{self._argument}: the writer of {str(self.path)!r} is closed; open a new one")
        self._raise_encoder_error()
        item = self._host_frame(frame)
        height, width = (item.host if isinstance(item, _CudaFrame) else item).shape[:2]
        if self._frame_size is None:
            if self.kind == "video" and (width % 2 or height % 2):
                raise ValueError(
                    f"frame: expected an even width and height for {str(self.path)!r} (its codec stores "
                    f"colour at half resolution, {PIXEL_FORMAT}), got {_size_text(width, height)}; "
                    "crop or resize the frames to an even size (the stream command: --size), or write "
                    "a folder of PNGs (a path without an extension)"
                )
            self._frame_size = (width, height)
            self._start()
        elif (width, height) != self._frame_size:
            raise ValueError(
                f"frame: expected every frame at the first one's size "
                f"{_size_text(*self._frame_size)}, got {_size_text(width, height)} (frame "
                f"{self.frames_written} of {str(self.path)!r})"
            )
        self._put(item)
        self.frames_written += 1

    def _start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._scratch = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.partial-", dir=self.path.parent))
        # the result is made inside the scratch folder (not as the scratch folder itself) so that it gets the
        # permissions the user's umask gives, not mkdtemp's private 0700
        inner = self._scratch / self.path.name
        if self.kind == "video":
            sink: Any = _VideoSink(inner, self.fps, self._encoder, self._options)
        else:
            inner.mkdir()
            sink = _PngSink(inner)
        # the thread holds the queue, the flag and the state, not the writer: an abandoned writer can be collected
        self._thread = threading.Thread(
            target=_encode, args=(sink, self._items, self._stop, self._state), name=_WRITER_THREAD, daemon=True
        )
        self._thread.start()

    def _put(self, item: Any) -> None:
        """Queues ``item``, waiting while the queue is full, as long as the encoder's thread runs."""
        while True:
            if not self._thread.is_alive():
                self._raise_encoder_error()
                raise RuntimeError(f"{_WRITER_THREAD} of {str(self.path)!r} ended before its last frame")
            try:
                self._items.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                continue

    def _raise_encoder_error(self) -> None:
        error = self._state.get("error")
        if error is not None:
            self.abort()
            raise RuntimeError(
                f"{self._argument}: writing {str(self.path)!r} failed at frame "
                f"{self._state['failed_at']}: {type(error).__name__}: {error}; nothing was written "
                "there"
            ) from error

    def close(self) -> Path:
        """Finishes encoding, then moves the result to ``path`` (replacing an existing target only if
        ``overwrite``).

        Returns:
            ``path``.

        Raises:
            ValueError: no frame was written.
            RuntimeError: the encoder failed; nothing is left at ``path``.
            FileExistsError: something appeared at ``path`` meanwhile and ``overwrite`` is false.
        """
        if self._done:
            raise RuntimeError(f"{self._argument}: the writer of {str(self.path)!r} is already closed")
        if self._thread is None:
            self.abort()
            raise ValueError(
                f"{self._argument}: expected at least one frame for {str(self.path)!r}, got none; nothing was written"
            )
        try:
            self._put(_END)
            self._thread.join()
            self._raise_encoder_error()
            self._move_into_place(self._scratch / self.path.name)
        except BaseException:
            self.abort()
            raise
        self._done = True
        shutil.rmtree(self._scratch, ignore_errors=True)
        return self.path

    def _move_into_place(self, result: Path) -> None:
        if self.kind == "images":
            if self._overwrite:
                replace_folder(result, self.path)
            else:
                check_output_folder(self.path, argument=self._argument)  # still new or empty
                os.replace(result, self.path)
            return
        if self._overwrite:
            os.replace(result, self.path)
            return
        try:  # a hard link fails where a file appeared meanwhile, where a rename would replace it
            os.link(result, self.path)
        except FileExistsError:
            raise FileExistsError(
                f"{self._argument}: expected a new file, got {str(self.path)!r}, which appeared "
                f"while the frames were written; pass {self._overwrite_argument} to replace "
                "it"
            ) from None
        except OSError:  # a file system without hard links
            if self.path.exists():
                raise FileExistsError(
                    f"{self._argument}: expected a new file, got {str(self.path)!r}, which "
                    "appeared while the frames were written"
                ) from None
            os.replace(result, self.path)

    def abort(self) -> None:
        """Stops encoding and deletes what was written; ``path`` is left as it was. Safe to call more than once."""
        if self._done:
            return
        self._done = True
        self._stop.set()
        # (a garbage collection on the writer's own thread may run __del__ there: that thread cannot join itself)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)

    def __enter__(self) -> "FrameWriter":
        return self

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __del__(self) -> None:
        # an abandoned writer (never closed) leaves no thread and no scratch folder behind
        if not getattr(self, "_done", True):
            self.abort()

    def __repr__(self) -> str:
        return f"FrameWriter({str(self.path)!r}, {self.kind}, {self.frames_written} frames written)"
