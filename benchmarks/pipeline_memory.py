"""Where the device memory of a whole pipeline goes on mixed batch sizes: ours with its options varied, beside
diffusers' numpy pipeline, each in a fresh process.

For each variant: device-wide used memory (NVML, or ``cudaMemGetInfo``: ORT's arenas count; each variant a first load of the files, with an empty
cache folder) above the process's idle after the
load and after a call at each image batch in turn (``--batches``, 10 DDIM steps, guidance 7.5, 512²), torch's
reserved memory beside it, each component's sessions and captured signatures, and the peak over everything
(``PeakMemory``, sampled from a child process). Variants: ``numpy`` (diffusers' ONNX pipeline), ``defaults``,
``text-no-graph`` (the text encoder one dynamic session without graphs), ``no-max-workspace``
(``cudnn_conv_use_max_workspace=0``), ``no-graphs`` (``cuda_graph=False``), ``power-of-two-arena`` (ORT's
default arena growth, as the numpy pipeline's, instead of ``kSameAsRequested``), ``text-weights-from-file`` (the text
encoder's sessions load its weights from the file themselves instead of reading tensors the pipeline owns: whether
ONNX Runtime keeps a copy of owned weights beside them), ``unet-owned`` (the UNet's weights owned tensors from the
load on, as the text encoder's are), ``weights-apart`` and ``power-of-two-weights-apart`` (ORT's
``session.use_device_allocator_for_initializers``: each weight allocated by itself, outside the arena, which then
holds the activations alone; with our arena growth, and with ORT's default one), ``calling-thread``
(``prepare_in_background=False``: the sessions made and first run when the call needs them), ``own-arenas`` (each
session an arena of its own: session options of the user's keep the defaults out of the shared arena), ``one-arena``
and ``one-arena-power-of-two`` (one arena for every session of the pipeline, the VAE encoder's made after the captures
included, which the defaults keep out: an allocator registered in ORT's environment and ``session.use_env_allocators``,
growing by what is asked or by powers of two).

Each variant's images (8-bit pixels) are compared with the ``defaults`` variant's, where both ran: the same sessions
and seeds, so a variant that only moves memory gives the same images (``max_pixel_difference_from_defaults`` per
batch).

With ``--arena-log`` each variant runs with ONNX Runtime's INFO log, kept in ``OUT/arena-VARIANT.log``; its row sums
per step (load, each batch) what the arenas reserved (the weights) and grew by: where a variant's memory goes.

    python benchmarks/pipeline_memory.py --folder WORK/sd15-fp16-optimized --out OUT/pipeline-memory
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = {
    "numpy": None,
    "defaults": {},
    "text-no-graph": {"component_options": {"text_encoder": {"cuda_graph": False}}},
    "no-max-workspace": {"provider_options": {"cudnn_conv_use_max_workspace": "0"}},
    "no-graphs": {"cuda_graph": False},
    "power-of-two-arena": {"provider_options": {"arena_extend_strategy": "kNextPowerOfTwo"}},
    "text-weights-from-file": {"component_options": {"text_encoder": {"share_weights": False}}},
    # the UNet's weights owned tensors from the load on (read straight from the files into pinned staging buffers),
    # which its sessions read in place, instead of loaded by ONNX Runtime into its arena
    "unet-owned": {"component_options": {"unet": {"share_weights": True}}},
    # ORT's power-of-two growth for the activations only: the weights each allocated apart, outside the arena
    "power-of-two-weights-apart": {
        "provider_options": {"arena_extend_strategy": "kNextPowerOfTwo"},
        "session_config": {"session.use_device_allocator_for_initializers": "1"},
    },
    "weights-apart": {"session_config": {"session.use_device_allocator_for_initializers": "1"}},
    # every session made and first run in the calling thread: no CUDA provider context held by a set-up thread
    "calling-thread": {"prepare_in_background": False},
    # each session an arena of its own: the user's session options keep sessions out of the shared one
    "own-arenas": {"session_config": {"session.use_env_allocators": "0"}},
    # one arena for every session of the pipeline (ORT's shared environment allocator), growing by what is asked or
    # by powers of two: the text encoder's, the UNet's and the VAE decoder's activations in the same memory
    "one-arena": {"session_config": {"session.use_env_allocators": "1"}, "env_arena": "kSameAsRequested"},
    "one-arena-power-of-two": {"session_config": {"session.use_env_allocators": "1"}, "env_arena": "kNextPowerOfTwo"},
}
ARENA_STRATEGIES = {"kNextPowerOfTwo": 0, "kSameAsRequested": 1}  # OrtArenaCfg's arena_extend_strategy


def measure(folder: str, variant: str, batches) -> dict:
    import torch

    from optimum_iobinding.bench.probes import PeakMemory

    mib = lambda b: round(b / 2**20, 1)  # noqa: E731
    torch.cuda.init()
    peak = PeakMemory(torch.device("cuda"))

    def used() -> int:  # the peak's own source (NVML where it finds the device)
        torch.cuda.synchronize()
        return peak.used()

    idle = used()
    with peak:
        snapshots = run(folder, variant, batches, used, idle, mib)
    return {"variant": variant, "peak_mib": mib(peak.peak - idle), "snapshots": snapshots}


ARENA_LOG = False  # --arena-log: ONNX Runtime's INFO lines in this process's stderr, a marker before each step
IMAGES = None  # --images FILE (the parent's): each batch's images, as 8-bit pixels, saved there (.npz)


def run(folder: str, variant: str, batches, used, idle: int, mib) -> list:
    import numpy as np
    import torch

    if ARENA_LOG:
        import onnxruntime as ort

        ort.set_default_logger_severity(1)  # INFO: each arena extension and reservation, with its bytes
        print("== load", file=sys.stderr, flush=True)

    options = VARIANTS[variant]
    if options is None:
        from optimum_iobinding.pipelines import load_numpy_pipeline

        pipe = load_numpy_pipeline(folder)
        components = {}
    else:
        from optimum_iobinding import OnnxStableDiffusionPipeline

        options = dict(options)
        arena = options.pop("env_arena", None)
        if arena is not None:
            import onnxruntime as ort

            ort.create_and_register_allocator_v2(
                "CUDAExecutionProvider",
                ort.OrtMemoryInfo("Cuda", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT),
                {"device_id": "0"},
                ort.OrtArenaCfg({"arena_extend_strategy": ARENA_STRATEGIES[arena]}),
            )
        config = options.pop("session_config", None)
        if config:
            import onnxruntime as ort

            options["sess_options"] = ort.SessionOptions()
            for key, value in config.items():
                options["sess_options"].add_session_config_entry(key, value)
        pipe = OnnxStableDiffusionPipeline.from_pretrained(folder, provider="CUDAExecutionProvider", **options)
        components = {"text_encoder": pipe.text_encoder, "unet": pipe.unet, "vae_decoder": pipe.vae_decoder}
    from diffusers import DDIMScheduler

    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config, clip_sample=False)
    pipe.set_progress_bar_config(disable=True)
    snapshots = [
        {"after": "load", "used_mib": mib(used() - idle), "torch_reserved_mib": mib(torch.cuda.memory_reserved())}
    ]
    kept = {}
    for batch in batches:
        if ARENA_LOG:
            print(f"== batch {batch}", file=sys.stderr, flush=True)
        generator = np.random.RandomState(0) if options is None else torch.Generator("cuda").manual_seed(0)
        images = pipe(
            "a photo of an astronaut riding a horse",
            num_images_per_prompt=batch,
            num_inference_steps=10,
            guidance_scale=7.5,
            height=512,
            width=512,
            generator=generator,
            output_type="np",
        ).images
        if IMAGES is not None:  # the images as 8-bit pixels, compared with another variant's by the parent process
            kept[f"batch {batch}"] = np.round(np.clip(images, 0, 1) * 255).astype(np.uint8)
        snapshot = {
            "after": f"batch {batch}",
            "used_mib": mib(used() - idle),
            "torch_reserved_mib": mib(torch.cuda.memory_reserved()),
        }
        for name, model in components.items():
            snapshot[name] = {"sessions": model.sessions_created, "graphs": len(model.graph_signatures)}
        snapshots.append(snapshot)
    if IMAGES is not None:
        np.savez(IMAGES, **kept)
    return snapshots


def arena_growth(log: str) -> dict:
    """Per step of a variant's run (``load``, ``batch N``, from the markers): the MiB ONNX Runtime's arenas grew by
    ("Extended allocation by N bytes") and reserved ("Reserving memory in BFCArena … size: N", the weights), and how
    many extensions that took."""
    import re

    steps, step = {}, None
    for line in log.splitlines():
        if line.startswith("== "):
            step = line[3:].strip()
            steps[step] = {"extended_mib": 0.0, "extensions": 0, "reserved_mib": 0.0}
        elif step is not None:
            extended = re.search(r"Extended allocation by (\d+) bytes", line)
            reserved = re.search(r"Reserving memory in BFCArena for \S+ size: (\d+)", line)
            if extended:
                steps[step]["extended_mib"] += int(extended[1]) / 2**20
                steps[step]["extensions"] += 1
            elif reserved:
                steps[step]["reserved_mib"] += int(reserved[1]) / 2**20
    return {name: {key: round(value, 1) for key, value in values.items()} for name, values in steps.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--batches", default="1,4,8,2")
    parser.add_argument(
        "--arena-log",
        action="store_true",
        help="keep ONNX Runtime's INFO log of each variant (OUT/arena-VARIANT.log) and sum its arenas' extensions "
        "and reservations per step (load, each batch) into the row",
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a variant, measured in this process
    parser.add_argument("--images", help=argparse.SUPPRESS)  # where the variant's process saves its images
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    global ARENA_LOG, IMAGES
    ARENA_LOG = args.arena_log
    IMAGES = args.images
    if args.one:
        print(json.dumps(measure(args.folder, args.one, batches)))
        return 0
    from optimum_iobinding.bench.probes import environment

    import numpy as np

    result = {"environment": environment(), "rows": []}
    pictures = tempfile.TemporaryDirectory()  # each variant's images, compared with the defaults' below
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            parser.error(f"--variants: expected names among {', '.join(VARIANTS)}, got {variant!r}")
        images = Path(pictures.name) / f"{variant}.npz"
        with tempfile.TemporaryDirectory() as cache:  # each variant a first load: nothing remembered before it
            done = subprocess.run(
                [sys.executable, __file__, "--folder", args.folder, "--out", str(args.out), "--batches", args.batches,
                 "--one", variant, "--images", str(images), *(["--arena-log"] if args.arena_log else [])],
                capture_output=True, text=True, env={**os.environ, "XDG_CACHE_HOME": cache},
            )  # fmt: skip
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        row = (
            json.loads(lines[-1])
            if done.returncode == 0 and lines
            else {"variant": variant, "error": done.stderr[-2000:]}
        )
        if args.arena_log:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"arena-{variant}.log").write_text(done.stderr)
            row["arena_mib"] = arena_growth(done.stderr)
        reference = Path(pictures.name) / "defaults.npz"
        if variant not in ("numpy", "defaults") and images.is_file() and reference.is_file():
            # the largest pixel difference (0–255) from the defaults' images, batch by batch: the same sessions and
            # seeds, so a variant that only moves memory gives the same images
            with np.load(images) as mine, np.load(reference) as theirs:
                row["max_pixel_difference_from_defaults"] = {
                    name: int(np.abs(mine[name].astype(int) - theirs[name].astype(int)).max())
                    for name in mine.files
                    if name in theirs.files
                }
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    pictures.cleanup()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pipeline-memory.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
