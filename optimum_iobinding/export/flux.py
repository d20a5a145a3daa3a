"""Export a diffusers ``FluxPipeline`` (FLUX.1 schnell or dev) to optimum's Flux ONNX layout: Flux's specs and the
traceable stand-ins of its attention, rotary embedding and RMS norms; the text encoders, the VAE and the component
exporters are :mod:`.components`', the folder :mod:`.transformer_pipeline`'s, shared with Stable Diffusion 3.

Layout written (what ``optimum-cli export onnx`` writes for Flux, which optimum's ``ORTFluxPipeline`` and our FLUX.1
pipeline both load)::

    model_index.json                the torch pipeline's index (FluxPipeline, FluxKontextPipeline, FluxFillPipeline,
                                    FluxControlPipeline or FluxControlNetPipeline; torch class names; one ``vae``
                                    entry)
    text_encoder/model.onnx         CLIP: input_ids (int64) → last_hidden_state, pooler_output
    text_encoder_2/model.onnx       T5 encoder: input_ids (int64) → last_hidden_state
    transformer/model.onnx          hidden_states (batch, packed tokens, 4 × latent channels; Fill's and Control's
                                    tokens carry their conditioning latents too: 384 and 128), encoder_hidden_states,
                                    pooled_projections, timestep (batch; t / 1000), txt_ids (sequence, 3; int64),
                                    img_ids (packed tokens, 3; int64) and, for dev (guidance_embeds), guidance (batch)
                                    → out_hidden_states; with ControlNets also controlnet_block_sample_0 … and
                                    controlnet_single_block_sample_0 … (batch, packed tokens, inner width)
    controlnet/model.onnx           (FluxControlNetPipeline) the transformer's inputs (guidance where the ControlNet
                                    embeds it), controlnet_cond (the control image's packed latents; an XLabs
                                    ControlNet's pixels), conditioning_scale (1) and a union ControlNet's
                                    controlnet_mode (batch, 1; int64) → its block samples, scaled;
                                    controlnet_1/ … for more than one
    vae_encoder/model.onnx          sample → latent_sample
    vae_decoder/model.onnx          latent_sample → sample
    */config.json, tokenizer/, tokenizer_2/, scheduler/

Precision of each component with ``dtype="fp16"``
(:func:`~optimum_iobinding.export.transformer_pipeline.float16_components`, the rule of every diffusion-transformer
export, and why):

==================  =========  ==============================================================================
component           precision  why
==================  =========  ==============================================================================
text_encoder        fp16       CLIP-L is small and its activations stay well inside float16's range (the SD
                               exports run it in fp16 too)
text_encoder_2      fp32       T5's feed-forward activations exceed float16's range (65504) on ordinary
                               prompts: inf/NaN embeddings
transformer         fp16       where the time goes; ORT's (fused) normalization and softmax kernels accumulate
                               in fp32, but Flux's residual stream can grow past float16's range on some prompts
                               (diffusers clips it in fp16): check images, or export bf16 or fp32. The
                               sinusoidal timestep and guidance embeddings and the rotary cos/sin tables are
                               computed in fp32 up to the first layer, as diffusers computes them; the
                               ``timestep`` and ``guidance`` inputs are fp16 (diffusers rounds them to the
                               latents' dtype too)
vae_encoder/decoder fp16       diffusers' ``FluxPipeline`` decodes in the pipeline's dtype: it never reads the
                               VAE config's ``force_upcast`` (AutoencoderKL's default, set in FLUX.1's config
                               too; only the SDXL pipelines upcast), so the export writes ``force_upcast:
                               false``, as its SDXL export does, and does not warn as that one does: diffusers
                               runs this VAE in fp16 itself
==================  =========  ==============================================================================

With ``dtype="bf16"`` the transformer is bfloat16 (:mod:`~optimum_iobinding.export.bfloat16`: float32's range in two
bytes, so its residual stream does not overflow; every op of the fused graph has a bfloat16 CUDA kernel; the
``timestep`` and ``guidance`` inputs are bfloat16, and the embeddings and rotary tables stay float32 as above) and the
others are as in the table; it runs on CUDA only.

A ControlNet is exported as its transformer is (ORT's ``mmdit`` fusions, the rewrites) and in its precision.

Components whose weights are over :data:`~optimum_iobinding.export.components.EXTERNAL_DATA_THRESHOLD` bytes
(FLUX.1's transformer: 12 billion parameters, 48 GB in fp32, 24 GB in fp16; T5-XXL's encoder, 19 GB in fp32) are
written with their weights in one external-data file ``model.onnx_data`` beside ``model.onnx``, as optimum writes
them; smaller ones are one file.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import ArgumentError, ArgumentTypeError
from ..families import FLUX_GUIDANCE, FLUX_IMAGE_IDS, FLUX_INPUTS, FLUX_TEXT_IDS, family, torch_class_family
from ..layout import (
    CONTROLNET_CONDITION,
    CONTROLNET_SCALE,
    FLUX_CONTROLNET_BLOCK_SAMPLE,
    FLUX_CONTROLNET_MODE,
    FLUX_CONTROLNET_SINGLE_BLOCK_SAMPLE,
    controlnet_component_names,
)
from .components import EXTERNAL_DATA_THRESHOLD, clip_text_encoder_spec, t5_encoder_spec, vae_specs
from .transformer_pipeline import export_transformer_pipeline

FLUX_COMPONENTS = ("text_encoder", "text_encoder_2", "transformer", "vae_encoder", "vae_decoder")
# ORT's transformer-optimizer model type of the components exported by the transformer family's exporter: "mmdit"
# fuses the Flux transformer's attention (CLIP and the VAE go through the UNet families' component exporter)
FLUX_OPTIMIZER_MODEL_TYPES = {"text_encoder_2": "t5", "transformer": "mmdit"}
# the input FLUX.1 dev's transformer takes beside FLUX_INPUTS: its guidance embedding's (schnell has none)


# ------------------------------------------------------------------------------------------------------ export
class _FluxTransformer(torch.nn.Module):
    """The transformer with optimum's input names and order; the position ids come in as int64 (optimum's dtype) and
    the transformer's rotary embedding makes floats of them itself. With ControlNets it also takes their
    ``block_samples`` and ``single_block_samples`` (after ``guidance``), added after its blocks as diffusers adds
    them (``blocks_repeat``: an XLabs ControlNet's, whose few samples repeat over the blocks)."""

    def __init__(self, transformer, block_samples: int = 0, single_block_samples: int = 0, blocks_repeat: bool = False):
        super().__init__()
        self.transformer = transformer
        self.guidance_embeds = bool(transformer.config.guidance_embeds)
        self.block_samples, self.single_block_samples = block_samples, single_block_samples
        self.blocks_repeat = blocks_repeat

    def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, txt_ids, img_ids, *more):
        guidance = more[0] if self.guidance_embeds else None
        samples = list(more[1:] if self.guidance_embeds else more)
        blocks, singles = samples[: self.block_samples], samples[self.block_samples :]
        controlnet = {}
        if self.block_samples or self.single_block_samples:
            controlnet = dict(
                controlnet_block_samples=blocks or None,
                controlnet_single_block_samples=singles or None,
                controlnet_blocks_repeat=self.blocks_repeat,
            )
        return self.transformer(
            hidden_states=hidden_states,
            encoder_hidden_states=encoder_hidden_states,
            pooled_projections=pooled_projections,
            timestep=timestep,
            img_ids=img_ids,
            txt_ids=txt_ids,
            guidance=guidance,
            return_dict=False,
            **controlnet,
        )[0]


