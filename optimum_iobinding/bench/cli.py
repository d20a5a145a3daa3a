"""Benchmark: the same ONNX files through every ONNX peer, plus diffusers' torch pipeline, on one GPU in one run.

Peers (each runs in its own process, so that memory and ORT arenas do not mix, and so that optimum-onnx can run in its
own environment — pass its site folder with ``--optimum-pythonpath``):

  numpy    diffusers' OnnxStableDiffusionPipeline (numpy round trips every step)
  optimum  optimum-onnx's ORTStableDiffusionPipeline(use_io_binding=True)
  defaults ours, from_pretrained(folder, provider="CUDAExecutionProvider") with nothing else: what a new user gets
  binding  ours, io_binding=True, cuda_graph=False
  graph    ours, cuda_graph=True
  torch    diffusers' StableDiffusionPipeline, fp16 eager
  floor    not a pipeline: back-to-back CUDA-graph replays of the UNet alone (the GPU floor of one step)

Every pipeline gets the same initial latents, prompt, DDIM scheduler and step count. Reported per pipeline: end-to-end
ms (median of ``--runs`` after ``--warmup``), per-step ms ((median at N steps − median at 2 steps) / (N − 2): the loop
alone), for ours also the GPU's time per step inside whole calls (CUDA events at the first and the last step) and
their UNet graph replayed alone in the same process, peak GPU memory above the process's idle (device-wide, sampled
every millisecond by a child process through NVML where pynvml is installed, so ORT's arenas count), host↔device
bytes per step (profiled: (bytes at 4 steps − bytes at 2 steps) / 2), the largest pixel difference from the numpy
pipeline's image, and the cold start: seconds to load the pipeline (its imports timed apart, as ``import_s``) and seconds
for its first image (fresh process).
``--repeats N`` runs each peer in N processes, the peer order rotated each time, and reports the median over them
(host-bound loops move by ±20 % from one process to the next on the same machine).

``--scenario mixed`` is a service's load instead: batch sizes 1, 4, 8, 2 in turn (``--mixed-batches``), ``--mixed-
steps`` steps each, for ``--rounds`` rounds of ``--cycles`` passes over them: per round and batch size the median
ms of its calls, device memory, sessions created after the first round; the peer ``warmed`` is "defaults" with
``pipe.warmup(...)`` for those batch sizes after loading.

    optimum-iobinding bench --models tiny,small,sd15 --dtypes fp16 --exports plain,optimized --out benchmarks/results/h100
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import torch

try:  # the export lock; absent on Windows, where bench processes then must not share a work folder
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

PEERS = ("numpy", "optimum", "accelerated", "defaults", "binding", "graph", "torch")
OUR_PEERS = ("defaults", "warmed", "binding", "graph")
MIXED_PEERS = ("numpy", "defaults", "warmed", "binding", "graph")
# peers that run in the optimum-onnx environment (--optimum-pythonpath)
OPTIMUM_PEERS = ("optimum", "accelerated")
MODEL_SIZES = {"tiny": 512, "small": 256, "sd15": 512, "sdxl": 1024, "lcm": 512, "turbo": 512}
# How each model is called: guidance, the step count of the short run (per-step time = the difference / steps),
# a fixed step count for few-step models (else --steps), and the scheduler.
RECIPES: Dict[str, Dict[str, Any]] = {
    "default": dict(guidance=7.5, short_steps=2, steps=None, scheduler="ddim"),
    "sdxl": dict(guidance=5.0, short_steps=2, steps=None, scheduler="ddim"),
    "lcm": dict(guidance=8.5, short_steps=1, steps=4, scheduler="lcm"),  # guidance as an embedding, no CFG batch
    "turbo": dict(guidance=0.0, short_steps=1, steps=4, scheduler="euler-a-trailing"),  # SD-Turbo: no guidance
}


def recipe_of(kind: str) -> Dict[str, Any]:
    return RECIPES.get(kind, RECIPES["default"])
PROMPT = "a photo of an astronaut riding a horse on mars"


# ------------------------------------------------------------------------------------------------------ models
def build_torch_pipeline(kind: str, seed: int = 0):
    """Random-weights torch pipelines (weights do not change speed): the tiny one, a small UNet (64–256 channels,
    for 256²), the SD1.5 architecture, LCM (SD1.5 with a guidance-embedding input), SD-Turbo (SD 2.1-base) and
    SDXL base."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from ..export.tiny import build_tiny_random_pipeline, write_tiny_tokenizer

    if kind == "tiny":
        pipe = build_tiny_random_pipeline(seed)
    else:
        torch.manual_seed(seed)
        with tempfile.TemporaryDirectory() as folder:
            tokenizer = write_tiny_tokenizer(folder)
        if kind == "small":
            unet = UNet2DConditionModel(
                block_out_channels=(64, 128, 256), layers_per_block=2, sample_size=32, cross_attention_dim=768,
                down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"), attention_head_dim=8,
            )
            text_layers = 4
        elif kind in ("sd15", "lcm"):
            # LCM: the SD1.5 UNet with the guidance-embedding input LCM distillation adds (LCM-Dreamshaper's 256)
            unet = UNet2DConditionModel(sample_size=64, cross_attention_dim=768, attention_head_dim=8,
                                        time_cond_proj_dim=256 if kind == "lcm" else None)
            text_layers = 12
        elif kind == "turbo":  # SD-Turbo: the SD 2.1-base architecture
            unet = UNet2DConditionModel(sample_size=64, cross_attention_dim=1024, attention_head_dim=(5, 10, 20, 20),
                                        use_linear_projection=True)
            text_layers = 23
        elif kind == "sdxl":
            return _sdxl_architecture(tokenizer)
        else:
            raise ValueError(f"model: expected one of {sorted(MODEL_SIZES)}, got {kind!r}")
        width = 1024 if kind == "turbo" else 768
        text_encoder = CLIPTextModel(CLIPTextConfig(
            hidden_size=width, intermediate_size=4 * width, num_attention_heads=width // 64,
            num_hidden_layers=text_layers, max_position_embeddings=77, vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, hidden_act="gelu" if kind == "turbo" else "quick_gelu",
        ))
        vae = _sd_vae()
        if kind == "lcm":
            from diffusers import LatentConsistencyModelPipeline, LCMScheduler

            return LatentConsistencyModelPipeline(
                vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                scheduler=LCMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear"),
                safety_checker=None, feature_extractor=None, requires_safety_checker=False,
            )
        pipe = StableDiffusionPipeline(
            vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
            scheduler=DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                    clip_sample=False, set_alpha_to_one=False, steps_offset=1),
            safety_checker=None, feature_extractor=None, requires_safety_checker=False,
        )
    set_recipe_scheduler(pipe, kind)
    return pipe


