"""Every pipeline family described once: what the pipelines, auto-detection, the export, the tiny models, the command
line, the benchmarks, the server and the contract tests ask of a family, as one small declarative record each
(:class:`Family`), in one table (:data:`FAMILIES`). The standard library only: the command line and the server read it
before anything heavy is imported.

A family record says which class runs it (module and name, imported on first use by :func:`pipeline_class`), the
model_index.json class names that select it (:func:`detect`, then its denoiser's ONNX interface as a fallback, so
that two families with one interface are told apart by the folder's class name), its denoiser's interface, which
exporter writes it, its sibling for image to image, the image inputs a call takes, its capabilities and its
defaults. A new family is a record here, a class with its ``__call__``, its export and its tests."""

from __future__ import annotations

import importlib
import numbers
from dataclasses import dataclass, field, replace
from typing import AbstractSet, Dict, FrozenSet, Mapping, Optional, Sequence, Tuple, Union

from .errors import ArgumentError
from .layout import (
    DIFFUSERS_ONNX_CLASS_NAME,
    DOWN_RESIDUAL_INPUT,
    FLUX_CONTROLNET_BLOCK_SAMPLE,
    FLUX_CONTROLNET_SINGLE_BLOCK_SAMPLE,
    IP_ADAPTER_KEY_INPUT,
    IP_ADAPTER_VALUE_INPUT,
    MID_RESIDUAL_INPUT,
)

__all__ = [
    "Defaults",
    "DenoiserInterface",
    "Family",
    "FAMILIES",
    "family",
    "family_of_class",
    "torch_class_family",
    "pipeline_class",
    "public_pipeline_names",
    "transformer_family",
    "controlnet_family",
    "t5_tokenizer_of",
    "tiny_random_kinds",
    "detect",
    "IMAGE_ROLES",
    "image_role",
    "image_route",
    "UNET_INPUTS",
    "SDXL_INPUTS",
    "SDXL_TEXT_EMBEDS",
    "SDXL_TIME_IDS",
    "MMDIT_INPUTS",
    "FLUX_INPUTS",
    "FLUX_TEXT_IDS",
    "FLUX_IMAGE_IDS",
    "FLUX_GUIDANCE",
    "WAN_INPUTS",
    "WAN_TEXT_INPUTS",
    "WAN_TRANSFORMERS",
    "WAN_IMAGE_INPUT",
    "WAN_IMAGE_EMBEDS",
    "WAN_I2V_CHANNELS",
    "WAN_TEXT_CONTEXT",
    "WAN_SETTINGS",
    "WAN_IMAGE_PIXELS",
]

# the denoisers' ONNX inputs (the export writes them, the pipelines feed them)
UNET_INPUTS = ("sample", "timestep", "encoder_hidden_states")
# SDXL's UNet also takes the pooled text embeddings and the size and crop conditioning
SDXL_TEXT_EMBEDS, SDXL_TIME_IDS = "text_embeds", "time_ids"
SDXL_INPUTS = (*UNET_INPUTS, SDXL_TEXT_EMBEDS, SDXL_TIME_IDS)
MMDIT_INPUTS = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep")
# FLUX.1's rotary position ids of the text tokens and of the packed latent tokens, and FLUX.1 dev's distilled guidance
FLUX_TEXT_IDS, FLUX_IMAGE_IDS, FLUX_GUIDANCE = "txt_ids", "img_ids", "guidance"
FLUX_INPUTS = (*MMDIT_INPUTS, FLUX_TEXT_IDS, FLUX_IMAGE_IDS)
# the token width (hidden_states' last dim) of the FLUX.1 transformers that take more than the packed latents (16
# latent channels × 2 × 2): Fill's adds the masked image's packed latents (64) and the packed mask (8 × 8 × 2 × 2 =
# 256), Control's (Canny, Depth) the control image's packed latents (64)
FLUX_FILL_TOKEN_WIDTH, FLUX_CONTROL_TOKEN_WIDTH = 384, 128
# Wan's transformer (latent videos (batch, channels, frames, height, width), the UMT5 states, the timestep: one per row,
# or one per row and latent token for Wan 2.2 TI2V), its UMT5 encoder's inputs (the padding masked out, as diffusers
# calls it), and its denoisers: Wan 2.2's second transformer is the low-noise expert
WAN_INPUTS = ("hidden_states", "encoder_hidden_states", "timestep")
WAN_TEXT_INPUTS = ("input_ids", "attention_mask")
WAN_TRANSFORMERS = ("transformer", "transformer_2")
# Wan's image to video: Wan 2.1's transformer also takes the CLIP image encoder's penultimate states (the encoder's
# output, diffusers' image_embeds); its latents go in beside the first frame's mask (4 channels, a latent frame's video
# frames) and latents (16): 36 channels
WAN_IMAGE_INPUT, WAN_IMAGE_EMBEDS = "encoder_hidden_states_image", "image_embeds"
WAN_I2V_CHANNELS = 36
# the CLIP image encoder's input (the image processor's pixel_values)
WAN_IMAGE_PIXELS = "pixel_values"
# UMT5's context in Wan: 512 tokens; diffusers' Wan attention takes the last 512 tokens of its context as the text's,
# the image's before them (WanAttnProcessor: "512 is the context length of the text encoder, hardcoded for now")
WAN_TEXT_CONTEXT = 512
# the settings a Wan folder's model_index.json keeps (diffusers' WanPipeline config), with their defaults
WAN_SETTINGS = {"boundary_ratio": None, "expand_timesteps": False}