class _FluxControlNet(torch.nn.Module):
    """A FLUX.1 ControlNet with the transformer's input names (its own ``guidance`` where it embeds one), the
    control image's ``controlnet_cond``, a union ControlNet's ``controlnet_mode``, and its block samples scaled by
    ``conditioning_scale`` (an input: one graph for every scale and guidance window), as diffusers scales them."""

    def __init__(self, controlnet):
        super().__init__()
        self.controlnet = controlnet
        self.guidance_embeds = bool(controlnet.config.guidance_embeds)
        self.union = bool(controlnet.union)

    def forward(
        self,
        hidden_states,
        encoder_hidden_states,
        pooled_projections,
        timestep,
        txt_ids,
        img_ids,
        controlnet_cond,
        conditioning_scale,
        *more,
    ):
        guidance = more[0] if self.guidance_embeds else None
        mode = more[-1] if self.union else None
        blocks, singles = self.controlnet(
            hidden_states=hidden_states,
            controlnet_cond=controlnet_cond,
            controlnet_mode=mode,
            conditioning_scale=1.0,
            encoder_hidden_states=encoder_hidden_states,
            pooled_projections=pooled_projections,
            timestep=timestep,
            img_ids=img_ids,
            txt_ids=txt_ids,
            guidance=guidance,
            return_dict=False,
        )
        return tuple(sample * conditioning_scale for sample in (*(blocks or ()), *(singles or ())))


