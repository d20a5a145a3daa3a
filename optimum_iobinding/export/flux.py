"""Export a diffusers ``FluxPipeline`` (FLUX.1 schnell or dev) to optimum's Flux ONNX layout, and the tiny random Flux
pipelines built offline.

Layout written (what ``optimum-cli export onnx`` writes for Flux, which optimum's ``ORTFluxPipeline`` and our
:class:`~optimum_iobinding.pipelines.flux.OnnxFluxPipeline` both load)::

    model_index.json                the torch pipeline's index (FluxPipeline, torch class names; one ``vae`` entry)
    text_encoder/model.onnx         CLIP: input_ids (int64) → last_hidden_state, pooler_output
    text_encoder_2/model.onnx       T5 encoder: input_ids (int64) → last_hidden_state
    transformer/model.onnx          hidden_states (batch, packed tokens, 4 × latent channels), encoder_hidden_states,
                                    pooled_projections, timestep (batch; t / 1000), txt_ids (sequence, 3; int64),
                                    img_ids (packed tokens, 3; int64) and, for dev (guidance_embeds), guidance (batch)
                                    → out_hidden_states
    vae_encoder/model.onnx          sample → latent_sample
    vae_decoder/model.onnx          latent_sample → sample
    */config.json, tokenizer/, tokenizer_2/, scheduler/

Precision of each component with ``fp16=True`` (:func:`flux_fp16_components`, and why):

==================  =========  ==============================================================================
component           precision  why
==================  =========  ==============================================================================
text_encoder        fp16       CLIP-L is small and its activations stay well inside float16's range (the SD
                               exports run it in fp16 too)
text_encoder_2      fp32       T5's feed-forward activations exceed float16's range (65504) on ordinary
                               prompts: inf/NaN embeddings
transformer         fp16       where the time goes; ORT's (fused) normalization and softmax kernels accumulate
                               in fp32, but Flux's residual stream can grow past float16's range on some prompts
                               (diffusers clips it in fp16): check images, or export with ``fp16=False``
vae_encoder/decoder fp16, or   fp32 where the VAE's config says ``force_upcast`` (diffusers' AutoencoderKL
                    fp32       default; diffusers then decodes in fp32 itself), else fp16
==================  =========  ==============================================================================

Components whose weights are over :data:`EXTERNAL_DATA_THRESHOLD` bytes (FLUX.1's transformer: 12 billion
parameters, 48 GB in fp32, 24 GB in fp16; T5-XXL's encoder, 19 GB in fp32) are written with their weights in one
external-data file ``model.onnx_data`` beside ``model.onnx``, as optimum writes them; smaller ones are one file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
import warnings
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

import onnx
import torch
from tqdm.auto import tqdm

from ..layout import building_beside, save_tokenizer
from .export import pooled_output, to_precision, vae_specs
from .optimize import fusion_options, optimize_component

logger = logging.getLogger(__name__)

FLUX_COMPONENTS = ("text_encoder", "text_encoder_2", "transformer", "vae_encoder", "vae_decoder")
# The external-data file of a large component (optimum's name), and the weight size above which it is used: protobuf
# cannot serialize a message over 2 GiB, and the graph itself needs some of that.
EXTERNAL_DATA_NAME = "model.onnx_data"
EXTERNAL_DATA_THRESHOLD = 1 << 30
# ORT's transformer optimizer model type of each component: "mmdit" fuses the Flux/SD3 transformer's attention.
FLUX_OPTIMIZER_MODEL_TYPES = {"text_encoder": "clip", "text_encoder_2": "t5", "transformer": "mmdit",
                              "vae_encoder": "vae", "vae_decoder": "vae"}


def flux_fp16_components(vae_config: Any) -> Dict[str, bool]:
    """Which components ``fp16=True`` converts to float16 (see the module's table): all but T5, and the VAE only
    where its config does not ask diffusers to upcast it."""
    force_upcast = bool(vae_config.get("force_upcast", False)) if hasattr(vae_config, "get") else False
    return {"text_encoder": True, "text_encoder_2": False, "transformer": True,
            "vae_encoder": not force_upcast, "vae_decoder": not force_upcast}


def is_flux(pipe: Any) -> bool:
    """``pipe`` is a diffusers Flux pipeline: its denoiser is a ``FluxTransformer2DModel``."""
    transformer = getattr(pipe, "transformer", None)
    return transformer is not None and type(transformer).__name__ == "FluxTransformer2DModel"


# ------------------------------------------------------------------------------------------------- tiny models
_TINY_T5_WORDS = (
    "a an the of on in with and photo painting picture astronaut horse riding cat dog house tree mountain sky red "
    "blue green portrait landscape city night sunset beautiful detailed castle forest river car"
).split()


def write_tiny_t5_tokenizer_to(folder: Path) -> Any:
    """Writes a small SentencePiece-style unigram tokenizer as a ``T5TokenizerFast`` into ``folder`` and returns it
    loaded from there: ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2 (T5's ids), a few prompt words and every printable ASCII
    character (so any text tokenizes), a ``▁`` word-start marker, ``model_max_length`` 512 (Flux's T5 length)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [(f"▁{word}", -1.0) for word in _TINY_T5_WORDS]
    vocab += [(chr(c), -5.0) for c in range(33, 127)]
    backend = Tokenizer(models.Unigram(vocab, unk_id=2, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                           special_tokens=[("</s>", 1)])
    tokenizer = T5TokenizerFast(tokenizer_object=backend, eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
                                extra_ids=0, model_max_length=512)
    tokenizer.save_pretrained(str(folder))
    return T5TokenizerFast.from_pretrained(str(folder))


def build_tiny_flux_pipeline(seed: int = 0, guidance_embeds: bool = False):
    """A tiny random-weights ``FluxPipeline`` built offline: a 2-layer CLIP text model (hidden 32; its pooled output
    is Flux's ``pooled_projections``), a 2-layer gated-GELU T5 encoder (d_model 32), a Flux transformer of one double
    and one single block (2 heads of 16, rotary axes 4/6/6), a four-block VAE (8× scale) of 16 latent channels with
    FLUX.1's scaling and shift factors, FLUX.1's FlowMatchEulerDiscreteScheduler settings. ``guidance_embeds``:
    FLUX.1 dev's guidance embedding (a ``guidance`` input); without it, schnell's shape."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5Config, T5EncoderModel

    from .tiny import _tiny_text_encoder_config, write_tiny_tokenizer

    with tempfile.TemporaryDirectory() as folder:
        tokenizer = write_tiny_tokenizer(Path(folder) / "clip")
        tokenizer_2 = write_tiny_t5_tokenizer_to(Path(folder) / "t5")
    torch.manual_seed(seed)
    # in inference mode, as from_pretrained gives them (a model built from a config starts in training mode)
    text_encoder = CLIPTextModel(_tiny_text_encoder_config(tokenizer)).eval()
    text_encoder_2 = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer_2), d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0, is_encoder_decoder=False, use_cache=False, dropout_rate=0.0)).eval()
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=guidance_embeds,
        axes_dims_rope=(4, 6, 6))
    vae = AutoencoderKL(
        block_out_channels=(16, 16, 32, 32), layers_per_block=1, in_channels=3, out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=16, norm_num_groups=8, sample_size=64, scaling_factor=0.3611, shift_factor=0.1159,
        use_quant_conv=False, use_post_quant_conv=False)
    # FLUX.1 dev's schedule (resolution-dependent shift); schnell's has a fixed shift of 1
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0 if guidance_embeds else 1.0, use_dynamic_shifting=guidance_embeds,
        base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
    return FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer)


# ------------------------------------------------------------------------------------------------------ export
class _CLIPTextEncoder(torch.nn.Module):
    """CLIP as optimum exports it for Flux: ``last_hidden_state`` and the pooled output (pooled on the device, see
    :func:`~optimum_iobinding.export.export.pooled_output`)."""

    def __init__(self, text_encoder):
        super().__init__()
        self.text_encoder = text_encoder

    def forward(self, input_ids):
        output = self.text_encoder(input_ids=input_ids, return_dict=True)
        return output.last_hidden_state, pooled_output(self.text_encoder, output.last_hidden_state, input_ids)


class _T5Encoder(torch.nn.Module):
    def __init__(self, text_encoder):
        super().__init__()
        self.text_encoder = text_encoder

    def forward(self, input_ids):
        return self.text_encoder(input_ids=input_ids, return_dict=True).last_hidden_state


class _FluxTransformer(torch.nn.Module):
    """The transformer with optimum's input names and order; the position ids come in as int64 (optimum's dtype) and
    the transformer's rotary embedding makes floats of them itself."""

    def __init__(self, transformer):
        super().__init__()
        self.transformer = transformer
        self.guidance_embeds = bool(transformer.config.guidance_embeds)

    def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, txt_ids, img_ids,
                guidance=None):
        return self.transformer(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                                pooled_projections=pooled_projections, timestep=timestep, img_ids=img_ids,
                                txt_ids=txt_ids, guidance=guidance, return_dict=False)[0]


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
            frequencies = (1.0 / self.theta ** exponents).to(torch.float32)
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

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: Optional[torch.Tensor] = None,
                 attention_mask: Optional[torch.Tensor] = None,
                 image_rotary_emb: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> Any:
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
            replacement = _DecomposedRMSNorm(child) if isinstance(child, torch.nn.RMSNorm) else \
                _RotaryPositions(child.theta, child.axes_dim)
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
        "text_encoder": dict(
            module=_CLIPTextEncoder(pipe.text_encoder), args=(torch.zeros(1, clip_length, dtype=torch.int64),),
            input_names=["input_ids"], output_names=["last_hidden_state", "pooler_output"],
            dynamic_axes={"input_ids": {0: "batch_size", 1: "sequence_length"},
                          "last_hidden_state": {0: "batch_size", 1: "sequence_length"},
                          "pooler_output": {0: "batch_size"}},
            config=pipe.text_encoder.config),
        "text_encoder_2": dict(
            module=_T5Encoder(pipe.text_encoder_2), args=(torch.ones(1, t5_length, dtype=torch.int64),),
            input_names=["input_ids"], output_names=["last_hidden_state"],
            dynamic_axes={"input_ids": {0: "batch_size", 1: "sequence_length"},
                          "last_hidden_state": {0: "batch_size", 1: "sequence_length"}},
            config=pipe.text_encoder_2.config),
    }
    names = ["hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "txt_ids", "img_ids"]
    args = [torch.randn(2, tokens, config.in_channels), torch.randn(2, text_length, config.joint_attention_dim),
            torch.randn(2, config.pooled_projection_dim), torch.tensor([0.5, 0.5]),
            torch.zeros(text_length, 3, dtype=torch.int64),
            torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0), indexing="ij"),
                        dim=-1).reshape(tokens, 3).to(torch.int64)]
    axes = {"hidden_states": {0: "batch_size", 1: "packed_height_width"},
            "encoder_hidden_states": {0: "batch_size", 1: "sequence_length"}, "pooled_projections": {0: "batch_size"},
            "timestep": {0: "batch_size"}, "txt_ids": {0: "sequence_length"}, "img_ids": {0: "packed_height_width"},
            "out_hidden_states": {0: "batch_size", 1: "packed_height_width"}}
    if config.guidance_embeds:
        names.append("guidance")
        args.append(torch.tensor([3.5, 3.5]))
        axes["guidance"] = {0: "batch_size"}
    specs["transformer"] = dict(module=_FluxTransformer(transformer), args=tuple(args), input_names=names,
                                output_names=["out_hidden_states"], dynamic_axes=axes, config=config)
    specs.update(vae_specs(pipe.vae, latent_size=8))
    return specs


