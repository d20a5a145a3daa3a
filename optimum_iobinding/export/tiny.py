"""Tiny random-weights diffusers pipelines and LoRAs, built offline (no weights can be downloaded in tests): the
default demo, the tests' fixtures and the benchmark's small models start from these."""

from __future__ import annotations

import inspect
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, Sequence, Union

import numpy as np
import torch

from ..errors import ArgumentError
from ..families import FLUX_CONTROL_TOKEN_WIDTH, FLUX_FILL_TOKEN_WIDTH


def _in_float32(built):
    """``built`` (a pipeline, or one model) with every torch module in float32, cast by torch's ``float()``:
    diffusers' ``.to(torch.float32)`` warns of "modules … that should be kept in float32: []" for models that list
    none."""
    modules = built.components.values() if hasattr(built, "components") else (built,)
    for module in modules:
        if isinstance(module, torch.nn.Module):
            module.float()
    return built


# ------------------------------------------------------------------------------------------------- tiny pipeline
def _byte_to_unicode() -> Dict[int, str]:
    """GPT-2/CLIP's reversible byte → printable character map (printable bytes stand for themselves)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
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
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
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
    """A tiny random-weights ``StableDiffusionPipeline`` built offline: UNet of two blocks (32/64 channels) of one layer, a
    2-layer CLIP text model of hidden size 32, a small four-block VAE (8× scale), a small byte-level BPE tokenizer,
    PNDM scheduler."""
    from diffusers import AutoencoderKL, PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=1,
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
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        num_train_timesteps=1000,
        skip_prk_steps=True,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    pipeline = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    return _in_float32(pipeline)


def _tiny_text_encoder_config(tokenizer, layers: int = 2, **extra):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        hidden_size=32,
        intermediate_size=37,
        num_attention_heads=4,
        num_hidden_layers=layers,
        layer_norm_eps=1e-5,
        vocab_size=len(tokenizer),
        max_position_embeddings=77,
        **extra,
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
        block_out_channels=(32, 64),
        layers_per_block=1,
        sample_size=32,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        transformer_layers_per_block=(1, 2),
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=6 * 8 + 32,
        cross_attention_dim=64,
        norm_num_groups=32,
    )
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1, timestep_spacing="leading"
    )
    pipeline = StableDiffusionXLPipeline(
        vae=base.vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer,
        unet=unet,
        scheduler=scheduler,
    )
    return _in_float32(pipeline)


def build_tiny_random_lcm_pipeline(seed: int = 0):
    """The tiny pipeline with an LCM UNet (``time_cond_proj_dim``: a guidance-scale embedding input) and
    ``LCMScheduler``: a ``LatentConsistencyModelPipeline``."""
    from diffusers import LatentConsistencyModelPipeline, LCMScheduler, UNet2DConditionModel

    base = build_tiny_random_pipeline(seed)
    torch.manual_seed(seed + 2)
    unet = UNet2DConditionModel(**{**base.unet.config, "time_cond_proj_dim": 32})
    pipeline = LatentConsistencyModelPipeline(
        vae=base.vae,
        text_encoder=base.text_encoder,
        tokenizer=base.tokenizer,
        unet=unet,
        scheduler=LCMScheduler.from_config(base.scheduler.config),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    return _in_float32(pipeline)


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
    return _in_float32(controlnet)


def build_tiny_random_controlnet_pipeline(seed: int = 0, controlnets: int = 1):
    """The tiny pipeline with one (or ``controlnets``) tiny random ControlNets: a ``StableDiffusionControlNetPipeline``
    (with a ``MultiControlNetModel`` for more than one)."""
    from diffusers import StableDiffusionControlNetPipeline

    base = build_tiny_random_pipeline(seed)
    nets = [build_tiny_random_controlnet(base.unet, seed + 10 + k) for k in range(controlnets)]
    return StableDiffusionControlNetPipeline(
        vae=base.vae,
        text_encoder=base.text_encoder,
        tokenizer=base.tokenizer,
        unet=base.unet,
        controlnet=nets[0] if controlnets == 1 else nets,
        scheduler=base.scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def build_tiny_random_xl_controlnet_pipeline(seed: int = 0, controlnets: int = 1):
    """The tiny SDXL pipeline (:func:`build_tiny_random_xl_pipeline`) with one (or ``controlnets``) tiny random SDXL
    ControlNets (:func:`build_tiny_random_controlnet` of its UNet: conditioned on pooled text and time ids as the
    UNet is): a ``StableDiffusionXLControlNetPipeline`` (with a ``MultiControlNetModel`` for more than one), the shapes
    of diffusers' own SDXL ControlNet tests."""
    from diffusers import StableDiffusionXLControlNetPipeline

    base = build_tiny_random_xl_pipeline(seed)
    nets = [build_tiny_random_controlnet(base.unet, seed + 10 + k) for k in range(controlnets)]
    return StableDiffusionXLControlNetPipeline(
        vae=base.vae,
        text_encoder=base.text_encoder,
        text_encoder_2=base.text_encoder_2,
        tokenizer=base.tokenizer,
        tokenizer_2=base.tokenizer_2,
        unet=base.unet,
        controlnet=nets[0] if controlnets == 1 else nets,
        scheduler=base.scheduler,
        add_watermarker=False,
    )