def controlnet_sample_names(controlnet) -> Tuple[List[str], List[str]]:
    """The names of a FLUX.1 ControlNet's block samples and single-block samples (its outputs, its transformer's
    inputs): one per block of each kind it has."""
    return (
        [f"{FLUX_CONTROLNET_BLOCK_SAMPLE}{i}" for i in range(len(controlnet.transformer_blocks))],
        [f"{FLUX_CONTROLNET_SINGLE_BLOCK_SAMPLE}{i}" for i in range(len(controlnet.single_transformer_blocks))],
    )


def flux_controlnets_of(pipe) -> List[Any]:
    """A ``FluxControlNetPipeline``'s ControlNets in order (a ``FluxMultiControlNetModel``'s nets), or ``[]``; all of
    one kind (their block counts and XLabs' conditioning), since their samples are summed and the transformer's
    export is made for them.

    Raises:
        ArgumentError: ControlNets of different kinds, naming the one that differs from the first."""
    controlnet = getattr(pipe, "controlnet", None)
    if controlnet is None:
        return []
    nets = list(getattr(controlnet, "nets", None) or [controlnet])
    for k, net in enumerate(nets[1:], start=1):
        for what, value, first in (
            ("double-stream blocks", len(net.transformer_blocks), len(nets[0].transformer_blocks)),
            ("single-stream blocks", len(net.single_transformer_blocks), len(nets[0].single_transformer_blocks)),
            ("an input hint block (XLabs)", net.input_hint_block is not None, nets[0].input_hint_block is not None),
        ):
            if value != first:
                raise ArgumentError(
                    f"controlnet[{k}]",
                    f"expected a ControlNet of the first one's kind ({what}: {first}), got {value}: the "
                    "ControlNets' samples are summed",
                )
    return nets


def with_flux_controlnets(pipe, controlnet):
    """``pipe`` (a ``FluxPipeline``) as a diffusers ``FluxControlNetPipeline`` with these ControlNets (models,
    folders or hub ids), each checked against the transformer it will feed.

    Raises:
        ArgumentTypeError: an item that is not a ``FluxControlNetModel``, its folder or hub id.
        ArgumentError: none, or a ControlNet made for another transformer (naming ``controlnet[k]``)."""
    import os

    from diffusers import FluxControlNetModel, FluxControlNetPipeline

    given = list(controlnet) if isinstance(controlnet, (list, tuple)) else [controlnet]
    if not given:
        raise ArgumentError("controlnet", "expected one or more ControlNets, got an empty list")
    nets = []
    for k, item in enumerate(given):
        if isinstance(item, (str, os.PathLike)):
            item = FluxControlNetModel.from_pretrained(os.fspath(item), torch_dtype=torch.float32)
        if not hasattr(item, "controlnet_blocks") or not hasattr(item, "single_transformer_blocks"):
            raise ArgumentTypeError(
                f"controlnet[{k}]", f"expected a FluxControlNetModel or its folder or hub id, got {type(item).__name__}"
            )
        for key in ("in_channels", "joint_attention_dim", "pooled_projection_dim"):
            mine, theirs = getattr(item.config, key), getattr(pipe.transformer.config, key)
            if mine != theirs:
                raise ArgumentError(
                    f"controlnet[{k}]",
                    f"{key} is {mine}, but the pipeline's transformer has {theirs}: a ControlNet must be made for "
                    "this transformer's architecture",
                )
        nets.append(item)
    return FluxControlNetPipeline(
        scheduler=pipe.scheduler,
        vae=pipe.vae,
        text_encoder=pipe.text_encoder,
        tokenizer=pipe.tokenizer,
        text_encoder_2=pipe.text_encoder_2,
        tokenizer_2=pipe.tokenizer_2,
        transformer=pipe.transformer,
        controlnet=nets[0] if len(nets) == 1 else nets,
    )


class _DecomposedRMSNorm(torch.nn.Module):
    """``torch.nn.RMSNorm`` (the Flux attention's query/key norms) in elementary ops, with the same weight: the
    TorchScript exporter has no ``aten::rms_norm`` below opset 23, and ORT's optimizer fuses these ops into its
    SimplifiedLayerNormalization."""

    def __init__(self, norm: torch.nn.RMSNorm):
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        eps = torch.finfo(hidden_states.dtype).eps if self.eps is None else self.eps
        normed = hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + eps)
        return normed if self.weight is None else normed * self.weight