@dataclass(frozen=True)
class DenoiserInterface:
    """A denoiser's ONNX interface as detection reads it: the ``component`` folder it lives in (``"unet"`` or
    ``"transformer"``), the ``inputs`` it must take, the ``optional`` ones it may take (FLUX.1 dev's ``guidance``),
    the ``prefixed`` inputs it takes any number of, at least one (a ControlNet's residuals), the
    ``optional_prefixed`` ones it may take any number of (IP-Adapter's image-prompt keys and values), and the
    ``sample_channels`` it must
    have (``None``: any) or must not have (``refused_channels``): a UNet's ``sample`` channels, a FLUX.1
    transformer's token width (the last dim of its ``hidden_states``)."""

    component: str
    inputs: Tuple[str, ...]
    optional: Tuple[str, ...] = ()
    prefixed: Tuple[str, ...] = ()
    optional_prefixed: Tuple[str, ...] = ()
    sample_channels: Optional[int] = None
    refused_channels: Tuple[int, ...] = ()

    def matches(self, inputs: Sequence[str], channels: Optional[int] = None) -> bool:
        """Whether a denoiser taking ``inputs`` (with ``channels`` sample channels, ``None``: unknown) is this one."""
        names = set(inputs)
        extra = {
            name
            for name in names - set(self.inputs) - set(self.optional)
            if not name.startswith(self.prefixed + self.optional_prefixed)
        }
        if self.prefixed and not any(name.startswith(self.prefixed) for name in names):
            return False
        if not set(self.inputs) <= names or extra:
            return False
        if self.sample_channels is not None and channels != self.sample_channels:
            return False
        return channels is None or channels not in self.refused_channels


@dataclass(frozen=True)
class Defaults:
    """A family's ``__call__`` defaults: steps, guidance scale, and image size in pixels (``None``: the denoiser's
    sample size × the VAE's scale factor, as diffusers' SDXL, SD3 and FLUX.1 pipelines choose)."""

    steps: int
    guidance_scale: float
    size: Optional[int] = None


