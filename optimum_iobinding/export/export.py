"""Export a diffusers pipeline to an ONNX folder: :func:`export_pipeline` checks the arguments, loads the pipeline and
hands it to its family's exporter, each of which writes its own layout:

- Stable Diffusion 1.x/2.x, LCM, Turbo, ControlNet: the diffusers ONNX layout; SDXL: optimum's (:mod:`.unet`).
- Stable Diffusion 3 / 3.5: optimum's SD3 layout (:mod:`.transformer`).
- FLUX.1: optimum's Flux layout (:mod:`.flux`).
- Wan (text to video): its text encoder and transformers in optimum's diffusion-transformer layout (:mod:`.wan`).

A tiny VAE alone (``export_pipeline(None, folder, tiny_vae=...)``) is written as ``vae_encoder/`` and ``vae_decoder/``
only: no model_index.json, tokenizer or scheduler.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch
from tqdm.auto import tqdm

from ..errors import ArgumentError, ArgumentTypeError, ModelFileError
from ..families import FAMILIES, Family, controlnet_family, t5_tokenizer_of, transformer_family
from ..layout import (
    MAX_OPSET,
    MIN_OPSET,
    building_beside,
    check_output_folder,
    download_from_hub,
    fixed_length_problem,
    looks_like_hub_id,
    read_json_object,
)
from .components import PRECISIONS, export_component, vae_specs
from .flux import export_flux_pipeline, with_flux_controlnets
from .ip_adapter import load_image_encoder
from .step_cache import check_first_block_cache_depth
from .tiny import TINY_RANDOM_KINDS, build_tiny_random_tiny_vae
from .transformer import export_sd3_pipeline
from .wan import export_wan_pipeline
from .unet import check_tiny_vae_fits, controlnets_of, export_unet_pipeline

# the diffusion-transformer exporters, by the name a family's record gives its exporter (Family.export)
TRANSFORMER_EXPORTERS = {"sd3": export_sd3_pipeline, "flux": export_flux_pipeline, "wan": export_wan_pipeline}
# what makes a diffusion-transformer pipeline one with ControlNets (``export MODEL --controlnet ID``), by exporter
CONTROLNET_PIPELINES = {"flux": with_flux_controlnets}

# the checks of the arguments are public too: the command line runs them before it loads anything (check_tiny_vae_fits
# belongs to .unet, since it holds a tiny VAE against the UNet, and is named here beside the others)
__all__ = [
    "export_pipeline",
    "exported_transformer_family",
    "check_transformer_options",
    "check_tiny_vae_arguments",
    "check_tiny_vae_config",
    "check_tiny_vae_fits",
    "resolve_dtype",
    "check_dtype_fits",
]


def export_pipeline(
    model_id_or_path: Optional[str],
    output_dir: Union[str, os.PathLike],
    *,
    dtype: Optional[str] = None,
    fp16: bool = False,
    opset: int = 17,
    optimize: Optional[str] = None,
    tiny_random: Union[bool, str] = False,
    components: Optional[Sequence[str]] = None,
    progress: bool = True,
    pipeline_loader: Optional[Callable[[str], object]] = None,
    torch_pipeline: Optional[object] = None,
    overwrite: bool = False,
    vae: Union[str, os.PathLike, object, None] = None,
    controlnet: Union[str, os.PathLike, object, Sequence[Union[str, os.PathLike, object]], None] = None,
    tiny_vae: Union[str, os.PathLike, object, bool, None] = None,
    step_cache: bool = False,
    vae_dtype: Optional[str] = None,
    ip_adapter: bool = False,
    image_encoder: Union[str, os.PathLike, object, None] = None,
    cold_start_parts: int = 0,
) -> Path:
    """Exports a diffusers Stable Diffusion (1.x/2.x, LCM, Turbo) pipeline to the diffusers ONNX layout, or an SDXL
    pipeline to optimum's SDXL layout (two text encoders with their hidden states; a UNet taking ``text_embeds`` and
    ``time_ids``). A UNet with ``time_cond_proj_dim`` (LCM) also takes ``timestep_cond``. A Stable Diffusion 3
    pipeline goes to optimum's SD3 layout (:func:`optimum_iobinding.export.transformer.export_sd3_pipeline`: the T5
    encoder stays float32 in a float16 export), a ``FluxPipeline`` to optimum's Flux layout (:mod:`.flux`, which
    says each component's precision). SD3's and FLUX.1's transformers can also be exported in bfloat16
    (``dtype="bf16"``, :mod:`.bfloat16`).

    With ``tiny_vae`` and no pipeline (``model_id_or_path=None``, no ``tiny_random`` or ``torch_pipeline``) it writes
    a folder of that tiny VAE alone: ``vae_encoder/`` and ``vae_decoder/`` (what a pipeline takes as its tiny VAE).

    Args:
        model_id_or_path: a local diffusers folder or a hub id; ignored with ``tiny_random``; ``None`` with
            ``tiny_vae`` alone for a folder of the tiny VAE only.
        output_dir: where to write the ONNX folder: a new or empty folder, outside the source folder. The export is
            built in a temporary folder beside it and moved into place only once all of it succeeded: a failed or
            interrupted export leaves ``output_dir`` as it was.
        dtype: the precision: ``"fp32"`` (the default), ``"fp16"`` (export fp32, then convert with ORT's float16
            converter; a diffusion transformer's T5 encoder stays float32), or ``"bf16"`` for SD3 and FLUX.1 only:
            the transformer bfloat16 (its float16 graph retyped, its weights rounded from the float32 ones, the ops
            without a bfloat16 CUDA kernel kept float32 between Casts: :mod:`.bfloat16`), CLIP and the VAE float16,
            T5 float32. A bfloat16 transformer runs on ORT's CUDA provider only (its CPU provider has no bfloat16
            MatMul or Add). A UNet pipeline is refused: most of its ops (Conv below opset 22, GroupNorm, NhwcConv,
            BiasSplitGelu) have no bfloat16 CUDA kernel.
        fp16: ``True`` is ``dtype="fp16"`` (an alias; with another ``dtype`` it is refused).
        opset: ONNX opset.
        optimize: ``"cuda"`` or ``"cpu"``: run ORT's transformer optimizer (model types unet/vae/clip) on each
            component before the fp16 conversion, with the fusions that target runs (see :func:`fusion_options`).
            The CUDA fusions (NhwcConv, GroupNorm, BiasSplitGelu …) only run on the CUDA execution provider.
        tiny_random: build a tiny random-weights pipeline offline instead of loading one: ``True`` or ``"sd"``,
            ``"xl"`` (SDXL), ``"lcm"`` (an LCM UNet with ``timestep_cond``), ``"sd3"`` (Stable Diffusion 3),
            ``"flux"`` or ``"flux-dev"`` (FLUX.1 schnell's and dev's shapes); see :data:`TINY_RANDOM_KINDS`.
        components: which ONNX components to export (default: all the pipeline has).
        progress: show a progress bar.
        pipeline_loader: how to load ``model_id_or_path`` (default ``DiffusionPipeline.from_pretrained``, which
            picks the pipeline class from the folder's model_index.json).
        torch_pipeline: an already built diffusers pipeline to export instead.
        overwrite: replace a non-empty ``output_dir`` — whole: nothing of the previous folder stays.
        vae: a VAE to export instead of the pipeline's: an ``AutoencoderKL``, or its folder or hub id (e.g. SDXL's
            float16-safe ``madebyollin/sdxl-vae-fp16-fix``).
        controlnet: one or several ControlNets (``ControlNetModel`` objects, or their folders or hub ids, e.g.
            ``lllyasviel/sd-controlnet-canny``) to export with a Stable Diffusion 1.x/2.x or SDXL pipeline (e.g.
            ``diffusers/controlnet-canny-sdxl-1.0``), or ``FluxControlNetModel`` objects with a FLUX.1 pipeline (e.g.
            ``InstantX/FLUX.1-dev-Controlnet-Canny``): the folder gets ``controlnet`` (``controlnet_1`` … for more)
            and a denoiser that takes their residuals (a FLUX.1 transformer: their block samples), which the
            family's ControlNet pipeline loads. A diffusers ``StableDiffusionControlNetPipeline``,
            ``StableDiffusionXLControlNetPipeline`` or ``FluxControlNetPipeline`` given as ``torch_pipeline`` (or its
            folder) exports its own.
        tiny_vae: export ``vae_encoder`` and ``vae_decoder`` from this diffusers ``AutoencoderTiny`` (TAESD, a VAE
            a fraction of the full one's cost, for few-step real-time work) instead of the pipeline's VAE: an
            ``AutoencoderTiny``, its folder or hub id (``"madebyollin/taesd"`` for SD 1.x/2.x, ``"madebyollin/taesdxl"``
            for SDXL), or ``True`` for a tiny random one built offline (with ``tiny_random``, or alone). The same
            inputs, outputs and axes as the full VAE's; its ``config.json`` says ``_class_name: AutoencoderTiny`` and
            ``scaling_factor: 1.0``, so the pipelines scale latents as diffusers does with it. Its latent channels
            must be the UNet's.
        step_cache: also write the denoiser's step-cache parts beside its ``model.onnx``, reading its weights,
            which go to ``model.onnx_data`` whatever their size: for SD3, FLUX.1 and Wan First-Block Cache's
            ``transformer/head.onnx``, ``body.onnx`` and ``out.onnx`` (:mod:`optimum_iobinding.export.step_cache`;
            Wan 2.2's ``transformer_2`` its own);
            for Stable Diffusion 1.x/2.x, SDXL and LCM DeepCache's ``unet/deep_cache_full.onnx`` and a
            ``unet/deep_cache_shallow_<branch>.onnx`` per branch (:mod:`optimum_iobinding.export.deep_cache`).
            Not for a ControlNet pipeline or a VAE alone.
        vae_dtype: a Wan pipeline's VAE precision, ``"fp32"`` (its default: diffusers' Wan pipelines run the VAE in
            float32) or ``"fp16"`` (its chunk graphs through ORT's float16 conversion, the RMS norms scaled so that
            nothing overflows: about half the decode's memory and time); refused for the other families, whose VAE
            follows ``dtype``.

        ip_adapter: a Stable Diffusion 1.x/2.x or SDXL UNet that takes IP-Adapter's image-prompt keys and values
            (:mod:`optimum_iobinding.export.ip_adapter`): the pipelines then load any IP-Adapter of the model at run
            time (``load_ip_adapter``), as diffusers does. An adapter diffusers' ``load_ip_adapter`` put on the
            ``torch_pipeline`` is not exported: load it on the ONNX pipeline.
        image_encoder: with ``ip_adapter``, the image encoder to export as ``image_encoder`` (a
            ``CLIPVisionModelWithProjection``, its folder or hub id, e.g. ``h94/IP-Adapter`` with the subfolder
            ``models/image_encoder``: give the folder); the pipeline's own (``torch_pipeline.image_encoder``) where
            it has one. Without one the pipelines take ``ip_adapter_image_embeds`` only.
        cold_start_parts: 0 (the default), or how many parts (2 or more) of the UNet to write beside it, each reading
            its weights: ``unet/cold_part_0.onnx`` … (:mod:`optimum_iobinding.export.cold_parts`). A pipeline makes
            their sessions and first runs side by side, and runs them in turn for the UNet at every step. UNet
            pipelines only.

    Returns:
        The output folder.

    Raises:
        ArgumentError: (a ``ValueError``) an argument out of its range, before any work: ``dtype`` unknown, in
            conflict with ``fp16``, or ``"bf16"`` for a pipeline that is not SD3's or FLUX.1's.
        FileExistsError: ``output_dir`` is not empty (without ``overwrite``) or is a file.
        OSError: no folder can be made or written at ``output_dir`` (the system's error class, naming ``output_dir``
            as given, not the temporary folder beside it).
        ValueError: ``output_dir`` is the source folder, inside it, or holds it; a ``tiny_vae`` that cannot be loaded
            or whose latent channels are not the UNet's.
        TypeError: a ``tiny_vae`` that is not an ``AutoencoderTiny`` (an ``AutoencoderKL`` goes in ``vae``).
    """
    if optimize not in (None, "cuda", "cpu"):
        raise ArgumentError("optimize", f"expected None, 'cuda' or 'cpu', got {optimize!r}")
    if not isinstance(opset, int) or isinstance(opset, bool) or not MIN_OPSET <= opset <= MAX_OPSET:
        raise ArgumentError("opset", f"expected an integer in [{MIN_OPSET}, {MAX_OPSET}] (17 is tested), got {opset!r}")
    if not isinstance(step_cache, bool):
        raise ArgumentError("step_cache", f"expected True or False, got {step_cache!r}")
    if (
        isinstance(cold_start_parts, bool)
        or not isinstance(cold_start_parts, int)
        or not (cold_start_parts == 0 or cold_start_parts >= 2)
    ):
        raise ArgumentError("cold_start_parts", f"expected 0 or an integer of 2 or more, got {cold_start_parts!r}")
    if vae_dtype not in (None, "fp32", "fp16"):
        raise ArgumentError("vae_dtype", f"expected None, 'fp32' or 'fp16', got {vae_dtype!r}")
    if not isinstance(ip_adapter, bool):
        raise ArgumentError("ip_adapter", f"expected True or False, got {ip_adapter!r}")
    if image_encoder is not None and not ip_adapter:
        raise ArgumentError(
            "image_encoder", "expected it with ip_adapter=True (IP-Adapter's image encoder), got it alone"
        )
    if ip_adapter and step_cache:
        raise ArgumentError("ip_adapter", "expected it without step_cache (DeepCache's parts take no image prompt)")
    dtype = resolve_dtype(dtype, fp16)
    tiny_vae = None if tiny_vae is False else tiny_vae
    # what is known before loading: a ControlNet asked for or given, or a VAE alone; the rest once it is loaded
    if step_cache and (
        controlnet is not None
        or _controlnet_kind(tiny_random)
        or (torch_pipeline is not None and controlnets_of(torch_pipeline))
    ):
        _refuse_step_cache_for_controlnets()
    if step_cache and tiny_vae is not None and model_id_or_path is None and torch_pipeline is None and not tiny_random:
        _refuse_step_cache("a VAE alone")
    if vae is not None or controlnet is not None or tiny_vae is not None:  # before anything is loaded or fetched
        check_transformer_options(
            exported_transformer_family(model_id_or_path, torch_pipeline=torch_pipeline, tiny_random=tiny_random),
            vae=vae,
            controlnet=controlnet,
            tiny_vae=tiny_vae,
        )
    vae_only = tiny_vae is not None and model_id_or_path is None and torch_pipeline is None and not tiny_random
    check_tiny_vae_arguments(
        tiny_vae, vae_only=vae_only, random_pipeline=bool(tiny_random), vae=vae, controlnet=controlnet
    )
    check_dtype_fits(
        dtype,
        model_id_or_path,
        torch_pipeline=torch_pipeline,
        tiny_random=tiny_random,
        vae_only=vae_only,
        controlnet=controlnet,
    )
    if vae_only:
        components = vae_only_components(components)
    source = (
        Path(model_id_or_path)
        if (
            model_id_or_path is not None
            and torch_pipeline is None
            and not tiny_random
            and Path(model_id_or_path).exists()
        )
        else None
    )
    target = check_output_folder(output_dir, source, overwrite)
    # the tiny VAE before the pipeline: a name that cannot be loaded fails in seconds, not after the pipeline's minutes
    tiny = load_tiny_vae(tiny_vae) if tiny_vae is not None else None
    if vae_only:
        return _export_vae_only(
            tiny, target, components, opset=opset, fp16=dtype == "fp16", optimize=optimize, progress=progress
        )
    if torch_pipeline is not None:
        pipe = torch_pipeline
    elif tiny_random:
        kind = "sd" if tiny_random is True else tiny_random
        if kind not in TINY_RANDOM_KINDS:
            raise ArgumentError(
                "tiny_random", f"expected True or one of {sorted(TINY_RANDOM_KINDS)}, got {tiny_random!r}"
            )
        pipe = TINY_RANDOM_KINDS[kind]()
    elif model_id_or_path is None:
        raise ArgumentError(
            "model_id_or_path",
            "expected a diffusers folder or hub id (or tiny_random=True; or tiny_vae "
            "alone for a folder of a tiny VAE), got None",
        )
    elif pipeline_loader is not None:
        pipe = pipeline_loader(model_id_or_path)
    else:
        from diffusers import DiffusionPipeline

        pipe = DiffusionPipeline.from_pretrained(model_id_or_path, torch_dtype=torch.float32, safety_checker=None)
    check_tokenizer_lengths(pipe)
    check_dtype_fits(dtype, torch_pipeline=pipe)  # a loaded pipeline is known only now
    if step_cache and controlnets_of(pipe):
        _refuse_step_cache_for_controlnets()
    record = exported_transformer_family(torch_pipeline=pipe) if getattr(pipe, "transformer", None) else None
    if vae_dtype is not None and (record is None or record.export != "wan"):
        title = f"{record.title} pipeline" if record is not None else type(pipe).__name__
        raise ArgumentError(
            "vae_dtype",
            f"expected none for a {title} (its VAE follows the export's precision; only Wan's VAE has one of its "
            f"own), got {vae_dtype!r}",
        )
    if ip_adapter:
        check_ip_adapter_pipeline(pipe)
        if image_encoder is not None:
            pipe.image_encoder = load_image_encoder(image_encoder)
    if getattr(pipe, "transformer", None) is not None:  # a diffusion transformer (SD3, Flux)
        if cold_start_parts:
            raise ArgumentError(
                "cold_start_parts",
                f"expected 0 for a {type(pipe).__name__} (UNet pipelines only), got {cold_start_parts}",
            )
        if step_cache:
            check_first_block_cache_depth(pipe.transformer)
        return _export_transformer_pipeline(
            pipe,
            target,
            vae=vae,
            controlnet=controlnet,
            tiny_vae=tiny_vae,
            components=components,
            opset=opset,
            dtype=dtype,
            optimize=optimize,
            progress=progress,
            step_cache=step_cache,
            **({"vae_dtype": vae_dtype} if vae_dtype is not None else {}),
        )
    return export_unet_pipeline(
        pipe,
        target,
        vae=vae,
        controlnet=controlnet,
        tiny_vae=tiny,
        components=components,
        opset=opset,
        fp16=dtype == "fp16",
        optimize=optimize,
        progress=progress,
        step_cache=step_cache,
        ip_adapter=ip_adapter,
        cold_start_parts=cold_start_parts,
    )


def check_ip_adapter_pipeline(pipe) -> None:
    """IP-Adapter's image-prompt inputs are exported for Stable Diffusion 1.x/2.x and SDXL text to image and image
    to image, with or without ControlNets (and their streams): refuses, naming ``ip_adapter``, the other pipelines
    (inpainting, LCM)."""
    unet = getattr(pipe, "unet", None)
    config = getattr(unet, "config", None)
    if config is None or getattr(config, "in_channels", 4) != 4 or getattr(config, "time_cond_proj_dim", None):
        raise ArgumentError(
            "ip_adapter",
            "expected a Stable Diffusion 1.x/2.x or SDXL pipeline (text or image to image, ControlNets, the stream), "
            "got a "
            f"{type(pipe).__name__}",
        )


def resolve_dtype(dtype: Optional[str], fp16: bool = False) -> str:
    """:func:`export_pipeline`'s precision, one of :data:`~.components.PRECISIONS`: ``dtype``, or where it is ``None``
    its alias ``fp16``'s (``True``: ``"fp16"``; ``False``: ``"fp32"``).

    Raises:
        ArgumentError: ``dtype`` is none of them, or is not ``"fp16"`` while ``fp16`` is ``True``.
    """
    expected = "expected 'fp32', 'fp16' or 'bf16'"
    if dtype is None:
        return "fp16" if fp16 else "fp32"
    if not isinstance(dtype, str) or dtype not in PRECISIONS:
        raise ArgumentError("dtype", f"{expected}, got {dtype!r}")
    if fp16 and dtype != "fp16":
        raise ArgumentError(
            "dtype",
            f"{expected}, got {dtype!r} together with fp16=True, an alias of dtype='fp16'; hint: give dtype alone",
        )
    return dtype


def check_dtype_fits(
    dtype: str,
    model_id_or_path: Optional[Union[str, os.PathLike]] = None,
    *,
    torch_pipeline: Optional[object] = None,
    tiny_random: Union[bool, str] = False,
    vae_only: bool = False,
    controlnet: Optional[object] = None,
) -> None:
    """``"bf16"`` is for the diffusion transformers (SD3/SD3.5, FLUX.1): refused for what is known to be anything
    else, as soon as it is known — a VAE alone, a ControlNet pipeline, a UNet pipeline given or built (tiny random),
    or one whose model_index.json (a local folder's, or that one file fetched from the Hub) names a UNet. On a UNet
    most ops would be kept float32, without a bfloat16 CUDA kernel: ``Conv`` below opset 22, and ORT's ``GroupNorm``,
    ``NhwcConv`` and ``BiasSplitGelu`` (see :mod:`.bfloat16`). Other precisions pass.

    Raises:
        ArgumentError: ``"bf16"`` for anything but an SD3 or FLUX.1 pipeline (naming ``dtype``).
    """
    if dtype != "bf16":
        return
    if vae_only:
        _refuse_bfloat16("a VAE alone")
    if tiny_random == "controlnet" or (
        controlnet is not None
        and controlnet_family(
            exported_transformer_family(model_id_or_path, torch_pipeline=torch_pipeline, tiny_random=tiny_random)
        )
        is None
    ):
        _refuse_bfloat16("a ControlNet pipeline (a UNet)")
    if torch_pipeline is not None:
        if getattr(torch_pipeline, "transformer", None) is None:
            _refuse_bfloat16(f"a {type(torch_pipeline).__name__} (a UNet)")
        return
    if tiny_random:
        kind = "sd" if tiny_random is True else tiny_random
        if kind in TINY_RANDOM_KINDS and _tiny_random_transformer_family(kind) is None:
            _refuse_bfloat16(f"the tiny random {kind} pipeline (a UNet)")
        return
    index = _model_index(model_id_or_path) if model_id_or_path is not None else None
    if index and index.get("unet") and not index.get("transformer"):
        _refuse_bfloat16(f"{os.fspath(model_id_or_path)!r}, whose model_index.json names a UNet")


def _refuse_bfloat16(got: str) -> None:
    raise ArgumentError(
        "dtype",
        f"expected 'fp32' or 'fp16' for {got}, got 'bf16'; hint: bf16 is for Stable "
        "Diffusion 3/3.5 and FLUX.1 (on a UNet most ops would stay float32, without a "
        "bfloat16 CUDA kernel: Conv below opset 22, GroupNorm, NhwcConv, BiasSplitGelu)",
    )


def _refuse_step_cache(got: str) -> None:
    raise ArgumentError(
        "step_cache",
        "expected an SD3, FLUX.1 or Wan pipeline (First-Block Cache's parts) or a Stable "
        "Diffusion 1.x/2.x, SDXL or LCM pipeline without a ControlNet (DeepCache's "
        f"parts), got {got}",
    )


def _controlnet_kind(tiny_random: Union[bool, str]) -> bool:
    """Whether the tiny random kind ``tiny_random`` is a ControlNet pipeline's (its family's denoiser takes a
    ControlNet's outputs: its interface's prefixed inputs)."""
    return any(tiny_random in record.tiny_random and record.interface.prefixed for record in FAMILIES)


def _refuse_step_cache_for_controlnets() -> None:
    _refuse_step_cache(
        "a ControlNet pipeline (its residuals go into the deep blocks that DeepCache's shallow steps skip, and "
        "First-Block Cache's parts take no ControlNet's samples)"
    )


def _export_transformer_pipeline(pipe, target: Path, *, vae, controlnet, tiny_vae, **options) -> Path:
    """A diffusion-transformer pipeline: SD3 through :mod:`.transformer`, FLUX.1 through :mod:`.flux` (the exporter
    its family's record names); with ``controlnet``, made the family's ControlNet pipeline first."""
    record = exported_transformer_family(torch_pipeline=pipe)
    export = TRANSFORMER_EXPORTERS.get(record.export) if record is not None else None
    if export is None:
        raise ArgumentError(
            "model",
            f"expected a Stable Diffusion (1.x/2.x, XL), Stable Diffusion 3 or Flux pipeline, got "
            f"a {type(pipe).__name__} with a {type(pipe.transformer).__name__}, which this version does "
            "not export",
        )
    check_transformer_options(record, vae=vae, controlnet=controlnet, tiny_vae=tiny_vae)  # a loader's pipeline
    if controlnet is not None:
        pipe = CONTROLNET_PIPELINES[record.export](pipe, controlnet)
    return export(pipe, target, **options)


def check_tokenizer_lengths(pipe: Any) -> None:
    """Refuses, before any component is exported, a pipeline whose CLIP tokenizer names no ``model_max_length``
    (transformers then reports 1e30): that length is the text encoder's example input and every prompt's length,
    so neither the export nor the folder's pipeline could run (nor does diffusers'). The T5 tokenizers (SD3's
    ``tokenizer_3``, Flux's ``tokenizer_2``) need none: each call gives their length (``max_sequence_length``).

    Raises:
        ArgumentError: naming the tokenizer and its length.
    """
    t5 = t5_tokenizer_of(exported_transformer_family(torch_pipeline=pipe))
    for name in ("tokenizer", "tokenizer_2", "tokenizer_3"):
        tokenizer = getattr(pipe, name, None)
        if tokenizer is None or name == t5:
            continue
        problem = fixed_length_problem(tokenizer)
        if problem is not None:
            raise ArgumentError(
                name,
                f"expected a {type(tokenizer).__name__} whose model_max_length is the length "
                f"its text encoder is fed (CLIP's 77), got one where {problem}: set "
                "model_max_length in its tokenizer_config.json",
            )


def exported_transformer_family(
    model_id_or_path: Optional[Union[str, os.PathLike]] = None,
    *,
    torch_pipeline: Optional[object] = None,
    tiny_random: Union[bool, str] = False,
) -> Optional[Family]:
    """The diffusion-transformer family (SD3's or FLUX.1's record) of what :func:`export_pipeline` would export, known
    before the pipeline loads: from the pipeline given, the tiny random kind, or the transformer that
    ``model_id_or_path``'s model_index.json names (a local folder's, or that one file fetched from the Hub).
    ``None``: a UNet pipeline, or not known before loading (a repository that cannot be fetched now fails when it
    loads, with the loader's own error)."""
    if torch_pipeline is not None:
        transformer = getattr(torch_pipeline, "transformer", None)
        return transformer_family(type(transformer).__name__) if transformer is not None else None
    if tiny_random:
        return _tiny_random_transformer_family("sd" if tiny_random is True else tiny_random)
    if model_id_or_path is None:
        return None
    index = _model_index(model_id_or_path)
    entry = index.get("transformer") if index else None
    return transformer_family(entry[-1]) if isinstance(entry, list) and entry else None


def _tiny_random_transformer_family(kind: str) -> Optional[Family]:
    """The diffusion-transformer family whose tiny random models include ``kind`` (``None``: a UNet's, or none)."""
    return next(
        (record for record in FAMILIES if kind in record.tiny_random and record.denoiser == "transformer"), None
    )


def _model_index(model_id_or_path: Union[str, os.PathLike]) -> Optional[dict]:
    """The model_index.json of a local diffusers folder, or of a hub repository (that one file fetched); ``None``
    where there is none or it cannot be fetched now (loading the pipeline then fails with the loader's own
    error)."""
    folder = Path(model_id_or_path)
    if not folder.exists():
        if not looks_like_hub_id(os.fspath(model_id_or_path)):
            return None
        try:
            folder = download_from_hub(os.fspath(model_id_or_path), ["model_index.json"], "model_id_or_path")
        except FileNotFoundError:
            return None
    if not folder.is_dir():
        return None
    index = read_json_object(folder / "model_index.json")
    if index is not None and not isinstance(index.get("_class_name"), str):  # diffusers' loader: a bare KeyError
        raise ModelFileError(
            str(folder / "model_index.json"),
            f'expected "_class_name": the diffusers pipeline class of the folder (e.g. "StableDiffusionPipeline"), '
            f"got {index.get('_class_name')!r}",
        )
    return index


def check_transformer_options(record: Optional[Family], *, vae=None, controlnet=None, tiny_vae=None) -> None:
    """A diffusion-transformer pipeline (of the family ``record``, see :func:`exported_transformer_family`) exports
    its own VAE, and no ControlNet unless a family runs its pipelines with ControlNets (FLUX.1's:
    :func:`~optimum_iobinding.families.controlnet_family`): ``vae``, ``controlnet`` and ``tiny_vae`` are refused by
    name, before anything is loaded.

    Raises:
        ArgumentError: (a ``ValueError``) one of them is given for such a pipeline.
    """
    if record is None:
        return
    if controlnet_family(record) is not None:
        controlnet = None  # the family's ControlNet pipeline takes it
    for name, value in (("vae", vae), ("controlnet", controlnet), ("tiny_vae", tiny_vae)):
        if value is not None:
            shown = (
                repr(os.fspath(value))
                if isinstance(value, os.PathLike)
                else repr(value)
                if isinstance(value, (str, bool, list, tuple))
                else type(value).__name__
            )
            raise ArgumentError(
                name,
                f"expected none for a {record.title} pipeline (its own VAE is exported, no ControlNet), got {shown}",
            )


TINY_VAE_COMPONENTS = ("vae_encoder", "vae_decoder")


def check_tiny_vae_arguments(tiny_vae, *, vae_only: bool, random_pipeline: bool, vae=None, controlnet=None) -> None:
    """What can be said of ``tiny_vae`` before anything is loaded: a random one goes with a random pipeline or alone,
    one VAE at a time, and a folder of the VAE alone has nothing else to take."""
    if tiny_vae is None:
        return
    if tiny_vae is True and not (random_pipeline or vae_only):
        raise ArgumentError(
            "tiny_vae",
            "True (a tiny random AutoencoderTiny) goes with tiny_random or alone (a folder of "
            "the tiny VAE only); a trained pipeline needs a trained tiny VAE, e.g. 'madebyollin/taesd' "
            "(SD 1.x/2.x) or 'madebyollin/taesdxl' (SDXL)",
        )
    if vae is not None:
        raise ArgumentError("vae and tiny_vae", "expected one VAE to export, got both")
    if vae_only and controlnet is not None:
        raise ArgumentError(
            "controlnet",
            "expected none for a folder of the tiny VAE alone, got one; export the ControlNet with its pipeline",
        )


def load_tiny_vae(tiny_vae):
    """``tiny_vae`` as a diffusers ``AutoencoderTiny`` in float32: the model itself, one loaded from its folder or hub
    id, or (``True``) a tiny random one built offline.

    Raises:
        TypeError: not an ``AutoencoderTiny``, nor a folder or hub id of one (its config.json names another class).
        ValueError: a folder or hub id that does not load.
    """
    from diffusers import AutoencoderKL, AutoencoderTiny

    if tiny_vae is True:
        return build_tiny_random_tiny_vae()
    if isinstance(tiny_vae, AutoencoderTiny):
        return tiny_vae
    if not isinstance(tiny_vae, (str, os.PathLike)):
        hint = "; an AutoencoderKL is a full VAE: pass it as vae=" if isinstance(tiny_vae, AutoencoderKL) else ""
        raise ArgumentTypeError(
            "tiny_vae",
            f"expected an AutoencoderTiny, its folder or hub id, or True (a tiny random one), "
            f"got {type(tiny_vae).__name__}{hint}",
        )
    name = os.fspath(tiny_vae)

    def unloadable(error: BaseException) -> ValueError:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return ValueError(
            f"tiny_vae: expected an AutoencoderTiny folder or hub id (e.g. 'madebyollin/taesd'), got "
            f"{name!r}, which does not load: {type(error).__name__}: {reason[:200]}"
        )

    try:
        config = AutoencoderTiny.load_config(name)
    except Exception as error:  # no such folder, no config.json, no network, no such repository
        raise unloadable(error) from error
    check_tiny_vae_config(config, name)
    try:
        return AutoencoderTiny.from_pretrained(name, torch_dtype=torch.float32)
    except Exception as error:  # weights missing or not this architecture's
        raise unloadable(error) from error


def check_tiny_vae_config(config: Any, name: str, vae_argument: str = "vae") -> None:
    """``config`` (a config.json's object) is an ``AutoencoderTiny``'s, or names no class; a full VAE's refusal
    says to pass it as ``vae_argument`` (a command line gives its option).

    Raises:
        TypeError: it names another class (an ``AutoencoderKL``'s goes in ``vae``).
    """
    class_name = config.get("_class_name") if isinstance(config, dict) else None
    if class_name not in (None, "AutoencoderTiny"):
        hint = f"; a full VAE goes in {vae_argument}" if class_name == "AutoencoderKL" else ""
        raise ArgumentTypeError(
            "tiny_vae",
            f"expected an AutoencoderTiny folder or hub id, got {name!r}, whose config.json "
            f"names the class {class_name}{hint}",
        )


def vae_only_components(components: Optional[Sequence[str]]) -> tuple:
    """The components of a folder of a tiny VAE alone: both (default), or those of them asked for."""
    components = TINY_VAE_COMPONENTS if components is None else tuple(components)
    unknown = [c for c in components if c not in TINY_VAE_COMPONENTS]
    if unknown or not components:
        raise ArgumentError(
            "components",
            f"a folder of the tiny VAE alone has {list(TINY_VAE_COMPONENTS)}, got "
            f"{unknown or list(components)}; give model_id_or_path (or tiny_random) for a pipeline",
        )
    return components


def _export_vae_only(
    vae, target: Path, components: Sequence[str], *, opset: int, fp16: bool, optimize: Optional[str], progress: bool
) -> Path:
    """A folder of ``vae`` alone: ``vae_encoder/`` and ``vae_decoder/`` (or the one of them in ``components``)."""
    specs = vae_specs(vae, latent_size=8)
    with building_beside(target) as scratch:
        for name in tqdm(components, desc="export", unit="model", disable=not progress):
            export_component(name, specs[name], scratch, opset, fp16, optimize)
    return target
