"""Export a diffusers Stable Diffusion pipeline to the diffusers ONNX layout.

Layout written (what diffusers' ``OnnxStableDiffusionPipeline`` and ours both load)::

    model_index.json            components named as diffusers' ONNX pipeline names them
    text_encoder/model.onnx     input_ids (int32) → last_hidden_state, pooler_output
    unet/model.onnx             sample, timestep, encoder_hidden_states → out_sample
    vae_encoder/model.onnx      sample → latent_sample (the latent distribution's mean: deterministic; a tiny VAE's,
                                diffusers' AutoencoderTiny's, latents)
    vae_decoder/model.onnx      latent_sample → sample
    controlnet/model.onnx       (a ControlNet pipeline) sample, timestep, encoder_hidden_states, controlnet_cond,
                                conditioning_scale → down_block_res_sample_0 … _N-1, mid_block_res_sample;
                                controlnet_1/, controlnet_2/ … for more than one ControlNet (diffusers' names), and a
                                UNet that also takes down_block_additional_residual_0 … and mid_block_additional_residual
    */config.json               the torch component's config (scaling factor, channels, block widths)
    tokenizer/, scheduler/

Large models go to one external-data file ``weights.pb`` next to their ``model.onnx``, as diffusers writes them.

A tiny VAE alone (``export_pipeline(None, folder, tiny_vae=...)``) is written as ``vae_encoder/`` and ``vae_decoder/``
only: no model_index.json, tokenizer or scheduler.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence, Union

import onnx
import torch
from tqdm.auto import tqdm

from ..layout import (
    DOWN_RESIDUAL_INPUT,
    DOWN_RESIDUAL_OUTPUT,
    MID_RESIDUAL_INPUT,
    MID_RESIDUAL_OUTPUT,
    ONNX_COMPONENTS,
    building_beside,
    check_output_folder,
    controlnet_component_names,
    download_from_hub,
    looks_like_hub_id,
    read_json_object,
    save_tokenizer,
    write_model_index,
    write_weight_map,
    write_xl_model_index,
)
from .attention import fused_vae_attention
from .lora_places import lora_layers, weight_map
from .optimize import (EXTERNAL_DATA_FILE, MAX_SINGLE_FILE_BYTES, convert_to_float16, fold_pads_into_convs,
                       fusion_options, optimize_component, optimized_to_float16, optimizer_model_type, save_onnx,
                       use_classic_attention)
from .tiny import TINY_RANDOM_KINDS, build_tiny_random_tiny_vae

logger = logging.getLogger(__name__)

__all__ = ["export_pipeline"]


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
    :func:`end_of_text_positions`); transformers' own pooling is left unused, so the exporter drops it."""
    rows = torch.arange(last_hidden_state.shape[0], device=last_hidden_state.device)
    return last_hidden_state[rows, end_of_text_positions(input_ids, text_encoder.config.eos_token_id)]


class _TextEncoder(torch.nn.Module):
    def __init__(self, text_encoder):
        super().__init__()
        self.text_encoder = text_encoder

    def forward(self, input_ids):
        output = self.text_encoder(input_ids=input_ids, return_dict=True)
        return output.last_hidden_state, pooled_output(self.text_encoder, output.last_hidden_state, input_ids)


class _TextEncoderWithHiddenStates(torch.nn.Module):
    """SDXL's encoders, as optimum exports them: the pooled output first for the projection model (``text_embeds``),
    then ``last_hidden_state`` (and ``pooler_output`` for the plain one), then every layer's ``hidden_states.i``
    (the pipeline takes the penultimate)."""

    def __init__(self, text_encoder, with_projection: bool):
        super().__init__()
        self.text_encoder = text_encoder
        self.with_projection = with_projection

    def forward(self, input_ids):
        output = self.text_encoder(input_ids=input_ids, output_hidden_states=True, return_dict=True)
        pooled = pooled_output(self.text_encoder, output.last_hidden_state, input_ids)
        if self.with_projection:
            return (self.text_encoder.text_projection(pooled), output.last_hidden_state, *output.hidden_states)
        return (output.last_hidden_state, pooled, *output.hidden_states)


class _UNet(torch.nn.Module):
    """``sample, timestep, encoder_hidden_states`` and, where the UNet takes them, ``timestep_cond`` (LCM's guidance
    embedding) and SDXL's ``text_embeds``, ``time_ids``."""

    def __init__(self, unet, extra_inputs: Sequence[str] = ()):
        super().__init__()
        self.unet = unet
        self.extra_inputs = tuple(extra_inputs)

    def forward(self, sample, timestep, encoder_hidden_states, *extra):
        named = dict(zip(self.extra_inputs, extra))
        added = {key: named[key] for key in ("text_embeds", "time_ids") if key in named} or None
        down = [named[name] for name in self.extra_inputs if name.startswith(DOWN_RESIDUAL_INPUT)] or None
        return self.unet(sample, timestep, encoder_hidden_states, timestep_cond=named.get("timestep_cond"),
                         added_cond_kwargs=added, down_block_additional_residuals=down,
                         mid_block_additional_residual=named.get(MID_RESIDUAL_INPUT), return_dict=False)[0]



