"""The video scenario's peers (``--scenario video``): Wan 2.1 T2V 1.3B's architecture at its model card's recipe
(:data:`.zoo.VIDEO_RECIPES`), each peer measured in a process of its own; and the MLPerf Inference v6.0 shape (Wan
2.2 T2V A14B's transformer at 720 × 1280, :data:`.zoo.MLPERF_VIDEO_RECIPES`), the transformer alone.

Text to video (:func:`run_video_peer`, :func:`run_video_floor`):

  ours     our Wan pipeline, from_pretrained(folder) with its defaults (CUDA graphs, IO binding, one stream)
  torch    diffusers' WanPipeline as its model card runs it: the transformer and UMT5 in bfloat16, the VAE in float32
  compile  the same with ``torch.compile(pipe.transformer, mode=...)`` (its first video, compilation included, timed
           apart)
  floor    back-to-back replays of our transformer's CUDA graph at the loop's shape (classifier-free guidance: 2 rows),
           as our loop captured it

Every pipeline gets the same initial latents, prompt, size, frame count, step count, guidance and UMT5 length. Per
step: the time between the first and the last step end inside each timed call (CUDA events recorded on the stream
the pipeline runs on, read after the call; on the CPU the host's clock), per step between. The VAE decode of the
last timed call's latents is timed apart (ours: ``pipe.codec.decode``, the chunk graphs of :class:`WanVideoCodec
<optimum_iobinding.pipelines.wan_codec.WanVideoCodec>` one latent frame at a time; diffusers: ``vae.decode`` as its
pipeline calls it).

The MLPerf shape (:func:`run_mlperf_peer`): one transformer call at two rows (a guided step) on random inputs — ours
through :class:`~optimum_iobinding.runtime.model.IOBindingORTModel` with its CUDA graph (and the graph replayed
alone), diffusers' ``WanTransformer3DModel`` in bfloat16 eager (``torch``) or compiled (``compile``).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import numpy as np

if TYPE_CHECKING:  # annotations only: torch is imported where it is used, not for --help
    import torch

from ..errors import ArgumentError
from ..families import family, pipeline_class
from .peers import PeerUnavailable
from .probes import PeakMemory, graph_floor_ms
from .transformer_peers import image_stats, weights_made_on
from .zoo import (
    MLPERF_VIDEO_RECIPES,
    PROMPT,
    VIDEO_RECIPES,
    build_video_pipeline,
    build_wan_transformer,
    wan_blocks,
    wan_full_blocks,
)

VIDEO_PEERS = ("ours", "torch", "compile", "floor")
MLPERF_PEERS = ("ours", "torch", "compile")
# this project's pipelines among the peers (where one fails, the run fails)
OUR_VIDEO_PEERS = ("ours",)
# peers that need CUDA: compiled kernels and captured graphs are what they measure
CUDA_ONLY_VIDEO_PEERS = ("compile", "floor")
# the peers of a run on the CPU (the tiny models): ours and diffusers' eager pipeline
CPU_VIDEO_PEERS = ("ours", "torch")
# torch.compile's modes the compile peers take (the others autotune for many minutes, or capture graphs of their own)
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")


def latent_video_shape(recipe: Dict[str, Any], rows: int = 1) -> Tuple[int, ...]:
    """The latents of a recipe's video: ``(rows, 16, 1 + (frames − 1) / 4, height / 8, width / 8)`` (Wan's VAE)."""
    return (rows, 16, (recipe["num_frames"] - 1) // 4 + 1, recipe["height"] // 8, recipe["width"] // 8)


def initial_video_latents(recipe: Dict[str, Any], seed: int = 0) -> np.ndarray:
    """The initial noise every peer starts from, float32, of the recipe's latent video."""
    return np.random.RandomState(seed).randn(*latent_video_shape(recipe)).astype(np.float32)


