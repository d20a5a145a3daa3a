"""CUDA execution policy, and nothing else: provider options that suit diffusion, pointing providers at one stream,
free-dimension overrides, TensorRT profiles, and the gate that keeps device set-ups and graph captures apart. No
session is made here; the session recipe and the graph pool apply these decisions."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch


# Defaults for the CUDA EP where they suit diffusion's static, repeated shapes; a user's options always win.
#   cudnn_conv_algo_search HEURISTIC: cuDNN's heuristics pick each conv algorithm without timing them all, so a new
#     input signature's first run does not wait for a search; with a session (or graph) per signature the choice is
#     made once per signature either way. Pass cudnn_conv_algo_search="EXHAUSTIVE" to time every algorithm (each
#     signature's first run then waits for it);
#   cudnn_conv_use_max_workspace: let cuDNN pick algorithms that need a large workspace (faster on big convs);
#   arena_extend_strategy kSameAsRequested: grow the arena by what is asked, not by powers of two (less memory).
# Not fuse_conv_bias, though it saves a kernel where it works (the bias inside the cuDNN-frontend convolution instead
# of a cuDNN add-tensor kernel after it): with onnxruntime-gpu 1.31.1 it computed wrong outputs (fp16 and fp32
# exports, with CUDA graphs too) and failed to build cuDNN graphs for some fp16 exports.
CUDA_DIFFUSION_DEFAULTS: Dict[str, str] = {
    "cudnn_conv_algo_search": "HEURISTIC",
    "cudnn_conv_use_max_workspace": "1",
    "arena_extend_strategy": "kSameAsRequested",
}

# TensorRT EP defaults: fp16 engines, cached on disk (building one takes minutes), CUDA graphs inside TensorRT.
TENSORRT_DIFFUSION_DEFAULTS: Dict[str, str] = {
    "trt_fp16_enable": "1",
    "trt_engine_cache_enable": "1",
    "trt_timing_cache_enable": "1",
}

DISABLE_SYNC_RUN_OPTION = "disable_synchronize_execution_providers"
# what ORT says when it refuses graph capture because a node is placed on another EP (the CPU)
PLACEMENT_REFUSAL = "all compute graph nodes have not been partitioned"
GRAPH_ID_RUN_OPTION = "gpu_graph_id"


class SetupGate:
    """Keeps graph captures alone, and sessions being made apart from first runs.

    ORT captures a graph in the stream capture mode in which any thread's ``cudaMalloc`` or synchronous copy fails the
    capture ("operation failed due to a previous error during capture", when a session is built in a thread beside a
    capture). So a capture waits until nothing else below runs, and everything waits for a capture:
    - a set-up (:meth:`setup`: weights uploaded, buffers allocated, a memory query) goes beside anything but a capture;
    - a session being made (:meth:`build`; pipelines make them in background threads, side by side) is also never
      beside a first run: with ONNX Runtime 1.31's CUDA provider, a session being made crashed (a segmentation fault)
      while another thread ran one;
    - a first run (:meth:`first_run`: a graph runner's first run in a thread, ORT's regular run before the capture
      that builds cuDNN's plans and grows the arena, and a run made ahead of a first call,
      :meth:`~.graph_pool.CudaGraphRunner.warm`) goes beside other first runs (the text encoder's beside the
      denoiser's) and set-ups, never beside a session being made."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._counts = {"setup": 0, "build": 0, "first run": 0, "capture": 0}

    @contextlib.contextmanager
    def _entered(self, kind: str, excluded: Tuple[str, ...]) -> Iterator[None]:
        with self._condition:
            while any(self._counts[other] for other in excluded):
                self._condition.wait()
            self._counts[kind] += 1
        try:
            yield
        finally:
            with self._condition:
                self._counts[kind] -= 1
                self._condition.notify_all()

    def setup(self) -> contextlib.AbstractContextManager:
        """Weights uploaded, buffers allocated, a memory query: beside anything but a capture."""
        return self._entered("setup", ("capture",))

    def build(self) -> contextlib.AbstractContextManager:
        """A session being made: beside set-ups and other sessions being made."""
        return self._entered("build", ("capture", "first run"))

    def first_run(self) -> contextlib.AbstractContextManager:
        """A run without a graph that builds what a capture needs: beside set-ups and other first runs."""
        return self._entered("first run", ("capture", "build"))

    def capture(self) -> contextlib.AbstractContextManager:
        """A capture: alone."""
        return self._entered("capture", ("capture", "setup", "build", "first run"))


DEVICE_SETUP = SetupGate()


def default_trt_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
    return os.path.join(base, "optimum-iobinding", "tensorrt")


def with_diffusion_defaults(providers: Sequence[str], options: Sequence[Dict[str, str]]) -> List[Dict[str, str]]:
    """Adds :data:`CUDA_DIFFUSION_DEFAULTS` / :data:`TENSORRT_DIFFUSION_DEFAULTS` under the user's own options."""
    merged = []
    for name, given in zip(providers, options):
        if name == "CUDAExecutionProvider":
            merged.append({**CUDA_DIFFUSION_DEFAULTS, **given})
        elif name == "TensorrtExecutionProvider":
            merged.append(
                {
                    **TENSORRT_DIFFUSION_DEFAULTS,
                    "trt_engine_cache_path": default_trt_cache_dir(),
                    "trt_timing_cache_path": default_trt_cache_dir(),
                    **given,
                }
            )
        else:
            merged.append(dict(given))
    return merged


def with_stream(
    providers: Sequence[str], options: Sequence[Dict[str, str]], stream: torch.cuda.Stream
) -> List[Dict[str, str]]:
    """Points every CUDA-like provider at ``stream``: ORT then enqueues its kernels where torch enqueues its own."""
    handle = str(stream.cuda_stream)
    return [
        {**opts, "user_compute_stream": handle, "has_user_compute_stream": "1"}
        if name in ("CUDAExecutionProvider", "TensorrtExecutionProvider")
        else dict(opts)
        for name, opts in zip(providers, options)
    ]


def free_dimension_overrides(
    declared: Mapping[str, Optional[Sequence[Any]]], input_shapes: Mapping[str, Sequence[int]]
) -> Tuple[Dict[str, int], List[str]]:
    """The named input dims to fix for one input signature, and the reasons some dims cannot be fixed.

    With every free dim fixed, ORT folds the shape subgraphs exporters write (Shape → Gather → Concat …) into
    constants, so no node is left on the CPU and the graph can be captured. A dim two inputs give different sizes,
    or an unnamed one, cannot be fixed by name.
    """
    overrides: Dict[str, int] = {}
    problems: List[str] = []
    conflicting = set()
    for name, shape in input_shapes.items():
        dims = declared.get(name)
        if dims is None:
            problems.append(f"input {name!r} has no declared shape")
            continue
        for axis, (dim, size) in enumerate(zip(dims, shape)):
            if isinstance(dim, str):
                if overrides.get(dim, size) != size:
                    conflicting.add(dim)
                overrides[dim] = int(size)
            elif dim is None:
                problems.append(f"input {name!r} dim {axis} is unnamed")
    for dim in conflicting:
        del overrides[dim]
        problems.append(f"inputs give dim {dim!r} different sizes")
    return overrides, problems


def tensorrt_profile_options(input_shapes: Mapping[str, Sequence[int]]) -> Dict[str, str]:
    """TensorRT EP options for one static optimization profile: min = opt = max = the given shapes."""
    profile = ",".join(f"{name}:{'x'.join(str(int(d)) for d in shape)}" for name, shape in input_shapes.items())
    return {"trt_profile_min_shapes": profile, "trt_profile_opt_shapes": profile, "trt_profile_max_shapes": profile}
