"""Export of Wan pipelines — text to video (Wan 2.1, Wan 2.2's two experts, Wan 2.2 TI2V's per-token timesteps) and
image to video (Wan 2.1 I2V with its CLIP image encoder, Wan 2.2 I2V): the UMT5 text encoder and the
``WanTransformer3DModel``\\ s, written in optimum's diffusion-transformer layout by :mod:`.transformer_pipeline`,
with the traceable, fast stand-ins of the transformer's rotary embedding and attention; the CLIP image encoder; and
the causal 3-D VAE as :mod:`.wan_vae` writes it.

Layout written::

    model_index.json            the torch pipeline's index (WanPipeline or WanImageToVideoPipeline; boundary_ratio
                                and expand_timesteps)
    text_encoder/               UMT5EncoderModel: input_ids, attention_mask (int64) → last_hidden_state
    transformer/, transformer_2/  WanTransformer3DModel (transformer_2: Wan 2.2's low-noise expert):
                                hidden_states (batch, channels, frames, height, width), encoder_hidden_states (batch,
                                text tokens, text width), timestep (batch; Wan 2.2 TI2V: batch, latent tokens)
                                → out_hidden_states (batch, channels, frames, height, width); image to video's
                                hidden_states have 36 channels (the latents', the first frame's mask and latents),
                                Wan 2.1 I2V's take encoder_hidden_states_image (batch, image tokens, width) too
                                (Wan 2.1 FLF2V's: 2 × batch, pos_embed_seq_len / 2, width: a first and a last image);
                                with ``step_cache``, each beside its First-Block Cache parts (:mod:`.step_cache`)
    image_encoder/, image_processor/  Wan 2.1 I2V's CLIPVisionModel: pixel_values → image_embeds (its penultimate
                                hidden states), and its CLIPImageProcessor
    vae_encoder/, vae_decoder/  AutoencoderKLWan as chunk graphs (model.onnx, chunk.onnx): see :mod:`.wan_vae`
    tokenizer/, scheduler/

Every axis but the channels is dynamic (batch, frames, height, width, text length). The transformer is exported with:

- its rotary embedding as ``com.microsoft`` ``RotaryEmbedding`` nodes in their interleaved form
  (:func:`.attention.interleaved_rotary_embedding`): one pass over the queries or keys. diffusers writes the rotated
  queries and keys by strided assignment (``out[..., 0::2] = …``), which the exporter turns into ``ScatterND``,
  catastrophically slow on ORT's CUDA provider; the tables are made once a call for every block, from float32 (diffusers
  rotates in float64, which ORT's CUDA provider would run on the host);
- its attention as ``com.microsoft`` ``MultiHeadAttention`` nodes (:func:`.attention.multi_head_attention`), cuDNN's
  flash kernel on CUDA; the query and key RMS norms written out in elementary ops (the TorchScript exporter has no
  ``aten::rms_norm`` below opset 23).

Both swaps last while the exporter traces (:func:`exportable_wan_modules`); the caller's model is left as it was.

Precision with ``dtype="fp16"``: the transformers float16 (their ``timestep`` input float32, as diffusers embeds the
timestep in float32), the UMT5 encoder **float32** (T5's feed-forward activations overflow float16: the rule of every
diffusion-transformer export, :mod:`.transformer_pipeline`), the VAE **float32** (diffusers' Wan pipelines run it in
float32: its model cards load it so; ``vae_dtype="fp16"`` exports it float16), the CLIP image encoder **float32** (likewise). ``dtype="bf16"``: the
transformers bfloat16, the rest as for ``"fp16"``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

import torch

from ..errors import ArgumentError
from ..layout import index_entry
from ..families import (
    WAN_IMAGE_EMBEDS,
    WAN_IMAGE_INPUT,
    WAN_IMAGE_PIXELS,
    WAN_INPUTS,
    WAN_SETTINGS,
    WAN_TEXT_CONTEXT,
    WAN_TEXT_INPUTS,
    WAN_TRANSFORMERS,
    family,
    torch_class_family,
)
from .attention import interleaved_rotary_embedding, multi_head_attention
from .components import EXTERNAL_DATA_THRESHOLD, export_model
from .step_cache import check_first_block_cache_depth
from .transformer_pipeline import export_transformer_pipeline
from .wan_vae import WAN_VAE_COMPONENTS, export_wan_vae

WAN = family("wan")
# what a Wan export writes: image to video's CLIP image encoder (and its image processor) through export_model, its VAE
# through .wan_vae, float32 both (as diffusers runs them: the module's docstring)
WAN_COMPONENTS = ("text_encoder", *WAN_TRANSFORMERS, "image_encoder", *WAN_VAE_COMPONENTS)
WRITTEN_BESIDE = ("image_encoder", *WAN_VAE_COMPONENTS)
# ORT's transformer-optimizer model type of each: UMT5 is a T5 (float32 in a float16 export), the transformers'
# normalizations and GELUs are what ORT's MMDiT fusions match
WAN_OPTIMIZER_MODEL_TYPES = {"text_encoder": "t5", **dict.fromkeys(WAN_TRANSFORMERS, "mmdit")}


# ------------------------------------------------------------------------------------------------ text encoder
class _UMT5Encoder(torch.nn.Module):
    """transformers' ``UMT5EncoderModel`` as diffusers' WanPipeline calls it: ``input_ids`` and ``attention_mask``
    (the padding masked out of every attention) → ``last_hidden_state``."""

    def __init__(self, text_encoder: torch.nn.Module):
        super().__init__()
        self.text_encoder = text_encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.text_encoder(input_ids=input_ids, attention_mask=attention_mask, return_dict=True).last_hidden_state


def umt5_encoder_spec(text_encoder: torch.nn.Module, sequence: int = 16) -> Dict[str, Any]:
    """The export spec of Wan's UMT5 encoder: int64 ``input_ids`` and ``attention_mask`` (batch, sequence) →
    ``last_hidden_state``, both dims dynamic (a short example exports faster; T5's relative positions take any
    length)."""
    mask = torch.ones(1, sequence, dtype=torch.int64)
    mask[:, sequence // 2 :] = 0  # padded, so that the exporter keeps the mask's path
    return dict(
        module=_UMT5Encoder(text_encoder),
        args=(torch.zeros(1, sequence, dtype=torch.int64), mask),
        input_names=list(WAN_TEXT_INPUTS),
        output_names=["last_hidden_state"],
        dynamic_axes={
            **{name: {0: "batch", 1: "sequence"} for name in WAN_TEXT_INPUTS},
            "last_hidden_state": {0: "batch", 1: "sequence"},
        },
        config=text_encoder.config,
    )


# ----------------------------------------------------------------------------------------------- image encoder
class _ImageEncoder(torch.nn.Module):
    """transformers' ``CLIPVisionModel`` as diffusers' WanImageToVideoPipeline reads it: ``pixel_values`` → its
    penultimate hidden states (``image_embeds``)."""

    def __init__(self, image_encoder: torch.nn.Module):
        super().__init__()
        self.image_encoder = image_encoder

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.image_encoder(pixel_values=pixel_values, output_hidden_states=True).hidden_states[-2]


def clip_image_encoder_spec(image_encoder: torch.nn.Module) -> Dict[str, Any]:
    """The export spec of Wan 2.1 I2V's CLIP image encoder: ``pixel_values`` (batch, 3, size, size; the size its
    position embeddings fix) → ``image_embeds`` (batch, patches + 1, width), the batch dynamic."""
    size = image_encoder.config.image_size
    return dict(
        module=_ImageEncoder(image_encoder),
        args=(torch.randn(1, image_encoder.config.num_channels, size, size),),
        input_names=[WAN_IMAGE_PIXELS],
        output_names=[WAN_IMAGE_EMBEDS],
        dynamic_axes={WAN_IMAGE_PIXELS: {0: "batch"}, WAN_IMAGE_EMBEDS: {0: "batch"}},
        # declared: the exporter names these dims freely, and a CUDA graph needs the output's shape before the run
        fixed_output_dims={
            WAN_IMAGE_EMBEDS: {
                1: (size // image_encoder.config.patch_size) ** 2 + 1,
                2: image_encoder.config.hidden_size,
            }
        },
        config=image_encoder.config,
    )


# ------------------------------------------------------------------------------------------------ transformer
class _WanTransformer(torch.nn.Module):
    """diffusers' ``WanTransformer3DModel`` with the inputs in :data:`~optimum_iobinding.families.WAN_INPUTS`' order
    (and Wan 2.1 I2V's image states, :data:`~optimum_iobinding.families.WAN_IMAGE_INPUT`) → ``out_hidden_states``."""

    def __init__(self, transformer: torch.nn.Module):
        super().__init__()
        self.transformer = transformer

    def forward(self, hidden_states, encoder_hidden_states, timestep, encoder_hidden_states_image=None):
        return self.transformer(
            hidden_states=hidden_states,
            timestep=timestep,
            encoder_hidden_states=encoder_hidden_states,
            encoder_hidden_states_image=encoder_hidden_states_image,
            return_dict=False,
        )[0]


class _RotaryTables(torch.nn.Module):
    """Wan's rotary tables (``WanRotaryPosEmbed``) for a latent video: per token, the cosines and sines of its frame's,
    row's and column's angles side by side, ``(tokens, head_dim / 2)`` — each angle once (diffusers' tables
    repeat each twice and its rotation reads every other one) and in float32 (diffusers' tables are float64)."""

    def __init__(self, rope: torch.nn.Module):
        super().__init__()
        self.patch_size = tuple(rope.patch_size)
        self.split = [rope.t_dim // 2, rope.h_dim // 2, rope.w_dim // 2]
        self.register_buffer("cos", rope.freqs_cos[:, 0::2].to(torch.float32), persistent=False)
        self.register_buffer("sin", rope.freqs_sin[:, 1::2].to(torch.float32), persistent=False)

    def forward(self, hidden_states: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        _, _, frames, height, width = hidden_states.shape
        p_t, p_h, p_w = self.patch_size
        grid = (frames // p_t, height // p_h, width // p_w)

        def table(values: torch.Tensor) -> torch.Tensor:
            axes = []
            for axis, part in enumerate(values.split(self.split, dim=1)):
                shape = [1, 1, 1, part.shape[-1]]
                shape[axis] = grid[axis]
                axes.append(part[: grid[axis]].view(shape).expand(*grid, part.shape[-1]))
            return torch.cat(axes, dim=-1).reshape(-1, sum(self.split))

        return table(self.cos), table(self.sin)


def _rms_norm(states: torch.Tensor, norm: torch.nn.RMSNorm) -> torch.Tensor:
    """``torch.nn.RMSNorm`` in elementary ops (the TorchScript exporter has none below opset 23), its weight shared."""
    eps = torch.finfo(states.dtype).eps if norm.eps is None else norm.eps
    normed = states * torch.rsqrt(states.pow(2).mean(-1, keepdim=True) + eps)
    return normed if norm.weight is None else normed * norm.weight


class _WanAttentionForExport:
    """``WanAttnProcessor``'s computation (projections, RMS-normed queries and keys across heads, the rotary
    embedding of a self-attention, attention, the output projection; Wan 2.1 I2V's attention to the image's states
    through keys and values of their own, added) with each attention one ``MultiHeadAttention`` node and the rotary
    embedding one ``RotaryEmbedding`` node (see the module's docstring)."""

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        rotary_emb: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    ) -> torch.Tensor:
        if attention_mask is not None:
            raise NotImplementedError("the Wan export covers attention without a mask")
        image = None
        if attn.add_k_proj is not None:  # Wan 2.1 I2V: the image's states, then the text's last 512, as diffusers
            image_tokens = encoder_hidden_states.shape[1] - WAN_TEXT_CONTEXT
            image, encoder_hidden_states = (
                encoder_hidden_states[:, :image_tokens],
                encoder_hidden_states[:, image_tokens:],
            )
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        query = _rms_norm(attn.to_q(hidden_states), attn.norm_q)
        key = _rms_norm(attn.to_k(context), attn.norm_k)
        value = attn.to_v(context)
        if rotary_emb is not None:
            cos, sin = rotary_emb
            cos, sin = cos.to(query.dtype), sin.to(query.dtype)  # the node reads its tables in the states' type
            query = interleaved_rotary_embedding(query, cos, sin, attn.heads)
            key = interleaved_rotary_embedding(key, cos, sin, attn.heads)
        scale = (attn.inner_dim // attn.heads) ** -0.5
        attended = multi_head_attention(query, key, value, attn.heads, scale)
        if image is not None:
            image_key = _rms_norm(attn.add_k_proj(image), attn.norm_added_k)
            attended = attended + multi_head_attention(query, image_key, attn.add_v_proj(image), attn.heads, scale)
        return attn.to_out[1](attn.to_out[0](attended))


# the opset of the TorchScript exporter's own ``aten::unflatten`` symbolic, which :func:`static_unflatten` overrides
_UNFLATTEN_OPSET = 13


def _unflatten_symbolic(g: Any, states: Any, dim: Any, sizes: Any) -> Any:
    """``aten::unflatten`` of a constant axis into constant sizes as a ``Reshape`` to ``Concat(Shape(x)[:axis], sizes,
    Shape(x)[axis + 1:])`` with constant slice bounds (the exporter's own symbolic computes the bounds in the graph,
    and ORT's symbolic shape inference, which the transformer rewrites need, cannot give the target a rank)."""
    from torch.onnx import symbolic_helper, symbolic_opset13

    rank = symbolic_helper._get_tensor_rank(states)
    if rank is None or not symbolic_helper._is_constant(dim) or not symbolic_helper._is_constant(sizes):
        return symbolic_opset13.unflatten(g, states, dim, sizes)
    axis = symbolic_helper._get_const(dim, "i", "dim") % rank

    def constant(values: Sequence[int]) -> Any:
        return g.op("Constant", value_t=torch.tensor(list(values), dtype=torch.int64))

    shape = g.op("Shape", states)
    head = g.op("Slice", shape, constant([0]), constant([axis]))
    tail = g.op("Slice", shape, constant([axis + 1]), constant([rank]))
    target = g.op("Concat", head, constant(symbolic_helper._get_const(sizes, "is", "sizes")), tail, axis_i=0)
    return g.op("Reshape", states, target)


@contextlib.contextmanager
def static_unflatten() -> Iterator[None]:
    """Within the block, the TorchScript exporter writes ``unflatten`` by :func:`_unflatten_symbolic` (diffusers'
    ``timestep_proj.unflatten(1, (6, -1))``, which feeds every block's modulation)."""
    torch.onnx.register_custom_op_symbolic("aten::unflatten", _unflatten_symbolic, _UNFLATTEN_OPSET)
    try:
        yield
    finally:
        torch.onnx.unregister_custom_op_symbolic("aten::unflatten", _UNFLATTEN_OPSET)


@contextlib.contextmanager
def exportable_wan_modules(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Within the block, every ``WanRotaryPosEmbed`` under ``module`` is replaced by :class:`_RotaryTables` and every
    ``WanAttention``'s processor by :class:`_WanAttentionForExport`, and ``unflatten`` is exported by
    :func:`static_unflatten`; all are put back when it ends (the caller's model is left as it was)."""
    swapped: list = []
    processors: list = []
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ == "WanRotaryPosEmbed":
                swapped.append((parent, name, child))
        if type(parent).__name__ == "WanAttention" and hasattr(parent, "set_processor"):
            processors.append((parent, parent.processor))
    try:
        for parent, name, child in swapped:
            setattr(parent, name, _RotaryTables(child))
        for attention, _ in processors:
            attention.set_processor(_WanAttentionForExport())
        with static_unflatten():
            yield module
    finally:
        for parent, name, child in swapped:
            setattr(parent, name, child)
        for attention, processor in processors:
            attention.set_processor(processor)


def wan_transformer_spec(
    transformer: torch.nn.Module, expand_timesteps: bool = False, sequence: int = 8
) -> Dict[str, Any]:
    """The export spec of a ``WanTransformer3DModel``: every axis but the channels dynamic; ``timestep`` one per row,
    or (``expand_timesteps``, Wan 2.2 TI2V) one per row and latent token. A first-last-frame transformer's (Wan 2.1
    FLF2V, ``pos_embed_seq_len``) image states are two rows per latent row (the first and the last image's, as
    diffusers reshapes them), of ``pos_embed_seq_len`` / 2 tokens each."""
    config = transformer.config
    p_t, p_h, p_w = config.patch_size
    frames, height, width = 2 * p_t, 4 * p_h, 3 * p_w  # not square: rows and columns cannot be swapped
    tokens = (frames // p_t) * (height // p_h) * (width // p_w)
    timestep = torch.full((2, tokens), 500.0) if expand_timesteps else torch.tensor([500.0, 500.0])
    latent_axes = {0: "batch", 2: "frames", 3: "height", 4: "width"}
    args = [
        torch.randn(2, config.in_channels, frames, height, width),
        torch.randn(2, sequence, config.text_dim),
        timestep,
    ]
    names, axes = list(WAN_INPUTS), {}
    if config.image_dim is not None:  # Wan 2.1 I2V: the image encoder's states, and the text context diffusers assumes
        args[1] = torch.randn(2, WAN_TEXT_CONTEXT, config.text_dim)
        names.append(WAN_IMAGE_INPUT)
        if config.pos_embed_seq_len is None:
            args.append(torch.randn(2, 5, config.image_dim))
            axes[WAN_IMAGE_INPUT] = {0: "batch", 1: "image_tokens"}
        else:  # Wan 2.1 FLF2V: a first and a last image's states per row, which its position embedding joins
            args.append(torch.randn(4, config.pos_embed_seq_len // 2, config.image_dim))
            axes[WAN_IMAGE_INPUT] = {0: "image_batch"}
    return dict(
        module=_WanTransformer(transformer),
        args=tuple(args),
        input_names=names,
        output_names=["out_hidden_states"],
        dynamic_axes={
            "hidden_states": latent_axes,
            "encoder_hidden_states": {0: "batch", 1: "sequence"},
            "timestep": {0: "batch", 1: "tokens"} if expand_timesteps else {0: "batch"},
            "out_hidden_states": latent_axes,
            **axes,
        },
        # diffusers embeds the timestep in float32 whatever the transformer's dtype
        float32_inputs=["timestep"],
        fixed_output_dims={"out_hidden_states": {1: config.out_channels}},
        config=config,
    )


def wan_component_specs(pipe: Any) -> Dict[str, Dict[str, Any]]:
    """What to export of a Wan pipeline: the UMT5 encoder and each transformer it has."""
    expand = bool(pipe.config.get("expand_timesteps", False))
    specs = {"text_encoder": umt5_encoder_spec(pipe.text_encoder)}
    for name in WAN_TRANSFORMERS:
        if getattr(pipe, name, None) is not None:
            specs[name] = wan_transformer_spec(getattr(pipe, name), expand)
    return specs


def export_wan_pipeline(
    pipe: Any,
    target: Path,
    *,
    components: Optional[Sequence[str]] = None,
    opset: int = 17,
    dtype: str = "fp32",
    optimize: Optional[str] = None,
    progress: bool = True,
    external_data_threshold: int = EXTERNAL_DATA_THRESHOLD,
    step_cache: bool = False,
    vae_dtype: Optional[str] = None,
) -> Path:
    """Exports a diffusers ``WanPipeline`` at ``target`` (see the module's docstring), built beside it and moved into
    place when whole.

    Args:
        pipe: the torch pipeline (float32).
        target: the output folder (checked by the caller: new, empty, or to be replaced).
        components: which components to export (default: all the pipeline has).
        opset: ONNX opset.
        dtype: ``"fp32"``, ``"fp16"`` (the UMT5 encoder stays float32) or ``"bf16"`` (the transformers bfloat16).
        optimize: ``"cuda"`` or ``"cpu"``: ORT's transformer optimizer (``mmdit`` for the transformers, ``t5`` for
            CUDA only) and the project's transformer rewrites.
        progress: show a progress bar.
        external_data_threshold: weights above this many bytes go to ``model.onnx_data``.
        step_cache: First-Block Cache's parts beside each transformer's ``model.onnx`` (:mod:`.step_cache`; Wan
            2.2's experts each their own), reading its weights.
        vae_dtype: the VAE's precision, ``"fp32"`` (``None``: diffusers' choice) or ``"fp16"`` (:mod:`.wan_vae`).

    Returns:
        ``target``.

    Raises:
        ArgumentError: ``step_cache`` for a transformer of one block (naming it).
    """
    specs = wan_component_specs(pipe)
    if step_cache:
        for name in WAN_TRANSFORMERS:
            if name in specs:
                check_first_block_cache_depth(getattr(pipe, name), name)
    vae, image_encoder = getattr(pipe, "vae", None), getattr(pipe, "image_encoder", None)
    has = {"image_encoder": image_encoder is not None, **dict.fromkeys(WAN_VAE_COMPONENTS, vae is not None)}
    available = tuple(name for name in WAN_COMPONENTS if name in specs or has.get(name))
    components = available if components is None else tuple(components)
    unknown = [name for name in components if name not in available]
    if unknown:
        raise ArgumentError("components", f"expected names from {list(available)}, got {unknown}")
    vae_components = [name for name in components if name in WAN_VAE_COMPONENTS]
    index_modules = {}
    if "image_encoder" in components:
        index_modules["image_encoder"] = ("transformers", type(image_encoder).__name__)
        if getattr(pipe, "image_processor", None) is not None:
            index_modules["image_processor"] = index_entry(pipe.image_processor)

    def write_beside(folder: Path) -> None:  # float32 whatever dtype says (the module's docstring says why)
        if "image_encoder" in components:
            spec = clip_image_encoder_spec(image_encoder)
            export_model("image_encoder", spec, folder, opset, optimize, "clip", external_data_threshold)
            if getattr(pipe, "image_processor", None) is not None:
                pipe.image_processor.save_pretrained(str(folder / "image_processor"))
        if vae_components:
            export_wan_vae(vae, folder, vae_components, opset=opset, dtype=vae_dtype or "fp32")

    return export_transformer_pipeline(
        pipe,
        target,
        specs,
        [name for name in components if name not in WRITTEN_BESIDE],
        class_name=(torch_class_family(type(pipe).__name__) or WAN).index_class_name,
        optimizer_model_types=WAN_OPTIMIZER_MODEL_TYPES,
        opset=opset,
        dtype=dtype,
        optimize=optimize,
        progress=progress,
        external_data_threshold=external_data_threshold,
        exportable=exportable_wan_modules,
        step_cache=step_cache,
        cached=WAN_TRANSFORMERS,
        settings={name: pipe.config.get(name) for name in WAN_SETTINGS},
        write_more=write_beside,
        index_modules=index_modules,
    )
