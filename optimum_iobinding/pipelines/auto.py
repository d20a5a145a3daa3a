"""Which pipeline an ONNX folder needs, as diffusers' ``AutoPipelineForText2Image`` picks one (what ``generate`` and
the server use)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union

from ..errors import ArgumentError, ArgumentPathError
from ..layout import read_model_index, resolve_pipeline_folder
from ..runtime.hub import load_graph
from .components import names_of
from .flux import OnnxFluxPipeline
from .latent_consistency import OnnxLatentConsistencyModelPipeline
from .stable_diffusion import OnnxStableDiffusionPipeline
from .denoisers import MMDIT_INPUTS
from .stable_diffusion_3 import OnnxStableDiffusion3Pipeline
from .stable_diffusion_xl import OnnxStableDiffusionXLPipeline


# what any text-to-image family reads from a pipeline folder: a Hub id is downloaded with these, once
TEXT_TO_IMAGE_CLASSES = (
    OnnxStableDiffusionPipeline,
    OnnxStableDiffusionXLPipeline,
    OnnxLatentConsistencyModelPipeline,
    OnnxStableDiffusion3Pipeline,
    OnnxFluxPipeline,
)


def resolve_model_folder(model: Union[str, os.PathLike], **hub_kwargs) -> Path:
    """A pipeline folder for :func:`pipeline_class_for`: ``model`` itself where it is a local folder, else the Hub
    repository ``model`` downloaded with the files any text-to-image family reads (its ONNX components, tokenizers,
    scheduler and model_index.json)."""
    components = dict.fromkeys(
        name for cls in TEXT_TO_IMAGE_CLASSES for name in names_of(cls.declared_components, "onnx")
    )
    tokenizers = dict.fromkeys(
        name for cls in TEXT_TO_IMAGE_CLASSES for name in names_of(cls.declared_components, "tokenizer")
    )
    return resolve_pipeline_folder(model, tuple(components), tuple(tokenizers), **hub_kwargs)


def pipeline_class_for(folder: Union[str, os.PathLike]) -> type:
    """The text-to-image pipeline class for an ONNX folder, as diffusers' ``AutoPipelineForText2Image`` picks one:
    FLUX.1 when its transformer takes ``img_ids``, Stable Diffusion 3 when it takes SD3's inputs; SDXL when the
    UNet takes ``text_embeds``/``time_ids``, LCM when it takes ``timestep_cond``, else Stable Diffusion 1.x/2.x
    (SD-Turbo included). A folder no text-to-image pipeline runs (an inpainting UNet, an SDXL refiner) is an error
    saying which pipeline to use."""
    folder = Path(folder)
    read_model_index(folder, ())  # a pipeline folder: its model_index.json is there and parses
    transformer_path = folder / "transformer" / "model.onnx"
    if transformer_path.is_file():  # a diffusion transformer
        return _transformer_pipeline_class(folder, transformer_path)
    unet_path = folder / "unet" / "model.onnx"
    if not unet_path.is_file():
        raise ArgumentPathError("model", f"expected {str(unet_path)!r} (an ONNX Stable Diffusion folder), found none")
    graph = load_graph(str(unet_path)).graph
    initializers = {init.name for init in graph.initializer}
    inputs = {value.name: value for value in graph.input if value.name not in initializers}
    if "text_embeds" in inputs or "time_ids" in inputs:
        if not (folder / "text_encoder").is_dir():
            raise ArgumentError(
                "model",
                f"{str(folder)!r} is an SDXL refiner (no text_encoder): it transforms images; use "
                "OnnxStableDiffusionXLImg2ImgPipeline from Python",
            )
        return OnnxStableDiffusionXLPipeline
    if "mid_block_additional_residual" in inputs:
        raise ArgumentError(
            "model",
            f"{str(folder)!r} is a ControlNet folder (its UNet takes the ControlNet's residuals): "
            "use OnnxStableDiffusionControlNetPipeline from Python with a control image",
        )
    if "timestep_cond" in inputs:
        return OnnxLatentConsistencyModelPipeline
    sample = inputs.get("sample")
    channels = (
        sample.type.tensor_type.shape.dim[1].dim_value
        if sample is not None and len(sample.type.tensor_type.shape.dim) > 1
        else 0
    )
    if channels == 9:
        raise ArgumentError(
            "model",
            f"{str(folder)!r} is an inpainting model (its UNet takes 9 channels): use "
            "OnnxStableDiffusionInpaintPipeline from Python with an image and a mask",
        )
    return OnnxStableDiffusionPipeline


def _transformer_pipeline_class(folder: Path, transformer_path: Path) -> type:
    graph = load_graph(str(transformer_path)).graph
    initializers = {init.name for init in graph.initializer}
    inputs = sorted(value.name for value in graph.input if value.name not in initializers)
    if "img_ids" in inputs:  # Flux takes rotary position ids
        return OnnxFluxPipeline
    if inputs == sorted(MMDIT_INPUTS):
        return OnnxStableDiffusion3Pipeline
    raise ArgumentError(
        "model",
        f"{str(folder)!r} has a transformer with inputs {inputs}, which no pipeline of this "
        f"version runs (Stable Diffusion 3's takes {list(MMDIT_INPUTS)}, FLUX.1's img_ids too)",
    )