def flux_fusion_options(name: str, target: str):
    """ORT's transformer-optimizer fusions for one Flux component: the UNet family's for CLIP and the VAE
    (:func:`~optimum_iobinding.export.optimize.fusion_options`); for the transformer and T5 their model type's, less
    the CUDA-only fused ops on ``target="cpu"``."""
    if name in ("text_encoder", "vae_encoder", "vae_decoder"):
        return fusion_options(name, {}, target)
    from onnxruntime.transformers.fusion_options import FusionOptions

    options = FusionOptions(FLUX_OPTIMIZER_MODEL_TYPES[name])
    if target == "cpu":
        for flag in ("enable_bias_splitgelu", "enable_bias_add", "enable_packed_qkv", "enable_packed_kv",
                     "enable_skip_group_norm", "enable_group_norm", "enable_nhwc_conv"):
            if hasattr(options, flag):
                setattr(options, flag, False)
    return options


def optimize_flux_component(name: str, path: Path, target: str):
    """ORT's optimizer on one component (its weights on disk meanwhile); the CLIP and VAE through the project's UNet-
    family path, the transformer as ``mmdit`` and T5 as ``t5`` — again without the attention fusion where that
    fusion raises."""
    if name in ("text_encoder", "vae_encoder", "vae_decoder"):
        return optimize_component(name, path, flux_fusion_options(name, target), target)
    from onnxruntime.transformers.optimizer import optimize_model

    from .optimize import in_folder, load_light

    options = flux_fusion_options(name, target)

    def run():
        with in_folder(path.parent):
            return optimize_model(load_light(path), model_type=FLUX_OPTIMIZER_MODEL_TYPES[name], opt_level=0,
                                  optimization_options=options, use_gpu=target == "cuda")

    try:
        return run()
    except Exception as error:  # the fusion scripts raise whatever the numpy code under them raises
        logger.warning("%s: ORT's attention fusion failed (%s: %s); optimizing without it", name,
                       type(error).__name__, error)
        options.enable_attention = False
        return run()


