"""Exporting one component, for every family: the torch modules and export specs that the families share (CLIP, its
pooled output found on the device; the T5 encoder; the VAE, full or tiny) and the two component exporters, each of
which writes ``model.onnx`` (with its weights beside it where they are large) and ``config.json`` in a folder of its
own:

- :func:`export_component`: the path of the UNet families' components, which the diffusion transformers' CLIP and VAE
  take too: the attention that ORT's optimizer fuses, ORT's optimizer by component name, float16, the map of
  where each LoRA layer's weight went, and a UNet's DeepCache parts (:mod:`.deep_cache`).
- :func:`export_model`: the path of a diffusion transformer and a T5 encoder: ORT's transformer optimizer by model
  type (``mmdit``, ``t5``), with the module made traceable by the family while the exporter runs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, Optional, Sequence

import onnx
import torch

from ..errors import ArgumentError
from ..layout import write_weight_map
from .attention import attention_as_one_node, constant_attention_scale, fused_vae_attention
from .bfloat16 import to_bfloat16
from .deep_cache import marked_unet_spec, name_marks_before_divisions_by_one, write_unet_with_deep_cache_parts
from .lora_places import lora_layers, weight_map
from .optimize import (
    EXTERNAL_DATA_FILE,
    MAX_SINGLE_FILE_BYTES,
    convert_to_float16,
    fold_pads_into_convs,
    fusion_options,
    fusion_options_for,
    in_folder,
    optimize_component,
    optimized_to_float16,
    optimizer_model_type,
    remove_same_type_casts,
    save_onnx,
    use_classic_attention,
)
from .cold_parts import write_cold_start_parts
from .step_cache import drop_marks, marked_transformer_spec, write_step_cache_parts
from .transformer_fusions import fuse_diffusion_transformer

logger = logging.getLogger(__name__)

__all__ = [
    "pooled_output",
    "clip_text_encoder_spec",
    "t5_encoder_spec",
    "vae_specs",
    "is_tiny_vae",
    "to_precision",
    "PRECISIONS",
    "fix_output_dims",
    "export_component",
    "export_model",
    "save_model",
    "torchscript_export",
    "EXTERNAL_DATA_THRESHOLD",
    "OPTIMUM_EXTERNAL_DATA_FILE",
]

# Weights beyond this many bytes go to an external-data file: protobuf cannot serialize a message over 2 GiB, and the
# graph itself needs some of that (the limit every export of the project keeps).
EXTERNAL_DATA_THRESHOLD = MAX_SINGLE_FILE_BYTES
# optimum's name for the external-data file of a diffusion transformer's components (the diffusers layout of the UNet
# families names it :data:`~optimum_iobinding.export.optimize.EXTERNAL_DATA_FILE`)
OPTIMUM_EXTERNAL_DATA_FILE = "model.onnx_data"
# model types ORT's optimizer is run on for CUDA only: its T5 fusions always write RelativePositionBias, an operator
# with a CUDA kernel only (a CPU session refuses the model); the CPU gets the T5 graph as exported
_OPTIMIZED_FOR_CUDA_ONLY = frozenset({"t5"})


# ------------------------------------------------------------------------------------------------ text encoders
def end_of_text_positions(input_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """Where each sequence's end-of-text token is, the position CLIP pools, as transformers finds it (the first id
    equal to ``eos_token_id``; with a config from before transformers fixed CLIP's eos id, 2, the first largest id) —
    but with the ArgMax over a 0/1 float mask: ONNX Runtime's CUDA provider has no ArgMax over integers, so an ArgMax
    over ``input_ids`` stays on the CPU, keeps the text encoder out of CUDA graphs and makes the host wait. Every
    float here is an integer below 2048, exact in float16 too (a float16 export converts them): the largest id is
    found in two steps, its multiple of 2048 and then its remainder."""
    if eos_token_id != 2:
        return (input_ids == eos_token_id).to(torch.float32).argmax(dim=-1)
    high = torch.div(input_ids, 2048, rounding_mode="floor")
    low = (input_ids - high * 2048).to(torch.float32)
    high = high.to(torch.float32)
    top = high == high.max(dim=-1, keepdim=True).values
    low = torch.where(top, low, torch.full_like(low, -1.0))
    largest = top & (low == low.max(dim=-1, keepdim=True).values)
    return largest.to(torch.float32).argmax(dim=-1)


def pooled_output(text_encoder, last_hidden_state: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """CLIP's pooled output (the end-of-text token's final hidden state), pooled on the device (see
    :func:`end_of_text_positions`) by a gather along the sequence: transformers indexes the rows with an arange of
    the batch, which ONNX Runtime computes on the CPU from the input's shape and copies up (one graph per input shape
    refused). transformers' own pooling is left unused, so the exporter drops it."""
    positions = end_of_text_positions(input_ids, text_encoder.config.eos_token_id)
    # the index as wide as the states by a broadcast add (the exporter knows its shape: the output's width stays
    # declared), the row taken by index: no shape arithmetic on the CPU, no squeeze (the exporter writes a dynamic
    # squeeze as an If)
    index = positions[:, None, None] + torch.zeros_like(last_hidden_state[:, :1], dtype=positions.dtype)
    return torch.gather(last_hidden_state, 1, index)[:, 0]


