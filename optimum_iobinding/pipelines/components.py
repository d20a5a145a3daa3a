"""Loading a pipeline: its components from an ONNX folder (diffusers' or optimum's layout) with one set of resolved
options; and diffusers' own numpy ONNX pipeline, the baseline every comparison
runs against."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple, Union

from ..layout import download_from_hub, load_scheduler, load_tokenizer, read_model_index
from ..runtime.model import IOBindingORTModel
from ..runtime.options import PipelineOptions
from ..runtime.shapes import infer_output_shapes

# the ONNX components of a tiny VAE export (diffusers' AutoencoderTiny), which a stream may load from a folder of its own
TINY_VAE_COMPONENTS = ("vae_encoder", "vae_decoder")

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
                    tokenizer: Any = None, onnx_components: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """The components ``pipeline_class`` is made of, loaded from ``folder``: each ONNX component an
    :class:`IOBindingORTModel` with its options (one stream for all), the tokenizers and the scheduler (``scheduler``
    and ``tokenizer`` replace the folder's), and the model_index.json settings the class takes.
    ``onnx_components``: load only these ONNX components (default: all the class has in ``folder``); the caller
    provides the others (a stream's tiny VAE from another folder)."""
    if tokenizer is not None and not (callable(tokenizer) and hasattr(tokenizer, "model_max_length")):
        raise TypeError(f"tokenizer: expected a transformers tokenizer (callable, with a model_max_length), got "
                        f"{type(tokenizer).__name__} {tokenizer!r:.80}")
    if scheduler is not None and not all(hasattr(scheduler, name) for name in ("set_timesteps", "step")):
        raise TypeError(f"scheduler: expected a diffusers scheduler (with set_timesteps and step), got "
                        f"{type(scheduler).__name__} {scheduler!r:.80}")
    if onnx_components is None:
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


def tiny_vae_folder(tiny_vae: Union[str, os.PathLike], **hub_kwargs: Any) -> Path:
    """The folder of a tiny VAE export: local, or downloaded from the Hub (its two VAE folders only); it must hold
    ``vae_encoder/model.onnx`` and ``vae_decoder/model.onnx``."""
    path = Path(tiny_vae).expanduser()
    if path.is_dir():
        folder = path
    elif path.exists():
        raise NotADirectoryError(f"tiny_vae: expected a folder with vae_encoder/ and vae_decoder/, got the file "
                                 f"{str(path)!r}")
    else:
        folder = download_from_hub(os.fspath(tiny_vae), [f"{name}/*" for name in TINY_VAE_COMPONENTS], "tiny_vae",
                                   **hub_kwargs)
    missing = [f"{name}/model.onnx" for name in TINY_VAE_COMPONENTS if not (folder / name / "model.onnx").is_file()]
    if missing:
        raise FileNotFoundError(f"tiny_vae: expected an AutoencoderTiny export holding vae_encoder/model.onnx and "
                                f"vae_decoder/model.onnx, got {str(folder)!r} without {' and '.join(missing)}")
    return folder


def check_latent_channels(vae_encoder: IOBindingORTModel, vae_decoder: IOBindingORTModel, unet: IOBindingORTModel,
                          where: str) -> None:
    """Refuses a VAE whose latents have other channels than the UNet's samples, naming ``where`` it came from."""
    def declared(model: IOBindingORTModel, name: str) -> Optional[int]:
        dims = model.input_dims.get(name) or []
        return dims[1] if len(dims) > 1 and isinstance(dims[1], int) else None

    expected = declared(unet, "sample") or unet.config.get("in_channels")
    if expected is None:
        return
    found = {"vae_decoder": declared(vae_decoder, "latent_sample") or vae_decoder.config.get("latent_channels")}
    try:
        shapes = infer_output_shapes(vae_encoder, {"sample": (1, 3, 64, 64)})
    except ValueError:  # not inferable without running it: the decoder's channels have to do
        shapes = {}
    shape = shapes.get(vae_encoder.output_names[0])
    if shape is not None:
        halves = 2 if vae_encoder.output_names[0] == "latent_parameters" else 1  # (mean, logvar)
        found["vae_encoder"] = shape[1] // halves
    for name, channels in found.items():
        if channels is not None and channels != expected:
            raise ValueError(f"{where}: expected a VAE with {expected} latent channels (the UNet's sample channels), "
                             f"got {channels} in its {name}; use a tiny VAE trained for this model's latent space "
                             "(madebyollin/taesd for SD 1.x/2.x)")


def load_numpy_pipeline(folder: Union[str, os.PathLike], provider: str = "CUDAExecutionProvider", **kwargs: Any):
    """diffusers' ``OnnxStableDiffusionPipeline`` (the numpy loop every benchmark compares against, and the server's
    ``diffusers-numpy`` engine) on ``provider``, checked to run there."""
    from diffusers import OnnxStableDiffusionPipeline as DiffusersOnnx

    # provider_options={} or diffusers' loader trips ORT's length check and silently falls back to the CPU
    pipe = DiffusersOnnx.from_pretrained(folder, provider=provider, provider_options={}, **kwargs)
    if pipe.unet.model.get_providers()[0] != provider:
        raise RuntimeError(f"numpy pipeline: the UNet runs on {pipe.unet.model.get_providers()}, not {provider}")
    return pipe