def save_flux_onnx(model: onnx.ModelProto, path: Path, threshold: int = EXTERNAL_DATA_THRESHOLD) -> None:
    """Writes ``model`` to ``path``: one file, or with its weights in ``model.onnx_data`` beside it where they are
    over ``threshold`` bytes (optimum's layout for components past protobuf's 2 GiB)."""
    from .optimize import weight_bytes

    path.parent.mkdir(parents=True, exist_ok=True)
    if weight_bytes(model) > threshold:
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=EXTERNAL_DATA_NAME, size_threshold=1024)
    else:
        onnx.save_model(model, str(path))


def export_flux_component(name: str, spec: dict, target: Path, opset: int, fp16: bool, optimize: Optional[str],
                          external_data_threshold: int = EXTERNAL_DATA_THRESHOLD) -> None:
    """One component: traced to ONNX, optimized (``optimize``), converted to float16 (``fp16``), saved with its
    config.json."""
    with tempfile.TemporaryDirectory() as scratch:
        scratch_path = Path(scratch) / "model.onnx"
        with exportable_flux_modules(spec["module"]), torch.no_grad(), warnings.catch_warnings():
            # the TorchScript exporter's notes on traced control flow and its own deprecation: not the user's to act on
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            warnings.filterwarnings("ignore", message="Constant folding - Only steps=1")
            warnings.filterwarnings("ignore", message="You are using the legacy TorchScript-based ONNX export")
            warnings.filterwarnings("ignore", message="The feature will be removed")
            warnings.filterwarnings("ignore", message="Exporting aten::index operator of advanced indexing")
            torch.onnx.export(spec["module"].eval(), spec["args"], str(scratch_path), dynamo=False,
                              input_names=spec["input_names"], output_names=spec["output_names"],
                              dynamic_axes=spec["dynamic_axes"], opset_version=opset, do_constant_folding=True)
        # ORT's T5 optimizer always fuses the relative position bias into its RelativePositionBias op, which only
        # the CUDA provider implements: on the CPU T5 stays as exported
        optimized = None
        if optimize and not (name == "text_encoder_2" and optimize == "cpu"):
            optimized = optimize_flux_component(name, scratch_path, optimize)
        model = to_precision(scratch_path, optimized, fp16)
    save_flux_onnx(model, target / name / "model.onnx", external_data_threshold)
    config = spec["config"].to_dict() if hasattr(spec["config"], "to_dict") else dict(spec["config"])
    if spec.get("class_name"):
        config.setdefault("_class_name", spec["class_name"])
    (target / name / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str))


