"""The folder of a diffusion-transformer export (Stable Diffusion 3 in :mod:`.transformer`, FLUX.1 in :mod:`.flux`),
in optimum's layout: each component through its exporter (:mod:`.components`), float16 by one rule for both
families, the tokenizers, the scheduler and the torch pipeline's model_index.json.

Precision (:func:`component_precisions`, one rule for both families). With ``dtype="fp16"``
(:func:`float16_components`): every component but the T5 encoder, VAE included.

- T5 stays **float32**: its feed-forward activations overflow float16 (transformers keeps T5's ``wo`` projections in
  float32 for that reason, and clamps its hidden states only when the torch model itself runs in float16, which an
  exported float32 graph does not record). The pipelines cast its output to the transformer's dtype.
- The VAE goes float16: diffusers' SD3 and Flux pipelines decode in the pipeline's dtype and never read the VAE
  config's ``force_upcast`` (only the SDXL pipelines upcast), so the export writes ``force_upcast: false``.

With ``dtype="bf16"``: the transformer bfloat16 (:mod:`.bfloat16`: float16's two bytes with float32's range, which
its residual stream can need), the rest as in a float16 export: CLIP and the VAE float16 (their activations stay
inside float16's range, and ORT's CUDA provider has no bfloat16 kernel for the VAE's convolutions at these opsets,
nor for ORT's GroupNorm), T5 float32. A bfloat16 transformer runs on CUDA only: ORT's CPU provider has no bfloat16
MatMul or Add.

Each family's module says what this means for each of its components.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Collection, ContextManager, Dict, Mapping, Optional, Sequence, Tuple

import torch
from tqdm.auto import tqdm

from ..layout import building_beside, index_entry, save_tokenizer, write_transformer_model_index
from .components import OPTIMUM_EXTERNAL_DATA_FILE, export_component, export_model

__all__ = ["export_transformer_pipeline", "float16_components", "component_precisions"]

# ORT's optimizer model type of the components a float16 export leaves float32: T5 (see the module's docstring)
FLOAT32_MODEL_TYPES = frozenset({"t5"})
# the denoisers of a diffusion-transformer folder (Wan 2.2's low-noise expert is the second)
TRANSFORMERS = ("transformer", "transformer_2")


def float16_components(components: Collection[str], optimizer_model_types: Mapping[str, str]) -> frozenset:
    """The components of a diffusion-transformer pipeline (SD3, FLUX.1) that a float16 export converts: all
    but the T5 encoder, VAE included (the module's docstring says why).

    Args:
        components: the pipeline's component names.
        optimizer_model_types: ORT's optimizer model type of the components that have one (T5's is ``"t5"``).

    Returns:
        The names to convert.
    """
    return frozenset(name for name in components if optimizer_model_types.get(name) not in FLOAT32_MODEL_TYPES)


def component_precisions(
    components: Collection[str], optimizer_model_types: Mapping[str, str], dtype: str
) -> Dict[str, str]:
    """Each component's precision (``"fp32"``, ``"fp16"`` or ``"bf16"``) in a diffusion-transformer export of
    ``dtype`` (the module's docstring says why): ``"fp32"`` all float32; ``"fp16"`` the :func:`float16_components`
    float16, T5 float32; ``"bf16"`` as ``"fp16"`` but the transformers (and the ControlNets feeding them) bfloat16.

    Args:
        components: the pipeline's component names.
        optimizer_model_types: ORT's optimizer model type of the components that have one (T5's is ``"t5"``).
        dtype: the export's precision.

    Returns:
        The precision of each of ``components``.
    """
    if dtype == "fp32":
        return dict.fromkeys(components, "fp32")
    half = float16_components(components, optimizer_model_types)
    precisions = {name: "fp16" if name in half else "fp32" for name in components}
    if dtype == "bf16":  # every transformer (Wan 2.2's two experts too), and the ControlNets that feed one
        precisions.update(
            {name: "bf16" for name in precisions if name in TRANSFORMERS or name.startswith("controlnet")}
        )
    return precisions


def export_transformer_pipeline(
    pipe: Any,
    target: Path,
    specs: Mapping[str, Dict[str, Any]],
    components: Sequence[str],
    *,
    class_name: str,
    optimizer_model_types: Mapping[str, str],
    opset: int,
    dtype: str,
    optimize: Optional[str],
    progress: bool,
    external_data_threshold: int,
    exportable: Optional[Callable[[torch.nn.Module], ContextManager]] = None,
    step_cache: bool = False,
    cached: Sequence[str] = ("transformer",),
    settings: Optional[Mapping[str, Any]] = None,
    write_more: Optional[Callable[[Path], None]] = None,
    index_modules: Optional[Mapping[str, Optional[Tuple[str, str]]]] = None,
) -> Path:
    """Writes a diffusion-transformer pipeline folder at ``target`` (built beside it, moved into place when whole):
    each of ``components`` from ``specs`` (those in ``optimizer_model_types`` by
    :func:`~optimum_iobinding.export.components.export_model`, CLIP and the VAE by the UNet families' component
    exporter, :func:`~optimum_iobinding.export.components.export_component`: its fusions, LoRA map, VAE attention),
    each in its precision in an export of ``dtype`` (``"fp32"``, ``"fp16"`` or ``"bf16"``, see
    :func:`component_precisions`); the pipeline's tokenizers (as both transformers 4 and 5 read them) and scheduler;
    and the torch pipeline's model_index.json under ``class_name`` (torch class names; one ``vae`` entry for both VAE
    folders), as optimum writes it, with the pipeline's ``settings`` (Wan's ``boundary_ratio``) beside its
    components; with ``step_cache``, the First-Block Cache parts of each transformer in ``cached`` (``transformer``;
    Wan 2.2's ``transformer_2`` too) beside it (:mod:`.step_cache`, cut from the transformer in its precision); and
    what ``write_more(folder)`` writes into the folder being built (a component of the family's own exporter: Wan's
    VAE), named in model_index.json by ``index_modules`` (``(library, class)`` by component, over the torch
    pipeline's own). The caller has checked ``target`` and ``components``.

    Returns:
        ``target``.
    """
    tokenizers = [name for name in ("tokenizer", "tokenizer_2", "tokenizer_3") if getattr(pipe, name, None) is not None]
    precisions = component_precisions(components, optimizer_model_types, dtype)
    with building_beside(target) as scratch:
        for name in tqdm(components, desc="export", unit="model", disable=not progress):
            if name in optimizer_model_types:
                export_model(
                    name,
                    specs[name],
                    scratch,
                    opset,
                    optimize,
                    optimizer_model_types[name],
                    external_data_threshold,
                    exportable,
                    step_cache=step_cache and name in cached,
                    dtype=precisions[name],
                )
            else:  # CLIP and the VAE: float16 at most (component_precisions)
                export_component(
                    name,
                    specs[name],
                    scratch,
                    opset,
                    precisions[name] == "fp16",
                    optimize,
                    external_data_threshold=external_data_threshold,
                    external_data_file=OPTIMUM_EXTERNAL_DATA_FILE,
                )
        for name in tokenizers:
            tokenizer = getattr(pipe, name)
            save_tokenizer(tokenizer, scratch / name)
        if write_more is not None:
            write_more(scratch)
        pipe.scheduler.save_pretrained(str(scratch / "scheduler"))
        # every component the pipeline class has, ``None`` where this pipeline has none (an SD3 without T5)
        modules = (
            "scheduler",
            "transformer",
            "transformer_2",
            "vae",
            "text_encoder",
            "text_encoder_2",
            "text_encoder_3",
            "tokenizer",
            "tokenizer_2",
            "tokenizer_3",
        )
        write_transformer_model_index(
            scratch,
            class_name,
            {
                **{name: index_entry(getattr(pipe, name)) for name in modules if hasattr(pipe, name)},
                "image_encoder": None,
                "feature_extractor": None,
                **(index_modules or {}),
            },
            settings,
        )
    return target
