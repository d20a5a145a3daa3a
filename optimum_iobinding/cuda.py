"""CUDA execution policy: provider options that suit diffusion, the shared stream, free-dimension overrides and the
CUDA-graph runner. No pipeline logic here; ``IOBindingORTModel`` decides when to use each piece."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import onnxruntime as ort
import torch

from .dtypes import TORCH_TO_ONNX

# Defaults for the CUDA EP where they suit diffusion's static, repeated shapes; a user's options always win.
#   cudnn_conv_algo_search EXHAUSTIVE: benchmark every conv algorithm once per shape (shapes repeat every step);
#   cudnn_conv_use_max_workspace: let cuDNN pick algorithms that need a large workspace (faster on big convs);
#   arena_extend_strategy kSameAsRequested: grow the arena by what is asked, not by powers of two (less memory).
# Not fuse_conv_bias, though it is faster where it works (the bias inside the cuDNN-frontend convolution instead of a
# cuDNN add-tensor kernel after it: SD1.5 fused UNet step 7.23 → 6.92 ms on the H100, and the host-bound binding loop
# 4 ms/step faster): with onnxruntime-gpu 1.31.1 it computed wrong images (tiny fp16 fused and fp32 exports; CUDA
# graphs too) and failed to build cuDNN graphs for fp16 plain exports (benchmarks/results/h100/fuse-conv-bias).
CUDA_DIFFUSION_DEFAULTS: Dict[str, str] = {
    "cudnn_conv_algo_search": "EXHAUSTIVE",
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
GRAPH_ID_RUN_OPTION = "gpu_graph_id"


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
            merged.append({**TENSORRT_DIFFUSION_DEFAULTS, "trt_engine_cache_path": default_trt_cache_dir(),
                           "trt_timing_cache_path": default_trt_cache_dir(), **given})
        else:
            merged.append(dict(given))
    return merged


def with_stream(providers: Sequence[str], options: Sequence[Dict[str, str]], stream: torch.cuda.Stream) -> List[Dict[str, str]]:
    """Points every CUDA-like provider at ``stream``: ORT then enqueues its kernels where torch enqueues its own."""
    handle = str(stream.cuda_stream)
    return [
        {**opts, "user_compute_stream": handle, "has_user_compute_stream": "1"}
        if name in ("CUDAExecutionProvider", "TensorrtExecutionProvider") else dict(opts)
        for name, opts in zip(providers, options)
    ]


def stream_of_session(session: ort.InferenceSession, device: torch.device) -> Optional[torch.cuda.Stream]:
    """The stream a session was created with (``user_compute_stream``), wrapped for torch; ``None`` if it has none."""
    options = session.get_provider_options().get(session.get_providers()[0], {})
    handle = options.get("user_compute_stream")
    if not handle or int(handle) == 0:
        return None
    return torch.cuda.ExternalStream(int(handle), device=device)


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


class CudaGraphRunner:
    """One session whose free dims are fixed to one input signature, run from fixed buffers so that ORT captures
    it as a CUDA graph on its first run and replays it afterwards.

    New inputs are copied into ``input_buffers`` (on the caller's stream, so in order with the replay); results
    are left in ``output_buffers`` — the same tensors every call.
    """

    def __init__(
        self,
        session: ort.InferenceSession,
        input_specs: Mapping[str, Tuple[Tuple[int, ...], torch.dtype]],
        output_specs: Mapping[str, Tuple[Tuple[int, ...], torch.dtype]],
        device: torch.device,
        run_options: ort.RunOptions,
    ):
        self.session = session
        self.device = device
        self.run_options = run_options
        self.input_buffers = {n: torch.zeros(s, dtype=d, device=device) for n, (s, d) in input_specs.items()}
        self.output_buffers = {n: torch.empty(s, dtype=d, device=device) for n, (s, d) in output_specs.items()}
        self.binding = session.io_binding()
        for buffers, bind in ((self.input_buffers, self.binding.bind_input), (self.output_buffers, self.binding.bind_output)):
            for name, tensor in buffers.items():
                bind(name, "cuda", device.index or 0, TORCH_TO_ONNX[tensor.dtype], list(tensor.shape), tensor.data_ptr())
        self.runs = 0

    def run(self, inputs: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        for name, tensor in inputs.items():
            buffer = self.input_buffers[name]
            if tensor.data_ptr() != buffer.data_ptr():
                buffer.copy_(tensor, non_blocking=True)
        self.session.run_with_iobinding(self.binding, self.run_options)
        self.runs += 1
        return self.output_buffers
