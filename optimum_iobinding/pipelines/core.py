"""The pipeline every Stable Diffusion family builds on: its components, what it reads from them once, loading and
saving, warm-up, argument checks, prompt encoding, latents, timestep inputs and the VAE — all as torch tensors on the
UNet's device. The denoising loop is :mod:`.denoise`'s; each family's ``__call__`` is in its own file."""

from __future__ import annotations

import inspect
import logging
import math
import os
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import PIL.Image
import torch
from diffusers import DiffusionPipeline
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.stable_diffusion import StableDiffusionPipelineOutput
from diffusers.schedulers.scheduling_utils import SchedulerMixin
from diffusers.utils.torch_utils import randn_tensor

from ..layout import (
    ONNX_COMPONENTS,
    building_beside,
    check_output_folder,
    resolve_pipeline_folder,
    save_tokenizer,
    write_model_index,
)
from ..runtime.hub import check_hub_kwargs
from ..runtime.cuda_policy import DEVICE_SETUP
from ..runtime.inputs import as_checked_tensor
from ..runtime.model import IOBindingORTModel
from ..runtime.options import CudaGraphSetting, PipelineOptions, ProviderSpec
from ..runtime.shapes import infer_output_shapes
from .arguments import Generator, is_integer, is_real, is_torch_generator
from .denoise import CALLBACK_TENSOR_INPUTS, check_callback_arguments, denoise
from .lora import LoraLoaderMixin
from .loading import check_component_kind, component_kind, load_components
from .tiling import TiledVAE

logger = logging.getLogger(__name__)


def tensor_of(value: Union[torch.Tensor, np.ndarray]) -> torch.Tensor:
    """Given embeddings or latents as a torch tensor: a numpy array is wrapped (one of the other byte order is
    converted to the native one first, as the models' inputs are)."""
    if isinstance(value, np.ndarray) and not value.dtype.isnative:
        value = value.astype(value.dtype.newbyteorder("="))
    return torch.as_tensor(value)


