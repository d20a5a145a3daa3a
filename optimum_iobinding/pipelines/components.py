"""What a family is made of and how it loads: each family declares its components once (:class:`Component`: name,
kind, optional), from which the core loads them from an ONNX folder (diffusers' or optimum's layout) with one set of
resolved options, checks that each model is of its kind, and writes them back; and diffusers' own numpy ONNX
pipeline, the baseline every comparison runs against."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple, Union

from ..families import family
from ..errors import ArgumentError, ArgumentPathError, ArgumentTypeError
from ..layout import (
    CONTROLNET_CONDITION,
    CONTROLNET_SCALE,
    DEEP_CACHE_FULL_PART,
    FIRST_BLOCK_CACHE_PARTS,
    check_tiny_vae_class,
    download_from_hub,
    load_image_processor,
    load_scheduler,
    load_tokenizer,
    read_model_index,
)
from ..runtime.model import IOBindingORTModel
from ..runtime.options import ModelOptions, PipelineOptions
from ..runtime.shapes import infer_output_shapes


@dataclass(frozen=True)
class Component:
    """One component of a family: its ``name`` (the folder and the pipeline attribute), its ``kind`` (``"onnx"``: an
    ONNX model, an :class:`IOBindingORTModel`; ``"tokenizer"``; ``"processor"``: a transformers image processor, Wan
    2.1 I2V's; ``"module"``: accepted and kept, never loaded, as a diffusers folder's safety checker) and whether the family runs without it (``optional``). A tokenizer's
    ``fixed_length``: its ``model_max_length`` is the length its text encoder is fed (CLIP's 77), checked when it
    loads; ``False`` where each call gives the length (T5's ``max_sequence_length``), so that the tokenizer may name
    none (transformers then reports 1e30), as diffusers runs it."""

    name: str
    kind: str = "onnx"
    optional: bool = False
    fixed_length: bool = True


def onnx(name: str, optional: bool = False) -> Component:
    return Component(name, "onnx", optional)


def tokenizer(name: str, optional: bool = False, fixed_length: bool = True) -> Component:
    return Component(name, "tokenizer", optional, fixed_length)


def processor(name: str, optional: bool = False) -> Component:
    return Component(name, "processor", optional)


def module(name: str) -> Component:
    return Component(name, "module", optional=True)


# the VAE every family declares: its decoder, and its encoder where the folder has one (image to image needs it)
VAE_COMPONENTS = (onnx("vae_encoder", optional=True), onnx("vae_decoder"))


def names_of(components: Sequence[Component], kind: Optional[str] = None) -> Tuple[str, ...]:
    """The names of ``components`` (of ``kind`` only, where given), in declaration order."""
    return tuple(c.name for c in components if kind is None or c.kind == kind)


def declared_dim(model: Optional[IOBindingORTModel], input_name: str, axis: int) -> Optional[int]:
    """The static size of ``axis`` of ``model``'s input ``input_name``, or ``None`` (dynamic, or no such input)."""
    dims = model.input_dims.get(input_name) if model is not None else None
    if dims is not None and len(dims) > axis and isinstance(dims[axis], int):
        return dims[axis]
    return None


# the ONNX components of a tiny VAE export (diffusers' AutoencoderTiny), which a stream may load from a folder of its own
TINY_VAE_COMPONENTS = ("vae_encoder", "vae_decoder")

# What each ONNX component is, by the inputs a pipeline feeds it (the denoiser's own part checks its exact inputs):
# component name (or its prefix, for controlnet_1 …) → (what it is, its inputs).
COMPONENT_INPUTS: Dict[str, Tuple[str, Tuple[str, ...]]] = {
    "text_encoder": ("a text encoder", ("input_ids",)),
    "text_encoder_2": ("a text encoder", ("input_ids",)),
    "vae_decoder": ("a VAE decoder", ("latent_sample",)),
    "vae_encoder": ("a VAE encoder", ("sample",)),
    # the inputs every family's ControlNet takes (each family's own check names the rest: Stable Diffusion's,
    # SDXL's and FLUX.1's differ)
    "controlnet": ("a ControlNet", (CONTROLNET_CONDITION, CONTROLNET_SCALE)),
}


# Inputs a component may take beside COMPONENT_INPUTS' (Wan's UMT5 encoder takes the prompt's attention mask).
OPTIONAL_COMPONENT_INPUTS: Dict[str, Tuple[str, ...]] = {"text_encoder": ("attention_mask",)}


def component_kind(input_names: Sequence[str]) -> Optional[str]:
    """What an ONNX model looks like by its inputs (a text encoder, a UNet, a VAE decoder …), or ``None``."""
    names = set(input_names) - {name for optional in OPTIONAL_COMPONENT_INPUTS.values() for name in optional}
    if CONTROLNET_CONDITION in names:
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
    # a UNet's and a ControlNet's exact inputs depend on the family (its parts check them); here: is it one at all
    more = name == "unet" or name.startswith("controlnet")
    if name == "unet":
        spec = ("a UNet", ("sample", "timestep", "encoder_hidden_states"))
        if set(spec[1]) <= set(model.input_names) and CONTROLNET_CONDITION not in model.input_names:
            return
    elif name.startswith("controlnet"):
        spec = COMPONENT_INPUTS["controlnet"]
        if set(spec[1]) <= set(model.input_names):
            return
    else:
        spec = COMPONENT_INPUTS.get(name)
    if spec is None:
        return
    kind, expected = spec
    declared = model.input_names
    optional = OPTIONAL_COMPONENT_INPUTS.get(name, ())
    if sorted(input for input in declared if input not in optional) == sorted(expected):
        return
    found = component_kind(declared)
    looks = f"{found}, not {kind}" if found is not None and found != kind else "not a model the pipeline can feed"
    where = f"{model.model_path!r}" if model.model_path else "the model"
    raise ArgumentError(
        name,
        f"expected {kind} (inputs {list(expected)}{' and more' if more else ''}), got a "
        f"model with inputs {declared} and "
        f"outputs {model.output_names}: {where} is {looks}; put the right model.onnx in the {name} "
        "folder",
    )


def check_replacement(name: str, value: Any) -> None:
    """A component given to ``from_pretrained`` in place of the folder's: a tokenizer must be a transformers tokenizer,
    the scheduler a diffusers scheduler; refused by name otherwise, before anything loads."""
    if name == "scheduler":
        if not all(hasattr(value, method) for method in ("set_timesteps", "step")):
            raise ArgumentTypeError(
                "scheduler",
                f"expected a diffusers scheduler (with set_timesteps and step), got "
                f"{type(value).__name__} {value!r:.80}",
            )
    elif not (callable(value) and hasattr(value, "model_max_length")):
        raise ArgumentTypeError(
            name,
            f"expected a transformers tokenizer (callable, with a model_max_length), got "
            f"{type(value).__name__} {value!r:.80}",
        )


def load_components(
    folder: Path,
    model_folders: Dict[str, Path],
    declared: Sequence[Component],
    options: PipelineOptions,
    must_capture: str,
    replacements: Dict[str, Any],
    settings: Sequence[str] = (),
    missing_hint: str = "",
    prepare: Sequence[str] = (),
) -> Dict[str, Any]:
    """The components of a family, loaded: each ONNX component from its folder in ``model_folders`` as an
    :class:`IOBindingORTModel` with its options (one stream for all; ``must_capture``: the component whose graphs
    ``cuda_graph=True`` requires), the tokenizers and the scheduler from ``folder`` unless ``replacements`` gives them,
    and the model_index.json ``settings`` the family takes. Every required model file is looked for before any loads
    (the denoiser's first: its absence says the folder is of another family, ``missing_hint``); the denoiser loads
    first too (its session is the first image's longest wait; a wrong file among the others is then found after it
    loaded). A failure releases what was loaded. The components named in ``prepare`` start building their
    shape-free session in a background thread as soon as they are loaded (:meth:`IOBindingORTModel.prepare`), beside
    the rest of the load."""
    optional = {component.name for component in declared if component.optional}
    order = sorted(model_folders, key=lambda name: name != must_capture)
    for name in order:
        path = model_folders[name] / "model.onnx"
        if name not in optional and not path.is_file():
            raise ArgumentPathError(
                "pretrained_model_name_or_path",
                f"component {name!r} is missing: expected {path}{missing_hint if name == must_capture else ''}",
            )
    index = read_model_index(folder, tuple(model_folders))
    components: Dict[str, Any] = {}
    try:
        for name in order:  # the denoiser's first: its session and first run are the first image's longest wait
            model_folder = model_folders[name]
            if not (model_folder / "model.onnx").is_file():
                components[name] = None
                continue
            model_options = options.for_component(name, must_capture=name == must_capture)
            if name == must_capture:
                model_options = with_step_cache_weights(model_options, model_folder)
            components[name] = IOBindingORTModel.from_pretrained(model_folder, options=model_options)
            check_component_kind(name, components[name])  # a wrong file fails here, before the next one loads
            if name in prepare:
                components[name].prepare(wait=False)
        for component in declared:
            name = component.name
            if component.kind == "processor":
                present = (folder / name).is_dir()
                components[name] = (
                    load_image_processor(folder, index, name) if present or not component.optional else None
                )
            if component.kind != "tokenizer":
                continue
            if name in replacements:
                components[name] = replacements[name]
            elif (folder / name).is_dir() or not component.optional:
                components[name] = load_tokenizer(folder, index, name, component.fixed_length)
            else:
                components[name] = None
        components["scheduler"] = replacements.get("scheduler") or load_scheduler(folder, index)
        components.update({key: index[key] for key in settings if key in index})
        return components
    except BaseException:
        components.clear()  # release sessions now, not when the traceback goes
        raise


def with_step_cache_weights(model_options: ModelOptions, model_folder: Path) -> ModelOptions:
    """A denoiser's options where its folder holds a step cache's parts (DeepCache's, First-Block Cache's): on a
    CUDA-like provider with the weights' sharing left to the default, the weights are owned from the load on. The
    parts read the denoiser's weights as owned tensors; owned only when a cache is first enabled, the one graph
    session (which loaded its weights itself) would be made again with its graphs, and the uncached loop after
    ``disable_cache()`` would run in another session than before (other convolution algorithms: another speed, another
    image). Owned from the start, the session and its graphs stay the same through enabling and disabling a cache."""
    parts = (DEEP_CACHE_FULL_PART, *FIRST_BLOCK_CACHE_PARTS)
    if model_options.share_weights is None and model_options.cuda_like:
        if any((model_folder / part).is_file() for part in parts):
            return model_options.replace(share_weights=True)
    return model_options


def tiny_vae_folder(tiny_vae: Union[str, os.PathLike], **hub_kwargs: Any) -> Path:
    """The folder of a tiny VAE export: local, or downloaded from the Hub (its two VAE folders only); it must hold
    ``vae_encoder/model.onnx`` and ``vae_decoder/model.onnx``."""
    path = Path(tiny_vae).expanduser()
    if path.is_dir():
        folder = path
    elif path.exists():
        raise NotADirectoryError(
            f"tiny_vae: expected a folder with vae_encoder/ and vae_decoder/, got the file {str(path)!r}"
        )
    else:
        folder = download_from_hub(
            os.fspath(tiny_vae), [f"{name}/*" for name in TINY_VAE_COMPONENTS], "tiny_vae", **hub_kwargs
        )
    missing = [f"{name}/model.onnx" for name in TINY_VAE_COMPONENTS if not (folder / name / "model.onnx").is_file()]
    if missing:
        raise ArgumentPathError(
            "tiny_vae",
            f"expected an AutoencoderTiny export holding vae_encoder/model.onnx and "
            f"vae_decoder/model.onnx, got {str(folder)!r} without {' and '.join(missing)}",
        )
    check_tiny_vae_class(folder, "tiny_vae", os.fspath(tiny_vae))
    return folder


def check_latent_channels(
    vae_encoder: IOBindingORTModel, vae_decoder: IOBindingORTModel, unet: IOBindingORTModel, where: str
) -> None:
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
            raise ArgumentError(
                where,
                f"expected a VAE with {expected} latent channels (the UNet's sample channels), "
                f"got {channels} in its {name}; use a tiny VAE trained for this model's latent space "
                "(madebyollin/taesd for SD 1.x/2.x)",
            )


def load_numpy_pipeline(folder: Union[str, os.PathLike], provider: str = "CUDAExecutionProvider", **kwargs: Any):
    """diffusers' numpy ONNX pipeline of Stable Diffusion (the numpy loop every benchmark compares against, and the
    server's ``diffusers-numpy`` engine) on ``provider``, checked to run there."""
    import diffusers

    DiffusersOnnx = getattr(diffusers, family("sd").numpy_class)

    # provider_options={} or diffusers' loader trips ORT's length check and silently falls back to the CPU
    pipe = DiffusersOnnx.from_pretrained(folder, provider=provider, provider_options={}, **kwargs)
    if pipe.unet.model.get_providers()[0] != provider:
        raise RuntimeError(f"numpy pipeline: the UNet runs on {pipe.unet.model.get_providers()}, not {provider}")
    return pipe
