"""Which pipeline an ONNX folder needs, as diffusers' ``AutoPipelineForText2Image`` picks one (what ``generate`` and
the server use): the family descriptions decide (:func:`optimum_iobinding.families.detect`), by the folder's
model_index.json class name first and its denoiser's ONNX inputs as a fallback."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

from ..errors import ArgumentError, ArgumentPathError
from ..families import FAMILIES, detect, pipeline_class
from ..layout import read_json_object, read_model_index, resolve_pipeline_folder
from ..runtime.hub import load_declared_graph
from .components import names_of


def resolve_model_folder(model: Union[str, os.PathLike], **hub_kwargs) -> Path:
    """A pipeline folder for :func:`pipeline_class_for`: ``model`` itself where it is a local folder, else the Hub
    repository ``model`` downloaded with the files any text-to-image family reads (its ONNX components, tokenizers,
    scheduler and model_index.json)."""
    classes = [pipeline_class(record) for record in FAMILIES if record.text_to_image]
    components = dict.fromkeys(name for cls in classes for name in names_of(cls.declared_components, "onnx"))
    tokenizers = dict.fromkeys(name for cls in classes for name in names_of(cls.declared_components, "tokenizer"))
    return resolve_pipeline_folder(model, tuple(components), tuple(tokenizers), **hub_kwargs)


# where each denoiser's channels are: a UNet's sample channels, a FLUX.1 transformer's token width (what tells FLUX.1
# Fill and Control apart from FLUX.1), and the config.json key that says it where the ONNX dim is dynamic
CHANNELS = {"unet": ("sample", 1, "in_channels"), "transformer": ("hidden_states", 2, "in_channels")}


def denoiser_inputs(folder: Path) -> Tuple[Dict[str, List[str]], Dict[str, Optional[int]]]:
    """The inputs of each denoiser the folder holds (``unet``, ``transformer``), and each one's channels (see
    :data:`CHANNELS`; ``None``: unknown)."""
    inputs: Dict[str, List[str]] = {}
    channels: Dict[str, Optional[int]] = {}
    for component in dict.fromkeys(record.denoiser for record in FAMILIES):
        path = folder / component / "model.onnx"
        if not path.is_file():
            continue
        graph = load_declared_graph(str(path)).graph
        initializers = {init.name for init in graph.initializer}
        values = {value.name: value for value in graph.input if value.name not in initializers}
        inputs[component] = sorted(values)
        name, axis, config_key = CHANNELS[component]
        sample = values.get(name)
        dims = sample.type.tensor_type.shape.dim if sample is not None else ()
        channels[component] = dims[axis].dim_value if len(dims) > axis and dims[axis].dim_value else None
        if channels[component] is None:
            configured = (read_json_object(folder / component / "config.json") or {}).get(config_key)
            channels[component] = configured if isinstance(configured, int) else None
    return inputs, channels


def pipeline_class_for(folder: Union[str, os.PathLike], text_to_image: bool = True) -> type:
    """The text-to-image pipeline class for an ONNX folder, as diffusers' ``AutoPipelineForText2Image`` picks one:
    the family that the folder's model_index.json names (``_class_name``), or where it names none of ours the first
    whose denoiser interface the folder's denoiser has (:func:`~optimum_iobinding.families.detect`). A folder that
    no text-to-image pipeline runs (an inpainting UNet, an SDXL refiner, a ControlNet's UNet) is an error saying which
    pipeline to use; with ``text_to_image=False`` its own pipeline class, which takes images."""
    folder = Path(folder)
    index = read_model_index(folder, ())  # a pipeline folder: its model_index.json is there and parses
    inputs, channels = denoiser_inputs(folder)
    if not inputs:
        raise ArgumentPathError(
            "model",
            f"expected {str(folder / 'unet' / 'model.onnx')!r} or {str(folder / 'transformer' / 'model.onnx')!r} "
            "(an ONNX diffusion folder), found neither",
        )
    folders = [entry.name for entry in folder.iterdir() if entry.is_dir()]
    record = detect(index.get("_class_name"), inputs, channels, folders)
    if record is None:
        described = "; ".join(f"its {component} takes {names}" for component, names in inputs.items())
        raise ArgumentError(
            "model", f"{str(folder)!r}: {described}, which no pipeline of this version runs (see the README's families)"
        )
    if text_to_image and not record.text_to_image:
        raise ArgumentError("model", f"{str(folder)!r} is {record.use_hint()}")
    return pipeline_class(record)
