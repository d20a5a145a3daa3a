"""FLUX.1 (schnell and dev) text-to-image on ONNX Runtime, the loop on the device: optimum's Flux export layout (a CLIP
text encoder for the pooled prompt, a T5 encoder for the token embeddings, a transformer over 2×2-packed latent
tokens with rotary position ids, an AutoencoderKL of 16 latent channels), diffusers'
``FlowMatchEulerDiscreteScheduler``."""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from diffusers import DiffusionPipeline
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.flux.pipeline_output import FluxPipelineOutput
from diffusers.schedulers.scheduling_utils import SchedulerMixin

from ..layout import resolve_pipeline_folder
from ..runtime.hub import check_hub_kwargs
from ..runtime.model import IOBindingORTModel
from ..runtime.options import CudaGraphSetting, PipelineOptions, ProviderSpec
from .arguments import Generator, check_sequence_length, is_integer, is_real
from .denoise import GraphFeed, check_callback_arguments, on_device_stream, replaced_tensors
from .loading import check_component_kind, load_components
from .pipeline import OnnxStableDiffusionPipelineBase, tensor_of, upload

logger = logging.getLogger(__name__)

FLUX_COMPONENTS = ("text_encoder", "text_encoder_2", "transformer", "vae_encoder", "vae_decoder")
# the transformer's inputs (optimum's FluxTransformerOnnxConfig); FLUX.1 dev also takes "guidance"
TRANSFORMER_INPUTS = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "txt_ids",
                      "img_ids")
# FLUX.1's VAE latent scaling, for a folder whose vae_decoder config.json names none (diffusers' FLUX.1 VAE config)
FLUX_VAE_SCALING_FACTOR, FLUX_VAE_SHIFT_FACTOR = 0.3611, 0.1159
# diffusers' FluxPipeline: 128 latent pixels (1024 px) by default, T5 prompts of at most 512 tokens
_DEFAULT_SAMPLE_SIZE = 128
MAX_SEQUENCE_LENGTH = 512
Prompt = Union[str, List[str], None]


