"""Export of diffusion-transformer pipelines to optimum's ONNX layout: what every such export shares (CLIP with its
hidden states and projection, the T5 encoder, the per-component exporter of the transformer and T5, external data,
the model index, the pipeline folder) and Stable Diffusion 3 / 3.5's own specs (FLUX.1's are in :mod:`.flux`).

Layout written (what ``optimum-cli export onnx`` writes for these models, and what both
:class:`OnnxStableDiffusion3Pipeline` and optimum's ``ORTStableDiffusion3Pipeline`` load)::

    model_index.json              the torch pipeline's index (torch class names; one ``vae`` entry for both VAE folders)
    text_encoder/, text_encoder_2/  CLIPTextModelWithProjection: input_ids (int64) → text_embeds, last_hidden_state,
                                  hidden_states.0 … hidden_states.N (SD3 takes the penultimate)
    text_encoder_3/               T5EncoderModel: input_ids (int64) → last_hidden_state (absent without a T5)
    transformer/                  SD3Transformer2DModel: hidden_states, encoder_hidden_states, pooled_projections,
                                  timestep → out_hidden_states
    vae_encoder/, vae_decoder/    as the Stable Diffusion export (16 latent channels; config.json keeps the VAE's
                                  scaling_factor and shift_factor)
    tokenizer/, tokenizer_2/, tokenizer_3/, scheduler/

Precision with ``fp16=True`` (:func:`float16_components`, one rule for SD3 and FLUX.1), per component:

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

Transformers and T5 encoders whose weights exceed :data:`EXTERNAL_DATA_THRESHOLD` bytes (protobuf cannot serialize a
message over 2 GiB, and the graph itself needs some of that) are written with their weights in ``model.onnx_data``
beside ``model.onnx``, as optimum writes them.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, ContextManager, Collection, Dict, Mapping, Optional, Sequence

import onnx
import torch
from tqdm.auto import tqdm

from ..layout import building_beside, save_tokenizer, write_transformer_model_index
from .export import export_component, fix_output_dims, pooled_output, to_precision, vae_specs
from .optimize import MAX_SINGLE_FILE_BYTES, fusion_options_for, optimize_component, save_onnx

__all__ = ["export_sd3_pipeline", "is_sd3_pipeline", "clip_text_encoder_spec", "t5_encoder_spec",
           "export_transformer_pipeline", "float16_components", "FP16_COMPONENTS", "EXTERNAL_DATA_FILE",
           "EXTERNAL_DATA_THRESHOLD"]

# ORT's optimizer model type of the components a float16 export leaves float32: T5 (see the module's docstring)
FLOAT32_MODEL_TYPES = frozenset({"t5"})


def float16_components(components: Collection[str], optimizer_model_types: Mapping[str, str]) -> frozenset:
    """The components of a diffusion-transformer pipeline (SD3, FLUX.1) that ``fp16=True`` converts to float16: all
    but the T5 encoder, VAE included (the module's docstring says why).

    Args:
        components: the pipeline's component names.
        optimizer_model_types: ORT's optimizer model type of the components that have one (T5's is ``"t5"``).

    Returns:
        The names to convert.
    """
    return frozenset(name for name in components if optimizer_model_types.get(name) not in FLOAT32_MODEL_TYPES)


SD3_COMPONENTS = ("text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "vae_encoder", "vae_decoder")
# ORT's transformer-optimizer model type of the SD3 components exported by :func:`export_model` (CLIP and the VAE go
# through the Stable Diffusion export's own component exporter)
SD3_OPTIMIZER_MODEL_TYPES = {"text_encoder_3": "t5", "transformer": "mmdit"}
# The SD3 components a float16 export converts
FP16_COMPONENTS = float16_components(SD3_COMPONENTS, SD3_OPTIMIZER_MODEL_TYPES)
# Weights beyond this many bytes go to an external-data file: protobuf cannot serialize a message over 2 GiB, and the
# graph itself needs some of that (the limit every export of the project keeps).
EXTERNAL_DATA_THRESHOLD = MAX_SINGLE_FILE_BYTES
EXTERNAL_DATA_FILE = "model.onnx_data"  # optimum's name for it
# model types ORT's optimizer is run on for CUDA only: its T5 fusions always write RelativePositionBias, an operator
# with a CUDA kernel only (a CPU session refuses the model); the CPU gets the T5 graph as exported
_OPTIMIZED_FOR_CUDA_ONLY = frozenset({"t5"})


# ------------------------------------------------------------------------------------------------ text encoders
class ClipTextEncoder(torch.nn.Module):
    """A CLIP text encoder as optimum exports it for SD3, SDXL and Flux: with a projection, ``text_embeds`` (the
    projected pooled output) then ``last_hidden_state``; without one, ``last_hidden_state`` then ``pooler_output``;
    then, with ``hidden_states``, every layer's ``hidden_states.i``. The pooled output is pooled on the device (see
    :func:`~optimum_iobinding.export.export.pooled_output`)."""

    def __init__(self, text_encoder: torch.nn.Module, with_projection: bool, hidden_states: bool = True):
        super().__init__()
        self.text_encoder = text_encoder
        self.with_projection = with_projection
        self.hidden_states = hidden_states

    def forward(self, input_ids: torch.Tensor):
        output = self.text_encoder(input_ids=input_ids, output_hidden_states=self.hidden_states, return_dict=True)
        last = output.last_hidden_state
        pooled = pooled_output(self.text_encoder, last, input_ids)
        layers = tuple(output.hidden_states) if self.hidden_states else ()
        if self.with_projection:
            return (self.text_encoder.text_projection(pooled), last, *layers)
        return (last, pooled, *layers)


def clip_text_encoder_spec(text_encoder: torch.nn.Module, sequence: int, with_projection: bool,
                           hidden_states: bool = True) -> Dict[str, Any]:
    """The export spec of a CLIP text encoder with optimum's names (``CLIPTextWithProjectionOnnxConfig`` /
    ``CLIPTextOnnxConfig``): int64 ``input_ids`` of dynamic batch and sequence; outputs as :class:`ClipTextEncoder`.

    Args:
        text_encoder: a transformers ``CLIPTextModelWithProjection`` (``with_projection``) or ``CLIPTextModel``.
        sequence: the example's sequence length (the tokenizer's ``model_max_length``).
        with_projection: export ``text_embeds`` (the projection) instead of ``pooler_output``.
        hidden_states: also export every layer's hidden states (SD3 and SDXL read the penultimate; Flux none).

    Returns:
        The spec: ``module``, example ``args``, ``input_names``, ``output_names``, ``dynamic_axes``, ``config``.
    """
    pooled = "text_embeds" if with_projection else "pooler_output"
    layers = [f"hidden_states.{i}" for i in range(text_encoder.config.num_hidden_layers + 1)] if hidden_states else []
    names = [pooled, "last_hidden_state"] if with_projection else ["last_hidden_state", pooled]
    return dict(
        module=ClipTextEncoder(text_encoder, with_projection, hidden_states),
        args=(torch.zeros(1, sequence, dtype=torch.int64),),
        input_names=["input_ids"],
        output_names=names + layers,
        dynamic_axes={"input_ids": {0: "batch", 1: "sequence"}, pooled: {0: "batch"},
                      **{name: {0: "batch", 1: "sequence"} for name in ["last_hidden_state", *layers]}},
        config=text_encoder.config,
    )


class T5Encoder(torch.nn.Module):
    """transformers' ``T5EncoderModel``: ``input_ids`` → ``last_hidden_state`` (optimum's ``T5EncoderOnnxConfig``)."""

    def __init__(self, text_encoder: torch.nn.Module):
        super().__init__()
        self.text_encoder = text_encoder

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.text_encoder(input_ids=input_ids, return_dict=True).last_hidden_state


def t5_encoder_spec(text_encoder: torch.nn.Module, sequence: int = 16) -> Dict[str, Any]:
    """The export spec of a T5 encoder with optimum's names: int64 ``input_ids`` (batch, sequence) →
    ``last_hidden_state``; both dims dynamic (T5's relative positions take any length, so a short example exports
    faster)."""
    return dict(
        module=T5Encoder(text_encoder),
        args=(torch.zeros(1, sequence, dtype=torch.int64),),
        input_names=["input_ids"],
        output_names=["last_hidden_state"],
        dynamic_axes={"input_ids": {0: "batch", 1: "sequence"}, "last_hidden_state": {0: "batch", 1: "sequence"}},
        config=text_encoder.config,
    )


# -------------------------------------------------------------------------------------------------- transformer
class SD3Transformer(torch.nn.Module):
    """diffusers' ``SD3Transformer2DModel`` with optimum's inputs, in its order: ``hidden_states`` (latents),
    ``encoder_hidden_states`` (CLIP and T5 states), ``pooled_projections`` (both CLIPs' pooled projections),
    ``timestep`` (one per row) → ``out_hidden_states``."""

    def __init__(self, transformer: torch.nn.Module):
        super().__init__()
        self.transformer = transformer

    def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep):
        return self.transformer(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                                pooled_projections=pooled_projections, timestep=timestep, return_dict=False)[0]


def sd3_transformer_spec(transformer: torch.nn.Module, sequence: int = 8) -> Dict[str, Any]:
    """The export spec of an SD3 transformer (optimum's ``SD3TransformerOnnxConfig`` names), batch, latent height and
    width and the text sequence dynamic."""
    config = transformer.config
    latent = 4 * config.patch_size
    return dict(
        module=SD3Transformer(transformer),
        args=(torch.randn(2, config.in_channels, latent, latent), torch.randn(2, sequence, config.joint_attention_dim),
              torch.randn(2, config.pooled_projection_dim), torch.tensor([500.0, 500.0])),
        input_names=["hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"],
        output_names=["out_hidden_states"],
        dynamic_axes={"hidden_states": {0: "batch", 2: "height", 3: "width"},
                      "encoder_hidden_states": {0: "batch", 1: "sequence"}, "pooled_projections": {0: "batch"},
                      "timestep": {0: "batch"}, "out_hidden_states": {0: "batch", 2: "height", 3: "width"}},
        # diffusers' SD3 pipeline feeds the timestep in float32 whatever the pipeline's dtype (FLUX.1 rounds it to
        # the latents' dtype first): a float16 export keeps this input float32
        float32_inputs=["timestep"],
        # the output's channels as a number: ORT's fused float16 graph names them by an unresolved Reshape dim, which
        # would leave the output's shape unknown before the run, and the transformer without a CUDA graph
        fixed_output_dims={"out_hidden_states": {1: transformer.out_channels}},
        config=config,
    )


def is_sd3_pipeline(pipe: Any) -> bool:
    """A diffusers Stable Diffusion 3 pipeline: an ``SD3Transformer2DModel`` as its ``transformer``."""
    transformer = getattr(pipe, "transformer", None)
    return transformer is not None and type(transformer).__name__ == "SD3Transformer2DModel"


def sd3_component_specs(pipe: Any) -> Dict[str, Dict[str, Any]]:
    """What to export of an SD3 pipeline: each component's module, example inputs, names and dynamic axes."""
    sequence = pipe.tokenizer.model_max_length
    specs = {name: clip_text_encoder_spec(getattr(pipe, name), sequence, with_projection=True)
             for name in ("text_encoder", "text_encoder_2")}
    if getattr(pipe, "text_encoder_3", None) is not None:
        specs["text_encoder_3"] = t5_encoder_spec(pipe.text_encoder_3)
    specs["transformer"] = sd3_transformer_spec(pipe.transformer)
    return {**specs, **vae_specs(pipe.vae, latent_size=8)}


# ------------------------------------------------------------------------------------------------------ writing
def save_model(model: onnx.ModelProto, path: Path, external_data_threshold: int = EXTERNAL_DATA_THRESHOLD) -> bool:
    """Writes ``model`` to ``path``; with its weights in ``model.onnx_data`` beside it (optimum's layout) where they
    exceed ``external_data_threshold`` bytes. Returns whether it wrote external data."""
    return save_onnx(model, path, external_data_threshold, EXTERNAL_DATA_FILE)


def _torch_export(spec: Dict[str, Any], path: Path, opset: int) -> None:
    with torch.no_grad(), warnings.catch_warnings():
        # the TorchScript exporter's notes on the Python control flow it traced and on its own deprecation: expected
        # for diffusers' and transformers' modules, and not the user's to act on
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        for message in ("Constant folding - Only steps=1", "You are using the legacy TorchScript-based ONNX export",
                        "The feature will be removed", "Exporting aten::index operator of advanced indexing"):
            warnings.filterwarnings("ignore", message=message)
        torch.onnx.export(spec["module"].eval(), spec["args"], str(path), dynamo=False,
                          input_names=spec["input_names"], output_names=spec["output_names"],
                          dynamic_axes=spec["dynamic_axes"], opset_version=opset, do_constant_folding=True)


def export_model(name: str, spec: Dict[str, Any], target: Path, opset: int, fp16: bool, optimize: Optional[str],
                 model_type: str, external_data_threshold: int = EXTERNAL_DATA_THRESHOLD,
                 exportable: Optional[Callable[[torch.nn.Module], ContextManager]] = None) -> None:
    """Exports one transformer-family component (a diffusion transformer, a T5 encoder) to ``target/name``: the
    TorchScript exporter, then ORT's transformer optimizer (``optimize``: ``"cuda"`` or ``"cpu"``; ``model_type``,
    e.g. ``t5`` or ``mmdit``; again without the attention fusion where that fusion raises) with the weights kept on
    disk, then ORT's float16 converter (``fp16``), then ``model.onnx`` (and its external data above
    ``external_data_threshold`` bytes) and ``config.json``.

    Args:
        name: the component's folder name.
        spec: its export spec (``module``, ``args``, ``input_names``, ``output_names``, ``dynamic_axes``, ``config``).
        target: the pipeline folder.
        opset: ONNX opset.
        fp16: convert to float16.
        optimize: ``"cuda"``, ``"cpu"`` or ``None``; for ``"cpu"`` a T5 encoder is left as exported (ORT's T5 fusions
            write an operator only CUDA runs).
        model_type: ORT's optimizer model type of the component.
        external_data_threshold: weights above this many bytes go to ``model.onnx_data``.
        exportable: a context manager factory that makes the module traceable while the exporter runs (given the
            module; it puts back what it changed).
    """
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "model.onnx"
        with (exportable or (lambda module: contextlib.nullcontext()))(spec["module"]):
            _torch_export(spec, path, opset)
        if optimize == "cpu" and model_type in _OPTIMIZED_FOR_CUDA_ONLY:
            optimize = None
        optimized = (optimize_component(name, path, fusion_options_for(model_type, optimize), optimize, model_type)
                     if optimize else None)
        model = to_precision(path, optimized, fp16, spec.get("float32_inputs", ()))
    fix_output_dims(model, spec.get("fixed_output_dims", {}))
    save_model(model, target / name / "model.onnx", external_data_threshold)
    config = spec["config"].to_dict() if hasattr(spec["config"], "to_dict") else dict(spec["config"])
    (target / name / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str))


def torch_class_entry(module: Any) -> Optional[tuple]:
    """A component's model_index.json entry, ``(library, class name)`` (``None`` for a missing one): transformers 5's
    ``T5Tokenizer`` is the fast one (``T5TokenizerFast`` is its alias there), while transformers 4's ``T5Tokenizer``
    needs a sentencepiece file the folder does not have; the fast name loads in both."""
    if module is None:
        return None
    library = "diffusers" if type(module).__module__.startswith("diffusers") else "transformers"
    name = type(module).__name__
    if name == "T5Tokenizer" and getattr(module, "is_fast", False):
        name = "T5TokenizerFast"
    return library, name


def export_transformer_pipeline(
    pipe: Any,
    target: Path,
    specs: Mapping[str, Dict[str, Any]],
    components: Sequence[str],
    *,
    class_name: str,
    optimizer_model_types: Mapping[str, str],
    opset: int,
    fp16: bool,
    optimize: Optional[str],
    progress: bool,
    external_data_threshold: int,
    exportable: Optional[Callable[[torch.nn.Module], ContextManager]] = None,
) -> Path:
    """Writes a diffusion-transformer pipeline folder at ``target`` (built beside it, moved into place when whole):
    each of ``components`` from ``specs`` (those in ``optimizer_model_types`` by :func:`export_model`, CLIP and the
    VAE by the Stable Diffusion export's own component exporter: its fusions, LoRA map, VAE attention), float16 where
    ``fp16`` and :func:`float16_components` names it; the pipeline's tokenizers (as both transformers 4 and 5
    read them) and scheduler; and the torch pipeline's model_index.json under ``class_name`` (torch
    class names; one ``vae`` entry for both VAE folders), as optimum writes it. The caller has checked ``target`` and
    ``components``.

    Returns:
        ``target``.
    """
    tokenizers = [name for name in ("tokenizer", "tokenizer_2", "tokenizer_3") if getattr(pipe, name, None) is not None]
    half_components = float16_components(components, optimizer_model_types) if fp16 else frozenset()
    with building_beside(target) as scratch:
        for name in tqdm(components, desc="export", unit="model", disable=not progress):
            half = name in half_components
            if name in optimizer_model_types:
                export_model(name, specs[name], scratch, opset, half, optimize, optimizer_model_types[name],
                             external_data_threshold, exportable)
            else:
                export_component(name, specs[name], scratch, opset, half, optimize,
                                 external_data_threshold=external_data_threshold,
                                 external_data_file=EXTERNAL_DATA_FILE)
        for name in tokenizers:
            tokenizer = getattr(pipe, name)
            save_tokenizer(tokenizer, scratch / name)
        pipe.scheduler.save_pretrained(str(scratch / "scheduler"))
        # every component the pipeline class has, ``None`` where this pipeline has none (an SD3 without T5)
        modules = ("scheduler", "transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer",
                   "tokenizer_2", "tokenizer_3")
        write_transformer_model_index(scratch, class_name, {
            **{name: torch_class_entry(getattr(pipe, name)) for name in modules if hasattr(pipe, name)},
            "image_encoder": None, "feature_extractor": None})
    return target


def export_sd3_pipeline(
    pipe: Any,
    target: Path,
    *,
    components: Optional[Sequence[str]] = None,
    opset: int = 17,
    fp16: bool = False,
    optimize: Optional[str] = None,
    progress: bool = True,
    external_data_threshold: int = EXTERNAL_DATA_THRESHOLD,
) -> Path:
    """Exports a diffusers ``StableDiffusion3Pipeline`` to optimum's ONNX layout at ``target`` (see the module's
    docstring), built beside it and moved into place when whole.

    Args:
        pipe: the torch pipeline (float32).
        target: the output folder (checked by the caller: new, empty, or to be replaced).
        components: which ONNX components to export (default: all the pipeline has; no ``text_encoder_3`` without a
            T5).
        opset: ONNX opset.
        fp16: convert all but T5 to float16 (:func:`float16_components`; T5 stays float32).
        optimize: ``"cuda"`` or ``"cpu"``: ORT's transformer optimizer (``clip``, ``t5``, ``mmdit``, ``vae``) on
            each component before the float16 conversion, with the fusions that target runs (for ``"cpu"`` the T5
            encoder is left as exported: ORT's T5 fusions write an operator only CUDA runs).
        progress: show a progress bar.
        external_data_threshold: weights above this many bytes go to ``model.onnx_data``.

    Returns:
        ``target``.
    """
    available = tuple(name for name in SD3_COMPONENTS
                      if name != "text_encoder_3" or getattr(pipe, "text_encoder_3", None) is not None)
    components = available if components is None else tuple(components)
    unknown = [name for name in components if name not in available]
    if unknown:
        raise ValueError(f"components: expected names from {list(available)}, got {unknown}")
    return export_transformer_pipeline(
        pipe, target, sd3_component_specs(pipe), components, class_name=type(pipe).__name__,
        optimizer_model_types=SD3_OPTIMIZER_MODEL_TYPES, opset=opset, fp16=fp16,
        optimize=optimize, progress=progress, external_data_threshold=external_data_threshold)