def write_flux_model_index(folder: Path, pipe) -> None:
    """The torch pipeline's model_index.json, as optimum writes it for its ONNX export (torch class names; one
    ``vae`` entry for the two VAE folders)."""
    import diffusers

    def entry(module: Any) -> list:
        if module is None:
            return [None, None]
        library = "diffusers" if type(module).__module__.startswith("diffusers") else "transformers"
        name = type(module).__name__
        if name == "T5Tokenizer" and getattr(module, "is_fast", False):
            # transformers 5's one T5 tokenizer is the fast one; transformers 4 (optimum's) needs its fast name to
            # read tokenizer.json rather than a SentencePiece model the folder does not have
            name = "T5TokenizerFast"
        return [library, name]

    index = {"_class_name": "FluxPipeline", "_diffusers_version": diffusers.__version__,
             "feature_extractor": [None, None], "image_encoder": [None, None],
             **{name: entry(getattr(pipe, name)) for name in ("scheduler", "text_encoder", "text_encoder_2",
                                                                 "tokenizer", "tokenizer_2", "transformer", "vae")}}
    (folder / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True))


def export_flux_pipeline(pipe, target: Path, *, fp16: bool = False, opset: int = 17, optimize: Optional[str] = None,
                         components: Optional[Sequence[str]] = None, progress: bool = True,
                         external_data_threshold: int = EXTERNAL_DATA_THRESHOLD) -> Path:
    """Exports a diffusers ``FluxPipeline`` to optimum's Flux layout in ``target`` (built beside it, moved into
    place when whole; the caller has checked ``target``).

    Args:
        pipe: the ``FluxPipeline`` (schnell or dev), in float32.
        target: the output folder.
        fp16: convert the components :func:`flux_fp16_components` names to float16 (the module's table says why
            the others stay float32).
        opset: ONNX opset.
        optimize: ``"cuda"`` or ``"cpu"``: ORT's transformer optimizer on each component (``mmdit`` for the
            transformer) before the float16 conversion.
        components: which components to export (default: all five).
        progress: show a progress bar.
        external_data_threshold: weight bytes above which a component's weights go to ``model.onnx_data``.

    Returns:
        ``target``.
    """
    components = FLUX_COMPONENTS if components is None else tuple(components)
    unknown = [name for name in components if name not in FLUX_COMPONENTS]
    if unknown:
        raise ValueError(f"components: expected names from {list(FLUX_COMPONENTS)}, got {unknown}")
    specs = flux_component_specs(pipe)
    precision = flux_fp16_components(pipe.vae.config)
    with building_beside(target) as scratch:
        for name in tqdm(components, desc="export", unit="model", disable=not progress):
            export_flux_component(name, specs[name], scratch, opset, fp16 and precision[name], optimize,
                                  external_data_threshold)
        for name in ("tokenizer", "tokenizer_2"):
            save_tokenizer(getattr(pipe, name), scratch / name)
        pipe.scheduler.save_pretrained(str(scratch / "scheduler"))
        write_flux_model_index(scratch, pipe)
    return target