def build_tiny_random_tiny_vae(seed: int = 0, latent_channels: int = 4):
    """A tiny random-weights ``AutoencoderTiny`` (diffusers' TAESD, narrower and shallower) built offline: four blocks
    each way, so the 8× scale of the tiny pipelines' VAE, and ``latent_channels`` (4, what the tiny UNets take).

    Its weights are drawn so that latents and images vary as a trained model's do (torch's default scale shrinks the
    signal through every ReLU: images came out nearly constant, about -1, proving little): convolutions of variance
    1.2 / fan-in, biases of 0.1, and the decoder's last bias 0.5, which centres its images (it returns 2x - 1)."""
    from diffusers import AutoencoderTiny

    torch.manual_seed(seed)
    vae = AutoencoderTiny(
        encoder_block_out_channels=(16, 16, 16, 16),
        decoder_block_out_channels=(16, 16, 16, 16),
        num_encoder_blocks=(1, 1, 1, 1),
        num_decoder_blocks=(1, 1, 1, 1),
        latent_channels=latent_channels,
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in (module for module in vae.modules() if isinstance(module, torch.nn.Conv2d)):
            scale = (1.2 / layer.weight[0].numel()) ** 0.5  # fan-in: one output channel's weights
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=generator) * scale)
            if layer.bias is not None:
                layer.bias.copy_(torch.randn(layer.bias.shape, generator=generator) * 0.1)
        last = [layer for layer in vae.decoder.modules() if isinstance(layer, torch.nn.Conv2d)][-1]
        last.bias.fill_(0.5)
    return _in_float32(vae)


# -------------------------------------------------------------------------------- tiny SD3 and Flux (MMDiT)
_T5_SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")  # T5's ids 0, 1 and 2: padding, end of text, unknown