class ClipTextEncoder(torch.nn.Module):
    """A CLIP text encoder as optimum exports it for SD3, SDXL and Flux: with a projection, ``text_embeds`` (the
    projected pooled output) then ``last_hidden_state``; without one, ``last_hidden_state`` then ``pooler_output``;
    then, with ``hidden_states``, every layer's ``hidden_states.i``. Each attention is one causal
    ``MultiHeadAttention`` node (:func:`~.attention.attention_as_one_node`) and the pooled output is pooled on the
    device (see :func:`pooled_output`): no node of the graph computes on the CPU from the input's shape, so a CUDA
    session captures one graph per input shape."""

    def __init__(self, text_encoder: torch.nn.Module, with_projection: bool, hidden_states: bool = True):
        super().__init__()
        self.text_encoder = text_encoder
        self.with_projection = with_projection
        self.hidden_states = hidden_states

    def forward(self, input_ids: torch.Tensor):
        # each attention one causal MultiHeadAttention node: no causal mask built from the sequence's length
        with attention_as_one_node(self.text_encoder, causal=True):
            output = self.text_encoder(input_ids=input_ids, output_hidden_states=self.hidden_states, return_dict=True)
        last = output.last_hidden_state
        pooled = pooled_output(self.text_encoder, last, input_ids)
        layers = tuple(output.hidden_states) if self.hidden_states else ()
        if self.with_projection:
            return (self.text_encoder.text_projection(pooled), last, *layers)
        return (last, pooled, *layers)


def clip_text_encoder_spec(
    text_encoder: torch.nn.Module, sequence: int, with_projection: bool, hidden_states: bool = True
) -> Dict[str, Any]:
    """The export spec of a CLIP text encoder with optimum's names (``CLIPTextWithProjectionOnnxConfig`` /
    ``CLIPTextOnnxConfig``): int64 ``input_ids`` of dynamic batch and sequence; outputs as :class:`ClipTextEncoder`.

    Args:
        text_encoder: a transformers ``CLIPTextModelWithProjection`` (``with_projection``) or ``CLIPTextModel``.
        sequence: the example's sequence length (the tokenizer's ``model_max_length``).
        with_projection: export ``text_embeds`` (the projection) instead of ``pooler_output``.
        hidden_states: also export every layer's hidden states (SD3 and SDXL read the penultimate; Flux none).

    Returns:
        The spec: ``module``, example ``args``, ``input_names``, ``output_names``, ``dynamic_axes``, ``config``.
    """
    pooled = "text_embeds" if with_projection else "pooler_output"
    layers = [f"hidden_states.{i}" for i in range(text_encoder.config.num_hidden_layers + 1)] if hidden_states else []
    names = [pooled, "last_hidden_state"] if with_projection else ["last_hidden_state", pooled]
    return dict(
        module=ClipTextEncoder(text_encoder, with_projection, hidden_states),
        args=(torch.zeros(1, sequence, dtype=torch.int64),),
        input_names=["input_ids"],
        output_names=names + layers,
        dynamic_axes={
            "input_ids": {0: "batch", 1: "sequence"},
            pooled: {0: "batch"},
            **{name: {0: "batch", 1: "sequence"} for name in ["last_hidden_state", *layers]},
        },
        config=text_encoder.config,
    )


