"""The benchmark's measuring instruments, each usable alone: device memory peaks (:class:`PeakMemory`), host↔device
bytes (:func:`copied_bytes`), the host's waits for the GPU (:func:`host_waits`), the GPU floor of one step
(back-to-back CUDA-graph replays of the UNet: :func:`run_floor`, :func:`own_graph_floor`) and the environment a
result was measured in (:func:`environment`)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

if TYPE_CHECKING:  # annotations only: torch is imported where it is used, not for --help
    import torch

from ..errors import ArgumentError
from .zoo import MODEL_SIZES, recipe_of


class PeakMemory:
    """Samples device-wide used memory (ORT's arenas count too) every 2 ms or sooner, from load to the last call.

    ``source``:
      * ``"process"`` (what ``"auto"`` picks where ``pynvml``, from the package nvidia-ml-py, finds the device): a
        child process at the lowest CPU priority polls NVML every millisecond. The measured process runs no sampling
        thread at all.
      * ``"nvml"``: a thread of this process polls NVML every 2 ms.
      * ``"cudart"`` (what ``"auto"`` falls back to): a thread polls ``cudaMemGetInfo`` every 2 ms (the bench's
        only source before the sampling process).
    A sampling thread shares the GIL with the pipeline's own threads; the child process keeps the measured process
    as a user's would be. Whether the thread costs anything measurable is open (``benchmarks/cold_start.py``'s
    ``sampled-*`` variants; ``benchmarks/results/h100/2026-11-24-61d0f43``)."""

    def __init__(self, device: torch.device, source: str = "auto"):
        if source not in ("auto", "process", "nvml", "cudart"):
            raise ArgumentError("source", f"expected 'auto', 'process', 'nvml' or 'cudart', got {source!r}")
        self.device = device
        self.peak = 0
        self._read = nvml_reader(device) if source != "cudart" else None
        if self._read is None and source in ("process", "nvml"):
            raise RuntimeError(f"source={source!r}: pynvml is not installed or does not find this device")
        self.source = source if source != "auto" else ("process" if self._read is not None else "cudart")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._child: Optional[subprocess.Popen] = None

    @property
    def exit_code(self) -> Optional[int]:
        """The sampling process's exit status once it has reported its peak (``source="process"``); ``None`` before
        that, and for the sampling threads."""
        return None if self._child is None else self._child.returncode

    def used(self) -> int:
        """The device's used bytes now, from this sampler's source."""
        import torch

        if self._read is not None:
            return self._read()
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.used())
            time.sleep(0.002)

    def __enter__(self) -> "PeakMemory":
        self.peak = self.used()
        if self.source == "process":
            self._child = subprocess.Popen(
                [sys.executable, "-c", _SAMPLER, pci_bus_id(self.device)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            ready = self._child.stdout.readline().strip()
            if ready != "ready":
                self._child.kill()
                raise RuntimeError(f"the memory sampling process did not start (it said {ready!r})")
        else:
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._child is not None:
            answer, _ = self._child.communicate("stop\n", timeout=30)
            self.peak = max(self.peak, int(answer.split()[-1]))
        else:
            self._stop.set()
            self._thread.join()
        self.peak = max(self.peak, self.used())


# the sampling process: NVML's used bytes of one device every millisecond until a line comes in; then the peak. It
# runs at the lowest CPU priority: where the measured process's threads want every CPU (sessions built side by side
# at a cold start), it yields to them instead of taking one (ORT's arenas only grow, so a later sample still sees
# what they hold)
_SAMPLER = """
import os, select, sys, pynvml
if hasattr(os, "nice"):
    os.nice(19)
pynvml.nvmlInit()
handle = pynvml.nvmlDeviceGetHandleByPciBusId(sys.argv[1])
read = lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used
peak = read()
print("ready", flush=True)
while not select.select([sys.stdin], [], [], 0.001)[0]:
    peak = max(peak, read())