def write_tiny_t5_tokenizer(folder: Union[str, os.PathLike], model_max_length: int = 512) -> "object":
    """Writes a small unigram (sentencepiece-style) vocabulary as ``tokenizer.json`` and returns the
    ``T5TokenizerFast`` loaded from ``folder`` (transformers 4 and 5 both load it; nothing is downloaded).

    As T5's: ``<pad>`` 0, ``</s>`` 1 (appended to every text), ``<unk>`` 2, words prefixed with ``▁`` (the
    Metaspace marker), and every printable ASCII character as a piece of its own, so any text tokenizes; no
    ``<extra_id_N>`` sentinels (``extra_ids=0``): a text encoder needs none."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    pieces = [(token, 0.0) for token in _T5_SPECIAL_TOKENS] + [("▁" + word, -2.0) for word in _TINY_WORDS]
    pieces += [("▁", -3.0)] + [(chr(code), -5.0) for code in range(ord("!"), ord("~") + 1)]
    backend = Tokenizer(models.Unigram(pieces, unk_id=_T5_SPECIAL_TOKENS.index("<unk>"), byte_fallback=False))
    backend.normalizer = normalizers.Replace(" {2,}", " ")
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    backend.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "T5TokenizerFast",
                "model_max_length": model_max_length,
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "pad_token": "<pad>",
                "extra_ids": 0,
            },
            indent=2,
        )
    )
    return T5TokenizerFast.from_pretrained(str(folder))


def build_tiny_random_sd3_pipeline(seed: int = 0, with_t5: bool = True):
    """A tiny random-weights ``StableDiffusion3Pipeline`` built offline: two 2-layer CLIP text encoders with
    projections (hidden size 32, projection 32: pooled projections of 64), a 2-layer T5 encoder of width 64 (the
    transformer's ``joint_attention_dim``; ``with_t5=False``: none, as ``text_encoder_3=None`` runs), an MMDiT of
    two layers (patch size 2, 16 latent channels), a four-block VAE of 16 latent channels (8× scale) with SD3's
    scaling and shift factors, and the flow-matching Euler scheduler with SD3's shift of 3."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextModelWithProjection, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory() as folder:
        tokenizer = write_tiny_tokenizer(folder)
    with tempfile.TemporaryDirectory() as folder:
        tokenizer_3 = write_tiny_t5_tokenizer(folder) if with_t5 else None
    text_encoder = CLIPTextModelWithProjection(_tiny_text_encoder_config(tokenizer, projection_dim=32))
    text_encoder_2 = CLIPTextModelWithProjection(_tiny_text_encoder_config(tokenizer, projection_dim=32))
    text_encoder_3 = None
    if with_t5:
        text_encoder_3 = T5EncoderModel(
            T5Config(
                vocab_size=len(tokenizer_3),
                d_model=64,
                d_kv=16,
                d_ff=37,
                num_layers=2,
                num_heads=4,
                relative_attention_num_buckets=8,
                pad_token_id=tokenizer_3.pad_token_id,
                eos_token_id=tokenizer_3.eos_token_id,
                decoder_start_token_id=tokenizer_3.pad_token_id,
            )
        ).eval()  # built in training mode: its dropout would make every call differ
    transformer = SD3Transformer2DModel(
        sample_size=32,
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=64,
        caption_projection_dim=32,
        pooled_projection_dim=64,
        pos_embed_max_size=32,
        dual_attention_layers=(0,),
        qk_norm="rms_norm",  # SD3.5's MMDiT-X features
    )
    vae = AutoencoderKL(
        block_out_channels=(32, 32, 32, 64),
        layers_per_block=1,
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=16,
        norm_num_groups=32,
        sample_size=64,
        scaling_factor=1.5305,
        shift_factor=0.0609,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer,
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )


def build_tiny_random_flux_pipeline(seed: int = 0, guidance_embeds: bool = False):
    """A tiny random-weights ``FluxPipeline`` built offline: a 2-layer CLIP text model (hidden 32; its pooled output
    is Flux's ``pooled_projections``), a 2-layer gated-GELU T5 encoder (d_model 32), a Flux transformer of one double
    and one single block (2 heads of 16, rotary axes 4/6/6), a four-block VAE (8× scale) of 16 latent channels with
    FLUX.1's scaling and shift factors, FLUX.1's FlowMatchEulerDiscreteScheduler settings. ``guidance_embeds``:
    FLUX.1 dev's guidance embedding (a ``guidance`` input); without it, schnell's shape."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5Config, T5EncoderModel

    with tempfile.TemporaryDirectory() as folder:
        tokenizer = write_tiny_tokenizer(Path(folder) / "clip")
        tokenizer_2 = write_tiny_t5_tokenizer(Path(folder) / "t5")
    torch.manual_seed(seed)
    # in inference mode, as from_pretrained gives them (a model built from a config starts in training mode)
    text_encoder = CLIPTextModel(_tiny_text_encoder_config(tokenizer)).eval()
    text_encoder_2 = T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer_2),
            d_model=32,
            d_kv=8,
            d_ff=37,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            feed_forward_proj="gated-gelu",
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
            is_encoder_decoder=False,
            use_cache=False,
            dropout_rate=0.0,
        )
    ).eval()
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=guidance_embeds,
        axes_dims_rope=(4, 6, 6),
    )
    vae = AutoencoderKL(
        block_out_channels=(16, 16, 32, 32),
        layers_per_block=1,
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=16,
        norm_num_groups=8,
        sample_size=64,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    # FLUX.1 dev's schedule (resolution-dependent shift); schnell's has a fixed shift of 1
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0 if guidance_embeds else 1.0,
        use_dynamic_shifting=guidance_embeds,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    return FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )


# FLUX.1's image-conditioned variants: the diffusers pipeline class, and the transformer's token width (None: FLUX.1's)
_FLUX_VARIANTS = {
    "kontext": ("FluxKontextPipeline", None),
    "fill": ("FluxFillPipeline", FLUX_FILL_TOKEN_WIDTH),
    "control": ("FluxControlPipeline", FLUX_CONTROL_TOKEN_WIDTH),
}


def build_tiny_random_flux_variant_pipeline(variant: str, seed: int = 0):
    """A tiny random-weights image-conditioned FLUX.1 pipeline built offline, on the tiny FLUX.1 dev pipeline's
    encoders, VAE and scheduler (:func:`build_tiny_random_flux_pipeline`; the variants are dev models): ``"kontext"``
    (``FluxKontextPipeline``, dev's transformer: the reference image's tokens go in beside the latents'),
    ``"fill"`` (``FluxFillPipeline``: a transformer taking 384 values per token, as FLUX.1 Fill's: the latents' 64,
    the masked image's 64, the 8 × 8 mask's 256) or ``"control"`` (``FluxControlPipeline``: 128, as FLUX.1
    Canny/Depth's: the latents' and the control image's). The transformers predict 64 values per token."""
    import diffusers
    from diffusers import FluxTransformer2DModel

    if variant not in _FLUX_VARIANTS:
        raise ArgumentError("variant", f"expected one of {sorted(_FLUX_VARIANTS)}, got {variant!r}")
    class_name, token_width = _FLUX_VARIANTS[variant]
    components = build_tiny_random_flux_pipeline(seed, guidance_embeds=True).components
    if token_width is not None:
        torch.manual_seed(seed + 1)
        config = {key: value for key, value in components["transformer"].config.items() if not key.startswith("_")}
        components["transformer"] = FluxTransformer2DModel(**{**config, "in_channels": token_width, "out_channels": 64})
    pipeline_class = getattr(diffusers, class_name)
    accepted = inspect.signature(pipeline_class.__init__).parameters
    return pipeline_class(**{name: module for name, module in components.items() if name in accepted})


# the tiny FLUX.1 ControlNets' kinds: InstantX's (the control image's latents in), a union one (InstantX's and
# Shakker-Labs' Union: a mode per call, of 3 here), XLabs' (pixels in, through its own hint block; its samples repeat)
FLUX_CONTROLNET_KINDS = ("plain", "union", "xlabs")


def build_tiny_random_flux_controlnet(transformer, seed: int = 0, kind: str = "plain"):
    """A tiny random-weights ``FluxControlNetModel`` for the tiny FLUX.1 transformer (its widths, rotary axes and
    guidance embedding), of one double-stream and one single-stream block, of ``kind`` (:data:`FLUX_CONTROLNET_KINDS`),
    with every weight drawn at random: the zero-initialized projections too (a fresh ControlNet's samples would be
    zero and prove nothing)."""
    from diffusers import FluxControlNetModel

    if kind not in FLUX_CONTROLNET_KINDS:
        raise ArgumentError("kind", f"expected one of {list(FLUX_CONTROLNET_KINDS)}, got {kind!r}")
    config = transformer.config
    torch.manual_seed(seed)
    controlnet = FluxControlNetModel(
        patch_size=2 if kind == "xlabs" else 1,  # XLabs' hint block gives 16 channels, patched 2 × 2 into 64
        in_channels=config.in_channels,
        num_layers=1,
        num_single_layers=0 if kind == "xlabs" else 1,
        attention_head_dim=config.attention_head_dim,
        num_attention_heads=config.num_attention_heads,
        joint_attention_dim=config.joint_attention_dim,
        pooled_projection_dim=config.pooled_projection_dim,
        guidance_embeds=config.guidance_embeds,
        axes_dims_rope=tuple(config.axes_dims_rope),
        num_mode=3 if kind == "union" else None,
        conditioning_embedding_channels=16 if kind == "xlabs" else None,
    ).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in controlnet.named_parameters():
            if name.startswith(("controlnet_blocks", "controlnet_single_blocks", "controlnet_x_embedder")):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return _in_float32(controlnet)


def build_tiny_random_flux_controlnet_pipeline(seed: int = 0, controlnets: Sequence[str] = ("plain",)):
    """The tiny FLUX.1 dev pipeline (:func:`build_tiny_random_flux_pipeline`) with a tiny random ControlNet of each
    kind in ``controlnets`` (:func:`build_tiny_random_flux_controlnet`; all XLabs' or none): a
    ``FluxControlNetPipeline`` (with a ``FluxMultiControlNetModel`` for more than one)."""
    from diffusers import FluxControlNetPipeline

    base = build_tiny_random_flux_pipeline(seed, guidance_embeds=True)
    nets = [
        build_tiny_random_flux_controlnet(base.transformer, seed + 10 + k, kind) for k, kind in enumerate(controlnets)
    ]
    return FluxControlNetPipeline(
        scheduler=base.scheduler,
        vae=base.vae,
        text_encoder=base.text_encoder,
        tokenizer=base.tokenizer,
        text_encoder_2=base.text_encoder_2,
        tokenizer_2=base.tokenizer_2,
        transformer=base.transformer,
        controlnet=nets[0] if len(nets) == 1 else nets,
    )


# -------------------------------------------------------------------------------------------------- tiny Wan
def build_tiny_random_wan_pipeline(
    seed: int = 0,
    two_experts: bool = False,
    boundary_ratio: float = 0.875,
    expand_timesteps: bool = False,
    scheduler: str = "unipc",
):
    """A tiny random-weights ``WanPipeline`` (Wan 2.1 text to video) built offline, of the shapes of diffusers' own
    Wan tests: a 2-layer UMT5 encoder of width 32 with the tiny unigram tokenizer (:func:`write_tiny_t5_tokenizer`), a
    ``WanTransformer3DModel`` of two layers (2 heads of 12, patches of 1 × 2 × 2, 16 latent channels, rotary tables of
    32 positions), an ``AutoencoderKLWan`` of base width 3 and 16 latent channels (8× spatial, 4× temporal scale) and
    the scheduler Wan 2.1 ships (``"unipc"``: ``UniPCMultistepScheduler`` with flow sigmas, shift 3) or diffusers'
    tests' (``"euler"``: ``FlowMatchEulerDiscreteScheduler`` with shift 7).

    Args:
        seed: the seed every weight is drawn from.
        two_experts: Wan 2.2's shape: a second transformer (``transformer_2``, the low-noise expert) switched to below
            ``boundary_ratio`` × the scheduler's training timesteps.
        boundary_ratio: where the experts switch (with ``two_experts``).
        expand_timesteps: Wan 2.2 TI2V's shape: one timestep per latent token (the pipeline's ``expand_timesteps``).
        scheduler: ``"unipc"`` or ``"euler"``.

    Returns:
        The ``WanPipeline``, in float32.
    """
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        UniPCMultistepScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    if scheduler not in ("unipc", "euler"):
        raise ArgumentError("scheduler", f"expected 'unipc' or 'euler', got {scheduler!r}")
    with tempfile.TemporaryDirectory() as folder:
        tokenizer = write_tiny_t5_tokenizer(folder)
    torch.manual_seed(seed)
    vae = AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    )
    text_encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(tokenizer),
            d_model=32,
            d_kv=8,
            d_ff=37,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            feed_forward_proj="gated-gelu",
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.pad_token_id,
            is_encoder_decoder=False,
            use_cache=False,
            dropout_rate=0.0,
        )
    ).eval()  # built in training mode: its dropout would make every call differ

    def transformer():
        return WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=12,
            in_channels=16,
            out_channels=16,
            text_dim=32,
            freq_dim=256,
            ffn_dim=32,
            num_layers=2,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
        )

    first = transformer()
    second = transformer() if two_experts else None
    if scheduler == "unipc":
        flow = UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=3.0
        )
    else:
        flow = FlowMatchEulerDiscreteScheduler(shift=7.0)
    pipeline = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=flow,
        transformer=first,
        transformer_2=second,
        boundary_ratio=boundary_ratio if two_experts else None,
        expand_timesteps=expand_timesteps,
    )
    return _in_float32(pipeline)