class T5Encoder(torch.nn.Module):
    """transformers' ``T5EncoderModel``: ``input_ids`` → ``last_hidden_state`` (optimum's ``T5EncoderOnnxConfig``)."""

    def __init__(self, text_encoder: torch.nn.Module):
        super().__init__()
        self.text_encoder = text_encoder

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.text_encoder(input_ids=input_ids, return_dict=True).last_hidden_state


def t5_encoder_spec(text_encoder: torch.nn.Module, sequence: int = 16) -> Dict[str, Any]:
    """The export spec of a T5 encoder with optimum's names: int64 ``input_ids`` (batch, sequence) →
    ``last_hidden_state``; both dims dynamic (T5's relative positions take any length, so a short example exports
    faster)."""
    return dict(
        module=T5Encoder(text_encoder),
        args=(torch.zeros(1, sequence, dtype=torch.int64),),
        input_names=["input_ids"],
        output_names=["last_hidden_state"],
        dynamic_axes={"input_ids": {0: "batch", 1: "sequence"}, "last_hidden_state": {0: "batch", 1: "sequence"}},
        config=text_encoder.config,
    )


# ---------------------------------------------------------------------------------------------------------- VAE
class _VaeEncoder(torch.nn.Module):
    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, sample):
        return self.vae.encode(sample).latent_dist.mode()


class _TinyVaeEncoder(torch.nn.Module):
    """diffusers' ``AutoencoderTiny``: images in [-1, 1] → its latents (deterministic: what diffusers' img2img
    pipelines take from its ``encode(...).latents``)."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, sample):
        return self.vae.encode(sample).latents


class _VaeDecoder(torch.nn.Module):
    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, latent_sample):
        return self.vae.decode(latent_sample, return_dict=False)[0]


def is_tiny_vae(vae) -> bool:
    """``vae`` is diffusers' ``AutoencoderTiny`` (TAESD)."""
    from diffusers import AutoencoderTiny

    return isinstance(vae, AutoencoderTiny)


def vae_specs(vae, latent_size: int) -> Dict[str, dict]:
    """The ``vae_encoder`` and ``vae_decoder`` specs of an ``AutoencoderKL`` or an ``AutoencoderTiny``: the same
    names, dtypes and dynamic axes for both (every pipeline loads either), examples of ``latent_size`` latents."""
    config = vae.config
    if is_tiny_vae(vae):
        # EncoderTiny halves the size in every block but the first; DecoderTiny upsamples after every block but the last
        encoder_factor = 2 ** (len(config.encoder_block_out_channels) - 1)
        decoder_factor = config.upsampling_scaling_factor ** (len(config.decoder_block_out_channels) - 1)
        encoder = _TinyVaeEncoder(vae)
    else:
        encoder_factor = decoder_factor = 2 ** (len(config.block_out_channels) - 1)
        encoder = _VaeEncoder(vae)
    image_size = latent_size * encoder_factor
    return {
        "vae_encoder": dict(
            module=encoder,
            args=(torch.randn(1, config.in_channels, image_size, image_size),),
            input_names=["sample"],
            output_names=["latent_sample"],
            dynamic_axes={
                "sample": {0: "batch", 2: "height", 3: "width"},
                "latent_sample": {0: "batch", 2: f"height / {encoder_factor}", 3: f"width / {encoder_factor}"},
            },
            # the exporter (or ORT's optimizer) may name the output's channels ("Slice…_dim_1", "Conv…_dim_1"):
            # fixed here, the output's size is known before the run and the model can be captured as a CUDA graph
            fixed_output_dims={"latent_sample": {1: config.latent_channels}},
            config=config,
            class_name=type(vae).__name__,
        ),
        "vae_decoder": dict(
            module=_VaeDecoder(vae),
            args=(torch.randn(1, config.latent_channels, latent_size, latent_size),),
            input_names=["latent_sample"],
            output_names=["sample"],
            # output dims as expressions of the input dims: sized before the run without shape inference (ours)
            # or eval (optimum's IO binding, which fails on a dim name no input has)
            dynamic_axes={
                "latent_sample": {0: "batch", 2: "latent_height", 3: "latent_width"},
                "sample": {0: "batch", 2: f"latent_height * {decoder_factor}", 3: f"latent_width * {decoder_factor}"},
            },
            fixed_output_dims={"sample": {1: config.out_channels}},  # as the encoder's
            config=config,
            class_name=type(vae).__name__,
        ),
    }


