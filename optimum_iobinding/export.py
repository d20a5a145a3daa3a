"""Export a diffusers Stable Diffusion pipeline to the diffusers ONNX layout, and build a tiny random one offline.

Layout written (what diffusers' ``OnnxStableDiffusionPipeline`` and ours both load)::

    model_index.json            components named as diffusers' ONNX pipeline names them
    text_encoder/model.onnx     input_ids (int32) → last_hidden_state, pooler_output
    unet/model.onnx             sample, timestep, encoder_hidden_states → out_sample
    vae_encoder/model.onnx      sample → latent_sample (the latent distribution's mean: deterministic)
    vae_decoder/model.onnx      latent_sample → sample
    controlnet/model.onnx       (a ControlNet pipeline) sample, timestep, encoder_hidden_states, controlnet_cond,
                                conditioning_scale → down_block_res_sample_0 … _N-1, mid_block_res_sample;
                                controlnet_1/, controlnet_2/ … for more than one ControlNet (diffusers' names), and a
                                UNet that also takes down_block_additional_residual_0 … and mid_block_additional_residual
    */config.json               the torch component's config (scaling factor, channels, block widths)
    tokenizer/, scheduler/

Large models go to one external-data file ``weights.pb`` next to their ``model.onnx``, as diffusers writes them.
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

from .layout import (  # noqa: F401 — the folder layout lives in layout.py; these names stay importable from here
    DOWN_RESIDUAL_INPUT,
    DOWN_RESIDUAL_OUTPUT,
    MID_RESIDUAL_INPUT,
    MID_RESIDUAL_OUTPUT,
    ONNX_COMPONENTS,
    controlnet_component_names,
    building_beside,
    check_output_folder,
    save_tokenizer,
    write_model_index,
    write_xl_model_index,
)

logger = logging.getLogger(__name__)

__all__ = ["export_pipeline", "build_tiny_random_pipeline", "write_tiny_tokenizer", "save_tokenizer", "ONNX_COMPONENTS"]

EXTERNAL_DATA_FILE = "weights.pb"
# Protobuf cannot serialize a message over 2 GiB; keep well below it in one file.
_MAX_SINGLE_FILE_BYTES = 1 << 30


# ------------------------------------------------------------------------------------------------- tiny pipeline
def _byte_to_unicode() -> Dict[int, str]:
    """GPT-2/CLIP's reversible byte → printable character map (printable bytes stand for themselves)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_TINY_WORDS = (
    "a an the of on in with and photo painting picture astronaut horse riding cat dog house tree mountain sky red "
    "blue green portrait landscape city night sunset beautiful detailed castle forest river car"
).split()


def write_tiny_tokenizer(folder: Union[str, os.PathLike]) -> "object":
    """Writes a small byte-level BPE vocabulary (vocab.json, merges.txt) and returns the CLIPTokenizer saved there.

    Every byte has a token, alone and word-final (``</w>``), so any text tokenizes; merges spell out a few common
    prompt words. ``CLIPTokenizer`` skips the first line of merges.txt, hence the ``#version: 0.2`` header.
    """
    from transformers import CLIPTokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    characters = list(_byte_to_unicode().values())
    vocab = {}
    for token in characters + [c + "</w>" for c in characters]:
        vocab.setdefault(token, len(vocab))
    merges = []
    for word in _TINY_WORDS:
        symbols = list(word[:-1]) + [word[-1] + "</w>"]
        while len(symbols) > 1:
            pair = (symbols[0], symbols[1])
            merged = pair[0] + pair[1]
            if pair not in merges:
                merges.append(pair)
                vocab.setdefault(merged, len(vocab))
            symbols = [merged] + symbols[2:]
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (folder / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8"
    )
    tokenizer = CLIPTokenizer(
        str(folder / "vocab.json"),
        str(folder / "merges.txt"),
        bos_token="<|startoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=77,
    )
    tokenizer.save_pretrained(str(folder))
    return tokenizer