def build_tiny_random_wan_i2v_pipeline(seed: int = 0, image_encoder: bool = True, two_experts: bool = False):
    """A tiny random-weights ``WanImageToVideoPipeline`` built offline on the tiny Wan pipeline's encoder, VAE and
    scheduler (:func:`build_tiny_random_wan_pipeline`): transformers taking the latents, the first frame's mask (4
    channels) and its latents side by side (36 channels), as Wan's image-to-video ones.

    Args:
        seed: the seed every weight is drawn from.
        image_encoder: Wan 2.1 I2V's shape: a CLIP vision encoder (2 layers of width 16, 32 × 32 pixels in patches
            of 4: 65 tokens) and its image processor, and transformers that attend to its penultimate states through
            keys and values of their own (``image_dim``, ``added_kv_proj_dim``); without it, Wan 2.2 I2V's.
        two_experts: Wan 2.2's second transformer (the low-noise expert), switched to below a boundary ratio of 0.9.

    Returns:
        The ``WanImageToVideoPipeline``, in float32.
    """
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    base = build_tiny_random_wan_pipeline(seed)
    torch.manual_seed(seed + 1)
    encoder = processor = None
    if image_encoder:
        encoder = CLIPVisionModel(
            CLIPVisionConfig(
                hidden_size=16,
                intermediate_size=37,
                num_hidden_layers=2,
                num_attention_heads=2,
                image_size=32,
                patch_size=4,
                projection_dim=16,
            )
        ).eval()
        processor = CLIPImageProcessor(crop_size=32, size=32)
    config = {key: value for key, value in base.transformer.config.items() if not key.startswith("_")}
    config.update(in_channels=36, out_channels=16)
    if image_encoder:
        config.update(image_dim=16, added_kv_proj_dim=24)

    def transformer():
        return WanTransformer3DModel(**config)

    first = transformer()
    second = transformer() if two_experts else None
    pipeline = WanImageToVideoPipeline(
        tokenizer=base.tokenizer,
        text_encoder=base.text_encoder,
        vae=base.vae,
        scheduler=base.scheduler,
        image_processor=processor,
        image_encoder=encoder,
        transformer=first,
        transformer_2=second,
        boundary_ratio=0.9 if two_experts else None,
    )
    return _in_float32(pipeline)