# ------------------------------------------------------------------------------------------------------ writing
# the precisions a component is exported in (:func:`to_precision`)
PRECISIONS = ("fp32", "fp16", "bf16")


def to_precision(exported: Path, optimized: Any, dtype: str, float32_inputs: Sequence[str] = ()) -> onnx.ModelProto:
    """The model exported to ``exported`` (with any external data beside it), or ORT's optimization of it
    (``optimized``, an ``OnnxModel``; ``None``: none), in memory, in the precision ``dtype`` (one of
    :data:`PRECISIONS`):

    - ``"fp32"``: as exported (or optimized).
    - ``"fp16"``: ORT's float16 converter: every float input and output but ``float32_inputs`` becomes float16, and
      the arithmetic of the timestep/guidance embeddings and rotary tables stays float32 (see
      :func:`~optimum_iobinding.export.optimize.float32_island`).
    - ``"bf16"``: that float16 model retyped to bfloat16, its weights rounded from the float32 ones and the ops
      without a bfloat16 CUDA kernel kept float32 (:func:`~optimum_iobinding.export.bfloat16.to_bfloat16`).
    """
    if dtype not in PRECISIONS:
        raise ArgumentError("dtype", f"expected one of {', '.join(map(repr, PRECISIONS))}, got {dtype!r}")
    scratch = exported.parent
    if optimized is not None:
        if dtype == "fp32":
            model = optimized.model
            onnx.load_external_data_for_model(model, str(scratch))
            return model
        float32 = None
        if dtype == "bf16":  # the float32 graph, its weights still on disk: the conversion edits optimized.model
            float32 = onnx.ModelProto()
            float32.CopyFrom(optimized.model)
        half = optimized_to_float16(optimized, scratch, float32_inputs)
        return half if float32 is None else to_bfloat16(half, float32, base_dir=scratch, in_place=True)
    if dtype == "fp32":
        return onnx.load(str(exported))
    # Types of every intermediate first, from the file (works past 2 GiB, unlike in-memory inference): without
    # them the converter turns Resize's float scales into float16, which ORT refuses.
    typed_path = scratch / "typed.onnx"
    onnx.shape_inference.infer_shapes_path(str(exported), str(typed_path))
    half = convert_to_float16(onnx.load(str(typed_path)), shapes_known=True, float32_inputs=float32_inputs)
    if dtype == "fp16":
        return half
    return to_bfloat16(half, onnx.load(str(exported), load_external_data=False), base_dir=scratch, in_place=True)


def fix_output_dims(model: onnx.ModelProto, fixed: Dict[str, Dict[int, int]]) -> None:
    """Declares ``fixed[output][axis]`` as the size of those output dims (in place)."""
    for output in model.graph.output:
        for axis, size in fixed.get(output.name, {}).items():
            dim = output.type.tensor_type.shape.dim[axis]
            dim.Clear()
            dim.dim_value = int(size)


