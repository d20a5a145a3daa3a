"""The ``optimum-iobinding`` command: ``generate`` an image, ``stream`` a video through a few-step model, ``export`` a
pipeline to ONNX, ``serve`` it over HTTP, ``loadtest`` a running service, ``bench`` every peer on the GPU."""

from __future__ import annotations

import argparse
import contextlib
import inspect
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

# the standard library only: every heavy module is imported by the command using it
from .errors import DEBUG_HELP, ArgumentError, CommandLineParser, RawDescriptionHelpFormatter, quiet_libraries
from .families import (
    Family,
    controlnet_family,
    family,
    family_of_class,
    image_role,
    image_route,
    pipeline_class,
    tiny_random_kinds,
    WAN_TRANSFORMERS,
)
from .layout import unwritable_reason

if TYPE_CHECKING:
    from .serve.config import ServeConfig

DEFAULT_PROMPT = "a photo of an astronaut riding a horse"  # generate's, without one
SCHEDULERS = {
    "pndm": "PNDMScheduler",
    "ddim": "DDIMScheduler",
    "euler": "EulerDiscreteScheduler",
    "euler-ancestral": "EulerAncestralDiscreteScheduler",
    "dpm++": "DPMSolverMultistepScheduler",
    "lms": "LMSDiscreteScheduler",
    "unipc": "UniPCMultistepScheduler",
}
# the modules a scheduler needs beyond diffusers' own requirements (diffusers defines the class only with them);
# setup.cfg installs them, and `generate` checks them before it loads anything
SCHEDULER_MODULES = {"lms": ("scipy",)}


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

    return (
        "CUDAExecutionProvider" if "CUDAExecutionProvider" in ort.get_available_providers() else "CPUExecutionProvider"
    )


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        help="diffusers pipeline folder or hub id: Stable Diffusion 1.x/2.x, SDXL, LCM, SD3, FLUX.1 or Wan (omit "
        "with --tiny-random, or with --tiny-vae for a folder of the tiny VAE alone)",
    )
    parser.add_argument("--output", "-o", required=True, help="folder to write the ONNX pipeline to")
    parser.add_argument(
        "--dtype",
        choices=("fp32", "fp16", "bf16"),
        default=None,
        help="precision: fp32 (default); fp16 (exported fp32, then ORT's float16 converter; SD3's and "
        "FLUX.1's T5 stays fp32); bf16 (SD3/SD3.5 and FLUX.1 only: the transformer bfloat16, "
        "CLIP and the VAE fp16, T5 fp32). bf16 models run on CUDA only: ORT's CPU provider has "
        "no bfloat16 MatMul or Add",
    )
    parser.add_argument("--fp16", action="store_true", help="alias of --dtype fp16")
    parser.add_argument(
        "--vae-dtype",
        choices=("fp32", "fp16"),
        default=None,
        help="Wan only: its VAE's precision, fp32 (default, as diffusers runs it) or fp16 (about half the decode's "
        "memory and time; overflow-safe norms)",
    )
    parser.add_argument("--opset", type=int, default=17, help="ONNX opset, 14 … 20 (default 17)")
    parser.add_argument(
        "--step-cache",
        action="store_true",
        help="also write the denoiser's step-cache parts beside it, reading its weights: the "
        "transformer's First-Block Cache head, body and out (SD3, FLUX.1, Wan); the UNet's DeepCache "
        "full and shallow graphs (SD 1.x/2.x, SDXL, LCM; not with a ControlNet)",
    )
    parser.add_argument(
        "--cold-start-parts",
        type=int,
        default=0,
        metavar="N",
        help="also write the UNet cut into N parts (2 or more) beside it, reading its weights: a pipeline runs them "
        "in turn and makes their sessions and first runs side by side (default 0: none; UNet pipelines only)",
    )
    parser.add_argument(
        "--tiny-random",
        nargs="?",
        const="sd",
        default=None,
        choices=tiny_random_kinds(),
        help="export a tiny random-weights pipeline built offline: sd (default), xl, lcm, controlnet "
        "(SD with a tiny random ControlNet), xl-controlnet, sd3 (Stable Diffusion 3), flux or flux-dev "
        "(FLUX.1 schnell's and dev's shapes), flux-kontext, flux-fill, flux-control, flux-controlnet, wan and "
        "wan2.2 (Wan 2.1 and 2.2 text to video), wan-i2v and wan2.2-i2v (image to video)",
    )
    parser.add_argument(
        "--optimize",
        choices=("cuda", "cpu"),
        default=None,
        help="run ORT's transformer optimizer with the fusions this execution provider runs (default: none, the "
        "graphs as torch exported them)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace a non-empty --output folder (whole: nothing of it stays)"
    )
    parser.add_argument(
        "--vae",
        default=None,
        metavar="FOLDER_OR_HUB_ID",
        help="export this VAE (folder or hub id) instead of the pipeline's, e.g. SDXL's float16-safe "
        "madebyollin/sdxl-vae-fp16-fix",
    )
    parser.add_argument(
        "--controlnet",
        action="append",
        default=None,
        metavar="ID_OR_FOLDER",
        help="export with this ControlNet (folder or hub id, e.g. lllyasviel/sd-controlnet-canny; an SDXL or "
        "FLUX.1 one for those models); repeat for multi-ControlNet. Load the result with "
        f"{family('controlnet').class_name} ({family('sdxl-controlnet').class_name}, "
        f"{family('flux-controlnet').class_name})",
    )
    parser.add_argument(
        "--ip-adapter",
        action="store_true",
        help="SD 1.x/2.x and SDXL: a UNet that takes IP-Adapter's image prompt, so that any IP-Adapter of the model loads at "
        "run time (pipe.load_ip_adapter, diffusers' arguments; generate and stream --ip-adapter)",
    )
    parser.add_argument(
        "--image-encoder",
        default=None,
        metavar="ID_OR_FOLDER",
        help="with --ip-adapter: the IP-Adapter's image encoder to export (a CLIPVisionModelWithProjection folder or "
        "hub id, e.g. the image_encoder folder of h94/IP-Adapter's models); without one the pipelines take image "
        "embeddings only",
    )
    parser.add_argument(
        "--tiny-vae",
        nargs="?",
        const=True,
        default=None,
        metavar="ID_OR_FOLDER",
        help="export the VAE from this diffusers AutoencoderTiny (TAESD; folder or hub id, e.g. "
        "madebyollin/taesd, or madebyollin/taesdxl for SDXL) instead of the pipeline's; without "
        "a value a tiny random one built offline (with --tiny-random, or alone). Without a model "
        "and --tiny-random: a folder of the tiny VAE alone (vae_encoder/, vae_decoder/)",
    )


def run_export(args: argparse.Namespace) -> int:
    from .layout import check_output_folder

    vae_only = args.tiny_vae is not None and not args.tiny_random and not args.model
    if not args.tiny_random and not args.model and not vae_only:
        raise UsageError(
            "export: give a model folder or hub id, or --tiny-random (or --tiny-vae alone for a folder "
            "of the tiny VAE only)"
        )
    if args.tiny_random and args.model:
        raise UsageError(
            f"model: expected a model folder or hub id, or --tiny-random, got both ({args.model!r} and "
            f"--tiny-random {args.tiny_random})"
        )
    if args.image_encoder is not None and not args.ip_adapter:
        raise UsageError(
            "--image-encoder: expected it with --ip-adapter (the IP-Adapter's image encoder), got it alone"
        )
    if args.ip_adapter and args.step_cache:
        raise UsageError("--ip-adapter: expected it without --step-cache (DeepCache's parts take no image prompt)")
    from .layout import MAX_OPSET, MIN_OPSET

    check(
        MIN_OPSET <= args.opset <= MAX_OPSET,
        "--opset",
        f"an integer in {MIN_OPSET} … {MAX_OPSET} (17 is tested)",
        args.opset,
    )
    if args.fp16 and args.dtype not in (None, "fp16"):
        raise UsageError(
            f"--fp16 and --dtype: expected one precision, got --fp16 (an alias of --dtype fp16) and "
            f"--dtype {args.dtype}; give --dtype alone"
        )
    dtype = args.dtype or ("fp16" if args.fp16 else "fp32")
    if args.tiny_vae is True and args.model:
        raise UsageError(
            f"--tiny-vae: expected an AutoencoderTiny's folder or hub id for {args.model!r} (e.g. "
            "madebyollin/taesd, or madebyollin/taesdxl for SDXL), got no value, which means a tiny "
            "random one: for --tiny-random, or alone"
        )
    tiny_vae = args.tiny_vae if isinstance(args.tiny_vae, str) else None  # a name, not the random one
    sources = [
        ("model", args.model, "model_index.json"),
        ("--vae", args.vae, "config.json"),
        *(("--controlnet", controlnet, "config.json") for controlnet in args.controlnet or ()),
        ("--tiny-vae", tiny_vae, "config.json"),
        ("--image-encoder", args.image_encoder, "config.json"),
    ]
    for option, name, _ in sources:
        check_local_or_hub(option, name)
    source = Path(args.model) if args.model and Path(args.model).exists() else None
    exported = sorted(path.parent.name for path in source.glob("*/model.onnx")) if source and source.is_dir() else []
    torch_weights = source is not None and any(
        next(source.glob(f"*/{stem}*.{suffix}"), None) is not None
        for stem in ("diffusion_pytorch_model", "model", "pytorch_model")
        for suffix in ("safetensors", "bin")
    )
    if exported and not torch_weights:  # some hub folders hold ONNX files beside the torch weights: those export
        raise UsageError(
            f"model: expected a diffusers pipeline to export (its torch weights), got {args.model!r}, an ONNX folder "
            f"already ({', '.join(f'{name}/model.onnx' for name in exported)}): run it with generate --model"
        )
    check_output_folder(
        args.output,
        source,
        args.overwrite,
        argument="--output",  # before the minutes of export
        overwrite_argument="--overwrite",
    )
    check_output_keeps(
        args.output,
        "--output",
        [
            ("--vae", args.vae),
            ("--tiny-vae", tiny_vae),
            ("--image-encoder", args.image_encoder),
            *(("--controlnet", controlnet) for controlnet in args.controlnet or ()),
        ],
    )
    quiet_libraries()
    from .export import export_pipeline
    from .export.export import (
        check_dtype_fits,
        check_tiny_vae_arguments,
        check_transformer_options,
        exported_transformer_family,
    )

    with options_named(EXPORT_OPTIONS):
        check_tiny_vae_arguments(
            args.tiny_vae,
            vae_only=vae_only,
            random_pipeline=bool(args.tiny_random),
            vae=args.vae,
            controlnet=args.controlnet,
        )
    for option, name, config in sources:  # a hub id that cannot be fetched fails now, not after minutes of export
        if name is not None and not Path(name).exists():
            fetch_from_hub(option, name, config)
        if option == "model":  # what an SD3 or Flux pipeline cannot take, refused before the rest is fetched
            record = exported_transformer_family(args.model, tiny_random=args.tiny_random or False)
            check_transformer_export_options(record, args)
            with options_named(EXPORT_OPTIONS):
                check_transformer_options(record, vae=args.vae, controlnet=args.controlnet, tiny_vae=args.tiny_vae)
                check_dtype_fits(
                    dtype,
                    args.model,
                    tiny_random=args.tiny_random or False,
                    vae_only=vae_only,
                    controlnet=args.controlnet,
                )
    if tiny_vae is not None:
        check_tiny_vae_folder(tiny_vae, args.model)
    check_component_folder("--vae", args.vae, "AutoencoderKL", "a VAE (diffusers' AutoencoderKL)")
    for controlnet in args.controlnet or ():
        check_component_folder("--controlnet", controlnet, "ControlNet", "a ControlNet (diffusers' ControlNetModel)")
    check_component_folder(
        "--image-encoder",
        args.image_encoder,
        "CLIPVision",
        "an image encoder (transformers' CLIPVisionModelWithProjection)",
    )
    start = time.perf_counter()
    nets = {f"controlnet[{k}]": f"--controlnet {name}" for k, name in enumerate(args.controlnet or ())}
    with options_named({**EXPORT_OPTIONS, **nets}):  # the exporter's own checks (the weights it loads)
        folder = export_pipeline(
            args.model,
            args.output,
            dtype=dtype,
            opset=args.opset,
            optimize=args.optimize,
            tiny_random=args.tiny_random or False,
            overwrite=args.overwrite,
            vae=args.vae,
            controlnet=args.controlnet,
            tiny_vae=args.tiny_vae,
            step_cache=args.step_cache,
            vae_dtype=args.vae_dtype,
            ip_adapter=args.ip_adapter,
            image_encoder=args.image_encoder,
            cold_start_parts=args.cold_start_parts,
        )
    if vae_only:
        what = f"the tiny VAE {tiny_vae}" if tiny_vae else "a tiny random tiny VAE"
    else:
        what = f"the tiny random {args.tiny_random} pipeline" if args.tiny_random else args.model
        if args.tiny_vae is not None:
            what += f" with the tiny VAE {tiny_vae}" if tiny_vae else " with a tiny random tiny VAE"
    print(f"exported {what} to {folder} ({dtype}, opset {args.opset}) in {time.perf_counter() - start:.1f} s")
    return 0


