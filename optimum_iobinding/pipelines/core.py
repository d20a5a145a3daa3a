"""The pipeline core every family and the stream stand on, whatever their denoiser: components declared once per family
(:class:`~.components.Component`), from which one ``from_pretrained`` and ``save_pretrained`` work for all; the
device, the stream and ``io_binding``; the call guard (one call at a time, on the pipeline's stream); the warm-up
driver; the argument checks every family shares; latent upload; the VAE as a latent codec; output conversion.

A family is a declaration — its components, its denoiser part (:mod:`.denoisers`), its prompt part
(:mod:`.prompts`), its VAE constants, its opt-in capabilities (LoRA) — plus its own ``__call__`` in numbered steps."""

from __future__ import annotations

import functools
import inspect
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import PIL.Image
import torch
from diffusers import DiffusionPipeline
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.stable_diffusion import StableDiffusionPipelineOutput
from diffusers.utils.torch_utils import randn_tensor

from ..errors import ArgumentError, ArgumentTypeError, ModelFileError
from ..families import Family, family, pipeline_class
from ..layout import building_beside, check_output_folder, resolve_pipeline_folder, save_tokenizer
from ..runtime.cuda_policy import DEVICE_SETUP
from ..runtime.hub import check_hub_kwargs, keywords_of
from ..runtime.model import IOBindingORTModel
from ..runtime.options import CudaGraphSetting, PipelineOptions, ProviderSpec
from .arguments import Generator, is_integer, is_real, is_torch_generator
from .codec import LatentCodec, unpack_latents
from .caching import StepCache
from .components import Component, check_component_kind, check_replacement, load_components, names_of
from .denoisers import Denoiser
from .loop import check_callback_arguments
from .prompts import PromptEncoder
from .tiling import TiledVAE
from .transfer import on_cpu, tensor_of, upload


@dataclass(frozen=True)
class VaeConstants:
    """A family's latent scaling and shift (``shift_factor=None``: none), for a VAE decoder whose config.json names
    none, and the hint a bad value in config.json quotes."""

    scaling_factor: float
    shift_factor: Optional[float]
    hint: str

    @classmethod
    def of(cls, family: str, scaling_factor: float, shift_factor: float) -> "VaeConstants":
        """The constants of a family whose VAE has both, the hint quoting them."""
        return cls(
            scaling_factor, shift_factor, f"{family}'s are scaling_factor {scaling_factor}, shift_factor {shift_factor}"
        )


class CallGuard:
    """One pipeline call at a time: the scheduler's state and the models' reused buffers belong to the running call,
    so calls from several threads are serialized, and a call from inside a call (a callback re-entering) is refused.
    ``with pipe.call_guard:`` is the public way in for anything that runs the pipeline's models outside a call."""

    def __init__(self, owner: str):
        self.owner = owner
        self.lock = threading.RLock()
        self._state = threading.local()

    @property
    def active(self) -> bool:
        """Whether this thread is inside a call."""
        return getattr(self._state, "active", False)

    def __enter__(self) -> "CallGuard":
        if self.active:
            raise RuntimeError(
                f"{self.owner}: called again from inside its own call (a callback?); the scheduler's "
                "state and the models' buffers belong to the running call. Collect what you need in "
                "the callback and call the pipeline after it returns"
            )
        self.lock.acquire()
        self._state.active = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self._state.active = False
        self.lock.release()


def on_device_stream(method: Callable) -> Callable:
    """Runs a pipeline method without autograd (``torch.no_grad``), under its :class:`CallGuard`, on the pipeline's
    CUDA stream, ordered after the caller's stream and before its next work (no host wait); off CUDA it just calls.
    The first call starts every component's session building (:meth:`OnnxDiffusionPipeline.prepare_sessions`)."""

    @functools.wraps(method)
    def on_stream(self: "OnnxDiffusionPipeline", *args: Any, **kwargs: Any) -> Any:
        with self.call_guard, torch.no_grad():
            self.prepare_sessions()
            stream = self.stream
            if stream is None:
                return method(self, *args, **kwargs)
            # the pipeline's GPU is the current one for the call: nothing (pinned buffers, a context) lands on cuda:0
            with torch.cuda.device(stream.device):
                caller = torch.cuda.current_stream(stream.device)
                stream.wait_stream(caller)
                with torch.cuda.stream(stream):
                    result = method(self, *args, **kwargs)
                caller.wait_stream(stream)
            return result

    return on_stream


