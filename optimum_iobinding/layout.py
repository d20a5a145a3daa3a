"""The ONNX folder layout, read and written in one place: model_index.json, the component folders, tokenizers and the
scheduler config; and the safe way to write such a folder (built beside it, moved into place when whole).

Pipelines read it (:mod:`optimum_iobinding.pipelines`), the exporter and ``save_pretrained`` write it; neither
imports the other.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from .errors import ArgumentError, ArgumentPathError, ArgumentTypeError

ONNX_COMPONENTS = ("text_encoder", "unet", "vae_encoder", "vae_decoder")
# the class diffusers' ONNX Stable Diffusion folders name in their model_index.json
DIFFUSERS_ONNX_CLASS_NAME = "OnnxStableDiffusionPipeline"
# What a ControlNet gives and its UNet takes: one residual per down-block output, one for the mid block.
DOWN_RESIDUAL_OUTPUT, MID_RESIDUAL_OUTPUT = "down_block_res_sample_", "mid_block_res_sample"
DOWN_RESIDUAL_INPUT, MID_RESIDUAL_INPUT = "down_block_additional_residual_", "mid_block_additional_residual"
# Every ControlNet takes the control image (or its latents) and the factor its outputs are scaled by.
CONTROLNET_CONDITION, CONTROLNET_SCALE = "controlnet_cond", "conditioning_scale"
# What a FLUX.1 ControlNet gives and its transformer takes (diffusers' controlnet_block_samples and
# controlnet_single_block_samples): one sample per ControlNet block of each kind, numbered from 0, for the transformer's
# double-stream and single-stream blocks; and the mode a union ControlNet takes (one per row).
FLUX_CONTROLNET_BLOCK_SAMPLE = "controlnet_block_sample_"
FLUX_CONTROLNET_SINGLE_BLOCK_SAMPLE = "controlnet_single_block_sample_"
FLUX_CONTROLNET_MODE = "controlnet_mode"
# What a UNet exported for IP-Adapter takes: each cross-attention layer's image-prompt keys and values (in the order of
# the UNet's attention processors, numbered from 0; the adapter's scale already in the values), and the folder of the
# image encoder that makes the image embeddings (diffusers' name)
IP_ADAPTER_KEY_INPUT, IP_ADAPTER_VALUE_INPUT = "ip_adapter_key_", "ip_adapter_value_"
IMAGE_ENCODER = "image_encoder"
# the key of the UNet's config.json that lists those layers' module names, in the inputs' order (per-block scales)
IMAGE_PROMPT_LAYERS_KEY = "image_prompt_layers"


# The step caches' part graphs, written by the export beside a denoiser's model.onnx and read by the pipelines:
# First-Block Cache's three (the embeddings and first block, the other blocks, the final norm and projection) and the
# values the export marks for them, in the order the marked transformer returns them after its own output ...
FIRST_BLOCK_CACHE_PARTS = ("head.onnx", "body.onnx", "out.onnx")
FIRST_BLOCK_MARKS = (
    "first_block_input",
    "first_block_hidden_states",
    "first_block_encoder_hidden_states",
    "blocks_output",
)
# ... and DeepCache's: the whole UNet with every branch's feature as an extra output, and one shallow graph per branch
DEEP_CACHE_FULL_PART = "deep_cache_full.onnx"
DEEP_CACHE_SHALLOW_PART = "deep_cache_shallow_{branch}.onnx"
DEEP_CACHE_FEATURE_PREFIX = "deep_features."


# The parts of a UNet whose sessions and first runs a pipeline makes side by side (the export's ``cold_start_parts``):
# part k of K in a file of its own beside the UNet's model.onnx, numbered from 0
COLD_START_PART = "cold_part_{number}.onnx"


def cold_start_part_files(folder: Path) -> List[Path]:
    """The cold-start parts beside a UNet (in its ``folder``), in order: ``cold_part_0.onnx``, ``cold_part_1.onnx``
    and so on while the next one is there; none where there are fewer than two."""
    found = []
    while (folder / COLD_START_PART.format(number=len(found))).is_file():
        found.append(folder / COLD_START_PART.format(number=len(found)))
    return found if len(found) >= 2 else []


def deep_cache_shallow_branch(file_name: str) -> Optional[int]:
    """The branch of a DeepCache shallow part's file name (:data:`DEEP_CACHE_SHALLOW_PART`), or ``None``."""
    prefix, suffix = DEEP_CACHE_SHALLOW_PART.split("{branch}")
    number = (
        file_name[len(prefix) : -len(suffix)] if file_name.startswith(prefix) and file_name.endswith(suffix) else ""
    )
    if not number.isdigit() or (number != "0" and number.startswith("0")) or not number.isascii():
        return None
    return int(number)