def flux_shift(image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 4096, base_shift: float = 0.5,
               max_shift: float = 1.15) -> float:
    """FLUX.1 dev's resolution-dependent shift ``mu`` of the flow-matching schedule: linear in the number of packed
    latent tokens, ``base_shift`` at ``base_seq_len`` tokens and ``max_shift`` at ``max_seq_len``."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * slope + base_shift - slope * base_seq_len


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """``(batch, channels, height, width)`` latents as Flux's tokens: each 2×2 patch one token of ``4 · channels``
    values, ``(batch, height/2 · width/2, 4 · channels)``, row by row."""
    batch, channels, height, width = latents.shape
    patches = latents.view(batch, channels, height // 2, 2, width // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(batch, (height // 2) * (width // 2), channels * 4)


def unpack_latents(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The inverse of :func:`pack_latents` for latents of ``height`` × ``width`` latent pixels."""
    batch, _, values = tokens.shape
    patches = tokens.view(batch, height // 2, width // 2, values // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return patches.reshape(batch, values // 4, height, width)


def latent_image_ids(height: int, width: int) -> torch.Tensor:
    """The rotary position ids of the packed tokens of a ``height`` × ``width`` token grid: ``(0, row, column)``."""
    rows = torch.arange(height, dtype=torch.float32)[:, None].expand(height, width)
    columns = torch.arange(width, dtype=torch.float32)[None, :].expand(height, width)
    return torch.stack([torch.zeros_like(rows), rows, columns], dim=-1).reshape(height * width, 3)


class OnnxFluxPipeline(OnnxStableDiffusionPipelineBase):
    """FLUX.1 text-to-image on ONNX Runtime, with the arguments of diffusers' ``FluxPipeline``.

    ``OnnxFluxPipeline.from_pretrained(folder, provider="CUDAExecutionProvider")`` loads an ``optimum-cli export
    onnx`` Flux folder (or ours: ``optimum-iobinding export``) and keeps the prompt embeddings, latents, the
    transformer's predictions, true-CFG guidance and the scheduler step on the GPU as torch tensors, each distinct
    input signature of the transformer captured once as a CUDA graph; only the final image is downloaded.
    ``io_binding=False`` runs every component with ``session.run`` on numpy arrays (the baseline).

    FLUX.1 dev's transformer takes the guidance scale as an input (``guidance``, a distilled guidance: one
    transformer call per step); schnell's takes none and ignores ``guidance_scale``. ``true_cfg_scale`` > 1 with a
    negative prompt runs diffusers' true classifier-free guidance (negative and positive in one batch).
    """

    _optional_components = ["vae_encoder"]
    model_cpu_offload_seq = "text_encoder->text_encoder_2->transformer->vae_decoder"
    _onnx_components = FLUX_COMPONENTS
    denoiser_name = "transformer"
    _tokenizer_names = ("tokenizer", "tokenizer_2")
    _callback_tensor_inputs = ["latents", "prompt_embeds"]
    _default_vae_scaling_factor = FLUX_VAE_SCALING_FACTOR
    _vae_constants_hint = (f"FLUX.1's are scaling_factor {FLUX_VAE_SCALING_FACTOR}, shift_factor "
                           f"{FLUX_VAE_SHIFT_FACTOR}")

    def __init__(
        self,
        vae_encoder: Optional[IOBindingORTModel],
        vae_decoder: IOBindingORTModel,
        text_encoder: IOBindingORTModel,
        text_encoder_2: IOBindingORTModel,
        tokenizer: Any,
        tokenizer_2: Any,
        transformer: IOBindingORTModel,
        scheduler: SchedulerMixin,
    ):
        DiffusionPipeline.__init__(self)  # not the Stable Diffusion module list of the base's __init__
        self.register_modules(vae_encoder=vae_encoder, vae_decoder=vae_decoder, text_encoder=text_encoder,
                              text_encoder_2=text_encoder_2, tokenizer=tokenizer, tokenizer_2=tokenizer_2,
                              transformer=transformer, scheduler=scheduler)
        for name in self._onnx_components:
            check_component_kind(name, getattr(self, name, None))
        self._check_flux_components()
        self._vae_tiler = None
        self.vae_scale_factor = self._read_vae_scale_factor()
        self.vae_scaling_factor = self._read_vae_scaling_factor()
        self.vae_shift_factor = self._vae_config_float("shift_factor", FLUX_VAE_SHIFT_FACTOR, positive=False)
        self.latent_channels = self._read_flux_latent_channels()
        # the 2×2 packing halves the latents once more: images are multiples of twice the VAE's factor
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor * 2)
        self.default_sample_size = _DEFAULT_SAMPLE_SIZE
        self._call_lock = threading.RLock()
        self._calling = threading.local()
        self._prepared = False

    # -------------------------------------------------------------------------------------------- what it reads
    def _check_flux_components(self) -> None:
        """Refuses, when loading, components that are not Flux's: a transformer without Flux's inputs, a CLIP
        encoder without its pooled output, a T5 encoder without ``last_hidden_state``."""
        declared = self.transformer.input_names
        missing = [name for name in TRANSFORMER_INPUTS if name not in declared]
        unexpected = [name for name in declared if name not in (*TRANSFORMER_INPUTS, "guidance")]
        if missing or unexpected:
            hint = ("a UNet: use OnnxStableDiffusionPipeline or OnnxStableDiffusionXLPipeline" if "sample" in declared
                    else "an SD3 transformer: use OnnxStableDiffusion3Pipeline" if "txt_ids" not in declared
                    and "pooled_projections" in declared else "export the Flux transformer with optimum-iobinding "
                    "export or optimum-cli export onnx")
            raise ValueError(f"transformer: expected a Flux transformer with inputs {list(TRANSFORMER_INPUTS)} (and "
                             f"guidance for FLUX.1 dev), got inputs {declared} in {self.transformer.model_path!r} "
                             f"({hint})")
        for name, output in (("text_encoder", "pooler_output"), ("text_encoder_2", "last_hidden_state")):
            outputs = getattr(self, name).output_names
            if output not in outputs:
                what = "a CLIP text encoder with its pooled output" if name == "text_encoder" else "a T5 encoder"
                raise ValueError(f"{name}: expected {what} (output {output!r}), got outputs {outputs} in "
                                 f"{getattr(self, name).model_path!r}")

    def _read_flux_latent_channels(self) -> int:
        """The VAE's latent channels: a quarter of the transformer's token width (its ``in_channels``)."""
        width = self._declared_dim(self.transformer, "hidden_states", 2) or self.transformer.config.get("in_channels")
        if not is_integer(width) or width < 4 or width % 4:
            raise ValueError(f"transformer: expected hidden_states of 4 × latent channels per token (Flux's 2×2 "
                             f"packing), got a width of {width!r}")
        channels = width // 4
        declared = self._declared_dim(self.vae_decoder, "latent_sample", 1) or self.vae_decoder.config.get(
            "latent_channels")
        if declared is not None and declared != channels:
            raise ValueError(f"vae_decoder: expected {channels} latent channels (the transformer's token width "
                             f"{width} / 4), got {declared}")
        return channels

    @property
    def guidance_embeds(self) -> bool:
        """Whether the transformer takes the guidance scale as an input (FLUX.1 dev), or not (schnell)."""
        return "guidance" in self.transformer.input_names

    @property
    def default_image_size(self) -> int:
        """The height and width a call gets where it gives none: 128 latent pixels (1024 px for FLUX.1)."""
        return self.default_sample_size * self.vae_scale_factor

    @property
    def size_multiple(self) -> int:
        """What heights and widths must be multiples of: the VAE's scale factor × 2 (the 2×2 token packing)."""
        return self.vae_scale_factor * 2

    @property
    def size_multiple_reason(self) -> str:
        return "2, Flux's 2×2 packing of latents into tokens"

    def load_lora_weights(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("load_lora_weights: runtime LoRA is not available for Flux pipelines yet; fuse the "
                                  "LoRA into the torch pipeline (diffusers' fuse_lora) before exporting it")

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
        tokenizer_2: Any = None,
        component_options: Optional[Dict[str, Dict[str, Any]]] = None,
        **hub_kwargs: Any,
    ) -> "OnnxFluxPipeline":
        """Loads an ``optimum-cli export onnx`` Flux folder (or ours), or a hub id of one.

        Args:
            pretrained_model_name_or_path: local folder or hub repository id.
            provider, provider_options, sess_options, io_binding, cuda_graph, component_options: as for
                :meth:`OnnxStableDiffusionPipelineBase.from_pretrained` (``component_options`` keys: ``"transformer"``,
                ``"text_encoder"``, ``"text_encoder_2"``, ``"vae_decoder"``, ``"vae_encoder"``).
            scheduler, tokenizer, tokenizer_2: replace the folder's.
            **hub_kwargs: for ``huggingface_hub.snapshot_download``.
        """
        check_hub_kwargs(f"{cls.__name__}.from_pretrained", hub_kwargs)
        options = PipelineOptions.resolve(cls._onnx_components, provider, provider_options, sess_options, io_binding,
                                          cuda_graph, component_options)
        folder = resolve_pipeline_folder(pretrained_model_name_or_path, cls._onnx_components, cls._tokenizer_names,
                                          **hub_kwargs)
        # every model file is there before anything loads: the transformer's first, the one that says "Flux"
        for name in ("transformer", *cls._onnx_components):
            path = folder / name / "model.onnx"
            if name not in cls._optional_components and not path.is_file():
                unet = (folder / "unet" / "model.onnx").is_file()
                hint = (f"; {str(folder)!r} holds a UNet: a Stable Diffusion folder, for the pipeline "
                        "pipeline_class_for picks") if unet else ""
                raise FileNotFoundError(f"pretrained_model_name_or_path: component {name!r} is missing: expected "
                                        f"{path} (a FLUX.1 ONNX folder){hint}")
        # tokenizers and scheduler through the shared loader; the ONNX components here (optimum's index names them
        # by their torch classes, T5EncoderModel and FluxTransformer2DModel)
        components = load_components(cls, folder, options, scheduler, tokenizer, onnx_components=())
        if tokenizer_2 is not None:
            if not (callable(tokenizer_2) and hasattr(tokenizer_2, "model_max_length")):
                raise TypeError(f"tokenizer_2: expected a transformers tokenizer (a T5TokenizerFast), got "
                                f"{type(tokenizer_2).__name__}")
            components["tokenizer_2"] = tokenizer_2
        for name in cls._onnx_components:
            if not (folder / name / "model.onnx").is_file():  # an optional one (checked above)
                components[name] = None
                continue
            components[name] = IOBindingORTModel.from_pretrained(folder / name, options=options.for_component(name))
            check_component_kind(name, components[name])
        return cls(**components)

    def _write_model_index(self, target: Path, written: List[str]) -> None:
        """optimum's Flux index: the torch pipeline's class names (one ``vae`` entry for the two VAE folders)."""
        import diffusers

        def tokenizer_entry(tokenizer: Any) -> List[str]:
            name = type(tokenizer).__name__
            if name == "T5Tokenizer" and getattr(tokenizer, "is_fast", False):
                name = "T5TokenizerFast"  # transformers 4 reads tokenizer.json only under the fast name
            return ["transformers", name]

        index = {"_class_name": "FluxPipeline", "_diffusers_version": diffusers.__version__,
                 "feature_extractor": [None, None], "image_encoder": [None, None],
                 "scheduler": ["diffusers", type(self.scheduler).__name__],
                 "text_encoder": ["transformers", "CLIPTextModel"],
                 "text_encoder_2": ["transformers", "T5EncoderModel"],
                 "tokenizer": tokenizer_entry(self.tokenizer), "tokenizer_2": tokenizer_entry(self.tokenizer_2),
                 "transformer": ["diffusers", "FluxTransformer2DModel"], "vae": ["diffusers", "AutoencoderKL"]}
        (Path(target) / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True))

    # ---------------------------------------------------------------------------------------------------- warm-up
    def warmup(
        self,
        heights: Union[int, Sequence[int], None] = None,
        widths: Union[int, Sequence[int], None] = None,
        batch_sizes: Union[int, Sequence[int]] = 1,
        guidance_scales: Union[float, Sequence[float]] = 3.5,
        num_inference_steps: int = 2,
        max_sequence_length: int = MAX_SEQUENCE_LENGTH,
    ) -> None:
        """Creates the sessions and captures the CUDA graphs that calls of these sizes will use (see
        :meth:`OnnxStableDiffusionPipelineBase.warmup`). Every argument is checked before the first call: a refused
        warm-up runs nothing.

        Args:
            max_sequence_length: the T5 prompt length the calls will use: part of the transformer's input shapes, so
                a warm-up at another length makes graphs the calls do not replay.
        """
        check_sequence_length(max_sequence_length, MAX_SEQUENCE_LENGTH)
        for height, width, batch_size, guidance_scale in self._warmup_combinations(
                heights, widths, batch_sizes, guidance_scales, num_inference_steps):
            self._warmup_call(height, width, batch_size, guidance_scale, num_inference_steps, max_sequence_length)

    def _warmup_call(self, height: int, width: int, batch_size: int, guidance_scale: float, steps: int,
                     max_sequence_length: int = MAX_SEQUENCE_LENGTH) -> None:
        self(prompt=[""] * batch_size, height=height, width=width, num_inference_steps=steps,
             guidance_scale=guidance_scale, generator=torch.Generator().manual_seed(0), output_type="np",
             max_sequence_length=max_sequence_length)

    # ------------------------------------------------------------------------------------------------- checks

    def check_inputs_flux(
        self,
        prompt: Prompt,
        prompt_2: Prompt,
        negative_prompt: Prompt,
        negative_prompt_2: Prompt,
        height: Any,
        width: Any,
        num_inference_steps: Any,
        sigmas: Any,
        guidance_scale: Any,
        true_cfg_scale: Any,
        num_images_per_prompt: Any,
        prompt_embeds: Any,
        pooled_prompt_embeds: Any,
        negative_prompt_embeds: Any,
        negative_pooled_prompt_embeds: Any,
        output_type: Any,
        joint_attention_kwargs: Any,
        callback_on_step_end: Any,
        callback_on_step_end_tensor_inputs: Any,
        max_sequence_length: Any,
    ) -> None:
        """Refuses, before any work, every argument the call cannot run with, naming it, what was expected and what
        came."""
        check_callback_arguments(callback_on_step_end, callback_on_step_end_tensor_inputs)
        self.check_size(height, width)
        if not is_integer(num_inference_steps) or num_inference_steps <= 0:
            raise ValueError(f"num_inference_steps: expected a positive integer, got {num_inference_steps!r}")
        if sigmas is not None:
            values = list(sigmas) if isinstance(sigmas, (list, tuple, np.ndarray)) else None
            if not values or not all(is_real(v) and math.isfinite(v) for v in values):
                raise ValueError(f"sigmas: expected a non-empty list of finite numbers (one per step), got {sigmas!r}")
        for name, value in (("guidance_scale", guidance_scale), ("true_cfg_scale", true_cfg_scale)):
            if not is_real(value) or not math.isfinite(value):
                raise ValueError(f"{name}: expected a finite number, got {value!r}")
        if not is_integer(num_images_per_prompt) or num_images_per_prompt < 1:
            raise ValueError(f"num_images_per_prompt: expected a positive integer, got {num_images_per_prompt!r}")
        check_sequence_length(max_sequence_length, MAX_SEQUENCE_LENGTH)
        if output_type not in ("pil", "np", "pt", "latent"):
            raise ValueError(f"output_type: expected 'pil', 'np', 'pt' or 'latent', got {output_type!r}")
        if joint_attention_kwargs:
            raise ValueError(f"joint_attention_kwargs: expected None (an ONNX transformer has no attention processors "
                             f"to pass them to), got {joint_attention_kwargs!r}")
        if prompt is not None and prompt_embeds is not None:
            raise ValueError("prompt and prompt_embeds: expected one of them, got both")
        if prompt is None and prompt_embeds is None:
            raise ValueError("prompt and prompt_embeds: expected one of them, got neither")
        if prompt_embeds is not None and pooled_prompt_embeds is None:
            raise ValueError("pooled_prompt_embeds: expected them with prompt_embeds (the transformer takes both), "
                             "got None")
        if pooled_prompt_embeds is not None and prompt_embeds is None:
            raise ValueError("pooled_prompt_embeds: expected them with prompt_embeds, got them alone")
        if negative_prompt_embeds is not None and negative_pooled_prompt_embeds is None:
            raise ValueError("negative_pooled_prompt_embeds: expected them with negative_prompt_embeds, got None")
        batch = self.check_texts("prompt", prompt, None)
        self.check_texts("prompt_2", prompt_2, batch)
        negatives = self.check_texts("negative_prompt", negative_prompt, batch, broadcast=True)
        self.check_texts("negative_prompt_2", negative_prompt_2, negatives, broadcast=True)
        for name, texts, rival, rival_name in (("prompt_2", prompt_2, prompt_embeds, "prompt_embeds"),
                                               ("negative_prompt", negative_prompt, negative_prompt_embeds,
                                                "negative_prompt_embeds"),
                                               ("negative_prompt_2", negative_prompt_2, negative_prompt_embeds,
                                                "negative_prompt_embeds")):
            if texts is not None and rival is not None:
                raise ValueError(f"{name} and {rival_name}: expected at most one of them, got both")
        rows = batch
        for name, embeds, rank, layout, input_name in (
                ("prompt_embeds", prompt_embeds, 3, "(batch, sequence, hidden)", "encoder_hidden_states"),
                ("pooled_prompt_embeds", pooled_prompt_embeds, 2, "(batch, width)", "pooled_projections"),
                ("negative_prompt_embeds", negative_prompt_embeds, 3, "(batch, sequence, hidden)",
                 "encoder_hidden_states"),
                ("negative_pooled_prompt_embeds", negative_pooled_prompt_embeds, 2, "(batch, width)",
                 "pooled_projections")):
            if embeds is None:
                continue
            self.check_embeds(name, embeds, rank, layout, input_name)
            rows = embeds.shape[0] if rows is None else rows
            if embeds.shape[0] != rows:
                raise ValueError(f"{name}: expected {rows} rows (one per prompt), got shape {tuple(embeds.shape)}")
        if prompt_embeds is not None and negative_prompt_embeds is not None and \
                tuple(prompt_embeds.shape) != tuple(negative_prompt_embeds.shape):
            raise ValueError(f"negative_prompt_embeds: expected shape {tuple(prompt_embeds.shape)} like prompt_embeds, "
                             f"got {tuple(negative_prompt_embeds.shape)}")

    # ------------------------------------------------------------------------------------------------ prompts
    def _clip_pooled(self, prompt: List[str]) -> torch.Tensor:
        max_length = self.tokenizer.model_max_length
        ids = self.tokenizer(prompt, padding="max_length", max_length=max_length, truncation=True,
                             return_tensors="np").input_ids
        self.warn_truncated(self.tokenizer, prompt, max_length, "CLIP can only handle sequences up to")
        outputs = dict(zip(self.text_encoder.output_names,
                           self.text_encoder(input_ids=self.token_ids(self.text_encoder, ids))))
        return outputs["pooler_output"].clone()  # the encoder's next call reuses its output buffer

    def _t5_embeds(self, prompt: List[str], max_sequence_length: int) -> torch.Tensor:
        ids = self.tokenizer_2(prompt, padding="max_length", max_length=max_sequence_length, truncation=True,
                               return_tensors="np").input_ids
        self.warn_truncated(self.tokenizer_2, prompt, max_sequence_length, "`max_sequence_length` is set to")
        outputs = dict(zip(self.text_encoder_2.output_names,
                           self.text_encoder_2(input_ids=self.token_ids(self.text_encoder_2, ids))))
        return outputs["last_hidden_state"].clone()

    def encode_prompt(
        self,
        prompt: Prompt,
        prompt_2: Prompt = None,
        num_images_per_prompt: int = 1,
        prompt_embeds: Optional[torch.Tensor] = None,
        pooled_prompt_embeds: Optional[torch.Tensor] = None,
        max_sequence_length: int = MAX_SEQUENCE_LENGTH,
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(prompt_embeds, pooled_prompt_embeds, text_ids)`` on ``self.device`` as diffusers' ``FluxPipeline``
        makes them: T5's token embeddings of ``prompt_2`` (``prompt`` where absent), CLIP's pooled embedding of
        ``prompt``, each repeated ``num_images_per_prompt`` times, and the text's rotary position ids (zeros)."""
        if prompt_embeds is None:
            prompt = [prompt] if isinstance(prompt, str) else prompt
            prompt_2 = prompt if prompt_2 is None else ([prompt_2] if isinstance(prompt_2, str) else prompt_2)
            pooled_prompt_embeds = self._clip_pooled(prompt)
            prompt_embeds = self._t5_embeds(prompt_2, max_sequence_length)
        device = self.device
        embeds_dtype = self.transformer.input_dtypes["encoder_hidden_states"]
        pooled_dtype = self.transformer.input_dtypes["pooled_projections"]
        prompt_embeds = tensor_of(prompt_embeds).to(device=device, dtype=embeds_dtype)
        pooled_prompt_embeds = tensor_of(pooled_prompt_embeds).to(device=device, dtype=pooled_dtype)
        prompt_embeds = prompt_embeds.repeat_interleave(num_images_per_prompt, dim=0)
        pooled_prompt_embeds = pooled_prompt_embeds.repeat_interleave(num_images_per_prompt, dim=0)
        text_ids = torch.zeros(prompt_embeds.shape[1], 3, dtype=self.transformer.input_dtypes["txt_ids"])
        return prompt_embeds, pooled_prompt_embeds, upload(text_ids, device)

    # ------------------------------------------------------------------------------------------- the schedule
    def flux_timesteps(self, num_inference_steps: int, image_seq_len: int,
                       sigmas: Optional[Sequence[float]] = None) -> torch.Tensor:
        """The scheduler's timesteps for ``num_inference_steps`` steps over ``image_seq_len`` latent tokens, as
        diffusers' FluxPipeline sets them: sigmas evenly from 1 to 1/steps (or the given ones), shifted by the
        scheduler (FLUX.1 dev: by :func:`flux_shift` of the token count). The schedule stays on the CPU: its
        per-step scalars meet the device tensors without making the host wait."""
        config = self.scheduler.config
        if sigmas is None:
            sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
        if getattr(config, "use_flow_sigmas", False):
            sigmas = None
        mu = flux_shift(image_seq_len, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                        config.get("base_shift", 0.5), config.get("max_shift", 1.15))
        if sigmas is None:
            self.scheduler.set_timesteps(num_inference_steps, mu=mu)
        else:
            self.scheduler.set_timesteps(sigmas=list(sigmas), mu=mu)
        self.scheduler.set_begin_index(0)
        return self.scheduler.timesteps

    # --------------------------------------------------------------------------------------------------- call
    @torch.no_grad()
    @on_device_stream
    def __call__(
        self,
        prompt: Prompt = None,
        prompt_2: Prompt = None,
        negative_prompt: Prompt = None,
        negative_prompt_2: Prompt = None,
        true_cfg_scale: float = 1.0,
        height: Optional[int] = None,
        width: Optional[int] = None,
        num_inference_steps: int = 28,
        sigmas: Optional[List[float]] = None,
        guidance_scale: float = 3.5,
        num_images_per_prompt: int = 1,
        generator: Generator = None,
        latents: Optional[Union[torch.Tensor, np.ndarray]] = None,
        prompt_embeds: Optional[Union[torch.Tensor, np.ndarray]] = None,
        pooled_prompt_embeds: Optional[Union[torch.Tensor, np.ndarray]] = None,
        negative_prompt_embeds: Optional[Union[torch.Tensor, np.ndarray]] = None,
        negative_pooled_prompt_embeds: Optional[Union[torch.Tensor, np.ndarray]] = None,
        output_type: str = "pil",
        return_dict: bool = True,
        joint_attention_kwargs: Optional[Dict[str, Any]] = None,
        callback_on_step_end: Optional[Callable[..., Dict[str, Any]]] = None,
        callback_on_step_end_tensor_inputs: List[str] = ("latents",),
        max_sequence_length: int = MAX_SEQUENCE_LENGTH,
    ):
        """Generates images from text, with the arguments of diffusers' ``FluxPipeline`` (IP-Adapter aside).

        ``generator`` is a ``torch.Generator`` (or one per image; the same noise as diffusers for the same seed) or a
        numpy ``RandomState``. ``latents`` are packed, ``(batch, tokens, 4 × latent channels)``, as diffusers takes
        them; ``output_type="latent"`` returns them packed too. ``callback_on_step_end(pipe, step, t, tensors)`` gets
        and may replace ``latents`` and ``prompt_embeds``, on the device.

        Returns:
            ``FluxPipelineOutput(images)``, or ``(images,)`` without ``return_dict``.
        """
        # 1. check inputs
        height = self.default_image_size if height is None else height
        width = self.default_image_size if width is None else width
        self.check_inputs_flux(prompt, prompt_2, negative_prompt, negative_prompt_2, height, width,
                               num_inference_steps, sigmas, guidance_scale, true_cfg_scale, num_images_per_prompt,
                               prompt_embeds, pooled_prompt_embeds, negative_prompt_embeds,
                               negative_pooled_prompt_embeds, output_type, joint_attention_kwargs,
                               callback_on_step_end, callback_on_step_end_tensor_inputs, max_sequence_length)
        batch_size = self.batch_size_of(prompt, prompt_embeds)
        image_count = batch_size * num_images_per_prompt
        if isinstance(generator, list) and len(generator) != image_count:
            raise ValueError(f"generator: expected one generator per image ({image_count}: {batch_size} prompts × "
                             f"num_images_per_prompt {num_images_per_prompt}), got a list of {len(generator)}")
        has_negative = negative_prompt is not None or (negative_prompt_embeds is not None
                                                       and negative_pooled_prompt_embeds is not None)
        do_true_cfg = true_cfg_scale > 1 and has_negative

        # 2. prompt embeddings, on the device
        prompt_embeds, pooled_prompt_embeds, text_ids = self.encode_prompt(
            prompt, prompt_2, num_images_per_prompt, prompt_embeds, pooled_prompt_embeds, max_sequence_length)
        if do_true_cfg:
            if negative_prompt_embeds is None:  # one negative prompt for every prompt, as a str
                negative_prompt = [negative_prompt] * batch_size if isinstance(negative_prompt, str) \
                    else negative_prompt
                negative_prompt_2 = [negative_prompt_2] * batch_size if isinstance(negative_prompt_2, str) \
                    else negative_prompt_2
            # the negative joins the prompt in one transformer batch: its text at the prompt's token count (given
            # embeddings may be shorter than max_sequence_length)
            negative_prompt_embeds, negative_pooled_prompt_embeds, _ = self.encode_prompt(
                negative_prompt, negative_prompt_2, num_images_per_prompt, negative_prompt_embeds,
                negative_pooled_prompt_embeds, prompt_embeds.shape[1])

        # 3. initial noise (drawn unpacked, as diffusers draws it), packed into tokens, and their position ids
        latent_height = 2 * (height // (self.vae_scale_factor * 2))
        latent_width = 2 * (width // (self.vae_scale_factor * 2))
        dtype = self.transformer.input_dtypes["hidden_states"]
        tokens = (latent_height // 2) * (latent_width // 2)
        if latents is None:
            shape = (image_count, self.latent_channels, latent_height, latent_width)
            noise = self.prepare_latents(shape, torch.float32, generator)
            latents = pack_latents(noise).to(dtype)
        else:
            latents = tensor_of(latents)
            expected = (image_count, tokens, self.latent_channels * 4)
            if tuple(latents.shape) != expected:
                raise ValueError(f"latents: expected packed latents of shape {expected} (batch, tokens, 4 × latent "
                                 f"channels), got {tuple(latents.shape)}")
            latents = latents.to(device=self.device, dtype=dtype)
        image_ids = upload(latent_image_ids(latent_height // 2, latent_width // 2).to(
            self.transformer.input_dtypes["img_ids"]), self.device)

        # 4. timesteps: the transformer's timestep (t / 1000) and guidance inputs made once on the device
        timesteps = self.flux_timesteps(num_inference_steps, tokens, sigmas)
        model_batch = image_count * (2 if do_true_cfg else 1)
        timestep_dtype = self.transformer.input_dtypes["timestep"]
        timestep_rows = upload((timesteps.to(dtype) / 1000).to(timestep_dtype)[:, None].expand(-1, model_batch)
                               .contiguous(), self.device)
        guidance = None
        if self.guidance_embeds:
            guidance = upload(torch.full((model_batch,), float(guidance_scale), dtype=torch.float32).to(
                self.transformer.input_dtypes["guidance"]), self.device)

        # 5. the denoising loop: every tensor stays on self.device
        latents = self.denoise_flux(latents, timesteps, timestep_rows, prompt_embeds, pooled_prompt_embeds,
                                    text_ids, image_ids, guidance, true_cfg_scale if do_true_cfg else None,
                                    negative_prompt_embeds, negative_pooled_prompt_embeds, callback_on_step_end,
                                    callback_on_step_end_tensor_inputs)

        # 6. decode: only now does anything leave the device
        if output_type == "latent":
            image = latents
        else:
            image = self.postprocess(self.decode_flux_latents(latents, latent_height, latent_width), output_type)
        self.maybe_free_model_hooks()
        if not return_dict:
            return (image,)
        return FluxPipelineOutput(images=image)

    def denoise_flux(
        self,
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        timestep_rows: torch.Tensor,
        prompt_embeds: torch.Tensor,
        pooled_prompt_embeds: torch.Tensor,
        text_ids: torch.Tensor,
        image_ids: torch.Tensor,
        guidance: Optional[torch.Tensor],
        true_cfg_scale: Optional[float],
        negative_prompt_embeds: Optional[torch.Tensor],
        negative_pooled_prompt_embeds: Optional[torch.Tensor],
        callback_on_step_end: Optional[Callable[..., Dict[str, Any]]],
        callback_on_step_end_tensor_inputs: Sequence[str],
    ) -> torch.Tensor:
        """The flow-matching loop: one transformer call per step (negative and positive in one batch with
        ``true_cfg_scale``), its inputs written into the transformer's CUDA-graph buffers where it has them (the
        ones constant over the loop once), the scheduler's Euler step on the device. Nothing waits on the host."""
        feed = GraphFeed(self.transformer)
        guided = true_cfg_scale is not None

        def conditioning() -> Tuple[torch.Tensor, torch.Tensor]:
            if not guided:
                return prompt_embeds, pooled_prompt_embeds
            return (torch.cat([negative_prompt_embeds, prompt_embeds]),
                    torch.cat([negative_pooled_prompt_embeds, pooled_prompt_embeds]))

        embeds, pooled = conditioning()
        for i, t in enumerate(self.progress_bar(timesteps)):
            inputs = {"hidden_states": feed.cat("hidden_states", [latents] * (2 if guided else 1)),
                      "encoder_hidden_states": feed.same("encoder_hidden_states", embeds),
                      "pooled_projections": feed.same("pooled_projections", pooled),
                      "timestep": timestep_rows[i], "txt_ids": feed.same("txt_ids", text_ids),
                      "img_ids": feed.same("img_ids", image_ids)}
            if guidance is not None:
                inputs["guidance"] = feed.same("guidance", guidance)
            noise_pred = self.transformer(**inputs)[0]
            feed.learn(inputs)
            if guided:
                negative, positive = noise_pred.chunk(2)
                # negative + scale · (positive − negative), in one kernel
                noise_pred = torch.lerp(negative, positive, float(true_cfg_scale))
            # the Euler step makes a new tensor: the transformer's reused output buffer is not kept
            latents = self.scheduler.step(noise_pred, t, latents, return_dict=False)[0]
            if callback_on_step_end is not None:
                feed.forget()
                available = {"latents": latents, "prompt_embeds": prompt_embeds}
                tensors = {name: available[name] for name in callback_on_step_end_tensor_inputs}
                replaced = replaced_tensors(callback_on_step_end, i, callback_on_step_end(self, i, t, tensors),
                                            available)
                latents = replaced["latents"]
                if replaced["prompt_embeds"] is not prompt_embeds:
                    prompt_embeds = replaced["prompt_embeds"]
                    embeds, pooled = conditioning()
        return latents

    def decode_flux_latents(self, latents: torch.Tensor, latent_height: int, latent_width: int) -> torch.Tensor:
        """Images in [-1, 1], NCHW, on ``self.device``: the tokens unpacked, unscaled and unshifted, one image per VAE
        call (tile by tile with :meth:`enable_vae_tiling`)."""
        latents = unpack_latents(latents, latent_height, latent_width)
        latents = latents / self.vae_scaling_factor + self.vae_shift_factor
        latents = latents.to(self.vae_decoder.input_dtypes["latent_sample"])
        if self._tiles_latents(latents):
            return torch.cat([self._vae_tiler.decode(latents[i : i + 1]) for i in range(latents.shape[0])])
        # each call reuses the decoder's output buffer: copy each image out before the next call
        return torch.cat([self.vae_decoder(latent_sample=latents[i : i + 1])[0].clone()
                          for i in range(latents.shape[0])])
