"""The benchmark's peers: what each one loads and how one peer is measured in its own process — a single batch size
(:func:`run_peer`), a service's mixed load (:func:`run_mixed`) or a stream of frames (:func:`run_stream_peer`, its
peers listed above :data:`STREAM_PEERS`).

  numpy       diffusers' numpy ONNX pipeline (numpy round trips every step)
  optimum     optimum-onnx's ORTStableDiffusionPipeline(use_io_binding=True)
  accelerated optimum-onnx's pipeline and loop, its parts switched to ours (``integrations.optimum.accelerate``)
  defaults    ours, from_pretrained(folder, provider="CUDAExecutionProvider") with nothing else: what a new user gets
  cached      "defaults" with ``pipe.enable_cache(cache_config_of(SPEC))``, the step cache ``--cache SPEC`` names (a row
              of its own where ``--cache`` is given, on the same files as "defaults")
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
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

if TYPE_CHECKING:  # annotations only: torch is imported where it is used, not for --help
    import torch

from ..errors import ArgumentError
from ..families import family, pipeline_class
from ..layout import controlnet_component_names
from .probes import PeakMemory, copied_bytes, own_graph_floor, replay_ms
from .zoo import (
    MODEL_SIZES,
    PROMPT,
    build_torch_pipeline,
    family_of_model,
    random_ip_adapter_state_dict,
    recipe_of,
    set_recipe_scheduler,
)

PEERS = ("numpy", "optimum", "accelerated", "defaults", "binding", "graph", "torch")
OUR_PEERS = ("defaults", "warmed", "binding", "graph", "cached")
# the peer that caches steps (``--cache``), and the uncached peer it is "defaults" of: its speed-up is over that one
CACHED_PEER, UNCACHED_PEER = "cached", "defaults"
MIXED_PEERS = ("numpy", "defaults", "warmed", "binding", "graph")
# peers that run in the optimum-onnx environment (--optimum-pythonpath)
OPTIMUM_PEERS = ("optimum", "accelerated")
# what a peer loads with, as (module, name): what import_peer imports (Stable Diffusion's: the imports are the same for
# every family)
LOADED_WITH = {
    "numpy": ("diffusers", family("sd").numpy_class),
    "torch": ("diffusers", family("sd").torch_classes[0]),
    **{peer: ("optimum.onnxruntime", "ORTStableDiffusionPipeline") for peer in OPTIMUM_PEERS},
    **{peer: (family("sd").module, family("sd").class_name) for peer in OUR_PEERS},
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


def load_peer(peer: str, folder: Path, kind: str, dtype: str, cache: Optional[str] = None):
    """The pipeline of one peer, with the model's recipe scheduler, and how to pass it the initial latents; the
    ``cached`` peer with the step cache ``cache`` (a ``--cache`` spec) enabled, the others never caching."""
    import torch

    torch_dtype = torch.float16 if dtype == "fp16" else torch.float32
    on_device = lambda lat: torch.from_numpy(lat).to("cuda", torch_dtype)  # noqa: E731
    if peer == "numpy":
        if family_of_model(kind).numpy_class is None:
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
            kind, ORTStableDiffusionPipeline
        )
        pipe = optimum_class.from_pretrained(folder, provider="CUDAExecutionProvider", use_io_binding=True)
        if peer == "accelerated":  # optimum's pipeline and loop, its parts switched to our fast path
            from ..integrations.optimum import accelerate

            accelerate(pipe, cuda_graph=True)
        latents_of = on_device
    elif peer in OUR_PEERS:
        our_class = pipeline_class(family_of_model(kind))
        graph_argument = {"binding": {"cuda_graph": False}, "graph": {"cuda_graph": True}}.get(peer, {})
        pipe = our_class.from_pretrained(folder, provider="CUDAExecutionProvider", **graph_argument)
        if peer == CACHED_PEER:
            enable_spec_cache(pipe, cache)
        latents_of = on_device
    elif peer == "torch":
        pipe = build_torch_pipeline(kind).to("cuda", torch_dtype)
        latents_of = on_device
    else:
        raise ArgumentError("peer", f"expected one of {PEERS}, got {peer!r}")
    set_recipe_scheduler(pipe, kind)
    pipe.set_progress_bar_config(disable=True)
    return pipe, latents_of


def run_peer(
    peer: str,
    folder: Path,
    kind: str,
    dtype: str,
    steps: int,
    runs: int,
    warmup: int,
    image_path: Path,
    cache: Optional[str] = None,
) -> Dict[str, Any]:
    """One peer on one export, in this process: the imports (timed apart), the load and the first image (the cold
    start), ``warmup`` calls, then ``runs`` timed calls at ``steps`` and at the recipe's short step count (per-step
    ms: the difference of their medians over the steps between), for ours the GPU's time per step inside whole calls
    (CUDA events at the first and the last step) and their UNet graph replayed alone (:func:`.probes.own_graph_floor`;
    not for a cached loop, which runs the cache's parts), the device's memory peak above its idle
    (:class:`.probes.PeakMemory`), host↔device bytes per step (profiled at two step counts), and the image, saved to
    ``image_path``. The ``cached`` peer (step cache ``cache``) also reports what its cache did in the last timed call
    at ``steps`` (:func:`step_cache_fields`)."""
    import torch

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
            pipe, latents_of = load_peer(peer, folder, kind, dtype, cache)
        except PeerUnavailable as reason:
            return {"peer": peer, "skipped": str(reason)}
        load_s = time.perf_counter() - start

        def call(num_steps: int, **extra: Any):
            # stochastic steps (LCM, Euler ancestral) draw from a seeded device generator, the same for every peer
            # but the numpy one (diffusers' ONNX pipeline takes numpy generators only)
            noise = {} if peer == "numpy" else {"generator": torch.Generator("cuda").manual_seed(0)}
            with torch.inference_mode():
                images = pipe(
                    PROMPT,
                    height=size,
                    width=size,
                    num_inference_steps=num_steps,
                    guidance_scale=recipe["guidance"],
                    latents=latents_of(latents),
                    output_type="np",
                    **noise,
                    **extra,
                ).images
            torch.cuda.synchronize()
            return np.asarray(images)

        def timed(num_steps: int) -> List[float]:
            return wall_ms(lambda: call(num_steps), runs)

        start = time.perf_counter()
        image = call(steps)  # the cold start's first image: sessions, algorithm search, graph capture
        first_image_s = time.perf_counter() - start
        for _ in range(warmup):
            image = call(steps)
        full = timed(steps)
        cached = step_cache_fields(pipe, cache)  # the last call at ``steps``: the short ones follow
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
    own_floor = own_graph_floor(pipe) if peer in OUR_PEERS and peer != CACHED_PEER else None
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
        **cached,
    }


def enable_spec_cache(pipe: Any, spec: Optional[str]) -> None:
    """Enables on ``pipe`` (ours) the step cache the ``--cache`` text ``spec`` names
    (:func:`~optimum_iobinding.pipelines.cache_configs.cache_config_of`).

    Raises:
        ArgumentError: ``spec`` is missing or names no cache (naming ``--cache``), or the pipeline cannot take it."""
    from ..pipelines.cache_configs import cache_config_of

    if spec is None:
        raise ArgumentError("--cache", f"expected a step cache for the {CACHED_PEER} peer, got None")
    pipe.enable_cache(cache_config_of(spec, "--cache"))


def cache_record(pipe: Any) -> Dict[str, Any]:
    """What the pipeline's step cache did in its last call: which steps ran the whole model (``computed``) and how many
    reused the cache (``skipped_steps``); nothing where ``pipe`` caches no step."""
    cache = getattr(pipe, "step_cache", None)
    if cache is None:
        return {}
    return {"computed": list(cache.computed), "skipped_steps": cache.skipped_steps}


def step_cache_fields(pipe: Any, spec: Optional[str]) -> Dict[str, Any]:
    """What a cached row reports beyond the others' columns: the ``--cache`` spec and :func:`cache_record`; nothing
    where no cache was asked for or ``pipe`` caches no step."""
    record = cache_record(pipe)
    return {"cache": spec, **record} if spec is not None and record else {}


def run_mixed(
    peer: str,
    folder: Path,
    kind: str,
    dtype: str,
    batches: Sequence[int],
    steps: int,
    rounds: int,
    first_steps: int,
    cycles: int = 1,
) -> Dict[str, Any]:
    """A service's load on one peer: load (timed, imports apart), a first image of ``first_steps`` steps at batch 1
    (timed: the cold start), then ``rounds`` rounds, each going ``cycles`` times through ``batches`` in turn (a call
    with that many images, ``steps`` steps per call). A round's time per batch size is the median of its ``cycles``
    calls (every call is kept in ``per_round_calls_ms``)."""
    import torch

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
                pipe(
                    [PROMPT] * batch,
                    height=size,
                    width=size,
                    num_inference_steps=num_steps,
                    guidance_scale=guidance,
                    output_type="np",
                    **noise,
                )
            torch.cuda.synchronize()
            return (time.perf_counter() - start) * 1000

        first_image_s = call(1, first_steps) / 1000
        created = lambda: getattr(pipe, "sessions_created", None)  # noqa: E731 — ours only
        per_round_calls, sessions_after_round = mixed_rounds(
            lambda batch: call(batch, steps), batches, rounds, cycles, created
        )
    return {
        "peer": peer,
        "scenario": "mixed",
        "batches": list(batches),
        "steps": steps,
        "rounds": rounds,
        "cycles": cycles,
        "import_s": import_s,
        "load_s": load_s,
        "warmup_s": warmup_s,
        "first_image_s": first_image_s,
        "first_steps": first_steps,
        "per_round_ms": [
            {batch: statistics.median(times) for batch, times in calls.items()} for calls in per_round_calls
        ],
        "per_round_calls_ms": per_round_calls,
        "sessions_after_round": sessions_after_round,
        "peak_memory_mib": (memory.peak - idle) / 2**20,
        "memory_source": memory.source,
    }


def mixed_rounds(
    call: Callable[[int], float], batches: Sequence[int], rounds: int, cycles: int, created: Callable[[], Optional[int]]
):
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


# ------------------------------------------------------------------------------------------- the stream scenario
# ``--scenario stream``: few-step image to image on a stream of 512² frames, batch 1, the turbo architecture.
#   ours    the stream pipeline, torch CUDA frames in and out
#   numpy   diffusers' numpy ONNX image-to-image pipeline (numpy round trips; the folder's full VAE only)
#   torch   diffusers' StableDiffusionImg2ImgPipeline, fp16, the row's VAE (AutoencoderKL or AutoencoderTiny), the
#           prompt's embeddings computed once
#   floor   the components' own CUDA graphs replayed back to back: VAE encoder + UNet (the stream's batch, or each
#           step in turn) + VAE decoder; on a feature row the models of the stream it prepares, its ControlNets too,
#           its UNet with the image prompt's inputs, and the image encoder where each frame brings an image prompt
#   video   a 512² video file: the codec alone (decode + encode), the ``stream`` command (decode → stream →
#           encode), and the same decoded frames through the stream from memory
STREAM_PEERS = ("ours", "numpy", "torch", "floor", "video")
STREAM_SIZE = 512
STREAM_KIND = "turbo"
# peers whose work does not depend on the stream batch: run once per (steps, VAE)
STREAM_BATCH_BLIND = ("numpy", "torch")
# the peers of a feature row (guidance, the similarity filter, a ControlNet, an IP-Adapter: ``--stream-features``),
# which the other peers do not run: ours, and the floor of its components at the shapes the row prepares
STREAM_FEATURE_PEERS = ("ours", "floor")
# the distinct frames of a moving clip (every frame new: the similarity filter keeps each), and of the control images
# and the image prompts given with the frames in turn
STREAM_CLIP_FRAMES = 8


def stream_unet_steps(num_inference_steps: int, strength: float) -> int:
    """UNet steps per frame of diffusers' img2img rule: the last ``strength`` of ``num_inference_steps``."""
    return min(int(num_inference_steps * strength), num_inference_steps)


def latency_summary(latencies_ms: Sequence[float]) -> Dict[str, Any]:
    """p50 and p99 of per-frame latencies (ms), and every latency."""
    return {
        "p50_ms": float(np.percentile(latencies_ms, 50)),
        "p99_ms": float(np.percentile(latencies_ms, 99)),
        "latency_ms_all": [float(ms) for ms in latencies_ms],
    }


def wall_ms(call: Callable[[], Any], runs: int) -> List[float]:
    """Wall-clock ms of each of ``runs`` calls of ``call()`` (which waits for its own device work)."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1000)
    return times


def step_cache_row(pipe: Any, call: Callable[[], Any], runs: int) -> Tuple[Dict[str, Any], Any]:
    """One row of a step-cache probe: ``call()`` (a pipeline call that waits for its own device work and returns its
    images) once untimed (sessions, graphs), then ``runs`` timed; the median and every time, the last image's spread,
    and, with a cache enabled, which steps of the last call ran whole. Returns the row and the last images."""
    images: List[Any] = [call()]
    times = wall_ms(lambda: images.append(call()), runs)
    row: Dict[str, Any] = {
        "end_to_end_ms": statistics.median(times),
        "end_to_end_ms_all": times,
        "image_std": float(np.asarray(images[-1]).std()),
    }
    row.update(cache_record(pipe))
    return row, images[-1]


def synchronized_latencies(
    call: Callable[[int], Any], count: int, synchronize: Optional[Callable[[], Any]] = None
) -> List[float]:
    """ms of ``count`` calls ``call(i)``, each waited for on the device (``synchronize``, default
    ``torch.cuda.synchronize``) before the next starts."""
    if synchronize is None:
        import torch

        synchronize = torch.cuda.synchronize
    times = []
    for index in range(count):
        start = time.perf_counter()
        call(index)
        synchronize()
        times.append((time.perf_counter() - start) * 1000)
    return times


def cuda_frames(count: int, size: int, seed: int = 0) -> List[torch.Tensor]:
    """Distinct float (3, size, size) CUDA frames in [-1, 1]."""
    import torch

    generator = torch.Generator("cuda").manual_seed(seed)
    return [torch.rand(3, size, size, device="cuda", generator=generator) * 2 - 1 for _ in range(count)]


def load_stream(
    folder: Path,
    tiny_vae: Optional[Path],
    config: Dict[str, Any],
    control_image: Any = None,
    provider: str = "CUDAExecutionProvider",
    size: int = STREAM_SIZE,
    ip_adapter_image: Any = None,
):
    """Ours, prepared for ``config`` at ``size``² (512²): its schedule, and where the row has them its guidance
    (``guidance_scale``, ``cfg_type``; guidance 0 otherwise) and its similarity filter (``similarity_threshold``);
    ``control_image``: the control image of every frame (a ControlNet folder's stream; ``None``: each frame brings
    its own). An IP-Adapter row's stream (``image_prompt``; a folder exported for IP-Adapter) loads a random adapter
    (:func:`random_ip_adapter_for`) at the row's ``ip_adapter_scale`` and is prepared with ``ip_adapter_image``, the
    image prompt of every frame until :meth:`update_image_prompt`."""
    stream = pipeline_class(family("stream")).from_pretrained(folder, provider=provider, tiny_vae=tiny_vae)
    set_recipe_scheduler(stream, STREAM_KIND)
    options = {key: config[key] for key in ("cfg_type", "similarity_threshold") if key in config}
    if control_image is not None:
        options["control_image"] = control_image
    if config.get("image_prompt") is not None:
        stream.load_ip_adapter(random_ip_adapter_for(stream))
        stream.set_ip_adapter_scale(config.get("ip_adapter_scale", 1.0))
        options["ip_adapter_image"] = ip_adapter_image
    stream.prepare(
        PROMPT,
        num_inference_steps=config["steps"],
        strength=config["strength"],
        guidance_scale=config.get("guidance_scale", 0.0),
        seed=0,
        height=size,
        width=size,
        stream_batch=config["stream_batch"],
        **options,
    )
    return stream


def stream_clip(config: Dict[str, Any], sources: Sequence[Any]) -> List[Any]:
    """The frames a row feeds, cycled: ``sources`` (a moving clip, every frame new), or its first frame again and
    again where the row's ``clip`` is ``"still"``."""
    return list(sources[:1]) if config.get("clip") == "still" else list(sources)


def control_images(config: Dict[str, Any], size: int, device: str = "cuda") -> List[Any]:
    """A ControlNet row's control images, (1, 3, size, size) in [0, 1] on ``device``: one for every frame
    (``control`` ``"fixed"``) or :data:`STREAM_CLIP_FRAMES` given with the frames in turn (``"per-frame"``); none
    for the other rows."""
    import torch

    count = {"fixed": 1, "per-frame": STREAM_CLIP_FRAMES}.get(config.get("control"), 0)
    generator = torch.Generator(device).manual_seed(1)
    return [torch.rand(1, 3, size, size, device=device, generator=generator) for _ in range(count)]


def random_ip_adapter_for(pipe: Any, seed: int = 0) -> Dict[str, Dict[str, Any]]:
    """A random plain IP-Adapter (:func:`.zoo.random_ip_adapter_state_dict`) for ``pipe``, an ONNX pipeline whose
    UNet takes image prompts and which has an image encoder: its projection takes the image encoder's
    ``image_embeds`` (its config's ``projection_dim``) and gives tokens of the UNet's cross-attention width (its
    ``encoder_hidden_states``' last dim), each layer's keys and values the width of that layer's inputs."""
    dims = pipe.unet.input_dims
    widths = [dims[key][2] for key, _ in pipe.image_prompt_layers]
    cross = dims["encoder_hidden_states"][2]
    encoder = getattr(pipe, "image_encoder", None)
    embeds = encoder.config.get("projection_dim") if encoder is not None else None
    if not widths or not all(isinstance(width, int) for width in [*widths, cross, embeds]):
        raise ArgumentError(
            "pipe",
            "expected a UNet exported for IP-Adapter and an image encoder, got image-prompt widths "
            f"{widths}, cross-attention width {cross!r} and image_embeds width {embeds!r}",
        )
    return random_ip_adapter_state_dict(widths, cross, embeds, seed)


def image_prompts(config: Dict[str, Any], size: int, seed: int = 2) -> List[Any]:
    """An IP-Adapter row's image prompts, random RGB PIL images of ``size``²: one for every frame (``image_prompt``
    ``"fixed"``) or :data:`STREAM_CLIP_FRAMES` given before the frames in turn (``"per-frame"``; the first one also
    to ``prepare``); none for the other rows."""
    import PIL.Image

    count = {"fixed": 1, "per-frame": STREAM_CLIP_FRAMES}.get(config.get("image_prompt"), 0)
    generator = np.random.default_rng(seed)
    return [PIL.Image.fromarray(generator.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(count)]


def measure_stream(
    stream: Any,
    config: Dict[str, Any],
    sources: Sequence[Any],
    controls: Sequence[Any],
    frames: int,
    warmup: int,
    synchronize: Callable[[], Any],
    prompts: Sequence[Any] = (),
) -> Dict[str, Any]:
    """Ours on one row, prepared (:func:`load_stream`): ``warmup`` frames of the row's clip (:func:`stream_clip`),
    then per-frame latency over ``frames`` calls, each waited for (``synchronize``), and frames/s over ``frames``
    frames back to back, waited for once at the end: given to :meth:`frames`, or, where each frame brings its own
    control image (``control`` ``"per-frame"``: ``controls`` in turn) or image prompt (``image_prompt``
    ``"per-frame"``: ``prompts`` in turn, each given to :meth:`update_image_prompt` before its frame), to the stream
    one call after another. With the similarity filter, the frames it skipped in the frames/s run and their share;
    with an image prompt per frame, the mean ms of ``update_image_prompt`` alone over ``frames`` calls, each waited
    for (``update_image_prompt_ms``)."""
    clip = stream_clip(config, sources)
    per_frame = config.get("control") == "per-frame"
    prompt_per_frame = config.get("image_prompt") == "per-frame"

    def update_image_prompt(index: int) -> None:
        stream.update_image_prompt(ip_adapter_image=prompts[index % len(prompts)])

    def feed(index: int) -> Any:
        frame = clip[index % len(clip)]
        if prompt_per_frame:
            update_image_prompt(index)
        return stream(frame, control_image=controls[index % len(controls)]) if per_frame else stream(frame)

    for index in range(warmup):
        feed(index)
    stream.flush()
    latencies = synchronized_latencies(feed, frames, synchronize)
    stream.flush()
    synchronize()
    skipped = stream.skipped_frames
    start = time.perf_counter()
    if per_frame or prompt_per_frame:  # frames() gives every frame the last control image and image prompt
        for index in range(frames):
            feed(index)
        stream.flush()
    else:
        for _ in stream.frames(clip[index % len(clip)] for index in range(frames)):
            pass
    synchronize()
    fps = frames / (time.perf_counter() - start)
    result = {**latency_summary(latencies), "fps": fps, "frames": frames, "unet_steps": len(stream.timesteps)}
    if "similarity_threshold" in config:
        result["skipped_frames"] = stream.skipped_frames - skipped
        result["skipped_share"] = result["skipped_frames"] / frames
    if prompt_per_frame:
        result["update_image_prompt_ms"] = statistics.mean(
            synchronized_latencies(update_image_prompt, frames, synchronize)
        )
    return result


def run_stream_peer(
    peer: str, folder: Path, tiny_vae: Optional[Path], config: Dict[str, Any], frames: int, warmup: int, work: Path
) -> Dict[str, Any]:
    """One peer of the stream scenario on one configuration (``config``: steps, strength, stream_batch, vae; a
    feature row's options too, :func:`load_stream`), in this process: ``warmup`` frames, then per-frame latency over
    ``frames`` synchronized calls (p50, p99) and frames/s (ours: :func:`measure_stream`; the others cannot overlap
    frames: 1000 / their mean latency). A feature row's floor is its prepared stream's (:func:`prepared_stream_floor`);
    the peers other than :data:`STREAM_FEATURE_PEERS` do not run feature rows."""
    if "feature" in config and peer not in STREAM_FEATURE_PEERS:
        raise PeerUnavailable(f"a feature row is measured by {', '.join(STREAM_FEATURE_PEERS)} alone")
    import torch

    torch.cuda.init()
    if peer == "floor" and "feature" not in config:
        return {"peer": peer, **stream_floor(folder, tiny_vae, config)}
    if peer == "video":
        return {"peer": peer, **stream_video(folder, tiny_vae, config, frames, warmup, work)}
    sources = cuda_frames(STREAM_CLIP_FRAMES, STREAM_SIZE)
    if peer in STREAM_FEATURE_PEERS:  # ours, and a feature row's floor: the stream the row prepares
        controls = control_images(config, STREAM_SIZE)
        prompts = image_prompts(config, STREAM_SIZE)
        stream = load_stream(
            folder,
            tiny_vae,
            config,
            controls[0] if config.get("control") == "fixed" else None,
            ip_adapter_image=prompts[0] if prompts else None,
        )
        if peer == "floor":
            return {"peer": peer, **prepared_stream_floor(stream, config)}
        return {
            "peer": peer,
            **measure_stream(stream, config, sources, controls, frames, warmup, torch.cuda.synchronize, prompts),
        }
    if peer == "numpy":
        if tiny_vae is not None:
            raise PeerUnavailable("diffusers' ONNX img2img pipeline runs the folder's own VAE")
        call = numpy_img2img(folder, config, sources)
    elif peer == "torch":
        call = torch_img2img(tiny_vae is not None, config, sources)
    else:
        raise ArgumentError("peer", f"expected one of {STREAM_PEERS}, got {peer!r}")
    for index in range(warmup):
        call(index)
    latencies = synchronized_latencies(call, frames)
    return {"peer": peer, **latency_summary(latencies), "fps": 1000 / statistics.mean(latencies), "frames": frames}


def numpy_img2img(folder: Path, config: Dict[str, Any], sources: Sequence[torch.Tensor]) -> Callable[[int], Any]:
    """diffusers' ONNX img2img pipeline on the folder (numpy in and out, as its users call it: PIL frames)."""
    import diffusers
    import PIL.Image

    # provider_options={} or diffusers' loader trips ORT's length check and silently falls back to the CPU
    pipe = getattr(diffusers, family("sd-img2img").numpy_class).from_pretrained(
        folder, provider="CUDAExecutionProvider", provider_options={}
    )
    if pipe.unet.model.get_providers()[0] != "CUDAExecutionProvider":
        raise RuntimeError(f"numpy pipeline: the UNet runs on {pipe.unet.model.get_providers()}, not CUDA")
    set_recipe_scheduler(pipe, STREAM_KIND)
    pipe.set_progress_bar_config(disable=True)
    images = [
        PIL.Image.fromarray(
            ((frame.permute(1, 2, 0).float().cpu().numpy() + 1) * 127.5).round().clip(0, 255).astype(np.uint8)
        )
        for frame in sources
    ]

    def call(index: int) -> Any:
        return pipe(
            PROMPT,
            image=images[index % len(images)],
            num_inference_steps=config["steps"],
            strength=config["strength"],
            guidance_scale=0.0,
            generator=np.random.RandomState(0),
            output_type="np",
        ).images

    return call


def torch_img2img(tiny_vae: bool, config: Dict[str, Any], sources: Sequence[torch.Tensor]) -> Callable[[int], Any]:
    """diffusers' torch img2img pipeline, fp16, with the full VAE or a TAESD-shaped AutoencoderTiny, the prompt's
    embeddings computed once; CUDA frames in [0, 1] in, CUDA tensors out."""
    import torch
    from diffusers import StableDiffusionImg2ImgPipeline

    from .zoo import build_taesd_architecture

    base = build_torch_pipeline(STREAM_KIND)
    vae = {"vae": build_taesd_architecture()} if tiny_vae else {}
    pipe = StableDiffusionImg2ImgPipeline.from_pipe(base, **vae).to("cuda", torch.float16)
    set_recipe_scheduler(pipe, STREAM_KIND)
    pipe.set_progress_bar_config(disable=True)
    with torch.inference_mode():
        embeddings, _ = pipe.encode_prompt(PROMPT, "cuda", 1, False)
    images = [((frame + 1) / 2).to(torch.float16).unsqueeze(0) for frame in sources]

    def call(index: int) -> Any:
        with torch.inference_mode():
            return pipe(
                prompt_embeds=embeddings,
                image=images[index % len(images)],
                num_inference_steps=config["steps"],
                strength=config["strength"],
                guidance_scale=0.0,
                generator=torch.Generator("cuda").manual_seed(0),
                output_type="pt",
            ).images

    return call


def graph_replay_ms(model: Any, inputs: Dict[str, torch.Tensor], replays: int) -> float:
    """ms per replay of ``model``'s own CUDA graph (an IOBindingORTModel's capture) of ``inputs``' shapes, ``replays``
    of them back to back on its stream (CUDA events), after three calls (ORT captures after a regular run)."""
    import torch

    with torch.cuda.stream(model.stream):
        for _ in range(3):
            model(**inputs)
        runner = model.graph_runner({name: tuple(tensor.shape) for name, tensor in inputs.items()})
    if runner is None:
        raise RuntimeError(f"{model.input_names}: the model could not be captured as a CUDA graph")
    return replay_ms(runner, model.stream, replays)


def stream_floor(folder: Path, tiny_vae: Optional[Path], config: Dict[str, Any], replays: int = 50) -> Dict[str, Any]:
    """The GPU floor of one frame: each component's own CUDA graph (IOBindingORTModel's capture) replayed back to
    back, timed with CUDA events: VAE encoder (batch 1) + UNet (batch k with the stream batch, else k replays of
    batch 1) + VAE decoder (batch 1)."""
    import torch
    from ..runtime.model import IOBindingORTModel

    latent = STREAM_SIZE // 8
    unet_steps = stream_unet_steps(config["steps"], config["strength"])
    unet_batch = unet_steps if config["stream_batch"] else 1

    def load(name: str) -> IOBindingORTModel:
        source = tiny_vae if tiny_vae is not None and name.startswith("vae_") else folder
        return IOBindingORTModel.from_pretrained(
            source, subfolder=name, provider="CUDAExecutionProvider", cuda_graph=True
        )

    encoder, unet, decoder = load("vae_encoder"), load("unet"), load("vae_decoder")
    (image_name,), (latent_name,) = encoder.input_names, decoder.input_names
    declared = unet.input_dims
    dtype = unet.input_dtypes["sample"]
    parts = {
        "vae_encoder": graph_replay_ms(
            encoder,
            {
                image_name: torch.randn(
                    1, 3, STREAM_SIZE, STREAM_SIZE, device="cuda", dtype=encoder.input_dtypes[image_name]
                )
            },
            replays,
        ),
        "unet": graph_replay_ms(
            unet,
            {
                "sample": torch.randn(unet_batch, 4, latent, latent, device="cuda", dtype=dtype),
                "timestep": torch.full(
                    [unet_batch] if declared["timestep"] else [],
                    500,
                    device="cuda",
                    dtype=unet.input_dtypes["timestep"],
                ),
                "encoder_hidden_states": torch.randn(
                    unet_batch, 77, declared["encoder_hidden_states"][2], device="cuda", dtype=dtype
                ),
            },
            replays,
        ),
        "vae_decoder": graph_replay_ms(
            decoder,
            {latent_name: torch.randn(1, 4, latent, latent, device="cuda", dtype=decoder.input_dtypes[latent_name])},
            replays,
        ),
    }
    unet_calls = 1 if config["stream_batch"] else unet_steps
    frame_ms = parts["vae_encoder"] + unet_calls * parts["unet"] + parts["vae_decoder"]
    return {
        "frame_ms": frame_ms,
        "fps": 1000 / frame_ms,
        "parts_ms": parts,
        "unet_batch": unet_batch,
        "unet_calls": unet_calls,
    }


def stream_floor_inputs(stream: Any, image_encoder: bool = False) -> Dict[str, Tuple[Any, Dict[str, torch.Tensor]]]:
    """The models a frame of a prepared stream runs, in order, each with inputs of the shapes and dtypes ``prepare``
    gave it: the VAE encoder (one frame), with ``image_encoder`` (each frame brings an image prompt) the image encoder
    (one image at its size), each ControlNet (``controlnet``, ``controlnet_1`` …), the UNet (its batch, the guidance's
    rows included; with the ControlNets' residuals, and the image prompt's keys and values of an IP-Adapter stream)
    and the VAE decoder (one latent). The inputs are copies, but a model's call with them writes its graph's input
    buffers, which the stream's frames read: time the stream's frames before, not after."""
    import torch

    unet_inputs = {name: value.clone() for name, value in stream.unet_inputs.items()}
    _, channels, height, width = unet_inputs["sample"].shape
    device, scale = unet_inputs["sample"].device, stream.vae_scale_factor
    encoder, decoder = stream.vae_encoder, stream.vae_decoder
    (image_name,), (latent_name,) = encoder.input_names, decoder.input_names
    image = torch.randn(1, 3, height * scale, width * scale, device=device, dtype=encoder.input_dtypes[image_name])
    models = {"vae_encoder": (encoder, {image_name: image})}
    if image_encoder:
        prompt_encoder = stream.image_encoder
        _, _, side, _ = prompt_encoder.input_dims["pixel_values"]
        pixels = torch.randn(1, 3, side, side, device=device, dtype=prompt_encoder.input_dtypes["pixel_values"])
        models["image_encoder"] = (prompt_encoder, {"pixel_values": pixels})
    nets = list(getattr(stream, "controlnets", []))
    for name, net, inputs in zip(controlnet_component_names(len(nets)), nets, stream.control_inputs if nets else []):
        inputs = {key: value.clone() for key, value in inputs.items()}
        models[name] = (net, inputs)
        residuals = [residual.clone() for residual in net(**inputs)]  # their shapes and dtypes: the UNet's inputs
        unet_inputs.update(zip(stream.denoiser.residual_inputs, residuals))
    models["unet"] = (stream.unet, unet_inputs)
    latent = torch.randn(1, channels, height, width, device=device, dtype=decoder.input_dtypes[latent_name])
    models["vae_decoder"] = (decoder, {latent_name: latent})
    return models


def prepared_stream_floor(stream: Any, config: Dict[str, Any], replays: int = 50) -> Dict[str, Any]:
    """The GPU floor of one frame of a feature row: each model of the prepared stream (:func:`stream_floor_inputs`)
    replayed alone from its own CUDA graph, back to back (:func:`graph_replay_ms`): VAE encoder (+ the image encoder
    where each frame brings an image prompt, ``image_prompt`` ``"per-frame"``) + the ControlNets and the UNet (once
    with the stream batch, else once per step) + VAE decoder. The UNet's batch holds the guidance's rows (a
    negative-prompt row per latent row under "full", one under "initialize")."""
    models = stream_floor_inputs(stream, image_encoder=config.get("image_prompt") == "per-frame")
    parts = {name: graph_replay_ms(model, inputs, replays) for name, (model, inputs) in models.items()}
    unet_calls = 1 if config["stream_batch"] else len(stream.timesteps)
    step_ms = sum(ms for name, ms in parts.items() if name not in ("vae_encoder", "image_encoder", "vae_decoder"))
    frame_ms = parts["vae_encoder"] + parts.get("image_encoder", 0.0) + unet_calls * step_ms + parts["vae_decoder"]
    return {
        "frame_ms": frame_ms,
        "fps": 1000 / frame_ms,
        "parts_ms": parts,
        "unet_batch": int(models["unet"][1]["sample"].shape[0]),
        "unet_calls": unet_calls,
    }


def stream_video(
    folder: Path, tiny_vae: Optional[Path], config: Dict[str, Any], frames: int, warmup: int, work: Path
) -> Dict[str, Any]:
    """A 512² H.264 video of ``frames`` frames (made once under ``work``) three ways: the codec alone (decode, then
    encode the same frames), the ``stream`` command in a process of its own (decode → stream → encode; its own
    summary line's seconds: the frame loop, load and prepare apart), and its decoded frames through the stream from
    memory (numpy frames in and out, as the command passes them)."""
    import re
    import subprocess
    import sys
    import tempfile

    from ..video import FrameWriter, open_frames

    source = work / f"stream-video-{STREAM_SIZE}-{frames}.mp4"
    if not source.is_file():
        with FrameWriter(source, fps=30, overwrite=True) as writer:
            for index in range(frames):
                writer.write(moving_pattern(index, STREAM_SIZE))
    with tempfile.TemporaryDirectory(dir=work) as scratch:
        start = time.perf_counter()
        with open_frames(source) as reader, FrameWriter(Path(scratch) / "codec.mp4", fps=reader.fps) as writer:
            for frame in reader:
                writer.write(frame)
        codec_s = time.perf_counter() - start

        command = [
            sys.executable,
            "-m",
            "optimum_iobinding.cli",
            "stream",
            str(source),
            str(Path(scratch) / "stream.mp4"),
            "--prompt",
            PROMPT,
            "--model",
            str(folder),
            "--steps",
            str(config["steps"]),
            "--strength",
            str(config["strength"]),
            "--provider",
            "CUDAExecutionProvider",
            "--stream-batch" if config["stream_batch"] else "--no-stream-batch",
            *(["--tiny-vae", str(tiny_vae)] if tiny_vae is not None else []),
        ]
        completed = subprocess.run(command, capture_output=True, text=True)
        summary = re.search(r": (\d+) frames of .* in ([0-9.]+) s \(", completed.stdout)
        if completed.returncode != 0 or summary is None:
            raise RuntimeError(
                f"the stream command failed ({completed.returncode}): {(completed.stderr or completed.stdout)[-1500:]}"
            )
        command_s = float(summary.group(2))

    with open_frames(source) as reader:
        decoded = list(reader)
    stream = load_stream(folder, tiny_vae, config)
    for _ in stream.frames(decoded[:warmup]):
        pass
    start = time.perf_counter()
    for _ in stream.frames(decoded):
        pass
    in_memory_s = time.perf_counter() - start
    return {
        "frames": frames,
        "codec_s": codec_s,
        "codec_fps": frames / codec_s,
        "command_s": command_s,
        "command_fps": frames / command_s,
        "in_memory_host_s": in_memory_s,
        "in_memory_host_fps": frames / in_memory_s,
        "command": " ".join(command[2:]),
    }


def moving_pattern(index: int, size: int) -> np.ndarray:
    """Frame ``index`` of a smooth moving pattern, uint8 (size, size, 3): something a codec compresses as it would a
    camera's frames, not noise."""
    y, x = np.mgrid[0:size, 0:size].astype(np.float32)
    phase = index / 8.0
    channels = [np.sin(x / 37.0 + phase), np.cos(y / 29.0 - phase), np.sin((x + y) / 53.0 + 2 * phase)]
    return np.ascontiguousarray(((np.stack(channels, axis=-1) + 1) * 127.5).astype(np.uint8))