@dataclass(frozen=True)
class Family:
    """One pipeline family (see the module's docstring).

    Attributes:
        key: its short name (the command line's and the benchmarks').
        class_name, module: the pipeline class that runs it and the module defining it.
        title: how a message names it.
        interface: its denoiser's ONNX interface (detection's fallback).
        index_class_names: model_index.json ``_class_name`` values that select it (ours, diffusers', optimum's).
        index_class_name: the ``_class_name`` its own saved folders and exports write.
        auto: whether :func:`detect` may pick it (an image-to-image sibling shares its family's folder).
        text_to_image: whether a prompt alone runs it (``generate``); otherwise ``hint`` says what to use instead.
        image_inputs: the image arguments a call takes, by their names in its ``__call__`` (``image``, ``mask_image``,
            ``control_image``; the ControlNet pipeline's control image is diffusers' ``image``; a stream's ``frame``).
        control_image: which of :attr:`image_inputs` is the control image (a ControlNet's ``image``, FLUX.1
            Control's and ControlNet image to image's ``control_image``), if any; the others are images it starts
            from or edits.
        sized_by_image: whether its output has its image's size (diffusers' image to image: no ``height`` and
            ``width`` arguments).
        strength: whether a call takes ``strength`` (how much of the schedule runs from its image).
        image_to_image: the key of its image-to-image sibling on the same components, if any.
        inpainting: the key of its inpainting sibling on the same components (which keeps the unmasked area of a
            plain denoiser by blending), if any.
        export: the exporter that writes its folder (``"unet"``, ``"sd3"``, ``"flux"``, ``"wan"``; ``None``: none).
        torch_classes: diffusers' torch pipeline classes the exporter takes for it.
        tiny_random: the tiny random models (``export --tiny-random KIND``) of its shapes.
        numpy_class: diffusers' numpy ONNX pipeline of the family (the baseline the benchmarks compare with).
        step_cache: the step cache it runs (``"deepcache"``, ``"first-block"``, ``None``).
        lora: diffusers' LoRA loader mixin whose formats it reads at run time (``lora_state_dict``: diffusers', PEFT's,
            kohya's and the others its converters take), by class name; ``None``: no runtime LoRA.
        scheduler_choice: whether a call may swap its scheduler for another of diffusers' (``generate --scheduler``).
        negative_prompt: whether a call takes a negative prompt.
        negative_prompt_needs: the call argument without which a negative prompt does nothing (FLUX.1's true
            classifier-free guidance: ``"true_cfg_scale > 1"``), if any.
        callback_tensors: the loop's tensors a step-end callback may ask for and replace.
        frames: its calls make videos (diffusers' ``frames``: frames of each video): ``generate`` writes them as a
            video, the server, answering images, refuses the folder.
        defaults: its ``__call__`` defaults.
        hint: what to use, where :attr:`text_to_image` is false or its folder holds another family.
        options: what only some families have: ``needs_folder`` (a component folder detection requires: SDXL's
            first text encoder, which a refiner lacks), ``transformer_class`` (diffusers' class of its transformer),
            ``t5_tokenizer`` and ``t5_encoder`` (its T5 components), ``size_by_area`` (its ``height`` and ``width``
            give the aspect ratio, ``max_area`` the pixels: FLUX.1 Kontext's), ``controlnet_of`` (the key of the
            family whose pipelines the export adds ControlNets to for it: ``export MODEL --controlnet ID``),
            ``control_mode`` (its calls take a union ControlNet's ``control_mode``).
    """

    key: str
    class_name: str
    module: str
    title: str
    interface: DenoiserInterface
    defaults: Defaults
    index_class_names: Tuple[str, ...] = ()
    index_class_name: Optional[str] = None
    auto: bool = True
    text_to_image: bool = True
    image_inputs: FrozenSet[str] = frozenset()
    control_image: Optional[str] = None
    sized_by_image: bool = False
    strength: bool = False
    image_to_image: Optional[str] = None
    inpainting: Optional[str] = None
    export: Optional[str] = None
    torch_classes: Tuple[str, ...] = ()
    tiny_random: Tuple[str, ...] = ()
    numpy_class: Optional[str] = None
    step_cache: Optional[str] = None
    lora: Optional[str] = None
    scheduler_choice: bool = True
    negative_prompt: bool = True
    negative_prompt_needs: Optional[str] = None
    callback_tensors: Tuple[str, ...] = ("latents", "prompt_embeds")
    frames: bool = False
    hint: str = ""
    options: Mapping[str, object] = field(default_factory=dict)

    @property
    def denoiser(self) -> str:
        """The component its loop calls at every step (``"unet"`` or ``"transformer"``)."""
        return self.interface.component

    def rows_per_image(self, guidance_scale: object) -> int:
        """The denoiser's rows for each image of a call at ``guidance_scale``: 2 where the family guides by
        classifier-free guidance (a negative prompt's row beside the prompt's) and the scale is above 1, else 1."""
        guided = self.negative_prompt and self.negative_prompt_needs is None
        number = isinstance(guidance_scale, numbers.Real) and not isinstance(guidance_scale, bool)
        return 2 if guided and number and guidance_scale > 1 else 1

    def use_hint(self) -> str:
        """``"use OnnxX from Python with …"``: what runs a folder of this family."""
        return self.hint or f"use {self.class_name}"

    def images_only_refusal(self) -> Optional[str]:
        """What a surface that returns images only (the server) says of a folder of this family, after its argument's
        name: ``None`` where the family's calls make images."""
        if not self.frames:
            return None
        return (
            f"expected a folder of a family that makes images, got a {self.title} folder, whose calls make videos: "
            f"{self.use_hint()} from Python"
        )


_SD_MODULE = "optimum_iobinding.pipelines"
# a UNet exported for IP-Adapter also takes each cross-attention layer's image-prompt keys and values
IMAGE_PROMPT_INPUTS = (IP_ADAPTER_KEY_INPUT, IP_ADAPTER_VALUE_INPUT)
_UNET = DenoiserInterface("unet", UNET_INPUTS, optional_prefixed=IMAGE_PROMPT_INPUTS, refused_channels=(9,))
_SD_DEFAULTS = Defaults(steps=50, guidance_scale=7.5, size=512)
_SD_INDEX = (DIFFUSERS_ONNX_CLASS_NAME, "StableDiffusionPipeline", "ORTStableDiffusionPipeline")
_SD_LORA = "StableDiffusionLoraLoaderMixin"
_SD_COMMON = dict(index_class_name=DIFFUSERS_ONNX_CLASS_NAME, export="unet", lora=_SD_LORA)
# FLUX.1's transformer (text to image and Kontext: 64 values per token); the widths of Fill's and Control's are theirs
_FLUX = DenoiserInterface(
    "transformer",
    FLUX_INPUTS,
    optional=(FLUX_GUIDANCE,),
    refused_channels=(FLUX_FILL_TOKEN_WIDTH, FLUX_CONTROL_TOKEN_WIDTH),
)
_FLUX_OPTIONS = {
    "transformer_class": "FluxTransformer2DModel",
    "t5_tokenizer": "tokenizer_2",
    "t5_encoder": "text_encoder_2",
}
# what FLUX.1's image-conditioned variants share with it: the export, First-Block Cache, LoRA, the scheduler
_FLUX_VARIANT = dict(
    export="flux", step_cache="first-block", lora="FluxLoraLoaderMixin", scheduler_choice=False, options=_FLUX_OPTIONS
)

