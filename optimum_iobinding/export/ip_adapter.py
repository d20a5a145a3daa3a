"""IP-Adapter in a UNet's export: the UNet takes each cross-attention layer's image-prompt keys and values.

diffusers' IP-Adapter (``IPAdapterAttnProcessor2_0``) adds to each cross-attention layer's attention output
``scale · softmax(q · k_ipᵀ / √d) · v_ip``, where ``k_ip`` and ``v_ip`` are the adapter's projections (``to_k_ip``,
``to_v_ip``) of the image-prompt tokens, themselves the adapter's projection of the image encoder's embeddings. They
depend on the image and the adapter, never on the step: the pipeline makes them once per call on the device
(:mod:`optimum_iobinding.pipelines.ip_adapter`), the scale folded into the values (the attention is linear in them),
and the exported UNet takes them as inputs (:data:`~optimum_iobinding.layout.IP_ADAPTER_KEY_INPUT` ``i``,
:data:`~optimum_iobinding.layout.IP_ADAPTER_VALUE_INPUT` ``i`` for the ``i``-th cross-attention layer, in the order of
the UNet's attention processors). So one export runs any IP-Adapter of the UNet's widths (plain or plus, any number
of image tokens, any scale per layer), and loading or switching one changes no session and no captured graph.

The image encoder (``CLIPVisionModelWithProjection``) is exported beside it: ``pixel_values`` → ``image_embeds`` (a
plain adapter's input) and ``penultimate_hidden_states`` (a plus adapter's), each attention one
``MultiHeadAttention`` node (:func:`~.attention.attention_as_one_node`).
"""

from __future__ import annotations

import os
from typing import Dict, List, Tuple

import torch

from ..errors import ArgumentError, ArgumentTypeError
from ..layout import IP_ADAPTER_KEY_INPUT, IP_ADAPTER_VALUE_INPUT
from .attention import attention_as_one_node, multi_head_attention

__all__ = [
    "ImagePromptAttnProcessor",
    "image_prompt_layers",
    "image_prompt_inputs",
    "image_prompt_processors",
    "without_loaded_ip_adapter",
    "image_encoder_spec",
    "load_image_encoder",
]


class ImagePromptAttnProcessor:
    """A cross-attention layer for export: diffusers' classic ``AttnProcessor`` steps (the pattern ONNX Runtime's
    attention fusion knows) and, where :attr:`key` and :attr:`value` are set (by the export's UNet wrapper, from its
    inputs), the image-prompt attention added before the output projection, as ``IPAdapterAttnProcessor2_0`` adds
    it (its scale already in :attr:`value`)."""

    #: the export's switch to diffusers' classic processor keeps this one (it takes the classic steps already)
    keeps_classic_steps = True

    def __init__(self):
        self.key = None
        self.value = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, *args, **kw):
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)
        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch_size, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch_size, channel, height * width).transpose(1, 2)
        batch_size, sequence_length, _ = (
            hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
        )
        attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        query = attn.to_q(hidden_states)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        elif attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)
        key = attn.head_to_batch_dim(attn.to_k(encoder_hidden_states))
        value = attn.head_to_batch_dim(attn.to_v(encoder_hidden_states))
        by_head = attn.head_to_batch_dim(query)
        hidden_states = attn.batch_to_head_dim(
            torch.bmm(attn.get_attention_scores(by_head, key, attention_mask), value)
        )
        if self.key is None:
            hidden_states = attn.to_out[0](hidden_states)
        else:
            # one MultiHeadAttention node over the few image tokens (the classic steps would cost a copy of the
            # queries by head and four more kernels per layer)
            image_states = multi_head_attention(query, self.key, self.value, attn.heads, attn.scale)
            # to_out(text + image) written as to_out's product of the text states plus (its bias + its product of the
            # image states): the text attention's chain up to the output projection stays the one ONNX Runtime's
            # attention fusion matches (the bias Add's other operand may be any tensor)
            projection = attn.to_out[0]
            image_out = torch.nn.functional.linear(image_states, projection.weight)
            if projection.bias is not None:
                image_out = image_out + projection.bias
            hidden_states = torch.nn.functional.linear(hidden_states, projection.weight) + image_out
        hidden_states = attn.to_out[1](hidden_states)
        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(batch_size, channel, height, width)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor


def image_prompt_layers(unet) -> List[Tuple[str, int]]:
    """The UNet's cross-attention layers in the order of its attention processors (diffusers' order for IP-Adapter
    weights: the ``i``-th is the adapter's ``{2i + 1}.to_k_ip``), each with its attention's inner width."""
    layers = []
    for name, module in unet.named_modules():
        if name.endswith("attn2") and hasattr(module, "to_k") and hasattr(module, "set_processor"):
            layers.append((name, module.to_k.out_features))
    return layers