def build_tiny_random_pipeline(seed: int = 0):
    """A tiny random-weights ``StableDiffusionPipeline`` built offline: UNet of two blocks (32/64 channels), a
    2-layer CLIP text model of hidden size 32, a small four-block VAE (8× scale), a small byte-level BPE tokenizer,
    PNDM scheduler."""
    from diffusers import AutoencoderKL, PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=2,
        sample_size=32,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
        norm_num_groups=32,
    )
    # four blocks: the usual 8× scale, which diffusers' ONNX pipeline assumes (the baseline must run on it too)
    vae = AutoencoderKL(
        block_out_channels=(32, 32, 32, 64),
        layers_per_block=1,
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=4,
        norm_num_groups=32,
        sample_size=64,
    )
    with tempfile.TemporaryDirectory() as folder:
        tokenizer = write_tiny_tokenizer(folder)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            hidden_size=32,
            intermediate_size=37,
            num_attention_heads=4,
            num_hidden_layers=2,
            layer_norm_eps=1e-5,
            vocab_size=len(tokenizer),
            max_position_embeddings=77,
        )
    )
    scheduler = PNDMScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000,
        skip_prk_steps=True, set_alpha_to_one=False, steps_offset=1,
    )
    return StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    ).to(torch.float32)


def _tiny_text_encoder_config(tokenizer, layers: int = 2, **extra):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=layers, layer_norm_eps=1e-5,
        vocab_size=len(tokenizer), max_position_embeddings=77, **extra,
    )


def build_tiny_random_xl_pipeline(seed: int = 0):
    """A tiny random-weights ``StableDiffusionXLPipeline`` built offline: two 3-layer CLIP encoders (the second with
    a projection), a UNet of two blocks conditioned on pooled text and time ids (SDXL's ``text_time``), the tiny
    VAE, Euler scheduler as SDXL ships."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    base = build_tiny_random_pipeline(seed)
    torch.manual_seed(seed + 1)
    tokenizer = base.tokenizer
    text_encoder = CLIPTextModel(_tiny_text_encoder_config(tokenizer, layers=3))
    text_encoder_2 = CLIPTextModelWithProjection(_tiny_text_encoder_config(tokenizer, layers=3, projection_dim=32))
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=2, sample_size=32, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4), use_linear_projection=True, transformer_layers_per_block=(1, 2),
        addition_embed_type="text_time", addition_time_embed_dim=8, projection_class_embeddings_input_dim=6 * 8 + 32,
        cross_attention_dim=64, norm_num_groups=32,
    )
    scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                       steps_offset=1, timestep_spacing="leading")
    return StableDiffusionXLPipeline(
        vae=base.vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2, tokenizer=tokenizer,
        tokenizer_2=tokenizer, unet=unet, scheduler=scheduler,
    ).to(torch.float32)


def build_tiny_random_lcm_pipeline(seed: int = 0):
    """The tiny pipeline with an LCM UNet (``time_cond_proj_dim``: a guidance-scale embedding input) and
    ``LCMScheduler``: a ``LatentConsistencyModelPipeline``."""
    from diffusers import LatentConsistencyModelPipeline, LCMScheduler, UNet2DConditionModel

    base = build_tiny_random_pipeline(seed)
    torch.manual_seed(seed + 2)
    unet = UNet2DConditionModel(**{**base.unet.config, "time_cond_proj_dim": 32})
    return LatentConsistencyModelPipeline(
        vae=base.vae, text_encoder=base.text_encoder, tokenizer=base.tokenizer, unet=unet,
        scheduler=LCMScheduler.from_config(base.scheduler.config), safety_checker=None, feature_extractor=None,
        requires_safety_checker=False,
    ).to(torch.float32)


def build_tiny_random_controlnet(unet, seed: int = 0):
    """A tiny random-weights ``ControlNetModel`` for the tiny UNet: its encoder half (``ControlNetModel.from_unet``,
    a conditioning embedding that downsamples 8×, as the tiny VAE does) with every weight drawn at random — the
    zero convolutions too, which a fresh ControlNet starts at zero (its residuals would then be zero and prove
    nothing)."""
    from diffusers import ControlNetModel

    controlnet = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(8, 16, 16, 32))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in controlnet.named_parameters():
            if name.startswith(("controlnet_down_blocks", "controlnet_mid_block", "controlnet_cond_embedding")):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return controlnet.to(torch.float32)


def build_tiny_random_controlnet_pipeline(seed: int = 0, controlnets: int = 1):
    """The tiny pipeline with one (or ``controlnets``) tiny random ControlNets: a ``StableDiffusionControlNetPipeline``
    (with a ``MultiControlNetModel`` for more than one)."""
    from diffusers import StableDiffusionControlNetPipeline

    base = build_tiny_random_pipeline(seed)
    nets = [build_tiny_random_controlnet(base.unet, seed + 10 + k) for k in range(controlnets)]
    return StableDiffusionControlNetPipeline(
        vae=base.vae, text_encoder=base.text_encoder, tokenizer=base.tokenizer, unet=base.unet,
        controlnet=nets[0] if controlnets == 1 else nets, scheduler=base.scheduler, safety_checker=None,
        feature_extractor=None, requires_safety_checker=False,
    )


TINY_RANDOM_KINDS: Dict[str, Callable[[], Any]] = {
    "sd": build_tiny_random_pipeline,
    "xl": build_tiny_random_xl_pipeline,
    "lcm": build_tiny_random_lcm_pipeline,
    "controlnet": build_tiny_random_controlnet_pipeline,
}


# --------------------------------------------------------------------------------------------------- components
class _TextEncoder(torch.nn.Module):
    def __init__(self, text_encoder):
        super().__init__()
        self.text_encoder = text_encoder

    def forward(self, input_ids):
        output = self.text_encoder(input_ids=input_ids, return_dict=True)
        return output.last_hidden_state, output.pooler_output


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
        if self.with_projection:
            return (output.text_embeds, output.last_hidden_state, *output.hidden_states)
        return (output.last_hidden_state, output.pooler_output, *output.hidden_states)


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


def _component_specs(pipe) -> Dict[str, dict]:
    """What to export for each component: module, example inputs, names and dynamic axes."""
    xl = is_xl(pipe)
    unet = pipe.unet
    vae = pipe.vae
    latent_channels = vae.config.latent_channels
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
    return {
        **specs,
        "vae_encoder": dict(
            module=_VaeEncoder(vae),
            args=(torch.randn(1, vae.config.in_channels, latent_size * vae_scale_factor, latent_size * vae_scale_factor),),
            input_names=["sample"],
            output_names=["latent_sample"],
            dynamic_axes={"sample": {0: "batch", 2: "height", 3: "width"},
                          "latent_sample": {0: "batch", 2: f"height / {vae_scale_factor}",
                                            3: f"width / {vae_scale_factor}"}},
            config=vae.config,
        ),
        "vae_decoder": dict(
            module=_VaeDecoder(vae),
            args=(torch.randn(1, latent_channels, latent_size, latent_size),),
            input_names=["latent_sample"],
            output_names=["sample"],
            # output dims as expressions of the input dims: sized before the run without shape inference (ours)
            # or eval (optimum's IO binding, which fails on a dim name no input has)
            dynamic_axes={"latent_sample": {0: "batch", 2: "latent_height", 3: "latent_width"},
                          "sample": {0: "batch", 2: f"latent_height * {vae_scale_factor}",
                                     3: f"latent_width * {vae_scale_factor}"}},
            config=vae.config,
        ),
    }


def _weight_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the initializers (what decides whether a model fits one protobuf; ByteSize() itself fails > 2 GiB)."""
    return sum(len(t.raw_data) or 4 * (len(t.float_data) + len(t.int32_data)) + 8 * len(t.int64_data)
               for t in model.graph.initializer)


