"""The pipeline core every family and the stream stand on, whatever their denoiser: components declared once per family
(:class:`~.components.Component`), the parts made of them (denoiser, prompt encoder, latent codec), the device, the
stream and ``io_binding``, the call guard (one call at a time, on the pipeline's stream), step caching and the
warm-up driver. The rest of the core is one part per job, each a module of its own that the core class is composed
of: loading and saving (:mod:`.loading`), the shared argument checks (:mod:`.checks`), latents and schedules
(:mod:`.latents`), decoding and output (:mod:`.output`).

A family is a declaration — its components, its denoiser part (:mod:`.denoisers`), its prompt part
(:mod:`.prompts`), its VAE constants, its opt-in capabilities (LoRA) — plus its own ``__call__`` in numbered steps."""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Dict, List, Optional, Sequence, Tuple, Union

import torch
from diffusers import DiffusionPipeline
from diffusers.image_processor import VaeImageProcessor

from ..errors import ArgumentError, ArgumentTypeError
from ..families import Family, family, pipeline_class
from ..runtime.model import IOBindingORTModel
from .arguments import is_integer, is_real
from .codec import LatentCodec
from .caching import StepCache
from .checks import ArgumentChecks
from .latents import Latents
from .loading import Loading
from .output import Output
from .components import Component, check_component_kind, names_of
from .denoisers import Denoiser
from .prompts import PromptEncoder


def offload_refused(method: str) -> NotImplementedError:
    """The refusal of diffusers' CPU offloading ``method``: a pipeline of ONNX Runtime sessions has no torch modules
    to move."""
    return NotImplementedError(
        f"{method}: expected a pipeline of torch modules, got one of ONNX Runtime sessions, which stay on their "
        "provider's device; a float16 export, smaller batches or enable_vae_tiling() need less memory"
    )


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
            self.call_decodes = kwargs.get("output_type") != "latent"  # for the loop's start (prepare_decode)
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