def _sd_vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=4,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
    )


def _sdxl_architecture(tokenizer):
    """SDXL base's architecture with random weights: CLIP ViT-L and OpenCLIP bigG text encoders, the 2.6 B UNet."""
    from diffusers import DDIMScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    def text_config(width, layers, heads, projection=None):
        return CLIPTextConfig(
            hidden_size=width, intermediate_size=4 * width, num_attention_heads=heads, num_hidden_layers=layers,
            max_position_embeddings=77, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, hidden_act="gelu",
            **({"projection_dim": projection} if projection else {}),
        )

    unet = UNet2DConditionModel(
        sample_size=128, block_out_channels=(320, 640, 1280), layers_per_block=2,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), cross_attention_dim=2048,
        use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
        projection_class_embeddings_input_dim=2816,
    )
    vae = _sd_vae()
    vae.register_to_config(scaling_factor=0.13025, sample_size=1024)
    return StableDiffusionXLPipeline(
        vae=vae, text_encoder=CLIPTextModel(text_config(768, 12, 12)),
        text_encoder_2=CLIPTextModelWithProjection(text_config(1280, 32, 20, projection=1280)),
        tokenizer=tokenizer, tokenizer_2=tokenizer, unet=unet,
        scheduler=DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                clip_sample=False, set_alpha_to_one=False, steps_offset=1),
    )


def set_recipe_scheduler(pipe: Any, kind: str) -> None:
    from diffusers import DDIMScheduler, EulerAncestralDiscreteScheduler, LCMScheduler

    name = recipe_of(kind)["scheduler"]
    if name == "ddim":
        # clip_sample off as in SD's own DDIM config: a config without the key (the tiny pipeline's PNDM one) would
        # turn it on, while diffusers' ONNX pipeline turns it off when it loads such a config — different loops
        pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config, clip_sample=False)
    elif name == "lcm":
        pipe.scheduler = LCMScheduler.from_config(pipe.scheduler.config)
    else:
        pipe.scheduler = EulerAncestralDiscreteScheduler.from_config(pipe.scheduler.config,
                                                                     timestep_spacing="trailing")


def ensure_export(kind: str, dtype: str, export: str, work: Path) -> Path:
    """The export of one configuration under ``work``, made once and shared by every process that asks for it.

    Exports are built beside the folder and renamed into place, so a folder with a model_index.json is always whole;
    a lock file serialises processes that want the same export (``--export-only`` can make the next models' exports in
    the background while the GPU measures the current one).
    """
    from ..export import export_pipeline

    folder = work / f"{kind}-{dtype}-{export}"
    work.mkdir(parents=True, exist_ok=True)
    with _ExportLock(work / f".{folder.name}.lock"):
        if not (folder / "model_index.json").is_file():
            if folder.exists():  # not one of ours (ours appear whole, by a rename): never delete it
                raise FileExistsError(f"--work: {str(folder)!r} exists but is not a finished export (no "
                                      "model_index.json); move it away or choose another --work folder")
            # export_pipeline builds beside the folder and renames it into place once whole
            export_pipeline(None, folder, fp16=dtype == "fp16", optimize="cuda" if export == "optimized" else None,
                            progress=False, torch_pipeline=build_torch_pipeline(kind))
    return folder


class _ExportLock:
    """An exclusive advisory lock on a file (POSIX flock); where flock does not exist, no lock."""

    def __init__(self, path: Path):
        self.path = path
        self.handle: Any = None

    def __enter__(self) -> "_ExportLock":
        self.handle = open(self.path, "a")
        if fcntl is not None:
            fcntl.flock(self.handle.fileno(), fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: Any) -> None:
        if fcntl is not None:
            fcntl.flock(self.handle.fileno(), fcntl.LOCK_UN)
        self.handle.close()