def _save_onnx(model: onnx.ModelProto, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if _weight_bytes(model) > _MAX_SINGLE_FILE_BYTES:
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=EXTERNAL_DATA_FILE, size_threshold=1024)
    else:
        onnx.save_model(model, str(path))


def convert_to_float16(model: onnx.ModelProto, shapes_known: bool = False) -> onnx.ModelProto:
    """fp32 → fp16 with ORT's converter: inputs and outputs become fp16 too (``keep_io_types=False``), the ops in
    its default block list (those that need fp32) stay fp32 behind casts. The converter needs every intermediate's
    type; ``shapes_known`` says the model already carries them (its own inference cannot serialize > 2 GiB)."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    return convert_float_to_float16(model, keep_io_types=False, disable_shape_infer=shapes_known)


# ORT's optimizer model types, and the hidden sizes its BiasSplitGelu kernel takes (others must skip that fusion).
_OPTIMIZER_MODEL_TYPES = {"text_encoder": "clip", "text_encoder_2": "clip", "unet": "unet", "vae_encoder": "vae",
                          "vae_decoder": "vae", "controlnet": "unet"}


def _kind(name: str) -> str:
    """A component's kind: ``controlnet_1``, ``controlnet_2`` … are ControlNets like ``controlnet``."""
    return "controlnet" if name.startswith("controlnet") else name
BIAS_SPLIT_GELU_HIDDEN_SIZES = (2560, 5120, 6144, 10240, 12288)