class OnnxDiffusionPipeline(Loading, ArgumentChecks, Latents, Output, DiffusionPipeline):
    """Components are :class:`IOBindingORTModel`\\ s; the denoising loop runs in torch on ``self.device``.

    With ``io_binding=True`` (components binding on the session's device) every tensor of the loop stays there and
    only the final image is downloaded. With ``io_binding=False`` the components run ``session.run`` on numpy arrays
    and the loop runs on the CPU: diffusers' numpy pipeline, the baseline.

    A family declares (class attributes): ``declared_components``; ``denoiser_part`` and ``prompt_part`` (a part class,
    or a ``functools.partial`` of one, called with the pipeline); ``vae_constants``; ``settings`` (model_index.json
    entries it takes, with their defaults); ``encodes_images`` (whether a call runs the VAE encoder);
    ``packed_latents`` (Flux's 2×2 tokens); ``codec_part`` (the latent codec's maker, for a VAE that is not an image
    ``AutoencoderKL``'s: Wan's video VAE; ``None``: :class:`~.codec.LatentCodec` with ``vae_constants``); ``family``
    (its record in :mod:`optimum_iobinding.families`: its denoiser component, image-to-image sibling, capabilities and
    defaults);
    ``loading_arguments`` (``from_pretrained`` keywords its :meth:`model_folders` takes). Capabilities are
    opt-in mixins: :class:`Warmup`, LoRA (:class:`~.lora.LoraLoaderMixin`).
    """

    declared_components: ClassVar[Tuple[Component, ...]] = ()
    denoiser_part: ClassVar[Callable[[Any], Denoiser]]
    prompt_part: ClassVar[Callable[[Any], PromptEncoder]]
    codec_part: ClassVar[Optional[Callable[[Any], Any]]] = None
    vae_constants: ClassVar[VaeConstants] = VaeConstants(0.18215, None, "SD 1.x/2.x use 0.18215, SDXL 0.13025")
    settings: ClassVar[Dict[str, Any]] = {}
    encodes_images: ClassVar[bool] = False
    packed_latents: ClassVar[bool] = False
    #: the family's description (:mod:`optimum_iobinding.families`): its denoiser, sibling, capabilities, defaults
    family: ClassVar[Family]
    loading_arguments: ClassVar[Tuple[str, ...]] = ()
    #: whether sessions and first runs are made in background threads (``from_pretrained``'s argument)
    prepare_in_background: bool = True
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
        self.call_decodes = False  # whether the call under way decodes its latents (set by each call)
        self.denoiser: Denoiser = self.denoiser_part(self)
        self.denoiser.check_model()
        self.prompt: PromptEncoder = self.prompt_part(self)
        if hasattr(self.prompt, "check_encoders"):
            self.prompt.check_encoders()
        constants = self.vae_constants
        self.codec = (
            LatentCodec(self, constants.scaling_factor, constants.shift_factor, constants.hint)
            if self.codec_part is None
            else self.codec_part(self)
        )
        self.latent_channels = self.denoiser.latent_channels(self.vae_decoder)
        # Flux's 2×2 packing halves the latents once more: images are multiples of twice the VAE's factor; a family
        # whose components include an image processor of its own (Wan 2.1 I2V's CLIP one) keeps it under that name.
        # A PIL image of another mode (grayscale, RGBA, a palette) is made RGB for an RGB encoder, as diffusers'
        # load_image makes it (a codec that does not say its channels: as given)
        if "image_processor" not in names:
            channels = self.codec.image_channels() if hasattr(self.codec, "image_channels") else ()
            self.image_processor = VaeImageProcessor(
                vae_scale_factor=self.vae_scale_factor * (2 if self.packed_latents else 1),
                do_convert_rgb=channels == (3,),
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
    def dtype(self) -> torch.dtype:
        """The precision of the export: the dtype of the denoiser's latents (diffusers' ``dtype`` is its torch
        modules', which a pipeline of ONNX sessions has none of: it said float32 for a float16 export)."""
        return self.denoiser.model.input_dtypes.get(self.denoiser.sample_input, torch.float32)

    @classmethod
    def from_pipe(cls, pipeline: Any, **kwargs: Any) -> Any:
        """diffusers' ``from_pipe``: a pipeline of another class on ``pipeline``'s components (sessions shared), in
        its precision unless ``dtype`` (or ``torch_dtype``) says another (diffusers' default, float32, which an
        export of another precision cannot take)."""
        if kwargs.get("torch_dtype") is None and kwargs.get("dtype") is None and hasattr(pipeline, "denoiser"):
            kwargs["dtype"] = pipeline.dtype
        made = super().from_pipe(pipeline, **kwargs)
        share = getattr(made, "share_lora_state", None)
        if share is not None:  # the LoRA adapters live with the shared models, as diffusers' do
            share(pipeline)
        return made

    def to(self, *args: Any, **kwargs: Any) -> "OnnxDiffusionPipeline":
        """diffusers' ``to(device, dtype)``: the pipeline runs where its ONNX Runtime provider put it (:attr:`device`)
        and in the precision its export has (:attr:`dtype`), so ``to`` moves nothing: it returns the pipeline where
        the device and dtype given are already its own, and refuses others, saying how to get them (the provider at
        load, the export's ``--dtype``). diffusers' pipeline moved nothing either, silently."""
        kwargs.pop("silence_dtype_warnings", None)
        unknown = sorted(set(kwargs) - {"device", "dtype"})
        if unknown:
            raise ArgumentTypeError(
                ", ".join(unknown), f"unexpected arguments of to: expected device and dtype, got {', '.join(unknown)}"
            )
        if len(args) > 2:
            raise ArgumentTypeError(
                "to", f"expected at most a device and a dtype, got {len(args)} positional arguments"
            )
        given = {name: value for name, value in kwargs.items() if value is not None}  # None: not given, as diffusers'
        for value in args:
            name = "dtype" if isinstance(value, torch.dtype) else "device"
            if name in given:
                raise ArgumentTypeError(name, "expected it once, got it twice")
            given[name] = value
        device, dtype = given.get("device"), given.get("dtype")
        if device is not None:
            try:
                wanted = torch.device(device)
            except (RuntimeError, TypeError):
                raise ArgumentError("device", f"expected a device such as 'cuda' or 'cpu', got {device!r}") from None
            here = self.device
            if wanted.type != here.type or (here.type == "cuda" and wanted.index not in (None, here.index)):
                if wanted.type == "cuda" and here.type == "cuda":
                    how = f"load it with provider_options device_id={wanted.index} for {str(wanted)!r}"
                elif wanted.type == "cuda":
                    how = "load it with provider='CUDAExecutionProvider' (and io_binding=True) for CUDA"
                elif wanted.type == "cpu":
                    how = "load it with provider='CPUExecutionProvider' for the CPU"
                else:
                    how = "its providers here run on the CPU or CUDA"
                raise ArgumentError(
                    "device",
                    f"expected {str(here)!r}, where the pipeline's ONNX Runtime provider runs it (a pipeline does not "
                    f"move: {how}), got {str(wanted)!r}",
                )
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise ArgumentTypeError("dtype", f"expected a torch.dtype such as torch.float16, got {dtype!r}")
        if dtype is not None and dtype != self.dtype:
            names = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
            how = f"export it with --dtype {names[dtype]}" if dtype in names else "exports are fp32, fp16 or bf16"
            raise ArgumentError(
                "dtype", f"expected {self.dtype} (the precision of the export; {how} for {dtype}), got {dtype}"
            )
        return self

    def enable_model_cpu_offload(self, *args: Any, **kwargs: Any) -> None:
        """diffusers' offloading moves torch modules between devices; ONNX Runtime sessions stay where their
        provider put them: refused, saying what lowers the memory instead."""
        raise offload_refused("enable_model_cpu_offload")

    def enable_sequential_cpu_offload(self, *args: Any, **kwargs: Any) -> None:
        """As :meth:`enable_model_cpu_offload`: refused."""
        raise offload_refused("enable_sequential_cpu_offload")

    def enable_group_offload(self, *args: Any, **kwargs: Any) -> None:
        """As :meth:`enable_model_cpu_offload`: refused."""
        raise offload_refused("enable_group_offload")

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
        return self._sibling(self.family.image_to_image)

    def inpainting(self) -> Optional["OnnxDiffusionPipeline"]:
        """This pipeline's inpainting sibling on the same components (no second copy of any model), or ``None``
        where the family has none or the folder has no VAE encoder."""
        return self._sibling(self.family.inpainting)

    def _sibling(self, key: Optional[str]) -> Optional["OnnxDiffusionPipeline"]:
        """The pipeline of family ``key`` on this one's components, where ``key`` is set and a VAE encoder is there."""
        if key is None or getattr(self, "vae_encoder", None) is None:
            return None
        sibling = pipeline_class(family(key))
        accepted = {*names_of(sibling.declared_components), "scheduler", *sibling.settings}
        made = sibling(**{name: module for name, module in self.components.items() if name in accepted})
        made.prepare_in_background = self.prepare_in_background
        return made

    # ---------------------------------------------------------------------------------------------------- warm-up
    def prepare_sessions(self) -> None:
        """On the first call, each component's shape-free session starts building in a background thread
        (:meth:`IOBindingORTModel.prepare`), where the load has not started it (a pipeline made from components): the
        denoiser's and the VAE's are made while the text encoder's is made and run, instead of one after another.
        The VAE encoder only where the family encodes images; nothing with ``prepare_in_background=False``. A codec
        with models beside the components (Wan's chunk graphs: ``session_parts``) has theirs started too."""
        if not self._sessions_started and self.prepare_in_background:
            self._sessions_started = True
            parts = getattr(self.codec, "session_parts", None)
            for name, model in self.onnx_models.items():
                if name != "vae_encoder" or self.encodes_images:
                    model.prepare(wait=False)
            for model in parts(self.encodes_images) if parts is not None else ():
                model.prepare(wait=False)

    # ------------------------------------------------------------------------------------------------ step caching
    def enable_cache(self, config: Any) -> None:
        """Caches denoising steps from the next call on, as diffusers' ``enable_cache`` does on a model: a cached
        step runs part of the denoiser and reuses what an earlier step computed for the rest.

        Args:
            config: diffusers' ``FirstBlockCacheConfig(threshold=…)`` for SD3, FLUX.1 and Wan (the first transformer
                block runs; where its residual changed less than the threshold since the last full step, the other
                blocks are skipped and their cached residual added; Wan 2.2's experts each cache their own steps),
                :class:`~optimum_iobinding.DeepCacheConfig` for the Stable Diffusion and SDXL UNets (every
                ``cache_interval``-th step runs the whole UNet; the others its shallow branch over the cached deep
                features).

        Raises:
            ArgumentTypeError: ``config`` is not a config this family caches with.
            ArgumentError: a cache is enabled already (as diffusers: :meth:`disable_cache` first), the config is
                out of range, this family cannot cache, or the folder was exported without the parts the cache runs
                (the message says how to export them).
        """
        if self.step_cache is not None:
            raise ArgumentError(
                "enable_cache",
                f"expected no cache enabled, got {type(self.step_cache.config).__name__} enabled already: call "
                "disable_cache() first to cache with another config (as diffusers asks)",
            )
        self.denoiser.enable_cache(config)

    def disable_cache(self) -> None:
        """Runs the whole denoiser at every step again (the default)."""
        self.denoiser.disable_cache()

    @property
    def step_cache(self) -> Optional[StepCache]:
        """The enabled step cache (``None``: off); its ``computed`` says which steps of the last call ran whole."""
        return self.denoiser.cache


class Warmup:
    """Warm-up for the families whose calls take a prompt and a size (the stream warms up in its ``prepare``)."""

    _warming_up = False  # True while warmup's calls run: they show no progress bar (they are set-up, not work asked)

    def progress_bar(self, iterable: Any = None, total: Optional[int] = None) -> Any:
        """diffusers' progress bar of the steps; none during :meth:`warmup`."""
        if self._warming_up:
            from tqdm.auto import tqdm

            return tqdm(iterable, total=total, disable=True)
        return super().progress_bar(iterable=iterable, total=total)  # type: ignore[misc]

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
            heights, widths: image sizes in pixels. Without ``heights``: the call's default size
                (:meth:`warmup_default_size`); ``widths`` default: the heights (squares). Lists of the same length
                pair up; otherwise every combination.
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
        combinations = self.warmup_combinations(heights, widths, batch_sizes, guidance_scales, num_inference_steps)
        warming_up, self._warming_up = self._warming_up, True
        try:
            for height, width, batch_size, guidance_scale in combinations:
                self.warmup_call(height, width, batch_size, guidance_scale, num_inference_steps, **call_arguments)
        finally:
            self._warming_up = warming_up

    def warmup_arguments(self) -> Dict[str, Callable[[Any], None]]:
        """The ``__call__`` arguments :meth:`warmup` passes on, each with its check (none by default)."""
        return {}

    def warmup_default_size(self) -> Tuple[int, int]:
        """The ``(height, width)`` a warm-up without ``heights`` runs at: the call's default size (a square of
        :attr:`~OnnxDiffusionPipeline.default_image_size`; a family whose default is not square says its own)."""
        return self.default_image_size, self.default_image_size

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
        default_height, default_width = self.warmup_default_size()
        if heights is None:
            heights = default_height
            widths = default_width if widths is None else widths
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