class _RotaryPositions(torch.nn.Module):
    """Flux's rotary embedding of the position ids (``FluxPosEmbed``: per axis, the cosines and sines of position ×
    ``theta^(-2k/dim)``, each repeated twice, the axes side by side), written so that it traces with a dynamic
    number of positions and in float32 (diffusers computes it in float64 on the CPU; ORT's CUDA provider would run
    float64 ops on the host, which keeps the transformer out of CUDA graphs; the angles differ by < 1e-5)."""

    def __init__(self, theta: float, axes_dim: Sequence[int]):
        super().__init__()
        self.theta = float(theta)
        self.axes_dim = [int(d) for d in axes_dim]

    def forward(self, ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        positions = ids.to(torch.float32)
        cosines, sines = [], []
        for axis, dim in enumerate(self.axes_dim):
            exponents = torch.arange(0, dim, 2, dtype=torch.float64)[: dim // 2] / dim
            frequencies = (1.0 / self.theta**exponents).to(torch.float32)
            angles = positions[:, axis : axis + 1] * frequencies[None, :]
            # each frequency twice in a row (the real and imaginary halves of one rotation)
            cosines.append(torch.stack([angles.cos(), angles.cos()], dim=-1).flatten(1))
            sines.append(torch.stack([angles.sin(), angles.sin()], dim=-1).flatten(1))
        return torch.cat(cosines, dim=-1), torch.cat(sines, dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Flux's rotary embedding applied to ``x`` of shape ``(batch, heads, sequence, head_dim)``: each pair of
    neighbouring values rotated, by slicing (a reshape into pairs traces with the example's sequence length)."""
    rotated = torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).flatten(3)
    return x * cos[None, None] + rotated * sin[None, None]


class _FluxAttentionForExport:
    """Flux's attention (``FluxAttnProcessor``'s computation: per-head RMS-normed queries and keys, the text tokens
    first, rotary embedding, scaled dot-product attention) with every shape taken from the inputs, so that the
    exported graph takes any number of text and image tokens; in the (batch, heads, sequence, head_dim) layout and op
    order that ORT's MMDiT attention fusion matches (the export is float32: no casts in between)."""

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        image_rotary_emb: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    ) -> Any:
        batch = hidden_states.shape[0]

        def heads(projected: torch.Tensor) -> torch.Tensor:
            return projected.view(batch, -1, attn.heads, attn.head_dim).transpose(1, 2)

        query = attn.norm_q(heads(attn.to_q(hidden_states)))
        key = attn.norm_k(heads(attn.to_k(hidden_states)))
        value = heads(attn.to_v(hidden_states))
        if attn.added_kv_proj_dim is not None and encoder_hidden_states is not None:
            query = torch.cat([attn.norm_added_q(heads(attn.add_q_proj(encoder_hidden_states))), query], dim=2)
            key = torch.cat([attn.norm_added_k(heads(attn.add_k_proj(encoder_hidden_states))), key], dim=2)
            value = torch.cat([heads(attn.add_v_proj(encoder_hidden_states)), value], dim=2)
        if image_rotary_emb is not None:
            cos, sin = image_rotary_emb
            query, key = _rotate(query, cos, sin), _rotate(key, cos, sin)
        attended = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask)
        attended = attended.transpose(1, 2).reshape(batch, -1, attn.heads * attn.head_dim)
        if encoder_hidden_states is None:
            return attended
        text_tokens = encoder_hidden_states.shape[1]
        encoder_out, image_out = attended[:, :text_tokens], attended[:, text_tokens:]
        return attn.to_out[1](attn.to_out[0](image_out)), attn.to_add_out(encoder_out)


@contextlib.contextmanager
def exportable_flux_modules(module: torch.nn.Module):
    """Within the block, the parts of ``module`` the TorchScript exporter cannot trace with dynamic shapes are
    replaced by equivalents that it can: every ``torch.nn.RMSNorm`` by a :class:`_DecomposedRMSNorm` sharing its
    weight, a Flux transformer's rotary embedding by :class:`_RotaryPositions`, its attention processors by
    :class:`_FluxAttentionForExport`. All are put back when it ends (the caller's model is left as it was)."""
    swapped: list = []
    processors: list = []
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.RMSNorm):
                swapped.append((parent, name, child))
            elif type(child).__name__ == "FluxPosEmbed":
                swapped.append((parent, name, child))
        if type(parent).__name__ == "FluxAttention" and hasattr(parent, "set_processor"):
            processors.append((parent, parent.processor))
    try:
        for parent, name, child in swapped:
            replacement = (
                _DecomposedRMSNorm(child)
                if isinstance(child, torch.nn.RMSNorm)
                else _RotaryPositions(child.theta, child.axes_dim)
            )
            setattr(parent, name, replacement)
        for attention, _ in processors:
            attention.set_processor(_FluxAttentionForExport())
        yield module
    finally:
        for parent, name, child in swapped:
            setattr(parent, name, child)
        for attention, processor in processors:
            attention.set_processor(processor)