# what the exporter's checks call the options of `export`
EXPORT_OPTIONS = {
    "tiny_vae": "--tiny-vae",
    "vae and tiny_vae": "--vae and --tiny-vae",
    "controlnet": "--controlnet",
    "vae": "--vae",
    "step_cache": "--step-cache",
    "dtype": "--dtype",
    "vae_dtype": "--vae-dtype",
    "ip_adapter": "--ip-adapter",
    "image_encoder": "--image-encoder",
    "cold_start_parts": "--cold-start-parts",
}


def check_transformer_export_options(record: Optional[Family], args: argparse.Namespace) -> None:
    """A diffusion transformer's export (the family ``record``; ``None``: a UNet's) writes its own VAE, and no
    ControlNet but FLUX.1's: ``--vae``, ``--tiny-vae`` and (where no family adds ControlNets to its pipelines)
    ``--controlnet`` are refused, in the command line's words."""
    if record is None:
        return
    controlnet = args.controlnet if controlnet_family(record) is None else None
    for option, value in (("--vae", args.vae), ("--controlnet", controlnet), ("--tiny-vae", args.tiny_vae)):
        if value is None:
            continue
        shown = (
            "--tiny-vae without a value (a tiny random one)"
            if value is True
            else repr(value[0] if isinstance(value, list) and len(value) == 1 else value)
        )
        raise UsageError(
            f"{option}: expected none for a {record.title} pipeline (its export writes its own VAE and no "
            f"ControlNet), got {shown}"
        )


# what a folder given for one option is instead, by the class its config.json names: the option it belongs to
OTHER_FOLDER_OPTIONS = {"AutoencoderTiny": "--tiny-vae", "ControlNet": "--controlnet", "AutoencoderKL": "--vae"}


def check_component_folder(option: str, name: Optional[str], kind: str, expected: str) -> None:
    """A local folder given for a component (``--vae``, ``--controlnet``, ``--image-encoder``) holds that kind of
    torch model: its config.json names a class with ``kind`` in it (diffusers' ``_class_name``, transformers'
    ``architectures``). A file, an ONNX export or another model is refused naming the option, before any work;
    a hub id is read by the export."""
    from .layout import read_json_object

    if name is None or not Path(name).expanduser().exists():
        return
    folder = Path(name).expanduser()
    if not folder.is_dir():
        raise UsageError(f"{option}: expected a folder or hub id of {expected}, got the file {name!r}")
    if (folder / "model.onnx").is_file():
        raise UsageError(f"{option}: expected the torch weights of {expected} to export, got {name!r}, an ONNX export")
    try:
        config = read_json_object(folder / "config.json")
    except ValueError as error:
        raise UsageError(f"{option}: expected {expected}, got {name!r}, whose config.json does not parse") from error
    if config is None:
        raise UsageError(f"{option}: expected a folder of {expected} holding config.json, got {name!r}, which has none")
    found = config.get("_class_name") or next(iter(config.get("architectures") or ()), None)
    if found is None or kind not in str(found):
        other = next((flag for key, flag in OTHER_FOLDER_OPTIONS.items() if key in str(found) and flag != option), None)
        hint = f"; {found} goes in {other}" if other else ""
        raise UsageError(
            f"{option}: expected {expected}, got {name!r}, whose config.json names {found or 'no class'}{hint}"
        )


def check_tiny_vae_folder(tiny_vae: str, model: Optional[str]) -> None:
    """--tiny-vae's config.json (a local folder's, or fetched from the Hub) is an AutoencoderTiny's, and its latent
    channels are those of the model's UNet (its unet/config.json; one file more from the Hub): before any weights
    load."""
    from .export.export import check_tiny_vae_config, check_tiny_vae_fits
    from .layout import download_from_hub, read_json_object

    def config_of(name: str, file: str, option: str) -> Optional[dict]:
        folder = Path(name) if Path(name).exists() else download_from_hub(name, [file], option)
        return read_json_object(folder / file)

    config = config_of(tiny_vae, "config.json", "--tiny-vae")
    if config is None:
        raise UsageError(
            f"--tiny-vae: expected a folder holding an AutoencoderTiny's config.json, got {tiny_vae!r}, which has none"
        )
    with options_named(EXPORT_OPTIONS):
        check_tiny_vae_config(config, tiny_vae, vae_argument="--vae")
        unet = config_of(model, "unet/config.json", "model") if model else None
        if unet is not None:
            check_tiny_vae_fits(config, unet)


class UsageError(Exception):
    """A mistake in the command line: reported in one line, exit status 2."""


# ------------------------------------------------------------------------------------------- argument checks
# Every command checks its arguments first, before anything is loaded, built or downloaded, and names the option.

NUMPY_SEEDS = range(2**32)  # what np.random.RandomState takes, the generator of `generate`


def check(ok: bool, option: str, expected: str, value: object) -> None:
    """``option: expected X, got Y`` unless ``ok``."""
    if not ok:
        raise UsageError(f"{option}: expected {expected}, got {value!r}")


def check_local_or_hub(option: str, name: Optional[str]) -> None:
    """``name`` (where given) is an existing path or could be a hub repository id."""
    from .layout import looks_like_hub_id

    if name is not None and not Path(name).exists() and not looks_like_hub_id(name):
        raise UsageError(
            f"{option}: expected an existing local folder or a hub repository id, got {name!r}: no such file or folder"
        )


def check_not_a_file(option: str, name: Optional[str]) -> None:
    """``name`` (where given) is no file: a pipeline is a folder (or a hub id)."""
    if name is not None and Path(name).expanduser().is_file():
        raise UsageError(f"{option}: expected an ONNX pipeline folder or a hub id, got the file {name!r}")


def fetch_from_hub(option: str, name: str, first_file: str) -> None:
    """Fetches one small file of the hub repository ``name`` (into the Hub's cache, where the loading that follows
    finds it), so that a repository that cannot be had fails here, in one line naming ``option``."""
    from .layout import download_from_hub

    download_from_hub(name, [first_file], option)


@contextmanager
def options_named(names: Mapping[str, str]) -> Iterator[None]:
    """A library refuses an argument by its parameter's name (an :class:`~optimum_iobinding.errors.ArgumentError`
    whose ``argument`` is ``provider``, ``pretrained_model_name_or_path`` …); inside this block a refusal of a
    parameter in ``names`` names the command line's option instead (``--provider: …``), keeping the reason. Every
    other error passes through as it is."""
    try:
        yield
    except ArgumentError as error:
        option = names.get(error.argument)
        if option is None:
            raise
        raise UsageError(f"{option}: {error.reason}") from error


