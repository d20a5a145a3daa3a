"""The benchmark's peers: what each one loads and how one peer is measured in its own process — a single batch size
(:func:`run_peer`) or a service's mixed load (:func:`run_mixed`).

  numpy       diffusers' OnnxStableDiffusionPipeline (numpy round trips every step)
  optimum     optimum-onnx's ORTStableDiffusionPipeline(use_io_binding=True)
  accelerated optimum-onnx's pipeline and loop, its parts switched to ours (``integrations.optimum.accelerate``)
  defaults    ours, from_pretrained(folder, provider="CUDAExecutionProvider") with nothing else: what a new user gets
  warmed      "defaults" with ``pipe.warmup(...)`` for the mixed scenario's batch sizes after loading
  binding     ours, io_binding=True, cuda_graph=False
  graph       ours, cuda_graph=True
  torch       diffusers' StableDiffusionPipeline, fp16 eager

Every pipeline gets the same initial latents, prompt, scheduler and step count (the model's recipe,
:mod:`.zoo`); stochastic steps draw from the same seeded device generator (but numpy's, which takes numpy
generators only).
"""

from __future__ import annotations

import importlib
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import torch

from .probes import PeakMemory, copied_bytes, own_graph_floor
from .zoo import MODEL_SIZES, PROMPT, build_torch_pipeline, recipe_of, set_recipe_scheduler

PEERS = ("numpy", "optimum", "accelerated", "defaults", "binding", "graph", "torch")
OUR_PEERS = ("defaults", "warmed", "binding", "graph")
MIXED_PEERS = ("numpy", "defaults", "warmed", "binding", "graph")
# peers that run in the optimum-onnx environment (--optimum-pythonpath)
OPTIMUM_PEERS = ("optimum", "accelerated")
# what a peer loads with, as (module, name): what import_peer imports
LOADED_WITH = {
    "numpy": ("diffusers", "OnnxStableDiffusionPipeline"),
    "torch": ("diffusers", "StableDiffusionPipeline"),
    **{peer: ("optimum.onnxruntime", "ORTStableDiffusionPipeline") for peer in OPTIMUM_PEERS},
    **{peer: ("..pipelines", "OnnxStableDiffusionPipeline") for peer in OUR_PEERS},
}


class PeerUnavailable(RuntimeError):
    """A peer that has no pipeline for a model (diffusers' numpy pipelines exist for SD 1.x/2.x only)."""


def import_peer(peer: str) -> float:
    """Imports what ``peer`` loads with, and returns the seconds it took: the cold-start columns time loading and the
    first image, not Python's imports (which take long, and vary from one process to the next)."""
    start = time.perf_counter()
    module, name = LOADED_WITH.get(peer, (None, None))
    if module is not None:
        getattr(importlib.import_module(module, __package__), name)  # the attribute: diffusers imports lazily
    return time.perf_counter() - start


def load_peer(peer: str, folder: Path, kind: str, dtype: str):
    """The pipeline of one peer, with the model's recipe scheduler, and how to pass it the initial latents."""
    torch_dtype = torch.float16 if dtype == "fp16" else torch.float32
    on_device = lambda lat: torch.from_numpy(lat).to("cuda", torch_dtype)  # noqa: E731
    if peer == "numpy":
        if kind in ("sdxl", "lcm"):
            raise PeerUnavailable(f"diffusers has no ONNX (numpy) pipeline for {kind}")
        from ..pipelines import load_numpy_pipeline

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
    """One peer on one export, in this process: the imports (timed apart), the load and the first image (the cold
    start), ``warmup`` calls, then ``runs`` timed calls at ``steps`` and at the recipe's short step count (per-step
    ms: the difference of their medians over the steps between), for ours the GPU's time per step inside whole calls
    (CUDA events at the first and the last step) and their UNet graph replayed alone (:func:`.probes.own_graph_floor`),
    the device's memory peak above its idle (:class:`.probes.PeakMemory`), host↔device bytes per step (profiled at
    two step counts), and the image, saved to ``image_path``."""
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