def deep_cache_shallow_parts(folder: Path) -> Dict[int, Path]:
    """The DeepCache shallow parts beside a UNet (in its ``folder``), by branch; none where the folder is not there."""
    if not folder.is_dir():
        return {}
    return {branch: path for path in folder.iterdir() if (branch := deep_cache_shallow_branch(path.name)) is not None}


def missing_first_block_cache_parts(folder: Path) -> List[str]:
    """The First-Block Cache parts (:data:`FIRST_BLOCK_CACHE_PARTS`) not beside a transformer (in its ``folder``)."""
    return [name for name in FIRST_BLOCK_CACHE_PARTS if not (folder / name).is_file()]


def step_cache_part_files(folder: Path) -> List[Path]:
    """The step caches' part graphs beside a denoiser (in its ``folder``): First-Block Cache's and DeepCache's."""
    named = [folder / name for name in (*FIRST_BLOCK_CACHE_PARTS, DEEP_CACHE_FULL_PART)]
    return [path for path in named if path.is_file()] + sorted(deep_cache_shallow_parts(folder).values())


def controlnet_component_names(count: int) -> tuple:
    """diffusers' folder names for ``count`` ControlNets: ``controlnet``, ``controlnet_1``, ``controlnet_2`` …"""
    return tuple("controlnet" if k == 0 else f"controlnet_{k}" for k in range(count))


# ------------------------------------------------------------------------------------------------ safe writing
def check_output_folder(
    output_dir: Union[str, os.PathLike],
    source: Union[str, os.PathLike, None] = None,
    overwrite: bool = False,
    argument: str = "output_dir",
    overwrite_argument: str = "overwrite=True",
) -> Path:
    """Checks, before any work, that writing a folder at ``output_dir`` destroys nothing it did not make, and that a
    folder can be made there.

    Refused: the source folder itself, a folder inside it, a folder holding it (replacing that would delete the
    source), a file, a non-empty folder unless ``overwrite`` (which then replaces it whole), and a path where no
    folder can be made (:func:`check_writable`). The errors name ``argument`` and, for a non-empty folder, say to
    pass ``overwrite_argument``: the caller's words for them (a command line gives its options).

    Returns:
        ``output_dir`` as a path.
    """
    target = Path(output_dir).expanduser()
    resolved = target.resolve()
    working = Path.cwd().resolve()
    if resolved == working or resolved in working.parents:
        raise ArgumentError(
            argument,
            f"expected a folder apart from the working folder {str(working)!r}, got {os.fspath(output_dir)!r}, which "
            f"{'is' if resolved == working else 'holds'} it: the folder is written elsewhere and then moved into place",
        )
    if source is not None:
        source_resolved = Path(source).expanduser().resolve()
        if resolved == source_resolved or source_resolved in resolved.parents:
            raise ArgumentError(
                argument,
                f"expected a folder outside the source folder {str(source_resolved)!r}, got "
                f"{str(target)!r}, which is {'the source itself' if resolved == source_resolved else 'inside it'}: "
                "writing there would overwrite or bury the files being read",
            )
        if resolved in source_resolved.parents:
            raise ArgumentError(
                argument,
                f"expected a folder that does not hold the source folder "
                f"{str(source_resolved)!r}, got {str(target)!r}: replacing it would delete the source",
            )
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"{argument}: expected a folder, got the file {str(target)!r}")
    if target.is_dir():
        entries = sorted(entry.name for entry in target.iterdir())
        if entries and not overwrite:
            raise FileExistsError(
                f"{argument}: expected a new or empty folder, got {str(target)!r} holding {len(entries)} entr{'y' if len(entries) == 1 else 'ies'} "
                f"({', '.join(entries[:3])}{', …' if len(entries) > 3 else ''}); pass {overwrite_argument} to replace "
                "it whole, or choose another folder"
            )
    check_writable(target, argument)
    return target


def check_writable(target: Path, argument: str) -> None:
    """Refuses, before any work, a ``target`` whose folder cannot be made: its nearest existing parent is a file, or
    a folder that takes no new folder (read-only, ``/proc``), tried by making and removing an empty one there."""
    existing = next((path for path in [target.parent, *target.parent.parents] if path.exists()), None)
    if existing is None:
        return
    if not existing.is_dir():
        raise NotADirectoryError(
            f"{argument}: expected a folder that can be written, got {str(target)!r}, but "
            f"{str(existing)!r} is not a folder"
        )
    try:
        os.rmdir(tempfile.mkdtemp(prefix=f".{target.name}.probe-", dir=existing))
    except OSError as error:
        raise unwritable(error, target, argument, f"making a folder in {str(existing)!r} failed") from error


