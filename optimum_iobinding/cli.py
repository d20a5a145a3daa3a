"""The ``optimum-iobinding`` command: ``generate`` an image, ``export`` a pipeline to ONNX, ``serve`` it over HTTP,
``loadtest`` a running service, ``bench`` every peer on the GPU."""

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


def tiny_model_folder(cache_dir: Optional[Path] = None, progress: bool = True, kind: str = "sd") -> Path:
    """The tiny random-weights ONNX pipeline (``kind``: one of ``export.tiny.TINY_RANDOM_KINDS``), built once into the
    cache folder (atomically: a half-built folder is never mistaken for a finished one)."""
    from .export import export_pipeline

    folder = (cache_dir or default_cache_dir()) / f"tiny-random-{kind}"
    if (folder / "model_index.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".tiny-", dir=folder.parent))
    try:
        export_pipeline(None, scratch, tiny_random=kind, progress=progress)
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
    parser.add_argument("--tiny-random", nargs="?", const="sd", default=None, choices=("sd", "xl", "lcm", "controlnet"),
                        help="export a tiny random-weights pipeline built offline: sd (default), xl, lcm or controlnet "
                             "(SD with a tiny random ControlNet)")
    parser.add_argument("--optimize", choices=("cuda", "cpu"), default=None,
                        help="run ORT's transformer optimizer with the fusions this execution provider runs")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a non-empty --output folder (whole: nothing of it stays)")
    parser.add_argument("--vae", default=None,
                        help="export this VAE (folder or hub id) instead of the pipeline's, e.g. SDXL's float16-safe "
                             "madebyollin/sdxl-vae-fp16-fix")
    parser.add_argument("--controlnet", action="append", default=None, metavar="ID_OR_FOLDER",
                        help="export with this ControlNet (folder or hub id, e.g. lllyasviel/sd-controlnet-canny); "
                             "repeat for multi-ControlNet. Load the result with OnnxStableDiffusionControlNetPipeline")


def run_export(args: argparse.Namespace) -> int:
    from .export import export_pipeline
    from .layout import check_output_folder, looks_like_hub_id

    if not args.tiny_random and not args.model:
        raise UsageError("export: give a model folder or hub id, or --tiny-random")
    if args.model and not args.tiny_random and not Path(args.model).exists() and not looks_like_hub_id(args.model):
        raise UsageError(f"model: expected an existing local folder or a hub repository id, got {args.model!r}: no "
                         "such file or folder")
    for controlnet in args.controlnet or ():
        if not Path(controlnet).exists() and not looks_like_hub_id(controlnet):
            raise UsageError(f"--controlnet: expected an existing local folder or a hub repository id, got "
                             f"{controlnet!r}: no such file or folder")
    source = Path(args.model) if args.model and not args.tiny_random and Path(args.model).exists() else None
    check_output_folder(args.output, source, args.overwrite, argument="--output")  # before the minutes of export
    start = time.perf_counter()
    folder = export_pipeline(args.model, args.output, fp16=args.fp16, opset=args.opset, optimize=args.optimize,
                             tiny_random=args.tiny_random or False, overwrite=args.overwrite, vae=args.vae,
                             controlnet=args.controlnet)
    print(f"exported {f'the tiny random {args.tiny_random} pipeline' if args.tiny_random else args.model} to {folder} "
          f"({'fp16' if args.fp16 else 'fp32'}, opset {args.opset}) in {time.perf_counter() - start:.1f} s")
    return 0


class UsageError(Exception):
    """A mistake in the command line: reported in one line, exit status 2."""


def check_image_path(out: str) -> Path:
    """``--out`` is checked before any work: a file (not a folder) with an extension PIL can write, in a folder that
    exists or can be made, and that is writable."""
    from PIL import Image

    path = Path(out).expanduser()
    if path.is_dir() or out.endswith(("/", os.sep)):
        raise UsageError(f"--out: expected an image file name, got the folder {out!r} (e.g. {os.path.join(out, 'image.png')!r})")
    writable = {ext for ext, fmt in Image.registered_extensions().items() if fmt in Image.SAVE}
    if path.suffix.lower() not in writable:
        shown = ", ".join(sorted(e for e in writable if e in {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tiff"}))
        raise UsageError(f"--out: expected a file name with an image extension PIL can write ({shown}, …), got {out!r}")
    parent = path.parent
    existing = next((p for p in [parent, *parent.parents] if p.exists()), None)
    if existing is not None and (not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK)):
        raise UsageError(f"--out: expected a writable folder for {out!r}, but {str(existing)!r} is "
                         f"{'not a folder' if not existing.is_dir() else 'not writable'}")
    return path


def run_generate(args: argparse.Namespace) -> int:
    import numpy as np

    from .layout import looks_like_hub_id
    from .pipelines import pipeline_class_for

    out = check_image_path(args.out)
    for name in ("steps", "height", "width"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name}: expected a positive integer, got {getattr(args, name)}")
    if args.model is not None and not Path(args.model).exists() and not looks_like_hub_id(args.model):
        raise UsageError(f"--model: expected an existing local folder or a hub repository id, got {args.model!r}: "
                         "no such file or folder")
    model = Path(args.model) if args.model and Path(args.model).exists() else args.model
    if model is None:
        model = tiny_model_folder(Path(args.cache_dir) if args.cache_dir else None)
    provider = args.provider or default_provider()
    load_start = time.perf_counter()
    pipeline_class = pipeline_class_for(model) if isinstance(model, Path) else None
    if pipeline_class is None:
        from .pipelines import OnnxStableDiffusionPipeline as pipeline_class
    pipe = pipeline_class.from_pretrained(model, provider=provider, io_binding=args.io_binding)
    if args.scheduler:
        import diffusers

        scheduler_class = getattr(diffusers, SCHEDULERS[args.scheduler])
        pipe.scheduler = scheduler_class.from_config(pipe.scheduler.config)
    load_seconds = time.perf_counter() - load_start
    step_times: List[float] = []

    def record_step(pipeline, step, timestep, tensors):
        step_times.append(time.perf_counter())
        return tensors

    import inspect

    call = dict(num_inference_steps=args.steps, guidance_scale=args.guidance, height=args.height, width=args.width,
                generator=np.random.RandomState(args.seed), callback_on_step_end=record_step)
    accepted = inspect.signature(pipe.__call__).parameters
    if args.negative_prompt is not None:
        if "negative_prompt" not in accepted:
            raise UsageError(f"--negative-prompt: {type(pipe).__name__} takes no negative prompt (its guidance is an "
                             "embedding, with no unconditional batch)")
        call["negative_prompt"] = args.negative_prompt
    start = time.perf_counter()
    image = pipe(args.prompt, **call).images[0]
    seconds = time.perf_counter() - start
    out.parent.mkdir(parents=True, exist_ok=True)
    image.save(out)
    loop = step_times[-1] - step_times[0] if len(step_times) > 1 else 0.0
    per_step = loop / (len(step_times) - 1) * 1000 if len(step_times) > 1 else float("nan")
    print(f"{out}: {args.width}×{args.height}, {args.steps} steps in {seconds:.2f} s ({per_step:.1f} ms/step; "
          f"load {load_seconds:.1f} s; {type(pipe).__name__}, {provider}, io_binding={args.io_binding}; "
          f"model {model})")
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from .layout import looks_like_hub_id

    if args.model is not None and not Path(args.model).exists() and not looks_like_hub_id(args.model):
        raise UsageError(f"model: expected an existing local folder or a hub repository id, got {args.model!r}")
    try:
        from .serve import ServeConfig, run
    except ImportError as error:
        raise UsageError(str(error)) from None
    model = args.model if args.model is not None else str(tiny_model_folder(
        Path(args.cache_dir) if args.cache_dir else None))
    warmup = None
    if args.warmup_batch_sizes is not None:
        warmup = ServeConfig.from_args({"model": model, "warmup_batch_sizes": args.warmup_batch_sizes}
                                       ).warmup_batch_sizes
    config = ServeConfig(model=model, replicas=args.replicas, max_batch_size=args.max_batch_size,
                         batch_wait_timeout_s=args.batch_wait_ms / 1000.0, device=args.device, provider=args.provider,
                         steps=args.steps, guidance=args.guidance, warmup_batch_sizes=warmup,
                         max_queued_requests=args.max_queued_requests, png_compression=args.png_compression)
    if not 0 < args.port < 65536:
        raise UsageError(f"--port: expected 1–65535, got {args.port}")
    if Path(model).is_dir():  # before Ray starts: a folder that is no pipeline fails here, not in every replica
        from .pipelines import pipeline_class_for

        pipeline_class_for(model)
    print(f"optimum-iobinding: serving {model} on http://{args.host}:{args.port}/v1/images "
          f"({args.replicas} replica(s), batches of up to {args.max_batch_size}); Ctrl-C stops", flush=True)
    run(config, host=args.host, port=args.port)
    return 0


def run_loadtest_command(args: argparse.Namespace) -> int:
    from .serve.loadtest import main_from_args

    return main_from_args(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="optimum-iobinding", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
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

    serve_command = commands.add_parser(
        "serve", help="serve POST /v1/images with Ray Serve: a pipeline per replica, a GPU per replica",
        description="Runs the Ray Serve application of optimum_iobinding.serve on a local Ray cluster, or joins "
                    "RAY_ADDRESS. Needs the serve extra: pip install 'optimum-iobinding[serve]'.")
    serve_command.add_argument("model", nargs="?", default=None,
                               help="ONNX pipeline folder or hub id (default: the tiny random model built offline)")
    serve_command.add_argument("--replicas", type=int, default=1, help="generator replicas, a GPU each (default 1)")
    serve_command.add_argument("--max-batch-size", type=int, default=4, help="images per pipeline call (default 4)")
    serve_command.add_argument("--batch-wait-ms", type=float, default=0.0,
                               help="how long a replica waits for a batch to fill (default 0: batches form from the "
                                    "requests that queue while one runs)")
    serve_command.add_argument("--host", default="127.0.0.1")
    serve_command.add_argument("--port", type=int, default=8000)
    serve_command.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    serve_command.add_argument("--provider", default=None, help="ORT execution provider (default: by device)")
    serve_command.add_argument("--steps", type=int, default=30, help="default steps of a request (default 30)")
    serve_command.add_argument("--guidance", type=float, default=7.5, help="default guidance (default 7.5)")
    serve_command.add_argument("--warmup-batch-sizes", default=None,
                               help="batch sizes captured at start, e.g. 1,2,4 (default 1 … max batch size)")
    serve_command.add_argument("--max-queued-requests", type=int, default=256,
                               help="requests waiting before new ones get 503 (default 256)")
    serve_command.add_argument("--png-compression", type=int, default=0,
                               help="zlib level of the PNG answers: 0 (default) uncompressed, about 1 ms per 512² "
                                    "image; 1-9 about half the bytes for tens of ms")
    serve_command.add_argument("--cache-dir", default=None, help="where the tiny model is built (default ~/.cache)")
    serve_command.set_defaults(run=run_serve)

    loadtest = commands.add_parser(
        "loadtest", help="load-test a running /v1/images service: images/s, p50/p95/p99 latency",
        description="Closed-loop load test of POST /v1/images at each concurrency; prints a table and writes "
                    "loadtest.json/.md/.png with --out.")
    loadtest.add_argument("url", help="the service, e.g. http://127.0.0.1:8000")
    loadtest.add_argument("--concurrency", default="1,4,16", help="client threads, one level each (default 1,4,16)")
    loadtest.add_argument("--requests", type=int, default=32, help="counted requests per level (default 32)")
    loadtest.add_argument("--warmup", type=int, default=-1,
                          help="uncounted requests first (default: one per client thread)")
    loadtest.add_argument("--prompt", default="a photo of an astronaut riding a horse")
    loadtest.add_argument("--seed", type=int, default=0, help="first seed; each request takes the next")
    loadtest.add_argument("--steps", type=int, default=None)
    loadtest.add_argument("--guidance", type=float, default=None)
    loadtest.add_argument("--size", default=None, help="512 or 768x512 (default: the service's)")
    loadtest.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")
    loadtest.add_argument("--out", default=None, help="folder for loadtest.json, .md and .png")
    loadtest.set_defaults(run=run_loadtest_command)

    commands.add_parser("bench", help="benchmark every peer on the GPU (optimum-iobinding bench --help)")
    export = commands.add_parser("export", help="export a diffusers pipeline to the ONNX layout")
    add_export_arguments(export)
    export.set_defaults(run=run_export)
    return parser


def quiet_libraries() -> None:
    """A command prints its own results and errors: the libraries' notices (transformers' "requires torchvision",
    diffusers' dtype notes while the tiny model is built) are for library users, so the command shows their errors
    only; this project's own warnings still show."""
    import logging

    logging.basicConfig(level=logging.WARNING, format="optimum-iobinding: %(levelname)s: %(message)s")
    for name in ("transformers", "diffusers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import diffusers.utils.logging as diffusers_logging
        import transformers.utils.logging as transformers_logging

        diffusers_logging.set_verbosity_error()
        transformers_logging.set_verbosity_error()
    except ImportError:  # pragma: no cover — both are requirements
        pass


# Errors about what the user passed (a file, a size, a setting): exit status 2, as argparse's own usage errors.
USAGE_ERRORS = (UsageError, ValueError, TypeError, FileNotFoundError, FileExistsError, NotADirectoryError)


def main(argv: Optional[List[str]] = None) -> int:
    """Runs a command. Errors are one line, ``optimum-iobinding: error: <message>``: exit status 2 for a mistake in
    what was asked (arguments, files, sizes), 1 for a failure while doing it; ``--debug`` shows the traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    if argv[:1] == ["bench"]:  # its own parser: many options, and one peer per process behind it
        from .bench.cli import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    quiet_libraries()
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print("optimum-iobinding: interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # noqa: BLE001 — every error becomes one line (or a traceback with --debug)
        if debug:
            raise
        print(f"optimum-iobinding: error: {error}", file=sys.stderr)
        return 2 if isinstance(error, USAGE_ERRORS) else 1


if __name__ == "__main__":
    sys.exit(main())