def flux_component_specs(pipe) -> Dict[str, dict]:
    """What to export for each Flux component: module, example inputs, names and dynamic axes (optimum's)."""
    transformer = pipe.transformer
    config = transformer.config
    clip_length = pipe.tokenizer.model_max_length
    t5_length = 16  # every length is dynamic: a short example exports faster
    tokens, text_length = 16, t5_length  # packed latent tokens of the example (a 4 × 4 grid)
    specs: Dict[str, dict] = {
        "text_encoder": clip_text_encoder_spec(
            pipe.text_encoder, clip_length, with_projection=False, hidden_states=False
        ),
        "text_encoder_2": t5_encoder_spec(pipe.text_encoder_2, t5_length),
    }
    names = list(FLUX_INPUTS)
    args = [  # in FLUX_INPUTS' order
        torch.randn(2, tokens, config.in_channels),
        torch.randn(2, text_length, config.joint_attention_dim),
        torch.randn(2, config.pooled_projection_dim),
        torch.tensor([0.5, 0.5]),
        torch.zeros(text_length, 3, dtype=torch.int64),
        torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0), indexing="ij"), dim=-1)
        .reshape(tokens, 3)
        .to(torch.int64),
    ]
    axes = {
        "hidden_states": {0: "batch_size", 1: "packed_height_width"},
        "encoder_hidden_states": {0: "batch_size", 1: "sequence_length"},
        "pooled_projections": {0: "batch_size"},
        "timestep": {0: "batch_size"},
        FLUX_TEXT_IDS: {0: "sequence_length"},
        FLUX_IMAGE_IDS: {0: "packed_height_width"},
        "out_hidden_states": {0: "batch_size", 1: "packed_height_width"},
    }
    if config.guidance_embeds:
        names.append(FLUX_GUIDANCE)
        args.append(torch.tensor([3.5, 3.5]))
        axes[FLUX_GUIDANCE] = {0: "batch_size"}
    controlnets = flux_controlnets_of(pipe)
    module = _FluxTransformer(transformer)
    if controlnets:
        specs.update(flux_controlnet_specs(pipe, controlnets, args[:6], tokens))
        blocks, singles = controlnet_sample_names(controlnets[0])
        width = controlnets[0].inner_dim
        for sample in (*blocks, *singles):
            names.append(sample)
            args.append(torch.randn(2, tokens, width))
            axes[sample] = {0: "batch_size", 1: "packed_height_width"}
        module = _FluxTransformer(transformer, len(blocks), len(singles), controlnets[0].input_hint_block is not None)
    specs["transformer"] = dict(
        module=module,
        args=tuple(args),
        input_names=names,
        output_names=["out_hidden_states"],
        dynamic_axes=axes,
        config=config,
        # the token width as a number, whatever ORT's fusions leave (as SD3's channels)
        fixed_output_dims={"out_hidden_states": {2: transformer.proj_out.out_features}},
    )
    specs.update(vae_specs(pipe.vae, latent_size=8))
    return specs