def save_model(model: onnx.ModelProto, path: Path, external_data_threshold: int = EXTERNAL_DATA_THRESHOLD) -> bool:
    """Writes ``model`` to ``path``; with its weights in ``model.onnx_data`` beside it (optimum's layout) where they
    exceed ``external_data_threshold`` bytes. Returns whether it wrote external data."""
    return save_onnx(model, path, external_data_threshold, OPTIMUM_EXTERNAL_DATA_FILE)


def torchscript_export(spec: Dict[str, Any], path: Path, opset: int) -> None:
    """Exports ``spec``'s module through the TorchScript exporter, without gradients, its tracer's notes on
    diffusers' and transformers' modules silenced (they are not the user's to act on).

    Args:
        spec: an export spec: ``module``, ``args``, ``input_names``, ``output_names``, ``dynamic_axes``.
        path: the ``.onnx`` file to write.
        opset: ONNX opset.
    """
    with torch.no_grad(), warnings.catch_warnings():
        # the TorchScript exporter's notes on the Python control flow it traced, the constant folding it skipped, its
        # own deprecation and how it spells advanced indexing: expected for diffusers' and transformers' modules, and
        # not the user's to act on
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        for message in (
            "Constant folding - Only steps=1",
            "You are using the legacy TorchScript-based ONNX export",
            "The feature will be removed",
            "Exporting aten::index operator of advanced indexing",
        ):
            warnings.filterwarnings("ignore", message=message)
        torch.onnx.export(
            spec["module"].eval(),
            spec["args"],
            str(path),
            dynamo=False,
            input_names=spec["input_names"],
            output_names=spec["output_names"],
            dynamic_axes=spec["dynamic_axes"],
            opset_version=opset,
            do_constant_folding=True,
        )