def fusion_options(name: str, config: Any, target: str):
    """ORT transformer-optimizer fusions for one component.

    ``target="cuda"``: every fusion ORT has for the model type, except BiasSplitGelu where the UNet's GEGLU widths
    are not among :data:`BIAS_SPLIT_GELU_HIDDEN_SIZES`, and GroupNorm for blocks narrower than ORT's kernel takes. ``target="cpu"``: only fusions whose fused ops have CPU
    kernels (attention, layer norm, GELU) — NhwcConv, GroupNorm, SkipGroupNorm, BiasSplitGelu and BiasAdd run on
    CUDA only.
    """
    from onnxruntime.transformers.fusion_options import FusionOptions

    name = _kind(name)
    options = FusionOptions(_OPTIMIZER_MODEL_TYPES[name])
    if target == "cpu":
        for flag in ("enable_nhwc_conv", "enable_group_norm", "enable_skip_group_norm", "enable_bias_splitgelu",
                     "enable_bias_add", "enable_packed_qkv", "enable_packed_kv"):
            if hasattr(options, flag):
                setattr(options, flag, False)
    else:
        channels = list(config.get("block_out_channels", [])) if isinstance(config, dict) else \
            list(getattr(config, "block_out_channels", []))
        if name in ("unet", "controlnet") and not all(8 * c in BIAS_SPLIT_GELU_HIDDEN_SIZES for c in channels):
            options.enable_bias_splitgelu = False
        # ORT's CUDA GroupNorm takes only some channel counts (it refuses 32 channels in 32 groups, for one): the
        # SD-size widths it was written for, UNet blocks of ≥ 320 and VAE blocks of ≥ 128 channels
        smallest = {"unet": 320, "controlnet": 320, "vae_encoder": 128, "vae_decoder": 128}.get(name)
        if smallest is not None and channels and min(channels) < smallest:
            for flag in ("enable_group_norm", "enable_skip_group_norm"):
                if hasattr(options, flag):
                    setattr(options, flag, False)
    return options


def _use_classic_attention(module: torch.nn.Module) -> None:
    """ORT's UNet attention fusion fails on graphs exported from SDPA attention (a TypeError in get_num_heads) and
    fuses the classic processor's MatMul/Softmax pattern into MultiHeadAttention: export with the classic one."""
    from diffusers.models.attention_processor import AttnProcessor

    for child in module.modules():
        if hasattr(child, "set_attn_processor") and hasattr(child, "attn_processors"):
            child.set_attn_processor(AttnProcessor())
            return


@contextlib.contextmanager
def _in_folder(folder: Path):
    """ORT's fusion and shape-inference code reads initializers with ``numpy_helper.to_array(tensor)``, which resolves
    external data relative to the working directory: run it from the model's folder. (The working directory is the
    process's: exporting is not something to run on two threads at once.)"""
    previous = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(previous)


def _load_light(path: Path) -> onnx.ModelProto:
    """The model at ``path`` with every initializer over 1 KiB left on disk beside it (read on demand).

    ORT's symbolic shape inference copies the whole ModelProto, weights included, in the passes that use it: on the
    SD1.5 UNet (3.4 GB fp32) its ``remove_useless_reshape_nodes`` pass alone went past 24 GB and was killed, and on
    the SDXL UNet each such pass took minutes. Without the weights in the proto the same fusions ran in 73 s and
    3.2 GB peak (SD1.5, 2 CPUs). The exporter already writes large models this way; a small one is rewritten so."""
    from onnx.external_data_helper import uses_external_data

    model = onnx.load(str(path), load_external_data=False)
    if not any(uses_external_data(tensor) for tensor in model.graph.initializer):
        model = _unload(model, path)
    return model


def _unload(model: onnx.ModelProto, path: Path) -> onnx.ModelProto:
    """Writes ``model`` to ``path`` with its weights beside it and returns it loaded light (see :func:`_load_light`)."""
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.stem + ".weights", size_threshold=1024)
    return onnx.load(str(path), load_external_data=False)