# ------------------------------------------------------------------------------------------------- measurement
class PeakMemory:
    """Samples device-wide used memory (ORT's arenas count too) every 2 ms or sooner, from load to the last call.

    ``source``:
      * ``"process"`` (what ``"auto"`` picks where ``pynvml``, from the package nvidia-ml-py, finds the device): a
        child process polls NVML every millisecond. The measured process runs no sampling thread at all.
      * ``"nvml"``: a thread of this process polls NVML every 2 ms.
      * ``"cudart"`` (what ``"auto"`` falls back to): a thread polls ``cudaMemGetInfo`` every 2 ms, as the bench did
        up to session 13.
    A sampling thread shares the GIL with the pipeline's own threads; the child process keeps the measured process
    as a user's would be. Whether the thread costs anything measurable is open (``benchmarks/cold_start.py``'s
    ``sampled-*`` variants; ``benchmarks/results/h100/session14``)."""

    def __init__(self, device: torch.device, source: str = "auto"):
        if source not in ("auto", "process", "nvml", "cudart"):
            raise ValueError(f"source: expected 'auto', 'process', 'nvml' or 'cudart', got {source!r}")
        self.device = device
        self.peak = 0
        self._read = _nvml_reader(device) if source != "cudart" else None
        if self._read is None and source in ("process", "nvml"):
            raise RuntimeError(f"source={source!r}: pynvml is not installed or does not find this device")
        self.source = source if source != "auto" else ("process" if self._read is not None else "cudart")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._child: Optional[subprocess.Popen] = None

    def used(self) -> int:
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
            self._child = subprocess.Popen([sys.executable, "-c", _SAMPLER, _pci_bus_id(self.device)],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
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


# the sampling process: NVML's used bytes of one device every millisecond until a line comes in; then the peak
_SAMPLER = """
import select, sys, pynvml
pynvml.nvmlInit()
handle = pynvml.nvmlDeviceGetHandleByPciBusId(sys.argv[1])
read = lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used
peak = read()
print("ready", flush=True)
while not select.select([sys.stdin], [], [], 0.001)[0]:
    peak = max(peak, read())
print(max(peak, read()), flush=True)
"""


def _pci_bus_id(device: torch.device) -> str:
    props = torch.cuda.get_device_properties(device)
    return f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"


def _nvml_reader(device: torch.device) -> Optional[Callable[[], int]]:
    """A reader of the device's used bytes through NVML, the device found by its PCI address (so that
    CUDA_VISIBLE_DEVICES needs no mapping), or None where pynvml is missing or cannot answer."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(_pci_bus_id(device))
        pynvml.nvmlDeviceGetMemoryInfo(handle)
    except Exception:  # noqa: BLE001 — any failure means: sample through the CUDA runtime instead
        return None
    return lambda: int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)


def copied_bytes(run: Callable[[], Any]) -> Dict[str, int]:
    """Host↔device bytes that ``run`` moves, from the profiler's memcpy activity (ORT's copies included)."""
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
HOST_WAITS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                        "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize"})


def host_waits(run: Callable[[], Any]) -> List[str]:
    """The host waits inside ``run`` (ORT's included; the profiler's own device synchronization when it stops is
    outside), each as its name and the innermost Python frames that led to it (where the profiler recorded them)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        with record_function("measured"):
            run()
    events = prof.events()
    (measured,) = [event for event in events  # the host's range (the GPU timeline has one of the same name)
                   if event.name == "measured" and event.device_type == torch.autograd.DeviceType.CPU]
    inside = measured.time_range
    return [" < ".join([event.name, *[frame for frame in (event.stack or []) if ".py(" in frame][:4]])
            for event in events if event.name in HOST_WAITS
            and inside.start <= event.time_range.start and event.time_range.end <= inside.end]


class PeerUnavailable(RuntimeError):
    """A peer that has no pipeline for a model (diffusers' numpy pipelines exist for SD 1.x/2.x only)."""


def import_peer(peer: str) -> float:
    """Imports what ``peer`` loads with, and returns the seconds it took: the cold-start columns time loading and the
    first image, not Python's imports (11–20 s on the GPU machines, and ±2 s from one process to the next)."""
    start = time.perf_counter()
    if peer == "numpy":
        from diffusers import OnnxStableDiffusionPipeline  # noqa: F401
    elif peer == "torch":
        from diffusers import StableDiffusionPipeline  # noqa: F401
    elif peer in OPTIMUM_PEERS:
        from optimum.onnxruntime import ORTStableDiffusionPipeline  # noqa: F401
    elif peer in OUR_PEERS:
        from ..pipelines import OnnxStableDiffusionPipeline  # noqa: F401
    return time.perf_counter() - start


def load_peer(peer: str, folder: Path, kind: str, dtype: str):
    """The pipeline of one peer, with the model's recipe scheduler, and how to pass it the initial latents."""
    torch_dtype = torch.float16 if dtype == "fp16" else torch.float32
    on_device = lambda lat: torch.from_numpy(lat).to("cuda", torch_dtype)  # noqa: E731
    if peer == "numpy":
        if kind in ("sdxl", "lcm"):
            raise PeerUnavailable(f"diffusers has no ONNX (numpy) pipeline for {kind}")
        from ..pipelines.loading import load_numpy_pipeline

        pipe = load_numpy_pipeline(folder)
        latents_of = lambda lat: lat.astype(np.float16 if dtype == "fp16" else np.float32)  # noqa: E731
    elif peer in OPTIMUM_PEERS:
        from optimum.onnxruntime import (
            ORTLatentConsistencyModelPipeline,
            ORTStableDiffusionPipeline,
            ORTStableDiffusionXLPipeline,
        )

        optimum_class = {"sdxl": ORTStableDiffusionXLPipeline, "lcm": ORTLatentConsistencyModelPipeline}.get(
            kind, ORTStableDiffusionPipeline)
        pipe = optimum_class.from_pretrained(folder, provider="CUDAExecutionProvider", use_io_binding=True)
        if peer == "accelerated":  # optimum's pipeline and loop, its parts switched to our fast path
            from ..integrations.optimum import accelerate

            accelerate(pipe, cuda_graph=True)
        latents_of = on_device
    elif peer in OUR_PEERS:
        from ..pipelines import (
            OnnxLatentConsistencyModelPipeline,
            OnnxStableDiffusionPipeline,
            OnnxStableDiffusionXLPipeline,
        )

        our_class = {"sdxl": OnnxStableDiffusionXLPipeline, "lcm": OnnxLatentConsistencyModelPipeline}.get(
            kind, OnnxStableDiffusionPipeline)
        graph_argument = {"binding": {"cuda_graph": False}, "graph": {"cuda_graph": True}}.get(peer, {})
        pipe = our_class.from_pretrained(folder, provider="CUDAExecutionProvider", **graph_argument)
        latents_of = on_device
    elif peer == "torch":
        pipe = build_torch_pipeline(kind).to("cuda", torch_dtype)
        latents_of = on_device
    else:
        raise ValueError(f"peer: expected one of {PEERS}, got {peer!r}")
    set_recipe_scheduler(pipe, kind)
    pipe.set_progress_bar_config(disable=True)
    return pipe, latents_of