def export_component(
    name: str,
    spec: dict,
    target: Path,
    opset: int,
    fp16: bool,
    optimize: Optional[str],
    xl: bool = False,
    external_data_threshold: int = MAX_SINGLE_FILE_BYTES,
    external_data_file: str = EXTERNAL_DATA_FILE,
    step_cache: bool = False,
    cold_start_parts: int = 0,
) -> None:
    """Exports one component the UNet families' way (text encoder, UNet, ControlNet, VAE; a diffusion transformer's
    CLIP and VAE too) to ``target/name``: the TorchScript exporter (with the attention ORT's optimizer fuses), ORT's
    optimizer (``optimize``), float16 (``fp16``), the LoRA map of a UNet or text encoder, ``model.onnx`` (its
    weights in ``external_data_file`` beside it past ``external_data_threshold`` bytes) and ``config.json``.

    ``step_cache`` (a UNet): DeepCache's parts beside ``model.onnx`` (:mod:`.deep_cache`: ``deep_cache_full.onnx``
    and a ``deep_cache_shallow_<branch>.onnx`` per branch), all reading its weights, which then go to
    ``model.onnx_data`` whatever their size. ``cold_start_parts`` (a UNet, 2 or more): that many parts whose sessions
    and first runs a pipeline makes side by side (:mod:`.cold_parts`), reading its weights."""
    layers_of = getattr(spec["module"], "unet", None) or getattr(spec["module"], "text_encoder", None)
    hooks: Callable[[torch.nn.Module], ContextManager] = lambda module: contextlib.nullcontext()  # noqa: E731
    branches: Dict[int, str] = {}
    if step_cache:  # the features marked as outputs while ORT's optimizer runs
        spec, hooks, branches = marked_unet_spec(spec)
    with tempfile.TemporaryDirectory() as scratch:
        scratch_path = Path(scratch) / "model.onnx"
        attention: ContextManager = constant_attention_scale()  # plain: nothing of the attention on the CPU
        if optimize and optimizer_model_type(name) == "vae":  # ORT's VAE attention fusion cannot: see .attention
            attention = fused_vae_attention(spec["module"])
        elif optimize:
            attention = contextlib.nullcontext()
            use_classic_attention(spec["module"])
        with attention, hooks(spec["module"]):
            torchscript_export(spec, scratch_path, opset)
        exported = onnx.load(str(scratch_path), load_external_data=False)  # weights past 2 GiB stay in their files
        changed = fold_pads_into_convs(exported)
        if step_cache and optimize:  # so that ORT's optimizer keeps a graph that computes every mark
            changed = name_marks_before_divisions_by_one(exported, list(branches.values())) or changed
        if optimize:  # ORT's optimizer would remove them too, rewriting the whole graph once for each
            changed = remove_same_type_casts(exported) or changed
        if changed:
            onnx.save_model(exported, str(scratch_path))
        del exported
        optimized = (
            optimize_component(name, scratch_path, fusion_options(name, spec["config"], optimize), optimize)
            if optimize
            else None
        )
        model = to_precision(scratch_path, optimized, "fp16" if fp16 else "fp32")
    if layers_of is not None:  # where each layer's weight went: runtime LoRA updates it there
        (target / name).mkdir(parents=True, exist_ok=True)
        write_weight_map(weight_map(layers_of, model), target / name, [layer for layer, _ in lora_layers(layers_of)])
    fix_output_dims(model, spec.get("fixed_output_dims", {}))
    if step_cache:
        write_unet_with_deep_cache_parts(model, target / name, branches)
    else:  # with cold-start parts the weights go to their file whatever their size: the parts read them there
        threshold = 0 if cold_start_parts else external_data_threshold
        save_onnx(model, target / name / "model.onnx", threshold, external_data_file)
    if cold_start_parts:
        write_cold_start_parts(target / name, cold_start_parts)
    config = spec["config"].to_dict() if hasattr(spec["config"], "to_dict") else dict(spec["config"])
    if spec.get("class_name"):  # which torch class it came from (an AutoencoderKL or AutoencoderTiny VAE)
        config.setdefault("_class_name", spec["class_name"])
    config.update(spec.get("config_extra", {}))  # what the export adds (an IP-Adapter UNet's layer names)
    if fp16 and config.get("force_upcast"):
        # diffusers upcasts such a VAE to float32 before decoding (SDXL's stock VAE overflows float16); a float16 ONNX
        # model cannot be upcast, and pipelines that try (optimum-onnx's, through diffusers' upcast_vae) fail.
        if xl:  # SD 1.x/2.x VAEs decode fine in float16 although their configs say force_upcast too
            logger.warning(
                "%s: the VAE's config says force_upcast=True (SDXL's stock VAE overflows float16 and then decodes "
                "NaN/black images), but this export is float16 and cannot be upcast, so its config.json says "
                "force_upcast=false. If the images come out black, export a float16-safe VAE: vae= (CLI: --vae), "
                "e.g. madebyollin/sdxl-vae-fp16-fix.",
                name,
            )
        config["force_upcast"] = False
    (target / name / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str))


# The project's own rewrites of a component's graph after ORT's optimizer, by ORT's model type: the diffusion
# transformers' modulated LayerNorms, GELU biases, rotary embeddings and value biases (see :mod:`.transformer_fusions`)
GRAPH_REWRITES: Dict[str, Callable[[onnx.ModelProto], Dict[str, int]]] = {"mmdit": fuse_diffusion_transformer}


