"""The transformer scenario's peers (``--scenario transformer``): SD3.5 Medium's and FLUX.1's architectures
(:data:`.zoo.TRANSFORMER_RECIPES`), each peer measured in a process of its own on the same ONNX folder.

  ours     our Stable Diffusion 3 / FLUX.1 pipeline, from_pretrained(folder) with its defaults (CUDA graphs)
  cached   "ours" with ``pipe.enable_cache(cache_config_of(SPEC))``, First-Block Cache as ``--cache fbc:THRESHOLD``
           names it (a row of its own where ``--cache`` is given; the export carries the cache's parts)
  optimum  optimum-onnx's ORTStableDiffusion3Pipeline / ORTFluxPipeline(use_io_binding=True) on the same folder
  torch    diffusers' StableDiffusion3Pipeline / FluxPipeline, bf16 eager, the same architecture and seed
  compile  the same with ``torch.compile(pipe.transformer)`` (its first image, compilation included, timed apart)
  floor    back-to-back replays of our transformer's CUDA graph at the loop's batch (CFG: 2), as captured by our loop

Every pipeline gets the same initial latents, prompt, step count, guidance and T5 length (the model's recipe).
"""

from __future__ import annotations

import contextlib
import importlib
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Tuple

import numpy as np

if TYPE_CHECKING:  # annotations only: torch is imported where it is used, not for --help
    import torch

from ..errors import ArgumentError
from ..families import family
from .peers import PeerUnavailable, enable_spec_cache, step_cache_fields, wall_ms
from .probes import PeakMemory, graph_floor_ms
from .zoo import PROMPT, TRANSFORMER_RECIPES, build_transformer_pipeline

TRANSFORMER_PEERS = ("ours", "optimum", "torch", "compile", "floor")
# the peer that caches steps (``--cache``), and the uncached peer of the same files its speed-up is over
CACHED_TRANSFORMER_PEER, UNCACHED_TRANSFORMER_PEER = "cached", "ours"
# this project's pipelines among the peers
OUR_TRANSFORMER_PEERS = ("ours", "cached")
# peers that run in the optimum-onnx environment (--optimum-pythonpath)
OPTIMUM_TRANSFORMER_PEERS = ("optimum",)
# peers that need CUDA whatever the device: compiled kernels and captured graphs are what they measure
CUDA_ONLY_TRANSFORMER_PEERS = ("compile", "floor")
# the families of the scenario (keys of optimum_iobinding.families, as the recipes name them)
TRANSFORMER_FAMILIES = ("sd3", "flux")
# what each peer loads with, per family, as (module, name)
TRANSFORMER_LOADED_WITH = {
    **{("ours", key): (family(key).module, family(key).class_name) for key in TRANSFORMER_FAMILIES},
    ("optimum", "sd3"): ("optimum.onnxruntime", "ORTStableDiffusion3Pipeline"),
    ("optimum", "flux"): ("optimum.onnxruntime", "ORTFluxPipeline"),
    **{
        (peer, key): ("diffusers", family(key).torch_classes[0])
        for peer in ("torch", "compile")
        for key in TRANSFORMER_FAMILIES
    },
}


def pipeline_class(peer: str, kind: str) -> Any:
    """The pipeline class ``peer`` loads ``kind`` with; :class:`.peers.PeerUnavailable` where it cannot be imported
    here (optimum-onnx lives in an environment of its own: ``--optimum-pythonpath``)."""
    module, name = TRANSFORMER_LOADED_WITH[(peer, TRANSFORMER_RECIPES[kind]["family"])]
    try:
        return getattr(importlib.import_module(module, __package__), name)
    except (ImportError, AttributeError) as error:
        raise PeerUnavailable(
            f"{name} cannot be imported in this environment ({type(error).__name__}: {error}); "
            "pass the optimum-onnx environment's site folder with --optimum-pythonpath"
        ) from error