class OnnxStableDiffusionPipelineBase(LoraLoaderMixin, DiffusionPipeline):
    """Components are :class:`IOBindingORTModel`\\ s; the denoising loop runs in torch on ``self.device``.

    With ``io_binding=True`` (components binding on the session's device) every tensor of the loop stays there and
    only the final image is downloaded. With ``io_binding=False`` the components run ``session.run`` on numpy arrays
    and the loop runs on the CPU: diffusers' numpy pipeline, the baseline.
    """

    _optional_components = ["vae_encoder", "safety_checker", "feature_extractor"]
    model_cpu_offload_seq = "text_encoder->unet->vae_decoder"
    # the ONNX folders and tokenizers this pipeline loads, and the model_index.json settings it takes
    _onnx_components: Tuple[str, ...] = ONNX_COMPONENTS
    _tokenizer_names: Tuple[str, ...] = ("tokenizer",)
    _index_settings: Tuple[str, ...] = ()
    # UNet inputs beyond sample, timestep and encoder_hidden_states that this pipeline feeds
    _unet_extra_inputs: Tuple[str, ...] = ()
    # the UNet's sample_size (in latents) where its config.json gives none: SD1.5's 64 (512 px)
    _default_unet_sample_size = 64
    # whether a call encodes images (img2img, inpaint): only then is the VAE encoder's session prepared
    _encodes_images = False
    # the loop's tensors a step-end callback may ask for (diffusers' name for the list)
    _callback_tensor_inputs = list(CALLBACK_TENSOR_INPUTS)
    # the VAE's latent scaling for a vae_decoder whose config.json names none (diffusers' ONNX conversion writes no
    # config.json; a hand-made folder may leave the key out): AutoencoderKL's default, SD 1.x/2.x's; and the family's
    # constants, quoted by the error on a bad value
    _default_vae_scaling_factor = 0.18215
    _vae_constants_hint = "SD 1.x/2.x use 0.18215, SDXL 0.13025"

    def __init__(
        self,
        vae_encoder: Optional[IOBindingORTModel],
        vae_decoder: IOBindingORTModel,
        text_encoder: IOBindingORTModel,
        tokenizer: Any,
        unet: IOBindingORTModel,
        scheduler: SchedulerMixin,
        safety_checker: Any = None,
        feature_extractor: Any = None,
        requires_safety_checker: bool = False,
    ):
        super().__init__()
        self.register_modules(
            vae_encoder=vae_encoder, vae_decoder=vae_decoder, text_encoder=text_encoder, tokenizer=tokenizer,
            unet=unet, scheduler=scheduler, safety_checker=safety_checker, feature_extractor=feature_extractor,
        )
        self.register_to_config(requires_safety_checker=requires_safety_checker)
        self._init_image_side()

    def _init_image_side(self) -> None:
        """What every pipeline reads from its VAE and UNet once, after its modules are registered."""
        for name in self._onnx_components:
            check_component_kind(name, getattr(self, name, None))
        self._check_unet_inputs()
        self._vae_tiler: Optional[TiledVAE] = None
        self.vae_scale_factor = self._read_vae_scale_factor()
        self.latent_channels = self._read_latent_channels()
        self.vae_scaling_factor = self._read_vae_scaling_factor()
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor)
        self._call_lock = threading.RLock()
        self._calling = threading.local()  # set while this thread is inside a call (a callback re-entering is refused)
        self._prepared = False

    # ------------------------------------------------------------------------------------------------- properties
    #: the component the loop calls at every step (``"transformer"`` for the diffusion transformers): its session
    #: decides where the loop's tensors live, the stream and whether tensors are bound
    denoiser_name = "unet"

    @property
    def denoiser(self) -> IOBindingORTModel:
        """The component the loop calls at every step (the UNet, or a diffusion transformer)."""
        return getattr(self, self.denoiser_name)

    @property
    def device(self) -> torch.device:
        """Where the loop's tensors live: the denoiser session's device (the CPU for the numpy baseline)."""
        return self.denoiser.device if self.denoiser.io_binding else torch.device("cpu")

    @property
    def _execution_device(self) -> torch.device:
        return self.device

    @property
    def stream(self) -> Optional["torch.cuda.Stream"]:
        """The CUDA stream shared by the components and the loop's torch ops (``None`` off CUDA)."""
        return self.denoiser.stream

    @property
    def io_binding(self) -> bool:
        return self.denoiser.io_binding

    def _check_unet_inputs(self) -> None:
        declared = self.unet.input_names
        expected = ["sample", "timestep", "encoder_hidden_states", *self._unet_extra_inputs]
        unexpected = [name for name in declared if name not in expected]
        missing = [name for name in expected if name not in declared]
        if not unexpected and not missing:
            return
        hints = {"timestep_cond": "an LCM UNet: use OnnxLatentConsistencyModelPipeline",
                 "text_embeds": "an SDXL UNet: use OnnxStableDiffusionXLPipeline or its Img2Img",
                 "time_ids": "an SDXL UNet: use OnnxStableDiffusionXLPipeline or its Img2Img",
                 "mid_block_additional_residual": "a UNet exported with a ControlNet: use "
                                                  "OnnxStableDiffusionControlNetPipeline or its Img2Img"}
        hint = next((hints[name] for name in unexpected if name in hints), None)
        found = component_kind(declared)
        if hint is None and found not in (None, "a UNet"):
            hint = f"{found}, not a UNet: put the right model.onnx in the unet folder"
        if hint is None and missing:
            hint = f"{type(self).__name__} needs a UNet exported with {missing}"
        raise ValueError(f"unet: expected inputs {expected}, got {declared} ({hint})")

    def _read_vae_scaling_factor(self) -> float:
        return self._vae_config_float("scaling_factor", self._default_vae_scaling_factor, positive=True)

    def _vae_config_float(self, key: str, default: float, positive: bool) -> float:
        """A latent constant of the VAE decoder's config.json (``scaling_factor``, ``shift_factor``): ``default``
        where the key is absent or null, refused by name where it is not a finite number (or, with ``positive``, not
        above zero)."""
        value = self.vae_decoder.config.get(key)
        value = default if value is None else value
        if not is_real(value) or not math.isfinite(value) or (positive and value <= 0):
            raise ValueError(f"vae_decoder config.json: {key}: expected a {'positive ' if positive else ''}finite "
                             f"number, got {value!r} ({self._vae_constants_hint})")
        return float(value)

    def _read_vae_scale_factor(self) -> int:
        blocks = self.vae_decoder.config.get("block_out_channels")
        if blocks is not None:
            if not isinstance(blocks, list) or not blocks or len(blocks) > 8:
                raise ValueError(f"vae_decoder config.json: block_out_channels: expected a list of 1 to 8 channel "
                                 f"counts, got {blocks!r}")
            factor = 2 ** (len(blocks) - 1)
            channels = self._declared_dim(self.vae_decoder, "latent_sample", 1) or 4
            try:
                shapes = infer_output_shapes(self.vae_decoder, {"latent_sample": (1, channels, 8, 8)})
            except ValueError:
                shapes = {}
            image_shape = next(iter(shapes.values()), None)
            if image_shape is not None and image_shape[2] != 8 * factor:
                raise ValueError(f"vae_decoder config.json: block_out_channels: {len(blocks)} blocks mean a scale "
                                 f"factor of {factor}, but the decoder turns 8 latent rows into {image_shape[2]} "
                                 f"(a factor of {image_shape[2] // 8})")
            return factor
        # No config: ask the decoder how much larger its output is than its input.
        channels = self._declared_dim(self.vae_decoder, "latent_sample", 1) or 4
        shapes = infer_output_shapes(self.vae_decoder, {"latent_sample": (1, channels, 8, 8)})
        image_shape = next(iter(shapes.values()))
        if image_shape is None:
            raise ValueError("vae_decoder: cannot tell its upsampling factor: no config.json and its output shape "
                             "is not inferable")
        return image_shape[2] // 8

    def _read_latent_channels(self) -> int:
        configured = self.vae_decoder.config.get("latent_channels")
        if configured is not None:
            declared = {name: self._declared_dim(model, input_name, 1) for name, model, input_name in
                        (("vae_decoder", self.vae_decoder, "latent_sample"), ("unet", self.unet, "sample"))}
            if not is_integer(configured) or configured < 1:
                raise ValueError(f"vae_decoder config.json: latent_channels: expected a positive integer, got "
                                 f"{configured!r}")
            if declared["vae_decoder"] is not None and declared["vae_decoder"] != configured:
                raise ValueError(f"vae_decoder config.json: latent_channels: expected {declared['vae_decoder']} (the "
                                 f"decoder's latent_sample channels), got {configured}")
            if declared["vae_decoder"] is None and declared["unet"] is not None and declared["unet"] < configured:
                raise ValueError(f"vae_decoder config.json: latent_channels: expected at most {declared['unet']} (the "
                                 f"UNet's sample channels), got {configured}")
            return int(configured)
        if self.unet.config.get("out_channels"):
            return int(self.unet.config["out_channels"])
        channels = self._declared_dim(self.vae_decoder, "latent_sample", 1) or self._declared_dim(self.unet, "sample", 1)
        if channels is None:
            raise ValueError("vae_decoder: cannot tell the number of latent channels: no config.json and a dynamic "
                             "channel dim")
        return channels

    @staticmethod
    def _declared_dim(model: IOBindingORTModel, input_name: str, axis: int) -> Optional[int]:
        dims = model.input_dims.get(input_name)
        if dims is not None and len(dims) > axis and isinstance(dims[axis], int):
            return dims[axis]
        return None

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
        scheduler: Optional[SchedulerMixin] = None,
        tokenizer: Any = None,
        component_options: Optional[Dict[str, Dict[str, Any]]] = None,
        **hub_kwargs: Any,
    ):
        """Loads a diffusers-converted ONNX folder or an ``optimum-cli export onnx`` folder, or a hub id.

        Args:
            pretrained_model_name_or_path: local folder or hub repository id.
            provider, provider_options, sess_options: for every ONNX component (see :class:`IOBindingORTModel`).
            io_binding: bind torch tensors on the session's device (default), or run diffusers' numpy baseline.
            cuda_graph: ``"auto"`` (default): on CUDA every component captures each input signature as a CUDA graph
                where it can (one INFO log line where it cannot); ``True``: the same, but a UNet signature that
                cannot be captured warns; ``False``: no graphs (see :class:`IOBindingORTModel`). Sessions are created lazily, one per input
                signature, sharing one copy of the weights; :meth:`warmup` creates them ahead of the first request.
            scheduler, tokenizer: replace the folder's.
            component_options: per component (``"unet"``, ``"text_encoder"``, ``"vae_decoder"``, …) settings of its
                :class:`IOBindingORTModel` that override the ones above: ``cuda_graph``, ``reuse_outputs``,
                ``max_output_signatures``, ``max_graph_signatures``, ``share_weights``.
            **hub_kwargs: for ``huggingface_hub.snapshot_download`` (revision, token, cache_dir, local_files_only).
        """
        check_hub_kwargs(f"{cls.__name__}.from_pretrained", hub_kwargs)
        options = PipelineOptions.resolve(cls._onnx_components, provider, provider_options, sess_options, io_binding,
                                          cuda_graph, component_options)  # checked before any download
        folder = resolve_pipeline_folder(pretrained_model_name_or_path, cls._download_components(),
                                          cls._tokenizer_names, **hub_kwargs)
        return cls(**load_components(cls, folder, options, scheduler, tokenizer))

    @classmethod
    def _download_components(cls) -> Sequence[str]:
        """The component folders to fetch from the Hub (glob patterns)."""
        return cls._onnx_components

    @classmethod
    def _components_in(cls, folder: Path) -> Tuple[str, ...]:
        """The ONNX components to load from ``folder`` (a pipeline with a variable number of them finds them)."""
        return cls._onnx_components

    # ---------------------------------------------------------------------------------------------------- warm-up
    def warmup(
        self,
        heights: Union[int, Sequence[int], None] = None,
        widths: Union[int, Sequence[int], None] = None,
        batch_sizes: Union[int, Sequence[int]] = 1,
        guidance_scales: Union[float, Sequence[float]] = 7.5,
        num_inference_steps: int = 2,
    ) -> None:
        """Creates the sessions, chooses the convolution algorithms and captures the CUDA graphs that calls of these
        sizes will use, so that a service's first request runs as fast as its steady state. Each combination runs
        the pipeline once for ``num_inference_steps`` steps on empty prompts (the result is thrown away; no random
        state of the caller's is used). Every argument is checked before the first call.

        Args:
            heights, widths: image sizes in pixels. ``heights`` default: the pipeline's default size; ``widths``
                default: the heights (squares). Lists of the same length pair up; otherwise every combination.
            batch_sizes: images per call (prompts × ``num_images_per_prompt``).
            guidance_scales: guidance scales the calls use (> 1 doubles the UNet batch; ≤ 1 does not).
            num_inference_steps: steps per warm-up call.
        """
        for height, width, batch_size, guidance_scale in self._warmup_combinations(
                heights, widths, batch_sizes, guidance_scales, num_inference_steps):
            self._warmup_call(height, width, batch_size, guidance_scale, num_inference_steps)

    def _warmup_combinations(
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
            raise ValueError(f"heights and widths: expected at least one size, got heights {heights!r} and widths "
                             f"{widths!r}")
        batches = as_list(batch_sizes)
        wrong = next((b for b in batches if not is_integer(b) or b < 1), None)
        if wrong is not None or not batches:
            raise ValueError(f"batch_sizes: expected positive integers, got {batch_sizes!r}")
        for height, width in sizes:
            self.check_size(height, width)
        scales = as_list(guidance_scales)
        if not scales or not all(is_real(scale) and math.isfinite(scale) for scale in scales):
            raise ValueError(f"guidance_scales: expected finite numbers, got {guidance_scales!r}")
        if not is_integer(num_inference_steps) or num_inference_steps < 1:
            raise ValueError(f"num_inference_steps: expected a positive integer, got {num_inference_steps!r}")
        return [(height, width, batch_size, guidance_scale) for height, width in sizes for batch_size in batches
                for guidance_scale in scales]

    def _warmup_call(self, height: int, width: int, batch_size: int, guidance_scale: float, steps: int) -> None:
        """One call of this pipeline at these sizes (pipelines that need an image override it)."""
        self(prompt=[""] * batch_size, height=height, width=width, num_inference_steps=steps,
             guidance_scale=guidance_scale, generator=torch.Generator().manual_seed(0), output_type="np")

    def _prepare_sessions(self) -> None:
        """On the first call, each component's shape-free session starts building in a background thread
        (:meth:`IOBindingORTModel.prepare`): the UNet's and the VAE's are made while the text encoder's is made and
        run, instead of one after another."""
        if not self._prepared:
            self._prepared = True
            for name, model in self.onnx_models.items():
                if name != "vae_encoder" or self._encodes_images:  # text-to-image never runs the encoder
                    model.prepare(wait=False)

    #: the family's image-to-image pipeline (the same components, an image to start from), where it has one
    image_to_image_class: Optional[type] = None

    def image_to_image(self) -> Optional["OnnxStableDiffusionPipelineBase"]:
        """This pipeline's image-to-image sibling on the same components (no second copy of any model), or ``None``
        where the family has none or the folder has no VAE encoder."""
        sibling = self.image_to_image_class
        if sibling is None or getattr(self, "vae_encoder", None) is None:
            return None
        accepted = inspect.signature(sibling.__init__).parameters
        return sibling(**{name: module for name, module in self.components.items() if name in accepted})

    @property
    def onnx_models(self) -> Dict[str, IOBindingORTModel]:
        """The pipeline's ONNX components by name."""
        return {name: getattr(self, name) for name in self._onnx_components
                if isinstance(getattr(self, name, None), IOBindingORTModel)}

    @property
    def sessions_created(self) -> int:
        """ORT sessions created so far by all components (a warmed-up service creates no more)."""
        return sum(model.sessions_created for model in self.onnx_models.values())

    def save_pretrained(self, save_directory: Union[str, os.PathLike], overwrite: bool = False) -> None:
        """Writes the diffusers ONNX layout, which this class and diffusers' own ONNX pipeline both load.

        The folder is built beside ``save_directory`` and moved into place when whole, so a failed save leaves
        what was there. ``save_directory`` must be new or empty unless ``overwrite=True``, which replaces it whole
        (the folder the pipeline was loaded from included: its files are copied out first).
        """
        target = check_output_folder(save_directory, None, overwrite, argument="save_directory")
        with building_beside(target) as scratch:
            written = []
            for name in self._onnx_components:
                model = getattr(self, name, None)
                if model is not None:
                    model.save_pretrained(scratch / name)
                    written.append(name)
            for name in self._tokenizer_names:
                if getattr(self, name, None) is not None:
                    save_tokenizer(getattr(self, name), scratch / name)
            self.scheduler.save_pretrained(str(scratch / "scheduler"))
            self._write_model_index(scratch, written)

    def _write_model_index(self, target: Path, written: List[str]) -> None:
        write_model_index(target, type(self.scheduler).__name__, type(self.tokenizer).__name__, written)

    # ----------------------------------------------------------------------------------------------- the pieces
    def check_inputs(
        self,
        prompt: Union[str, List[str], None],
        height: int,
        width: int,
        num_inference_steps: int,
        callback_steps: Optional[int],
        negative_prompt: Union[str, List[str], None] = None,
        prompt_embeds: Optional[torch.Tensor] = None,
        negative_prompt_embeds: Optional[torch.Tensor] = None,
        output_type: str = "pil",
        strength: Optional[float] = None,
        guidance_scale: Optional[float] = None,
        num_images_per_prompt: int = 1,
        callback_on_step_end: Any = None,
        callback_on_step_end_tensor_inputs: Any = ("latents",),
    ) -> None:
        """Refuses, before any work, every argument the call cannot run with, naming it, what was expected and
        what came."""
        check_callback_arguments(callback_on_step_end, callback_on_step_end_tensor_inputs)
        if strength is not None and (not is_real(strength) or not 0.0 <= strength <= 1.0):
            raise ValueError(f"strength: expected a value in [0, 1], got {strength!r}")
        if guidance_scale is not None and (not is_real(guidance_scale) or not math.isfinite(guidance_scale)):
            raise ValueError(f"guidance_scale: expected a finite number, got {guidance_scale!r}")
        if not is_integer(num_images_per_prompt) or num_images_per_prompt < 1:
            raise ValueError(f"num_images_per_prompt: expected a positive integer, got {num_images_per_prompt!r}")
        self.check_size(height, width)
        if not is_integer(num_inference_steps) or num_inference_steps <= 0:
            raise ValueError(f"num_inference_steps: expected a positive integer, got {num_inference_steps!r}")
        train_steps = getattr(self.scheduler.config, "num_train_timesteps", None)
        if train_steps and num_inference_steps > train_steps:
            raise ValueError(f"num_inference_steps: expected at most {train_steps} (the scheduler's "
                             f"num_train_timesteps), got {num_inference_steps}")
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt: expected a str or a non-empty list of str, got an empty list")
        for name, texts in (("prompt", prompt), ("negative_prompt", negative_prompt)):
            if isinstance(texts, list):
                wrong = next((i for i, item in enumerate(texts) if not isinstance(item, str)), None)
                if wrong is not None:
                    raise TypeError(f"{name}[{wrong}]: expected a str, got {type(texts[wrong]).__name__} "
                                    f"{texts[wrong]!r}")
        for name, embeds in (("prompt_embeds", prompt_embeds), ("negative_prompt_embeds", negative_prompt_embeds)):
            if embeds is not None:
                self.check_embeds(name, embeds, 3, "(batch, sequence, hidden)", "encoder_hidden_states")
        if output_type not in ("pil", "np", "pt", "latent"):
            raise ValueError(f"output_type: expected 'pil', 'np', 'pt' or 'latent', got {output_type!r}")
        if not isinstance(num_inference_steps, int) or num_inference_steps <= 0:
            raise ValueError(f"num_inference_steps: expected a positive integer, got {num_inference_steps!r}")
        if callback_steps is not None and (not isinstance(callback_steps, int) or callback_steps <= 0):
            raise ValueError(f"callback_steps: expected a positive integer, got {callback_steps!r}")
        if prompt is not None and prompt_embeds is not None:
            raise ValueError("prompt and prompt_embeds: expected one of them, got both")
        if prompt is None and prompt_embeds is None:
            raise ValueError("prompt and prompt_embeds: expected one of them, got neither")
        if prompt is not None and not isinstance(prompt, (str, list)):
            raise TypeError(f"prompt: expected a str or a list of str, got {type(prompt).__name__}")
        if negative_prompt is not None and negative_prompt_embeds is not None:
            raise ValueError("negative_prompt and negative_prompt_embeds: expected at most one of them, got both")
        if isinstance(prompt, list) and isinstance(negative_prompt, list) and len(prompt) != len(negative_prompt):
            raise ValueError(f"negative_prompt: expected a list of {len(prompt)} (as many as prompt), "
                             f"got {len(negative_prompt)}")
        if negative_prompt is not None and prompt is not None and type(prompt) is not type(negative_prompt):
            raise TypeError(f"negative_prompt: expected a {type(prompt).__name__} like prompt, "
                            f"got {type(negative_prompt).__name__}")
        if prompt_embeds is not None and negative_prompt_embeds is not None and \
                tuple(prompt_embeds.shape) != tuple(negative_prompt_embeds.shape):
            raise ValueError(f"negative_prompt_embeds: expected shape {tuple(prompt_embeds.shape)} like "
                             f"prompt_embeds, got {tuple(negative_prompt_embeds.shape)}")
        if prompt is not None and negative_prompt_embeds is not None and \
                negative_prompt_embeds.shape[0] != self.batch_size_of(prompt, None):
            raise ValueError(f"negative_prompt_embeds: expected {self.batch_size_of(prompt, None)} rows (one per "
                             f"prompt), got shape {tuple(negative_prompt_embeds.shape)}")

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
            raise TypeError(f"{name}: expected a dense torch.Tensor or numpy array {layout}, got {kind}")
        if not floating:
            raise TypeError(f"{name}: expected a float tensor (the text encoder's output), got dtype {dtype}")
        if embeds.ndim != rank:
            raise ValueError(f"{name}: expected shape {layout}, got {tuple(embeds.shape)}")
        if 0 in embeds.shape:
            raise ValueError(f"{name}: expected a non-empty tensor {layout}, got shape {tuple(embeds.shape)}")
        denoiser = "UNet" if self.denoiser_name == "unet" else self.denoiser_name
        declared = self.denoiser.input_dims.get(unet_input) or []
        if len(declared) == rank and isinstance(declared[-1], int) and embeds.shape[-1] != declared[-1]:
            raise ValueError(f"{name}: expected hidden size {declared[-1]} (the width of the {denoiser}'s "
                             f"{unet_input}), got {embeds.shape[-1]} (shape {tuple(embeds.shape)})")
        if rank == 3 and len(declared) == 3 and isinstance(declared[1], int) and embeds.shape[1] != declared[1]:
            raise ValueError(f"{name}: expected sequence length {declared[1]} (the {denoiser}'s {unet_input}), got "
                             f"{embeds.shape[1]} (shape {tuple(embeds.shape)})")

    @staticmethod
    def check_texts(name: str, texts: Any, count: Optional[int], broadcast: bool = False) -> Optional[int]:
        """A prompt argument, refused before any work otherwise, naming ``name``: a str or a non-empty list of str,
        as many as ``count`` (a str goes with any count where ``broadcast``). Returns how many it holds (``None``
        for ``None``)."""
        if texts is None:
            return None
        if not isinstance(texts, (str, list)):
            raise TypeError(f"{name}: expected a str or a list of str, got {type(texts).__name__} {texts!r}")
        if isinstance(texts, list):
            if not texts:
                raise ValueError(f"{name}: expected a str or a non-empty list of str, got an empty list")
            wrong = next((i for i, item in enumerate(texts) if not isinstance(item, str)), None)
            if wrong is not None:
                raise TypeError(f"{name}[{wrong}]: expected a str, got {type(texts[wrong]).__name__} "
                                f"{texts[wrong]!r}")
        given = 1 if isinstance(texts, str) else len(texts)
        if count is not None and given != count and not (broadcast and isinstance(texts, str)):
            raise ValueError(f"{name}: expected {count} prompt{'s' if count > 1 else ''} (as many as prompt), got "
                             f"{given}")
        return given

    def check_image(self, image: Any, name: str = "image", resized: bool = False, mask: bool = False,
                    channels: Optional[Tuple[int, ...]] = None) -> Tuple[int, int]:
        """Refuses, before any work, an image the pipeline cannot use, naming ``name``: not a PIL image, numpy array
        (``(height, width, channels)``, or a batch of them) or torch tensor (``([batch, ]channels, height,
        width)``), or a list of them; empty (a size of 0); with other ``channels`` than these (default: the VAE
        encoder's; ``()``: any); or, where the image's own size becomes the call's (``resized=False``: img2img),
        smaller than one latent pixel (the VAE's scale factor). A ``mask`` may also be ``(height, width)`` or a
        batch of those, of any channels (it is made grayscale).

        Returns:
            The (first) image's height and width.
        """
        allowed = () if mask else self._image_channels() if channels is None else channels
        items = image if isinstance(image, list) else [image]
        if not items:
            raise ValueError(f"{name}: expected an image or a non-empty list of images, got an empty list")
        sizes = []
        for index, item in enumerate(items):
            label = f"{name}[{index}]" if isinstance(image, list) else name
            if isinstance(item, PIL.Image.Image):
                shape, size = None, (item.height, item.width)
            elif isinstance(item, (np.ndarray, torch.Tensor)):
                shape = tuple(item.shape)
                layout = ("(height, width, channels)" if isinstance(item, np.ndarray)
                          else "(channels, height, width)")
                if not (2 if mask else 3) <= len(shape) <= 4:
                    also = " or (height, width)" if mask else ""
                    raise ValueError(f"{label}: expected an image of shape {layout}{also}, or a batch of them, got "
                                     f"shape {shape}")
                if isinstance(item, np.ndarray):
                    size, given = (shape[-3:-1], shape[-1]) if len(shape) >= 3 else (shape, 1)
                    if mask and len(shape) == 3 and shape[-1] != 1:  # a mask's (batch, height, width), as diffusers
                        size = shape[1:]
                else:
                    size, given = shape[-2:], (shape[-3] if len(shape) >= 3 else 1)
                if allowed and given not in allowed and 0 not in shape:
                    raise ValueError(f"{label}: expected {' or '.join(map(str, allowed))} channel"
                                     f"{'s' if allowed != (1,) else ''} in the layout {layout}, got shape {shape}")
            else:
                raise TypeError(f"{label}: expected a PIL image, a numpy array or a torch tensor (or a list of them), "
                                f"got {type(item).__name__}")
            if 0 in (shape or size):
                got = f"shape {shape}" if shape is not None else f"{size[0]} × {size[1]} pixels"
                raise ValueError(f"{label}: expected a non-empty image, got {got}")
            factor = self.vae_scale_factor
            if not resized and min(size) < factor:
                raise ValueError(f"{label}: expected at least {factor} × {factor} pixels (one latent pixel: the VAE's "
                                 f"scale factor), got {size[0]} × {size[1]}")
            sizes.append(tuple(int(d) for d in size))
        return sizes[0]

    def _image_channels(self) -> Tuple[int, ...]:
        """The channels an image may have: the VAE encoder's (3 for RGB; unknown: any)."""
        channels = self._declared_dim(self.vae_encoder, "sample", 1) if self.vae_encoder is not None else None
        return (channels,) if channels else ()

    def check_image_size(self, height: int, width: int, name: str = "image") -> None:
        """:meth:`check_size` for a size that an image gave (img2img), naming the image."""
        try:
            self.check_size(height, width)
        except ValueError as error:
            raise ValueError(f"{name}: a {height} × {width} image (after rounding down to the VAE factor "
                             f"{self.vae_scale_factor}) cannot be used: {error}; resize it") from None

    @property
    def default_image_size(self) -> int:
        """The height and width a call gets where it gives none: the UNet config's ``sample_size`` (latents) times
        the VAE's scale factor, as in diffusers."""
        return self.config_int(self.unet, "sample_size", self._default_unet_sample_size, "unet") * \
            self.vae_scale_factor

    @staticmethod
    def config_int(model: IOBindingORTModel, key: str, default: int, component: str) -> int:
        """A positive integer from a component's config.json (``default`` where absent), or an error naming it."""
        value = model.config.get(key, default)
        if not is_integer(value) or value <= 0:
            raise ValueError(f"{component} config.json: {key}: expected a positive integer, got {value!r}")
        return int(value)

    def check_size(self, height: Any, width: Any) -> None:
        """Height and width must be positive integers the denoiser can run: multiples of :attr:`size_multiple`
        (diffusers rounds others down with a warning; here they are refused, so that the image has the size asked
        for)."""
        multiple = self.size_multiple
        for name, value in (("height", height), ("width", width)):
            if not is_integer(value) or value <= 0:
                raise ValueError(f"{name}: expected a positive integer multiple of {multiple}, got {value!r}")
        if height % multiple != 0 or width % multiple != 0:
            raise ValueError(
                f"height and width: expected multiples of {multiple} (the VAE's scale factor {self.vae_scale_factor} "
                f"× {self.size_multiple_reason}), got {height} and {width}; e.g. "
                f"{-(-height // multiple) * multiple} × {-(-width // multiple) * multiple}")

    @property
    def size_multiple_reason(self) -> str:
        """Why :attr:`size_multiple` is what it is beyond the VAE's scale factor (for :meth:`check_size`'s
        message): here the UNet's downsamplings."""
        return f"2^{self.unet_downsamples}, the UNet's downsamplings"

    @property
    def unet_downsamples(self) -> int:
        """How often the UNet halves the latents (its down blocks minus one), from its config; 0 if unknown."""
        blocks = self.unet.config.get("down_block_types") or self.unet.config.get("block_out_channels")
        return max(len(blocks) - 1, 0) if isinstance(blocks, (list, tuple)) else 0

    @property
    def size_multiple(self) -> int:
        """What heights and widths must be multiples of: 8 × 2^(down blocks − 1) for Stable Diffusion (64 for
        SD1.5): a latent the UNet halves to an odd size cannot be concatenated with its skip connection again."""
        return self.vae_scale_factor * 2 ** self.unet_downsamples

    @staticmethod
    def batch_size_of(prompt: Union[str, List[str], None], prompt_embeds: Optional[torch.Tensor]) -> int:
        """How many prompts a call has: one string, a list, or the rows of ``prompt_embeds``."""
        if prompt is not None:
            return 1 if isinstance(prompt, str) else len(prompt)
        return prompt_embeds.shape[0]

    def encode_prompt(
        self,
        prompt: Union[str, List[str], None],
        num_images_per_prompt: int,
        do_classifier_free_guidance: bool,
        negative_prompt: Union[str, List[str], None] = None,
        prompt_embeds: Optional[torch.Tensor] = None,
        negative_prompt_embeds: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Text embeddings on ``self.device``: ``[negative; positive]`` when guiding, else positive only."""
        device = self.device
        if prompt_embeds is None:
            prompt_embeds = self._encode_text(prompt)
        prompt_embeds = tensor_of(prompt_embeds).to(device)
        batch_size = prompt_embeds.shape[0]
        prompt_embeds = prompt_embeds.repeat_interleave(num_images_per_prompt, dim=0)
        if not do_classifier_free_guidance:
            return prompt_embeds
        if negative_prompt_embeds is None:
            if negative_prompt is None:
                negative_prompt = [""] * batch_size
            elif isinstance(negative_prompt, str):
                negative_prompt = [negative_prompt] * batch_size
            negative_prompt_embeds = self._encode_text(negative_prompt, max_length=prompt_embeds.shape[1])
        negative_prompt_embeds = tensor_of(negative_prompt_embeds).to(device)
        negative_prompt_embeds = negative_prompt_embeds.repeat_interleave(num_images_per_prompt, dim=0)
        return torch.cat([negative_prompt_embeds, prompt_embeds])

    def _encode_text(self, text: Union[str, List[str]], max_length: Optional[int] = None) -> torch.Tensor:
        max_length = max_length or self.tokenizer.model_max_length
        tokens = self.tokenizer(text, padding="max_length", max_length=max_length, truncation=True,
                                return_tensors="np")
        self.warn_truncated(self.tokenizer, text, max_length, "CLIP can only handle sequences up to")
        input_ids = self.token_ids(self.text_encoder, tokens.input_ids)
        # the encoder's output buffer is reused by its next call (the negative prompt): keep a copy
        return self.text_encoder(input_ids=input_ids)[0].clone()

    @staticmethod
    def warn_truncated(tokenizer: Any, texts: Union[str, List[str]], max_length: int, why: str) -> None:
        """Logs, as diffusers does, the part of ``texts`` that ``max_length`` tokens cut off (``why``: the reason's
        start, e.g. ``"CLIP can only handle sequences up to"``)."""
        untruncated = tokenizer(texts, padding="longest", return_tensors="np").input_ids
        if untruncated.shape[-1] > max_length:
            removed = tokenizer.batch_decode(untruncated[:, max_length - 1 : -1])
            logger.warning(f"The following part of your input was truncated because {why} {max_length} tokens: "
                           f"{removed}")

    def token_ids(self, encoder: IOBindingORTModel, ids: np.ndarray) -> torch.Tensor:
        """A tokenizer's ids on the device in the dtype ``encoder`` declares, converted and range-checked on the host:
        converted on the device, the check would read the values back and make the host wait."""
        dtype = encoder.input_dtypes["input_ids"]
        return upload(as_checked_tensor("input_ids", torch.from_numpy(ids), dtype).to(dtype), self.device)

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
                raise ValueError(f"latents: expected shape {tuple(shape)}, got {tuple(latents.shape)}")
            return latents.to(device=self.device, dtype=dtype)
        if generator is None or isinstance(generator, np.random.RandomState):
            numpy_dtype = torch.empty((), dtype=dtype).numpy().dtype
            noise = (generator or np.random).randn(*shape).astype(numpy_dtype)
            return upload(torch.from_numpy(noise), self.device)
        if is_torch_generator(generator):
            if self.device.type == "cuda" and _on_cpu(generator):
                # drawn on the host as diffusers draws it, then uploaded without making the host wait
                return upload(randn_tensor(shape, generator=generator, device=torch.device("cpu"), dtype=dtype),
                              self.device)
            return randn_tensor(shape, generator=generator, device=self.device, dtype=dtype)
        raise TypeError(f"generator: expected a numpy RandomState, a torch.Generator or a list of torch.Generators "
                        f"(one per image), got {type(generator).__name__}")

    def timestep_inputs(self, timesteps: torch.Tensor, batch_size: int,
                        model: Optional[IOBindingORTModel] = None) -> torch.Tensor:
        """The UNet's (or ``model``'s) ``timestep`` input for every step, made once on the device: row ``i`` is step
        ``i``'s, in the dtype and rank the model declares (a scalar, ``[1]`` or ``[batch]``)."""
        model = self.unet if model is None else model
        timestep_dims = model.input_dims["timestep"] or []
        values = timesteps.to(dtype=model.input_dtypes["timestep"])
        if self.device.type == "cuda":
            # from pinned memory the upload is asynchronous: a pageable one would make the host wait
            values = upload(values, self.device)
        if len(timestep_dims) == 0:
            return values
        if timestep_dims[0] == 1:
            return values[:, None]
        return values[:, None].expand(-1, batch_size).contiguous()

    def scheduler_step_kwargs(self, generator: Generator, eta: float) -> Dict[str, Any]:
        """``eta`` for DDIM-like schedulers, and a torch generator for stochastic ones (a numpy one cannot serve)."""
        if not is_real(eta) or not 0.0 <= eta <= 1.0:
            raise ValueError(f"eta: expected a number in [0, 1] (DDIM's noise share), got {eta!r}")
        accepted = set(inspect.signature(self.scheduler.step).parameters)
        kwargs: Dict[str, Any] = {}
        if "eta" in accepted:
            kwargs["eta"] = eta
        if "generator" in accepted and is_torch_generator(generator):
            kwargs["generator"] = generator  # a list: one per image, as diffusers' schedulers take it
        return kwargs

    # ------------------------------------------------------------------------------------------------- tiling
    def enable_vae_tiling(self, tile_sample_size: Optional[int] = None, overlap: float = 0.25,
                          overlap_copies: bool = True) -> None:
        """Decode (and encode) images larger than a tile tile by tile, as diffusers' ``enable_vae_tiling`` does,
        with each tile's host transfer overlapping the next tile's compute on CUDA (see :class:`TiledVAE`).

        Args:
            tile_sample_size: tile size in pixels, a positive multiple of the VAE's scale factor; ``None`` (the
                default): the VAE config's ``sample_size`` (diffusers' choice). 0 is refused, not read as the default.
            overlap: fraction of a tile blended with each neighbour.
            overlap_copies: overlap transfers with compute (``False``: the sequential comparison).
        """
        size = self.config_int(self.vae_decoder, "sample_size", 512, "vae_decoder") if tile_sample_size is None \
            else tile_sample_size
        self._vae_tiler = TiledVAE(self.vae_decoder, self.vae_encoder, size, self.vae_scale_factor, overlap,
                                   overlap_copies)

    @property
    def vae_tiler(self) -> Optional[TiledVAE]:
        """The tiler :meth:`enable_vae_tiling` set up (``None`` while tiling is off)."""
        return self._vae_tiler

    def disable_vae_tiling(self) -> None:
        self._vae_tiler = None

    def _tiles_latents(self, latents: torch.Tensor) -> bool:
        tiler = self._vae_tiler
        return tiler is not None and max(latents.shape[-2:]) > tiler.tile_latent_size

    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Images in [-1, 1], NCHW, on ``self.device``. One image per VAE call, as diffusers' ONNX pipeline does
        (fp16 VAE exports misbehave at batch > 1)."""
        latents = latents / self.vae_scaling_factor
        if self._tiles_latents(latents):
            return torch.cat([self._vae_tiler.decode(latents[i : i + 1]) for i in range(latents.shape[0])])
        # each call reuses the decoder's output buffer: copy each image out before the next call
        return torch.cat([self.vae_decoder(latent_sample=latents[i : i + 1])[0].clone()
                          for i in range(latents.shape[0])])

    def encode_image(self, image: torch.Tensor, generator: Generator) -> torch.Tensor:
        """Scaled latents of ``image`` (NCHW in [-1, 1] on the device). An optimum export returns the latent
        distribution's parameters: sampled here with ``generator`` (its mean for a numpy generator)."""
        if self.vae_encoder is None:
            raise ValueError("vae_encoder: this pipeline needs one, and the folder has no vae_encoder/model.onnx")
        tiler = self._vae_tiler
        if tiler is not None and max(image.shape[-2:]) > tiler.tile_sample_size:
            latents = torch.cat([tiler.encode(image[i : i + 1]) for i in range(image.shape[0])])
        else:
            image = image.to(device=self.device, dtype=self.vae_encoder.input_dtypes["sample"])
            latents = torch.cat([self.vae_encoder(sample=image[i : i + 1])[0].clone()
                                 for i in range(image.shape[0])])
        if self.vae_encoder.output_names[0] == "latent_parameters":
            mean, logvar = latents.chunk(2, dim=1)
            if is_torch_generator(generator):
                std = torch.exp(0.5 * logvar.clamp(-30.0, 20.0))
                latents = mean + std * randn_tensor(mean.shape, generator=generator, device=self.device,
                                                    dtype=mean.dtype)
            else:
                latents = mean
        return latents * self.vae_scaling_factor

    def postprocess(self, image: torch.Tensor, output_type: str) -> Any:
        """"pt" stays on the device; "np" and "pil" come back through a pinned buffer, the one wait of the call."""
        if output_type == "pt" or image.device.type != "cuda":
            return self.image_processor.postprocess(image.float(), output_type=output_type)
        image = (image.float() / 2 + 0.5).clamp(0, 1)
        # pinning may allocate and the wait synchronizes: neither may run beside a graph capture in another thread
        with DEVICE_SETUP.setup():
            host = torch.empty(image.shape, dtype=image.dtype, pin_memory=True)
            host.copy_(image, non_blocking=True)
            torch.cuda.current_stream(image.device).synchronize()
        return self.image_processor.postprocess(host, output_type=output_type, do_denormalize=[False] * len(host))

    # the denoising loop (every tensor stays on self.device; nothing waits on the host): .denoise.denoise
    denoise = denoise

    def set_timesteps(self, num_inference_steps: int) -> torch.Tensor:
        """Sets the scheduler's timesteps, keeping its state on the CPU: its per-step scalars (sigmas, alphas) then
        meet the device tensors as CPU scalars, which never makes the host wait; a schedule on the GPU would
        (Euler compares a sigma with a Python float, DDIM indexes a CPU table with the timestep)."""
        self.scheduler.set_timesteps(num_inference_steps)
        return self.scheduler.timesteps

    def strength_timesteps(self, num_inference_steps: int, strength: float) -> torch.Tensor:
        """The scheduler's timesteps after skipping the first ``1 - strength`` of them (img2img, inpainting)."""
        self.set_timesteps(num_inference_steps)
        init_timestep = min(int(num_inference_steps * strength), num_inference_steps)
        t_start = max(num_inference_steps - init_timestep, 0)
        timesteps = self.scheduler.timesteps[t_start * self.scheduler.order :]
        if hasattr(self.scheduler, "set_begin_index"):
            self.scheduler.set_begin_index(t_start * self.scheduler.order)
        if len(timesteps) == 0:
            raise ValueError(f"strength: {strength} with num_inference_steps={num_inference_steps} leaves no "
                             "denoising step; raise either")
        return timesteps

    def finish(self, latents: torch.Tensor, output_type: str, return_dict: bool):
        """Decodes (unless ``output_type="latent"``) and packs the output as diffusers does. A tiled decode to "np"
        or "pil" on CUDA downloads each tile while the next one decodes."""
        if output_type in ("np", "pil") and latents.device.type == "cuda" and self._tiles_latents(latents):
            scaled = latents / self.vae_scaling_factor
            image = np.concatenate([self._vae_tiler.decode_to_host(scaled[i : i + 1])
                                    for i in range(scaled.shape[0])])
            if output_type == "pil":
                image = self.image_processor.numpy_to_pil(image)
        elif output_type == "latent":
            image = latents
        else:
            image = self.postprocess(self.decode_latents(latents), output_type)
        self.maybe_free_model_hooks()
        return self.pack_output(image, return_dict)

    def pack_output(self, image: Any, return_dict: bool) -> Any:
        """diffusers' output for this pipeline (no safety checker runs: ``nsfw_content_detected`` is ``None``)."""
        if not return_dict:
            return (image, None)
        return StableDiffusionPipelineOutput(images=image, nsfw_content_detected=None)


def upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` (on the host) on ``device`` without making the host wait: to CUDA through pinned memory, an
    asynchronous copy ordered on the current stream (a copy from pageable memory waits for the stream's pending work:
    in a server, for the batch running on the GPU). Elsewhere a plain ``.to(device)``."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    with DEVICE_SETUP.setup():  # pinning may allocate, which a graph capture in another thread must not see
        pinned = tensor.pin_memory()
    return pinned.to(device, non_blocking=True)


def _on_cpu(generator: Any) -> bool:
    """Whether a torch generator (or the first of a list) draws on the CPU."""
    first = generator[0] if isinstance(generator, list) else generator
    return first.device.type == "cpu"