def keep_float32_parameters(model: Any) -> int:
    """Casts to float32 the parameters that ``from_pretrained(torch_dtype=...)`` keeps in float32: those under the
    modules the class names in ``_keep_in_fp32_modules`` (diffusers' rule, transformers' alike: a name among the
    dotted parts of the parameter's). A model built from its config in bfloat16 then holds what a loaded one holds.

    Returns:
        How many parameters were cast.
    """
    import torch

    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    cast = 0
    for name, parameter in model.named_parameters():
        if any(part in name.split(".") for part in keep) and parameter.dtype != torch.float32:
            parameter.data = parameter.data.to(torch.float32)
            cast += 1
    return cast


class StepClock:
    """When each denoising step ended, as a step-end callback marks it: a CUDA event recorded on the current stream
    (the one the pipeline enqueues on; nothing waits for it), or the host's clock on the CPU. The last step's latents
    are kept (the decode is timed on them)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.calls: List[List[Any]] = []
        self.latents: Optional[torch.Tensor] = None

    def start_call(self) -> Callable[..., Dict[str, Any]]:
        """A new call's step-end callback (diffusers' ``callback_on_step_end`` signature)."""
        import torch

        marks: List[Any] = []
        self.calls.append(marks)

        def mark(pipeline: Any, step: int, timestep: Any, tensors: Dict[str, Any]) -> Dict[str, Any]:
            if self.cuda:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                marks.append(event)
            else:
                marks.append(time.perf_counter())
            self.latents = tensors["latents"]
            return tensors

        return mark

    def step_ms(self) -> List[float]:
        """Per marked call (of at least two steps): ms from the first step's end to the last's, per step between
        (call after the calls' work is done)."""
        result = []
        for marks in self.calls:
            if len(marks) < 2:
                continue
            elapsed = marks[0].elapsed_time(marks[-1]) if self.cuda else (marks[-1] - marks[0]) * 1000
            result.append(elapsed / (len(marks) - 1))
        return result


def load_video_peer(peer: str, folder: Optional[Path], config: Dict[str, Any]) -> Tuple[Any, Dict[str, Any]]:
    """The pipeline of one peer on the config's device, and what the result says of its weights and dtypes."""
    import torch

    device = config["device"]
    if peer in CUDA_ONLY_VIDEO_PEERS and device != "cuda":
        raise PeerUnavailable(f"{peer} measures CUDA work: it needs --device cuda")
    if peer == "ours":
        provider = "CUDAExecutionProvider" if device == "cuda" else "CPUExecutionProvider"
        pipe = pipeline_class(family("wan")).from_pretrained(folder, provider=provider)
        dtypes = {"transformer": str(pipe.transformer.input_dtypes["hidden_states"])}
        if pipe.vae_decoder is not None:
            dtypes["vae"] = str(pipe.vae_decoder.input_dtypes[pipe.vae_decoder.input_names[0]])
        return pipe, {"weights": "the export's", "dtypes": dtypes}
    if peer in ("torch", "compile"):
        blocks, text_layers = config.get("blocks"), config.get("text_layers")
        if device == "cuda":
            # diffusers' model card: the transformer and UMT5 in bfloat16 (their float32 modules kept), the VAE in
            # float32; the weights drawn on the device with the export's seed
            with weights_made_on(torch.device(device), torch.bfloat16):
                pipe = build_video_pipeline(config["model"], blocks, text_layers)
            pipe.vae.to(torch.float32)
            kept = {name: keep_float32_parameters(getattr(pipe, name)) for name in ("transformer", "text_encoder")}
            weights = "the export's seed, drawn on the device in bf16 (not the export's values)"
        else:  # the host: the export's own float32 weights (the same seed on the same device)
            pipe = build_video_pipeline(config["model"], blocks, text_layers)
            kept = {}
            weights = "the export's"
        # the scheduler's constants in float32 on the host, as from_pretrained gives them
        pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
        pipe = pipe.to(device)
        if peer == "compile":
            pipe.transformer = torch.compile(pipe.transformer, mode=config["compile_mode"])
        dtypes = {name: str(getattr(pipe, name).dtype) for name in ("text_encoder", "transformer", "vae")}
        return pipe, {"weights": weights, "dtypes": dtypes, "kept_float32_parameters": kept}
    raise ArgumentError("peer", f"expected one of {', '.join(VIDEO_PEERS[:-1])}, got {peer!r}")


def decode_seconds(peer: str, pipe: Any, latents: torch.Tensor, cuda: bool) -> float:
    """Seconds to decode ``latents`` (the denoiser's, float32) to the video, as each pipeline decodes them at the end
    of a call: ours through its codec (the latents de-normalised, then the chunk graphs one latent frame at a time),
    diffusers' through ``vae.decode`` after its own de-normalisation."""
    import torch

    def decode() -> Any:
        if peer == "ours":
            context = torch.cuda.stream(pipe.stream) if cuda else contextlib.nullcontext()
            with context:
                return pipe.codec.decode(latents)
        vae = pipe.vae
        shape = (1, vae.config.z_dim, 1, 1, 1)
        z = latents.to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(z.device, z.dtype)
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(z.device, z.dtype)
        return vae.decode(z / inverse_std + mean, return_dict=False)[0]

    with torch.inference_mode():
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        decode()
        if cuda:
            torch.cuda.synchronize()
    return time.perf_counter() - start


def run_video_peer(peer: str, folder: Optional[Path], config: Dict[str, Any], video_path: Path) -> Dict[str, Any]:
    """One text-to-video peer in this process: load (timed), the first video (timed: ORT's set-up and graph
    capture, or ``torch.compile``'s compilation), ``warmup`` calls, ``runs`` timed calls (end to end, and per step from their
    step ends: :class:`StepClock`), the VAE decode of the last call's latents (timed: :func:`decode_seconds`), for
    ours its transformer graph replayed alone in this process; the device's memory peak above its idle (CUDA:
    device-wide, ORT's arenas included; and torch's own ``max_memory_allocated``). On the CPU the frames are saved to
    ``video_path`` (their weights are the export's there: the frames are compared)."""
    import torch
    from diffusers import WanPipeline  # noqa: F401 — imported before the load is timed, as ours below

    pipeline_class(family("wan"))  # imported before the load is timed, as diffusers' above

    recipe = VIDEO_RECIPES[config["model"]]
    steps = config["steps"]
    cuda = config["device"] == "cuda"
    memory = PeakMemory(torch.device("cuda", 0)) if cuda else contextlib.nullcontext()
    idle = memory.used() if cuda else None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    clock = StepClock(cuda)
    latents = torch.from_numpy(initial_video_latents(recipe))
    with memory:
        start = time.perf_counter()
        pipe, about = load_video_peer(peer, folder, config)
        load_s = time.perf_counter() - start
        pipe.set_progress_bar_config(disable=True)
        latents = latents.to(config["device"])

        def call(marked: bool = False) -> np.ndarray:
            extra = {"callback_on_step_end": clock.start_call()} if marked else {}
            with torch.inference_mode():
                frames = pipe(
                    PROMPT,
                    height=recipe["height"],
                    width=recipe["width"],
                    num_frames=recipe["num_frames"],
                    num_inference_steps=steps,
                    guidance_scale=recipe["guidance"],
                    latents=latents.clone(),
                    max_sequence_length=recipe["max_sequence_length"],
                    output_type="np",
                    **extra,
                ).frames
            if cuda:
                torch.cuda.synchronize()
            return np.asarray(frames)

        start = time.perf_counter()
        frames = call()
        first_video_s = time.perf_counter() - start
        for _ in range(config["warmup"]):
            frames = call()
        end_to_end: List[float] = []
        for _ in range(config["runs"]):
            start = time.perf_counter()
            frames = call(marked=True)
            end_to_end.append(time.perf_counter() - start)
        decode_s = decode_seconds(peer, pipe, clock.latents, cuda)
    own_floor = graph_floor_ms(pipe.transformer, config["replays"]) if peer == "ours" and cuda else None
    per_step = clock.step_ms()
    if not cuda:
        np.save(video_path, frames.astype(np.float32))
    if peer == "ours":  # the provider each component ran on; which ran without a graph, ORT's reason
        about["providers"] = {name: model.providers[0] for name, model in pipe.onnx_models.items()}
        about["graph_signatures"] = {name: len(model.graph_signatures) for name, model in pipe.onnx_models.items()}
        about["graph_fallbacks"] = {
            name: {str(dict(signature)): reason for signature, reason in model.graph_fallbacks.items()}
            for name, model in pipe.onnx_models.items()
            if model.graph_fallbacks
        }
    step_ms = statistics.median(per_step) if per_step else None
    median_s = statistics.median(end_to_end)
    return {
        "peer": peer,
        **about,
        "end_to_end_s": median_s,
        "end_to_end_s_all": end_to_end,
        "steps": steps,
        "per_step_ms": step_ms,
        "per_step_ms_all": per_step,
        # the recipe's step count, at this run's cost per step: an estimate, named so in the report
        "recipe_steps_estimate_s": (
            median_s + (recipe["recipe_steps"] - steps) * step_ms / 1000 if step_ms is not None else None
        ),
        "vae_decode_s": decode_s,
        "own_floor_ms": own_floor,
        "per_step_over_own_floor": step_ms / own_floor if own_floor and step_ms else None,
        "peak_memory_mib": (memory.peak - idle) / 2**20 if cuda else None,
        "memory_source": memory.source if cuda else None,
        "torch_max_allocated_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
        "load_s": load_s,
        "first_video_s": first_video_s,
        # torch.compile compiles during the first video: that video's time less a warm one's
        "compile_s": first_video_s - median_s if peer == "compile" else None,
        "frames_shape": list(frames.shape),
        "video": None if cuda else str(video_path),
        "frame_stats": image_stats(frames),
    }


def run_video_floor(folder: Path, config: Dict[str, Any]) -> Dict[str, Any]:
    """The GPU floor of one step, in a process of its own: our pipeline (``cuda_graph=True``) runs one step at the
    recipe's shape (its loop captures the transformer's graph at the loop's own rows and shapes: 2 with guidance),
    latents out; then that graph replays back to back (:func:`.probes.graph_floor_ms`)."""
    import torch

    if config["device"] != "cuda":
        raise PeerUnavailable("floor measures CUDA-graph replays: it needs --device cuda")
    recipe = VIDEO_RECIPES[config["model"]]
    pipe = pipeline_class(family("wan")).from_pretrained(folder, provider="CUDAExecutionProvider", cuda_graph=True)
    pipe.set_progress_bar_config(disable=True)
    latents = torch.from_numpy(initial_video_latents(recipe)).to("cuda")
    with torch.inference_mode():
        pipe(
            PROMPT,
            height=recipe["height"],
            width=recipe["width"],
            num_frames=recipe["num_frames"],
            num_inference_steps=1,
            guidance_scale=recipe["guidance"],
            latents=latents,
            max_sequence_length=recipe["max_sequence_length"],
            output_type="latent",
        )
    torch.cuda.synchronize()
    per_step = graph_floor_ms(pipe.transformer, config["replays"])
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
        "replays": config["replays"],
    }


