"""Attention written as ONNX Runtime's own operators while the exporter traces: the VAE's self-attention as one
``Attention`` node (``com.microsoft``), for the optimized exports; and any projected multi-head attention as one
``MultiHeadAttention`` node (:func:`multi_head_attention`: Wan's transformer, whose attention ORT's optimizer does not
fuse), which ORT's CUDA provider runs with cuDNN's flash kernel and its CPU provider runs too.

Why not ORT's own VAE attention fusion (``onnxruntime.transformers.fusion_attention_vae``, ORT 1.31.1): on the graph
diffusers' classic attention processor exports it fails and, made to run, computes another model.

- It reads the head count from the ``Concat`` that builds the query's head reshape (``batch, sequence, heads,
  head_size``) and converts that 1-element 1-D constant with ``int()``: NumPy deprecated converting arrays of
  ``ndim > 0`` to scalars in 1.25 and refuses it now (``TypeError: only 0-dimensional arrays can be converted to
  Python scalars``, NumPy 2.4). ``Concat`` only takes tensors of rank ≥ 1, so no export makes that constant a scalar.
- Past that point it builds the fused node with a bias of zeros in place of the query, key and value biases. The
  key's bias does not change a softmax over keys, but the query's and the value's do: on the tiny random VAE decoder
  the fused output differed from the unfused one by 0.33 (outputs of magnitude 3); with the query and value biases
  set to zero in torch first, by 6e-6.

So the optimized export writes the node itself, from the weights, with every bias: :class:`FusedSelfAttnProcessor`
replaces the VAE's attention processor while the exporter traces; ORT's VAE fusion then finds no ``Softmax`` left
to fuse, and the other fusions (GroupNorm, NhwcConv …) run around the node as before.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch


class _SelfAttention(torch.autograd.Function):
    """Multi-head self-attention from packed projections, ``softmax(q kᵀ · scale) v`` with ``q, k, v = x W + b``:
    computed in torch while the exporter traces, written as one ``com.microsoft`` ``Attention`` node."""

    @staticmethod
    def forward(
        ctx: Any, hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, heads: int, scale: float
    ) -> torch.Tensor:
        batch, sequence, _ = hidden_states.shape

        def by_head(projected: torch.Tensor) -> torch.Tensor:  # (batch, heads, sequence, head_size)
            return projected.reshape(batch, sequence, heads, -1).transpose(1, 2)

        query, key, value = map(by_head, (torch.matmul(hidden_states, weight) + bias).chunk(3, dim=-1))
        probabilities = (torch.matmul(query, key.transpose(-1, -2)) * scale).softmax(dim=-1)
        return torch.matmul(probabilities, value).transpose(1, 2).reshape(batch, sequence, -1)

    @staticmethod
    def symbolic(g: Any, hidden_states: Any, weight: Any, bias: Any, heads: int, scale: float) -> Any:
        # ORT's Attention: input (batch, sequence, input_hidden), weights (input_hidden, 3 × hidden) as [Wq | Wk | Wv],
        # bias (3 × hidden) as [bq | bk | bv]; output (batch, sequence, hidden)
        output = g.op("com.microsoft::Attention", hidden_states, weight, bias, num_heads_i=heads, scale_f=scale)
        output.setType(hidden_states.type())  # the VAE's attention keeps the width (checked in fusable)
        return output


def fusable(attn: Any) -> bool:
    """Whether this diffusers ``Attention`` is a self-attention the ``Attention`` node computes: equal query, key and
    value widths, the input's width kept, no normalization of queries or keys."""
    layers = (attn.to_q, attn.to_k, attn.to_v)
    widths = {layer.out_features for layer in layers}
    return (
        len(widths) == 1
        and attn.to_q.in_features in widths
        and widths.pop() % attn.heads == 0
        and getattr(attn, "norm_q", None) is None
        and getattr(attn, "norm_k", None) is None
        and not getattr(attn, "is_cross_attention", False)
        and all(isinstance(layer, torch.nn.Linear) for layer in layers)
    )