class OnnxDiffusionPipeline(DiffusionPipeline):
    """Components are :class:`IOBindingORTModel`\\ s; the denoising loop runs in torch on ``self.device``.

    With ``io_binding=True`` (components binding on the session's device) every tensor of the loop stays there and
    only the final image is downloaded. With ``io_binding=False`` the components run ``session.run`` on numpy arrays
    and the loop runs on the CPU: diffusers' numpy pipeline, the baseline.

    A family declares (class attributes): ``declared_components``; ``denoiser_part`` and ``prompt_part`` (a part class,
    or a ``functools.partial`` of one, called with the pipeline); ``vae_constants``; ``settings`` (model_index.json
    entries it takes, with their defaults); ``encodes_images`` (whether a call runs the VAE encoder);
    ``packed_latents`` (Flux's 2×2 tokens); ``family`` (its record in :mod:`optimum_iobinding.families`: its
    denoiser component, image-to-image sibling, capabilities and defaults);
    ``loading_arguments`` (``from_pretrained`` keywords its :meth:`model_folders` takes). Capabilities are
    opt-in mixins: :class:`Warmup`, LoRA (:class:`~.lora.LoraLoaderMixin`).
    """

    declared_components: ClassVar[Tuple[Component, ...]] = ()
    denoiser_part: ClassVar[Callable[[Any], Denoiser]]
    prompt_part: ClassVar[Callable[[Any], PromptEncoder]]
    vae_constants: ClassVar[VaeConstants] = VaeConstants(0.18215, None, "SD 1.x/2.x use 0.18215, SDXL 0.13025")
    settings: ClassVar[Dict[str, Any]] = {}
    encodes_images: ClassVar[bool] = False
    packed_latents: ClassVar[bool] = False
    #: the family's description (:mod:`optimum_iobinding.families`): its denoiser, sibling, capabilities, defaults
    family: ClassVar[Family]
    loading_arguments: ClassVar[Tuple[str, ...]] = ()
    # components a folder may hold numbered copies of (controlnet_1 …), each taking the first's options
    numbered_components: ClassVar[Tuple[str, ...]] = ()
    # the folder kind a missing denoiser's error names (e.g. " (a FLUX.1 ONNX folder)")
    folder_description: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # diffusers' name for what the declaration says
        cls._optional_components = [c.name for c in cls.declared_components if c.optional]

    def __init__(self, **components: Any):
        super().__init__()
        names = self.component_names()
        unexpected = sorted(set(components) - set(names) - {"scheduler"} - set(self.settings))
        if unexpected:
            raise ArgumentTypeError(", ".join(unexpected), f"unexpected arguments of {type(self).__name__}")
        missing = [c.name for c in self.declared_components if not c.optional and c.name not in components]
        missing += [] if "scheduler" in components else ["scheduler"]
        if missing:
            raise ArgumentTypeError(", ".join(missing), f"missing components of {type(self).__name__}")
        self.register_modules(**{name: components.get(name) for name in (*names, "scheduler")})
        if self.settings:
            self.register_to_config(**{key: components.get(key, default) for key, default in self.settings.items()})
        for name in self.onnx_names():
            check_component_kind(name, getattr(self, name, None))
        self.call_guard = CallGuard(type(self).__name__)
        self._sessions_started = False
        self.denoiser: Denoiser = self.denoiser_part(self)
        self.denoiser.check_model()
        self.prompt: PromptEncoder = self.prompt_part(self)
        if hasattr(self.prompt, "check_encoders"):
            self.prompt.check_encoders()
        constants = self.vae_constants
        self.codec = LatentCodec(self, constants.scaling_factor, constants.shift_factor, constants.hint)
        self.latent_channels = self.denoiser.latent_channels(self.vae_decoder)
        # Flux's 2×2 packing halves the latents once more: images are multiples of twice the VAE's factor
        self.image_processor = VaeImageProcessor(
            vae_scale_factor=self.vae_scale_factor * (2 if self.packed_latents else 1)
        )

    # ------------------------------------------------------------------------------------------- the declaration
    def component_names(self) -> Tuple[str, ...]:
        """Every component this pipeline takes (ONNX models, tokenizers, kept modules), the scheduler aside."""
        return names_of(self.declared_components)

    def onnx_names(self) -> Tuple[str, ...]:
        return names_of(self.declared_components, "onnx")

    def tokenizer_names(self) -> Tuple[str, ...]:
        return names_of(self.declared_components, "tokenizer")

    @classmethod
    def denoiser_component(cls) -> str:
        """The component the loop calls at every step: the one ``cuda_graph=True`` requires captured."""
        return cls.family.denoiser

    @classmethod
    def _get_signature_keys(cls, obj: Any) -> Tuple[List[str], List[str]]:
        """diffusers' view of the components (``pipe.components``): the declared ones (optional ones included) and
        the scheduler are the modules; the settings are the optional parameters."""
        return sorted({*names_of(obj.declared_components), "scheduler"}), sorted(cls.settings)

    # ------------------------------------------------------------------------------------------------ properties
    @property
    def device(self) -> torch.device:
        """Where the loop's tensors live: the denoiser session's device (the CPU for the numpy baseline)."""
        model = self.denoiser.model
        return model.device if model.io_binding else torch.device("cpu")

    @property
    def _execution_device(self) -> torch.device:  # diffusers' name
        return self.device

    @property
    def stream(self) -> Optional["torch.cuda.Stream"]:
        """The CUDA stream shared by the components and the loop's torch ops (``None`` off CUDA)."""
        return self.denoiser.model.stream

    @property
    def io_binding(self) -> bool:
        return self.denoiser.model.io_binding

    @property
    def vae_scale_factor(self) -> int:
        """How many pixels a latent pixel is, each way (the VAE's upsampling)."""
        return self.codec.scale_factor

    @property
    def vae_scaling_factor(self) -> float:
        return self.codec.scaling_factor

    @property
    def vae_shift_factor(self) -> Optional[float]:
        return self.codec.shift_factor

    @property
    def default_sample_size(self) -> int:
        """The denoiser's sample size in latents (diffusers' SDXL, SD3 and Flux pipelines have the attribute)."""
        return self.denoiser.default_sample_size

    @property
    def default_image_size(self) -> int:
        """The height and width a call gets where it gives none: the denoiser's sample size (latents) times the
        VAE's scale factor, as in diffusers."""
        return self.default_sample_size * self.vae_scale_factor

    @property
    def size_multiple(self) -> int:
        """What heights and widths must be multiples of (the denoiser's rule: see its ``size_multiple``)."""
        return self.denoiser.size_multiple

    @property
    def onnx_models(self) -> Dict[str, IOBindingORTModel]:
        """The pipeline's ONNX components by name."""
        return {
            name: getattr(self, name)
            for name in self.onnx_names()
            if isinstance(getattr(self, name, None), IOBindingORTModel)
        }

    @property
    def sessions_created(self) -> int:
        """ORT sessions created so far by all components (a warmed-up service creates no more)."""
        return sum(model.sessions_created for model in self.onnx_models.values())

    @property
    def encode_prompt(self) -> Callable[..., Any]:
        """diffusers' ``encode_prompt`` with the family's arguments: its prompt part's ``encode`` (see
        :mod:`.prompts`), whose embeddings are on ``self.device``."""
        return self.prompt.encode

    def image_to_image(self) -> Optional["OnnxDiffusionPipeline"]:
        """This pipeline's image-to-image sibling on the same components (no second copy of any model), or ``None``
        where the family has none or the folder has no VAE encoder."""
        if self.family.image_to_image is None or getattr(self, "vae_encoder", None) is None:
            return None
        sibling = pipeline_class(family(self.family.image_to_image))
        accepted = {*names_of(sibling.declared_components), "scheduler", *sibling.settings}
        return sibling(**{name: module for name, module in self.components.items() if name in accepted})

    # -------------------------------------------------------------------------------------------- loading, saving
    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: Union[str, os.PathLike],
        provider: ProviderSpec = None,
        provider_options: Optional[Dict[str, Any]] = None,
        sess_options: Any = None,
        io_binding: bool = True,
        cuda_graph: CudaGraphSetting = "auto",
        component_options: Optional[Dict[str, Dict[str, Any]]] = None,
        **kwargs: Any,
    ) -> "OnnxDiffusionPipeline":
        """Loads a diffusers-converted ONNX folder, an ``optimum-cli export onnx`` folder or ours, or a hub id.

        Args:
            pretrained_model_name_or_path: local folder or hub repository id.
            provider, provider_options, sess_options: for every ONNX component (see :class:`IOBindingORTModel`).
            io_binding: bind torch tensors on the session's device (default), or run diffusers' numpy baseline.
            cuda_graph: ``"auto"`` (default): on CUDA every component captures each input signature as a CUDA graph
                where it can (one INFO log line where it cannot); ``True``: the same, but the denoiser (the UNet or
                the transformer) must be captured; ``False``: no graphs (see :class:`IOBindingORTModel`). Sessions
                are created lazily, one per input signature, sharing one copy of the weights; :meth:`warmup` creates
                them ahead of the first request.
            component_options: per component (``"unet"``, ``"transformer"``, ``"text_encoder"``, ``"vae_decoder"``,
                …) settings of its :class:`IOBindingORTModel` that override the ones above: ``cuda_graph``,
                ``reuse_outputs``, ``max_output_signatures``, ``max_graph_signatures``, ``share_weights``.
            **kwargs: components in place of the folder's (``scheduler=``, ``tokenizer=``, ``tokenizer_2=`` …); the
                family's loading arguments (the stream's ``tiny_vae``); and for ``huggingface_hub.snapshot_download``
                (revision, token, cache_dir, local_files_only).
        """
        replaceable = {"scheduler", *names_of(cls.declared_components, "tokenizer")}
        replacements = {name: kwargs.pop(name) for name in list(kwargs) if name in replaceable}
        replacements = {name: value for name, value in replacements.items() if value is not None}
        loading = {name: kwargs.pop(name) for name in list(kwargs) if name in cls.loading_arguments}
        check_hub_kwargs(
            f"{cls.__name__}.from_pretrained",
            kwargs,
            [*keywords_of(cls.from_pretrained), *sorted(replaceable), *cls.loading_arguments],
        )
        options = PipelineOptions.resolve(
            names_of(cls.declared_components, "onnx"),
            provider,
            provider_options,
            sess_options,
            io_binding,
            cuda_graph,
            component_options,
            numbered=cls.numbered_components,
        )  # checked before any download
        for name, value in replacements.items():
            check_replacement(name, value)
        folder, model_folders = cls.model_folders(pretrained_model_name_or_path, kwargs, **loading)
        components = load_components(
            folder,
            model_folders,
            cls.declared_components,
            options,
            cls.denoiser_component(),
            replacements,
            tuple(cls.settings),
            cls.missing_denoiser_hint(folder),
        )
        try:
            return cls(**components)
        except BaseException:
            components.clear()  # release sessions now, not when the traceback goes
            raise

    @classmethod
    def model_folders(
        cls, pretrained_model_name_or_path: Union[str, os.PathLike], hub_kwargs: Dict[str, Any], **loading: Any
    ) -> Tuple[Path, Dict[str, Path]]:
        """The pipeline folder (downloaded with what the family reads, for a hub id) and each ONNX component's
        folder in it (a family with its own loading arguments finds some elsewhere)."""
        folder = resolve_pipeline_folder(
            pretrained_model_name_or_path,
            cls.download_names(),
            names_of(cls.declared_components, "tokenizer"),
            **hub_kwargs,
        )
        return folder, {name: folder / name for name in cls.onnx_names_in(folder)}

    @classmethod
    def download_names(cls) -> Sequence[str]:
        """The component folders to fetch from the Hub (glob patterns)."""
        return names_of(cls.declared_components, "onnx")

    @classmethod
    def onnx_names_in(cls, folder: Path) -> Tuple[str, ...]:
        """The ONNX components to load from ``folder`` (a family with a variable number of them finds them)."""
        return names_of(cls.declared_components, "onnx")

    @classmethod
    def missing_denoiser_hint(cls, folder: Path) -> str:
        """What a folder without this family's denoiser is instead (for the error)."""
        others = {
            "unet": "a UNet: a Stable Diffusion folder",
            "transformer": "a diffusion transformer: an SD3 or FLUX.1 folder",
        }
        for name, what in others.items():
            if name != cls.denoiser_component() and (folder / name / "model.onnx").is_file():
                return (
                    f"{cls.folder_description}; {str(folder)!r} holds {what}, for the pipeline pipeline_class_for picks"
                )
        return cls.folder_description

    def save_pretrained(self, save_directory: Union[str, os.PathLike], overwrite: bool = False) -> None:
        """Writes the folder's layout (diffusers' ONNX layout for the UNet families, optimum's for the transformers),
        which this class loads again.

        The folder is built beside ``save_directory`` and moved into place when whole, so a failed save leaves
        what was there. ``save_directory`` must be new or empty unless ``overwrite=True``, which replaces it whole
        (the folder the pipeline was loaded from included: its files are copied out first).
        """
        target = check_output_folder(save_directory, None, overwrite, argument="save_directory")
        with building_beside(target, argument="save_directory") as scratch:
            written = []
            for name in self.onnx_names():
                model = getattr(self, name, None)
                if model is not None:
                    model.save_pretrained(scratch / name)
                    written.append(name)
            for name in self.tokenizer_names():
                if getattr(self, name, None) is not None:
                    save_tokenizer(getattr(self, name), scratch / name)
            self.scheduler.save_pretrained(str(scratch / "scheduler"))
            self.write_model_index(scratch, written)

    def write_model_index(self, target: Path, written: List[str]) -> None:
        """Writes the family's model_index.json into ``target`` (``written``: the ONNX components saved)."""
        raise TypeError(f"{type(self).__name__}: declares no model_index.json layout")

    # ---------------------------------------------------------------------------------------------------- warm-up
    def prepare_sessions(self) -> None:
        """On the first call, each component's shape-free session starts building in a background thread
        (:meth:`IOBindingORTModel.prepare`): the denoiser's and the VAE's are made while the text encoder's is made
        and run, instead of one after another. The VAE encoder only where the family encodes images."""
        if not self._sessions_started:
            self._sessions_started = True
            for name, model in self.onnx_models.items():
                if name != "vae_encoder" or self.encodes_images:
                    model.prepare(wait=False)

    # ----------------------------------------------------------------------------------------------- the checks
    def check_call(
        self,
        *,
        height: Any,
        width: Any,
        num_inference_steps: Any,
        guidance_scale: Any = None,
        num_images_per_prompt: Any = 1,
        output_type: Any = "pil",
        strength: Any = None,
        sigmas: Any = None,
        callback_steps: Any = None,
        callback_on_step_end: Any = None,
        callback_on_step_end_tensor_inputs: Any = ("latents",),
        joint_attention_kwargs: Any = None,
    ) -> None:
        """Refuses, before any work, a shared argument the call cannot run with (every family's, checked here
        once), naming it, what was expected and what came: the size, the steps (or ``sigmas``, one per step), the
        guidance scale, images per prompt, the output type, ``strength``, the callbacks and the tensors a step-end
        callback asks for (among the family's :attr:`~optimum_iobinding.families.Family.callback_tensors`), and
        diffusers' ``joint_attention_kwargs``, which an exported transformer has no attention processors to take."""
        if joint_attention_kwargs:
            raise ArgumentError(
                "joint_attention_kwargs",
                f"expected None (an ONNX transformer has no attention processors to pass them to), "
                f"got {joint_attention_kwargs!r}",
            )
        check_callback_arguments(callback_on_step_end, callback_on_step_end_tensor_inputs, self.family.callback_tensors)
        if strength is not None and (not is_real(strength) or not 0.0 <= strength <= 1.0):
            raise ArgumentError("strength", f"expected a value in [0, 1], got {strength!r}")
        if guidance_scale is not None and (not is_real(guidance_scale) or not math.isfinite(guidance_scale)):
            raise ArgumentError("guidance_scale", f"expected a finite number, got {guidance_scale!r}")
        if not is_integer(num_images_per_prompt) or num_images_per_prompt < 1:
            raise ArgumentError("num_images_per_prompt", f"expected a positive integer, got {num_images_per_prompt!r}")
        self.check_size(height, width)
        if sigmas is not None:
            values = list(sigmas) if isinstance(sigmas, (list, tuple, np.ndarray)) else None
            if not values or not all(is_real(v) and math.isfinite(v) for v in values):
                raise ArgumentError(
                    "sigmas", f"expected a non-empty list of finite numbers (one per step), got {sigmas!r}"
                )
            num_inference_steps = len(values)
        if not is_integer(num_inference_steps) or num_inference_steps <= 0:
            raise ArgumentError("num_inference_steps", f"expected a positive integer, got {num_inference_steps!r}")
        train_steps = getattr(self.scheduler.config, "num_train_timesteps", None)
        if train_steps and num_inference_steps > train_steps:
            raise ArgumentError(
                "num_inference_steps",
                f"expected at most {train_steps} (the scheduler's num_train_timesteps), got {num_inference_steps}",
            )
        if output_type not in ("pil", "np", "pt", "latent"):
            raise ArgumentError("output_type", f"expected 'pil', 'np', 'pt' or 'latent', got {output_type!r}")
        if callback_steps is not None and (not is_integer(callback_steps) or callback_steps <= 0):
            raise ArgumentError("callback_steps", f"expected a positive integer, got {callback_steps!r}")

    def check_inputs(
        self,
        *,
        prompt: Union[str, List[str], None],
        negative_prompt: Union[str, List[str], None] = None,
        prompt_embeds: Optional[torch.Tensor] = None,
        negative_prompt_embeds: Optional[torch.Tensor] = None,
        **call: Any,
    ) -> None:
        """:meth:`check_call` (``call``: its arguments), then the prompts of a CLIP family: a prompt or its
        embeddings (one of them), a negative prompt like it or its embeddings (at most one of them), embeddings of
        the denoiser's width."""
        self.check_call(**call)
        self.check_texts("prompt", prompt, None)
        self.check_texts("negative_prompt", negative_prompt, None)
        for name, embeds in (("prompt_embeds", prompt_embeds), ("negative_prompt_embeds", negative_prompt_embeds)):
            if embeds is not None:
                self.check_embeds(name, embeds, 3, "(batch, sequence, hidden)", "encoder_hidden_states")
        if prompt is not None and prompt_embeds is not None:
            raise ArgumentError("prompt and prompt_embeds", "expected one of them, got both")
        if prompt is None and prompt_embeds is None:
            raise ArgumentError("prompt and prompt_embeds", "expected one of them, got neither")
        if negative_prompt is not None and negative_prompt_embeds is not None:
            raise ArgumentError("negative_prompt and negative_prompt_embeds", "expected at most one of them, got both")
        if isinstance(prompt, list) and isinstance(negative_prompt, list) and len(prompt) != len(negative_prompt):
            raise ArgumentError(
                "negative_prompt", f"expected a list of {len(prompt)} (as many as prompt), got {len(negative_prompt)}"
            )
        if negative_prompt is not None and prompt is not None and type(prompt) is not type(negative_prompt):
            raise ArgumentTypeError(
                "negative_prompt",
                f"expected a {type(prompt).__name__} like prompt, got {type(negative_prompt).__name__}",
            )
        if (
            prompt_embeds is not None
            and negative_prompt_embeds is not None
            and tuple(prompt_embeds.shape) != tuple(negative_prompt_embeds.shape)
        ):
            raise ArgumentError(
                "negative_prompt_embeds",
                f"expected shape {tuple(prompt_embeds.shape)} like prompt_embeds, "
                f"got {tuple(negative_prompt_embeds.shape)}",
            )
        if (
            prompt is not None
            and negative_prompt_embeds is not None
            and negative_prompt_embeds.shape[0] != self.batch_size_of(prompt, None)
        ):
            raise ArgumentError(
                "negative_prompt_embeds",
                f"expected {self.batch_size_of(prompt, None)} rows (one per "
                f"prompt), got shape {tuple(negative_prompt_embeds.shape)}",
            )

    def check_embeds(self, name: str, embeds: Any, rank: int, layout: str, unet_input: str) -> None:
        """Given embeddings must be a float tensor (or numpy array) of ``rank`` dims whose last (the hidden size)
        is the width the denoiser's (UNet's or transformer's) ``unet_input`` declares, and whose sequence length is
        the one it declares (where static): refused before any work otherwise, naming ``name``."""
        if isinstance(embeds, np.ndarray):
            dtype, floating = embeds.dtype, embeds.dtype.kind == "f" and embeds.dtype.itemsize <= 8
        elif isinstance(embeds, torch.Tensor) and embeds.layout == torch.strided and not embeds.is_nested:
            dtype, floating = embeds.dtype, embeds.dtype.is_floating_point
        else:
            kind = f"a {str(embeds.layout)[6:]} tensor" if isinstance(embeds, torch.Tensor) else type(embeds).__name__
            raise ArgumentTypeError(name, f"expected a dense torch.Tensor or numpy array {layout}, got {kind}")
        if not floating:
            raise ArgumentTypeError(name, f"expected a float tensor (the text encoder's output), got dtype {dtype}")
        if embeds.ndim != rank:
            raise ArgumentError(name, f"expected shape {layout}, got {tuple(embeds.shape)}")
        if 0 in embeds.shape:
            raise ArgumentError(name, f"expected a non-empty tensor {layout}, got shape {tuple(embeds.shape)}")
        denoiser = "UNet" if self.denoiser.component == "unet" else self.denoiser.component
        declared = self.denoiser.model.input_dims.get(unet_input) or []
        if len(declared) == rank and isinstance(declared[-1], int) and embeds.shape[-1] != declared[-1]:
            raise ArgumentError(
                name,
                f"expected hidden size {declared[-1]} (the width of the {denoiser}'s "
                f"{unet_input}), got {embeds.shape[-1]} (shape {tuple(embeds.shape)})",
            )
        if rank == 3 and len(declared) == 3 and isinstance(declared[1], int) and embeds.shape[1] != declared[1]:
            raise ArgumentError(
                name,
                f"expected sequence length {declared[1]} (the {denoiser}'s {unet_input}), got "
                f"{embeds.shape[1]} (shape {tuple(embeds.shape)})",
            )

    @staticmethod
    def check_texts(name: str, texts: Any, count: Optional[int], broadcast: bool = False) -> Optional[int]:
        """A prompt argument, refused before any work otherwise, naming ``name``: a str or a non-empty list of str,
        as many as ``count`` (a str goes with any count where ``broadcast``). Returns how many it holds (``None``
        for ``None``)."""
        if texts is None:
            return None
        if not isinstance(texts, (str, list)):
            raise ArgumentTypeError(name, f"expected a str or a list of str, got {type(texts).__name__} {texts!r}")
        if isinstance(texts, list):
            if not texts:
                raise ArgumentError(name, "expected a str or a non-empty list of str, got an empty list")
            wrong = next((i for i, item in enumerate(texts) if not isinstance(item, str)), None)
            if wrong is not None:
                raise ArgumentTypeError(
                    f"{name}[{wrong}]", f"expected a str, got {type(texts[wrong]).__name__} {texts[wrong]!r}"
                )
        given = 1 if isinstance(texts, str) else len(texts)
        if count is not None and given != count and not (broadcast and isinstance(texts, str)):
            raise ArgumentError(
                name, f"expected {count} prompt{'s' if count > 1 else ''} (as many as prompt), got {given}"
            )
        return given

    def check_image(
        self,
        image: Any,
        name: str = "image",
        resized: bool = False,
        mask: bool = False,
        channels: Optional[Tuple[int, ...]] = None,
    ) -> Tuple[int, int]:
        """Refuses, before any work, an image the pipeline cannot use, naming ``name``: not a PIL image, numpy array
        (``(height, width, channels)``, or a batch of them) or torch tensor (``([batch, ]channels, height,
        width)``), or a list of them; empty (a size of 0); with other ``channels`` than these (default: the VAE
        encoder's; ``()``: any); or, where the image's own size becomes the call's (``resized=False``: img2img),
        smaller than one latent pixel (the VAE's scale factor). A ``mask`` may also be ``(height, width)`` or a
        batch of those, of any channels (it is made grayscale).

        Returns:
            The (first) image's height and width.
        """
        allowed = () if mask else self.codec.image_channels() if channels is None else channels
        items = image if isinstance(image, list) else [image]
        if not items:
            raise ArgumentError(name, "expected an image or a non-empty list of images, got an empty list")
        sizes = []
        for index, item in enumerate(items):
            label = f"{name}[{index}]" if isinstance(image, list) else name
            if isinstance(item, PIL.Image.Image):
                shape, size = None, (item.height, item.width)
            elif isinstance(item, (np.ndarray, torch.Tensor)):
                shape = tuple(item.shape)
                layout = "(height, width, channels)" if isinstance(item, np.ndarray) else "(channels, height, width)"
                if not (2 if mask else 3) <= len(shape) <= 4:
                    also = " or (height, width)" if mask else ""
                    raise ArgumentError(
                        label, f"expected an image of shape {layout}{also}, or a batch of them, got shape {shape}"
                    )
                if isinstance(item, np.ndarray):
                    size, given = (shape[-3:-1], shape[-1]) if len(shape) >= 3 else (shape, 1)
                    if mask and len(shape) == 3 and shape[-1] != 1:  # a mask's (batch, height, width), as diffusers
                        size = shape[1:]
                else:
                    size, given = shape[-2:], (shape[-3] if len(shape) >= 3 else 1)
                if allowed and given not in allowed and 0 not in shape:
                    raise ArgumentError(
                        label,
                        f"expected {' or '.join(map(str, allowed))} channel"
                        f"{'s' if allowed != (1,) else ''} in the layout {layout}, got shape {shape}",
                    )
            else:
                raise ArgumentTypeError(
                    label,
                    f"expected a PIL image, a numpy array or a torch tensor (or a list of them), "
                    f"got {type(item).__name__}",
                )
            if 0 in (shape or size):
                got = f"shape {shape}" if shape is not None else f"{size[0]} × {size[1]} pixels"
                raise ArgumentError(label, f"expected a non-empty image, got {got}")
            factor = self.vae_scale_factor
            if not resized and min(size) < factor:
                raise ArgumentError(
                    label,
                    f"expected at least {factor} × {factor} pixels (one latent pixel: the VAE's "
                    f"scale factor), got {size[0]} × {size[1]}",
                )
            sizes.append(tuple(int(d) for d in size))
        return sizes[0]

    def start_image(self, image: Any, height: Optional[int] = None, width: Optional[int] = None) -> torch.Tensor:
        """The image an image-to-image call starts from, checked and preprocessed (NCHW in [-1, 1], resized to
        ``height`` × ``width`` where both are given, else of its own size rounded down to the VAE's factor)."""
        if image is None:
            raise ArgumentError(
                "image", "expected an image to start from (a PIL image, numpy array or tensor), got None"
            )
        self.check_image(image, "image", resized=height is not None and width is not None)
        pixels = self.image_processor.preprocess(image, height=height, width=width).to(torch.float32)
        self.check_image_size(*pixels.shape[-2:], "image")
        return pixels

    def noised_image_latents(
        self,
        pixels: torch.Tensor,
        timesteps: torch.Tensor,
        generator: Generator,
        batch_size: int,
        num_images_per_prompt: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """The latents an image-to-image loop starts from: ``pixels`` encoded (one image for every prompt, or one
        per prompt, each ``num_images_per_prompt`` times), noised to the first of ``timesteps``."""
        image_latents = self.encode_image(pixels, generator).to(dtype)
        image_latents = expand_to_batch(image_latents, batch_size, num_images_per_prompt, "image")
        noise = self.prepare_latents(tuple(image_latents.shape), dtype, generator)
        return self.scheduler.add_noise(image_latents, noise, timesteps[:1].repeat(image_latents.shape[0]))

    def check_image_size(self, height: int, width: int, name: str = "image") -> None:
        """:meth:`check_size` for a size that an image gave (img2img), naming the image."""
        try:
            self.check_size(height, width)
        except ValueError as error:
            raise ArgumentError(
                name,
                f"a {height} × {width} image (after rounding down to the VAE factor "
                f"{self.vae_scale_factor}) cannot be used: {error}; resize it",
            ) from None

    def check_size(self, height: Any, width: Any) -> None:
        """Height and width must be positive integers the denoiser can run: multiples of :attr:`size_multiple`
        (diffusers rounds others down with a warning; here they are refused, so that the image has the size asked
        for)."""
        multiple = self.size_multiple
        for name, value in (("height", height), ("width", width)):
            if not is_integer(value) or value <= 0:
                raise ArgumentError(name, f"expected a positive integer multiple of {multiple}, got {value!r}")
        if height % multiple != 0 or width % multiple != 0:
            raise ArgumentError(
                "height and width",
                f"expected multiples of {multiple} (the VAE's scale factor "
                f"{self.vae_scale_factor} × {self.denoiser.size_multiple_reason}), got {height} and {width}; e.g. "
                f"{-(-height // multiple) * multiple} × {-(-width // multiple) * multiple}",
            )

    @staticmethod
    def batch_size_of(prompt: Union[str, List[str], None], prompt_embeds: Optional[torch.Tensor]) -> int:
        """How many prompts a call has: one string, a list, or the rows of ``prompt_embeds``."""
        if prompt is not None:
            return 1 if isinstance(prompt, str) else len(prompt)
        return prompt_embeds.shape[0]

    # ------------------------------------------------------------------------------------------------ latents
    def prepare_latents(
        self,
        shape: Tuple[int, ...],
        dtype: torch.dtype,
        generator: Generator,
        latents: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Initial noise on ``self.device``: from a numpy ``RandomState`` (the same numbers as diffusers' ONNX
        pipeline for the same seed; ``None`` means ``np.random``), from a ``torch.Generator``, or given."""
        if latents is not None:
            latents = tensor_of(latents)
            if tuple(latents.shape) != tuple(shape):
                raise ArgumentError("latents", f"expected shape {tuple(shape)}, got {tuple(latents.shape)}")
            return latents.to(device=self.device, dtype=dtype)
        if generator is None or isinstance(generator, np.random.RandomState):
            numpy_dtype = torch.empty((), dtype=dtype).numpy().dtype
            noise = (generator or np.random).randn(*shape).astype(numpy_dtype)
            return upload(torch.from_numpy(noise), self.device)
        if is_torch_generator(generator):
            if self.device.type == "cuda" and on_cpu(generator):
                # drawn on the host as diffusers draws it, then uploaded without making the host wait
                return upload(
                    randn_tensor(shape, generator=generator, device=torch.device("cpu"), dtype=dtype), self.device
                )
            return randn_tensor(shape, generator=generator, device=self.device, dtype=dtype)
        raise ArgumentTypeError(
            "generator",
            f"expected a numpy RandomState, a torch.Generator or a list of torch.Generators "
            f"(one per image), got {type(generator).__name__}",
        )

    def scheduler_step_kwargs(self, generator: Generator, eta: float) -> Dict[str, Any]:
        """``eta`` for DDIM-like schedulers, and a torch generator for stochastic ones (a numpy one cannot serve)."""
        if not is_real(eta) or not 0.0 <= eta <= 1.0:
            raise ArgumentError("eta", f"expected a number in [0, 1] (DDIM's noise share), got {eta!r}")
        accepted = set(inspect.signature(self.scheduler.step).parameters)
        kwargs: Dict[str, Any] = {}
        if "eta" in accepted:
            kwargs["eta"] = eta
        if "generator" in accepted and is_torch_generator(generator):
            kwargs["generator"] = generator  # a list: one per image, as diffusers' schedulers take it
        return kwargs

    def set_timesteps(self, num_inference_steps: int, **scheduler_arguments: Any) -> torch.Tensor:
        """Sets the scheduler's timesteps from the first (``scheduler_arguments``: the scheduler's own, as LCM's
        ``original_inference_steps``), keeping its state on the CPU: its per-step scalars (sigmas, alphas) then meet
        the device tensors as CPU scalars, which never makes the host wait; a schedule on the GPU would (Euler
        compares a sigma with a Python float, DDIM indexes a CPU table with the timestep)."""
        self.scheduler.set_timesteps(num_inference_steps, **scheduler_arguments)
        if hasattr(self.scheduler, "set_begin_index"):
            self.scheduler.set_begin_index(0)
        return self.scheduler.timesteps

    def initial_noise(
        self,
        rows: int,
        height: int,
        width: int,
        dtype: torch.dtype,
        generator: Generator,
        latents: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """A text-to-image loop's first latents on ``self.device``: ``rows`` images of noise (or the given
        ``latents``) of the latent size of ``height`` × ``width``, scaled by the scheduler's initial sigma."""
        shape = (rows, self.latent_channels, height // self.vae_scale_factor, width // self.vae_scale_factor)
        return self.prepare_latents(shape, dtype, generator, latents) * self.scheduler.init_noise_sigma

    def strength_timesteps(self, num_inference_steps: int, strength: float) -> torch.Tensor:
        """The scheduler's timesteps after skipping the first ``1 - strength`` of them (img2img, inpainting)."""
        self.set_timesteps(num_inference_steps)
        init_timestep = min(int(num_inference_steps * strength), num_inference_steps)
        t_start = max(num_inference_steps - init_timestep, 0)
        timesteps = self.scheduler.timesteps[t_start * self.scheduler.order :]
        if hasattr(self.scheduler, "set_begin_index"):
            self.scheduler.set_begin_index(t_start * self.scheduler.order)
        if len(timesteps) == 0:
            raise ArgumentError(
                "strength",
                f"{strength} with num_inference_steps={num_inference_steps} leaves no denoising step; raise either",
            )
        return timesteps

    # ------------------------------------------------------------------------------------------------ step caching
    def enable_cache(self, config: Any) -> None:
        """Caches denoising steps from the next call on, as diffusers' ``enable_cache`` does on a model: a cached
        step runs part of the denoiser and reuses what an earlier step computed for the rest.

        Args:
            config: diffusers' ``FirstBlockCacheConfig(threshold=…)`` for SD3 and FLUX.1 (the first transformer block
                runs; where its residual changed less than the threshold since the last full step, the other blocks
                are skipped and their cached residual added), :class:`~optimum_iobinding.DeepCacheConfig` for the
                Stable Diffusion and SDXL UNets (every ``cache_interval``-th step runs the whole UNet; the others
                its shallow branch over the cached deep features).

        Raises:
            ArgumentTypeError: ``config`` is not a config this family caches with.
            ArgumentError: the config is out of range, this family cannot cache, or the folder was exported
                without the parts the cache runs (the message says how to export them).
        """
        self.denoiser.enable_cache(config)

    def disable_cache(self) -> None:
        """Runs the whole denoiser at every step again (the default)."""
        self.denoiser.disable_cache()

    @property
    def step_cache(self) -> Optional[StepCache]:
        """The enabled step cache (``None``: off); its ``computed`` says which steps of the last call ran whole."""
        return self.denoiser.cache

    # ------------------------------------------------------------------------------------------------- the VAE
    def enable_vae_tiling(
        self, tile_sample_size: Optional[int] = None, overlap: float = 0.25, overlap_copies: bool = True
    ) -> None:
        """Decode (and encode) images larger than a tile tile by tile, as diffusers' ``enable_vae_tiling`` does,
        with each tile's host transfer overlapping the next tile's compute on CUDA (see :class:`TiledVAE`).

        Args:
            tile_sample_size: tile size in pixels, a positive multiple of the VAE's scale factor; ``None`` (the
                default): the VAE config's ``sample_size`` (diffusers' choice). 0 is refused, not read as the default.
            overlap: fraction of a tile blended with each neighbour.
            overlap_copies: overlap transfers with compute (``False``: the sequential comparison).
        """
        size = tile_sample_size
        if size is None:
            value = self.vae_decoder.config.get("sample_size", 512)
            if not is_integer(value) or value <= 0:
                raise ModelFileError(
                    "vae_decoder config.json", f"sample_size: expected a positive integer, got {value!r}"
                )
            size = int(value)
        self.codec.enable_tiling(size, overlap, overlap_copies)

    @property
    def vae_tiler(self) -> Optional[TiledVAE]:
        """The tiler :meth:`enable_vae_tiling` set up (``None`` while tiling is off)."""
        return self.codec.tiler

    def disable_vae_tiling(self) -> None:
        self.codec.disable_tiling()

    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Images in [-1, 1], NCHW, on ``self.device`` (see :meth:`LatentCodec.decode`)."""
        return self.codec.decode(latents)

    def encode_image(self, image: torch.Tensor, generator: Generator) -> torch.Tensor:
        """Scaled latents of ``image`` (NCHW in [-1, 1] on the device; see :meth:`LatentCodec.encode`)."""
        return self.codec.encode(image, generator)

    def postprocess(self, image: torch.Tensor, output_type: str) -> Any:
        """ "pt" stays on the device; "np" and "pil" come back through a pinned buffer, the one wait of the call."""
        if output_type == "pt" or image.device.type != "cuda":
            return self.image_processor.postprocess(image.float(), output_type=output_type)
        image = (image.float() / 2 + 0.5).clamp(0, 1)
        # pinning may allocate and the wait synchronizes: neither may run beside a graph capture in another thread
        with DEVICE_SETUP.setup():
            host = torch.empty(image.shape, dtype=image.dtype, pin_memory=True)
            host.copy_(image, non_blocking=True)
            torch.cuda.current_stream(image.device).synchronize()
        return self.image_processor.postprocess(host, output_type=output_type, do_denormalize=[False] * len(host))

    def finish(
        self, latents: torch.Tensor, output_type: str, return_dict: bool, latent_size: Optional[Tuple[int, int]] = None
    ) -> Any:
        """Decodes (unless ``output_type="latent"``) and packs the output as diffusers does. Packed latents (Flux's
        tokens) are unpacked to ``latent_size`` first. A tiled decode to "np" or "pil" on CUDA downloads each tile
        while the next one decodes."""
        if output_type == "latent":
            image = latents
        else:
            if self.packed_latents:
                latents = unpack_latents(latents, *latent_size)
            if output_type in ("np", "pil") and latents.device.type == "cuda" and self.codec.tiles(latents):
                image = self.codec.decode_to_host(latents)
                if output_type == "pil":
                    image = self.image_processor.numpy_to_pil(image)
            else:
                image = self.postprocess(self.codec.decode(latents), output_type)
        self.maybe_free_model_hooks()
        return self.pack_output(image, return_dict)

    #: the family's output class (diffusers'); its fields beyond ``images`` are ``None``
    output_class: ClassVar[type] = StableDiffusionPipelineOutput

    def pack_output(self, image: Any, return_dict: bool) -> Any:
        """diffusers' output for this family (no safety checker runs: ``nsfw_content_detected`` is ``None``)."""
        fields = [name for name in inspect.signature(self.output_class).parameters if name != "images"]
        if not return_dict:
            return (image, *([None] * len(fields)))
        return self.output_class(images=image, **{name: None for name in fields})


class Warmup:
    """Warm-up for the families whose calls take a prompt and a size (the stream warms up in its ``prepare``)."""

    def warmup(
        self,
        heights: Union[int, Sequence[int], None] = None,
        widths: Union[int, Sequence[int], None] = None,
        batch_sizes: Union[int, Sequence[int]] = 1,
        guidance_scales: Union[float, Sequence[float], None] = None,
        num_inference_steps: int = 2,
        **call_arguments: Any,
    ) -> None:
        """Creates the sessions, chooses the convolution algorithms and captures the CUDA graphs that calls of these
        sizes will use, so that a service's first request runs as fast as its steady state. Each combination runs
        the pipeline once for ``num_inference_steps`` steps on empty prompts (the result is thrown away; no random
        state of the caller's is used). Every argument is checked before the first call: a refused warm-up runs
        nothing.

        Args:
            heights, widths: image sizes in pixels. ``heights`` default: the pipeline's default size; ``widths``
                default: the heights (squares). Lists of the same length pair up; otherwise every combination.
            batch_sizes: images per call (prompts × ``num_images_per_prompt``).
            guidance_scales: guidance scales the calls use (default: the family's ``__call__`` default; for guided
                families > 1 doubles the denoiser's batch, ≤ 1 does not).
            num_inference_steps: steps per warm-up call.
            **call_arguments: further ``__call__`` arguments that shape the calls, among the family's
                :meth:`warmup_arguments` (SD3's and Flux's ``max_sequence_length``: part of the transformer's
                input shapes, so a warm-up at another length makes graphs the calls do not replay).
        """
        known = self.warmup_arguments()
        unknown = sorted(set(call_arguments) - set(known))
        if unknown:
            raise ArgumentTypeError(
                ", ".join(unknown),
                f"unexpected arguments of {type(self).__name__}.warmup{f' (it takes {sorted(known)})' if known else ''}",
            )
        for name, value in call_arguments.items():
            known[name](value)
        if guidance_scales is None:
            guidance_scales = self.family.defaults.guidance_scale
        for height, width, batch_size, guidance_scale in self.warmup_combinations(
            heights, widths, batch_sizes, guidance_scales, num_inference_steps
        ):
            self.warmup_call(height, width, batch_size, guidance_scale, num_inference_steps, **call_arguments)

    def warmup_arguments(self) -> Dict[str, Callable[[Any], None]]:
        """The ``__call__`` arguments :meth:`warmup` passes on, each with its check (none by default)."""
        return {}

    def warmup_combinations(
        self,
        heights: Union[int, Sequence[int], None],
        widths: Union[int, Sequence[int], None],
        batch_sizes: Union[int, Sequence[int]],
        guidance_scales: Union[float, Sequence[float]],
        num_inference_steps: Any,
    ) -> List[Tuple[int, int, int, float]]:
        """Every ``(height, width, batch_size, guidance_scale)`` a :meth:`warmup` of these arguments runs, each
        argument checked first: a warm-up refused runs nothing and changes nothing."""
        as_list = lambda value: list(value) if isinstance(value, (list, tuple)) else [value]  # noqa: E731
        if heights is None:
            heights = self.default_image_size
        heights_list = as_list(heights)
        widths_list = heights_list if widths is None else as_list(widths)
        if len(heights_list) == len(widths_list):
            sizes = list(zip(heights_list, widths_list))
        else:
            sizes = [(h, w) for h in heights_list for w in widths_list]
        if not sizes:
            raise ArgumentError(
                "heights and widths", f"expected at least one size, got heights {heights!r} and widths {widths!r}"
            )
        batches = as_list(batch_sizes)
        wrong = next((b for b in batches if not is_integer(b) or b < 1), None)
        if wrong is not None or not batches:
            raise ArgumentError("batch_sizes", f"expected positive integers, got {batch_sizes!r}")
        for height, width in sizes:
            self.check_size(height, width)
        scales = as_list(guidance_scales)
        if not scales or not all(is_real(scale) and math.isfinite(scale) for scale in scales):
            raise ArgumentError("guidance_scales", f"expected finite numbers, got {guidance_scales!r}")
        if not is_integer(num_inference_steps) or num_inference_steps < 1:
            raise ArgumentError("num_inference_steps", f"expected a positive integer, got {num_inference_steps!r}")
        return [
            (height, width, batch_size, guidance_scale)
            for height, width in sizes
            for batch_size in batches
            for guidance_scale in scales
        ]

    def warmup_call(
        self, height: int, width: int, batch_size: int, guidance_scale: float, steps: int, **call_arguments: Any
    ) -> None:
        """One call of this pipeline at these sizes, on empty prompts and the :meth:`warmup_images`."""
        self(
            prompt=[""] * batch_size,
            num_inference_steps=steps,
            guidance_scale=guidance_scale,
            generator=torch.Generator().manual_seed(0),
            output_type="np",
            **self.warmup_images(height, width),
            **call_arguments,
        )

    def warmup_images(self, height: int, width: int) -> Dict[str, Any]:
        """The image arguments of a warm-up call of this size: the size itself, or a blank image to start from
        (at full strength) for a family that encodes one."""
        if self.encodes_images:
            return {"image": torch.zeros(1, 3, height, width), "strength": 1.0}
        return {"height": height, "width": width}


def expand_to_batch(tensor: torch.Tensor, batch_size: int, num_images_per_prompt: int, name: str) -> torch.Tensor:
    """One image for every prompt, or one per prompt; then ``num_images_per_prompt`` copies of each."""
    if tensor.shape[0] == 1 and batch_size > 1:
        tensor = tensor.expand(batch_size, *tensor.shape[1:])
    elif tensor.shape[0] != batch_size:
        raise ArgumentError(name, f"expected 1 or {batch_size} images (one per prompt), got {tensor.shape[0]}")
    return tensor.repeat_interleave(num_images_per_prompt, dim=0)