# In detection order: where a folder's model_index.json names no family, the first whose interface matches wins, so a
# stricter interface comes before a looser one.
FAMILIES: Tuple[Family, ...] = (
    Family(
        "sdxl",
        "OnnxStableDiffusionXLPipeline",
        f"{_SD_MODULE}.stable_diffusion_xl",
        "SDXL",
        DenoiserInterface("unet", SDXL_INPUTS, optional_prefixed=IMAGE_PROMPT_INPUTS),
        Defaults(steps=50, guidance_scale=5.0),
        index_class_names=(
            "StableDiffusionXLPipeline",
            "ORTStableDiffusionXLPipeline",
            "StableDiffusionXLImg2ImgPipeline",
            "ORTStableDiffusionXLImg2ImgPipeline",
        ),
        index_class_name="StableDiffusionXLPipeline",
        image_to_image="sdxl-img2img",
        export="unet",
        torch_classes=("StableDiffusionXLPipeline", "StableDiffusionXLImg2ImgPipeline"),
        tiny_random=("xl",),
        step_cache="deepcache",
        lora="StableDiffusionXLLoraLoaderMixin",
        options={"needs_folder": "text_encoder"},
    ),
    Family(
        "sdxl-img2img",
        "OnnxStableDiffusionXLImg2ImgPipeline",
        f"{_SD_MODULE}.stable_diffusion_xl",
        "SDXL image to image (the refiner too)",
        DenoiserInterface("unet", SDXL_INPUTS, optional_prefixed=IMAGE_PROMPT_INPUTS),
        Defaults(steps=50, guidance_scale=5.0),
        index_class_name="StableDiffusionXLImg2ImgPipeline",
        text_to_image=False,
        image_inputs=frozenset({"image"}),
        sized_by_image=True,
        strength=True,
        export="unet",
        step_cache="deepcache",
        lora="StableDiffusionXLLoraLoaderMixin",
        hint="an SDXL refiner or image-to-image folder (no text_encoder): it transforms images; use "
        "OnnxStableDiffusionXLImg2ImgPipeline from Python",
    ),
    Family(
        "controlnet",
        "OnnxStableDiffusionControlNetPipeline",
        f"{_SD_MODULE}.controlnet",
        "Stable Diffusion with ControlNet",
        DenoiserInterface(
            "unet",
            UNET_INPUTS,
            prefixed=(DOWN_RESIDUAL_INPUT, MID_RESIDUAL_INPUT),
            optional_prefixed=IMAGE_PROMPT_INPUTS,
        ),
        _SD_DEFAULTS,
        index_class_names=("OnnxStableDiffusionControlNetPipeline",),
        index_class_name="OnnxStableDiffusionControlNetPipeline",
        text_to_image=False,
        image_inputs=frozenset({"image"}),
        control_image="image",
        image_to_image="controlnet-img2img",
        export="unet",
        torch_classes=("StableDiffusionControlNetPipeline",),
        tiny_random=("controlnet",),
        lora=_SD_LORA,
        hint="a ControlNet folder (its UNet takes the ControlNet's residuals): use "
        "OnnxStableDiffusionControlNetPipeline from Python with a control image",
    ),
    Family(
        "controlnet-img2img",
        "OnnxStableDiffusionControlNetImg2ImgPipeline",
        f"{_SD_MODULE}.controlnet",
        "Stable Diffusion image to image with ControlNet",
        DenoiserInterface(
            "unet",
            UNET_INPUTS,
            prefixed=(DOWN_RESIDUAL_INPUT, MID_RESIDUAL_INPUT),
            optional_prefixed=IMAGE_PROMPT_INPUTS,
        ),
        _SD_DEFAULTS,
        auto=False,
        text_to_image=False,
        image_inputs=frozenset({"image", "control_image"}),
        control_image="control_image",
        strength=True,
        index_class_name="OnnxStableDiffusionControlNetImg2ImgPipeline",
        export="unet",
        lora=_SD_LORA,
    ),
    Family(
        "sdxl-controlnet",
        "OnnxStableDiffusionXLControlNetPipeline",
        f"{_SD_MODULE}.controlnet_xl",
        "SDXL with ControlNet",
        DenoiserInterface(
            "unet",
            SDXL_INPUTS,
            prefixed=(DOWN_RESIDUAL_INPUT, MID_RESIDUAL_INPUT),
            optional_prefixed=IMAGE_PROMPT_INPUTS,
        ),
        Defaults(steps=50, guidance_scale=5.0),
        index_class_names=("StableDiffusionXLControlNetPipeline",),
        index_class_name="StableDiffusionXLControlNetPipeline",
        text_to_image=False,
        image_inputs=frozenset({"image"}),
        control_image="image",
        export="unet",
        torch_classes=("StableDiffusionXLControlNetPipeline",),
        tiny_random=("xl-controlnet",),
        lora="StableDiffusionXLLoraLoaderMixin",
        hint="an SDXL ControlNet folder (its UNet takes the ControlNets' residuals): use "
        "OnnxStableDiffusionXLControlNetPipeline from Python with a control image",
        options={"needs_folder": "text_encoder", "controlnet_of": "sdxl"},
    ),
    Family(
        "lcm",
        "OnnxLatentConsistencyModelPipeline",
        f"{_SD_MODULE}.latent_consistency",
        "Latent Consistency Model",
        DenoiserInterface("unet", (*UNET_INPUTS, "timestep_cond")),
        Defaults(steps=4, guidance_scale=8.5, size=512),
        index_class_names=("LatentConsistencyModelPipeline", "ORTLatentConsistencyModelPipeline", *_SD_INDEX),
        tiny_random=("lcm",),
        step_cache="deepcache",
        negative_prompt=False,
        **_SD_COMMON,
    ),
    Family(
        "inpaint",
        "OnnxStableDiffusionInpaintPipeline",
        f"{_SD_MODULE}.inpaint",
        "Stable Diffusion inpainting",
        DenoiserInterface("unet", UNET_INPUTS, sample_channels=9),
        Defaults(steps=50, guidance_scale=7.5, size=512),
        index_class_names=("OnnxStableDiffusionInpaintPipeline", "StableDiffusionInpaintPipeline", *_SD_INDEX),
        text_to_image=False,
        image_inputs=frozenset({"image", "mask_image"}),
        strength=True,
        numpy_class="OnnxStableDiffusionInpaintPipeline",
        step_cache="deepcache",
        hint="an inpainting model (its UNet takes 9 channels): use OnnxStableDiffusionInpaintPipeline from Python "
        "with an image and a mask",
        **_SD_COMMON,
    ),
    Family(
        "sd",
        "OnnxStableDiffusionPipeline",
        f"{_SD_MODULE}.stable_diffusion",
        "Stable Diffusion 1.x/2.x",
        _UNET,
        _SD_DEFAULTS,
        index_class_names=_SD_INDEX,
        image_to_image="sd-img2img",
        inpainting="inpaint",
        torch_classes=("StableDiffusionPipeline", "StableDiffusionImg2ImgPipeline", "StableDiffusionInpaintPipeline"),
        tiny_random=("sd",),
        numpy_class=DIFFUSERS_ONNX_CLASS_NAME,
        step_cache="deepcache",
        **_SD_COMMON,
    ),
    Family(
        "sd-img2img",
        "OnnxStableDiffusionImg2ImgPipeline",
        f"{_SD_MODULE}.img2img",
        "Stable Diffusion image to image",
        _UNET,
        Defaults(steps=50, guidance_scale=7.5),
        auto=False,
        text_to_image=False,
        image_inputs=frozenset({"image"}),
        sized_by_image=True,
        strength=True,
        numpy_class="OnnxStableDiffusionImg2ImgPipeline",
        step_cache="deepcache",
        **_SD_COMMON,
    ),
    Family(
        "stream",
        "OnnxStreamDiffusionPipeline",
        f"{_SD_MODULE}.stream",
        "real-time stream (few-step image to image on frames)",
        DenoiserInterface("unet", UNET_INPUTS, optional=("timestep_cond",), optional_prefixed=IMAGE_PROMPT_INPUTS),
        Defaults(steps=1, guidance_scale=0.0, size=512),
        auto=False,
        text_to_image=False,
        image_inputs=frozenset({"frame"}),
        index_class_name=DIFFUSERS_ONNX_CLASS_NAME,
        export="unet",
        lora=_SD_LORA,
        scheduler_choice=False,
        hint="use OnnxStreamDiffusionPipeline (the stream command)",
    ),
    Family(
        "stream-controlnet",
        "OnnxStreamDiffusionControlNetPipeline",
        f"{_SD_MODULE}.stream_controlnet",
        "real-time stream with ControlNets (few-step image to image on frames, each with its control image)",
        DenoiserInterface(
            "unet",
            UNET_INPUTS,
            prefixed=(DOWN_RESIDUAL_INPUT, MID_RESIDUAL_INPUT),
            optional_prefixed=IMAGE_PROMPT_INPUTS,
        ),
        Defaults(steps=1, guidance_scale=0.0, size=512),
        auto=False,
        text_to_image=False,
        image_inputs=frozenset({"frame", "control_image"}),
        control_image="control_image",
        index_class_name="OnnxStableDiffusionControlNetPipeline",
        export="unet",
        lora=_SD_LORA,
        scheduler_choice=False,
        hint="use OnnxStreamDiffusionPipeline (the stream command), which takes a ControlNet folder too",
    ),
    Family(
        "stream-xl-controlnet",
        "OnnxStreamDiffusionXLControlNetPipeline",
        f"{_SD_MODULE}.stream_xl_controlnet",
        "real-time SDXL stream with ControlNets (few-step image to image on frames, each with its control image)",
        DenoiserInterface(
            "unet",
            SDXL_INPUTS,
            prefixed=(DOWN_RESIDUAL_INPUT, MID_RESIDUAL_INPUT),
            optional_prefixed=IMAGE_PROMPT_INPUTS,
        ),
        Defaults(steps=1, guidance_scale=0.0, size=512),
        auto=False,
        text_to_image=False,
        image_inputs=frozenset({"frame", "control_image"}),
        control_image="control_image",
        index_class_name="StableDiffusionXLControlNetPipeline",
        export="unet",
        lora="StableDiffusionXLLoraLoaderMixin",
        scheduler_choice=False,
        hint="use OnnxStreamDiffusionPipeline (the stream command), which takes an SDXL ControlNet folder too",
    ),
    Family(
        "stream-xl",
        "OnnxStreamDiffusionXLPipeline",
        f"{_SD_MODULE}.stream_xl",
        "real-time SDXL stream (few-step image to image on frames: SDXL-Turbo, SDXL)",
        DenoiserInterface("unet", SDXL_INPUTS, optional=("timestep_cond",), optional_prefixed=IMAGE_PROMPT_INPUTS),
        Defaults(steps=1, guidance_scale=0.0, size=512),
        auto=False,
        text_to_image=False,
        image_inputs=frozenset({"frame"}),
        index_class_name="StableDiffusionXLPipeline",
        export="unet",
        lora="StableDiffusionXLLoraLoaderMixin",
        scheduler_choice=False,
        hint="use OnnxStreamDiffusionPipeline (the stream command), which takes an SDXL folder too",
    ),
    Family(
        "sd3",
        "OnnxStableDiffusion3Pipeline",
        f"{_SD_MODULE}.stable_diffusion_3",
        "Stable Diffusion 3",
        DenoiserInterface("transformer", MMDIT_INPUTS),
        Defaults(steps=28, guidance_scale=7.0),
        index_class_names=("StableDiffusion3Pipeline", "ORTStableDiffusion3Pipeline"),
        index_class_name="StableDiffusion3Pipeline",
        export="sd3",
        torch_classes=("StableDiffusion3Pipeline",),
        tiny_random=("sd3",),
        step_cache="first-block",
        lora="SD3LoraLoaderMixin",
        scheduler_choice=False,
        callback_tensors=("latents", "prompt_embeds", "pooled_prompt_embeds"),
        options={
            "transformer_class": "SD3Transformer2DModel",
            "t5_tokenizer": "tokenizer_3",
            "t5_encoder": "text_encoder_3",
        },
    ),
    Family(
        "flux",
        "OnnxFluxPipeline",
        f"{_SD_MODULE}.flux",
        "FLUX.1",
        _FLUX,
        Defaults(steps=28, guidance_scale=3.5),
        index_class_names=("FluxPipeline", "ORTFluxPipeline"),
        index_class_name="FluxPipeline",
        export="flux",
        torch_classes=("FluxPipeline",),
        tiny_random=("flux", "flux-dev"),
        step_cache="first-block",
        lora="FluxLoraLoaderMixin",
        scheduler_choice=False,
        negative_prompt_needs="true_cfg_scale > 1",
        options=_FLUX_OPTIONS,
    ),
    # after FLUX.1: the same interface, told apart by the class name model_index.json gives
    Family(
        "flux-kontext",
        "OnnxFluxKontextPipeline",
        f"{_SD_MODULE}.flux_kontext",
        "FLUX.1 Kontext (image editing)",
        _FLUX,
        Defaults(steps=28, guidance_scale=3.5),
        index_class_names=("FluxKontextPipeline",),
        index_class_name="FluxKontextPipeline",
        text_to_image=False,
        image_inputs=frozenset({"image"}),
        torch_classes=("FluxKontextPipeline",),
        tiny_random=("flux-kontext",),
        negative_prompt_needs="true_cfg_scale > 1",
        hint="a FLUX.1 Kontext folder (it edits a reference image): use OnnxFluxKontextPipeline from Python with an "
        "image",
        **{**_FLUX_VARIANT, "options": {**_FLUX_OPTIONS, "size_by_area": True}},
    ),
    Family(
        "flux-fill",
        "OnnxFluxFillPipeline",
        f"{_SD_MODULE}.flux_fill",
        "FLUX.1 Fill (inpainting, outpainting)",
        DenoiserInterface("transformer", FLUX_INPUTS, optional=(FLUX_GUIDANCE,), sample_channels=FLUX_FILL_TOKEN_WIDTH),
        Defaults(steps=50, guidance_scale=30.0),
        index_class_names=("FluxFillPipeline",),
        index_class_name="FluxFillPipeline",
        text_to_image=False,
        image_inputs=frozenset({"image", "mask_image"}),
        strength=True,
        torch_classes=("FluxFillPipeline",),
        tiny_random=("flux-fill",),
        negative_prompt=False,
        hint="a FLUX.1 Fill folder (its transformer takes the masked image and the mask): use OnnxFluxFillPipeline "
        "from Python with an image and a mask",
        **_FLUX_VARIANT,
    ),
    Family(
        "flux-control",
        "OnnxFluxControlPipeline",
        f"{_SD_MODULE}.flux_control",
        "FLUX.1 Control (Canny, Depth)",
        DenoiserInterface(
            "transformer", FLUX_INPUTS, optional=(FLUX_GUIDANCE,), sample_channels=FLUX_CONTROL_TOKEN_WIDTH
        ),
        Defaults(steps=28, guidance_scale=3.5),
        index_class_names=("FluxControlPipeline",),
        index_class_name="FluxControlPipeline",
        text_to_image=False,
        image_inputs=frozenset({"control_image"}),
        control_image="control_image",
        torch_classes=("FluxControlPipeline",),
        tiny_random=("flux-control",),
        negative_prompt=False,
        hint="a FLUX.1 Control folder (its transformer takes a control image's latents): use "
        "OnnxFluxControlPipeline from Python with a control image",
        **_FLUX_VARIANT,
    ),
    Family(
        "flux-controlnet",
        "OnnxFluxControlNetPipeline",
        f"{_SD_MODULE}.flux_controlnet",
        "FLUX.1 with ControlNet",
        DenoiserInterface(
            "transformer",
            FLUX_INPUTS,
            optional=(FLUX_GUIDANCE,),
            prefixed=(FLUX_CONTROLNET_BLOCK_SAMPLE, FLUX_CONTROLNET_SINGLE_BLOCK_SAMPLE),
            refused_channels=(FLUX_FILL_TOKEN_WIDTH, FLUX_CONTROL_TOKEN_WIDTH),
        ),
        Defaults(steps=28, guidance_scale=7.0),
        index_class_names=("FluxControlNetPipeline",),
        index_class_name="FluxControlNetPipeline",
        text_to_image=False,
        image_inputs=frozenset({"control_image"}),
        control_image="control_image",
        torch_classes=("FluxControlNetPipeline",),
        tiny_random=("flux-controlnet",),
        negative_prompt_needs="true_cfg_scale > 1",
        hint="a FLUX.1 ControlNet folder (its transformer takes the ControlNets' block samples): use "
        "OnnxFluxControlNetPipeline from Python with a control image",
        **{
            **_FLUX_VARIANT,
            "step_cache": None,
            "options": {**_FLUX_OPTIONS, "controlnet_of": "flux", "control_mode": True},
        },
    ),
    Family(
        "wan",
        "OnnxWanPipeline",
        f"{_SD_MODULE}.wan",
        "Wan 2.1 / 2.2 text to video",
        DenoiserInterface("transformer", WAN_INPUTS, refused_channels=(WAN_I2V_CHANNELS,)),
        Defaults(steps=50, guidance_scale=5.0),
        index_class_names=("WanPipeline",),
        index_class_name="WanPipeline",
        export="wan",
        torch_classes=("WanPipeline",),
        tiny_random=("wan", "wan2.2"),
        step_cache="first-block",
        scheduler_choice=False,
        callback_tensors=("latents", "prompt_embeds", "negative_prompt_embeds"),
        frames=True,
        options={
            "transformer_class": "WanTransformer3DModel",
            "t5_tokenizer": "tokenizer",
            "t5_encoder": "text_encoder",
        },
    ),
    Family(
        "wan-i2v",
        "OnnxWanImageToVideoPipeline",
        f"{_SD_MODULE}.wan_i2v",
        "Wan 2.1 / 2.2 image to video",
        DenoiserInterface("transformer", WAN_INPUTS, optional=(WAN_IMAGE_INPUT,), sample_channels=WAN_I2V_CHANNELS),
        Defaults(steps=50, guidance_scale=5.0),
        index_class_names=("WanImageToVideoPipeline",),
        index_class_name="WanImageToVideoPipeline",
        text_to_image=False,
        image_inputs=frozenset({"image"}),
        export="wan",
        torch_classes=("WanImageToVideoPipeline",),
        tiny_random=("wan-i2v", "wan2.2-i2v"),
        step_cache="first-block",
        scheduler_choice=False,
        callback_tensors=("latents", "prompt_embeds", "negative_prompt_embeds"),
        frames=True,
        hint="a Wan image-to-video folder (its transformer takes the first frame's latents): use "
        "OnnxWanImageToVideoPipeline from Python with an image",
        options={
            "transformer_class": "WanTransformer3DModel",
            "t5_tokenizer": "tokenizer",
            "t5_encoder": "text_encoder",
        },
    ),
)

