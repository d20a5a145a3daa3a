"""Loading a pipeline: its components from an ONNX folder (diffusers' or optimum's layout) with one set of resolved
options; and diffusers' own numpy ONNX pipeline, the baseline every comparison
runs against."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple, Union

from ..layout import load_scheduler, load_tokenizer, read_model_index
from ..runtime.model import IOBindingORTModel
from ..runtime.options import PipelineOptions

# What each ONNX component is, by the inputs a pipeline feeds it (the UNet's are checked by _check_unet_inputs):
# component name (or its prefix, for controlnet_1 …) → (what it is, its inputs).
COMPONENT_INPUTS: Dict[str, Tuple[str, Tuple[str, ...]]] = {
    "text_encoder": ("a text encoder", ("input_ids",)),
    "text_encoder_2": ("a text encoder", ("input_ids",)),
    "vae_decoder": ("a VAE decoder", ("latent_sample",)),
    "vae_encoder": ("a VAE encoder", ("sample",)),
    "controlnet": ("a ControlNet", ("sample", "timestep", "encoder_hidden_states", "controlnet_cond",
                                    "conditioning_scale")),
}


def component_kind(input_names: Sequence[str]) -> Optional[str]:
    """What an ONNX model looks like by its inputs (a text encoder, a UNet, a VAE decoder …), or ``None``."""
    names = set(input_names)
    if "controlnet_cond" in names:
        return "a ControlNet"
    if {"sample", "timestep", "encoder_hidden_states"} <= names:
        return "a UNet"
    for kind, inputs in COMPONENT_INPUTS.values():
        if names == set(inputs):
            return kind
    return None


def check_component_kind(name: str, model: Any) -> None:
    """Refuses an ONNX component of the wrong kind in ``name``'s folder (a VAE encoder where the decoder belongs, a
    UNet where the text encoder does), naming the folder, the inputs expected and what the model takes and gives."""
    if not isinstance(model, IOBindingORTModel):
        return
    if name == "unet":  # its exact inputs depend on the pipeline (_check_unet_inputs); here: is it a UNet at all
        spec = ("a UNet", ("sample", "timestep", "encoder_hidden_states"))
        if set(spec[1]) <= set(model.input_names) and "controlnet_cond" not in model.input_names:
            return
    else:
        spec = COMPONENT_INPUTS.get("controlnet" if name.startswith("controlnet") else name)
    if spec is None:
        return
    kind, expected = spec
    declared = model.input_names
    if sorted(declared) == sorted(expected):
        return
    found = component_kind(declared)
    looks = f"{found}, not {kind}" if found is not None and found != kind else "not a model the pipeline can feed"
    where = f"{model.model_path!r}" if model.model_path else "the model"
    raise ValueError(f"{name}: expected {kind} (inputs {list(expected)}{' and more' if name == 'unet' else ''}), got a "
                     f"model with inputs {declared} and "
                     f"outputs {model.output_names}: {where} is {looks}; put the right model.onnx in the {name} "
                     "folder")


def load_components(pipeline_class: type, folder: Path, options: PipelineOptions, scheduler: Any = None,
                    tokenizer: Any = None) -> Dict[str, Any]:
    """The components ``pipeline_class`` is made of, loaded from ``folder``: each ONNX component an
    :class:`IOBindingORTModel` with its options (one stream for all), the tokenizers and the scheduler (``scheduler``
    and ``tokenizer`` replace the folder's), and the model_index.json settings the class takes."""
    if tokenizer is not None and not (callable(tokenizer) and hasattr(tokenizer, "model_max_length")):
        raise TypeError(f"tokenizer: expected a transformers tokenizer (callable, with a model_max_length), got "
                        f"{type(tokenizer).__name__} {tokenizer!r:.80}")
    if scheduler is not None and not all(hasattr(scheduler, name) for name in ("set_timesteps", "step")):
        raise TypeError(f"scheduler: expected a diffusers scheduler (with set_timesteps and step), got "
                        f"{type(scheduler).__name__} {scheduler!r:.80}")
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
            check_component_kind(name, components[name])  # a wrong file fails here, before the next one loads
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