def export_model(
    name: str,
    spec: Dict[str, Any],
    target: Path,
    opset: int,
    optimize: Optional[str],
    model_type: str,
    external_data_threshold: int = EXTERNAL_DATA_THRESHOLD,
    exportable: Optional[Callable[[torch.nn.Module], ContextManager]] = None,
    step_cache: bool = False,
    dtype: str = "fp32",
) -> None:
    """Exports one transformer-family component (a diffusion transformer, a T5 encoder) to ``target/name``: the
    TorchScript exporter, then ORT's transformer optimizer (``optimize``: ``"cuda"`` or ``"cpu"``; ``model_type``,
    e.g. ``t5`` or ``mmdit``; again without the attention fusion where that fusion raises) with the weights kept on
    disk and the project's rewrites of that model type after it (:data:`GRAPH_REWRITES`), then the precision
    ``dtype`` (:func:`to_precision`: ORT's float16 converter, and for bfloat16 the float16 graph retyped), then a
    diffusion transformer's LoRA map (``lora_map.json``: where each layer's weight went, through the fusions and
    rewrites; the biases a rewrite folded from a weight are in the model's metadata), ``model.onnx`` (and its
    external data above ``external_data_threshold`` bytes) and ``config.json``.

    Args:
        name: the component's folder name.
        spec: its export spec (``module``, ``args``, ``input_names``, ``output_names``, ``dynamic_axes``, ``config``).
        target: the pipeline folder.
        opset: ONNX opset.
        optimize: ``"cuda"``, ``"cpu"`` or ``None``; for ``"cpu"`` a T5 encoder is left as exported (ORT's T5 fusions
            write an operator only CUDA runs).
        model_type: ORT's optimizer model type of the component.
        external_data_threshold: weights above this many bytes go to ``model.onnx_data``.
        exportable: a context manager factory that makes the module traceable while the exporter runs (given the
            module; it puts back what it changed).
        step_cache: a diffusion transformer's First-Block Cache parts too (:mod:`.step_cache`: ``head.onnx``,
            ``body.onnx``, ``out.onnx`` beside ``model.onnx``, all reading its weights in ``model.onnx_data``;
            cut from the model in ``dtype``).
        dtype: ``"fp32"``, ``"fp16"`` or ``"bf16"`` (see :func:`to_precision`).
    """
    hooks: Callable[[torch.nn.Module], ContextManager] = lambda module: contextlib.nullcontext()  # noqa: E731
    layers_of = getattr(spec["module"], "transformer", None)  # a diffusion transformer's layers, as LoRAs name them
    if step_cache:  # the parts' ends marked as outputs while ORT's optimizer and the rewrites run
        spec, hooks = marked_transformer_spec(spec)
        external_data_threshold = 0  # the weights in one file that the parts read too
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "model.onnx"
        with (exportable or (lambda module: contextlib.nullcontext()))(spec["module"]), hooks(spec["module"]):
            torchscript_export(spec, path, opset)
        if optimize == "cpu" and model_type in _OPTIMIZED_FOR_CUDA_ONLY:
            optimize = None
        optimized = (
            optimize_component(name, path, fusion_options_for(model_type, optimize), optimize, model_type)
            if optimize
            else None
        )
        if optimized is not None and model_type in GRAPH_REWRITES:
            rewritten = onnx.ModelProto()  # a copy (the weights stay on disk): a failing rewrite leaves ORT's graph
            rewritten.CopyFrom(optimized.model)
            try:
                with in_folder(path.parent):  # the small constants they read may be on disk beside the model
                    made = GRAPH_REWRITES[model_type](rewritten)
            except Exception as error:  # an unforeseen graph: ORT's optimized graph is still a whole export
                logger.warning(
                    "%s: the graph rewrites failed (%s: %s); exporting ORT's optimized graph without them",
                    name,
                    type(error).__name__,
                    error,
                )
            else:
                optimized.model.CopyFrom(rewritten)
                logger.info("%s: graph rewrites %s", name, made)
        model = to_precision(path, optimized, dtype, spec.get("float32_inputs", ()))
    fix_output_dims(model, spec.get("fixed_output_dims", {}))
    if step_cache:
        drop_marks(model)
    if layers_of is not None:  # where each layer's weight went, after the fusions and rewrites: runtime LoRA
        (target / name).mkdir(parents=True, exist_ok=True)
        write_weight_map(weight_map(layers_of, model), target / name, [layer for layer, _ in lora_layers(layers_of)])
    save_model(model, target / name / "model.onnx", external_data_threshold)
    if step_cache:
        write_step_cache_parts(target / name)
    config = spec["config"].to_dict() if hasattr(spec["config"], "to_dict") else dict(spec["config"])
    (target / name / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str))