def unwritable_reason(folder: Path) -> Optional[str]:
    """Why nothing can be written in ``folder`` (or made where it would be made: its nearest existing parent), in a
    few words, or ``None``. Asked by writing: a file made and removed at once, as a permission bit does not say it
    for root, a read-only mount or /proc."""
    existing = next((p for p in [folder, *folder.parents] if p.exists()), None)
    if existing is None:
        return None
    if not existing.is_dir():
        return f"{str(existing)!r} is not a folder"
    try:
        handle, probe = tempfile.mkstemp(prefix=".optimum-iobinding-", dir=existing)
    except OSError as error:
        return f"{str(existing)!r} takes no new file ({error.strerror or error})"
    os.close(handle)
    os.unlink(probe)
    return None


@contextlib.contextmanager
def building_beside(target: Path, argument: str = "output_dir") -> Iterator[Path]:
    """Yields a new folder, inside a temporary one beside ``target`` (with the permissions the user's umask gives);
    when the block ends without an error, the folder replaces ``target`` (whole: nothing of a previous ``target``
    stays); when it raises (or is interrupted), the temporary folder is removed and ``target`` is left exactly as it
    was. Only what was there when the block began is replaced: a ``target`` that was absent or empty then, and that
    something else filled meanwhile (another export to the same folder, a user's file), is left as it is and a
    ``FileExistsError`` naming ``argument`` is raised.

    The temporary folder is the layout's own: a failure to make it, to write into it or to move it into place is
    raised as the same kind of ``OSError`` naming ``argument`` and ``target`` (see :func:`unwritable`); other errors
    pass as they are."""
    target = Path(target)
    scratch = None
    # the caller agreed to replace what is there now (a link to a folder is replaced, as a folder is)
    replaces = target.is_symlink() or (target.is_dir() and any(target.iterdir()))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
        # the folder yielded is made inside the temporary one, not the temporary one itself: made by mkdir, it has
        # the permissions the user's umask gives (others may read an export a server runs as another user), not
        # mkdtemp's private 0700
        building = scratch / target.name
        building.mkdir()
    except OSError as error:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        raise unwritable(error, target, argument, f"making a folder in {str(target.parent)!r} failed") from error
    try:
        yield building
    except OSError as error:
        shutil.rmtree(scratch, ignore_errors=True)
        inside = _path_inside(error, building)
        if inside is None:
            raise
        raise unwritable(
            error, target, argument, "writing it failed" if inside == "." else f"writing {inside} failed"
        ) from error
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    try:
        if replaces:
            replace_folder(building, target)
        else:  # a rename replaces an empty folder, and refuses a folder something else filled meanwhile
            os.replace(building, target)
    except OSError as error:
        if not replaces and error.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise FileExistsError(
                f"{argument}: expected a new or empty folder, got {str(target)!r}, which something else filled while "
                "this one was written; it was left as it is, and nothing was written there"
            ) from None
        raise unwritable(error, target, argument, "moving the finished folder into place failed") from error
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _path_inside(error: OSError, folder: Path) -> Optional[str]:
    """The path, relative to ``folder``, that ``error`` names inside it (``"."``: ``folder`` itself), or ``None``."""
    for name in (error.filename, error.filename2):
        if name is None or not isinstance(name, (str, bytes, os.PathLike)):
            continue
        try:
            return Path(os.fsdecode(name)).relative_to(folder).as_posix()
        except ValueError:
            continue
    return None


def unwritable(error: OSError, target: Path, argument: str, what: str) -> OSError:
    """``error``, met writing the folder ``target`` (``what`` failed), as an error of the same class (and errno)
    that names ``argument`` and ``target``, the folder the caller gave, instead of the temporary one beside it."""
    reason = error.strerror or str(error) or type(error).__name__
    message = f"{argument}: expected a folder that can be written, got {str(target)!r}: {what} ({reason})"
    try:
        replacement = type(error)(message)
    except Exception:  # a subclass with a constructor of its own
        replacement = OSError(message)
    replacement.errno = error.errno
    return replacement