class _ControlNet(torch.nn.Module):
    """A ControlNet whose residuals come out scaled by ``conditioning_scale``, one factor per residual (down blocks,
    then mid): a plain call gives every residual the same factor, guess mode diffusers' ``logspace(-1, 0)`` ramp, and
    steps outside the guidance window 0 — all the same graph."""

    def __init__(self, controlnet):
        super().__init__()
        self.controlnet = controlnet

    def forward(self, sample, timestep, encoder_hidden_states, controlnet_cond, conditioning_scale):
        down, mid = self.controlnet(sample, timestep, encoder_hidden_states, controlnet_cond, conditioning_scale=1.0,
                                    guess_mode=False, return_dict=False)
        return (*(residual * conditioning_scale[i] for i, residual in enumerate(down)), mid * conditioning_scale[-1])


def controlnets_of(pipe) -> list:
    """The pipeline's ControlNets in order (a ``MultiControlNetModel``'s nets), or ``[]``."""
    controlnet = getattr(pipe, "controlnet", None)
    if controlnet is None:
        return []
    return list(getattr(controlnet, "nets", None) or [controlnet])



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


def is_xl(pipe) -> bool:
    """An SDXL pipeline: a second text encoder, or a UNet conditioned on pooled text and time ids."""
    return getattr(pipe, "text_encoder_2", None) is not None or \
        getattr(pipe.unet.config, "addition_embed_type", None) == "text_time"


def onnx_components_of(pipe) -> tuple:
    """The ONNX components a torch pipeline exports to (SDXL's refiner has no first text encoder; a ControlNet
    pipeline adds its ControlNets)."""
    if not is_xl(pipe):
        return ONNX_COMPONENTS + controlnet_component_names(len(controlnets_of(pipe)))
    encoders = tuple(name for name in ("text_encoder", "text_encoder_2") if getattr(pipe, name, None) is not None)
    return encoders + ("unet", "vae_encoder", "vae_decoder")


def _text_encoder_spec(text_encoder, sequence: int, xl: bool, with_projection: bool) -> dict:
    if not xl:
        return dict(
            module=_TextEncoder(text_encoder),
            args=(torch.zeros(1, sequence, dtype=torch.int32),),
            input_names=["input_ids"],
            output_names=["last_hidden_state", "pooler_output"],
            dynamic_axes={"input_ids": {0: "batch", 1: "sequence"},
                          "last_hidden_state": {0: "batch", 1: "sequence"}, "pooler_output": {0: "batch"}},
            config=text_encoder.config,
        )
    layers = text_encoder.config.num_hidden_layers
    hidden = [f"hidden_states.{i}" for i in range(layers + 1)]
    pooled = "text_embeds" if with_projection else "pooler_output"
    names = [pooled, "last_hidden_state", *hidden] if with_projection else ["last_hidden_state", pooled, *hidden]
    axes = {name: {0: "batch", 1: "sequence"} for name in ["last_hidden_state", *hidden]}
    return dict(
        module=_TextEncoderWithHiddenStates(text_encoder, with_projection),
        args=(torch.zeros(1, sequence, dtype=torch.int64),),  # optimum's SDXL export takes int64 ids
        input_names=["input_ids"],
        output_names=names,
        dynamic_axes={"input_ids": {0: "batch", 1: "sequence"}, pooled: {0: "batch"}, **axes},
        config=text_encoder.config,
    )


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
            dynamic_axes={"sample": {0: "batch", 2: "height", 3: "width"},
                          "latent_sample": {0: "batch", 2: f"height / {encoder_factor}",
                                            3: f"width / {encoder_factor}"}},
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
            dynamic_axes={"latent_sample": {0: "batch", 2: "latent_height", 3: "latent_width"},
                          "sample": {0: "batch", 2: f"latent_height * {decoder_factor}",
                                     3: f"latent_width * {decoder_factor}"}},
            fixed_output_dims={"sample": {1: config.out_channels}},  # as the encoder's
            config=config,
            class_name=type(vae).__name__,
        ),
    }