print(max(peak, read()), flush=True)
"""


def pci_bus_id(device: torch.device) -> str:
    """The PCI address of ``device`` as NVML names it (``"00000000:17:00.0"``)."""
    import torch

    props = torch.cuda.get_device_properties(device)
    return f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"


def nvml_reader(device: torch.device) -> Optional[Callable[[], int]]:
    """A reader of the device's used bytes through NVML, the device found by its PCI address (so that
    CUDA_VISIBLE_DEVICES needs no mapping), or None where pynvml is missing or cannot answer."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(pci_bus_id(device))
        pynvml.nvmlDeviceGetMemoryInfo(handle)
    except Exception:  # noqa: BLE001 — any failure means: sample through the CUDA runtime instead
        return None
    return lambda: int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)


def copied_bytes(run: Callable[[], Any]) -> Dict[str, int]:
    """Host↔device bytes that ``run`` moves, from the profiler's memcpy activity (ORT's copies included)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        trace_path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(trace_path)
        events = json.loads(Path(trace_path).read_text()).get("traceEvents", [])
    totals = {"htod": 0, "dtoh": 0}
    for event in events:
        name = str(event.get("name", ""))
        if event.get("cat") in ("gpu_memcpy", "Memcpy") or name.startswith("Memcpy"):
            size = int((event.get("args") or {}).get("bytes", 0))
            if "HtoD" in name:
                totals["htod"] += size
            elif "DtoH" in name:
                totals["dtoh"] += size
    return totals


# CUDA runtime/driver calls that make the host wait for the GPU (cudaMemcpy: the synchronous copy)
HOST_WAITS = frozenset(
    {
        "cudaStreamSynchronize",
        "cudaDeviceSynchronize",
        "cudaEventSynchronize",
        "cudaMemcpy",
        "cuStreamSynchronize",
        "cuCtxSynchronize",
        "cuEventSynchronize",
    }
)


def host_waits(run: Callable[[], Any]) -> List[str]:
    """The host waits inside ``run`` (ORT's included; the profiler's own device synchronization when it stops is
    outside), each as its name and the innermost Python frames that led to it (where the profiler recorded them)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        with record_function("measured"):
            run()
    events = prof.events()
    (measured,) = [
        event
        for event in events  # the host's range (the GPU timeline has one of the same name)
        if event.name == "measured" and event.device_type == torch.autograd.DeviceType.CPU
    ]
    inside = measured.time_range
    return [
        " < ".join([event.name, *[frame for frame in (event.stack or []) if ".py(" in frame][:4]])
        for event in events
        if event.name in HOST_WAITS and inside.start <= event.time_range.start and event.time_range.end <= inside.end
    ]


def kernel_table(work: Callable[[], object], calls: int = 5, top: int = 15) -> List[Dict[str, object]]:
    """The GPU kernels of ``calls`` runs of ``work``: name, ms per run, share of the GPU time, launches per run."""
    import torch
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            work()
        torch.cuda.synchronize()
    total: Dict[str, float] = defaultdict(float)
    count: Dict[str, int] = defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total[event.name] += event.time_range.elapsed_us()
            count[event.name] += 1
    whole = sum(total.values()) or 1.0
    rows = sorted(total, key=total.get, reverse=True)[:top]
    return [
        {
            "kernel": name[:160],
            "ms": total[name] / calls / 1000,
            "share": total[name] / whole,
            "launches": count[name] / calls,
        }
        for name in rows
    ] + [{"kernel": "(all)", "ms": whole / calls / 1000}]