def image_prompt_inputs(unet, batch: int = 2, tokens: int = 4) -> Tuple[List[str], List[torch.Tensor], Dict]:
    """The image-prompt inputs of the UNet's export: names (a key and a value per cross-attention layer), example
    tensors and dynamic axes (rows and image-prompt tokens)."""
    names, examples, axes = [], [], {}
    for index, (_, width) in enumerate(image_prompt_layers(unet)):
        for prefix in (IP_ADAPTER_KEY_INPUT, IP_ADAPTER_VALUE_INPUT):
            names.append(f"{prefix}{index}")
            examples.append(torch.randn(batch, tokens, width))
            axes[names[-1]] = {0: "batch", 1: "image_prompt_tokens"}
    return names, examples, axes


def image_prompt_processors(unet) -> List[ImagePromptAttnProcessor]:
    """Sets an :class:`ImagePromptAttnProcessor` on each cross-attention layer of ``unet`` (its other layers keep
    theirs) and returns them in the layers' order."""
    processors = []
    for name, _ in image_prompt_layers(unet):
        processor = ImagePromptAttnProcessor()
        unet.get_submodule(name).set_processor(processor)
        processors.append(processor)
    return processors


class without_loaded_ip_adapter:
    """Within: the torch UNet without an IP-Adapter diffusers' ``load_ip_adapter`` put on it (its image projection
    and ``encoder_hid_dim_type``), which the export's inputs replace; put back on leaving."""

    def __init__(self, unet):
        self.unet = unet
        self.saved = None

    def __enter__(self):
        if getattr(self.unet.config, "encoder_hid_dim_type", None) == "ip_image_proj":
            self.saved = self.unet.encoder_hid_proj
            self.unet.encoder_hid_proj = None
            self.unet.config.encoder_hid_dim_type = None
        return self.unet

    def __exit__(self, *exc):
        if self.saved is not None:
            self.unet.encoder_hid_proj = self.saved
            self.unet.config.encoder_hid_dim_type = "ip_image_proj"
        return False


class _ImageEncoder(torch.nn.Module):
    def __init__(self, encoder):
        super().__init__()
        self.encoder = encoder

    def forward(self, pixel_values):
        with attention_as_one_node(self.encoder):
            output = self.encoder(pixel_values=pixel_values, output_hidden_states=True, return_dict=True)
        return output.image_embeds, output.hidden_states[-2]


def load_image_encoder(image_encoder):
    """A ``CLIPVisionModelWithProjection``: the model itself, or loaded from its folder or hub id (float32)."""
    if isinstance(image_encoder, (str, os.PathLike)):
        from transformers import CLIPVisionModelWithProjection

        return CLIPVisionModelWithProjection.from_pretrained(os.fspath(image_encoder), torch_dtype=torch.float32)
    if not hasattr(image_encoder, "vision_model") or not hasattr(image_encoder, "visual_projection"):
        raise ArgumentTypeError(
            "image_encoder",
            f"expected a CLIPVisionModelWithProjection or its folder or hub id, got {type(image_encoder).__name__}",
        )
    return image_encoder


def image_encoder_spec(encoder) -> dict:
    """The image encoder's export spec: ``pixel_values`` (rows, 3, size, size at its config's image size) →
    ``image_embeds``, ``penultimate_hidden_states``."""
    size = encoder.config.image_size
    if encoder.config.num_hidden_layers < 2:
        raise ArgumentError(
            "image_encoder",
            f"expected a CLIP vision model of at least 2 layers (a plus IP-Adapter takes the penultimate layer's "
            f"states), got {encoder.config.num_hidden_layers}",
        )
    return dict(
        module=_ImageEncoder(encoder),
        args=(torch.randn(2, 3, size, size),),
        input_names=["pixel_values"],
        output_names=["image_embeds", "penultimate_hidden_states"],
        dynamic_axes={
            "pixel_values": {0: "batch"},
            "image_embeds": {0: "batch"},
            "penultimate_hidden_states": {0: "batch"},
        },
        # the states' tokens (one per patch and the class token) and width, declared: the exporter names them freely,
        # and ONNX shape inference stops at the attention nodes, so a CUDA graph could not know the output's shape
        fixed_output_dims={
            "penultimate_hidden_states": {
                1: (size // encoder.config.patch_size) ** 2 + 1,
                2: encoder.config.hidden_size,
            }
        },
        config=encoder.config,
    )