def component_specs(pipe, vae=None) -> Dict[str, dict]:
    """What to export for each component: module, example inputs, names and dynamic axes; the VAE's from ``vae``
    where given (a tiny VAE), else from the pipeline's."""
    xl = is_xl(pipe)
    unet = pipe.unet
    vae = pipe.vae if vae is None else vae
    vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)
    # small example shapes: every spatial dim is dynamic, and exporting at full size would only cost time
    latent_size = 2 ** (len(unet.config.block_out_channels) - 1) * 4
    tokenizer = pipe.tokenizer if getattr(pipe, "tokenizer", None) is not None else pipe.tokenizer_2
    sequence = tokenizer.model_max_length
    specs: Dict[str, dict] = {}
    if getattr(pipe, "text_encoder", None) is not None:
        specs["text_encoder"] = _text_encoder_spec(pipe.text_encoder, sequence, xl, with_projection=False)
    if xl and getattr(pipe, "text_encoder_2", None) is not None:
        specs["text_encoder_2"] = _text_encoder_spec(pipe.text_encoder_2, sequence, xl, with_projection=True)

    extra_names, extra_args, extra_axes = [], [], {}
    if getattr(unet.config, "time_cond_proj_dim", None):
        extra_names.append("timestep_cond")
        extra_args.append(torch.randn(2, unet.config.time_cond_proj_dim))
        extra_axes["timestep_cond"] = {0: "batch"}
    if getattr(unet.config, "addition_embed_type", None) == "text_time":
        # original size, crop corner and target size; the refiner has an aesthetic score instead of the target size
        time_ids = 5 if getattr(pipe.config, "requires_aesthetics_score", False) else 6
        pooled_dim = unet.config.projection_class_embeddings_input_dim - time_ids * unet.config.addition_time_embed_dim
        extra_names += ["text_embeds", "time_ids"]
        extra_args += [torch.randn(2, pooled_dim), torch.randn(2, time_ids)]
        extra_axes.update({"text_embeds": {0: "batch"}, "time_ids": {0: "batch"}})
    unet_args = (torch.randn(2, unet.config.in_channels, latent_size, latent_size), torch.tensor([1.0]),
                 torch.randn(2, sequence, unet.config.cross_attention_dim))
    controlnets = controlnets_of(pipe)
    if controlnets:
        if xl:
            raise ValueError("controlnet: only Stable Diffusion 1.x/2.x ControlNet pipelines export (not SDXL's)")
        image = torch.rand(2, controlnets[0].config.conditioning_channels, latent_size * vae_scale_factor,
                           latent_size * vae_scale_factor)
        with torch.no_grad():  # the residuals' shapes, for the example inputs of the UNet
            down, mid = controlnets[0](*unet_args, image, return_dict=False)
        residuals = [f"{DOWN_RESIDUAL_INPUT}{i}" for i in range(len(down))] + [MID_RESIDUAL_INPUT]
        extra_names += residuals
        extra_args += [torch.randn(r.shape) for r in (*down, mid)]
        extra_axes.update({name: {0: "batch", 2: f"{name}_height", 3: f"{name}_width"} for name in residuals})
        scale_count = len(down) + 1
        outputs = [f"{DOWN_RESIDUAL_OUTPUT}{i}" for i in range(len(down))] + [MID_RESIDUAL_OUTPUT]
        for name, controlnet in zip(controlnet_component_names(len(controlnets)), controlnets):
            specs[name] = dict(
                module=_ControlNet(controlnet),
                args=(*unet_args, image, torch.ones(scale_count)),
                input_names=["sample", "timestep", "encoder_hidden_states", "controlnet_cond", "conditioning_scale"],
                output_names=outputs,
                dynamic_axes={"sample": {0: "batch", 2: "height", 3: "width"}, "timestep": {0: "timestep_batch"},
                              "encoder_hidden_states": {0: "batch", 1: "sequence"},
                              "controlnet_cond": {0: "batch", 2: "image_height", 3: "image_width"},
                              **{output: {0: "batch", 2: f"{output}_height", 3: f"{output}_width"}
                                 for output in outputs}},
                config=controlnet.config,
            )
    specs["unet"] = dict(
        module=_UNet(unet, extra_names),
        args=(*unet_args, *extra_args),
        input_names=["sample", "timestep", "encoder_hidden_states", *extra_names],
        output_names=["out_sample"],
        dynamic_axes={"sample": {0: "batch", 2: "height", 3: "width"}, "timestep": {0: "timestep_batch"},
                      "encoder_hidden_states": {0: "batch", 1: "sequence"}, **extra_axes,
                      "out_sample": {0: "batch", 2: "height", 3: "width"}},
        config=unet.config,
    )
    return {**specs, **vae_specs(vae, latent_size)}