def run_floor(
    folder: Path, kind: str, replays: int = 50, provider_options: Optional[Dict[str, Any]] = None
) -> Dict[str, Any]:
    """Back-to-back CUDA-graph replays of the UNet alone, with CFG batch 2: the GPU time of one step.
    ``provider_options`` go on top of the diffusion defaults (benchmarks/unet_options.py compares them)."""
    import torch
    from ..runtime.model import IOBindingORTModel

    size = MODEL_SIZES[kind]
    unet = IOBindingORTModel.from_pretrained(
        folder, subfolder="unet", provider="CUDAExecutionProvider", provider_options=provider_options, cuda_graph=True
    )
    dtype = unet.input_dtypes["sample"]
    declared = unet.input_dims
    batch = 2 if recipe_of(kind)["guidance"] > 1.0 and kind != "lcm" else 1  # CFG doubles the UNet batch
    inputs = {
        "sample": torch.randn(batch, 4, size // 8, size // 8, device=unet.device, dtype=dtype),
        "timestep": torch.full(
            [batch] if declared["timestep"] else [], 500, device=unet.device, dtype=unet.input_dtypes["timestep"]
        ),
        "encoder_hidden_states": torch.randn(
            batch, 77, declared["encoder_hidden_states"][2], device=unet.device, dtype=dtype
        ),
    }
    for name in ("text_embeds", "time_ids", "timestep_cond"):  # SDXL's conditioning, LCM's guidance embedding
        if name in declared:
            inputs[name] = torch.randn(batch, declared[name][1], device=unet.device, dtype=unet.input_dtypes[name])
    stream = unet.stream
    with torch.cuda.stream(stream):
        for _ in range(3):
            unet(**inputs)
        runner = unet.graph_runner({name: tuple(tensor.shape) for name, tensor in inputs.items()})
        if runner is None:
            return {"peer": "floor", "error": "the UNet could not be captured as a CUDA graph"}
    return {"peer": "floor", "per_step_ms": replay_ms(runner, stream, replays)}


def replay_ms(runner, stream: "torch.cuda.Stream", replays: int) -> float:
    """ms per replay of ``runner``'s graph, ``replays`` of them back to back on ``stream`` (CUDA events)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        for _ in range(replays):
            runner.run(runner.input_buffers)
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / replays


def own_graph_floor(pipe, replays: int = 50) -> Optional[float]:
    """The GPU floor measured inside a peer's own process: back-to-back replays of the UNet graph its loop captured
    (the same graph, the same memory, the same clocks as its timed calls), in ms per replay; None where its UNet has
    no graph or more than one (the single scenario uses one shape). ``floor`` (:func:`run_floor`) is the same
    measurement in a process of its own; the two differ slightly, for reasons not known
    (``benchmarks/results/h100/2026-11-24-61d0f43``)."""
    unet = getattr(pipe, "unet", None)
    return graph_floor_ms(unet, replays) if unet is not None and hasattr(unet, "graph_signatures") else None


def graph_floor_ms(model: Any, replays: int = 20) -> Optional[float]:
    """ms per back-to-back replay of the one CUDA graph ``model`` (an :class:`IOBindingORTModel`) captured; None where
    it captured none or more than one."""
    import torch

    signatures = model.graph_signatures
    if len(signatures) != 1:
        return None
    runner = model.graph_runner(signatures[0])
    if runner is None:
        return None
    with torch.cuda.stream(model.stream):
        runner.run(runner.input_buffers)
    return replay_ms(runner, model.stream, replays)


def command_line() -> str:
    """The command that made a result: the bench's (``optimum-iobinding bench …``, however it was started), or a
    script's (``python3 benchmarks/step_cache_probe.py …``)."""
    if sys.argv[1:2] == ["bench"]:
        return " ".join(["optimum-iobinding", *sys.argv[1:]])
    script = os.path.basename(sys.argv[0])
    if script.endswith(".py") and script not in ("cli.py", "__main__.py"):
        return " ".join(["python3", sys.argv[0], *sys.argv[1:]])
    return " ".join(["optimum-iobinding bench", *sys.argv[1:]])


def environment() -> Dict[str, Any]:
    """What a result was measured with: the device, the versions of Python, torch, CUDA, ONNX Runtime, diffusers,
    transformers and onnx, the command line and the date."""
    import torch
    import onnxruntime as ort

    info = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "onnxruntime": ort.__version__,
        "command": command_line(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    for module in ("diffusers", "transformers", "onnx"):
        try:
            info[module] = __import__(module).__version__
        except ImportError:
            pass
    return info