class FusedSelfAttnProcessor:
    """A diffusers attention processor for export: the steps of diffusers' classic ``AttnProcessor`` around the
    attention, the attention itself one ``Attention`` node (see the module's docstring). What that node does not
    cover (cross-attention, a mask, a layer :func:`fusable` refuses) goes to the classic processor."""

    def __init__(self) -> None:
        from diffusers.models.attention_processor import AttnProcessor

        self.classic = AttnProcessor()

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        temb: Optional[torch.Tensor] = None,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        if encoder_hidden_states is not None or attention_mask is not None or not fusable(attn):
            return self.classic(attn, hidden_states, encoder_hidden_states, attention_mask, temb)
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)
        image_shape = hidden_states.shape if hidden_states.ndim == 4 else None
        if image_shape is not None:  # NCHW → (batch, pixels, channels)
            hidden_states = hidden_states.flatten(2).transpose(1, 2)
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        layers = (attn.to_q, attn.to_k, attn.to_v)
        weight = torch.cat([layer.weight for layer in layers]).t()
        bias = torch.cat(
            [layer.bias if layer.bias is not None else layer.weight.new_zeros(layer.out_features) for layer in layers]
        )
        hidden_states = _SelfAttention.apply(hidden_states, weight, bias, int(attn.heads), float(attn.scale))
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))  # projection, dropout
        if image_shape is not None:
            hidden_states = hidden_states.transpose(1, 2).reshape(image_shape)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor


def _attention_owner(module: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The first module under ``module`` (itself included) that sets diffusers attention processors and has any."""
    for child in module.modules():
        if hasattr(child, "set_attn_processor") and getattr(child, "attn_processors", None):
            return child
    return None


@contextlib.contextmanager
def fused_vae_attention(module: torch.nn.Module) -> Iterator[None]:
    """Inside the block, every attention layer of the VAE in ``module`` runs :class:`FusedSelfAttnProcessor`; after
    it, the processors it had before (the caller's VAE is left as it was)."""
    owner = _attention_owner(module)
    if owner is None:  # no attention (diffusers' AutoencoderTiny)
        yield
        return
    previous = dict(owner.attn_processors)
    owner.set_attn_processor(FusedSelfAttnProcessor())
    try:
        yield
    finally:
        owner.set_attn_processor(previous)


# ---------------------------------------------------------------------------------- multi-head attention
class _MultiHeadAttention(torch.autograd.Function):
    """``softmax(q kᵀ · scale) v`` per head of already projected queries, keys and values, each ``(batch, sequence,
    heads × head_size)`` (with ``causal``, each query over the keys up to its own position): computed in torch while
    the exporter traces, written as one ``com.microsoft`` ``MultiHeadAttention`` node (``unidirectional`` where
    causal), which ORT's CUDA provider runs with cuDNN's flash kernel, and its CPU provider too."""

    @staticmethod
    def forward(
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        heads: int,
        scale: float,
        causal: bool,
    ) -> torch.Tensor:
        def by_head(states: torch.Tensor) -> torch.Tensor:  # (batch, heads, sequence, head_size)
            return states.unflatten(-1, (heads, -1)).transpose(1, 2)

        attended = torch.nn.functional.scaled_dot_product_attention(
            by_head(query), by_head(key), by_head(value), scale=scale, is_causal=causal
        )
        return attended.transpose(1, 2).flatten(2)

    @staticmethod
    def symbolic(g: Any, query: Any, key: Any, value: Any, heads: int, scale: float, causal: bool) -> Any:
        attributes = {"num_heads_i": heads, "scale_f": scale, **({"unidirectional_i": 1} if causal else {})}
        output = g.op("com.microsoft::MultiHeadAttention", query, key, value, **attributes)
        output.setType(query.type())  # callers give values as wide as the queries (checked in multi_head_attention)
        return output


def multi_head_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, heads: int, scale: float, causal: bool = False
) -> torch.Tensor:
    """Multi-head attention of projected ``query`` ``(batch, sequence, heads × head_size)`` over ``key`` and ``value``
    ``(batch, context, heads × head_size)``, as torch's ``scaled_dot_product_attention`` computes it per head, exported
    as one ``com.microsoft`` ``MultiHeadAttention`` node.

    Args:
        query, key, value: the projections, heads side by side on the last axis, all three of one width (the node's
            output is typed as the query).
        heads: the number of heads.
        scale: the logits' scale (1 / √head_size for plain attention).
        causal: each query attends to the keys up to its own position only (self-attention: context = sequence).

    Returns:
        The attended values, ``(batch, sequence, heads × head_size)``.
    """
    return _MultiHeadAttention.apply(query, key, value, int(heads), float(scale), bool(causal))


@contextlib.contextmanager
def attention_as_one_node(encoder: torch.nn.Module, causal: bool = False) -> Iterator[None]:
    """Within: each attention layer of the CLIP ``encoder`` (transformers' ``CLIPAttention``: ``q_proj``, ``k_proj``,
    ``v_proj``, ``out_proj``) computes its heads as one ``MultiHeadAttention`` node when traced
    (:func:`multi_head_attention`). ORT's optimizer fuses no attention of a vision encoder, nor of a text encoder
    whose causal mask transformers builds as it does now (a masked softmax guarded against NaN); and the mask's own
    arithmetic on the sequence's length runs on the CPU, which keeps a CUDA session from capturing one graph for
    every input shape.

    Args:
        encoder: the CLIP vision or text model.
        causal: the text encoder's causal attention: each layer's mask is taken as the causal one and the node made
            ``unidirectional`` (the caller passes no padding mask). Without it, a layer called with a mask runs as
            its own ``forward``.

    The layers' own ``forward`` is back on leaving."""
    patched = []
    for module in encoder.modules():
        if not all(hasattr(module, name) for name in ("q_proj", "k_proj", "v_proj", "out_proj", "num_heads", "scale")):
            continue
        original = module.forward

        def forward(hidden_states, attention_mask=None, *args, _module=module, _original=original, **kwargs):
            masked = attention_mask is not None or args or kwargs.get("causal_attention_mask") is not None
            if masked and not causal:
                return _original(hidden_states, attention_mask, *args, **kwargs)
            attended = multi_head_attention(
                _module.q_proj(hidden_states),
                _module.k_proj(hidden_states),
                _module.v_proj(hidden_states),
                _module.num_heads,
                _module.scale,
                causal,
            )
            return _module.out_proj(attended), None

        patched.append((module, module.__dict__.get("forward")))
        module.forward = forward
    try:
        yield
    finally:
        for module, own in patched:
            if own is None:
                del module.forward  # the class's own again
            else:
                module.forward = own


@contextlib.contextmanager
def constant_attention_scale() -> Iterator[None]:
    """Within: torch's ``scaled_dot_product_attention`` called without a ``scale`` gets its default,
    1 / √head_size, as a number. Traced without it, the TorchScript exporter computes the scale from the query's
    shape (``Shape`` → ``Sqrt`` → a ``Mul`` on the query and key), which ONNX Runtime's CUDA provider computes on the
    CPU and copies up: it then refuses one session that captures a graph per input shape. For the plain exports of
    the UNet families' components only (the UNet's optimized export uses diffusers' classic attention, and the VAE's
    writes its attention node itself); not for the diffusion transformers, whose optimized graphs ORT's MMDiT
    attention fusion makes by matching that very ``Sqrt`` chain in the graph their plain export writes."""
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention

    def scaled_dot_product_attention(query, key, value, *args, scale=None, **kwargs):
        if scale is None:
            scale = float(int(query.shape[-1]) ** -0.5)
        return original(query, key, value, *args, scale=scale, **kwargs)

    functional.scaled_dot_product_attention = scaled_dot_product_attention
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = original


# ---------------------------------------------------------------------------------- rotary embedding
class _InterleavedRotaryEmbedding(torch.autograd.Function):
    """The rotary embedding of ``states`` ``(batch, tokens, heads × head_size)`` whose pairs of neighbouring values
    ``(x1, x2)`` turn by each token's angles, ``(x1 cos − x2 sin, x1 sin + x2 cos)``, with the cosines and sines
    ``(tokens, head_size / 2)`` given per token: computed in torch while the exporter traces, written as one
    ``com.microsoft`` ``RotaryEmbedding`` node in its interleaved form (positions counted from 0, so that token ``t``
    reads row ``t`` of the tables) — one pass over the activations instead of a slice, four products, a sum, a
    difference and a concatenation, each a pass."""

    @staticmethod
    def forward(ctx: Any, states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
        by_head = states.unflatten(2, (heads, -1))
        first, second = by_head[..., 0::2], by_head[..., 1::2]
        cos, sin = cos[:, None, :], sin[:, None, :]  # (tokens, 1, head_size / 2): every head turns alike
        rotated = torch.stack([first * cos - second * sin, first * sin + second * cos], dim=-1)
        return rotated.flatten(3).flatten(2)

    @staticmethod
    def symbolic(g: Any, states: Any, cos: Any, sin: Any, heads: int) -> Any:
        positions = g.op("Constant", value_t=torch.zeros(1, dtype=torch.int64))  # an offset: token t at row t
        output = g.op("com.microsoft::RotaryEmbedding", states, positions, cos, sin, interleaved_i=1, num_heads_i=heads)
        output.setType(states.type())
        return output


def interleaved_rotary_embedding(
    states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int
) -> torch.Tensor:
    """The rotary embedding that turns each pair of neighbouring values of every head of ``states`` by its token's
    angles (Wan's), exported as one ``com.microsoft`` ``RotaryEmbedding`` node (interleaved).

    Args:
        states: queries or keys ``(batch, tokens, heads × head_size)``.
        cos, sin: the cosine and sine of each token's angles, ``(tokens, head_size / 2)``, of the states' dtype (the
            node reads its tables in the input's type).
        heads: the number of heads.

    Returns:
        The turned states, of ``states``' shape.
    """
    return _InterleavedRotaryEmbedding.apply(states, cos, sin, int(heads))