def check_image_path(out: str) -> Path:
    """``--out`` is checked before any work: a file (not a folder) with an extension PIL can write, in a folder that
    exists or can be made, and that is writable."""
    from PIL import Image

    path = Path(out).expanduser()
    if path.is_dir() or out.endswith(("/", os.sep)):
        raise UsageError(
            f"--out: expected an image file name, got the folder {out!r} (e.g. {os.path.join(out, 'image.png')!r})"
        )
    writable = {ext for ext, fmt in Image.registered_extensions().items() if fmt in Image.SAVE}
    if path.suffix.lower() not in writable:
        shown = ", ".join(sorted(e for e in writable if e in {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tiff"}))
        raise UsageError(f"--out: expected a file name with an image extension PIL can write ({shown}, …), got {out!r}")
    if path.exists() and not path.is_file():
        raise UsageError(f"--out: expected an image file name, got {out!r}, which is neither a file nor a folder")
    problem = unwritable_reason(path.parent) or (unwritable_file_reason(path) if path.exists() else None)
    if problem is not None:
        raise UsageError(f"--out: expected a writable folder for {out!r}, but {problem}")
    return path


def unwritable_file_reason(path: Path) -> Optional[str]:
    """Why the existing file ``path`` cannot be replaced, or ``None`` (opened for appending, nothing written)."""
    try:
        with open(path, "ab"):
            pass
    except OSError as error:
        return f"{str(path)!r} cannot be written ({error.strerror or error})"
    return None


def check_cache_dir(cache_dir: Optional[str]) -> None:
    """``--cache-dir`` (or the default cache folder) can take the tiny model where it is not built there yet: checked
    before any work, where a folder that cannot be written would fail after the export's first seconds."""
    folder = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    if (folder / "tiny-random-sd" / "model_index.json").is_file():
        return  # built: only read
    problem = unwritable_reason(folder)
    if problem is not None:
        given = f"{cache_dir!r}" if cache_dir else f"the default {str(folder)!r}"
        raise UsageError(
            f"--cache-dir: expected a folder where the tiny model can be built, got {given}, but {problem}; pass "
            "--model, or a writable --cache-dir"
        )


# what the pipelines' own checks call the options of `generate`
GENERATE_OPTIONS = {
    "num_inference_steps": "--steps",
    "num_frames": "--frames",
    "guidance_scale": "--guidance",
    "height": "--height",
    "width": "--width",
    "height and width": "--height and --width",
    "negative_prompt": "--negative-prompt",
    "provider": "--provider",
    "control_mode": "--control-mode",
    "ip_adapter_image": "--ip-adapter-image",
}
# the components a pipeline folder holds: a refusal of one (its model.onnx, its inputs, its config) is the model's
MODEL_COMPONENTS = (
    "text_encoder",
    "text_encoder_2",
    "text_encoder_3",
    "tokenizer",
    "tokenizer_2",
    "tokenizer_3",
    "unet",
    "transformer",
    "controlnet",
    "vae_encoder",
    "vae_decoder",
    "scheduler",
)
VAE_COMPONENTS = ("vae_encoder", "vae_decoder")


def model_option_names(option: str, vae_option: Optional[str] = None) -> Dict[str, str]:
    """What loading and the runtime call the model (the folder or hub id, a file of it ``path``, a component by its
    folder's name), named as the command line's ``option`` names the model (``--model``), a component's folder
    beside it: ``--model (unet/): expected inputs …``. ``vae_option``: where the VAE comes from elsewhere
    (``--tiny-vae``)."""
    names = {"pretrained_model_name_or_path": option, "model": option}
    names["path"] = option if vae_option is None else f"{option} or {vae_option}"  # the file says which
    for component in MODEL_COMPONENTS:
        source = vae_option if vae_option is not None and component in VAE_COMPONENTS else option
        names[component] = f"{source} ({component}/)"
    return names


# what loading calls the model of `generate` (layout's hub download, the folder checks, its components' refusals)
MODEL_OPTION = model_option_names("--model")
# the tiny model built into the cache folder: a refusal of one of its files is the cache's
TINY_MODEL_OPTION = model_option_names("--cache-dir")


def check_generate_arguments(args: argparse.Namespace) -> Optional[Path]:
    """Every check that needs no model; returns the image path (``None``: a video's, checked once the folder's family
    says it makes videos). What depends on the model (sizes the UNet can run, at most the scheduler's steps) the
    pipeline checks before its first step."""
    # a video or a folder of frames, where the folder (--model: the tiny default makes images) is of a video family:
    # checked once the folder's family is known
    video = args.model is not None and args.out is not None and (is_video_path(args.out) or not Path(args.out).suffix)
    out = None if video else check_image_path(args.out or DEFAULT_IMAGE_OUT)
    if args.frames is not None:
        check(args.frames > 0, "--frames", "a positive integer (4k + 1 for Wan: 81, 49, 33 …)", args.frames)
    check(math.isfinite(args.fps) and args.fps > 0, "--fps", "a positive number of frames per second", args.fps)
    if args.prompt_option is not None:
        if args.prompt is not None:
            raise UsageError(
                f"--prompt: expected the prompt once, got {args.prompt!r} and --prompt {args.prompt_option!r}"
            )
        args.prompt = args.prompt_option
    if args.prompt is None:
        args.prompt = DEFAULT_PROMPT
    for option in ("--steps", "--height", "--width"):
        value = getattr(args, option[2:])
        check(value is None or value > 0, option, "a positive integer", value)
    if args.strength is not None:
        check(0 < args.strength <= 1, "--strength", "a number in (0, 1]", args.strength)
    args.loras = [parse_lora_option(spec) for spec in args.lora]
    args.images = read_image_options(args)
    args.image_prompt = check_ip_adapter_arguments(args)
    if args.guidance is not None:
        check(math.isfinite(args.guidance), "--guidance", "a finite number", args.guidance)
    check(args.seed in NUMPY_SEEDS, "--seed", f"an integer in 0 … {NUMPY_SEEDS[-1]} (numpy's seeds)", args.seed)
    check_local_or_hub("--model", args.model)
    check_not_a_file("--model", args.model)
    if args.model is None:
        check_cache_dir(args.cache_dir)
    check_scheduler_modules(args.scheduler)
    if args.cache is not None:
        check_cache_spec(args.cache)
    if args.provider is not None:  # the last check: it imports the runtime (and onnxruntime) to ask
        from .runtime.providers import normalize_providers

        with options_named(GENERATE_OPTIONS):
            normalize_providers(args.provider, io_binding=args.io_binding)
    return out


# a step cache's refusal names --cache (the spec's, or the config's when a pipeline refuses it), a value the part of
# the spec that gave it
CACHE_OPTION = {
    "cache": "--cache",
    "config": "--cache",
    "cache_interval": "--cache deepcache:INTERVAL",
    "cache_branch_id": "--cache deepcache:INTERVAL:BRANCH",
}
# each step cache a family record names (Family.step_cache): the --cache form that asks for it, and what it is
CACHE_FORMS = {
    "deepcache": ("deepcache", "deepcache:INTERVAL[:BRANCH] (DeepCache: SD 1.x/2.x, SDXL, LCM)"),
    "first-block": ("fbc", "fbc:THRESHOLD (First-Block Cache: SD3, FLUX.1, Wan)"),
}


# the image options of `generate`: the role of their image (families.IMAGE_ROLES) and the mode it is read in
IMAGE_OPTIONS = {"--image": ("image", "RGB"), "--mask": ("mask", "L"), "--control-image": ("control_image", "RGB")}
ROLE_OPTIONS = {role: option for option, (role, _) in IMAGE_OPTIONS.items()}


def read_image_options(args: argparse.Namespace) -> Dict[str, Any]:
    """The images ``--image``, ``--mask`` and ``--control-image`` name, read (Pillow) before any model loads: option →
    image (RGB; a mask in grey, white where it repaints, as diffusers reads one). A missing or unreadable file is
    refused naming its option."""
    images = {}
    for option, (_, mode) in IMAGE_OPTIONS.items():
        path = getattr(args, option[2:].replace("-", "_"))
        if path is not None:
            images[option] = read_image_file(option, path, mode)
    if "--mask" in images and "--image" not in images:
        raise UsageError("--mask: expected it beside --image (the image it repaints), got a mask alone")
    if "--image" in images and "--mask" in images and images["--mask"].size != images["--image"].size:
        (mask_w, mask_h), (image_w, image_h) = images["--mask"].size, images["--image"].size
        raise UsageError(f"--mask: expected the size of --image, {image_w}x{image_h}, got {mask_w}x{mask_h}")
    return images


def read_image_file(option: str, path: str, mode: str) -> Any:
    """The image file ``path`` converted to ``mode``, or a refusal naming ``option``."""
    from PIL import Image, UnidentifiedImageError

    file = Path(path).expanduser()
    if not file.is_file():
        what = "a folder" if file.is_dir() else "no such file"
        raise UsageError(f"{option}: expected an image file (PNG, JPEG, …), got {path!r}: {what}")
    try:
        with Image.open(file) as image:
            return image.convert(mode)
    except (OSError, UnidentifiedImageError, Image.DecompressionBombError) as error:
        raise UsageError(
            f"{option}: expected an image file Pillow reads (PNG, JPEG, …), got {path!r}: {error}"
        ) from None


def add_ip_adapter_arguments(parser: argparse.ArgumentParser) -> None:
    """``--ip-adapter`` and its image, file and scale (``generate`` and ``stream``)."""
    group = parser.add_argument_group(
        "IP-Adapter (a model exported with --ip-adapter; the image prompt needs its image encoder too)"
    )
    group.add_argument(
        "--ip-adapter",
        default=None,
        metavar="ID_OR_FOLDER",
        help="the IP-Adapter's hub id or folder (e.g. h94/IP-Adapter), with --ip-adapter-weight and --ip-adapter-image",
    )
    group.add_argument(
        "--ip-adapter-weight",
        default=None,
        metavar="PATH",
        help="its weights file in that repo or folder, e.g. models/ip-adapter_sd15.safetensors",
    )
    group.add_argument("--ip-adapter-image", default=None, metavar="FILE", help="the image prompt")
    group.add_argument(
        "--ip-adapter-scale", type=float, default=None, help="how much the image prompt counts (default 1.0)"
    )


def check_ip_adapter_arguments(args: argparse.Namespace) -> Optional[Any]:
    """The IP-Adapter options, together or not at all, and the image prompt read: before any model loads."""
    given = {
        option: getattr(args, option[2:].replace("-", "_"))
        for option in ("--ip-adapter", "--ip-adapter-weight", "--ip-adapter-image")
    }
    if not any(value is not None for value in given.values()):
        if args.ip_adapter_scale is not None:
            raise UsageError("--ip-adapter-scale: expected it with --ip-adapter, got it alone")
        return None
    if args.ip_adapter_scale is None:
        args.ip_adapter_scale = 1.0
    missing = [option for option, value in given.items() if value is None]
    if missing:
        present = " and ".join(option for option in given if option not in missing)
        raise UsageError(
            f"{missing[0]}: expected with {present} (the IP-Adapter's three options go together: "
            f"{', '.join(given)}), got none"
        )
    check(math.isfinite(args.ip_adapter_scale), "--ip-adapter-scale", "a finite number", args.ip_adapter_scale)
    check_local_or_hub("--ip-adapter", args.ip_adapter)
    image = read_image_file("--ip-adapter-image", args.ip_adapter_image, "RGB")
    weight = Path(args.ip_adapter).expanduser() / args.ip_adapter_weight
    if Path(args.ip_adapter).expanduser().is_dir():
        if not weight.is_file():
            found = "a folder" if weight.is_dir() else "no such file"
            raise UsageError(
                f"--ip-adapter-weight: expected a weights file in the --ip-adapter folder {args.ip_adapter!r}, got "
                f"{args.ip_adapter_weight!r}: {found} there"
            )
    return image


def load_ip_adapter_option(pipe: Any, args: argparse.Namespace) -> None:
    """Loads ``--ip-adapter``'s weights file on ``pipe`` at ``--ip-adapter-scale``; refusals name the options."""
    subfolder, _, weight_name = args.ip_adapter_weight.replace("\\", "/").rpartition("/")
    if not hasattr(pipe, "load_ip_adapter"):
        raise UsageError(f"--ip-adapter: expected none for {type(pipe).__name__} (it takes no IP-Adapter)")
    if not Path(args.ip_adapter).expanduser().exists():  # a hub id: its weights file fetched in one line, or refused
        fetch_from_hub("--ip-adapter", args.ip_adapter, args.ip_adapter_weight.replace("\\", "/"))
    names = {"pretrained_model_name_or_path_or_dict": "--ip-adapter", "weight_name": "--ip-adapter-weight"}
    with options_named({**names, "scale": "--ip-adapter-scale"}):
        pipe.load_ip_adapter(args.ip_adapter, subfolder=subfolder or None, weight_name=weight_name)
        pipe.set_ip_adapter_scale(args.ip_adapter_scale)
    if getattr(pipe, "image_encoder", None) is None:  # the image prompt is encoded by the folder's image encoder
        raise UsageError(
            "--ip-adapter-image: expected a --model folder with an image_encoder/ (export --ip-adapter "
            f"--image-encoder ID_OR_FOLDER), got {args.model or 'the tiny model'!r}, which has none"
        )


def parse_lora_option(spec: str) -> Tuple[str, float]:
    """``--lora PATH[:SCALE]`` → ``(PATH, SCALE)`` (scale 1 without one); PATH a LoRA file, a folder or a hub id."""
    from .cache_spec import parse_lora_spec
    from .layout import missing_weights_file

    with options_named({"lora": "--lora"}):
        path, scale = parse_lora_spec(spec)
    head, separator, tail = spec.rpartition(":")
    if not Path(path).expanduser().exists() and separator and Path(head).expanduser().exists():
        raise UsageError(f"--lora: expected PATH[:SCALE] with a number for SCALE, got {tail!r} after {head!r}")
    if missing_weights_file(path):
        raise UsageError(f"--lora: expected an existing LoRA file or folder, or a hub id, got {path!r}: no such file")
    return path, scale


def load_loras(pipe: Any, loras: List[Tuple[str, float]]) -> None:
    """Loads each ``--lora`` on ``pipe`` as an adapter named after its file and makes them all active with their
    scales (as diffusers' ``load_lora_weights`` and ``set_adapters``); a refusal names the option and the file."""
    from .cache_spec import lora_adapter_names

    names = lora_adapter_names([path for path, _ in loras])
    for name, (path, _) in zip(names, loras):
        option = f"--lora {path}"
        refusals = {"pretrained_model_name_or_path_or_dict": option, "adapter_name": option}
        refusals.update({component: f"{option} ({component})" for component in MODEL_COMPONENTS})
        with options_named(refusals):
            pipe.load_lora_weights(path, adapter_name=name)
    if names:
        with options_named({"adapter_weights": "--lora SCALE"}):
            pipe.set_adapters(names, adapter_weights=[scale for _, scale in loras])


def check_cache_spec(spec: str) -> None:
    """``--cache``: its form and its values (DeepCache's by its config's own rules), before any model loads."""
    from .cache_spec import parse_cache_spec

    quiet_libraries()  # DeepCache's config comes with the pipelines, and they with diffusers and transformers
    from .pipelines.cache_configs import cache_config_of

    with options_named(CACHE_OPTION):
        kind, values = parse_cache_spec(spec, "cache")
        cache_config_of(spec)
    if kind == "fbc":  # diffusers' FirstBlockCacheConfig takes any threshold: a pipeline refuses it when enabled
        check(values[0] >= 0, "--cache fbc:THRESHOLD", "a number ≥ 0", values[0])


VIDEO_EXTENSIONS = (".mp4", ".mkv", ".mov", ".webm")  # what video.FrameWriter encodes (its VIDEO_ENCODERS)
DEFAULT_IMAGE_OUT, DEFAULT_VIDEO_OUT = "image.png", "video.mp4"  # generate's --out without one


def is_video_path(out: str) -> bool:
    return Path(out).suffix.lower() in VIDEO_EXTENSIONS


def check_output_fits(record: Family, args: argparse.Namespace) -> None:
    """``--out``, ``--frames`` and ``--fps`` fit what the folder's family makes (``record.frames``: videos)."""
    if not record.frames:
        if args.out is not None and is_video_path(args.out):
            raise UsageError(
                f"--out: expected an image file name for {record.class_name} (its calls make images), got {args.out!r}"
            )
        if args.frames is not None:
            raise UsageError(f"--frames: expected none for {record.class_name} (its calls make images)")
    elif args.out is not None and Path(args.out).suffix and not is_video_path(args.out):
        raise UsageError(
            f"--out: expected a video file ({', '.join(VIDEO_EXTENSIONS)}) or a folder for PNG frames for "
            f"{record.class_name} (its calls make videos), got {args.out!r}"
        )


def check_makes_images(record: Family, option: str) -> None:
    """A folder whose family makes videos (``record.frames``) is refused by ``option``: the server returns images."""
    refusal = record.images_only_refusal()
    if refusal is not None:
        raise UsageError(f"{option}: {refusal}")


def check_cache_fits(record: Family, spec: str) -> None:
    """``--cache`` names the step cache the folder's family (``record``) runs, before its pipeline loads."""
    from .cache_spec import parse_cache_spec

    kind = parse_cache_spec(spec, "cache")[0]
    if record.step_cache is None:
        raise UsageError(
            f"--cache: expected none for {record.class_name} ({record.title} caches no steps), got {spec!r}"
        )
    form, words = CACHE_FORMS[record.step_cache]
    if kind != form:
        other = next(text for key, (name, text) in CACHE_FORMS.items() if name == kind)
        raise UsageError(f"--cache: expected {words} for {record.class_name}, got {spec!r}, which is {other}")


def check_cache_parts(record: Family, folder: Path, spec: str) -> None:
    """The parts the step cache of ``--cache`` runs are beside the folder's denoiser (or each of Wan 2.2's two),
    checked before the pipeline loads: a server's replicas would otherwise find them missing after the cluster
    started. ``spec`` has passed :func:`check_cache_fits`."""
    from .cache_spec import parse_cache_spec
    from .layout import (
        DEEP_CACHE_FULL_PART,
        DEEP_CACHE_SHALLOW_PART,
        FIRST_BLOCK_CACHE_PARTS,
        deep_cache_shallow_parts,
        missing_first_block_cache_parts,
    )

    kind, values = parse_cache_spec(spec, "cache")
    again = "export the model again with --step-cache"
    if kind == "deepcache":
        unet = folder / record.denoiser
        branches = sorted(deep_cache_shallow_parts(unet))
        if not (unet / DEEP_CACHE_FULL_PART).is_file() or not branches:
            shallow = DEEP_CACHE_SHALLOW_PART.format(branch="<branch>")
            raise UsageError(
                f"--cache: DeepCache runs the UNet's parts {DEEP_CACHE_FULL_PART} and {shallow}, but {unet} lacks "
                f"them; {again}"
            )
        if len(values) > 1 and values[1] not in branches:
            raise UsageError(f"--cache: expected a branch among this UNet's {branches}, got {spec!r}")
        return
    names = [record.denoiser, *(name for name in WAN_TRANSFORMERS[1:] if (folder / name / "model.onnx").is_file())]
    for name in names:
        missing = missing_first_block_cache_parts(folder / name)
        if missing:
            raise UsageError(
                f"--cache: First-Block Cache runs the transformer's parts {list(FIRST_BLOCK_CACHE_PARTS)}, but "
                f"{folder / name} lacks {missing}; {again}"
            )


def cache_summary(pipe: Any, spec: Optional[str]) -> str:
    """What the last call's step cache did, for the summary line ("" without one)."""
    cache = getattr(pipe, "step_cache", None)
    if spec is None or cache is None:
        return ""
    return f"; cache {spec}: {len(cache.computed) - cache.skipped_steps} of {len(cache.computed)} steps ran whole"


def check_scheduler_modules(scheduler: Optional[str]) -> None:
    """``--scheduler``'s class can be made here: the modules it needs beyond diffusers are installed (asked of the
    import system, without importing them or diffusers)."""
    import importlib.util

    missing = [name for name in SCHEDULER_MODULES.get(scheduler or "", ()) if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(
            f"--scheduler: {scheduler} ({SCHEDULERS[scheduler]}) needs {', '.join(missing)}, which this "
            f"environment lacks: pip install {' '.join(missing)}"
        )


def run_generate(args: argparse.Namespace) -> int:
    out = check_generate_arguments(args)
    quiet_libraries()
    import numpy as np

    from .pipelines import pipeline_class_for, resolve_model_folder
    from .pipelines.memory import CallMemory, check_image_fits

    model = tiny_model_folder(Path(args.cache_dir) if args.cache_dir else None) if args.model is None else None
    provider = args.provider or default_provider()
    load_start = time.perf_counter()
    model_names = MODEL_OPTION if args.model is not None else TINY_MODEL_OPTION
    with options_named(model_names):  # a hub id that cannot be had: --model
        if model is None:  # a hub id: downloaded with what any text-to-image family reads
            model = resolve_model_folder(args.model)
        folder_class = pipeline_class_for(model, text_to_image=False)  # an image family: asked for its images
        record = family_of_class(folder_class.__name__)
        check_generate_fits(record, args)
        if args.cache is not None:
            check_cache_parts(record, Path(model), args.cache)
    with options_named({**ROLE_OPTIONS, "strength": "--strength"}):
        roles = {IMAGE_OPTIONS[option][0] for option in args.images}
        sibling, runs = image_route(record, roles, args.strength is not None)
    if args.loras and runs.lora is None:
        raise UsageError(f"--lora: expected none for {runs.class_name} ({runs.title} takes no LoRA)")
    if args.control_mode is not None and not runs.options.get("control_mode"):
        raise UsageError(
            f"--control-mode: expected none for {runs.class_name} ({runs.title} takes no union ControlNet's mode)"
        )
    first_image = next(iter(args.images.values()), None)  # its sides where --width and --height give none
    given = (args.width, args.height)
    default = None if runs.frames else 512  # a video family's size is its pipeline's (Wan's 832 × 480)
    width, height = (side or (first_image.size[axis] if first_image else default) for axis, side in enumerate(given))
    if not runs.frames:
        with options_named(GENERATE_OPTIONS):
            memory = CallMemory.of_folder(model, provider)
            guidance = args.guidance if args.guidance is not None else record.defaults.guidance_scale
            check_image_fits(memory, width, height, provider, rows=record.rows_per_image(guidance))
    if not runs.frames and out is None:  # a name without an extension, for an image
        out = check_image_path(args.out)
    writer = None
    if runs.frames:  # checked before the work: the target's folder, PyAV (FrameWriter's own checks)
        with options_named({"path": "--out", "fps": "--fps"}):
            target = args.out or DEFAULT_VIDEO_OUT  # a file is replaced as an image is, a folder of frames never
            writer = open_frame_writer(target, args.fps, is_video_path(target), "--out")
    owned = {}  # a LoRA follows the load: its components own their weights from the start (changed in place)
    if args.loras and provider == "CUDAExecutionProvider":
        owned = {"component_options": folder_class.weights_owned_from_load(model)}
    with options_named(model_names):
        pipe = folder_class.from_pretrained(model, provider=provider, io_binding=args.io_binding, **owned)
    if sibling is not None:
        pipe = getattr(pipe, sibling)()
        if pipe is None:  # a folder without a VAE encoder
            option = "--mask" if sibling == "inpainting" else "--image"
            raise UsageError(f"{option}: {runs.class_name} needs the folder's vae_encoder/, which {model} lacks")
    if first_image is not None:  # an image's side, rounded down to what the denoiser runs
        multiple = pipe.size_multiple
        width, height = (
            side if side == chosen else max(multiple, chosen // multiple * multiple)
            for side, chosen in zip(given, (width, height))
        )
    if args.guidance is not None and getattr(pipe, "guidance_embeds", None) is False:  # FLUX.1 schnell's transformer
        raise UsageError(
            f"--guidance: expected none for {args.model or model!r}, whose transformer takes no guidance scale "
            f"(FLUX.1 schnell: guidance-distilled; dev takes one), got {args.guidance:g}"
        )
    load_loras(pipe, args.loras)
    if args.image_prompt is not None:
        if "ip_adapter_image" not in inspect.signature(pipe.__call__).parameters:
            raise UsageError(f"--ip-adapter: expected none for {type(pipe).__name__} (it takes no image prompt)")
        load_ip_adapter_option(pipe, args)
    if args.scheduler:
        import diffusers

        scheduler_class = getattr(diffusers, SCHEDULERS[args.scheduler])
        pipe.scheduler = scheduler_class.from_config(pipe.scheduler.config)
    if args.cache is not None:
        from .pipelines.cache_configs import cache_config_of

        with options_named(CACHE_OPTION):  # the family or the folder may not cache
            pipe.enable_cache(cache_config_of(args.cache))
    load_seconds = time.perf_counter() - load_start
    step_times: List[float] = []
    from tqdm.auto import tqdm

    # the bar counts the steps asked for that run: a scheduler may call the model more often (PNDM's first step
    # twice: 21 calls for 20 steps), and --strength runs the last part of the schedule only (2 of 4 steps at 0.5), so
    # the pipeline's own bar, one tick a call, is replaced by one the calls move in proportion (made at the first
    # step's end, as the pipeline's at the loop's start: a refusal before it is one line alone)
    pipe.set_progress_bar_config(disable=True)
    progress: List[Any] = []
    counted = {"calls": 1, "steps": args.steps}  # the model calls the loop makes, the steps asked for they are

    def record_step(pipeline, step, timestep, tensors):
        step_times.append(time.perf_counter())
        if not progress:
            scheduled = [float(t) for t in pipeline.scheduler.timesteps]
            # where the loop starts in the schedule (the last of a repeated timestep: PNDM's first step is twice)
            start = min(reversed(range(len(scheduled))), key=lambda k: abs(scheduled[k] - float(timestep)), default=0)
            counted["calls"] = max(len(scheduled) - start, 1)
            counted["steps"] = max(1, round(args.steps * counted["calls"] / max(len(scheduled), 1)))
            progress.append(tqdm(total=counted["steps"], unit="step"))
        calls = max(counted["calls"], step + 1)
        progress[0].update(min(counted["steps"], round((step + 1) * counted["steps"] / calls)) - progress[0].n)
        return tensors

    call = dict(
        num_inference_steps=args.steps,
        generator=np.random.RandomState(args.seed),
        callback_on_step_end=record_step,
        **image_arguments(runs, args.images, width, height),
    )
    if not runs.sized_by_image:  # (a video family without --height or --width: its pipeline's default for that side)
        call.update({name: side for name, side in (("height", height), ("width", width)) if side is not None})
    if args.frames is not None:
        call["num_frames"] = args.frames
    if runs.options.get("size_by_area"):  # else FLUX.1 Kontext makes about a megapixel of the aspect ratio
        call["max_area"] = height * width
    if args.strength is not None:
        call["strength"] = args.strength
    if args.guidance is not None:  # else the pipeline's own default, as diffusers' (7.5 for SD, 3.5 for FLUX.1 …)
        call["guidance_scale"] = args.guidance
    if args.negative_prompt is not None:  # a family that takes none is refused before loading
        call["negative_prompt"] = args.negative_prompt
    if args.control_mode is not None:
        call["control_mode"] = args.control_mode
    if args.image_prompt is not None:
        call["ip_adapter_image"] = args.image_prompt
    start = time.perf_counter()
    try:
        with options_named({**model_names, **GENERATE_OPTIONS}):  # the pipeline's checks of what depends on the model
            if writer is not None:
                frames = pipe(prompt=args.prompt, output_type="np", **call).frames[0]
                made_by = f"{type(pipe).__name__}, {provider}{cache_summary(pipe, args.cache)}"
                return write_video(writer, frames, args, start, made_by)
            image = pipe(prompt=args.prompt, **call).images[0]
    finally:
        for bar in progress:
            bar.close()
        if writer is not None:
            writer.abort()  # nothing partial is left at --out (a no-op once it is closed)
    seconds = time.perf_counter() - start
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        image.save(out)
    except OSError as error:  # checked writable before the work: the disk filled, or the folder changed since
        raise RuntimeError(f"--out: writing {str(out)!r} failed: {error.strerror or error}") from error
    print(
        f"{out}: {image.width}×{image.height}, {steps_run(counted['steps'], args)} in {seconds:.2f} s "
        f"({step_rate(step_times)}load {load_seconds:.1f} s; {type(pipe).__name__}, {provider}, "
        f"io_binding={args.io_binding}; model {args.model or model}{cache_summary(pipe, args.cache)})"
    )
    return 0


def open_frame_writer(target: str, fps: float, overwrite: bool, option: str) -> Any:
    """A :class:`~optimum_iobinding.video.FrameWriter` of ``target`` in the command's words (``option``,
    ``--overwrite``), made before any work: it refuses a folder that takes no file then, not at the first frame."""
    from .video import FrameWriter

    return FrameWriter(target, fps, overwrite=overwrite, argument=option, overwrite_argument="--overwrite")


def check_output_keeps(output: str, option: str, inputs: Iterable[Tuple[str, Optional[str]]]) -> None:
    """Writing ``output`` (``option``), which replaces a folder whole, destroys none of ``inputs`` (the paths the
    command reads, each with its option; ``None``: not given): refused where one of them is ``output`` or lies inside
    it."""
    target = Path(output).expanduser().resolve()
    for name, path in inputs:
        if path is None or not Path(path).expanduser().exists():
            continue
        read = Path(path).expanduser().resolve()
        if read == target or target in read.parents:
            raise UsageError(
                f"{option}: expected a path apart from {name} ({path!r}), got {output!r}, which "
                f"{'is' if read == target else 'holds'} it: writing {option} would replace what {name} reads"
            )


def steps_run(steps: int, args: argparse.Namespace) -> str:
    """``"20 steps"``, or where a strength ran part of the schedule ``"2 of 4 steps (--strength 0.5)"`` (an image
    without --strength: the pipeline's default strength)."""
    if steps < args.steps:
        strength = f"--strength {args.strength:g}" if args.strength is not None else "the pipeline's default strength"
        return f"{steps} of {args.steps} steps ({strength})"
    return f"{args.steps} step{'s' if args.steps != 1 else ''}"


def write_video(writer: Any, frames: Any, args: argparse.Namespace, start: float, made_by: str) -> int:
    """Writes a video's frames (float HxWx3 in [0, 1], as diffusers' ``output_type="np"``) with ``writer`` and
    prints what was made (``made_by``: the pipeline and the provider, with the step cache's summary after them)."""
    import numpy as np

    for frame in frames:
        writer.write((np.clip(frame, 0.0, 1.0) * 255).round().astype(np.uint8))
    writer.close()
    seconds = time.perf_counter() - start
    height, width = frames.shape[1:3]
    print(
        f"{writer.path}: {len(frames)} frame{'s' if len(frames) != 1 else ''} of {width}×{height} at {args.fps:g} frames/s, {args.steps} "
        f"step{'s' if args.steps != 1 else ''} in {seconds:.2f} s ({made_by})"
    )
    return 0


def image_arguments(record: Family, images: Mapping[str, Any], width: int, height: int) -> Dict[str, Any]:
    """The call arguments of the image options ``images`` for the family ``record``, each image at the output's size
    (``width`` × ``height``: resized where it has another)."""
    arguments = {}
    for argument in record.image_inputs:
        image = images[ROLE_OPTIONS[image_role(record, argument)]]
        arguments[argument] = image if image.size == (width, height) else image.resize((width, height))
    return arguments


def step_rate(step_ends: List[float]) -> str:
    """``"12.3 ms/step; "`` from the times the model's calls ended (the interval between the first and the last, over
    the calls between them), or ``""`` where one call gives no interval to measure."""
    if len(step_ends) < 2:
        return ""
    return f"{(step_ends[-1] - step_ends[0]) / (len(step_ends) - 1) * 1000:.1f} ms/step; "


def check_generate_fits(record: Family, args: argparse.Namespace) -> None:
    """What the family of a folder (``record``) cannot take, refused before its pipeline loads: a family without a
    choice of scheduler (the diffusion transformers run diffusers' flow-matching scheduler, where ``--scheduler``
    names discrete-time ones), a negative prompt for a family that takes none (LCM's guidance is an embedding), or one
    that takes it only with an argument ``generate`` does not set (``record.negative_prompt_needs``), or an ``--out``
    or ``--frames`` of the other kind of output (:func:`check_output_fits`)."""
    name = record.class_name
    check_output_fits(record, args)
    if args.cache is not None:
        check_cache_fits(record, args.cache)
    if args.scheduler and not record.scheduler_choice:
        raise UsageError(
            f"--scheduler: expected none for {name} (it runs diffusers' flow-matching scheduler from the "
            f"folder), got {args.scheduler!r}"
        )
    if args.negative_prompt is not None and not record.negative_prompt:
        raise UsageError(
            f"--negative-prompt: {name} takes no negative prompt (its guidance is an embedding, with no "
            "unconditional batch)"
        )
    if args.negative_prompt is not None and record.negative_prompt_needs:
        raise UsageError(
            f"--negative-prompt: expected none for {name} ({record.title} uses a negative prompt only with true "
            f"classifier-free guidance, {record.negative_prompt_needs}: call the pipeline from Python for it), "
            f"got {args.negative_prompt!r}"
        )


# what the stream pipeline's own checks call the options of `stream`
STREAM_OPTIONS = {
    "num_inference_steps": "--steps",
    "strength": "--strength",
    "guidance_scale": "--guidance",
    "height": "--size",
    "width": "--size",
    "height and width": "--size",
    "provider": "--provider",
    "tiny_vae": "--tiny-vae",
    "prompt": "--prompt",
    "negative_prompt": "--negative-prompt",
    "seed": "--seed",
    "cfg_type": "--cfg-type",
    "delta": "--delta",
    "similarity_threshold": "--similarity-threshold",
    "max_skip_frame": "--max-skip-frame",
    "control_image": "--control-image",
    "controlnet_conditioning_scale": "--control-scale",
    "ip_adapter_image": "--ip-adapter-image",
}


def stream_option_names(args: argparse.Namespace) -> Dict[str, str]:
    """What the stream pipeline, its loading and the runtime call the options of `stream`: the model's names
    (:func:`model_option_names`: ``--model``, or ``--cache-dir`` for the tiny model; the VAE's ``--tiny-vae`` where
    given) and :data:`STREAM_OPTIONS`."""
    option = "--model" if args.model is not None else "--cache-dir"
    return {**model_option_names(option, "--tiny-vae" if args.tiny_vae is not None else None), **STREAM_OPTIONS}


STREAM_SEEDS = range(2**63)  # what torch.Generator().manual_seed takes without wrapping around
STREAM_DEFAULT_FPS = 30.0  # a folder of images carries no rate: a video written from one plays at this rate
# an SD pipeline folder the stream loads: the text encoder, the UNet and (unless --tiny-vae) both halves of the VAE
STREAM_COMPONENTS = ("text_encoder", "unet")
STREAM_VAE_COMPONENTS = ("vae_encoder", "vae_decoder")


def parse_frame_size(text: Optional[str]) -> Optional[Tuple[int, int]]:
    """``--size``: ``512`` (a square) or ``768x512`` (width x height), as (width, height); ``None`` keeps the
    input's size."""
    if text is None:
        return None
    width, separator, height = text.lower().partition("x")
    if not separator:
        height = width
    if not (width.isdigit() and height.isdigit() and int(width) > 0 and int(height) > 0):
        raise UsageError(f"--size: expected pixels as 512 or 768x512 (width x height), got {text!r}")
    return int(width), int(height)


def check_stream_folders(model: Optional[str], tiny_vae: Optional[str]) -> None:
    """A local --model folder holds what the stream loads (model_index.json, the tokenizer, the text encoder, the
    UNet, and the VAE's encoder and decoder unless --tiny-vae replaces them); a local --tiny-vae folder holds
    vae_encoder/ and vae_decoder/. Hub ids are fetched by the loading."""
    if model is not None and Path(model).exists():
        folder = Path(model)
        if not folder.is_dir():
            raise UsageError(f"--model: expected an ONNX pipeline folder or a hub id, got the file {model!r}")
        needed = [*STREAM_COMPONENTS, *(() if tiny_vae is not None else STREAM_VAE_COMPONENTS)]
        missing = (["model_index.json"] if not (folder / "model_index.json").is_file() else []) + [
            f"{name}/model.onnx" for name in needed if not (folder / name / "model.onnx").is_file()
        ]
        if not (folder / "tokenizer").is_dir():
            missing.append("tokenizer/")
        if "unet/model.onnx" in missing and (folder / "transformer" / "model.onnx").is_file():
            raise UsageError(
                f"--model: expected a UNet folder (SD 1.x/2.x, SD-Turbo, LCM, SDXL: the stream runs UNets), got "
                f"{model!r}, a diffusion transformer's (SD3, FLUX.1), which no stream runs"
            )
        if missing:
            hint = (
                "; pass --tiny-vae FOLDER for a folder without a VAE encoder"
                if any(name.startswith("vae_") for name in missing)
                else "; export one with optimum-iobinding export"
            )
            raise UsageError(
                f"--model: expected an ONNX Stable Diffusion folder, got {model!r} without {', '.join(missing)}{hint}"
            )
    if tiny_vae is not None and Path(tiny_vae).exists():
        folder = Path(tiny_vae)
        missing = [
            f"{name}/model.onnx" for name in STREAM_VAE_COMPONENTS if not (folder / name / "model.onnx").is_file()
        ]
        if missing:
            raise UsageError(
                f"--tiny-vae: expected an AutoencoderTiny export holding vae_encoder/model.onnx and "
                f"vae_decoder/model.onnx, got {tiny_vae!r} without {' and '.join(missing)}; make one "
                "with optimum-iobinding export --tiny-vae ID_OR_FOLDER -o FOLDER"
            )
        from .layout import check_tiny_vae_class

        with options_named({"tiny_vae": "--tiny-vae"}):
            check_tiny_vae_class(folder, shown=tiny_vae)


def check_video_extra(source: str, target: str) -> None:
    """A video file in or out needs PyAV (the video extra): asked of the import system before any work, as `serve`
    asks for its extra; folders of images need none."""
    import importlib.util

    from .video import VIDEO_ENCODERS

    videos = [
        (option, path)
        for option, path, is_video in (
            ("INPUT", source, Path(source).expanduser().is_file()),
            ("OUTPUT", target, Path(target).suffix.lower() in VIDEO_ENCODERS),
        )
        if is_video
    ]
    if videos and importlib.util.find_spec("av") is None:
        option, path = videos[0]
        raise UsageError(
            f"{option}: the video file {path!r} needs the video extra (PyAV), which this environment lacks: pip "
            "install 'optimum-iobinding[video]' (folders of images need none)"
        )


def stream_control_arguments(stream: Any, controls: List[Any], args: argparse.Namespace) -> Dict[str, Any]:
    """``prepare``'s ControlNet arguments from ``--control-image`` (read already) and ``--control-scale``: refused by
    name where the model has no ControlNet, or has ControlNets and no control image was given (before any frame)."""
    nets = len(getattr(stream, "controlnets", ()))
    if not nets:
        if controls:
            raise UsageError("--control-image: expected a model exported with a ControlNet, got one without")
        return {}
    if not controls:
        raise UsageError(
            f"--control-image: expected {nets} control image(s) for the model's {nets} ControlNet(s) (every frame's), "
            "got none"
        )
    if len(controls) != nets:
        raise UsageError(
            f"--control-image: expected {nets} (one per ControlNet of the model, in order), got {len(controls)}"
        )
    scales = args.control_scale or []
    if len(scales) not in (0, 1, nets):
        expected = "1 value (the model's one ControlNet's)" if nets == 1 else f"1 or {nets} values (one per ControlNet)"
        raise UsageError(f"--control-scale: expected {expected}, got {len(scales)}")
    arguments: Dict[str, Any] = {"control_image": controls[0] if nets == 1 else controls}
    if scales:
        arguments["controlnet_conditioning_scale"] = scales[0] if len(scales) == 1 else scales
    return arguments


def check_frame_size(multiple: int, width: int, height: int, args: argparse.Namespace) -> None:
    """The frames' size (``--size``, else the input's) is one the loaded model runs: multiples of its
    ``size_multiple``."""
    if width % multiple == 0 and height % multiple == 0:
        return
    if args.size is not None:
        raise UsageError(
            f"--size: expected a width and height that are multiples of {multiple} (the model's size "
            f"multiple), got {args.size!r}"
        )
    fitted = f"{max(multiple, width // multiple * multiple)}x{max(multiple, height // multiple * multiple)}"
    raise UsageError(
        f"INPUT: expected frames whose width and height are multiples of {multiple}, got "
        f"{width}×{height} frames in {args.input!r} ({multiple}: the model's size multiple); pass --size "
        f"(e.g. --size {fitted}) to fit every frame to one"
    )


def check_stream_arguments(args: argparse.Namespace) -> Optional[Tuple[int, int]]:
    """Every check of `stream` that needs neither the frames nor the model; returns --size as (width, height)."""
    check(args.steps > 0, "--steps", "a positive integer", args.steps)
    check(math.isfinite(args.strength) and 0 < args.strength <= 1, "--strength", "a number in (0, 1]", args.strength)
    check(math.isfinite(args.guidance), "--guidance", "a finite number", args.guidance)
    check(math.isfinite(args.delta), "--delta", "a finite number", args.delta)
    if args.similarity_threshold is not None:
        check(
            0 <= args.similarity_threshold <= 1,
            "--similarity-threshold",
            "a number in [0, 1]",
            args.similarity_threshold,
        )
    check(args.max_skip_frame >= 0, "--max-skip-frame", "an integer ≥ 0", args.max_skip_frame)
    if args.negative_prompt is not None and (args.guidance <= 1 or args.cfg_type in ("none", "self")):
        raise UsageError(
            "--negative-prompt: expected it with --guidance above 1 and --cfg-type full or initialize (the guidance "
            f"that runs it), got --guidance {args.guidance:g} and --cfg-type {args.cfg_type}"
        )
    for scale in args.control_scale or ():
        check(math.isfinite(scale), "--control-scale", "a finite number", scale)
    if args.control_scale and not args.control_image:
        raise UsageError("--control-scale: expected it with --control-image (a ControlNet model's), got it alone")
    check(args.seed in STREAM_SEEDS, "--seed", f"an integer in 0 … {STREAM_SEEDS[-1]}", args.seed)
    size = parse_frame_size(args.size)  # its multiple is the model's: checked once the model is loaded
    check_local_or_hub("--model", args.model)
    check_local_or_hub("--tiny-vae", args.tiny_vae)
    check_stream_folders(args.model, args.tiny_vae)
    check_video_extra(args.input, args.output)
    if args.model is None:
        check_cache_dir(args.cache_dir)
    if args.provider is not None:  # the last check: it imports the runtime (and onnxruntime) to ask
        from .runtime.providers import normalize_providers

        with options_named(STREAM_OPTIONS):
            normalize_providers(args.provider, io_binding=True)
    return size


def run_stream(args: argparse.Namespace) -> int:
    """``stream INPUT OUTPUT``: every frame of a video file or a folder of images through the stream pipeline,
    written to a video file or a folder of PNGs (atomically)."""
    size = check_stream_arguments(args)
    controls = [read_image_file("--control-image", path, "RGB") for path in args.control_image or ()]
    image_prompt = check_ip_adapter_arguments(args)
    from tqdm.auto import tqdm

    from .video import open_frames

    if Path(args.output).expanduser().resolve() == Path(args.input).expanduser().resolve():
        raise UsageError(
            f"OUTPUT: expected another path than INPUT, got {args.output!r} for both (the input is read "
            "while the output is written)"
        )
    check_output_keeps(
        args.output,
        "OUTPUT",
        [
            ("INPUT", args.input),
            ("--model", args.model),
            ("--tiny-vae", args.tiny_vae),
            ("--ip-adapter", args.ip_adapter),
            ("--ip-adapter-image", args.ip_adapter_image),
            ("--cache-dir", args.cache_dir if args.model is None else None),
            *(("--control-image", path) for path in args.control_image or ()),
        ],
    )
    with contextlib.ExitStack() as opened:  # what is opened is closed on every way out (the output discarded)
        reader = opened.enter_context(
            open_frames(args.input, size, argument="INPUT", size_argument="--size")
        )  # a bad file fails here
        width, height = reader.size
        fps = reader.fps or STREAM_DEFAULT_FPS
        writer = opened.enter_context(open_frame_writer(args.output, fps, args.overwrite, "OUTPUT"))  # before any model

        quiet_libraries()
        model = Path(args.model) if args.model and Path(args.model).exists() else args.model
        if model is None:
            model = tiny_model_folder(Path(args.cache_dir) if args.cache_dir else None)
        provider = args.provider or default_provider()
        from .pipelines.memory import CallMemory, check_image_fits

        decoder = Path(args.tiny_vae if args.tiny_vae is not None else model) / "vae_decoder"
        if decoder.is_dir():  # a hub id's decoder is checked by the pipeline's own loading, once downloaded
            memory = CallMemory.of_folder(model if Path(model).is_dir() else decoder.parent, provider, decoder)
            with options_named({"frame size": "--size" if args.size is not None else "INPUT"}):
                check_image_fits(memory, width, height, provider, argument="frame size")
        started = time.perf_counter()
        with options_named(stream_option_names(args)):
            stream = pipeline_class(family("stream")).from_pretrained(model, provider=provider, tiny_vae=args.tiny_vae)
            check_frame_size(stream.size_multiple, width, height, args)
            if image_prompt is not None:
                load_ip_adapter_option(stream, args)
            stream.prepare(
                args.prompt,
                negative_prompt=args.negative_prompt,
                num_inference_steps=args.steps,
                strength=args.strength,
                guidance_scale=args.guidance,
                seed=args.seed,
                height=height,
                width=width,
                stream_batch=args.stream_batch,
                cfg_type=args.cfg_type,
                delta=args.delta,
                similarity_threshold=args.similarity_threshold,
                max_skip_frame=args.max_skip_frame,
                **stream_control_arguments(stream, controls, args),
                **({"ip_adapter_image": image_prompt} if image_prompt is not None else {}),
            )
            ready = time.perf_counter()
            outputs = stream.frames(reader)
            for frame in tqdm(outputs, total=reader.frame_count, desc="stream", unit="frame"):
                writer.write(frame)
            seconds = time.perf_counter() - ready
    frames = writer.frames_written
    print(
        f"{args.output}: {frames} frame{'s' if frames != 1 else ''} of {width}×{height} in {seconds:.2f} s ({frames / seconds:.1f} frames/s; "
        f"load and prepare {ready - started:.1f} s; {args.steps} steps at strength {args.strength}, "
        f"{len(stream.timesteps)} UNet step(s) a frame; {provider}; model {model}"
        + (f", tiny VAE {args.tiny_vae}" if args.tiny_vae else "")
        + (
            f"; {stream.skipped_frames} frames skipped by the similarity filter"
            if args.similarity_threshold is not None
            else ""
        )
        + ")"
    )
    return 0


# ServeConfig's settings and the options of `serve` that give them
SERVE_OPTIONS = {
    "model": "model",
    "replicas": "--replicas",
    "max_batch_size": "--max-batch-size",
    "batch_wait_timeout_s": "--batch-wait-ms",
    "device": "--device",
    "provider": "--provider",
    "steps": "--steps",
    "guidance": "--guidance",
    "warmup_batch_sizes": "--warmup-batch-sizes",
    "max_queued_requests": "--max-queued-requests",
    "png_compression": "--png-compression",
    "max_images_per_request": "--max-images-per-request",
    "max_pixels_per_image": "--max-pixels-per-image",
    "max_pixels_per_batch": "--max-pixels-per-batch",
    "max_steps": "--max-steps",
    "max_prompt_chars": "--max-prompt-chars",
    "max_prompt_tokens": "--max-prompt-tokens",
    "max_body_bytes": "--max-body-bytes",
    "request_timeout_s": "--request-timeout-s",
    "cache": "--cache",
    "loras": "--lora",
}


def check_serve_arguments(args: argparse.Namespace, model: str) -> ServeConfig:
    """The service's settings, checked (by ServeConfig, its one place) and named by their options."""
    from .serve.config import ServeConfig  # the standard library only: checks run without Ray

    check(0 < args.port < 65536, "--port", "a port in 1 … 65535", args.port)
    check(
        math.isfinite(args.batch_wait_ms) and 0 <= args.batch_wait_ms <= 60_000,
        "--batch-wait-ms",
        "milliseconds in 0 … 60000",
        args.batch_wait_ms,
    )
    check(math.isfinite(args.guidance), "--guidance", "a finite number", args.guidance)
    for spec in args.lora:  # a path there or a hub id, a finite scale
        parse_lora_option(spec)
    with options_named(SERVE_OPTIONS):
        warmup = None
        if args.warmup_batch_sizes is not None:
            warmup = ServeConfig.from_args(
                {"model": model, "warmup_batch_sizes": args.warmup_batch_sizes}
            ).warmup_batch_sizes
        return ServeConfig(
            model=model,
            replicas=args.replicas,
            max_batch_size=args.max_batch_size,
            batch_wait_timeout_s=args.batch_wait_ms / 1000.0,
            device=args.device,
            provider=args.provider,
            steps=args.steps,
            guidance=args.guidance,
            warmup_batch_sizes=warmup,
            max_queued_requests=args.max_queued_requests,
            png_compression=args.png_compression,
            max_images_per_request=args.max_images_per_request,
            max_pixels_per_image=args.max_pixels_per_image,
            max_pixels_per_batch=args.max_pixels_per_batch,
            max_steps=args.max_steps,
            max_prompt_chars=args.max_prompt_chars,
            max_prompt_tokens=args.max_prompt_tokens,
            max_body_bytes=args.max_body_bytes,
            request_timeout_s=args.request_timeout_s,
            cache=args.cache,
            loras=list(args.lora),
        )


# what loading calls the model `serve` serves
SERVED_MODEL_OPTION = model_option_names("model")


def run_serve(args: argparse.Namespace) -> int:
    import dataclasses
    import importlib.util

    check_local_or_hub("model", args.model)
    check_not_a_file("model", args.model)
    config = check_serve_arguments(args, args.model if args.model is not None else "the tiny random model")
    if args.model is None:
        check_cache_dir(args.cache_dir)
    if args.cache is not None:
        check_cache_spec(args.cache)
    # asked of the import system: Ray must not be imported before `run` sets up the local cluster
    missing = [name for name in ("ray", "fastapi") if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(
            f"serve: expected the serve extra (Ray Serve), missing {', '.join(missing)}: "
            "pip install 'optimum-iobinding[serve]'"
        )
    from .serve import run
    from .serve.config import ServeStartError, check_port_free

    if args.model is not None and not Path(args.model).exists():  # before Ray starts, as the folder check below
        fetch_from_hub("model", args.model, "model_index.json")
    quiet_libraries()
    if args.model is None:
        config = dataclasses.replace(
            config, model=str(tiny_model_folder(Path(args.cache_dir) if args.cache_dir else None))
        )
    if Path(config.model).exists():  # before Ray starts: a path that is no pipeline fails here, not in every replica
        from .pipelines import pipeline_class_for

        with options_named(SERVED_MODEL_OPTION):
            served_class = pipeline_class_for(config.model)
        served = family_of_class(served_class.__name__)
        check_makes_images(served, "model")
        if args.cache is not None:
            check_cache_fits(served, args.cache)
            check_cache_parts(served, Path(config.model), args.cache)
    if not os.environ.get("RAY_ADDRESS"):  # a local cluster: its proxy would share a port another server holds
        with options_named({"port": "--port", "host": "--host"}):
            check_port_free(args.host, args.port)
    url = f"http://[{args.host}]:{args.port}" if ":" in args.host else f"http://{args.host}:{args.port}"
    print(f"optimum-iobinding: starting Ray Serve for {config.model} on {url} …", flush=True)

    def ready() -> None:  # once GET /health answers
        print(
            f"optimum-iobinding: serving {config.model} on {url}/v1/images ({args.replicas} replica(s), batches "
            f"of up to {args.max_batch_size}); Ctrl-C stops",
            flush=True,
        )

    try:
        stopped = run(config, host=args.host, port=args.port, dashboard=args.dashboard, on_ready=ready)
    except ServeStartError as error:  # one line; --debug shows the error behind it, with Ray's traceback
        raise ServeStartError(f"serve: {error} (--debug shows the traceback)") from error.__cause__
    return 130 if stopped == signal.SIGINT else 0  # stopped by a signal, Serve and the local Ray shut down


def run_loadtest_command(args: argparse.Namespace) -> int:
    from .serve.loadtest import main_from_args

    return main_from_args(args)


def add_command(commands: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A command's parser: options spelled out in full (``--step`` is no ``--steps``), and ``--debug`` among its own
    options, given no default there, so that a ``--debug`` before the command's name stays set. ``commands``: what
    ``add_subparsers`` returned."""
    command = commands.add_parser(name, allow_abbrev=False, **kwargs)
    command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    return command


def build_parser() -> argparse.ArgumentParser:
    parser = CommandLineParser(prog="optimum-iobinding", description=__doc__, allow_abbrev=False)
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    commands = parser.add_subparsers(dest="command")  # none given: refused by parse_arguments, naming them

    generate = add_command(commands, "generate", help="generate an image (offline with the tiny model by default)")
    generate.add_argument("prompt", nargs="?", default=None, help=f"the prompt (default {DEFAULT_PROMPT!r})")
    generate.add_argument(
        "--prompt",
        dest="prompt_option",
        default=None,
        metavar="PROMPT",
        help="the prompt as an option, as stream and loadtest take it",
    )
    generate.add_argument(
        "--negative-prompt", default=None, help="what the image should not show (default: none, as diffusers')"
    )
    generate.add_argument("--steps", type=int, default=20, help="denoising steps (default 20)")
    generate.add_argument(
        "--guidance",
        type=float,
        default=None,
        help="guidance scale (default: the pipeline's, as diffusers': 7.5 for SD 1.x/2.x, 5.0 for "
        "SDXL, 7.0 for SD3, 3.5 for FLUX.1 dev)",
    )
    generate.add_argument("--seed", type=int, default=0, help="the seed of the initial noise (numpy's RandomState)")
    generate.add_argument(
        "--height", type=int, default=None, help="image height in pixels (default 512; Wan's 480; or an --image's own)"
    )
    generate.add_argument(
        "--width", type=int, default=None, help="image width in pixels (default 512; Wan's 832; or an --image's own)"
    )
    images = generate.add_argument_group("images (each resized to --height and --width where they are given)")
    images.add_argument(
        "--image",
        default=None,
        metavar="FILE",
        help="the image to start from (image to image; with --mask, inpainting) or to edit (FLUX.1 Kontext, Fill)",
    )
    images.add_argument("--mask", default=None, metavar="FILE", help="with --image: where to repaint (white)")
    images.add_argument(
        "--control-image", default=None, metavar="FILE", help="the control image (ControlNet, FLUX.1 Control)"
    )
    images.add_argument(
        "--control-mode",
        type=int,
        default=None,
        metavar="N",
        help="a union ControlNet's mode for --control-image (FLUX.1 ControlNet union models; e.g. 0 for canny in "
        "InstantX's union; default: none, which a union ControlNet refuses)",
    )
    images.add_argument(
        "--strength",
        type=float,
        default=None,
        help="with --image: how much of the schedule runs (default the pipeline's, as diffusers': 0.8 for image to "
        "image)",
    )
    generate.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="PATH[:SCALE]",
        help="a LoRA file, folder or hub id, at SCALE (default 1); repeat it for several",
    )
    add_ip_adapter_arguments(generate)
    generate.add_argument(
        "--scheduler",
        choices=sorted(SCHEDULERS),
        default=None,
        help="replace the model's scheduler (default: the model's own, from its folder)",
    )
    generate.add_argument("--provider", default=None, help="ORT execution provider (default: CUDA if available)")
    generate.add_argument(
        "--io-binding",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="bind torch tensors on the device (default) or run diffusers' numpy loop",
    )
    generate.add_argument(
        "--model", default=None, help="ONNX pipeline folder or hub id (default: a tiny random model built offline)"
    )
    generate.add_argument(
        "--cache-dir", default=None, help="where the tiny model is built (default ~/.cache/optimum-iobinding)"
    )
    generate.add_argument(
        "--out",
        default=None,
        help="the image to write (default image.png), or for a video family the video (.mp4, .mkv, .mov, .webm; "
        "default video.mp4)",
    )
    generate.add_argument(
        "--frames", type=int, default=None, help="a video family's frames (default the pipeline's: 81 for Wan)"
    )
    generate.add_argument("--fps", type=float, default=16.0, help="a video's frames per second (default 16)")
    generate.add_argument(
        "--cache",
        default=None,
        metavar="SPEC",
        help="cache denoising steps (default off): fbc:THRESHOLD (First-Block Cache: SD3, FLUX.1, Wan, "
        "e.g. fbc:0.08) or deepcache:INTERVAL[:BRANCH] (DeepCache, SD and SDXL, e.g. "
        "deepcache:3); the model folder needs the parts: export it with --step-cache",
    )
    generate.set_defaults(run=run_generate)

    serve_command = add_command(
        commands,
        "serve",
        help="serve POST /v1/images with Ray Serve: a pipeline per replica, a GPU per replica",
        description="Runs the Ray Serve application of optimum_iobinding.serve on a local Ray cluster, or joins "
        "RAY_ADDRESS. Needs the serve extra: pip install 'optimum-iobinding[serve]'.",
    )
    serve_command.add_argument(
        "model",
        nargs="?",
        default=None,
        help="ONNX pipeline folder or hub id (default: the tiny random model built offline)",
    )
    serve_command.add_argument("--replicas", type=int, default=1, help="generator replicas, a GPU each (default 1)")
    serve_command.add_argument("--max-batch-size", type=int, default=4, help="images per pipeline call (default 4)")
    serve_command.add_argument(
        "--batch-wait-ms",
        type=float,
        default=0.0,
        help="how long a replica waits for a batch to fill (default 0: batches form from the "
        "requests that queue while one runs)",
    )
    serve_command.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every one)")
    serve_command.add_argument("--port", type=int, default=8000, help="the port to listen on")
    serve_command.add_argument(
        "--device", choices=("auto", "cuda", "cpu"), default="auto", help="where replicas run (auto: CUDA if available)"
    )
    serve_command.add_argument("--provider", default=None, help="ORT execution provider (default: by device)")
    serve_command.add_argument("--steps", type=int, default=30, help="default steps of a request (default 30)")
    serve_command.add_argument("--guidance", type=float, default=7.5, help="default guidance (default 7.5)")
    serve_command.add_argument(
        "--warmup-batch-sizes",
        default=None,
        help="batch sizes captured at start, e.g. 1,2,4 (default 1 … max batch size)",
    )
    serve_command.add_argument(
        "--max-queued-requests", type=int, default=256, help="requests waiting before new ones get 503 (default 256)"
    )
    serve_command.add_argument(
        "--png-compression",
        type=int,
        default=0,
        help="zlib level of the PNG answers: 0 (default) uncompressed, the quickest to "
        "make; 1-9 about half the bytes for many times the encoding time",
    )
    serve_command.add_argument(
        "--cache-dir", default=None, help="where the tiny model is built (default ~/.cache/optimum-iobinding)"
    )
    serve_command.add_argument(
        "--cache",
        default=None,
        metavar="SPEC",
        help="cache every request's denoising steps (default off), as generate --cache: fbc:THRESHOLD or "
        "deepcache:INTERVAL[:BRANCH]; the model folder needs the parts: export it with --step-cache",
    )
    serve_command.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="PATH[:SCALE]",
        help="a LoRA every replica loads, at SCALE (default 1), named after its file; repeat it for several; a "
        "request's loras field picks among them",
    )
    serve_command.add_argument("--dashboard", action="store_true", help="start Ray's dashboard (on 127.0.0.1)")
    limits = serve_command.add_argument_group("request limits (beyond them: 400 or 413 before any work)")
    limits.add_argument("--max-images-per-request", type=int, default=4, help="images of one request (default 4)")
    limits.add_argument(
        "--max-pixels-per-image",
        type=int,
        default=None,
        help="default: (2 × the larger of the model's and the warm-up's side)²",
    )
    limits.add_argument(
        "--max-pixels-per-batch",
        type=int,
        default=None,
        help="default: --max-batch-size images of --max-pixels-per-image",
    )
    limits.add_argument("--max-steps", type=int, default=150, help="steps of one request (default 150)")
    limits.add_argument("--max-prompt-chars", type=int, default=2000, help="characters of a prompt (default 2000)")
    limits.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="tokens of a prompt (default: the tokenizer's length, 77 for CLIP)",
    )
    limits.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help="bytes of a request's body (default: room for a start image of the largest size)",
    )
    limits.add_argument(
        "--request-timeout-s",
        type=float,
        default=300.0,
        help="seconds a request may take in its replica before it gets 504 (default 300)",
    )
    serve_command.set_defaults(run=run_serve)

    loadtest = add_command(
        commands,
        "loadtest",
        help="load-test a running /v1/images service: images/s, p50/p95/p99 latency",
        formatter_class=RawDescriptionHelpFormatter,  # the install command on one line
        description="Closed-loop load test of POST /v1/images at each concurrency; prints a table.\n"
        "With --out, writes loadtest.json and loadtest.md, and the plot loadtest.png\n"
        "where matplotlib is installed: pip install 'optimum-iobinding[plot]'",
    )
    loadtest.add_argument("url", help="the service, e.g. http://127.0.0.1:8000")
    loadtest.add_argument("--concurrency", default="1,4,16", help="client threads, one level each (default 1,4,16)")
    loadtest.add_argument("--requests", type=int, default=32, help="counted requests per level (default 32)")
    loadtest.add_argument(
        "--warmup", type=int, default=-1, help="uncounted requests first (default -1: one per client thread)"
    )
    loadtest.add_argument("--prompt", default=DEFAULT_PROMPT, help="every request's prompt")
    loadtest.add_argument("--seed", type=int, default=0, help="first seed; each request takes the next")
    loadtest.add_argument("--steps", type=int, default=None, help="denoising steps (default: the service's)")
    loadtest.add_argument("--guidance", type=float, default=None, help="guidance scale (default: the service's)")
    loadtest.add_argument("--size", default=None, help="512 or 768x512 (default: the service's)")
    loadtest.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")
    loadtest.add_argument(
        "--out",
        default=None,
        help="folder for loadtest.json and .md, and .png with matplotlib (the plot extra) (default: none, the table "
        "printed only)",
    )
    loadtest.set_defaults(run=run_loadtest_command)

    stream = add_command(
        commands,
        "stream",
        help="a video (or a folder of images) through a few-step model, frame by frame",
        description=f"Runs every frame of INPUT through {family('stream').class_name} (the prompt encoded once, the "
        "noise fixed, CUDA graphs on CUDA) and writes OUTPUT: a video file (.mp4, .mkv, .mov: H.264; "
        ".webm: VP9) at the input's rate, or a folder of PNGs (a path without an extension). The "
        "defaults are SD-Turbo's recipe: one UNet step (--steps 2 at --strength 0.5), no guidance. "
        "Video files need the video extra: pip install 'optimum-iobinding[video]'.",
    )
    stream.add_argument("input", metavar="INPUT", help="a video file or a folder of images (read in natural order)")
    stream.add_argument("output", metavar="OUTPUT", help="a video file or a folder for PNG frames")
    stream.add_argument("--prompt", required=True, help="what every frame should become")
    stream.add_argument("--negative-prompt", default=None, help="with --guidance above 1")
    stream.add_argument(
        "--model",
        default=None,
        help="ONNX pipeline folder or hub id: SD 1.x/2.x, SD-Turbo, LCM, or SDXL / SDXL-Turbo (default: a tiny "
        "random model built offline)",
    )
    stream.add_argument(
        "--steps", type=int, default=2, help="the scheduler's steps, of which the last --strength are run (default 2)"
    )
    stream.add_argument(
        "--strength", type=float, default=0.5, help="how far each frame is noised, in (0, 1] (default 0.5)"
    )
    stream.add_argument("--guidance", type=float, default=0.0, help="guidance scale (default 0: none)")
    stream.add_argument(
        "--cfg-type",
        choices=("none", "full", "self", "initialize"),
        default="full",
        help="how --guidance above 1 guides (StreamDiffusion's cfg_type): full (a negative-prompt row per frame "
        "row; default), self or initialize (residual guidance from the stream's stock noise: no extra row, or one), "
        "none",
    )
    stream.add_argument(
        "--delta", type=float, default=1.0, help="residual guidance's scale of the stock noise (default 1.0)"
    )
    stream.add_argument(
        "--similarity-threshold",
        type=float,
        default=None,
        help="skip a frame nearly equal to the last kept one (StreamDiffusion's similarity filter; e.g. 0.98), "
        "writing the last output again; default: no filter",
    )
    stream.add_argument(
        "--max-skip-frame",
        type=int,
        default=10,
        help="with the filter: keep a frame after this many skips (default 10)",
    )
    stream.add_argument(
        "--control-image",
        action="append",
        default=None,
        metavar="FILE",
        help="a ControlNet model's control image for every frame (an edge or depth map; repeat it, one per "
        "ControlNet, for a model with several)",
    )
    stream.add_argument(
        "--control-scale",
        type=float,
        action="append",
        default=None,
        help="how much a ControlNet's residuals count (default 0.8; repeat it, one per ControlNet)",
    )
    add_ip_adapter_arguments(stream)
    stream.add_argument("--seed", type=int, default=0, help="the stream's fixed noise (default 0)")
    stream.add_argument(
        "--tiny-vae",
        default=None,
        metavar="FOLDER",
        help="an AutoencoderTiny export (vae_encoder/, vae_decoder/; optimum-iobinding export "
        "--tiny-vae) in place of the model's VAE",
    )
    stream.add_argument(
        "--size",
        default=None,
        help="fit every frame to this size, 512 or 768x512 (width x height; scaled to cover, "
        "centre cropped); default: the input's. Both must be multiples of the model's size "
        "multiple, 8 × 2^(the UNet's down blocks − 1): 64 for Stable Diffusion 1.x/2.x and SD-Turbo, 32 for SDXL",
    )
    stream.add_argument(
        "--stream-batch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with several UNet steps, one UNet call a frame holding consecutive frames at their "
        "steps (default); --no-stream-batch runs a frame's steps in turn",
    )
    stream.add_argument(
        "--overwrite", action="store_true", help="replace an existing OUTPUT (once the new one is whole)"
    )
    stream.add_argument("--provider", default=None, help="ORT execution provider (default: CUDA if available)")
    stream.add_argument(
        "--cache-dir", default=None, help="where the tiny model is built (default ~/.cache/optimum-iobinding)"
    )
    stream.set_defaults(run=run_stream)

    add_command(commands, "bench", help="benchmark every peer on the GPU (optimum-iobinding bench --help)")
    export = add_command(commands, "export", help="export a diffusers pipeline to the ONNX layout")
    add_export_arguments(export)
    export.set_defaults(run=run_export)
    parser.set_defaults(command_parsers=commands.choices)  # each command's parser, for its own usage errors
    return parser


def parse_arguments(argv: List[str]) -> argparse.Namespace:
    """``argv`` parsed; no command, or an option no parser knows, is refused in one line (exit status 2): the
    commands named, or the options of the command it was given to that it is close to."""
    from .errors import unrecognized_arguments

    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command is None:
        parser.error(f"command: expected one of {', '.join(args.command_parsers)}, got none (see --help)")
    if unknown:
        command = args.command_parsers.get(args.command, parser)
        command.error(
            unrecognized_arguments(unknown, (option for action in command._actions for option in action.option_strings))
        )
    return args


def show_warnings() -> None:
    """This project's warnings, one line each: ``optimum-iobinding: WARNING: …``."""
    import logging

    logging.basicConfig(level=logging.WARNING, format="optimum-iobinding: %(levelname)s: %(message)s")


# Errors about what the user passed (a file, a size, a setting; a path that cannot be written or is a folder where a
# file is asked for): exit status 2, as argparse's own usage errors.
USAGE_ERRORS = (
    UsageError,
    ValueError,
    TypeError,
    FileNotFoundError,
    FileExistsError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
)


class Terminated(BaseException):
    """SIGTERM arrived (a ``kill``, a container's stop): raised in the main thread, as Ctrl-C's ``KeyboardInterrupt``
    is, so that what a command was writing is removed on the way out (an export's temporary folder, a partial
    video)."""


@contextmanager
def terminated_as_interrupted(command: Optional[str]) -> Iterator[None]:
    """SIGTERM ends the command as Ctrl-C does (:class:`Terminated`) while the block runs, in the main thread; the
    handler before is put back after. ``serve`` handles its signals itself (Ray Serve's shutdown)."""
    if command == "serve" or threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:  # (None: a handler set from C, which Python cannot put back; the default then)
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def main(argv: Optional[List[str]] = None) -> int:
    """Runs a command. Errors are one line, ``optimum-iobinding: error: <message>``: exit status 2 for a mistake in
    what was asked (arguments, files, sizes), 1 for a failure while doing it; ``--debug``, before or after the
    command's name, shows the traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((arg for arg in argv if arg != "--debug"), None)
    if command == "bench":  # its own parser: many options, and one peer per process behind it
        from .bench.cli import main as bench_main

        start = argv.index("bench")
        debug = "--debug" in argv
        bench_argv = [arg for arg in argv[start + 1 :] if arg != "--debug"]  # bench takes no values like "--debug"

        def run() -> int:
            return bench_main(bench_argv)
    else:
        args = parse_arguments(argv)
        show_warnings()
        debug = args.debug

        def run() -> int:
            return args.run(args)

    return one_line_errors(run, debug, "optimum-iobinding", command)


def one_line_errors(run: Callable[[], Any], debug: bool, program: str, command: Optional[str] = None) -> int:
    """``run()``'s status (0 where it returns ``None``), every error one line, ``PROGRAM: error: <message>``: 2 for a
    mistake in what was asked (:data:`USAGE_ERRORS`), 1 for a failure while doing it, 130 for Ctrl-C and 143 for
    SIGTERM (see :func:`terminated_as_interrupted`); with ``debug`` the traceback instead."""
    try:
        with terminated_as_interrupted(command):
            return run() or 0
    except KeyboardInterrupt:
        print(f"{program}: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print(f"{program}: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except Exception as error:  # noqa: BLE001 — every error becomes one line (or a traceback with --debug)
        if debug:
            raise
        print(f"{program}: error: {error}", file=sys.stderr)
        return 2 if isinstance(error, USAGE_ERRORS) else 1


# what the examples call the pipelines' loading arguments
SCRIPT_OPTIONS = {"pretrained_model_name_or_path": "--model", "provider": "--provider"}


def run_script(main: Callable[[], Any], names: Mapping[str, str] = SCRIPT_OPTIONS) -> int:
    """An example script's ``main()`` as the commands run: its errors one line naming the script, with the
    commands' exit statuses, a refused argument of ``names`` called by the script's option (``--model``); ``--debug``
    anywhere among its arguments (taken out before ``main`` parses them) shows the traceback.
    ``sys.exit(run_script(main))`` ends each script in examples/."""
    debug = "--debug" in sys.argv[1:]
    sys.argv[1:] = [arg for arg in sys.argv[1:] if arg != "--debug"]
    show_warnings()
    quiet_libraries()  # the libraries' notices, as the commands quiet them

    def run() -> Any:
        with options_named(names):
            return main()

    return one_line_errors(run, debug, Path(sys.argv[0]).name)


if __name__ == "__main__":
    sys.exit(main())