def flux_controlnet_specs(pipe, controlnets: List[Any], transformer_args: List[torch.Tensor], tokens: int) -> dict:
    """What to export for each of a ``FluxControlNetPipeline``'s ControlNets (``controlnet``, ``controlnet_1`` …):
    the transformer's example inputs (``transformer_args``, in :data:`FLUX_INPUTS`' order, over ``tokens`` packed
    tokens), a control image's packed latents (an XLabs ControlNet's pixels of the same size), its scale, and its
    guidance and mode where it takes them."""
    specs = {}
    grid = int(tokens**0.5)  # the example's tokens are a square grid
    vae_scale_factor = 2 ** (len(pipe.vae.config.block_out_channels) - 1)
    for name, controlnet in zip(controlnet_component_names(len(controlnets)), controlnets):
        blocks, singles = controlnet_sample_names(controlnet)
        if controlnet.input_hint_block is not None:  # XLabs: pixels, encoded by the ControlNet itself
            side = grid * 2 * vae_scale_factor
            condition = torch.rand(2, 3, side, side) * 2 - 1
            condition_axes = {0: "batch_size", 2: "height", 3: "width"}
        else:  # the control image's packed latents, as the transformer's tokens
            condition = torch.randn(2, tokens, controlnet.config.in_channels)
            condition_axes = {0: "batch_size", 1: "packed_height_width"}
        names = [*FLUX_INPUTS, CONTROLNET_CONDITION, CONTROLNET_SCALE]
        args = [*transformer_args, condition, torch.ones(1)]
        axes = {
            "hidden_states": {0: "batch_size", 1: "packed_height_width"},
            "encoder_hidden_states": {0: "batch_size", 1: "sequence_length"},
            "pooled_projections": {0: "batch_size"},
            "timestep": {0: "batch_size"},
            FLUX_TEXT_IDS: {0: "sequence_length"},
            FLUX_IMAGE_IDS: {0: "packed_height_width"},
            CONTROLNET_CONDITION: condition_axes,
            **{sample: {0: "batch_size", 1: "packed_height_width"} for sample in (*blocks, *singles)},
        }
        if controlnet.config.guidance_embeds:
            names.append(FLUX_GUIDANCE)
            args.append(torch.tensor([3.5, 3.5]))
            axes[FLUX_GUIDANCE] = {0: "batch_size"}
        if controlnet.union:
            names.append(FLUX_CONTROLNET_MODE)
            args.append(torch.zeros(2, 1, dtype=torch.int64))
            axes[FLUX_CONTROLNET_MODE] = {0: "batch_size"}
        specs[name] = dict(
            module=_FluxControlNet(controlnet),
            args=tuple(args),
            input_names=names,
            output_names=[*blocks, *singles],
            dynamic_axes=axes,
            config=controlnet.config,
            fixed_output_dims={sample: {2: controlnet.inner_dim} for sample in (*blocks, *singles)},
        )
    return specs


def export_flux_pipeline(
    pipe,
    target: Path,
    *,
    dtype: str = "fp32",
    opset: int = 17,
    optimize: Optional[str] = None,
    components: Optional[Sequence[str]] = None,
    progress: bool = True,
    external_data_threshold: int = EXTERNAL_DATA_THRESHOLD,
    step_cache: bool = False,
) -> Path:
    """Exports a diffusers ``FluxPipeline`` to optimum's Flux layout in ``target`` (built beside it, moved into
    place when whole; the caller has checked ``target``); its image-conditioned variants (``FluxKontextPipeline``,
    ``FluxFillPipeline``, ``FluxControlPipeline``) alike, their model_index.json naming their own class (what tells
    Kontext, whose transformer has FLUX.1's interface, apart).

    Args:
        pipe: the ``FluxPipeline`` (schnell or dev) or a variant, in float32.
        target: the output folder.
        dtype: ``"fp32"``; ``"fp16"``: all but T5 float16 (the module's table says why T5 stays float32);
            ``"bf16"``: the transformer bfloat16, the others as for ``"fp16"`` (see the module's docstring).
        opset: ONNX opset.
        optimize: ``"cuda"`` or ``"cpu"``: ORT's transformer optimizer on each component (``mmdit`` for the
            transformer) before the float16 conversion.
        components: which components to export (default: all five).
        progress: show a progress bar.
        external_data_threshold: weight bytes above which a component's weights go to ``model.onnx_data``.
        step_cache: the transformer's First-Block Cache parts too (:mod:`.step_cache`).

    Returns:
        ``target``.
    """
    nets = controlnet_component_names(len(flux_controlnets_of(pipe)))
    available = FLUX_COMPONENTS + nets
    components = available if components is None else tuple(components)
    unknown = [name for name in components if name not in available]
    if unknown:
        raise ArgumentError("components", f"expected names from {list(available)}, got {unknown}")
    return export_transformer_pipeline(
        pipe,
        target,
        flux_component_specs(pipe),
        components,
        class_name=(torch_class_family(type(pipe).__name__) or family("flux")).index_class_name,
        optimizer_model_types={**FLUX_OPTIMIZER_MODEL_TYPES, **dict.fromkeys(nets, "mmdit")},
        index_modules={name: ("diffusers", "FluxControlNetModel") for name in nets},
        opset=opset,
        dtype=dtype,
        optimize=optimize,
        progress=progress,
        external_data_threshold=external_data_threshold,
        exportable=exportable_flux_modules,
        step_cache=step_cache,
    )