def initial_latents(kind: str, seed: int = 0) -> np.ndarray:
    """The initial noise every peer starts from, float32: SD3's ``(1, 16, H/8, W/8)``; FLUX.1's the same noise packed
    into 2×2 patches, ``(1, H/16 · W/16, 64)``, the layout its pipelines take latents in."""
    size = TRANSFORMER_RECIPES[kind]["size"]
    noise = np.random.RandomState(seed).randn(1, 16, size // 8, size // 8).astype(np.float32)
    if TRANSFORMER_RECIPES[kind]["family"] == "sd3":
        return noise
    half = size // 16
    patches = noise.reshape(1, 16, half, 2, half, 2).transpose(0, 2, 4, 1, 3, 5)
    return np.ascontiguousarray(patches.reshape(1, half * half, 64))


def onnx_input_dtype(folder: Path, component: str, name: str) -> torch.dtype:
    """The element type of input ``name`` of ``folder/component/model.onnx``, read without its weights."""
    import torch
    import onnx
    from onnx.helper import tensor_dtype_to_np_dtype

    model = onnx.load(str(folder / component / "model.onnx"), load_external_data=False)
    for value in model.graph.input:
        if value.name == name:
            element = value.type.tensor_type.elem_type
            if element == onnx.TensorProto.BFLOAT16:  # numpy's bfloat16 (ml_dtypes') is not one torch converts
                return torch.bfloat16
            return torch.from_numpy(np.zeros(0, tensor_dtype_to_np_dtype(element))).dtype
    raise ValueError(
        f"{folder / component / 'model.onnx'}: expected an input named {name!r}, got "
        f"{[value.name for value in model.graph.input]}"
    )


@contextlib.contextmanager
def weights_made_on(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Modules built inside are made on ``device`` in ``dtype`` directly: the full models' random weights are drawn
    there, not in float32 on the host (FLUX.1's transformer alone is 48 GB in float32)."""
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def load_transformer_peer(
    peer: str,
    folder: Path,
    kind: str,
    blocks: Optional[int],
    text_layers: Optional[int],
    device: str,
    cache: Optional[str] = None,
) -> Tuple[Any, Any, Dict[str, Any]]:
    """The pipeline of one peer on ``device`` ("cuda" or "cpu"), the initial latents in the form it takes them, and
    what the result should say about its weights; the ``cached`` peer is ours with the step cache ``cache`` (a
    ``--cache`` spec) enabled, the others never cache."""
    import torch

    if peer in CUDA_ONLY_TRANSFORMER_PEERS and device != "cuda":
        raise PeerUnavailable(f"{peer} measures CUDA work: it needs --device cuda")
    latents = torch.from_numpy(initial_latents(kind))
    provider = "CUDAExecutionProvider" if device == "cuda" else "CPUExecutionProvider"
    if peer in OUR_TRANSFORMER_PEERS:
        pipe = pipeline_class("ours", kind).from_pretrained(folder, provider=provider)
        if peer == CACHED_TRANSFORMER_PEER:
            enable_spec_cache(pipe, cache)
        return pipe, latents.to(device, pipe.transformer.input_dtypes["hidden_states"]), {"weights": "the export's"}
    if peer == "optimum":
        pipe = pipeline_class(peer, kind).from_pretrained(folder, provider=provider, use_io_binding=device == "cuda")
        dtype = onnx_input_dtype(folder, "transformer", "hidden_states")
        return pipe, latents.to(device, dtype), {"weights": "the export's"}
    if peer in ("torch", "compile"):
        pipeline_class(peer, kind)
        if device == "cuda":
            with weights_made_on(torch.device(device), torch.bfloat16):
                pipe = build_transformer_pipeline(kind, blocks, text_layers)
            weights = "the export's seed, drawn on the device in bf16 (not the export's values)"
        else:  # the host: the export's own float32 weights (the same seed on the same device)
            pipe = build_transformer_pipeline(kind, blocks, text_layers)
            weights = "the export's"
        # the scheduler's constants in float32 on the host, as from_pretrained gives them
        pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
        pipe = pipe.to(device, torch.bfloat16 if device == "cuda" else torch.float32)
        if peer == "compile":
            pipe.transformer = torch.compile(pipe.transformer)
        return pipe, latents.to(device, pipe.transformer.dtype), {"weights": weights}
    raise ArgumentError(
        "peer", f"expected one of {', '.join((*TRANSFORMER_PEERS[:-1], CACHED_TRANSFORMER_PEER))}, got {peer!r}"
    )


def step_ms(full: List[float], short: List[float], between: int, step_ends: List[List[float]]) -> float:
    """A step's ms: where the step ends of timed calls were marked (the CPU, where a step ends when its work is done)
    the median over those calls of the time from the first step's end to the last's, per step between; else (CUDA,
    where the host runs ahead of the device) the difference of the medians of the calls at the recipe's steps
    (``full``) and at its short step count (``short``), per step ``between``. Two medians of separate calls differ
    by their noise too: on the CPU's tiny models, where a step is a few ms, the difference came out negative."""
    marked = [(ends[-1] - ends[0]) * 1000 / (len(ends) - 1) for ends in step_ends if len(ends) > 1]
    if marked:
        return statistics.median(marked)
    return (statistics.median(full) - statistics.median(short)) / between


def run_transformer_peer(
    peer: str,
    folder: Path,
    kind: str,
    blocks: Optional[int],
    text_layers: Optional[int],
    runs: int,
    warmup: int,
    device: str,
    image_path: Path,
    cache: Optional[str] = None,
) -> Dict[str, Any]:
    """One peer on one export, in this process: load (timed), the first image (timed: sessions and graph capture, or
    ``torch.compile``'s compilation), ``warmup`` calls, ``runs`` timed calls at the recipe's steps and at its short
    step count (per-step ms: on CUDA the difference of their medians over the steps between, on the CPU measured
    inside the calls at the recipe's steps, :func:`step_ms`), for ours its transformer graph
    replayed alone in this process, the device's memory peak above its idle (CUDA), and the image, saved to
    ``image_path``. The ``cached`` peer (step cache ``cache``) also reports what its cache did in the last timed call
    at the recipe's steps (:func:`.peers.step_cache_fields`)."""
    import torch

    recipe = TRANSFORMER_RECIPES[kind]
    cuda = device == "cuda"
    memory = PeakMemory(torch.device("cuda", 0)) if cuda else contextlib.nullcontext()
    idle = memory.used() if cuda else None
    with memory:
        start = time.perf_counter()
        pipe, latents, about = load_transformer_peer(peer, folder, kind, blocks, text_layers, device, cache)
        load_s = time.perf_counter() - start
        pipe.set_progress_bar_config(disable=True)

        step_ends: List[List[float]] = []  # per timed call at the recipe's steps on the CPU: when each step ended

        def call(steps: int, marked: bool = False) -> np.ndarray:
            extra: Dict[str, Any] = {}
            if marked:
                ends: List[float] = []
                step_ends.append(ends)

                def mark(pipeline: Any, step: int, timestep: Any, tensors: Dict[str, Any]) -> Dict[str, Any]:
                    ends.append(time.perf_counter())
                    return tensors

                extra["callback_on_step_end"] = mark
            with torch.inference_mode():
                images = pipe(
                    PROMPT,
                    height=recipe["size"],
                    width=recipe["size"],
                    num_inference_steps=steps,
                    guidance_scale=recipe["guidance"],
                    latents=latents.clone(),
                    max_sequence_length=recipe["max_sequence_length"],
                    output_type="np",
                    **extra,
                ).images
            if cuda:
                torch.cuda.synchronize()
            return np.asarray(images)

        def timed(steps: int) -> List[float]:
            # on the CPU each step ends when its work is done: its end marks time the loop alone
            return wall_ms(lambda: call(steps, marked=not cuda and steps == recipe["steps"]), runs)

        start = time.perf_counter()
        image = call(recipe["steps"])
        first_image_s = time.perf_counter() - start
        for _ in range(warmup):
            image = call(recipe["steps"])
        full = timed(recipe["steps"])
        cached = step_cache_fields(pipe, cache)  # the last call at the recipe's steps: the short ones follow
        short = timed(recipe["short_steps"])
    own_floor = graph_floor_ms(pipe.transformer) if peer == "ours" and cuda else None
    np.save(image_path, image.astype(np.float32))
    if peer in OUR_TRANSFORMER_PEERS:  # the provider each component ran on; which ran without a graph, ORT's reason
        about["providers"] = {name: model.providers[0] for name, model in pipe.onnx_models.items()}
        about["graph_fallbacks"] = {
            name: {str(dict(signature)): reason for signature, reason in model.graph_fallbacks.items()}
            for name, model in pipe.onnx_models.items()
            if model.graph_fallbacks
        }
    per_step = step_ms(full, short, recipe["steps"] - recipe["short_steps"], step_ends)
    return {
        "peer": peer,
        **about,
        "end_to_end_ms": statistics.median(full),
        "end_to_end_ms_all": full,
        "short_ms_all": short,
        "steps": recipe["steps"],
        "short_steps": recipe["short_steps"],
        "per_step_ms": per_step,
        "own_floor_ms": own_floor,
        "per_step_over_own_floor": per_step / own_floor if own_floor else None,
        "peak_memory_mib": (memory.peak - idle) / 2**20 if cuda else None,
        "memory_source": memory.source if cuda else None,
        "load_s": load_s,
        "first_image_s": first_image_s,
        # torch.compile compiles during the first image: that image's time less a warm one's
        "compile_s": first_image_s - statistics.median(full) / 1000 if peer == "compile" else None,
        "image": str(image_path),
        "image_stats": image_stats(image),
        **cached,
    }


def image_stats(image: np.ndarray) -> Dict[str, float]:
    """What says at a glance whether an image is an image: its range, mean, spread and share of non-finite values
    (float16 overflow shows as NaN or a flat image)."""
    image = np.asarray(image, dtype=np.float32)
    finite = image[np.isfinite(image)]
    return {
        "min": float(finite.min()) if finite.size else float("nan"),
        "max": float(finite.max()) if finite.size else float("nan"),
        "mean": float(finite.mean()) if finite.size else float("nan"),
        "std": float(finite.std()) if finite.size else float("nan"),
        "non_finite": float(1 - finite.size / max(image.size, 1)),
    }


def run_transformer_floor(folder: Path, kind: str, device: str, replays: int = 20) -> Dict[str, Any]:
    """The GPU floor of one step, in a process of its own: our pipeline makes one image at the recipe's short step
    count (its loop captures the transformer's graph at the loop's own batch and shapes: CFG's 2 for SD3), then that
    graph replays back to back (:func:`graph_floor_ms`)."""
    import torch

    if device != "cuda":
        raise PeerUnavailable("floor measures CUDA-graph replays: it needs --device cuda")
    recipe = TRANSFORMER_RECIPES[kind]
    pipe = pipeline_class("ours", kind).from_pretrained(folder, provider="CUDAExecutionProvider", cuda_graph=True)
    pipe.set_progress_bar_config(disable=True)
    latents = torch.from_numpy(initial_latents(kind)).to("cuda", pipe.transformer.input_dtypes["hidden_states"])
    with torch.inference_mode():
        pipe(
            PROMPT,
            height=recipe["size"],
            width=recipe["size"],
            num_inference_steps=recipe["short_steps"],
            guidance_scale=recipe["guidance"],
            latents=latents,
            max_sequence_length=recipe["max_sequence_length"],
            output_type="latent",
        )
    torch.cuda.synchronize()
    per_step = graph_floor_ms(pipe.transformer, replays)
    if per_step is None:
        reasons = "; ".join(sorted(set(pipe.transformer.graph_fallbacks.values())))
        return {
            "peer": "floor",
            "error": f"the transformer captured {len(pipe.transformer.graph_signatures)} CUDA "
            f"graphs, expected exactly one{' (ORT: ' + reasons + ')' if reasons else ''}",
        }
    return {
        "peer": "floor",
        "per_step_ms": per_step,
        "graph_inputs": pipe.transformer.graph_signatures[0],
        "replays": replays,
    }