def mlperf_inputs(model_dtype: torch.dtype, text_dim: int, config: Dict[str, Any], device: str) -> Dict[str, Any]:
    """A guided step's transformer inputs at the MLPerf shape (seeded): the latents of two rows, UMT5 states of the
    recipe's length, the timestep (float32, as diffusers embeds it)."""
    import torch

    recipe = MLPERF_VIDEO_RECIPES[config["mlperf_model"]]
    rows = recipe["rows"]
    generator = torch.Generator().manual_seed(0)
    return {
        "hidden_states": torch.randn(*latent_video_shape(recipe, rows), generator=generator).to(device, model_dtype),
        "encoder_hidden_states": torch.randn(rows, recipe["max_sequence_length"], text_dim, generator=generator).to(
            device, model_dtype
        ),
        "timestep": torch.full((rows,), 500.0, device=device),
    }


def run_mlperf_peer(peer: str, folder: Optional[Path], config: Dict[str, Any]) -> Dict[str, Any]:
    """One transformer call at the MLPerf shape, in this process: the first call (timed: ORT's set-up and graph
    capture, or compilation), ``warmup`` calls, ``runs`` timed calls (CUDA events around each on the stream it runs on; the
    host's clock on the CPU), for ours its graph replayed alone; the device's memory peak above its idle."""
    import torch
    from diffusers import WanTransformer3DModel  # noqa: F401 — imported before the load is timed, as ours below

    from ..runtime.model import IOBindingORTModel

    device = config["device"]
    cuda = device == "cuda"
    if peer == "compile" and not cuda:
        raise PeerUnavailable("compile measures CUDA work: it needs --device cuda")
    memory = PeakMemory(torch.device("cuda", 0)) if cuda else contextlib.nullcontext()
    idle = memory.used() if cuda else None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    kind, blocks = config["mlperf_model"], wan_blocks(config["mlperf_model"], config["mlperf_blocks"])
    with memory:
        start = time.perf_counter()
        if peer == "ours":
            model = IOBindingORTModel.from_pretrained(
                folder,
                subfolder="transformer",
                provider="CUDAExecutionProvider" if cuda else "CPUExecutionProvider",
                cuda_graph=cuda,
            )
            dtype, text_dim = model.input_dtypes["hidden_states"], model.input_dims["encoder_hidden_states"][2]
            stream = model.stream

            def step(inputs: Dict[str, Any]) -> Any:
                return model(**inputs)

        elif peer in ("torch", "compile"):
            if cuda:
                with weights_made_on(torch.device(device), torch.bfloat16):
                    model = build_wan_transformer(kind, blocks)
                keep_float32_parameters(model)
            else:
                model = build_wan_transformer(kind, blocks)
            dtype, text_dim, stream = model.dtype, model.config.text_dim, None
            forward = torch.compile(model, mode=config["compile_mode"]) if peer == "compile" else model

            def step(inputs: Dict[str, Any]) -> Any:
                return forward(**inputs, return_dict=False)[0]

        else:
            raise ArgumentError("peer", f"expected one of {', '.join(MLPERF_PEERS)}, got {peer!r}")
        load_s = time.perf_counter() - start
        inputs = mlperf_inputs(dtype, text_dim, config, device)
        if cuda:  # made on the default stream: done before ours reads them on its own
            torch.cuda.synchronize()

        def timed() -> float:
            with torch.inference_mode():
                if not cuda:
                    start = time.perf_counter()
                    step(inputs)
                    return (time.perf_counter() - start) * 1000
                context = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with context:
                    begin.record()
                    step(inputs)
                    end.record()
                end.synchronize()
                return begin.elapsed_time(end)

        start = time.perf_counter()
        timed()
        first_call_s = time.perf_counter() - start
        for _ in range(config["warmup"]):
            timed()
        calls = [timed() for _ in range(config["runs"])]
    replay = graph_floor_ms(model, config["replays"]) if peer == "ours" and cuda else None
    step_ms = statistics.median(calls)
    return {
        "peer": peer,
        "blocks": blocks,
        "full_blocks": wan_full_blocks(kind),
        "inputs": {name: list(tensor.shape) for name, tensor in inputs.items()},
        "dtype": str(dtype),
        "step_ms": step_ms,
        "step_ms_all": calls,
        "graph_replay_ms": replay,
        "per_block_ms": step_ms / blocks,
        # the full depth at this run's per-block cost (the embeddings and the head counted in it): an estimate
        "full_depth_estimate_ms": step_ms / blocks * wan_full_blocks(kind),
        "peak_memory_mib": (memory.peak - idle) / 2**20 if cuda else None,
        "torch_max_allocated_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
        "load_s": load_s,
        "first_call_s": first_call_s,
        "compile_s": first_call_s - step_ms / 1000 if peer == "compile" else None,
    }