def _optimize(name: str, path: Path, options: Any, target: str):
    """ORT's transformer optimizer on the model at ``path``, its weights left on disk while the graph is rewritten
    (:func:`_load_light`; fusions that need a weight read it from there); where its attention fusion breaks on a
    graph (the VAE's single-head attention reshapes trip ``get_num_heads_and_hidden_size``), the component is
    optimized again without that fusion. Returns ORT's ``OnnxModel``; initializers it did not touch are still on disk
    in ``path``'s folder: load them (``onnx.load_external_data_for_model``) before that folder goes."""
    from onnxruntime.transformers.optimizer import optimize_model

    def run(fusions):
        with _in_folder(path.parent):
            return optimize_model(_load_light(path), model_type=_OPTIMIZER_MODEL_TYPES[_kind(name)], opt_level=0,
                                  optimization_options=fusions, use_gpu=target == "cuda")

    try:
        return run(options)
    except Exception as error:  # the fusion scripts raise whatever the numpy code under them raises
        if not options.enable_attention:
            raise
        logger.warning("%s: ORT's attention fusion failed (%s: %s); optimizing without it", name,
                       type(error).__name__, error)
        options.enable_attention = False
        return run(options)


def _optimized_to_float16(optimized: Any, folder: Path) -> onnx.ModelProto:
    """What ORT's ``OnnxModel.convert_float_to_float16(keep_io_types=False)`` does — symbolic type inference (onnx's
    own cannot type the fused com.microsoft ops), its float16 converter, then removing cascaded and useless Casts —
    with the weights on disk in ``folder`` for the two inference passes and in memory only for the conversion."""
    from onnx import ValueInfoProto
    from onnxruntime.transformers.float16 import convert_float_to_float16
    from onnxruntime.transformers.onnx_model import OnnxModel
    from onnxruntime.transformers.shape_infer_helper import SymbolicShapeInferenceHelper

    model = optimized.model
    try:
        with _in_folder(folder):
            typed = SymbolicShapeInferenceHelper(model).infer_shapes(model, auto_merge=True, guess_output_rank=False)
    except Exception as error:  # ORT goes on without the types, warning; so do we, saying why
        logger.warning("ORT's symbolic shape inference failed before the float16 conversion (%s: %s); converting "
                       "without its types", type(error).__name__, error)
        typed = None
    # element types only, as ORT merges them (auto_merge may widen shapes: microsoft/onnxruntime#15521)
    known = {info.name for info in model.graph.value_info}
    for info in (typed.graph.value_info if typed is not None else ()):
        if info.name and info.name not in known and info.type.tensor_type.elem_type != onnx.TensorProto.UNDEFINED:
            typed_only = ValueInfoProto()
            typed_only.CopyFrom(info)
            typed_only.type.tensor_type.ClearField("shape")
            model.graph.value_info.append(typed_only)
            known.add(info.name)
    onnx.load_external_data_for_model(model, str(folder))
    converted = OnnxModel(convert_float_to_float16(model, keep_io_types=False, disable_shape_infer=True))
    converted.remove_cascaded_cast_nodes()
    converted = OnnxModel(_unload(converted.model, folder / "fp16.onnx"))
    with _in_folder(folder):
        converted.remove_useless_cast_nodes()
    onnx.load_external_data_for_model(converted.model, str(folder))
    return converted.model


