"""Export of the UNet families (Stable Diffusion 1.x/2.x, LCM, Turbo; SDXL; ControlNet) to the diffusers ONNX layout
(SDXL to optimum's): their text encoders, UNet and ControlNets' specs, and the folder; each component goes through
:func:`~optimum_iobinding.export.components.export_component`, the VAE's spec is :mod:`.components`'.

Layout written (what diffusers' numpy ONNX pipeline and ours both load)::

    model_index.json            components named as diffusers' ONNX pipeline names them
    text_encoder/model.onnx     input_ids (int32) → last_hidden_state, pooler_output
    unet/model.onnx             sample, timestep, encoder_hidden_states → out_sample
    vae_encoder/model.onnx      sample → latent_sample (the latent distribution's mean: deterministic; a tiny VAE's,
                                diffusers' AutoencoderTiny's, latents)
    vae_decoder/model.onnx      latent_sample → sample
    controlnet/model.onnx       (a ControlNet pipeline) sample, timestep, encoder_hidden_states, controlnet_cond,
                                conditioning_scale (SDXL's: text_embeds, time_ids too) → down_block_res_sample_0 …
                                _N-1, mid_block_res_sample; controlnet_1/, controlnet_2/ … for more than one ControlNet
                                (diffusers' names), and a UNet that also takes down_block_additional_residual_0 … and
                                mid_block_additional_residual
    */config.json               the torch component's config (scaling factor, channels, block widths)
    tokenizer/, scheduler/

Large models go to one external-data file ``weights.pb`` next to their ``model.onnx``, as diffusers writes them.
With ``step_cache`` the UNet's folder also holds DeepCache's parts (:mod:`.deep_cache`: ``deep_cache_full.onnx``,
``deep_cache_shallow_<branch>.onnx``), and its weights are in ``model.onnx_data``, which they all read. With
``cold_start_parts`` it holds ``cold_part_0.onnx`` … too (:mod:`.cold_parts`), reading the UNet's weights.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import torch
from tqdm.auto import tqdm

from ..errors import ArgumentError, ArgumentTypeError
from ..families import family
from ..layout import (
    CONTROLNET_CONDITION,
    CONTROLNET_SCALE,
    DOWN_RESIDUAL_INPUT,
    DOWN_RESIDUAL_OUTPUT,
    IMAGE_ENCODER,
    IMAGE_PROMPT_LAYERS_KEY,
    IP_ADAPTER_KEY_INPUT,
    IP_ADAPTER_VALUE_INPUT,
    MID_RESIDUAL_INPUT,
    MID_RESIDUAL_OUTPUT,
    ONNX_COMPONENTS,
    building_beside,
    controlnet_component_names,
    save_tokenizer,
    write_model_index,
    write_xl_model_index,
)
from .attention import attention_as_one_node
from .components import export_component, pooled_output, vae_specs
from .deep_cache import check_deep_cache_unet
from .ip_adapter import (
    image_encoder_spec,
    image_prompt_inputs,
    image_prompt_layers,
    image_prompt_processors,
    without_loaded_ip_adapter,
)

__all__ = [
    "export_unet_pipeline",
    "component_specs",
    "onnx_components_of",
    "is_xl",
    "check_tiny_vae_fits",
    "check_deep_cache_pipeline",
    "controlnets_of",
]


class _TextEncoder(torch.nn.Module):
    def __init__(self, text_encoder):
        super().__init__()
        self.text_encoder = text_encoder

    def forward(self, input_ids):
        with attention_as_one_node(self.text_encoder, causal=True):  # see ClipTextEncoder
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
        with attention_as_one_node(self.text_encoder, causal=True):  # see ClipTextEncoder
            output = self.text_encoder(input_ids=input_ids, output_hidden_states=True, return_dict=True)
        pooled = pooled_output(self.text_encoder, output.last_hidden_state, input_ids)
        if self.with_projection:
            return (self.text_encoder.text_projection(pooled), output.last_hidden_state, *output.hidden_states)
        return (output.last_hidden_state, pooled, *output.hidden_states)


class _UNet(torch.nn.Module):
    """``sample, timestep, encoder_hidden_states`` and, where the UNet takes them, ``timestep_cond`` (LCM's guidance
    embedding) and SDXL's ``text_embeds``, ``time_ids``."""

    def __init__(self, unet, extra_inputs: Sequence[str] = (), image_prompt_processors: Sequence = ()):
        super().__init__()
        self.unet = unet
        self.extra_inputs = tuple(extra_inputs)
        self.image_prompt_processors = list(image_prompt_processors)

    def forward(self, sample, timestep, encoder_hidden_states, *extra):
        named = dict(zip(self.extra_inputs, extra))
        for index, processor in enumerate(self.image_prompt_processors):  # an IP-Adapter's keys and values
            processor.key = named[f"{IP_ADAPTER_KEY_INPUT}{index}"]
            processor.value = named[f"{IP_ADAPTER_VALUE_INPUT}{index}"]
        added = {key: named[key] for key in ("text_embeds", "time_ids") if key in named} or None
        down = [named[name] for name in self.extra_inputs if name.startswith(DOWN_RESIDUAL_INPUT)] or None
        return self.unet(
            sample,
            timestep,
            encoder_hidden_states,
            timestep_cond=named.get("timestep_cond"),
            added_cond_kwargs=added,
            down_block_additional_residuals=down,
            mid_block_additional_residual=named.get(MID_RESIDUAL_INPUT),
            return_dict=False,
        )[0]


