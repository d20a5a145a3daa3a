"""The ``optimum-iobinding`` command: ``generate`` an image, ``export`` a pipeline to ONNX."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

SCHEDULERS = {
    "pndm": "PNDMScheduler",
    "ddim": "DDIMScheduler",
    "euler": "EulerDiscreteScheduler",
    "euler-ancestral": "EulerAncestralDiscreteScheduler",
    "dpm++": "DPMSolverMultistepScheduler",
    "lms": "LMSDiscreteScheduler",
    "unipc": "UniPCMultistepScheduler",
}


def default_cache_dir() -> Path:
    """Where the tiny offline model is built: $OPTIMUM_IOBINDING_CACHE, else the XDG cache folder."""
    if os.environ.get("OPTIMUM_IOBINDING_CACHE"):
        return Path(os.environ["OPTIMUM_IOBINDING_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "optimum-iobinding"


def tiny_model_folder(cache_dir: Optional[Path] = None, progress: bool = True) -> Path:
    """The tiny random-weights ONNX pipeline, built once into the cache folder (atomically: a half-built folder is
    never mistaken for a finished one)."""
    from .export import export_pipeline

    folder = (cache_dir or default_cache_dir()) / "tiny-random-sd"
    if (folder / "model_index.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".tiny-", dir=folder.parent))
    try:
        export_pipeline(None, scratch, tiny_random=True, progress=progress)
        if not (folder / "model_index.json").is_file():
            shutil.rmtree(folder, ignore_errors=True)
            scratch.rename(folder)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return folder


def default_provider() -> str:
    import onnxruntime as ort

    return "CUDAExecutionProvider" if "CUDAExecutionProvider" in ort.get_available_providers() else "CPUExecutionProvider"


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?",
                        help="diffusers Stable Diffusion / SDXL / LCM folder or hub id (omit with --tiny-random)")
    parser.add_argument("--output", "-o", required=True, help="folder to write the ONNX pipeline to")
    parser.add_argument("--fp16", action="store_true", help="convert to float16 with ORT's converter after export")
    parser.add_argument("--opset", type=int, default=17, help="ONNX opset (default 17)")
    parser.add_argument("--tiny-random", nargs="?", const="sd", default=None, choices=("sd", "xl", "lcm"),
                        help="export a tiny random-weights pipeline built offline: sd (default), xl or lcm")
    parser.add_argument("--optimize", choices=("cuda", "cpu"), default=None,
                        help="run ORT's transformer optimizer with the fusions this execution provider runs")


def run_export(args: argparse.Namespace) -> int:
    from .export import export_pipeline

    if not args.tiny_random and not args.model:
        print("export: give a model folder or hub id, or --tiny-random", file=sys.stderr)
        return 2
    start = time.perf_counter()
    folder = export_pipeline(args.model, args.output, fp16=args.fp16, opset=args.opset, optimize=args.optimize,
                             tiny_random=args.tiny_random or False)
    print(f"exported {f'the tiny random {args.tiny_random} pipeline' if args.tiny_random else args.model} to {folder} "
          f"({'fp16' if args.fp16 else 'fp32'}, opset {args.opset}) in {time.perf_counter() - start:.1f} s")
    return 0


def run_generate(args: argparse.Namespace) -> int:
    import numpy as np

    from .pipelines import OnnxStableDiffusionPipeline

    model = Path(args.model) if args.model and Path(args.model).exists() else args.model
    if model is None:
        model = tiny_model_folder(Path(args.cache_dir) if args.cache_dir else None)
    provider = args.provider or default_provider()
    load_start = time.perf_counter()
    pipe = OnnxStableDiffusionPipeline.from_pretrained(model, provider=provider, io_binding=args.io_binding)
    if args.scheduler:
        import diffusers

        scheduler_class = getattr(diffusers, SCHEDULERS[args.scheduler])
        pipe.scheduler = scheduler_class.from_config(pipe.scheduler.config)
    load_seconds = time.perf_counter() - load_start
    step_times: List[float] = []

    def record_step(pipeline, step, timestep, tensors):
        step_times.append(time.perf_counter())
        return tensors

    start = time.perf_counter()
    image = pipe(
        args.prompt, negative_prompt=args.negative_prompt, num_inference_steps=args.steps,
        guidance_scale=args.guidance, height=args.height, width=args.width,
        generator=np.random.RandomState(args.seed), callback_on_step_end=record_step,
    ).images[0]
    seconds = time.perf_counter() - start
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    image.save(out)
    loop = step_times[-1] - step_times[0] if len(step_times) > 1 else 0.0
    per_step = loop / (len(step_times) - 1) * 1000 if len(step_times) > 1 else float("nan")
    print(f"{out}: {args.width}×{args.height}, {args.steps} steps in {seconds:.2f} s ({per_step:.1f} ms/step; "
          f"load {load_seconds:.1f} s; {provider}, io_binding={args.io_binding}; model {model})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="optimum-iobinding", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate an image (offline with the tiny model by default)")
    generate.add_argument("prompt", nargs="?", default="a photo of an astronaut riding a horse")
    generate.add_argument("--negative-prompt", default=None)
    generate.add_argument("--steps", type=int, default=20, help="denoising steps (default 20)")
    generate.add_argument("--guidance", type=float, default=7.5, help="guidance scale (default 7.5)")
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--height", type=int, default=512)
    generate.add_argument("--width", type=int, default=512)
    generate.add_argument("--scheduler", choices=sorted(SCHEDULERS), default=None,
                          help="replace the model's scheduler")
    generate.add_argument("--provider", default=None, help="ORT execution provider (default: CUDA if available)")
    generate.add_argument("--io-binding", action=argparse.BooleanOptionalAction, default=True,
                          help="bind torch tensors on the device (default) or run diffusers' numpy loop")
    generate.add_argument("--model", default=None,
                          help="ONNX pipeline folder or hub id (default: a tiny random model built offline)")
    generate.add_argument("--cache-dir", default=None, help="where the tiny model is built (default ~/.cache)")
    generate.add_argument("--out", default="image.png", help="PNG to write (default image.png)")
    generate.set_defaults(run=run_generate)

    commands.add_parser("bench", help="benchmark every peer on the GPU (optimum-iobinding bench --help)")
    export = commands.add_parser("export", help="export a diffusers pipeline to the ONNX layout")
    add_export_arguments(export)
    export.set_defaults(run=run_export)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # its own parser: many options, and one peer per process behind it
        from .bench import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
