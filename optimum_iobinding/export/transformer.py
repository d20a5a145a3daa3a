"""Export of Stable Diffusion 3 / 3.5 pipelines to optimum's ONNX layout: SD3's transformer and component specs. The
text encoders, VAE and component exporters are :mod:`.components`', the folder :mod:`.transformer_pipeline`'s, both
shared with FLUX.1 (:mod:`.flux`).

Layout written (what ``optimum-cli export onnx`` writes for these models, and what both our Stable Diffusion 3 pipeline
and optimum's ``ORTStableDiffusion3Pipeline`` load)::

    model_index.json              the torch pipeline's index (torch class names; one ``vae`` entry for both VAE folders)
    text_encoder/, text_encoder_2/  CLIPTextModelWithProjection: input_ids (int64) → text_embeds, last_hidden_state,
                                  hidden_states.0 … hidden_states.N (SD3 takes the penultimate)
    text_encoder_3/               T5EncoderModel: input_ids (int64) → last_hidden_state (absent without a T5)
    transformer/                  SD3Transformer2DModel: hidden_states, encoder_hidden_states, pooled_projections,
                                  timestep → out_hidden_states
    vae_encoder/, vae_decoder/    as the Stable Diffusion export (16 latent channels; config.json keeps the VAE's
                                  scaling_factor and shift_factor)
    tokenizer/, tokenizer_2/, tokenizer_3/, scheduler/

Precision with ``dtype="fp16"`` (:func:`~optimum_iobinding.export.transformer_pipeline.float16_components`, one
rule for SD3 and FLUX.1), per component:

- ``text_encoder``, ``text_encoder_2`` (CLIP): float16, as for SD 1.x/2.x and SDXL.
- ``transformer`` (MMDiT): float16; diffusers runs the SD3 transformer in float16 itself (its model cards load the
  pipeline with ``torch_dtype=torch.float16``), and ORT's MMDiT fusions target float16. Its sinusoidal timestep
  embedding is computed in float32 up to the first layer, and its ``timestep`` input is float32: diffusers feeds the
  timestep in float32 and embeds it in float32 whatever the pipeline's dtype (a float16 timestep near 1000 is off by
  up to 0.5, and its sines and cosines by up to ~0.3).
- ``vae_encoder``, ``vae_decoder``: float16; diffusers' SD3 and Flux pipelines decode in the pipeline's dtype and
  never read the VAE config's ``force_upcast`` (AutoencoderKL's default, in these VAEs' configs too; only the SDXL
  pipelines upcast). The export writes ``force_upcast: false``, as the SDXL export does; unlike that one it does not
  warn, since diffusers runs these VAEs in float16 itself.
- ``text_encoder_3`` (T5): **float32**. T5's feed-forward activations overflow float16 (transformers keeps T5's
  ``wo`` projections in float32 for that reason, and clamps its hidden states only when the torch model itself runs
  in float16, which an exported float32 graph does not record). The pipeline casts its output to the transformer's
  dtype.

With ``dtype="bf16"`` the transformer is bfloat16 (:mod:`~optimum_iobinding.export.bfloat16`: its patch-embedding
``Conv`` and unpatchify ``Einsum``, which ORT's CUDA provider has no bfloat16 kernel for at opset 17, stay float32
between Casts; its ``timestep`` input stays float32) and the others are as above; it runs on CUDA only.

Transformers and T5 encoders whose weights exceed
:data:`~optimum_iobinding.export.components.EXTERNAL_DATA_THRESHOLD` bytes (protobuf cannot serialize a message over
2 GiB, and the graph itself needs some of that) are written with their weights in ``model.onnx_data`` beside
``model.onnx``, as optimum writes them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import torch

from ..errors import ArgumentError
from ..families import MMDIT_INPUTS
from .components import EXTERNAL_DATA_THRESHOLD, clip_text_encoder_spec, t5_encoder_spec, vae_specs
from .components import OPTIMUM_EXTERNAL_DATA_FILE as EXTERNAL_DATA_FILE
from .transformer_pipeline import export_transformer_pipeline, float16_components

# EXTERNAL_DATA_FILE, EXTERNAL_DATA_THRESHOLD, clip_text_encoder_spec, t5_encoder_spec, export_transformer_pipeline
# and float16_components belong to .components and .transformer_pipeline; they are named here too, where callers
# import them
__all__ = [
    "export_sd3_pipeline",
    "clip_text_encoder_spec",
    "t5_encoder_spec",
    "export_transformer_pipeline",
    "float16_components",
    "FP16_COMPONENTS",
    "EXTERNAL_DATA_FILE",
    "EXTERNAL_DATA_THRESHOLD",
]

SD3_COMPONENTS = ("text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "vae_encoder", "vae_decoder")
# ORT's transformer-optimizer model type of the SD3 components exported by
# :func:`~optimum_iobinding.export.components.export_model` (CLIP and the VAE go through the UNet families' component
# exporter)
SD3_OPTIMIZER_MODEL_TYPES = {"text_encoder_3": "t5", "transformer": "mmdit"}
# The SD3 components a float16 export converts
FP16_COMPONENTS = float16_components(SD3_COMPONENTS, SD3_OPTIMIZER_MODEL_TYPES)


# -------------------------------------------------------------------------------------------------- transformer
class SD3Transformer(torch.nn.Module):
    """diffusers' ``SD3Transformer2DModel`` with optimum's inputs, in its order: ``hidden_states`` (latents),
    ``encoder_hidden_states`` (CLIP and T5 states), ``pooled_projections`` (both CLIPs' pooled projections),
    ``timestep`` (one per row) → ``out_hidden_states``."""

    def __init__(self, transformer: torch.nn.Module):
        super().__init__()
        self.transformer = transformer

    def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep):
        return self.transformer(
            hidden_states=hidden_states,
            encoder_hidden_states=encoder_hidden_states,
            pooled_projections=pooled_projections,
            timestep=timestep,
            return_dict=False,
        )[0]


def sd3_transformer_spec(transformer: torch.nn.Module, sequence: int = 8) -> Dict[str, Any]:
    """The export spec of an SD3 transformer (optimum's ``SD3TransformerOnnxConfig`` names), batch, latent height and
    width and the text sequence dynamic."""
    config = transformer.config
    latent = 4 * config.patch_size
    return dict(
        module=SD3Transformer(transformer),
        args=(
            torch.randn(2, config.in_channels, latent, latent),
            torch.randn(2, sequence, config.joint_attention_dim),
            torch.randn(2, config.pooled_projection_dim),
            torch.tensor([500.0, 500.0]),
        ),
        input_names=list(MMDIT_INPUTS),
        output_names=["out_hidden_states"],
        dynamic_axes={
            "hidden_states": {0: "batch", 2: "height", 3: "width"},
            "encoder_hidden_states": {0: "batch", 1: "sequence"},
            "pooled_projections": {0: "batch"},
            "timestep": {0: "batch"},
            "out_hidden_states": {0: "batch", 2: "height", 3: "width"},
        },
        # diffusers' SD3 pipeline feeds the timestep in float32 whatever the pipeline's dtype (FLUX.1 rounds it to
        # the latents' dtype first): a float16 export keeps this input float32
        float32_inputs=["timestep"],
        # the output's channels as a number: ORT's fused float16 graph names them by an unresolved Reshape dim, which
        # would leave the output's shape unknown before the run, and the transformer without a CUDA graph
        fixed_output_dims={"out_hidden_states": {1: transformer.out_channels}},
        config=config,
    )


def sd3_component_specs(pipe: Any) -> Dict[str, Dict[str, Any]]:
    """What to export of an SD3 pipeline: each component's module, example inputs, names and dynamic axes."""
    sequence = pipe.tokenizer.model_max_length
    specs = {
        name: clip_text_encoder_spec(getattr(pipe, name), sequence, with_projection=True)
        for name in ("text_encoder", "text_encoder_2")
    }
    if getattr(pipe, "text_encoder_3", None) is not None:
        specs["text_encoder_3"] = t5_encoder_spec(pipe.text_encoder_3)
    specs["transformer"] = sd3_transformer_spec(pipe.transformer)
    return {**specs, **vae_specs(pipe.vae, latent_size=8)}


def export_sd3_pipeline(
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
) -> Path:
    """Exports a diffusers ``StableDiffusion3Pipeline`` to optimum's ONNX layout at ``target`` (see the module's
    docstring), built beside it and moved into place when whole.

    Args:
        pipe: the torch pipeline (float32).
        target: the output folder (checked by the caller: new, empty, or to be replaced).
        components: which ONNX components to export (default: all the pipeline has; no ``text_encoder_3`` without a
            T5).
        opset: ONNX opset.
        dtype: ``"fp32"``; ``"fp16"``: all but T5 float16 (:func:`float16_components`; T5 stays float32);
            ``"bf16"``: the transformer bfloat16, the others as for ``"fp16"`` (see the module's docstring).
        optimize: ``"cuda"`` or ``"cpu"``: ORT's transformer optimizer (``clip``, ``t5``, ``mmdit``, ``vae``) on
            each component before the float16 conversion, with the fusions that target runs (for ``"cpu"`` the T5
            encoder is left as exported: ORT's T5 fusions write an operator only CUDA runs).
        progress: show a progress bar.
        external_data_threshold: weights above this many bytes go to ``model.onnx_data``.
        step_cache: the transformer's First-Block Cache parts too (:mod:`.step_cache`).

    Returns:
        ``target``.
    """
    available = tuple(
        name for name in SD3_COMPONENTS if name != "text_encoder_3" or getattr(pipe, "text_encoder_3", None) is not None
    )
    components = available if components is None else tuple(components)
    unknown = [name for name in components if name not in available]
    if unknown:
        raise ArgumentError("components", f"expected names from {list(available)}, got {unknown}")
    return export_transformer_pipeline(
        pipe,
        target,
        sd3_component_specs(pipe),
        components,
        class_name=type(pipe).__name__,
        optimizer_model_types=SD3_OPTIMIZER_MODEL_TYPES,
        opset=opset,
        dtype=dtype,
        optimize=optimize,
        progress=progress,
        external_data_threshold=external_data_threshold,
        step_cache=step_cache,
    )