TINY_RANDOM_KINDS: Dict[str, Callable[[], Any]] = {
    "sd": build_tiny_random_pipeline,
    "xl": build_tiny_random_xl_pipeline,
    "lcm": build_tiny_random_lcm_pipeline,
    "controlnet": build_tiny_random_controlnet_pipeline,
    "xl-controlnet": build_tiny_random_xl_controlnet_pipeline,
    "sd3": build_tiny_random_sd3_pipeline,
    "flux": build_tiny_random_flux_pipeline,
    "flux-dev": lambda: build_tiny_random_flux_pipeline(guidance_embeds=True),
    **{f"flux-{variant}": (lambda v=variant: build_tiny_random_flux_variant_pipeline(v)) for variant in _FLUX_VARIANTS},
    "flux-controlnet": build_tiny_random_flux_controlnet_pipeline,
    "wan": build_tiny_random_wan_pipeline,
    "wan2.2": lambda: build_tiny_random_wan_pipeline(two_experts=True),
    "wan-i2v": build_tiny_random_wan_i2v_pipeline,
    "wan2.2-i2v": lambda: build_tiny_random_wan_i2v_pipeline(image_encoder=False, two_experts=True),
}


# ------------------------------------------------------------------------------------------------- tiny LoRA
def random_lora_layers(
    module: torch.nn.Module, targets: Sequence[str], rank: int = 4, seed: int = 0
) -> Dict[str, torch.Tensor]:
    """A random LoRA for ``module`` (tests and benchmarks: no LoRA can be downloaded offline): for every Linear and
    Conv2d whose name is one of ``targets`` or ends with ``"." + target`` (PEFT's matching), ``lora_A`` (rank × in,
    with the layer's kernel for a convolution) and ``lora_B`` (out × rank, 1 × 1), both non-zero, keyed by PEFT's
    names (``down_blocks.0….to_q.lora_A.weight``). Works on a module made on the ``meta`` device (shapes only)."""
    generator = torch.Generator().manual_seed(seed)
    layers: Dict[str, torch.Tensor] = {}
    for name, layer in module.named_modules():
        if not any(name == target or name.endswith("." + target) for target in targets):
            continue
        if isinstance(layer, torch.nn.Linear):
            down_shape, up_shape = (rank, layer.in_features), (layer.out_features, rank)
        elif isinstance(layer, torch.nn.Conv2d):
            down_shape = (rank, layer.in_channels, *layer.kernel_size)
            up_shape = (layer.out_channels, rank, 1, 1)
        else:
            continue
        fan_in = int(np.prod(down_shape[1:]))
        layers[f"{name}.lora_A.weight"] = torch.randn(down_shape, generator=generator) / fan_in**0.5
        layers[f"{name}.lora_B.weight"] = torch.randn(up_shape, generator=generator) * 0.5 / rank**0.5
    if not layers:
        raise ArgumentError("targets", f"no Linear or Conv2d layer of the module is named {list(targets)}")
    return layers


def save_lora(folder: Union[str, Path], **components: Dict[str, torch.Tensor]) -> Path:
    """Writes ``pytorch_lora_weights.safetensors`` in diffusers' format: each component's layers (e.g.
    ``unet=random_lora_layers(...)``) under its name (``unet.…``, ``text_encoder.…``)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {
            f"{component}.{key}": value.contiguous()
            for component, layers in components.items()
            for key, value in layers.items()
        },
        str(folder / "pytorch_lora_weights.safetensors"),
    )
    return folder
