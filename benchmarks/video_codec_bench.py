"""Video decode and encode throughput of PyAV (``av``) against imageio-ffmpeg, frames as numpy HWC uint8 RGB.

What optimum_iobinding.video's choice of library rests on. From the project root, with either or both installed:
    python3 benchmarks/video_codec_bench.py --frames 300 --size 512 --repeats 3 --out OUT
Writes OUT/video-codec-bench.json (every run, the versions, the machine) and prints one line per case. Its results
on the development machine: benchmarks/results/cpu/2026-11-24-6b70f59.

Both libraries run the same FFmpeg codecs with the same options; they differ in where the work happens: PyAV calls
libavcodec in this process (the RGB <-> YUV conversion runs on the calling thread, beside the codec),
imageio-ffmpeg pipes raw RGB frames to and from an ``ffmpeg`` child process. So each case reports frames per second
of wall time (median of ``--repeats``, the cases interleaved), the CPU seconds spent in this process and in
children, and the share of pure-Python work a thread keeps doing while another thread decodes or encodes (how much
of the GIL and of the cores a codec thread leaves to the thread that feeds the GPU; 1.0: all of it).

Cases: H.264 (libx264, yuv420p, CRF 18; presets medium and veryfast) in MP4 and VP9 (libvpx-vp9, realtime,
cpu-used 8, row-mt, CRF 32) in WebM. PyAV runs with FFmpeg's default slice threading and with ``thread_type="AUTO"``
(frame and slice threads); imageio-ffmpeg with ffmpeg's own default (threads chosen by ffmpeg); where the project
imports, optimum_iobinding.video too (PyAV with AUTO threads, the codec on a background thread; ``threads=thread``:
encode includes the rename into place). Every decode case reads the same file, written beforehand. The frames: a
512-pixel window panning over a textured image (moving content a codec has to work for, unlike a still or noise).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CODECS = {
    # name: (extension, FFmpeg encoder, FFmpeg decoder, encoder options)
    "h264-medium": (".mp4", "libx264", "h264", {"crf": "18", "preset": "medium"}),
    "h264-veryfast": (".mp4", "libx264", "h264", {"crf": "18", "preset": "veryfast"}),
    "vp9-realtime": (
        ".webm",
        "libvpx-vp9",
        "libvpx-vp9",
        {"crf": "32", "b": "0", "deadline": "realtime", "cpu-used": "8", "row-mt": "1"},
    ),
}
FPS = 30


def synthetic_frames(count: int, size: int) -> List[np.ndarray]:
    """``count`` RGB frames: a ``size`` window panning diagonally over a texture of several scales."""
    rng = np.random.default_rng(0)
    side = size + count * 2
    texture = np.zeros((side, side, 3), np.float32)
    for cell, weight in ((64, 0.5), (16, 0.3), (4, 0.2)):
        coarse = rng.random((side // cell + 1, side // cell + 1, 3), dtype=np.float32)
        texture += weight * np.repeat(np.repeat(coarse, cell, 0), cell, 1)[:side, :side]
    texture = (texture * 255).astype(np.uint8)
    return [np.ascontiguousarray(texture[2 * k : 2 * k + size, k : k + size]) for k in range(count)]


def cpu_seconds() -> tuple:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def run_once(run: Callable[[], int]) -> Dict:
    """Runs ``run`` (which returns the number of frames it handled) once; wall time and CPU time."""
    own0, children0 = cpu_seconds()
    start = time.perf_counter()
    frames = run()
    wall = time.perf_counter() - start
    own1, children1 = cpu_seconds()
    return {
        "frames": frames,
        "wall_s": round(wall, 4),
        "fps": round(frames / wall, 1),
        "cpu_s_process": round(own1 - own0, 3),
        "cpu_s_children": round(children1 - children0, 3),
    }


def python_work_while(run: Callable[[], int], seconds_alone: float = 0.5) -> float:
    """How much pure-Python work the calling thread gets done while ``run`` goes on a background thread, as a
    fraction of what it does alone: what a decoding or encoding thread leaves to the thread that feeds the GPU
    (both the GIL and the cores count)."""
    import threading

    def spin(stop: Callable[[], bool]) -> float:
        count, start = 0, time.perf_counter()
        while not stop():
            for _ in range(1000):
                count += 1
        return count / (time.perf_counter() - start)

    deadline = time.perf_counter() + seconds_alone
    alone = spin(lambda: time.perf_counter() > deadline)
    worker = threading.Thread(target=run)
    worker.start()
    busy = spin(lambda: not worker.is_alive())
    worker.join()
    return round(busy / alone, 3)


# ------------------------------------------------------------------------------------------------------- PyAV
def pyav_encode(path: str, frames: List[np.ndarray], codec: str, options: Dict[str, str], thread_type) -> int:
    import av

    with av.open(path, "w") as container:
        stream = container.add_stream(codec, rate=FPS)
        stream.width, stream.height = frames[0].shape[1], frames[0].shape[0]
        stream.pix_fmt = "yuv420p"
        stream.options = dict(options)
        if thread_type is not None:
            stream.codec_context.thread_type = thread_type
            stream.codec_context.thread_count = 0
        for array in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")))
        container.mux(stream.encode(None))
    return len(frames)


def pyav_decode(path: str, thread_type) -> int:
    import av

    count = 0
    with av.open(path) as container:
        stream = container.streams.video[0]
        if thread_type is not None:
            stream.thread_type = thread_type
            stream.codec_context.thread_count = 0
        for frame in container.decode(stream):
            array = frame.to_ndarray(format="rgb24")
            count += array.shape[0] > 0
    return count


# ----------------------------------------------------------------------------------------------- imageio-ffmpeg
def imageio_encode(path: str, frames: List[np.ndarray], codec: str, options: Dict[str, str]) -> int:
    import imageio_ffmpeg

    # the ffmpeg command line names the codec context's bitrate "b:v" ("-b" is ambiguous there)
    params = [item for key, value in options.items() for item in (f"-{'b:v' if key == 'b' else key}", value)]
    writer = imageio_ffmpeg.write_frames(
        path,
        (frames[0].shape[1], frames[0].shape[0]),
        fps=FPS,
        codec=codec,
        quality=None,
        macro_block_size=1,
        output_params=params,
    )
    writer.send(None)
    for array in frames:
        writer.send(array)
    writer.close()
    return len(frames)


def imageio_decode(path: str, decoder: str) -> int:
    import imageio_ffmpeg

    reader = imageio_ffmpeg.read_frames(path, pix_fmt="rgb24", input_params=["-c:v", decoder])
    meta = reader.__next__()
    width, height = meta["size"]
    count = 0
    for chunk in reader:
        array = np.frombuffer(chunk, np.uint8).reshape(height, width, 3)
        count += array.shape[0] > 0
    return count


# ------------------------------------------------------------------------------- optimum_iobinding.video (PyAV)
def module_encode(path: str, frames: List[np.ndarray], options: Dict[str, str]) -> int:
    from optimum_iobinding.video import FrameWriter

    with FrameWriter(path, fps=FPS, overwrite=True, codec_options=options) as writer:
        for array in frames:
            writer.write(array)
    return len(frames)


def module_decode(path: str) -> int:
    from optimum_iobinding.video import open_frames

    return sum(array.shape[0] > 0 for array in open_frames(path))


def versions() -> Dict[str, str]:
    found = {"python": platform.python_version(), "numpy": np.__version__}
    try:
        import av

        found["av"] = av.__version__
        found["av_ffmpeg_libavcodec"] = ".".join(map(str, av.library_versions["libavcodec"]))
    except ImportError:
        pass
    try:
        import subprocess

        import imageio_ffmpeg

        found["imageio_ffmpeg"] = imageio_ffmpeg.__version__
        banner = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-version"], capture_output=True, text=True)
        found["imageio_ffmpeg_binary"] = banner.stdout.splitlines()[0]
    except ImportError:
        pass
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=300)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--codecs", default=",".join(CODECS), help=f"comma-separated, of {', '.join(CODECS)}")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    found = versions()
    libraries = [name for name in ("av", "imageio_ffmpeg") if name in found]
    try:  # PyAV behind the project's own background threads, where the project imports (it needs torch)
        importlib.import_module("optimum_iobinding.video")
        libraries.append("optimum_iobinding.video")
    except ImportError:
        pass
    if not libraries:
        parser.error("neither av nor imageio-ffmpeg is installed")
    frames = synthetic_frames(args.frames, args.size)
    cases = []
    work = tempfile.mkdtemp(prefix="video-codec-bench-")

    def measure(operation: str, codec: str, runs: Dict[tuple, Callable[[], int]], sizes: Dict[tuple, str] = None):
        """Runs each of ``runs`` (keyed by (library, threads)) ``--repeats`` times, interleaved so that load from
        other processes on the machine falls on every case alike, then once more beside a spinning Python thread."""
        results = {key: [] for key in runs}
        for _ in range(args.repeats):
            for key, run in runs.items():
                results[key].append(run_once(run))
        for (library, threads), measured in results.items():
            case = {
                "library": library,
                "operation": operation,
                "codec": codec,
                "threads": threads,
                "fps_median": statistics.median(run["fps"] for run in measured),
                "python_work_left": python_work_while(runs[library, threads]),
                "runs": measured,
            }
            if sizes:
                case["bytes"] = os.path.getsize(sizes[library, threads])
            cases.append(case)
            cpu = statistics.median(run["cpu_s_process"] for run in measured)
            children = statistics.median(run["cpu_s_children"] for run in measured)
            print(
                f"{operation:6} {codec:14} {library:23} threads={threads:8} {case['fps_median']:7.1f} frames/s  "
                f"cpu s: process {cpu:5.2f} children {children:5.2f}  python work left "
                f"{case['python_work_left']:.2f}",
                flush=True,
            )

    def pyav_encoder(path, encoder, options, thread_type):
        return lambda: pyav_encode(path, frames, encoder, options, thread_type)

    def pyav_decoder(path, thread_type):
        return lambda: pyav_decode(path, thread_type)

    load_before = os.getloadavg()
    for codec_name in args.codecs.split(","):
        extension, encoder, decoder, options = CODECS[codec_name]
        encoders, paths = {}, {}
        if "av" in libraries:
            for threads, thread_type in (("default", None), ("auto", "AUTO")):
                paths["av", threads] = os.path.join(work, f"av-{threads}-{codec_name}{extension}")
                encoders["av", threads] = pyav_encoder(paths["av", threads], encoder, options, thread_type)
        if "imageio_ffmpeg" in libraries:
            path = paths["imageio_ffmpeg", "default"] = os.path.join(work, f"imageio-{codec_name}{extension}")
            encoders["imageio_ffmpeg", "default"] = lambda: imageio_encode(path, frames, encoder, options)
        if "optimum_iobinding.video" in libraries:
            module_path = os.path.join(work, f"module-{codec_name}{extension}")
            paths["optimum_iobinding.video", "thread"] = module_path
            encoders["optimum_iobinding.video", "thread"] = lambda: module_encode(module_path, frames, options)
        measure("encode", codec_name, encoders, paths)
        reference = next(iter(paths.values()))  # every decoder reads the same file
        decoders = {}
        if "av" in libraries:
            for threads, thread_type in (("default", None), ("auto", "AUTO")):
                decoders["av", threads] = pyav_decoder(reference, thread_type)
        if "imageio_ffmpeg" in libraries:
            decoders["imageio_ffmpeg", "default"] = lambda: imageio_decode(reference, decoder)
        if "optimum_iobinding.video" in libraries:
            decoders["optimum_iobinding.video", "thread"] = lambda: module_decode(reference)
        measure("decode", codec_name, decoders)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "command": " ".join(sys.argv),
        "frames": args.frames,
        "size": args.size,
        "fps_of_file": FPS,
        "repeats": args.repeats,
        "load_average_before_after": [load_before, os.getloadavg()],
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor(), "platform": platform.platform()},
        "versions": found,
        "codec_options": {name: CODECS[name][3] for name in args.codecs.split(",")},
        "cases": cases,
    }
    (out / "video-codec-bench.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