_BY_KEY: Dict[str, Family] = {record.key: record for record in FAMILIES}


def family(key: str) -> Family:
    """The family record of ``key`` (:attr:`Family.key`).

    Raises:
        KeyError: no family has that key (naming the keys there are)."""
    try:
        return _BY_KEY[key]
    except KeyError:
        raise KeyError(f"no family {key!r}; the families are {sorted(_BY_KEY)}") from None


def family_of_class(class_name: str) -> Optional[Family]:
    """The first family a pipeline class of this name runs (``None``: none)."""
    return next((record for record in FAMILIES if record.class_name == class_name), None)


def torch_class_family(class_name: str) -> Optional[Family]:
    """The family whose exporter takes diffusers' torch pipeline class of this name (:attr:`Family.torch_classes`);
    ``None``: none."""
    return next((record for record in FAMILIES if class_name in record.torch_classes), None)


def pipeline_class(record: Family) -> type:
    """The pipeline class that runs ``record``, imported on first use."""
    return getattr(importlib.import_module(record.module), record.class_name)


def public_pipeline_names() -> Dict[str, str]:
    """Every pipeline class name and the module that defines it (the package's lazily imported public names)."""
    return {record.class_name: record.module for record in FAMILIES}


def transformer_family(transformer_class: Optional[str]) -> Optional[Family]:
    """The family whose transformer is of this diffusers class (what a model_index.json's ``transformer`` names)."""
    return next(
        (
            record
            for record in FAMILIES
            if transformer_class and record.options.get("transformer_class") == transformer_class
        ),
        None,
    )