def replace_folder(new: Path, target: Path) -> None:
    """Moves folder ``new`` to ``target``, replacing what was there; the previous folder is deleted only after the
    new one is in place (and put back if the move fails)."""
    if not target.exists():
        os.replace(new, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.rmdir(old)
    os.replace(target, old)
    try:
        os.replace(new, target)
    except BaseException:
        os.replace(old, target)
        shutil.rmtree(new, ignore_errors=True)
        raise
    if old.is_symlink():  # a link was the target: the link goes, never what it pointed to
        old.unlink()
    else:
        shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------------------------------------ reading
def read_json_object(path: Union[str, os.PathLike]) -> Optional[Dict[str, Any]]:
    """A JSON object file (``config.json``, ``model_index.json``, ``scheduler_config.json``); ``None`` where it is
    absent; an error naming the file where it is not a JSON object."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: expected a JSON object, got a file that does not parse: {error}") from error
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got a JSON {type(value).__name__}")
    return value


# the opsets an export writes: torch's TorchScript exporter writes up to 20, and the attention of every diffusers model
# (scaled_dot_product_attention) needs 14
MIN_OPSET, MAX_OPSET = 14, 20
TINY_VAE_CLASS = "AutoencoderTiny"  # diffusers' class of TAESD, what `export --tiny-vae` writes in config.json
TINY_VAE_HALVES = ("vae_encoder", "vae_decoder")


def check_tiny_vae_class(folder: Path, argument: str = "tiny_vae", shown: Optional[str] = None) -> None:
    """The VAE of a tiny VAE's ``folder`` is a tiny one: its halves' config.json name no other class (a full VAE
    would run with the tiny one's scaling and make wrong frames without an error). Refused as ``argument``, the
    folder shown as ``shown`` (the user's words; default the path)."""
    for name in TINY_VAE_HALVES:
        found = (read_json_object(folder / name / "config.json") or {}).get("_class_name")
        if found is not None and found != TINY_VAE_CLASS:
            raise ArgumentError(
                argument,
                f"expected an {TINY_VAE_CLASS} export (TAESD, made by optimum-iobinding export --tiny-vae), got "
                f"{shown or str(folder)!r}, whose {name} is an {found}; without a tiny VAE the model's own VAE runs",
            )


# Class names a model_index.json may give an ONNX component: diffusers' ONNX layout names OnnxRuntimeModel, optimum's
# export keeps the torch pipeline's index (torch classes; its VAE is one entry, "vae", split into two folders).
_ONNX_COMPONENT_CLASSES = {
    "OnnxRuntimeModel",
    "IOBindingORTModel",
    "ORTModel",
    "CLIPTextModel",
    "CLIPTextModelWithProjection",
    "UNet2DConditionModel",
    "AutoencoderKL",
}

# diffusion-transformer folders (optimum's export of SD3 and FLUX.1): the transformer and the T5 encoder
_ONNX_COMPONENT_CLASSES |= {"SD3Transformer2DModel", "FluxTransformer2DModel", "T5EncoderModel"}
# Wan's folders: its UMT5 encoder, its transformers (Wan 2.2's two experts) and Wan 2.1 I2V's CLIP image encoder
_ONNX_COMPONENT_CLASSES |= {"UMT5EncoderModel", "WanTransformer3DModel", "CLIPVisionModel"}
# the ControlNets of an SDXL or FLUX.1 ControlNet folder (diffusers' ONNX layout names them OnnxRuntimeModel)
_ONNX_COMPONENT_CLASSES |= {"ControlNetModel", "FluxControlNetModel"}


def looks_like_hub_id(name: str) -> bool:
    """``name`` or ``owner/name`` in the Hub's characters (a path like ``./x``, ``/x`` or ``a/b/c`` is not)."""
    parts = name.split("/")
    return 1 <= len(parts) <= 2 and all(
        part and not part.startswith((".", "-")) and all(c.isalnum() or c in "-_." for c in part) for part in parts
    )


# the extensions of weights files: a name ending in one that names nothing here is a missing file, not a hub id
WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")


def missing_weights_file(name: Any) -> bool:
    """``name`` is a path (text) that names nothing here and reads as a file, not a hub id: it ends in a weights
    file's extension (:data:`WEIGHT_FILE_SUFFIXES`) or is no hub id at all."""
    if not isinstance(name, (str, os.PathLike)) or Path(name).expanduser().exists():
        return False
    text = os.fspath(name)
    return text.lower().endswith(WEIGHT_FILE_SUFFIXES) or not looks_like_hub_id(text)


def download_from_hub(name: str, allow_patterns: Sequence[str], argument: str, **hub_kwargs: Any) -> Path:
    """``snapshot_download`` of ``name``; a local path that does not exist, or a download that fails, is one
    line naming the argument (not a 100-line "check your internet connection" traceback)."""
    if not looks_like_hub_id(name):
        raise ArgumentPathError(
            argument, f"expected an existing local folder or a hub repository id, got {name!r}: no such file or folder"
        )
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, allow_patterns=list(allow_patterns), **hub_kwargs))
    except Exception as error:  # offline, unknown repository, no access: all mean "not here, not there"
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ArgumentPathError(
            argument,
            f"{name!r} is not a local folder (no such path here), and the Hugging Face "
            f"Hub could not provide it: {type(error).__name__}: {reason[:200]}",
        ) from error


def resolve_pipeline_folder(
    name_or_path: Union[str, os.PathLike],
    onnx_components: Sequence[str] = ONNX_COMPONENTS,
    tokenizers: Sequence[str] = ("tokenizer",),
    **hub_kwargs: Any,
) -> Path:
    """A pipeline folder: local, or downloaded from the Hub (only the files the pipeline reads)."""
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise ArgumentTypeError(
            "pretrained_model_name_or_path",
            f"expected a folder path or a hub repository id, got {type(name_or_path).__name__} {name_or_path!r}",
        )
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise NotADirectoryError(f"pretrained_model_name_or_path: expected a folder, got the file {str(path)!r}")
    patterns = [f"{c}/*" for c in [*onnx_components, *tokenizers]] + ["scheduler/*", "model_index.json"]
    return download_from_hub(os.fspath(name_or_path), patterns, "pretrained_model_name_or_path", **hub_kwargs)


def read_model_index(folder: Path, onnx_components: Sequence[str] = ONNX_COMPONENTS) -> Dict[str, Any]:
    index = read_json_object(folder / "model_index.json")
    if index is None:
        raise ArgumentPathError("pretrained_model_name_or_path", f"expected a model_index.json in {str(folder)!r}")
    for name, value in index.items():
        if name.startswith("_") or not isinstance(value, list) or len(value) != 2 or value[1] is None:
            continue
        if name in onnx_components:
            if value[1] not in _ONNX_COMPONENT_CLASSES:
                raise ValueError(
                    f"model_index.json: component {name!r} is {value}; expected an ONNX component "
                    f"(one of {sorted(_ONNX_COMPONENT_CLASSES)})"
                )
    return index


def component_class(index: Dict[str, Any], name: str, module: Any, base: Optional[type], default: str) -> type:
    library, class_name = index.get(name) or [None, default]
    class_name = class_name or default
    if not isinstance(class_name, str):
        raise ValueError(
            f"model_index.json: {name}: expected a class name, got {type(class_name).__name__} {class_name!r}"
        )
    component_class = getattr(module, class_name, None)
    if component_class is None or (
        base is not None and not (isinstance(component_class, type) and issubclass(component_class, base))
    ):
        raise ValueError(
            f"model_index.json: {name} class {class_name!r} is not a {module.__name__} "
            f"{base.__name__ if base else 'class'}"
        )
    return component_class


def load_scheduler(folder: Path, index: Dict[str, Any]) -> Any:
    import diffusers
    from diffusers.schedulers.scheduling_utils import SchedulerMixin

    config_path = folder / "scheduler" / "scheduler_config.json"
    config = read_json_object(config_path)
    if config is None:
        raise ArgumentPathError("pretrained_model_name_or_path", f"expected {config_path}")
    default = config.get("_class_name", "PNDMScheduler")
    scheduler_class = component_class(index, "scheduler", diffusers, SchedulerMixin, default)
    return scheduler_class.from_pretrained(str(folder), subfolder="scheduler")


# the largest model_max_length taken as a real one: transformers reports a tokenizer whose config names none as
# int(1e30) (its VERY_LARGE_INTEGER)
MAX_TOKENIZER_LENGTH = 1_000_000


def fixed_length_problem(tokenizer: Any) -> Optional[str]:
    """What is wrong with ``tokenizer``'s ``model_max_length`` as the length its text encoder is fed (CLIP's 77, which
    the pipelines pad every prompt to), e.g. ``"its model_max_length is 1e+30 (…)"``; ``None`` where it can be. A T5
    tokenizer needs none: its length is the call's ``max_sequence_length``."""
    length = getattr(tokenizer, "model_max_length", None)
    if not isinstance(length, (int, float)) or isinstance(length, bool):
        return f"its model_max_length is {length!r}"
    if length > MAX_TOKENIZER_LENGTH:
        return f"its model_max_length is {length:.3g}, transformers' value for a tokenizer_config.json that names none"
    return None if length > 0 else f"its model_max_length is {length!r}"


def load_tokenizer(folder: Path, index: Dict[str, Any], name: str = "tokenizer", fixed_length: bool = True) -> Any:
    """The tokenizer in ``folder / name``, of the class model_index.json names; refused, naming the folder and what
    it holds, where it does not load or is no tokenizer. ``fixed_length``: its ``model_max_length`` is the length the
    text encoder is fed (CLIP), so one that names none is refused too; ``False`` for T5, whose length each call gives
    (``max_sequence_length``), as diffusers' SD3 and Flux pipelines read it."""
    import transformers

    if not (folder / name).is_dir():
        raise ArgumentPathError("pretrained_model_name_or_path", f"expected a {name} folder in {str(folder)!r}")
    tokenizer_class = component_class(index, name, transformers, None, "CLIPTokenizer")
    if not (
        isinstance(tokenizer_class, type)
        and (
            issubclass(tokenizer_class, transformers.PreTrainedTokenizerBase)
            or tokenizer_class is transformers.AutoTokenizer
        )
    ):
        kind = "class" if isinstance(tokenizer_class, type) else type(tokenizer_class).__name__
        raise ValueError(
            f"model_index.json: {name}: expected a transformers tokenizer class (CLIPTokenizer, "
            f"CLIPTokenizerFast, AutoTokenizer …), got the {kind} {index[name][1]!r}, which is not a "
            "tokenizer"
        )
    found = sorted(p.name for p in (folder / name).iterdir())

    def refuse(why: str, error: Optional[BaseException] = None) -> ValueError:
        return ValueError(
            f"{name}: expected a {tokenizer_class.__name__} folder (tokenizer.json, or vocab.json and "
            f"merges.txt, with tokenizer_config.json), got {str(folder / name)!r} holding "
            f"{found or 'nothing'}: {why}"
        )

    try:
        tokenizer = tokenizer_class.from_pretrained(str(folder / name))
    except Exception as error:  # a broken folder fails deep inside transformers (OverflowError, OSError…)
        raise refuse(f"{type(error).__name__}: {str(error)[:200]}") from error
    # an empty folder loads as a tokenizer with no vocabulary and no length limit, which fails only when used
    if len(tokenizer) < 3:
        raise refuse(f"it has {len(tokenizer)} tokens")
    if not isinstance(tokenizer, transformers.PreTrainedTokenizerBase):
        raise refuse(f"it loads as a {type(tokenizer).__name__}, not a tokenizer")
    problem = fixed_length_problem(tokenizer) if fixed_length else None
    if problem is not None:
        raise refuse(f"{problem} (CLIP's is 77: the length its text encoder is fed)")
    return tokenizer


def load_image_processor(folder: Path, index: Dict[str, Any], name: str = "image_processor") -> Any:
    """The image processor in ``folder / name`` (Wan 2.1 I2V's ``CLIPImageProcessor``), of the class
    model_index.json names; refused, naming the folder, where it is no transformers image processor or does not
    load."""
    import transformers

    processor_class = component_class(index, name, transformers, None, "CLIPImageProcessor")
    if not (
        isinstance(processor_class, type)
        and issubclass(processor_class, transformers.image_processing_utils.BaseImageProcessor)
    ):
        raise ValueError(
            f"model_index.json: {name}: expected a transformers image processor class (CLIPImageProcessor …), got "
            f"{index.get(name)!r}"
        )
    try:
        return processor_class.from_pretrained(str(folder / name))
    except Exception as error:  # a missing or broken preprocessor_config.json
        raise ValueError(
            f"{name}: expected a {processor_class.__name__} folder (preprocessor_config.json), got "
            f"{str(folder / name)!r}, which does not load: {type(error).__name__}: {str(error)[:200]}"
        ) from error


# ------------------------------------------------------------------------------------------------------ writing
def save_tokenizer(tokenizer: Any, folder: Union[str, os.PathLike]) -> None:
    """Saves a tokenizer so that transformers 4 and 5 both load it: transformers 5 writes only tokenizer.json, while
    transformers 4's CLIPTokenizer (diffusers' ONNX pipeline, optimum's environment) reads vocab.json and merges.txt,
    which are written here from the BPE model inside tokenizer.json; and transformers 5 writes
    ``extra_special_tokens`` as a list, which transformers 4 reads as a mapping and fails on: an empty one is left
    out."""
    folder = Path(folder)
    tokenizer.save_pretrained(str(folder))
    config_path = folder / "tokenizer_config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text(encoding="utf-8"))
        if config.get("extra_special_tokens") == []:
            del config["extra_special_tokens"]
            config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        return
    backend = folder / "tokenizer.json"
    if not backend.is_file():
        return
    model = json.loads(backend.read_text(encoding="utf-8")).get("model", {})
    if model.get("type") != "BPE":
        return
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    (folder / "vocab.json").write_text(json.dumps(model["vocab"], ensure_ascii=False), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{m}\n" for m in merges), encoding="utf-8")


def write_model_index(
    folder: Union[str, os.PathLike],
    scheduler_class: str,
    tokenizer_class: str = "CLIPTokenizer",
    components: Sequence[str] = ONNX_COMPONENTS,
    class_name: str = DIFFUSERS_ONNX_CLASS_NAME,
) -> None:
    """Writes model_index.json as diffusers' ONNX pipeline expects it (its components are ``OnnxRuntimeModel``),
    naming ``class_name`` (default: diffusers' ONNX Stable Diffusion pipeline, which loads the folder too)."""
    import diffusers

    index = {
        "_class_name": class_name,
        "_diffusers_version": diffusers.__version__,
        "feature_extractor": [None, None],
        "requires_safety_checker": False,
        "safety_checker": [None, None],
        "scheduler": ["diffusers", scheduler_class],
        "tokenizer": ["transformers", tokenizer_class],
    }
    for name in components:
        index[name] = ["diffusers", "OnnxRuntimeModel"]
    Path(folder, "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True))


def write_xl_model_index(
    folder: Union[str, os.PathLike],
    class_name: str,
    scheduler_class: str,
    modules: Dict[str, Optional[str]],
    force_zeros_for_empty_prompt: bool = True,
    requires_aesthetics_score: bool = False,
    controlnets: Sequence[str] = (),
) -> None:
    """SDXL folders follow optimum's export: the torch pipeline's index (torch class names; one ``vae`` entry for the
    two VAE folders), which optimum's ``ORTStableDiffusionXLPipeline`` and ours both load. ``modules`` maps
    text_encoder(_2) and tokenizer(_2) to their transformers class name, or ``None`` where the pipeline has none;
    ``controlnets``: the ControlNet folders of an SDXL ControlNet pipeline."""
    import diffusers

    index = {
        "_class_name": class_name,
        "_diffusers_version": diffusers.__version__,
        "force_zeros_for_empty_prompt": bool(force_zeros_for_empty_prompt),
        "requires_aesthetics_score": bool(requires_aesthetics_score),
        "feature_extractor": [None, None],
        "image_encoder": [None, None],
        "scheduler": ["diffusers", scheduler_class],
        "unet": ["diffusers", "UNet2DConditionModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }
    for name in ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"):
        index[name] = ["transformers", modules[name]] if modules.get(name) else [None, None]
    for name in controlnets:
        index[name] = ["diffusers", "ControlNetModel"]
    Path(folder, "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True))


def index_entry(module: Any) -> Optional[Tuple[str, str]]:
    """A component's model_index.json entry, ``(library, class name)`` (``None`` for a missing one), as both the
    export and ``save_pretrained`` write it: transformers 5's ``T5Tokenizer`` is the fast one (``T5TokenizerFast`` is
    its alias there), while transformers 4's ``T5Tokenizer`` needs a sentencepiece file the folder does not have; the
    fast name loads in both. An image processor is named by its class, not transformers 5's backend of it
    (``CLIPImageProcessorPil`` without torchvision), which transformers 4 has not."""
    if module is None:
        return None
    library = "diffusers" if type(module).__module__.startswith("diffusers") else "transformers"
    name = type(module).__name__
    if name == "T5Tokenizer" and getattr(module, "is_fast", False):
        name = "T5TokenizerFast"
    for backend in ("ImageProcessorPil", "ImageProcessorFast"):  # transformers 5's backends of one image processor
        if name.endswith(backend):
            name = name[: -len(backend)] + "ImageProcessor"  # the class every transformers version loads
    return library, name


def write_transformer_model_index(
    folder: Union[str, os.PathLike],
    class_name: str,
    modules: Dict[str, Optional[Tuple[str, str]]],
    settings: Optional[Dict[str, Any]] = None,
) -> None:
    """Diffusion-transformer folders (SD3, Flux, Wan) follow optimum's export: the torch pipeline's index, each
    component as ``[library, class name]`` (``[null, null]`` where ``modules`` gives ``None``), which optimum's ORT
    pipelines and ours both load, and the pipeline's ``settings`` as they are (Wan's ``boundary_ratio``)."""
    import diffusers

    index: Dict[str, Any] = {"_class_name": class_name, "_diffusers_version": diffusers.__version__}
    index.update(settings or {})
    for name, entry in modules.items():
        index[name] = list(entry) if entry is not None else [None, None]
    Path(folder, "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True))


# ------------------------------------------------------------------------------------------------ LoRA map
# Where each torch layer's weight went in an ONNX export (written by the export, read by runtime LoRA).
LORA_MAP_NAME = "lora_map.json"
LORA_MAP_VERSION = 1


@dataclass(frozen=True)
class WeightPlace:
    """Where (part of) an initializer holds one torch weight.

    Attributes:
        initializer: the initializer's name.
        layout: ``"same"`` (the torch layout), ``"transposed"`` (a Linear weight as ``(in, out)``), ``"nhwc"`` (a
            Conv2d weight as ``(out, kh, kw, in)``) or ``"packed"`` (a Linear weight, transposed, as part ``index``
            of ``parts`` packed side by side in an ``(in, parts·out)`` weight: per head, ``heads`` blocks of
            ``parts`` × ``out / heads`` columns; ``heads`` 1 is plain concatenation).
    """

    initializer: str
    layout: str
    parts: int = 1
    index: int = 0
    heads: int = 1


def write_weight_map(places: Dict[str, List[WeightPlace]], folder: Union[str, Path], layers: Sequence[str]) -> Path:
    """Writes ``lora_map.json`` into ``folder``: the places, and the layers the torch module had without a place."""
    missing = sorted(set(layers) - set(places))
    path = Path(folder) / LORA_MAP_NAME
    path.write_text(
        json.dumps(
            {
                "version": LORA_MAP_VERSION,
                "layers": {name: [asdict(place) for place in found] for name, found in sorted(places.items())},
                "not_found": missing,
            },
            indent=1,
        )
    )
    return path


def read_weight_map(folder: Union[str, Path]) -> Tuple[Dict[str, List[WeightPlace]], List[str]]:
    """The places and the layers without one, from the ``lora_map.json`` in ``folder``.

    Raises:
        FileNotFoundError: the folder has no map (an export made before LoRA support: export again).
        ValueError: the map is of another version or malformed.
    """
    path = Path(folder) / LORA_MAP_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no {LORA_MAP_NAME}; it is written by optimum-iobinding's export, which "
            "records where each layer's weight went. Export the model again to use LoRA with it"
        )
    try:
        data = json.loads(path.read_text())
        if data.get("version") != LORA_MAP_VERSION:
            raise ValueError(f"version {data.get('version')!r}, expected {LORA_MAP_VERSION}")
        places = {name: [WeightPlace(**place) for place in found] for name, found in data["layers"].items()}
        return places, list(data.get("not_found", []))
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: not a LoRA map this version reads: {error}") from None


# ------------------------------------------------------------------------------------------------ folded biases
# A transformer rewrite (export/transformer_fusions.py: the attention's value bias moved into its output projection's
# bias) makes a bias that holds a product with a weight: ``c' = c + b_v · W_o[rows]``. Where a LoRA changes ``W_o``,
# ``c'`` must change with it, so the export records each fold in the model's metadata under this key (a JSON list of
# ``{"bias", "weight", "offset", "value_bias"}``: the folded bias's initializer, ``W_o``'s initializer in the
# ``(in, out)`` layout, the first of its rows the fold read, and ``b_v``), and the runtime keeps those biases as
# owned tensors whatever their size, which runtime LoRA updates with their weight.
FOLDED_BIASES_KEY = "optimum_iobinding.folded_biases"


def folded_biases(model: Any) -> List[Dict[str, Any]]:
    """The folds recorded in ``model``'s metadata (an ``onnx.ModelProto``), or none."""
    for entry in model.metadata_props:
        if entry.key == FOLDED_BIASES_KEY:
            return list(json.loads(entry.value))
    return []


def record_folded_bias(model: Any, bias: str, weight: str, offset: int, value_bias: Sequence[float]) -> None:
    """Adds one fold to ``model``'s metadata (see :data:`FOLDED_BIASES_KEY`)."""
    folds = folded_biases(model) + [
        {"bias": bias, "weight": weight, "offset": int(offset), "value_bias": [float(v) for v in value_bias]}
    ]
    for entry in model.metadata_props:
        if entry.key == FOLDED_BIASES_KEY:
            entry.value = json.dumps(folds)
            return
    entry = model.metadata_props.add()
    entry.key, entry.value = FOLDED_BIASES_KEY, json.dumps(folds)


# ------------------------------------------------------------------------------------------ Wan's causal 3-D VAE
# Wan 2.1/2.2's VAE (diffusers' AutoencoderKLWan) runs chunk by chunk: the decoder one latent frame per call, the
# encoder the first video frame and then four at a time, each causal convolution reading the last input frames of the
# chunk before (its feature cache). Each of vae_decoder/ and vae_encoder/ holds two graphs over one weights file:
# model.onnx, the first chunk (the VAE's input alone in; its output and the cache out), and WAN_VAE_CHUNK_PART, every
# later chunk (the input and the cache in; the output and the next cache out, of the same shapes).
WAN_VAE_CHUNK_PART = "chunk.onnx"
WAN_VAE_WEIGHTS_FILE = "model.onnx_data"
WAN_VAE_DECODER_INPUT, WAN_VAE_DECODER_OUTPUT = "latent_sample", "sample"
WAN_VAE_ENCODER_INPUT, WAN_VAE_ENCODER_OUTPUT = "sample", "latent_sample"  # the latent distribution's mode
WAN_VAE_CACHE_INPUT = "past_features.{index}"
WAN_VAE_CACHE_OUTPUT = "present_features.{index}"


def wan_vae_cache_names(count: int) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """The cache's input names and output names of a Wan VAE chunk graph with ``count`` cached layers, in order:
    output ``i`` of one chunk is input ``i`` of the next."""
    return (
        tuple(WAN_VAE_CACHE_INPUT.format(index=index) for index in range(count)),
        tuple(WAN_VAE_CACHE_OUTPUT.format(index=index) for index in range(count)),
    )