def _export_component(name: str, spec: dict, target: Path, opset: int, fp16: bool, optimize: Optional[str],
                      xl: bool = False) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        scratch_path = Path(scratch) / "model.onnx"
        if optimize:
            _use_classic_attention(spec["module"])
        with torch.no_grad(), warnings.catch_warnings():
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
        if optimize:
            optimized = _optimize(name, scratch_path, fusion_options(name, spec["config"], optimize), optimize)
            if fp16:
                model = _optimized_to_float16(optimized, Path(scratch))
            else:
                model = optimized.model
                onnx.load_external_data_for_model(model, scratch)
        elif fp16:
            # Types of every intermediate first, from the file (works past 2 GiB, unlike in-memory inference):
            # without them the converter turns Resize's float scales into float16, which ORT refuses.
            typed_path = Path(scratch) / "typed.onnx"
            onnx.shape_inference.infer_shapes_path(str(scratch_path), str(typed_path))
            model = convert_to_float16(onnx.load(str(typed_path)), shapes_known=True)
        else:
            model = onnx.load(str(scratch_path))  # with any external data the exporter wrote beside it
    layers_of = getattr(spec["module"], "unet", None) or getattr(spec["module"], "text_encoder", None)
    if layers_of is not None:  # where each layer's weight went: runtime LoRA updates it there
        from .lora import lora_layers, weight_map, write_weight_map

        (target / name).mkdir(parents=True, exist_ok=True)
        write_weight_map(weight_map(layers_of, model), target / name,
                         [layer for layer, _ in lora_layers(layers_of)])
    _save_onnx(model, target / name / "model.onnx")
    config = spec["config"].to_dict() if hasattr(spec["config"], "to_dict") else dict(spec["config"])
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
) -> Path:
    """Exports a diffusers Stable Diffusion (1.x/2.x, LCM, Turbo) pipeline to the diffusers ONNX layout, or an SDXL
    pipeline to optimum's SDXL layout (two text encoders with their hidden states; a UNet taking ``text_embeds`` and
    ``time_ids``). A UNet with ``time_cond_proj_dim`` (LCM) also takes ``timestep_cond``.

    Args:
        model_id_or_path: a local diffusers folder or a hub id; ignored with ``tiny_random``.
        output_dir: where to write the ONNX folder: a new or empty folder, outside the source folder. The export is
            built in a temporary folder beside it and moved into place only once all of it succeeded: a failed or
            interrupted export leaves ``output_dir`` as it was.
        fp16: export fp32, then convert with ORT's float16 converter.
        opset: ONNX opset.
        optimize: ``"cuda"`` or ``"cpu"``: run ORT's transformer optimizer (model types unet/vae/clip) on each
            component before the fp16 conversion, with the fusions that target runs (see :func:`fusion_options`).
            The CUDA fusions (NhwcConv, GroupNorm, BiasSplitGelu …) only run on the CUDA execution provider.
        tiny_random: build a tiny random-weights pipeline offline instead of loading one: ``True`` or ``"sd"``,
            ``"xl"`` (SDXL) or ``"lcm"`` (an LCM UNet with ``timestep_cond``); see :data:`TINY_RANDOM_KINDS`.
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

    Returns:
        The output folder.

    Raises:
        FileExistsError: ``output_dir`` is not empty (without ``overwrite``) or is a file.
        ValueError: ``output_dir`` is the source folder, inside it, or holds it.
    """
    if optimize not in (None, "cuda", "cpu"):
        raise ValueError(f"optimize: expected None, 'cuda' or 'cpu', got {optimize!r}")
    if not isinstance(opset, int) or isinstance(opset, bool) or not 7 <= opset <= 22:
        raise ValueError(f"opset: expected an integer in [7, 22] (17 is tested), got {opset!r}")
    source = Path(model_id_or_path) if (model_id_or_path is not None and torch_pipeline is None and not tiny_random
                                         and Path(model_id_or_path).exists()) else None
    target = check_output_folder(output_dir, source, overwrite)
    if torch_pipeline is not None:
        pipe = torch_pipeline
    elif tiny_random:
        kind = "sd" if tiny_random is True else tiny_random
        if kind not in TINY_RANDOM_KINDS:
            raise ValueError(f"tiny_random: expected True or one of {sorted(TINY_RANDOM_KINDS)}, got {tiny_random!r}")
        pipe = TINY_RANDOM_KINDS[kind]()
    elif model_id_or_path is None:
        raise ValueError("model_id_or_path: expected a diffusers folder or hub id (or tiny_random=True), got None")
    elif pipeline_loader is not None:
        pipe = pipeline_loader(model_id_or_path)
    else:
        from diffusers import DiffusionPipeline

        pipe = DiffusionPipeline.from_pretrained(model_id_or_path, torch_dtype=torch.float32, safety_checker=None)
    if vae is not None:
        if isinstance(vae, (str, os.PathLike)):
            from diffusers import AutoencoderKL

            vae = AutoencoderKL.from_pretrained(os.fspath(vae), torch_dtype=torch.float32)
        if not hasattr(vae, "decode") or not hasattr(vae, "config"):
            raise TypeError(f"vae: expected an AutoencoderKL or its folder or hub id, got {type(vae).__name__}")
        pipe.vae = vae
    if controlnet is not None:
        pipe = _with_controlnets(pipe, controlnet)
    available = onnx_components_of(pipe)
    components = available if components is None else tuple(components)
    unknown = [c for c in components if c not in available]
    if unknown:
        raise ValueError(f"components: expected names from {list(available)}, got {unknown}")
    specs = _component_specs(pipe)
    with building_beside(target) as scratch:
        for name in tqdm(components, desc="export", unit="model", disable=not progress):
            _export_component(name, specs[name], scratch, opset, fp16, optimize, xl=is_xl(pipe))
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