def controlnet_family(record: Optional[Family]) -> Optional[Family]:
    """The family that runs ``record``'s pipelines with ControlNets added by the export (whose ``controlnet_of``
    option names ``record``: SDXL's, FLUX.1's), or ``None``: ``record`` takes none."""
    if record is None:
        return None
    return next((other for other in FAMILIES if other.options.get("controlnet_of") == record.key), None)


# The images a command or a request gives a family, by role (the command line's options and the request's fields are
# named after them): what to start from or to edit, where to repaint, what to follow
IMAGE_ROLES = ("image", "mask", "control_image")


def image_role(record: Family, argument: str) -> str:
    """The role (:data:`IMAGE_ROLES`) of ``record``'s image argument ``argument`` (one of its ``image_inputs``)."""
    if argument == record.control_image:
        return "control_image"
    return "mask" if argument == "mask_image" else "image"


def image_route(record: Family, roles: AbstractSet[str], strength: bool = False) -> Tuple[Optional[str], Family]:
    """Which pipeline takes images in ``roles`` (and a ``strength``, where one is given) on a folder of ``record``'s
    family: the folder's own (``None``) or its ``"image_to_image"`` or ``"inpainting"`` sibling, with the record of
    the family that runs them. An image it cannot take, one it needs that is missing, or a strength it takes none of
    is an :class:`~optimum_iobinding.errors.ArgumentError` naming the role (or ``strength``)."""
    sibling, runs = None, record
    starts = record.image_inputs - {record.control_image, "mask_image"}
    if "mask" in roles and "mask_image" not in record.image_inputs:
        if record.inpainting is None:
            raise ArgumentError(
                "mask", f"expected none for {record.class_name} ({record.title} repaints no masked area)"
            )
        sibling, runs = "inpainting", family(record.inpainting)
    elif "image" in roles and not starts:
        if record.image_to_image is None:
            raise ArgumentError(
                "image", f"expected none for {record.class_name} ({record.title} starts from no image and edits none)"
            )
        sibling, runs = "image_to_image", family(record.image_to_image)
    if "control_image" in roles and runs.control_image is None:
        raise ArgumentError(
            "control_image", f"expected none for {runs.class_name} ({runs.title} takes no control image)"
        )
    for argument in sorted(runs.image_inputs):
        role = image_role(runs, argument)
        if role not in roles:
            raise ArgumentError(role, f"expected an image for {runs.class_name} ({runs.title}), got none")
    if strength and not runs.strength:
        raise ArgumentError("strength", f"expected none for {runs.class_name} ({runs.title} takes no strength)")
    return sibling, runs