class _ControlNet(torch.nn.Module):
    """A ControlNet whose residuals come out scaled by ``conditioning_scale``, one factor per residual (down blocks,
    then mid): a plain call gives every residual the same factor, guess mode diffusers' ``logspace(-1, 0)`` ramp, and
    steps outside the guidance window 0 — all the same graph. An SDXL ControlNet also takes its UNet's
    ``text_embeds`` and ``time_ids``."""

    def __init__(self, controlnet):
        super().__init__()
        self.controlnet = controlnet

    def forward(self, sample, timestep, encoder_hidden_states, controlnet_cond, conditioning_scale, *added):
        down, mid = self.controlnet(
            sample,
            timestep,
            encoder_hidden_states,
            controlnet_cond,
            conditioning_scale=1.0,
            added_cond_kwargs=dict(zip(("text_embeds", "time_ids"), added)) or None,
            guess_mode=False,
            return_dict=False,
        )
        return (*(residual * conditioning_scale[i] for i, residual in enumerate(down)), mid * conditioning_scale[-1])


def controlnets_of(pipe) -> list:
    """The pipeline's ControlNets in order (a ``MultiControlNetModel``'s nets), or ``[]``."""
    controlnet = getattr(pipe, "controlnet", None)
    if controlnet is None:
        return []
    return list(getattr(controlnet, "nets", None) or [controlnet])


def is_xl(pipe) -> bool:
    """An SDXL pipeline: a second text encoder, or a UNet conditioned on pooled text and time ids."""
    return (
        getattr(pipe, "text_encoder_2", None) is not None
        or getattr(pipe.unet.config, "addition_embed_type", None) == "text_time"
    )


def onnx_components_of(pipe) -> tuple:
    """The ONNX components a torch pipeline exports to (SDXL's refiner has no first text encoder; a ControlNet
    pipeline adds its ControlNets)."""
    nets = controlnet_component_names(len(controlnets_of(pipe)))
    if not is_xl(pipe):
        return ONNX_COMPONENTS + nets
    encoders = tuple(name for name in ("text_encoder", "text_encoder_2") if getattr(pipe, name, None) is not None)
    return encoders + ("unet", "vae_encoder", "vae_decoder") + nets


