"""Loading a pipeline: its components from an ONNX folder (diffusers' or optimum's layout) with one set of resolved
options; and diffusers' own numpy ONNX pipeline, the baseline every comparison
runs against."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Union

from ..layout import load_scheduler, load_tokenizer, read_model_index
from ..runtime.model import IOBindingORTModel
from ..runtime.options import PipelineOptions


def load_components(pipeline_class: type, folder: Path, options: PipelineOptions, scheduler: Any = None,
                    tokenizer: Any = None) -> Dict[str, Any]:
    """The components ``pipeline_class`` is made of, loaded from ``folder``: each ONNX component an
    :class:`IOBindingORTModel` with its options (one stream for all), the tokenizers and the scheduler (``scheduler``
    and ``tokenizer`` replace the folder's), and the model_index.json settings the class takes."""
    onnx_components = pipeline_class._components_in(folder)
    index = read_model_index(folder, onnx_components)
    components: Dict[str, Any] = {}
    try:
        for name in onnx_components:
            model_folder = folder / name
            if not (model_folder / "model.onnx").is_file():
                if name in pipeline_class._optional_components:
                    components[name] = None
                    continue
                raise FileNotFoundError(
                    f"pretrained_model_name_or_path: component {name!r} is missing: expected "
                    f"{model_folder / 'model.onnx'}"
                )
            components[name] = IOBindingORTModel.from_pretrained(model_folder, options=options.for_component(name))
        for name in pipeline_class._tokenizer_names:
            if name == "tokenizer" and tokenizer is not None:
                components[name] = tokenizer
            elif (folder / name).is_dir() or name not in pipeline_class._optional_components:
                components[name] = load_tokenizer(folder, index, name)
            else:
                components[name] = None
        components["scheduler"] = scheduler if scheduler is not None else load_scheduler(folder, index)
        components.update({key: index[key] for key in pipeline_class._index_settings if key in index})
        return components
    except BaseException:
        components.clear()  # release sessions now, not when the traceback goes
        raise


def load_numpy_pipeline(folder: Union[str, os.PathLike], provider: str = "CUDAExecutionProvider", **kwargs: Any):
    """diffusers' ``OnnxStableDiffusionPipeline`` (the numpy loop every benchmark compares against, and the server's
    ``diffusers-numpy`` engine) on ``provider``, checked to run there."""
    from diffusers import OnnxStableDiffusionPipeline as DiffusersOnnx

    # provider_options={} or diffusers' loader trips ORT's length check and silently falls back to the CPU
    pipe = DiffusersOnnx.from_pretrained(folder, provider=provider, provider_options={}, **kwargs)
    if pipe.unet.model.get_providers()[0] != provider:
        raise RuntimeError(f"numpy pipeline: the UNet runs on {pipe.unet.model.get_providers()}, not {provider}")
    return pipe