def tiny_random_kinds() -> Tuple[str, ...]:
    """Every tiny random model's kind (``export --tiny-random KIND``), the families' :attr:`~Family.tiny_random` in
    the table's order."""
    return tuple(kind for record in FAMILIES for kind in record.tiny_random)


def t5_tokenizer_of(record: Optional[Family]) -> Optional[str]:
    """The component holding the family's T5 tokenizer, whose length each call gives (``max_sequence_length``), so
    that it need name no ``model_max_length``; ``None``: the family has none (its tokenizers are CLIP's, of a fixed
    length)."""
    return None if record is None else record.options.get("t5_tokenizer")


def detect(
    index_class_name: Optional[str],
    denoiser_inputs: Mapping[str, Sequence[str]],
    channels: Union[None, int, Mapping[str, Optional[int]]] = None,
    folders: Sequence[str] = (),
) -> Optional[Family]:
    """The family of a folder: among the families detection may pick (:attr:`Family.auto`), those whose
    :attr:`~Family.index_class_names` hold the folder's model_index.json ``_class_name`` first, then the rest, the
    first whose denoiser interface matches the folder's (``denoiser_inputs``: the inputs of each denoiser folder there,
    ``channels``: each denoiser's sample channels by its folder — a UNet's ``sample`` channels, a FLUX.1
    transformer's token width — or an int, the UNet's; ``None``: unknown; ``folders``: the component folders there).
    ``None``: no family runs it.
    """
    by_component = {"unet": channels} if channels is None or isinstance(channels, int) else dict(channels)
    named = [record for record in FAMILIES if record.auto and index_class_name in record.index_class_names]
    rest = [record for record in FAMILIES if record.auto and record not in named]
    # a class name that selects one family alone selects it where the denoiser's channels are unknown (a dynamic dim,
    # no config): a FLUX.1 Fill folder is not taken for FLUX.1 for want of its token width
    alone = sum(index_class_name in record.index_class_names for record in FAMILIES) == 1
    for record in (*named, *rest):
        inputs = denoiser_inputs.get(record.denoiser)
        channels_of = by_component.get(record.denoiser)
        interface = record.interface
        if alone and record in named and channels_of is None:
            interface = replace(interface, sample_channels=None)
        if inputs is None or not interface.matches(inputs, channels_of):
            continue
        needed = record.options.get("needs_folder")
        if needed is not None and needed not in folders:
            continue
        return record
    return None