def to_precision(exported: Path, optimized: Any, fp16: bool,
                 float32_inputs: Sequence[str] = ()) -> onnx.ModelProto:
    """The model exported to ``exported`` (with any external data beside it), or ORT's optimization of it
    (``optimized``, an ``OnnxModel``; ``None``: none), in memory, converted to float16 by ORT's converter where
    ``fp16``: every float input and output but ``float32_inputs`` becomes float16, and the arithmetic of the
    timestep/guidance embeddings and rotary tables stays float32 (see
    :func:`~optimum_iobinding.export.optimize.float32_island`)."""
    scratch = exported.parent
    if optimized is not None:
        if fp16:
            return optimized_to_float16(optimized, scratch, float32_inputs)
        model = optimized.model
        onnx.load_external_data_for_model(model, str(scratch))
        return model
    if fp16:
        # Types of every intermediate first, from the file (works past 2 GiB, unlike in-memory inference): without
        # them the converter turns Resize's float scales into float16, which ORT refuses.
        typed_path = scratch / "typed.onnx"
        onnx.shape_inference.infer_shapes_path(str(exported), str(typed_path))
        return convert_to_float16(onnx.load(str(typed_path)), shapes_known=True, float32_inputs=float32_inputs)
    return onnx.load(str(exported))


def fix_output_dims(model: onnx.ModelProto, fixed: Dict[str, Dict[int, int]]) -> None:
    """Declares ``fixed[output][axis]`` as the size of those output dims (in place)."""
    for output in model.graph.output:
        for axis, size in fixed.get(output.name, {}).items():
            dim = output.type.tensor_type.shape.dim[axis]
            dim.Clear()
            dim.dim_value = int(size)


def export_component(name: str, spec: dict, target: Path, opset: int, fp16: bool, optimize: Optional[str],
                      xl: bool = False, external_data_threshold: int = MAX_SINGLE_FILE_BYTES,
                      external_data_file: str = EXTERNAL_DATA_FILE) -> None:
    """Exports one UNet-family component (text encoder, UNet, ControlNet, VAE) to ``target/name``: the TorchScript
    exporter (with the attention ORT's optimizer fuses), ORT's optimizer (``optimize``), float16 (``fp16``), the
    LoRA map of a UNet or text encoder, ``model.onnx`` (its weights in ``external_data_file`` beside it past
    ``external_data_threshold`` bytes) and ``config.json``."""
    with tempfile.TemporaryDirectory() as scratch:
        scratch_path = Path(scratch) / "model.onnx"
        attention = contextlib.nullcontext()
        if optimize and optimizer_model_type(name) == "vae":  # ORT's VAE attention fusion cannot: see .attention
            attention = fused_vae_attention(spec["module"])
        elif optimize:
            use_classic_attention(spec["module"])
        with attention, torch.no_grad(), warnings.catch_warnings():
            # the TorchScript exporter's notes on Python control flow it traced (TracerWarning) and constant folding
            # it skipped: expected for diffusers' modules, and not the user's to act on
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            warnings.filterwarnings("ignore", message="Constant folding - Only steps=1")
            # the exporter announcing its own deprecation, and how it spells advanced indexing: nothing to act on
            warnings.filterwarnings("ignore", message="You are using the legacy TorchScript-based ONNX export")
            warnings.filterwarnings("ignore", message="The feature will be removed")
            warnings.filterwarnings("ignore", message="Exporting aten::index operator of advanced indexing")
            torch.onnx.export(
                spec["module"].eval(), spec["args"], str(scratch_path), dynamo=False,
                input_names=spec["input_names"], output_names=spec["output_names"],
                dynamic_axes=spec["dynamic_axes"], opset_version=opset, do_constant_folding=True,
            )
        exported = onnx.load(str(scratch_path), load_external_data=False)  # weights past 2 GiB stay in their files
        if fold_pads_into_convs(exported):
            onnx.save_model(exported, str(scratch_path))
        del exported
        optimized = (optimize_component(name, scratch_path, fusion_options(name, spec["config"], optimize), optimize)
                     if optimize else None)
        model = to_precision(scratch_path, optimized, fp16)
    layers_of = getattr(spec["module"], "unet", None) or getattr(spec["module"], "text_encoder", None)
    if layers_of is not None:  # where each layer's weight went: runtime LoRA updates it there

        (target / name).mkdir(parents=True, exist_ok=True)
        write_weight_map(weight_map(layers_of, model), target / name,
                         [layer for layer, _ in lora_layers(layers_of)])
    fix_output_dims(model, spec.get("fixed_output_dims", {}))
    save_onnx(model, target / name / "model.onnx", external_data_threshold, external_data_file)
    config = spec["config"].to_dict() if hasattr(spec["config"], "to_dict") else dict(spec["config"])
    if spec.get("class_name"):  # which torch class it came from (an AutoencoderKL or AutoencoderTiny VAE)
        config.setdefault("_class_name", spec["class_name"])
    if fp16 and config.get("force_upcast"):
        # diffusers upcasts such a VAE to float32 before decoding (SDXL's stock VAE overflows float16); a float16 ONNX
        # model cannot be upcast, and pipelines that try (optimum-onnx's, through diffusers' upcast_vae) fail.
        if xl:  # SD 1.x/2.x VAEs decode fine in float16 although their configs say force_upcast too
            logger.warning(
                "%s: the VAE's config says force_upcast=True (SDXL's stock VAE overflows float16 and then decodes "
                "NaN/black images), but this export is float16 and cannot be upcast, so its config.json says "
                "force_upcast=false. If the images come out black, export a float16-safe VAE: vae= (CLI: --vae), "
                "e.g. madebyollin/sdxl-vae-fp16-fix.", name)
        config["force_upcast"] = False
    (target / name / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str))