def _text_encoder_spec(text_encoder, sequence: int, xl: bool, with_projection: bool) -> dict:
    if not xl:
        return dict(
            module=_TextEncoder(text_encoder),
            args=(torch.zeros(1, sequence, dtype=torch.int32),),
            input_names=["input_ids"],
            output_names=["last_hidden_state", "pooler_output"],
            dynamic_axes={
                "input_ids": {0: "batch", 1: "sequence"},
                "last_hidden_state": {0: "batch", 1: "sequence"},
                "pooler_output": {0: "batch"},
            },
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


def component_specs(pipe, vae=None, ip_adapter: bool = False) -> Dict[str, dict]:
    """What to export for each component: module, example inputs, names and dynamic axes; the VAE's from ``vae``
    where given (a tiny VAE), else from the pipeline's. ``ip_adapter``: the UNet takes IP-Adapter's image-prompt
    keys and values (:mod:`.ip_adapter`; its cross-attention processors are replaced), and the pipeline's
    ``image_encoder``, where it has one, is exported too."""
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
    unet_args = (
        torch.randn(2, unet.config.in_channels, latent_size, latent_size),
        torch.tensor([1.0]),
        torch.randn(2, sequence, unet.config.cross_attention_dim),
    )
    controlnets = controlnets_of(pipe)
    if controlnets:
        image = torch.rand(
            2,
            controlnets[0].config.conditioning_channels,
            latent_size * vae_scale_factor,
            latent_size * vae_scale_factor,
        )
        # an SDXL ControlNet is conditioned as its UNet: the example's text_embeds and time_ids
        added = extra_args[-2:] if xl else []
        added_names = ["text_embeds", "time_ids"] if xl else []
        with torch.no_grad():  # the residuals' shapes, for the example inputs of the UNet
            down, mid = controlnets[0](
                *unet_args,
                image,
                added_cond_kwargs=dict(zip(added_names, added)) or None,
                return_dict=False,
            )
        residuals = [f"{DOWN_RESIDUAL_INPUT}{i}" for i in range(len(down))] + [MID_RESIDUAL_INPUT]
        extra_names += residuals
        extra_args += [torch.randn(r.shape) for r in (*down, mid)]
        extra_axes.update({name: {0: "batch", 2: f"{name}_height", 3: f"{name}_width"} for name in residuals})
        scale_count = len(down) + 1
        outputs = [f"{DOWN_RESIDUAL_OUTPUT}{i}" for i in range(len(down))] + [MID_RESIDUAL_OUTPUT]
        for name, controlnet in zip(controlnet_component_names(len(controlnets)), controlnets):
            specs[name] = dict(
                module=_ControlNet(controlnet),
                args=(*unet_args, image, torch.ones(scale_count), *added),
                input_names=[
                    "sample",
                    "timestep",
                    "encoder_hidden_states",
                    CONTROLNET_CONDITION,
                    CONTROLNET_SCALE,
                    *added_names,
                ],
                output_names=outputs,
                dynamic_axes={
                    "sample": {0: "batch", 2: "height", 3: "width"},
                    "timestep": {0: "timestep_batch"},
                    "encoder_hidden_states": {0: "batch", 1: "sequence"},
                    CONTROLNET_CONDITION: {0: "batch", 2: "image_height", 3: "image_width"},
                    **{added_name: {0: "batch"} for added_name in added_names},
                    **residual_output_axes(
                        outputs, [r.shape[2:] for r in (*down, mid)], latent_size, controlnet.config
                    ),
                },
                config=controlnet.config,
            )
    processors, config_extra = [], {}
    if ip_adapter:
        names, examples, axes = image_prompt_inputs(unet)
        config_extra[IMAGE_PROMPT_LAYERS_KEY] = [name for name, _ in image_prompt_layers(unet)]
        processors = image_prompt_processors(unet)
        extra_names, extra_args = [*extra_names, *names], [*extra_args, *examples]
        extra_axes.update(axes)
        if getattr(pipe, IMAGE_ENCODER, None) is not None:
            specs[IMAGE_ENCODER] = image_encoder_spec(getattr(pipe, IMAGE_ENCODER))
    specs["unet"] = dict(
        module=_UNet(unet, extra_names, processors),
        config_extra=config_extra,
        args=(*unet_args, *extra_args),
        input_names=["sample", "timestep", "encoder_hidden_states", *extra_names],
        output_names=["out_sample"],
        dynamic_axes={
            "sample": {0: "batch", 2: "height", 3: "width"},
            "timestep": {0: "timestep_batch"},
            "encoder_hidden_states": {0: "batch", 1: "sequence"},
            **extra_axes,
            "out_sample": {0: "batch", 2: "height", 3: "width"},
        },
        config=unet.config,
    )
    return {**specs, **vae_specs(vae, latent_size)}


def residual_output_axes(
    outputs: Sequence[str], sizes: Sequence[Sequence[int]], latent_size: int, config: Any = None
) -> Dict:
    """The ControlNet's residual outputs' dynamic axes, their height and width written as expressions of the
    ``sample``'s (``height``, ``ceil(height / 4)``, …): a residual ``k`` downsamplings deep is ``ceil(size / 2**k)``
    of the latents (each a 3×3 convolution of stride 2 and padding 1), which the runtime evaluates for any size
    before anything runs — a free name per output would leave it to ONNX shape inference, which stops at the fused
    graph's contrib ops (and a graph whose output shapes are unknown is not captured). ``sizes``: each residual's
    (height, width) for ``latent_size``² latents. A ControlNet whose downsamplings pad otherwise than by 1
    (``downsample_padding``) keeps a free name per output."""
    padding = getattr(config, "downsample_padding", 1) if config is not None else 1
    if padding != 1:
        return {output: {0: "batch", 2: f"{output}_height", 3: f"{output}_width"} for output in outputs}

    def expression(symbol: str, size: int) -> str:
        factor = 1
        while -(-latent_size // factor) != size:
            factor *= 2
            if factor > latent_size:
                raise ValueError(f"a ControlNet residual of size {size} is no halving of {latent_size}")
        return symbol if factor == 1 else f"ceil({symbol} / {factor})"

    return {
        output: {0: "batch", 2: expression("height", int(h)), 3: expression("width", int(w))}
        for output, (h, w) in zip(outputs, sizes)
    }


def check_tiny_vae_fits(tiny_vae_config, unet_config) -> None:
    """The tiny VAE's latents are the UNet's: its ``latent_channels`` must be the UNet's ``out_channels`` (the
    channels of the latents the UNet denoises; an inpainting UNet takes more in)."""
    mine, unet = tiny_vae_config.get("latent_channels"), unet_config.get("out_channels")
    if mine is not None and unet is not None and mine != unet:
        raise ArgumentError(
            "tiny_vae",
            f"expected a tiny VAE of {unet} latent channels (the UNet's), got one of {mine}; "
            "e.g. 'madebyollin/taesd' or 'madebyollin/taesdxl' have 4, for SD 1.x/2.x and SDXL",
        )


def check_deep_cache_pipeline(pipe) -> None:
    """DeepCache's parts are a UNet pipeline's without a ControlNet, whose blocks DeepCache numbers: a ControlNet's
    residuals go into the deep blocks and the mid block, which a shallow step does not run.

    Raises:
        ArgumentError: naming ``step_cache``.
    """
    if controlnets_of(pipe):
        raise ArgumentError(
            "step_cache",
            "expected a Stable Diffusion 1.x/2.x, SDXL or LCM pipeline without a ControlNet "
            "(DeepCache's shallow steps skip the deep blocks that a ControlNet's "
            f"residuals go into), got a {type(pipe).__name__} with "
            f"{len(controlnets_of(pipe))} ControlNet(s)",
        )
    check_deep_cache_unet(pipe.unet)


def _with_controlnets(pipe, controlnet):
    """``pipe`` as a diffusers ``StableDiffusionControlNetPipeline`` (an SDXL pipeline as a
    ``StableDiffusionXLControlNetPipeline``) with these ControlNets (models, folders or hub ids), each checked
    against the UNet it will feed."""
    from diffusers import ControlNetModel, StableDiffusionControlNetPipeline, StableDiffusionXLControlNetPipeline

    if is_xl(pipe) and getattr(pipe, "text_encoder", None) is None:
        raise ArgumentError(
            "controlnet",
            f"expected an SDXL base pipeline (two text encoders) to export with a ControlNet, got a "
            f"{type(pipe).__name__} without text_encoder (a refiner)",
        )
    given = list(controlnet) if isinstance(controlnet, (list, tuple)) else [controlnet]
    if not given:
        raise ArgumentError("controlnet", "expected one or more ControlNets, got an empty list")
    nets = []
    for k, item in enumerate(given):
        if isinstance(item, (str, os.PathLike)):
            item = ControlNetModel.from_pretrained(os.fspath(item), torch_dtype=torch.float32)
        if not hasattr(item, "controlnet_down_blocks") or not hasattr(item, "config"):
            raise ArgumentTypeError(
                f"controlnet[{k}]", f"expected a ControlNetModel or its folder or hub id, got {type(item).__name__}"
            )
        for key in ("block_out_channels", "cross_attention_dim"):
            mine, theirs = getattr(item.config, key), getattr(pipe.unet.config, key)
            if list(mine if isinstance(mine, (list, tuple)) else [mine]) != list(
                theirs if isinstance(theirs, (list, tuple)) else [theirs]
            ):
                raise ArgumentError(
                    f"controlnet[{k}]",
                    f"{key} is {mine}, but the pipeline's UNet has {theirs}: a ControlNet must be made for this "
                    "UNet's architecture",
                )
        nets.append(item)
    if is_xl(pipe):
        return StableDiffusionXLControlNetPipeline(
            vae=pipe.vae,
            text_encoder=pipe.text_encoder,
            text_encoder_2=pipe.text_encoder_2,
            tokenizer=pipe.tokenizer,
            tokenizer_2=pipe.tokenizer_2,
            unet=pipe.unet,
            controlnet=nets[0] if len(nets) == 1 else nets,
            scheduler=pipe.scheduler,
            force_zeros_for_empty_prompt=getattr(pipe.config, "force_zeros_for_empty_prompt", True),
            add_watermarker=False,
        )
    return StableDiffusionControlNetPipeline(
        vae=pipe.vae,
        text_encoder=pipe.text_encoder,
        tokenizer=pipe.tokenizer,
        unet=pipe.unet,
        controlnet=nets[0] if len(nets) == 1 else nets,
        scheduler=pipe.scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def export_unet_pipeline(
    pipe,
    target: Path,
    *,
    vae=None,
    controlnet=None,
    tiny_vae=None,
    components: Optional[Sequence[str]] = None,
    opset: int = 17,
    fp16: bool = False,
    optimize: Optional[str] = None,
    progress: bool = True,
    step_cache: bool = False,
    ip_adapter: bool = False,
    cold_start_parts: int = 0,
) -> Path:
    """Writes a UNet pipeline's folder at ``target`` (see the module's docstring), built beside it and moved into
    place when whole; the caller has checked ``target``.

    Args:
        pipe: the torch pipeline (float32).
        target: the output folder.
        vae: an ``AutoencoderKL``, or its folder or hub id, to export instead of the pipeline's.
        controlnet: one or several ControlNets (models, folders or hub ids) to export with the pipeline.
        tiny_vae: a loaded ``AutoencoderTiny`` to export as ``vae_encoder`` and ``vae_decoder``, or ``None``.
        components: which ONNX components to export (default: all the pipeline has).
        opset: ONNX opset.
        fp16: convert to float16.
        optimize: ``"cuda"``, ``"cpu"`` or ``None``: ORT's optimizer on each component.
        progress: show a progress bar.
        step_cache: DeepCache's parts beside the UNet (:mod:`.deep_cache`); not for a ControlNet pipeline.
        ip_adapter: a UNet taking IP-Adapter's image-prompt keys and values, and the pipeline's ``image_encoder``
            where it has one (:mod:`.ip_adapter`).
        cold_start_parts: 0, or the number of parts (2 or more) written beside the UNet whose sessions and first
            runs a pipeline makes side by side (:mod:`.cold_parts`).

    Returns:
        ``target``.

    Raises:
        ArgumentError: ``step_cache`` for a ControlNet pipeline, or for a UNet whose blocks DeepCache does not number.
    """
    if vae is not None:
        if isinstance(vae, (str, os.PathLike)):
            from diffusers import AutoencoderKL

            vae = AutoencoderKL.from_pretrained(os.fspath(vae), torch_dtype=torch.float32)
        if not hasattr(vae, "decode") or not hasattr(vae, "config"):
            raise ArgumentTypeError(
                "vae", f"expected an AutoencoderKL or its folder or hub id, got {type(vae).__name__}"
            )
        pipe.vae = vae
    if controlnet is not None:
        pipe = _with_controlnets(pipe, controlnet)
    if step_cache:
        check_deep_cache_pipeline(pipe)
    if tiny_vae is not None:
        check_tiny_vae_fits(tiny_vae.config, pipe.unet.config)
    available = onnx_components_of(pipe)
    components = available if components is None else tuple(components)
    unknown = [c for c in components if c not in available]
    if unknown:
        raise ArgumentError("components", f"expected names from {list(available)}, got {unknown}")
    with kept_attention_processors(pipe.unet), without_loaded_ip_adapter(pipe.unet):
        return _export_unet_folder(
            pipe,
            target,
            tiny_vae,
            components,
            opset,
            fp16,
            optimize,
            progress,
            step_cache,
            ip_adapter,
            cold_start_parts,
        )


def kept_attention_processors(unet) -> contextlib.AbstractContextManager:
    """Within: the export may set the UNet's attention processors (the classic ones for ORT's fusion, IP-Adapter's
    export processor); on leaving, the caller's pipeline gets its own back."""

    @contextlib.contextmanager
    def kept():
        previous = dict(unet.attn_processors) if hasattr(unet, "attn_processors") else None
        try:
            yield
        finally:
            if previous is not None:
                unet.set_attn_processor(previous)

    return kept()


def _export_unet_folder(
    pipe, target, tiny_vae, components, opset, fp16, optimize, progress, step_cache, ip_adapter, cold_start_parts=0
):
    specs = component_specs(pipe, vae=tiny_vae, ip_adapter=ip_adapter)
    if IMAGE_ENCODER in specs:
        components = (*components, IMAGE_ENCODER)
    with building_beside(target) as scratch:
        for name in tqdm(components, desc="export", unit="model", disable=not progress):
            export_component(
                name,
                specs[name],
                scratch,
                opset,
                fp16,
                optimize,
                xl=is_xl(pipe),
                step_cache=step_cache and name == "unet",
                cold_start_parts=cold_start_parts if name == "unet" else 0,
            )
        for name in ("tokenizer", "tokenizer_2"):
            if getattr(pipe, name, None) is not None:
                save_tokenizer(getattr(pipe, name), scratch / name)
        pipe.scheduler.save_pretrained(str(scratch / "scheduler"))
        if is_xl(pipe):
            modules = {
                name: type(getattr(pipe, name)).__name__ if getattr(pipe, name, None) is not None else None
                for name in ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")
            }
            write_xl_model_index(
                scratch,
                type(pipe).__name__,
                type(pipe.scheduler).__name__,
                modules,
                getattr(pipe.config, "force_zeros_for_empty_prompt", True),
                getattr(pipe.config, "requires_aesthetics_score", False),
                controlnet_component_names(len(controlnets_of(pipe))),
            )
        else:
            nets = controlnet_component_names(len(controlnets_of(pipe)))
            write_model_index(
                scratch,
                type(pipe.scheduler).__name__,
                type(pipe.tokenizer).__name__,
                ONNX_COMPONENTS + nets + ((IMAGE_ENCODER,) if IMAGE_ENCODER in components else ()),
                family("controlnet" if nets else "sd").index_class_name,
            )
    return target