def run_peer(peer: str, folder: Path, kind: str, dtype: str, steps: int, runs: int, warmup: int,
             image_path: Path) -> Dict[str, Any]:
    device = torch.device("cuda", 0)
    torch.cuda.init()
    size = MODEL_SIZES[kind]
    idle = PeakMemory(device).used()  # the same source as the sampler below: "auto" picks the same one
    recipe = recipe_of(kind)
    steps = recipe["steps"] or steps
    short_steps = recipe["short_steps"]
    latents = np.random.RandomState(0).randn(1, 4, size // 8, size // 8).astype(np.float32)
    import_s = import_peer(peer)
    with PeakMemory(device) as memory:
        start = time.perf_counter()
        try:
            pipe, latents_of = load_peer(peer, folder, kind, dtype)
        except PeerUnavailable as reason:
            return {"peer": peer, "skipped": str(reason)}
        load_s = time.perf_counter() - start

        def call(num_steps: int, **extra: Any):
            # stochastic steps (LCM, Euler ancestral) draw from a seeded device generator, the same for every peer
            # but the numpy one (diffusers' ONNX pipeline takes numpy generators only)
            noise = {} if peer == "numpy" else {"generator": torch.Generator("cuda").manual_seed(0)}
            with torch.inference_mode():
                images = pipe(PROMPT, height=size, width=size, num_inference_steps=num_steps,
                              guidance_scale=recipe["guidance"], latents=latents_of(latents), output_type="np",
                              **noise, **extra).images
            torch.cuda.synchronize()
            return np.asarray(images)

        def timed(num_steps: int) -> List[float]:
            times = []
            for _ in range(runs):
                start = time.perf_counter()
                call(num_steps)
                times.append((time.perf_counter() - start) * 1000)
            return times

        start = time.perf_counter()
        image = call(steps)  # the cold start's first image: sessions, algorithm search, graph capture
        first_image_s = time.perf_counter() - start
        for _ in range(warmup):
            image = call(steps)
        full = timed(steps)
        short = timed(short_steps)

        def gpu_step_ms() -> float:
            # CUDA events on the pipeline's stream at the end of the first and of the last step (the old-style
            # callback at steps 0 and steps - 1 only: the loop copies its constant inputs once more after it)
            events: Dict[int, torch.cuda.Event] = {}

            def mark(i: int, _t: Any, _latents: Any) -> None:
                events[i] = torch.cuda.Event(enable_timing=True)
                events[i].record()

            call(steps, callback=mark, callback_steps=steps - 1)
            return events[0].elapsed_time(events[steps - 1]) / (steps - 1)

        # the loop's GPU time per step inside whole calls (ours): no difference of two noisy medians in it
        gpu_steps = [gpu_step_ms() for _ in range(runs)] if peer in OUR_PEERS and steps > 2 else None
    own_floor = own_graph_floor(pipe) if peer in OUR_PEERS else None
    bytes_short, bytes_long = copied_bytes(lambda: call(short_steps)), copied_bytes(lambda: call(short_steps + 2))
    np.save(image_path, image.astype(np.float32))
    per_step = (statistics.median(full) - statistics.median(short)) / (steps - short_steps)
    gpu_step = statistics.median(gpu_steps) if gpu_steps else None
    return {
        "peer": peer,
        "end_to_end_ms": statistics.median(full),
        "end_to_end_ms_all": full,
        "steps": steps,
        "per_step_ms": per_step,
        "gpu_step_ms": gpu_step,
        "gpu_step_ms_all": gpu_steps,
        "own_floor_ms": own_floor,
        "per_step_over_own_floor": per_step / own_floor if own_floor else None,
        "gpu_step_over_own_floor": gpu_step / own_floor if own_floor and gpu_step else None,
        "peak_memory_mib": (memory.peak - idle) / 2**20,
        "memory_source": memory.source,
        "import_s": import_s,
        "load_s": load_s,
        "first_image_s": first_image_s,
        "htod_bytes_per_step": (bytes_long["htod"] - bytes_short["htod"]) / 2,
        "dtoh_bytes_per_step": (bytes_long["dtoh"] - bytes_short["dtoh"]) / 2,
        "image": str(image_path),
    }


def run_mixed(peer: str, folder: Path, kind: str, dtype: str, batches: Sequence[int], steps: int, rounds: int,
              first_steps: int, cycles: int = 1) -> Dict[str, Any]:
    """A service's load on one peer: load (timed, imports apart), a first image of ``first_steps`` steps at batch 1
    (timed: the cold start), then ``rounds`` rounds, each going ``cycles`` times through ``batches`` in turn (a call
    with that many images, ``steps`` steps per call). A round's time per batch size is the median of its ``cycles``
    calls (every call is kept in ``per_round_calls_ms``)."""
    device = torch.device("cuda", 0)
    torch.cuda.init()
    size = MODEL_SIZES[kind]
    idle = PeakMemory(device).used()
    guidance = recipe_of(kind)["guidance"]
    loaded_as = "defaults" if peer == "warmed" else peer
    import_s = import_peer(loaded_as)
    with PeakMemory(device) as memory:
        start = time.perf_counter()
        pipe, _ = load_peer(loaded_as, folder, kind, dtype)
        load_s = time.perf_counter() - start
        warmup_s = None
        if peer == "warmed":
            start = time.perf_counter()
            pipe.warmup(heights=size, batch_sizes=list(batches), guidance_scales=guidance)
            torch.cuda.synchronize()
            warmup_s = time.perf_counter() - start

        def call(batch: int, num_steps: int) -> float:
            noise = {} if peer == "numpy" else {"generator": torch.Generator("cuda").manual_seed(0)}
            start = time.perf_counter()
            with torch.inference_mode():
                pipe([PROMPT] * batch, height=size, width=size, num_inference_steps=num_steps,
                     guidance_scale=guidance, output_type="np", **noise)
            torch.cuda.synchronize()
            return (time.perf_counter() - start) * 1000

        first_image_s = call(1, first_steps) / 1000
        created = lambda: getattr(pipe, "sessions_created", None)  # noqa: E731 — ours only
        per_round_calls, sessions_after_round = mixed_rounds(lambda batch: call(batch, steps), batches, rounds,
                                                             cycles, created)
    return {
        "peer": peer, "scenario": "mixed", "batches": list(batches), "steps": steps, "rounds": rounds,
        "cycles": cycles, "import_s": import_s, "load_s": load_s, "warmup_s": warmup_s,
        "first_image_s": first_image_s, "first_steps": first_steps,
        "per_round_ms": [{batch: statistics.median(times) for batch, times in calls.items()}
                         for calls in per_round_calls],
        "per_round_calls_ms": per_round_calls, "sessions_after_round": sessions_after_round,
        "peak_memory_mib": (memory.peak - idle) / 2**20, "memory_source": memory.source,
    }


def mixed_rounds(call: Callable[[int], float], batches: Sequence[int], rounds: int, cycles: int,
                 created: Callable[[], Optional[int]]):
    """``rounds`` rounds of ``cycles`` passes over ``batches`` in turn: each round's ms per batch size (every call)
    and the session count after each round."""
    per_round_calls: List[Dict[str, List[float]]] = []
    sessions_after_round: List[Optional[int]] = []
    for _ in range(rounds):
        calls: Dict[str, List[float]] = {str(batch): [] for batch in batches}
        for _ in range(cycles):
            for batch in batches:
                calls[str(batch)].append(call(batch))
        per_round_calls.append(calls)
        sessions_after_round.append(created())
    return per_round_calls, sessions_after_round


def mixed_summary(result: Dict[str, Any]) -> Dict[str, Any]:
    """Per batch size: the best round's ms and the worst later round's ratio to it (the "within 5 %" check); and
    whether any session was created after the first round."""
    rounds = result["per_round_ms"]
    worst, best = {}, {}
    for batch in map(str, result["batches"]):
        times = [row[batch] for row in rounds]
        best[batch] = min(times)
        worst[batch] = max(times[1:]) / best[batch] if len(times) > 1 else 1.0
    sessions = [count for count in result.get("sessions_after_round", []) if count is not None]
    return {"best_ms": best, "worst_later_round_ratio": worst,
            "sessions_created_after_round_1": (sessions[-1] - sessions[0]) if sessions else None}


def run_floor(folder: Path, kind: str, replays: int = 50,
              provider_options: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Back-to-back CUDA-graph replays of the UNet alone, with CFG batch 2: the GPU time of one step.
    ``provider_options`` go on top of the diffusion defaults (benchmarks/unet_options.py compares them)."""
    from ..runtime.model import IOBindingORTModel

    size = MODEL_SIZES[kind]
    unet = IOBindingORTModel.from_pretrained(folder, subfolder="unet", provider="CUDAExecutionProvider",
                                             provider_options=provider_options, cuda_graph=True)
    dtype = unet.input_dtypes["sample"]
    declared = unet.input_dims
    batch = 2 if recipe_of(kind)["guidance"] > 1.0 and kind != "lcm" else 1  # CFG doubles the UNet batch
    inputs = {
        "sample": torch.randn(batch, 4, size // 8, size // 8, device=unet.device, dtype=dtype),
        "timestep": torch.full([batch] if declared["timestep"] else [], 500, device=unet.device,
                               dtype=unet.input_dtypes["timestep"]),
        "encoder_hidden_states": torch.randn(batch, 77, declared["encoder_hidden_states"][2], device=unet.device,
                                             dtype=dtype),
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
    (``benchmarks/results/h100/session14``)."""
    unet = getattr(pipe, "unet", None)
    signatures = getattr(unet, "graph_signatures", [])
    if len(signatures) != 1:
        return None
    runner = unet.graph_runner(signatures[0])
    if runner is None:
        return None
    with torch.cuda.stream(unet.stream):
        runner.run(runner.input_buffers)
    return replay_ms(runner, unet.stream, replays)


# ------------------------------------------------------------------------------------------------- orchestration
def environment() -> Dict[str, Any]:
    import onnxruntime as ort

    info = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "onnxruntime": ort.__version__,
        "command": " ".join(["optimum-iobinding", *sys.argv[1:]]) if sys.argv[1:2] == ["bench"] else
        " ".join(["optimum-iobinding bench", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    for module in ("diffusers", "transformers", "onnx"):
        try:
            info[module] = __import__(module).__version__
        except ImportError:
            pass
    return info


def _subprocess(args: List[str], pythonpath: Optional[str], timeout: int) -> Dict[str, Any]:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as result_file:
        result_path = result_file.name
    try:
        completed = subprocess.run([sys.executable, "-m", "optimum_iobinding.bench", *args, "--result", result_path],
                                   env=env, capture_output=True, text=True, timeout=timeout)
        if completed.returncode != 0:
            return {"error": (completed.stderr or completed.stdout)[-2000:]}
        return json.loads(Path(result_path).read_text())
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    finally:
        os.unlink(result_path)


def combine_repeats(results: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """One peer's results from several processes (``--repeats``) as one: the median over the processes of each
    one's median time, per-step time, load and first-image seconds; the highest memory peak and copy counts; every
    timed run in ``end_to_end_ms_all``; each process's own result in ``repeats``. A process that failed or was
    skipped makes the whole result that failure (with the others kept in ``repeats``)."""
    if len(results) == 1:
        return results[0]
    kept = [{key: value for key, value in result.items() if key != "image"} for result in results]
    for result in results:
        if "error" in result or "skipped" in result:
            return {**result, "repeats": kept}
    combined = dict(results[0])
    for key in ("end_to_end_ms", "per_step_ms", "load_s", "first_image_s", "own_floor_ms",
                "per_step_over_own_floor", "gpu_step_ms", "gpu_step_over_own_floor"):
        values = [result[key] for result in results if result.get(key) is not None]
        combined[key] = statistics.median(values) if values else None
    for key in ("peak_memory_mib", "htod_bytes_per_step", "dtoh_bytes_per_step"):
        combined[key] = max(result[key] for result in results)
    combined["end_to_end_ms_all"] = [ms for result in results for ms in result.get("end_to_end_ms_all", [])]
    combined["repeats"] = kept
    return combined


def benchmark(models: Sequence[str], dtypes: Sequence[str], exports: Sequence[str], peers: Sequence[str], steps: int,
              runs: int, warmup: int, work: Path, out: Path, optimum_pythonpath: Optional[str], timeout: int,
              repeats: int = 1) -> Dict:
    """Every peer of every (model, dtype, export), each in a process of its own, ``repeats`` times: repeat ``r``
    runs the peers in the given order rotated by ``r``, so that no peer always follows the same one (host-bound
    loops move by ±20 % between processes on the same machine), and the table shows the median over the
    processes (:func:`combine_repeats`)."""
    from tqdm.auto import tqdm

    if repeats < 1:
        raise ValueError(f"repeats: expected at least 1, got {repeats}")
    out.mkdir(parents=True, exist_ok=True)
    results: Dict[str, Any] = {"environment": environment(), "steps": steps, "runs": runs, "warmup": warmup,
                               "repeats": repeats, "rows": []}
    configs = [(m, d, e) for m in models for d in dtypes for e in exports]
    progress = tqdm(total=len(configs) * (len(peers) * repeats + 2), desc="bench", unit="task")
    for kind, dtype, export in configs:
        progress.set_postfix_str(f"{kind} {dtype} {export}: export")
        folder = ensure_export(kind, dtype, export, work)
        progress.update()
        row = {"model": kind, "dtype": dtype, "export": export, "size": MODEL_SIZES[kind], "peers": {}}
        floor_args = ["--run-floor", "--folder", str(folder), "--model", kind]
        progress.set_postfix_str(f"{kind} {dtype} {export}: floor")
        row["floor"] = _subprocess(floor_args, None, timeout)
        progress.update()
        by_peer: Dict[str, List[Dict[str, Any]]] = {}
        for repeat in range(repeats):
            for peer in list(peers[repeat % len(peers):]) + list(peers[:repeat % len(peers)]):
                if peer == "torch" and (dtype != "fp16" or export != "plain"):
                    progress.update()
                    continue  # the torch peer is fp16 eager, once per model
                progress.set_postfix_str(f"{kind} {dtype} {export}: {peer}"
                                         + (f" ({repeat + 1}/{repeats})" if repeats > 1 else ""))
                image = work / f"image-{kind}-{dtype}-{export}-{peer}.npy"
                peer_args = ["--run-peer", peer, "--folder", str(folder), "--model", kind, "--dtype", dtype,
                             "--steps", str(steps), "--runs", str(runs), "--warmup", str(warmup), "--image",
                             str(image)]
                by_peer.setdefault(peer, []).append(
                    _subprocess(peer_args, optimum_pythonpath if peer in OPTIMUM_PEERS else None, timeout))
                progress.update()
        row["peers"] = {peer: combine_repeats(by_peer[peer]) for peer in peers if peer in by_peer}
        reference = row["peers"].get("numpy", {}).get("image") or row["peers"].get("optimum", {}).get("image")
        row["reference"] = "numpy" if row["peers"].get("numpy", {}).get("image") else "optimum"
        for result in row["peers"].values():
            if reference and result.get("image") and "error" not in result:
                difference = np.abs(np.load(result["image"]) - np.load(reference)).max()
                result["max_abs_diff_vs_numpy"] = float(difference)
        results["rows"].append(row)
        (out / "results.json").write_text(json.dumps(results, indent=2))
    progress.close()
    write_report(results, out)
    return results


def mixed_benchmark(models: Sequence[str], dtypes: Sequence[str], exports: Sequence[str], peers: Sequence[str],
                    batches: Sequence[int], steps: int, rounds: int, first_steps: int, work: Path, out: Path,
                    timeout: int, cycles: int = 1) -> Dict:
    """``--scenario mixed``: every peer in a fresh process on the same export, results in mixed.json/md/png."""
    if cycles < 1:
        raise ValueError(f"cycles: expected at least 1, got {cycles}")
    out.mkdir(parents=True, exist_ok=True)
    results: Dict[str, Any] = {"environment": environment(), "scenario": "mixed", "batches": list(batches),
                               "steps": steps, "rounds": rounds, "cycles": cycles, "first_steps": first_steps,
                               "rows": []}
    for kind, dtype, export in [(m, d, e) for m in models for d in dtypes for e in exports]:
        folder = ensure_export(kind, dtype, export, work)
        row = {"model": kind, "dtype": dtype, "export": export, "size": MODEL_SIZES[kind], "peers": {}}
        for peer in peers:
            print(f"mixed: {kind} {dtype} {export}: {peer}", file=sys.stderr, flush=True)
            row["peers"][peer] = _subprocess(
                ["--run-mixed", peer, "--folder", str(folder), "--model", kind, "--dtype", dtype,
                 "--mixed-batches", ",".join(map(str, batches)), "--mixed-steps", str(steps), "--rounds",
                 str(rounds), "--cycles", str(cycles), "--steps", str(first_steps)], None, timeout)
        results["rows"].append(row)
        (out / "mixed.json").write_text(json.dumps(results, indent=2))
    write_mixed_report(results, out)
    return results


def write_mixed_report(results: Dict[str, Any], out: Path) -> None:
    """mixed.json → mixed.md (tables) and mixed.png (per-call ms per round)."""
    env = results["environment"]
    batches = [str(b) for b in results["batches"]]
    cycles = results.get("cycles", 1)
    timed_apart = any("import_s" in peer for row in results["rows"] for peer in row["peers"].values())
    imports = " (imports apart)" if timed_apart else " (imports included)"
    lines = [
        f"# Mixed batch sizes: {env.get('device')}",
        "",
        f"`{env.get('command')}` — {env.get('date')}; torch {env.get('torch')}, onnxruntime {env.get('onnxruntime')}, "
        f"diffusers {env.get('diffusers')}. Batch sizes {' → '.join(batches)} in turn, {results['steps']} DDIM steps "
        f"each, CFG, {results['rounds']} rounds"
        + (f" of {cycles} passes over them (a round's ms: the median of its {cycles} calls per batch size)"
           if cycles > 1 else ", one call per batch size each")
        + f", one process per peer. Cold start: load{imports}, then a first batch-1 image of "
        f"{results['first_steps']} steps. Memory: device-wide peak above the process's idle.",
        "",
        "| model | pipeline | " + " | ".join(f"round {r + 1} ms (b{'/b'.join(batches)})" for r in range(results["rounds"]))
        + " | worst later round / best | peak MiB | × numpy MiB | sessions created after round 1 | load s | warm-up s "
        "| first image s |",
        "|---|---|" + "---|" * results["rounds"] + "---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        numpy_mib = row["peers"].get("numpy", {}).get("peak_memory_mib")
        for peer, result in row["peers"].items():
            label = f"| {row['model']} {row['dtype']} {row['export']} {row['size']}² | {peer} |"
            if "error" in result:
                lines.append(f"{label} failed: {result['error'].strip().splitlines()[-1][:120]} |")
                continue
            summary = mixed_summary(result)
            rounds = " | ".join(" / ".join(f"{r[b]:.0f}" for b in batches) for r in result["per_round_ms"])
            worst = max(summary["worst_later_round_ratio"].values())
            ratio = f"{result['peak_memory_mib'] / numpy_mib:.2f}" if numpy_mib else ""
            created = summary["sessions_created_after_round_1"]
            warm = f"{result['warmup_s']:.1f}" if result.get("warmup_s") is not None else ""
            lines.append(f"{label} {rounds} | {worst:.3f} | {result['peak_memory_mib']:.0f} | {ratio} | "
                         f"{'' if created is None else created} | {result['load_s']:.1f} | {warm} | "
                         f"{result['first_image_s']:.2f} |")
    (out / "mixed.md").write_text("\n".join(lines) + "\n")
    plt = _pyplot()
    if plt is None:
        return
    for row in results["rows"]:
        figure, axis = plt.subplots(figsize=(10, 4))
        for peer, result in row["peers"].items():
            if "error" in result:
                continue
            series = [r[b] for r in result["per_round_ms"] for b in batches]
            axis.plot(range(len(series)), series, marker="o", label=peer)
        axis.set_xticks(range(len(batches) * results["rounds"]),
                        [f"r{r + 1} b{b}" for r in range(results["rounds"]) for b in batches], fontsize=7)
        axis.set_ylabel("ms per call")
        axis.set_yscale("log")
        axis.set_title(f"mixed batch sizes — {row['model']} {row['dtype']} {row['export']} — {env.get('device')}")
        axis.legend()
        figure.tight_layout()
        figure.savefig(out / f"mixed-{row['model']}-{row['dtype']}-{row['export']}.png", dpi=120)


# ----------------------------------------------------------------------------------------------------- report
def _pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend, or ``None`` where matplotlib is not installed (tables only)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_report(results: Dict[str, Any], out: Path) -> None:
    """results.json → results.md (table) and results.png (chart)."""
    env = results["environment"]
    lines = [
        f"# Benchmark: {env.get('device')}",
        "",
        f"`{env.get('command')}` — {env.get('date')}; torch {env.get('torch')} (CUDA {env.get('cuda')}), onnxruntime "
        f"{env.get('onnxruntime')}, diffusers {env.get('diffusers')}, transformers {env.get('transformers')}; "
        f"{results['steps']} DDIM steps, CFG (batch 2), median of {results['runs']} runs after {results['warmup']} "
        + (f"warm-up in each of {results['repeats']} processes per peer (peer order rotated each time), then the "
           "median over the processes" if results.get("repeats", 1) > 1 else "warm-up")
        + "; SDXL guidance 5; LCM 4 steps (LCM scheduler, guidance embedded, batch 1); Turbo 4 Euler-ancestral "
        "trailing steps, guidance 0. Where diffusers has no numpy pipeline (SDXL, LCM), × and diff are against "
        "optimum-onnx.",
        "",
        "| model | dtype | export | pipeline | end-to-end ms | per-step ms | × numpy | step / GPU floor "
        "| step / own graph | GPU step / own graph | peak GPU MiB | H↔D bytes/step | max diff vs numpy | load s "
        "| first image s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        floor = row.get("floor", {}).get("per_step_ms")
        numpy_ms = row["peers"].get(row.get("reference", "numpy"), {}).get("end_to_end_ms")
        for peer, result in row["peers"].items():
            label = f"| {row['model']} {row['size']}² | {row['dtype']} | {row['export']} | {peer} |"
            if "skipped" in result:
                lines.append(f"{label} — ({result['skipped']}) |" + " |" * 10)
                continue
            if "error" in result:
                lines.append(f"{label} failed: {result['error'].strip().splitlines()[-1][:120]} |" + " |" * 10)
                continue
            speedup = f"{numpy_ms / result['end_to_end_ms']:.2f}" if numpy_ms else ""
            vs_floor = f"{result['per_step_ms'] / floor:.3f}" if floor else ""
            own = result.get("per_step_over_own_floor")
            vs_own = "" if own is None else f"{own:.3f} ({result['own_floor_ms']:.2f})"
            gpu_own = result.get("gpu_step_over_own_floor")
            gpu_vs_own = "" if gpu_own is None else f"{gpu_own:.3f} ({result['gpu_step_ms']:.3f})"
            copies = result["htod_bytes_per_step"] + result["dtoh_bytes_per_step"]
            diff = result.get("max_abs_diff_vs_numpy")
            cold = " | ".join(f"{result[key]:.2f}" if result.get(key) is not None else "" for key in
                              ("load_s", "first_image_s"))
            lines.append(
                f"{label} {result['end_to_end_ms']:.1f} | {result['per_step_ms']:.2f} | {speedup} | {vs_floor} | "
                f"{vs_own} | {gpu_vs_own} | {result['peak_memory_mib']:.0f} | {copies:,.0f} | "
                f"{'' if diff is None else f'{diff:.2e}'} | {cold} |"
            )
        if floor:
            lines.append(f"| {row['model']} {row['size']}² | {row['dtype']} | {row['export']} | GPU floor (UNet graph "
                         f"replays, a process of its own) | | {floor:.2f} | | 1.000 |" + " |" * 7)
    (out / "results.md").write_text("\n".join(lines) + "\n")
    plt = _pyplot()
    if plt is None:
        return
    labels, values, colors = [], [], []
    palette = {"numpy": "#999999", "optimum": "#e69f00", "accelerated": "#d55e00", "defaults": "#0072b2", "binding": "#56b4e9", "graph": "#009e73", "torch": "#cc79a7"}
    for row in results["rows"]:
        for peer, result in row["peers"].items():
            if "error" not in result and "skipped" not in result:
                labels.append(f"{row['model']} {row['dtype']} {row['export']}\n{peer}")
                values.append(result["end_to_end_ms"])
                colors.append(palette.get(peer, "#333333"))
    figure, axis = plt.subplots(figsize=(10, 0.35 * len(labels) + 1.5))
    axis.barh(range(len(labels)), values, color=colors)
    axis.set_yticks(range(len(labels)), labels, fontsize=7)
    axis.invert_yaxis()
    axis.set_xlabel(f"end-to-end ms ({results['steps']} steps, CFG), lower is better")
    axis.set_title(f"optimum-iobinding benchmark — {env.get('device')}")
    figure.tight_layout()
    figure.savefig(out / "results.png", dpi=120)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="optimum-iobinding bench", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,small,sd15")
    parser.add_argument("--dtypes", default="fp16,fp32")
    parser.add_argument("--exports", default="plain,optimized")
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1,
                        help="single: processes per peer, the peer order rotated each time; the table shows the "
                             "median over them")
    parser.add_argument("--work", default="bench-work", help="where exports and images go")
    parser.add_argument("--out", default="benchmarks/results/latest")
    parser.add_argument("--optimum-pythonpath", default=None, help="site folder of the optimum-onnx environment")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per peer process")
    parser.add_argument("--report-only", action="store_true", help="re-render results.md/png from results.json")
    parser.add_argument("--scenario", choices=("single", "mixed"), default="single",
                        help="single: one batch size, every peer (default); mixed: batch sizes in turn, rounds")
    parser.add_argument("--mixed-batches", default="1,4,8,2", help="mixed: images per call, in turn")
    parser.add_argument("--mixed-steps", type=int, default=10, help="mixed: steps per call")
    parser.add_argument("--rounds", type=int, default=3, help="mixed: rounds over the batch sizes")
    parser.add_argument("--cycles", type=int, default=3,
                        help="mixed: passes over the batch sizes per round; a round's time per batch size is the "
                             "median of its calls")
    parser.add_argument("--export-only", action="store_true",
                        help="only make the exports under --work (e.g. in the background, ahead of the benches)")
    # one peer in this process (used by the orchestrator)
    parser.add_argument("--run-peer", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--run-floor", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run-mixed", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--image", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    split = lambda text: [item for item in text.split(",") if item]  # noqa: E731
    if args.repeats < 1:
        parser.error(f"--repeats: expected at least 1, got {args.repeats}")
    if args.cycles < 1:
        parser.error(f"--cycles: expected at least 1, got {args.cycles}")
    if args.run_mixed:
        result = run_mixed(args.run_mixed, Path(args.folder), args.model, args.dtype,
                           [int(b) for b in split(args.mixed_batches)], args.mixed_steps, args.rounds, args.steps,
                           args.cycles)
        Path(args.result).write_text(json.dumps(result))
        return 0
    if args.run_peer or args.run_floor:
        if args.run_floor:
            result = run_floor(Path(args.folder), args.model)
        else:
            result = run_peer(args.run_peer, Path(args.folder), args.model, args.dtype, args.steps, args.runs,
                              args.warmup, Path(args.image))
        Path(args.result).write_text(json.dumps(result))
        return 0
    out = Path(args.out)
    if args.report_only:
        if (out / "mixed.json").is_file():
            write_mixed_report(json.loads((out / "mixed.json").read_text()), out)
        if (out / "results.json").is_file():
            write_report(json.loads((out / "results.json").read_text()), out)
        return 0
    if args.export_only:
        for kind in split(args.models):
            for dtype in split(args.dtypes):
                for export in split(args.exports):
                    print(ensure_export(kind, dtype, export, Path(args.work)), flush=True)
        return 0
    if not torch.cuda.is_available():
        print("optimum-iobinding bench: error: no CUDA GPU is visible to torch here; the benchmark measures CUDA "
              "pipelines (--export-only and --report-only work without one)", file=sys.stderr)
        return 1
    if args.scenario == "mixed":
        peers = [peer for peer in split(args.peers) if peer in MIXED_PEERS] if args.peers != parser.get_default(
            "peers") else list(MIXED_PEERS)
        mixed_benchmark(split(args.models), split(args.dtypes), split(args.exports), peers,
                        [int(b) for b in split(args.mixed_batches)], args.mixed_steps, args.rounds, args.steps,
                        Path(args.work), out, args.timeout, args.cycles)
        print((out / "mixed.md").read_text())
        return 0
    results = benchmark(split(args.models), split(args.dtypes), split(args.exports), split(args.peers), args.steps,
                        args.runs, args.warmup, Path(args.work), out, args.optimum_pythonpath, args.timeout,
                        args.repeats)
    print((out / "results.md").read_text())
    measured = [result for row in results["rows"] for result in row["peers"].values()
                if "error" not in result and "skipped" not in result]
    if not measured:
        print("optimum-iobinding bench: error: every peer failed or was skipped; see results.md for why",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