def export_pipeline(
    model_id_or_path: Optional[str],
    output_dir: Union[str, os.PathLike],
    *,
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
) -> Path:
    """Exports a diffusers Stable Diffusion (1.x/2.x, LCM, Turbo) pipeline to the diffusers ONNX layout, or an SDXL
    pipeline to optimum's SDXL layout (two text encoders with their hidden states; a UNet taking ``text_embeds`` and
    ``time_ids``). A UNet with ``time_cond_proj_dim`` (LCM) also takes ``timestep_cond``. A Stable Diffusion 3
    pipeline goes to optimum's SD3 layout (:func:`optimum_iobinding.export.transformer.export_sd3_pipeline`: the T5
    encoder stays float32 in a float16 export), a ``FluxPipeline`` to optimum's Flux layout (:mod:`.flux`, which
    says each component's precision).

    With ``tiny_vae`` and no pipeline (``model_id_or_path=None``, no ``tiny_random`` or ``torch_pipeline``) it writes
    a folder of that tiny VAE alone: ``vae_encoder/`` and ``vae_decoder/`` (what a pipeline takes as its tiny VAE).

    Args:
        model_id_or_path: a local diffusers folder or a hub id; ignored with ``tiny_random``; ``None`` with
            ``tiny_vae`` alone for a folder of the tiny VAE only.
        output_dir: where to write the ONNX folder: a new or empty folder, outside the source folder. The export is
            built in a temporary folder beside it and moved into place only once all of it succeeded: a failed or
            interrupted export leaves ``output_dir`` as it was.
        fp16: export fp32, then convert with ORT's float16 converter.
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
            ``lllyasviel/sd-controlnet-canny``) to export with a Stable Diffusion 1.x/2.x pipeline: the folder gets
            ``controlnet`` (``controlnet_1`` … for more) and a UNet that takes their residuals, which
            :class:`OnnxStableDiffusionControlNetPipeline` loads. A diffusers ``StableDiffusionControlNetPipeline``
            given as ``torch_pipeline`` (or its folder) exports its own.
        tiny_vae: export ``vae_encoder`` and ``vae_decoder`` from this diffusers ``AutoencoderTiny`` (TAESD, a VAE
            a fraction of the full one's cost, for few-step real-time work) instead of the pipeline's VAE: an
            ``AutoencoderTiny``, its folder or hub id (``"madebyollin/taesd"`` for SD 1.x/2.x, ``"madebyollin/taesdxl"``
            for SDXL), or ``True`` for a tiny random one built offline (with ``tiny_random``, or alone). The same
            inputs, outputs and axes as the full VAE's; its ``config.json`` says ``_class_name: AutoencoderTiny`` and
            ``scaling_factor: 1.0``, so the pipelines scale latents as diffusers does with it. Its latent channels
            must be the UNet's.

    Returns:
        The output folder.

    Raises:
        FileExistsError: ``output_dir`` is not empty (without ``overwrite``) or is a file.
        ValueError: ``output_dir`` is the source folder, inside it, or holds it; a ``tiny_vae`` that cannot be loaded
            or whose latent channels are not the UNet's.
        TypeError: a ``tiny_vae`` that is not an ``AutoencoderTiny`` (an ``AutoencoderKL`` goes in ``vae``).
    """
    if optimize not in (None, "cuda", "cpu"):
        raise ValueError(f"optimize: expected None, 'cuda' or 'cpu', got {optimize!r}")
    if not isinstance(opset, int) or isinstance(opset, bool) or not 7 <= opset <= 22:
        raise ValueError(f"opset: expected an integer in [7, 22] (17 is tested), got {opset!r}")
    tiny_vae = None if tiny_vae is False else tiny_vae
    if vae is not None or controlnet is not None or tiny_vae is not None:  # before anything is loaded or fetched
        check_transformer_options(transformer_family(model_id_or_path, torch_pipeline=torch_pipeline,
                                                     tiny_random=tiny_random),
                                  vae=vae, controlnet=controlnet, tiny_vae=tiny_vae)
    vae_only = tiny_vae is not None and model_id_or_path is None and torch_pipeline is None and not tiny_random
    check_tiny_vae_arguments(tiny_vae, vae_only=vae_only, random_pipeline=bool(tiny_random), vae=vae,
                             controlnet=controlnet)
    if vae_only:
        components = vae_only_components(components)
    source = Path(model_id_or_path) if (model_id_or_path is not None and torch_pipeline is None and not tiny_random
                                         and Path(model_id_or_path).exists()) else None
    target = check_output_folder(output_dir, source, overwrite)
    # the tiny VAE before the pipeline: a name that cannot be loaded fails in seconds, not after the pipeline's minutes
    tiny = load_tiny_vae(tiny_vae) if tiny_vae is not None else None
    if vae_only:
        return _export_vae_only(tiny, target, components, opset=opset, fp16=fp16, optimize=optimize,
                                progress=progress)
    if torch_pipeline is not None:
        pipe = torch_pipeline
    elif tiny_random:
        kind = "sd" if tiny_random is True else tiny_random
        if kind not in TINY_RANDOM_KINDS:
            raise ValueError(f"tiny_random: expected True or one of {sorted(TINY_RANDOM_KINDS)}, got {tiny_random!r}")
        pipe = TINY_RANDOM_KINDS[kind]()
    elif model_id_or_path is None:
        raise ValueError("model_id_or_path: expected a diffusers folder or hub id (or tiny_random=True; or tiny_vae "
                         "alone for a folder of a tiny VAE), got None")
    elif pipeline_loader is not None:
        pipe = pipeline_loader(model_id_or_path)
    else:
        from diffusers import DiffusionPipeline

        pipe = DiffusionPipeline.from_pretrained(model_id_or_path, torch_dtype=torch.float32, safety_checker=None)
    if getattr(pipe, "transformer", None) is not None:  # a diffusion transformer (SD3, Flux)
        return _export_transformer_pipeline(pipe, target, vae=vae, controlnet=controlnet, tiny_vae=tiny_vae,
                                            components=components, opset=opset, fp16=fp16, optimize=optimize,
                                            progress=progress)
    if vae is not None:
        if isinstance(vae, (str, os.PathLike)):
            from diffusers import AutoencoderKL

            vae = AutoencoderKL.from_pretrained(os.fspath(vae), torch_dtype=torch.float32)
        if not hasattr(vae, "decode") or not hasattr(vae, "config"):
            raise TypeError(f"vae: expected an AutoencoderKL or its folder or hub id, got {type(vae).__name__}")
        pipe.vae = vae
    if controlnet is not None:
        pipe = _with_controlnets(pipe, controlnet)
    if tiny is not None:
        check_tiny_vae_fits(tiny.config, pipe.unet.config)
    available = onnx_components_of(pipe)
    components = available if components is None else tuple(components)
    unknown = [c for c in components if c not in available]
    if unknown:
        raise ValueError(f"components: expected names from {list(available)}, got {unknown}")
    specs = component_specs(pipe, vae=tiny)
    with building_beside(target) as scratch:
        for name in tqdm(components, desc="export", unit="model", disable=not progress):
            export_component(name, specs[name], scratch, opset, fp16, optimize, xl=is_xl(pipe))
        for name in ("tokenizer", "tokenizer_2"):
            if getattr(pipe, name, None) is not None:
                save_tokenizer(getattr(pipe, name), scratch / name)
        pipe.scheduler.save_pretrained(str(scratch / "scheduler"))
        if is_xl(pipe):
            modules = {name: type(getattr(pipe, name)).__name__ if getattr(pipe, name, None) is not None else None
                       for name in ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")}
            write_xl_model_index(scratch, type(pipe).__name__, type(pipe.scheduler).__name__, modules,
                                 getattr(pipe.config, "force_zeros_for_empty_prompt", True),
                                 getattr(pipe.config, "requires_aesthetics_score", False))
        else:
            nets = controlnet_component_names(len(controlnets_of(pipe)))
            write_model_index(scratch, type(pipe.scheduler).__name__, type(pipe.tokenizer).__name__,
                              ONNX_COMPONENTS + nets,
                              "OnnxStableDiffusionControlNetPipeline" if nets else "OnnxStableDiffusionPipeline")
    return target


def _export_transformer_pipeline(pipe, target: Path, *, vae, controlnet, tiny_vae, **options) -> Path:
    """A diffusion-transformer pipeline (SD3 through :mod:`.transformer`, FLUX.1 through :mod:`.flux`; both import
    this module)."""
    from .flux import export_flux_pipeline, is_flux
    from .transformer import export_sd3_pipeline, is_sd3_pipeline

    if is_flux(pipe):
        export = export_flux_pipeline
    elif is_sd3_pipeline(pipe):
        export = export_sd3_pipeline
    else:
        raise ValueError(f"model: expected a Stable Diffusion (1.x/2.x, XL), Stable Diffusion 3 or Flux pipeline, got "
                         f"a {type(pipe).__name__} with a {type(pipe.transformer).__name__}, which this version does "
                         "not export")
    # a pipeline_loader's pipeline is known only now
    check_transformer_options(transformer_family(torch_pipeline=pipe), vae=vae, controlnet=controlnet,
                              tiny_vae=tiny_vae)
    return export(pipe, target, **options)


# the diffusion-transformer families, by their transformer's class (what model_index.json names)
TRANSFORMER_FAMILIES = {"FluxTransformer2DModel": "Flux", "SD3Transformer2DModel": "Stable Diffusion 3"}
TINY_RANDOM_FAMILIES = {"sd3": "Stable Diffusion 3", "flux": "Flux", "flux-dev": "Flux"}


def transformer_family(model_id_or_path: Optional[Union[str, os.PathLike]] = None, *,
                       torch_pipeline: Optional[object] = None, tiny_random: Union[bool, str] = False) -> Optional[str]:
    """The diffusion-transformer family (``"Flux"``, ``"Stable Diffusion 3"``) of what :func:`export_pipeline` would
    export, known before the pipeline loads: from the pipeline given, the tiny random kind, or the transformer that
    ``model_id_or_path``'s model_index.json names (a local folder's, or that one file fetched from the Hub).
    ``None``: a UNet pipeline, or not known before loading (a repository that cannot be fetched now fails when it
    loads, with the loader's own error)."""
    if torch_pipeline is not None:
        transformer = getattr(torch_pipeline, "transformer", None)
        return TRANSFORMER_FAMILIES.get(type(transformer).__name__) if transformer is not None else None
    if tiny_random:
        return TINY_RANDOM_FAMILIES.get("sd" if tiny_random is True else tiny_random)
    if model_id_or_path is None:
        return None
    folder = Path(model_id_or_path)
    if not folder.exists():
        if not looks_like_hub_id(os.fspath(model_id_or_path)):
            return None
        try:
            folder = download_from_hub(os.fspath(model_id_or_path), ["model_index.json"], "model_id_or_path")
        except FileNotFoundError:
            return None
    index = read_json_object(folder / "model_index.json") if folder.is_dir() else None
    entry = index.get("transformer") if index else None
    return TRANSFORMER_FAMILIES.get(entry[-1]) if isinstance(entry, list) and entry else None


def check_transformer_options(family: Optional[str], *, vae=None, controlnet=None, tiny_vae=None) -> None:
    """A diffusion-transformer pipeline (``family``, see :func:`transformer_family`) exports its own VAE and no
    ControlNet: ``vae``, ``controlnet`` and ``tiny_vae`` are refused by name, before anything is loaded.

    Raises:
        ValueError: one of them is given for a ``family`` pipeline.
    """
    if family is None:
        return
    for name, value in (("vae", vae), ("controlnet", controlnet), ("tiny_vae", tiny_vae)):
        if value is not None:
            shown = repr(os.fspath(value)) if isinstance(value, os.PathLike) else \
                repr(value) if isinstance(value, (str, bool, list, tuple)) else type(value).__name__
            raise ValueError(f"{name}: expected None for a {family} pipeline (its own VAE is exported, no ControlNet), "
                             f"got {shown}")


TINY_VAE_COMPONENTS = ("vae_encoder", "vae_decoder")


def check_tiny_vae_arguments(tiny_vae, *, vae_only: bool, random_pipeline: bool, vae=None, controlnet=None) -> None:
    """What can be said of ``tiny_vae`` before anything is loaded: a random one goes with a random pipeline or alone,
    one VAE at a time, and a folder of the VAE alone has nothing else to take."""
    if tiny_vae is None:
        return
    if tiny_vae is True and not (random_pipeline or vae_only):
        raise ValueError("tiny_vae: True (a tiny random AutoencoderTiny) goes with tiny_random or alone (a folder of "
                         "the tiny VAE only); a trained pipeline needs a trained tiny VAE, e.g. 'madebyollin/taesd' "
                         "(SD 1.x/2.x) or 'madebyollin/taesdxl' (SDXL)")
    if vae is not None:
        raise ValueError("vae and tiny_vae: expected one VAE to export, got both")
    if vae_only and controlnet is not None:
        raise ValueError("controlnet: expected none for a folder of the tiny VAE alone, got one; export the "
                         "ControlNet with its pipeline")


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
        raise TypeError(f"tiny_vae: expected an AutoencoderTiny, its folder or hub id, or True (a tiny random one), "
                        f"got {type(tiny_vae).__name__}{hint}")
    name = os.fspath(tiny_vae)

    def unloadable(error: BaseException) -> ValueError:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return ValueError(f"tiny_vae: expected an AutoencoderTiny folder or hub id (e.g. 'madebyollin/taesd'), got "
                          f"{name!r}, which does not load: {type(error).__name__}: {reason[:200]}")

    try:
        config = AutoencoderTiny.load_config(name)
    except Exception as error:  # no such folder, no config.json, no network, no such repository
        raise unloadable(error) from error
    check_tiny_vae_config(config, name)
    try:
        return AutoencoderTiny.from_pretrained(name, torch_dtype=torch.float32)
    except Exception as error:  # weights missing or not this architecture's
        raise unloadable(error) from error


def check_tiny_vae_config(config: Any, name: str) -> None:
    """``config`` (a config.json's object) is an ``AutoencoderTiny``'s, or names no class.

    Raises:
        TypeError: it names another class (an ``AutoencoderKL``'s goes in ``vae``).
    """
    class_name = config.get("_class_name") if isinstance(config, dict) else None
    if class_name not in (None, "AutoencoderTiny"):
        hint = "; a full VAE goes in vae= (CLI: --vae)" if class_name == "AutoencoderKL" else ""
        raise TypeError(f"tiny_vae: expected an AutoencoderTiny folder or hub id, got {name!r}, whose config.json "
                        f"names the class {class_name}{hint}")


def check_tiny_vae_fits(tiny_vae_config, unet_config) -> None:
    """The tiny VAE's latents are the UNet's: its ``latent_channels`` must be the UNet's ``out_channels`` (the
    channels of the latents the UNet denoises; an inpainting UNet takes more in)."""
    mine, unet = tiny_vae_config.get("latent_channels"), unet_config.get("out_channels")
    if mine is not None and unet is not None and mine != unet:
        raise ValueError(f"tiny_vae: expected a tiny VAE of {unet} latent channels (the UNet's), got one of {mine}; "
                         "e.g. 'madebyollin/taesd' or 'madebyollin/taesdxl' have 4, for SD 1.x/2.x and SDXL")


def vae_only_components(components: Optional[Sequence[str]]) -> tuple:
    """The components of a folder of a tiny VAE alone: both (default), or those of them asked for."""
    components = TINY_VAE_COMPONENTS if components is None else tuple(components)
    unknown = [c for c in components if c not in TINY_VAE_COMPONENTS]
    if unknown or not components:
        raise ValueError(f"components: a folder of the tiny VAE alone has {list(TINY_VAE_COMPONENTS)}, got "
                         f"{unknown or list(components)}; give model_id_or_path (or tiny_random) for a pipeline")
    return components


def _export_vae_only(vae, target: Path, components: Sequence[str], *, opset: int, fp16: bool,
                     optimize: Optional[str], progress: bool) -> Path:
    """A folder of ``vae`` alone: ``vae_encoder/`` and ``vae_decoder/`` (or the one of them in ``components``)."""
    specs = vae_specs(vae, latent_size=8)
    with building_beside(target) as scratch:
        for name in tqdm(components, desc="export", unit="model", disable=not progress):
            export_component(name, specs[name], scratch, opset, fp16, optimize)
    return target


def _with_controlnets(pipe, controlnet):
    """``pipe`` as a diffusers ``StableDiffusionControlNetPipeline`` with these ControlNets (models, folders or hub
    ids), each checked against the UNet it will feed."""
    from diffusers import ControlNetModel, StableDiffusionControlNetPipeline

    if is_xl(pipe):
        raise ValueError("controlnet: only Stable Diffusion 1.x/2.x pipelines export with a ControlNet (not SDXL)")
    given = list(controlnet) if isinstance(controlnet, (list, tuple)) else [controlnet]
    if not given:
        raise ValueError("controlnet: expected one or more ControlNets, got an empty list")
    nets = []
    for k, item in enumerate(given):
        if isinstance(item, (str, os.PathLike)):
            item = ControlNetModel.from_pretrained(os.fspath(item), torch_dtype=torch.float32)
        if not hasattr(item, "controlnet_down_blocks") or not hasattr(item, "config"):
            raise TypeError(f"controlnet[{k}]: expected a ControlNetModel or its folder or hub id, got "
                            f"{type(item).__name__}")
        for key in ("block_out_channels", "cross_attention_dim"):
            mine, theirs = getattr(item.config, key), getattr(pipe.unet.config, key)
            if list(mine if isinstance(mine, (list, tuple)) else [mine]) != \
                    list(theirs if isinstance(theirs, (list, tuple)) else [theirs]):
                raise ValueError(f"controlnet[{k}]: {key} is {mine}, but the pipeline's UNet has {theirs}: a "
                                 "ControlNet must be made for this UNet's architecture")
        nets.append(item)
    return StableDiffusionControlNetPipeline(
        vae=pipe.vae, text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer, unet=pipe.unet,
        controlnet=nets[0] if len(nets) == 1 else nets, scheduler=pipe.scheduler, safety_checker=None,
        feature_extractor=None, requires_safety_checker=False,
    )
