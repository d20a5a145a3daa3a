"""Stable Diffusion 3 / 3.5 text-to-image on ONNX Runtime, the loop on the device: optimum's SD3 export layout (two
CLIP text encoders with projections and hidden states, an optional T5 encoder, an MMDiT ``transformer`` taking
``hidden_states``, ``encoder_hidden_states``, ``pooled_projections`` and ``timestep``), diffusers'
``FlowMatchEulerDiscreteScheduler``."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from diffusers.pipelines.stable_diffusion_3 import StableDiffusion3PipelineOutput
from diffusers.schedulers.scheduling_utils import SchedulerMixin

from ..layout import write_transformer_model_index
from ..runtime.model import IOBindingORTModel
from .arguments import Generator, check_sequence_length, is_integer, is_real
from .denoise import GraphFeed, check_callback_arguments, on_device_stream, replaced_tensors
from .pipeline import OnnxStableDiffusionPipelineBase, tensor_of

logger = logging.getLogger(__name__)

SD3_COMPONENTS = ("text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "vae_encoder", "vae_decoder")
TRANSFORMER_INPUTS = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep")
# the loop's tensors a step-end callback may ask for and give back replaced (diffusers' SD3 list)
SD3_CALLBACK_TENSOR_INPUTS = ("latents", "prompt_embeds", "pooled_prompt_embeds")
# diffusers' limit on the T5 sequence (its check_inputs refuses more)
MAX_SEQUENCE_LENGTH = 512
# SD3's VAE latent scaling (SD3 and SD3.5 share the VAE), for a folder whose vae_decoder config.json names none
SD3_VAE_SCALING_FACTOR, SD3_VAE_SHIFT_FACTOR = 1.5305, 0.0609
Prompt = Union[str, List[str], None]


class OnnxStableDiffusion3Pipeline(OnnxStableDiffusionPipelineBase):
    """Stable Diffusion 3 / 3.5 text-to-image with the arguments of diffusers' ``StableDiffusion3Pipeline``: every
    tensor of the loop stays on the transformer's device with ``io_binding=True``; on CUDA every component replays
    its CUDA graphs by default (``cuda_graph="auto"``). ``io_binding=False`` is the numpy-like baseline.

    A folder without ``text_encoder_3`` (a T5-less export) runs as diffusers does with ``text_encoder_3=None``: the T5
    part of the text embeddings is zeros.
    """

    _optional_components = ["text_encoder_3", "tokenizer_3", "vae_encoder"]
    model_cpu_offload_seq = "text_encoder->text_encoder_2->text_encoder_3->transformer->vae_decoder"
    _onnx_components = SD3_COMPONENTS
    denoiser_name = "transformer"
    _tokenizer_names = ("tokenizer", "tokenizer_2", "tokenizer_3")
    _callback_tensor_inputs = list(SD3_CALLBACK_TENSOR_INPUTS)
    _default_unet_sample_size = 128  # SD3: 1024 px
    _default_vae_scaling_factor = SD3_VAE_SCALING_FACTOR
    _vae_constants_hint = f"SD3's are scaling_factor {SD3_VAE_SCALING_FACTOR}, shift_factor {SD3_VAE_SHIFT_FACTOR}"

    def __init__(
        self,
        vae_encoder: Optional[IOBindingORTModel],
        vae_decoder: IOBindingORTModel,
        text_encoder: IOBindingORTModel,
        text_encoder_2: IOBindingORTModel,
        text_encoder_3: Optional[IOBindingORTModel],
        tokenizer: Any,
        tokenizer_2: Any,
        tokenizer_3: Any,
        transformer: IOBindingORTModel,
        scheduler: SchedulerMixin,
    ):
        super(OnnxStableDiffusionPipelineBase, self).__init__()  # DiffusionPipeline's, not the SD module list
        self.register_modules(
            vae_encoder=vae_encoder, vae_decoder=vae_decoder, text_encoder=text_encoder,
            text_encoder_2=text_encoder_2, text_encoder_3=text_encoder_3, tokenizer=tokenizer,
            tokenizer_2=tokenizer_2, tokenizer_3=tokenizer_3, transformer=transformer, scheduler=scheduler,
        )
        if text_encoder_3 is not None and tokenizer_3 is None:
            raise ValueError("tokenizer_3: expected the T5 tokenizer with text_encoder_3, got None (the folder has no "
                             "tokenizer_3/)")
        self._init_image_side()
        self._check_text_encoders()
        self.vae_shift_factor = self._vae_config_float("shift_factor", SD3_VAE_SHIFT_FACTOR, positive=False)
        self.patch_size = self.config_int(self.transformer, "patch_size", 2, "transformer")

    # ------------------------------------------------------------------------------------------------ properties
    @property
    def default_image_size(self) -> int:
        """The height and width a call gets where it gives none: the transformer config's ``sample_size`` (latents)
        times the VAE's scale factor (1024 for SD3), as in diffusers."""
        return self.config_int(self.transformer, "sample_size", self._default_unet_sample_size, "transformer") * \
            self.vae_scale_factor

    @property
    def default_sample_size(self) -> int:
        """The transformer's sample size in latents (diffusers' SD3 pipeline has the same attribute)."""
        return self.default_image_size // self.vae_scale_factor

    @property
    def size_multiple(self) -> int:
        """What heights and widths must be multiples of: the VAE's scale factor times the transformer's patch size
        (16 for SD3): the transformer cuts the latents into patches."""
        return self.vae_scale_factor * self.patch_size

    @property
    def joint_attention_dim(self) -> int:
        """The width of the transformer's ``encoder_hidden_states`` (T5's width: 4096 for SD3)."""
        declared = self._declared_dim(self.transformer, "encoder_hidden_states", 2)
        return declared or self.config_int(self.transformer, "joint_attention_dim", 4096, "transformer")

    # --------------------------------------------------------------------------------------------------- checks
    def _check_unet_inputs(self) -> None:
        """The transformer must take SD3's four inputs (a Flux transformer also takes ids; a UNet other ones)."""
        declared = self.transformer.input_names
        if sorted(declared) == sorted(TRANSFORMER_INPUTS):
            return
        if {"img_ids", "txt_ids"} & set(declared):
            hint = "a Flux transformer: use OnnxFluxPipeline"
        elif "sample" in declared:
            hint = "a UNet, not an SD3 transformer: use OnnxStableDiffusionPipeline or its XL variant"
        else:
            hint = "put an SD3 transformer's model.onnx in the transformer folder"
        raise ValueError(f"transformer: expected inputs {list(TRANSFORMER_INPUTS)}, got {declared} in "
                         f"{self.transformer.model_path!r} ({hint})")

    def _check_text_encoders(self) -> None:
        """Both CLIP encoders must give ``text_embeds`` (the projection) and their hidden states (an export with
        ``output_hidden_states``: SD3 reads the penultimate); the T5 encoder ``last_hidden_state``."""
        for name in ("text_encoder", "text_encoder_2"):
            encoder = getattr(self, name)
            outputs = encoder.output_names
            layers = [output for output in outputs if output.startswith("hidden_states.")]
            if encoder.input_names != ["input_ids"] or "text_embeds" not in outputs or len(layers) < 2:
                raise ValueError(f"{name}: expected a CLIPTextModelWithProjection export taking input_ids, with "
                                 f"outputs text_embeds and hidden_states.0 … hidden_states.N, got inputs "
                                 f"{encoder.input_names} and outputs {outputs} in {encoder.model_path!r}")
        if self.text_encoder_3 is not None:
            encoder = self.text_encoder_3
            if encoder.input_names != ["input_ids"] or "last_hidden_state" not in encoder.output_names:
                raise ValueError(f"text_encoder_3: expected a T5 encoder export (input_ids → last_hidden_state), got "
                                 f"inputs {encoder.input_names} and outputs {encoder.output_names} in "
                                 f"{encoder.model_path!r}")

    def _read_latent_channels(self) -> int:
        configured = self.transformer.config.get("out_channels") or self.transformer.config.get("in_channels")
        declared = self._declared_dim(self.transformer, "hidden_states", 1)
        decoder = self._declared_dim(self.vae_decoder, "latent_sample", 1) or \
            self.vae_decoder.config.get("latent_channels")
        channels = declared or configured or decoder
        if not is_integer(channels) or channels < 1:
            raise ValueError("transformer: cannot tell the number of latent channels: no config.json and a dynamic "
                             "channel dim")
        if decoder is not None and decoder != channels:
            raise ValueError(f"vae_decoder: expected {channels} latent channels (the transformer's hidden_states), "
                             f"got {decoder}")
        return int(channels)

    @property
    def size_multiple_reason(self) -> str:
        return f"the transformer's patch size {self.patch_size}"

    def load_lora_weights(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("load_lora_weights: runtime LoRA is not available for Stable Diffusion 3 pipelines "
                                  "yet; fuse the LoRA into the torch pipeline (diffusers' fuse_lora) before exporting "
                                  "it")

    def check_inputs_sd3(
        self,
        prompt: Prompt,
        prompt_2: Prompt,
        prompt_3: Prompt,
        negative_prompt_2: Prompt,
        negative_prompt_3: Prompt,
        prompt_embeds: Any,
        negative_prompt_embeds: Any,
        pooled_prompt_embeds: Any,
        negative_pooled_prompt_embeds: Any,
        max_sequence_length: Any,
        callback_on_step_end: Any,
        callback_on_step_end_tensor_inputs: Any,
    ) -> None:
        """What SD3 adds to :meth:`check_inputs`, refused before any work: the second and third prompts (a str or a
        list of str, one per prompt), the pooled embeddings (``(batch, width)`` of the transformer's
        ``pooled_projections``, with their hidden states), ``max_sequence_length`` and the callback's tensors."""
        check_callback_arguments(callback_on_step_end, callback_on_step_end_tensor_inputs,
                                 SD3_CALLBACK_TENSOR_INPUTS)
        check_sequence_length(max_sequence_length, MAX_SEQUENCE_LENGTH)
        prompts = self.batch_size_of(prompt, prompt_embeds) if prompt is not None or prompt_embeds is not None \
            else None
        for name, texts, rival, rival_name in (
                ("prompt_2", prompt_2, prompt_embeds, "prompt_embeds"),
                ("prompt_3", prompt_3, prompt_embeds, "prompt_embeds"),
                ("negative_prompt_2", negative_prompt_2, negative_prompt_embeds, "negative_prompt_embeds"),
                ("negative_prompt_3", negative_prompt_3, negative_prompt_embeds, "negative_prompt_embeds")):
            if texts is None:
                continue
            if rival is not None:
                raise ValueError(f"{name} and {rival_name}: expected at most one of them, got both")
            self.check_texts(name, texts, prompts, broadcast=True)
        if prompt_embeds is not None and pooled_prompt_embeds is None:
            raise ValueError("pooled_prompt_embeds: expected them with prompt_embeds (SD3's transformer takes both), "
                             "got None")
        if negative_prompt_embeds is not None and negative_pooled_prompt_embeds is None:
            raise ValueError("negative_pooled_prompt_embeds: expected them with negative_prompt_embeds, got None")
        for name, pooled, embeds in (("pooled_prompt_embeds", pooled_prompt_embeds, prompt_embeds),
                                     ("negative_pooled_prompt_embeds", negative_pooled_prompt_embeds,
                                      negative_prompt_embeds)):
            if pooled is None:
                continue
            if embeds is None:
                raise ValueError(f"{name}: expected it with {name.replace('pooled_', '')}, got it alone")
            self.check_embeds(name, pooled, 2, "(batch, width)", "pooled_projections")
            if pooled.shape[0] != embeds.shape[0]:
                raise ValueError(f"{name}: expected {embeds.shape[0]} rows like {name.replace('pooled_', '')}, got "
                                 f"shape {tuple(pooled.shape)}")

    # ------------------------------------------------------------------------------------------------ prompts
    def encode_prompt(
        self,
        prompt: Prompt,
        prompt_2: Prompt = None,
        prompt_3: Prompt = None,
        num_images_per_prompt: int = 1,
        do_classifier_free_guidance: bool = True,
        negative_prompt: Prompt = None,
        negative_prompt_2: Prompt = None,
        negative_prompt_3: Prompt = None,
        prompt_embeds: Optional[torch.Tensor] = None,
        negative_prompt_embeds: Optional[torch.Tensor] = None,
        pooled_prompt_embeds: Optional[torch.Tensor] = None,
        negative_pooled_prompt_embeds: Optional[torch.Tensor] = None,
        clip_skip: Optional[int] = None,
        max_sequence_length: int = 256,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(prompt_embeds, pooled_prompt_embeds)`` on ``self.device`` in the transformer's dtype, ``[negative;
        positive]`` when guiding, each prompt's rows repeated ``num_images_per_prompt`` times. As diffusers: both
        CLIPs' penultimate hidden states side by side, padded to T5's width, then T5's states (zeros without a T5)
        along the sequence; both CLIPs' pooled projections side by side; an absent negative prompt is ``""``."""
        if prompt_embeds is None:
            prompt = [prompt] if isinstance(prompt, str) else prompt
            prompt_embeds, pooled_prompt_embeds = self._encode_text_sd3(
                prompt, prompt_2 or prompt, prompt_3 or prompt, clip_skip, max_sequence_length)
        batch_size = prompt_embeds.shape[0]
        if do_classifier_free_guidance and negative_prompt_embeds is None:
            negative_prompt = negative_prompt or ""
            negatives = [negative_prompt, negative_prompt_2 or negative_prompt, negative_prompt_3 or negative_prompt]
            negatives = [batch_size * [text] if isinstance(text, str) else text for text in negatives]
            if len(negatives[0]) != batch_size:
                raise ValueError(f"negative_prompt: expected {batch_size} prompts (as many as prompt), got "
                                 f"{len(negatives[0])}")
            negative_prompt_embeds, negative_pooled_prompt_embeds = self._encode_text_sd3(
                *negatives, clip_skip=None, max_sequence_length=max_sequence_length)
        dtype = self.transformer.input_dtypes["encoder_hidden_states"]
        pooled_dtype = self.transformer.input_dtypes["pooled_projections"]

        def ready(tensor: Any, dtype: torch.dtype) -> torch.Tensor:
            return tensor_of(tensor).to(device=self.device, dtype=dtype).repeat_interleave(num_images_per_prompt, 0)

        prompt_embeds, pooled = ready(prompt_embeds, dtype), ready(pooled_prompt_embeds, pooled_dtype)
        if not do_classifier_free_guidance:
            return prompt_embeds, pooled
        return (torch.cat([ready(negative_prompt_embeds, dtype), prompt_embeds]),
                torch.cat([ready(negative_pooled_prompt_embeds, pooled_dtype), pooled]))

    def _encode_text_sd3(self, prompt: List[str], prompt_2: Prompt, prompt_3: Prompt, clip_skip: Optional[int],
                         max_sequence_length: int) -> Tuple[torch.Tensor, torch.Tensor]:
        # one string serves every prompt (the checks allow it)
        prompt_2 = [prompt_2] * len(prompt) if isinstance(prompt_2, str) else prompt_2
        prompt_3 = [prompt_3] * len(prompt) if isinstance(prompt_3, str) else prompt_3
        for name, texts in (("prompt_2", prompt_2), ("prompt_3", prompt_3)):
            if len(texts) != len(prompt):
                raise ValueError(f"{name}: expected {len(prompt)} prompts like prompt, got {len(texts)}")
        hidden_1, pooled_1 = self._clip_embeds(prompt, self.tokenizer, self.text_encoder, clip_skip)
        hidden_2, pooled_2 = self._clip_embeds(prompt_2, self.tokenizer_2, self.text_encoder_2, clip_skip)
        t5 = self._t5_embeds(prompt_3, max_sequence_length)
        clip = torch.cat([hidden_1, hidden_2.to(hidden_1.dtype)], dim=-1)
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))  # to T5's width
        return torch.cat([clip.to(t5.dtype), t5], dim=-2), torch.cat([pooled_1, pooled_2.to(pooled_1.dtype)], dim=-1)

    def _clip_embeds(self, texts: List[str], tokenizer: Any, encoder: IOBindingORTModel,
                     clip_skip: Optional[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        """One CLIP's penultimate (``clip_skip``: earlier) hidden states and pooled projection, copied out of the
        encoder's reused output buffers."""
        max_length = tokenizer.model_max_length
        ids = tokenizer(texts, padding="max_length", max_length=max_length, truncation=True,
                        return_tensors="np").input_ids
        self.warn_truncated(tokenizer, texts, max_length, "CLIP can only handle sequences up to")
        outputs = dict(zip(encoder.output_names, encoder(input_ids=self.token_ids(encoder, ids))))
        layers = sorted((name for name in outputs if name.startswith("hidden_states.")),
                        key=lambda name: int(name.split(".")[1]))
        if clip_skip is not None and (not is_integer(clip_skip) or not 0 <= clip_skip <= len(layers) - 2):
            raise ValueError(f"clip_skip: expected None or an integer in [0, {len(layers) - 2}], got {clip_skip!r}")
        index = len(layers) - 2 - (clip_skip or 0)
        return outputs[layers[index]].clone(), outputs["text_embeds"].clone()

    def _t5_embeds(self, texts: List[str], max_sequence_length: int) -> torch.Tensor:
        """T5's last hidden states (``max_sequence_length`` tokens), or zeros of the transformer's width without a
        T5 (diffusers' ``text_encoder_3=None``)."""
        if self.text_encoder_3 is None:
            return torch.zeros(len(texts), max_sequence_length, self.joint_attention_dim, device=self.device,
                               dtype=self.transformer.input_dtypes["encoder_hidden_states"])
        ids = self.tokenizer_3(texts, padding="max_length", max_length=max_sequence_length, truncation=True,
                               add_special_tokens=True, return_tensors="np").input_ids
        self.warn_truncated(self.tokenizer_3, texts, max_sequence_length, "`max_sequence_length` is set to")
        return self.text_encoder_3(input_ids=self.token_ids(self.text_encoder_3, ids))[0].clone()

    # ------------------------------------------------------------------------------------------------ schedule
    def flow_timesteps(self, num_inference_steps: Optional[int], sigmas: Optional[Sequence[float]],
                       mu: Optional[float], latent_height: int, latent_width: int) -> torch.Tensor:
        """The scheduler's timesteps for this call, its state kept on the CPU (see :meth:`set_timesteps`). With
        ``use_dynamic_shifting`` (SD3.5) and no ``mu``, ``mu`` is the schedule's shift for this image's token count:
        linear between ``base_shift`` at ``base_image_seq_len`` and ``max_shift`` at ``max_image_seq_len`` (the
        scheduler config's values, as diffusers computes it)."""
        config = self.scheduler.config
        kwargs: Dict[str, Any] = {}
        if mu is not None:
            kwargs["mu"] = float(mu)
        elif config.get("use_dynamic_shifting", False):
            tokens = (latent_height // self.patch_size) * (latent_width // self.patch_size)
            base_tokens, max_tokens = config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096)
            base_shift, max_shift = config.get("base_shift", 0.5), config.get("max_shift", 1.16)
            slope = (max_shift - base_shift) / (max_tokens - base_tokens)
            kwargs["mu"] = tokens * slope + base_shift - slope * base_tokens
        if sigmas is not None:
            self.scheduler.set_timesteps(sigmas=list(sigmas), **kwargs)
        else:
            self.scheduler.set_timesteps(num_inference_steps, **kwargs)
        if hasattr(self.scheduler, "set_begin_index"):
            self.scheduler.set_begin_index(0)
        return self.scheduler.timesteps

    # ---------------------------------------------------------------------------------------------------- loop
    def denoise_sd3(
        self,
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        prompt_embeds: torch.Tensor,
        pooled_prompt_embeds: torch.Tensor,
        guidance_scale: float,
        step_kwargs: Dict[str, Any],
        callback_on_step_end: Optional[Callable[..., Dict[str, Any]]] = None,
        callback_on_step_end_tensor_inputs: Sequence[str] = ("latents",),
    ) -> torch.Tensor:
        """The flow-matching loop. Every tensor stays on ``self.device``; nothing waits on the host: the guidance
        batch is written straight into the transformer graph's ``hidden_states`` input, the embeddings copied into
        its inputs once (:class:`GraphFeed`), the timesteps made once on the device.

        Returns:
            The denoised latents.
        """
        do_classifier_free_guidance = guidance_scale > 1.0
        rows = latents.shape[0] * (2 if do_classifier_free_guidance else 1)
        timestep_inputs = self.timestep_inputs(timesteps, rows, self.transformer)
        feed = GraphFeed(self.transformer)
        for i, t in enumerate(self.progress_bar(timesteps)):
            model_input = feed.cat("hidden_states", [latents] * 2 if do_classifier_free_guidance else [latents])
            inputs = {"hidden_states": model_input, "timestep": timestep_inputs[i],
                      "encoder_hidden_states": feed.same("encoder_hidden_states", prompt_embeds),
                      "pooled_projections": feed.same("pooled_projections", pooled_prompt_embeds)}
            noise_pred = self.transformer(**inputs)[0]
            feed.learn(inputs)
            if do_classifier_free_guidance:
                noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
                # uncond + scale * (text - uncond) in one kernel
                noise_pred = torch.lerp(noise_pred_uncond, noise_pred_text, float(guidance_scale))
            # the Euler step makes a new tensor from the velocity: the reused output buffer is read before the next
            # call writes it
            latents = self.scheduler.step(noise_pred, t, latents, **step_kwargs, return_dict=False)[0]
            if callback_on_step_end is not None:
                feed.forget()
                available = {"latents": latents, "prompt_embeds": prompt_embeds,
                             "pooled_prompt_embeds": pooled_prompt_embeds}
                tensors = {name: available[name] for name in callback_on_step_end_tensor_inputs}
                replaced = replaced_tensors(callback_on_step_end, i, callback_on_step_end(self, i, t, tensors),
                                            available, SD3_CALLBACK_TENSOR_INPUTS)
                latents, prompt_embeds = replaced["latents"], replaced["prompt_embeds"]
                pooled_prompt_embeds = replaced["pooled_prompt_embeds"]
        return latents

    @torch.no_grad()
    @on_device_stream
    def __call__(
        self,
        prompt: Prompt = None,
        prompt_2: Prompt = None,
        prompt_3: Prompt = None,
        height: Optional[int] = None,
        width: Optional[int] = None,
        num_inference_steps: int = 28,
        sigmas: Optional[List[float]] = None,
        guidance_scale: float = 7.0,
        negative_prompt: Prompt = None,
        negative_prompt_2: Prompt = None,
        negative_prompt_3: Prompt = None,
        num_images_per_prompt: int = 1,
        generator: Generator = None,
        latents: Optional[Union[torch.Tensor, np.ndarray]] = None,
        prompt_embeds: Optional[torch.Tensor] = None,
        negative_prompt_embeds: Optional[torch.Tensor] = None,
        pooled_prompt_embeds: Optional[torch.Tensor] = None,
        negative_pooled_prompt_embeds: Optional[torch.Tensor] = None,
        output_type: str = "pil",
        return_dict: bool = True,
        joint_attention_kwargs: Optional[Dict[str, Any]] = None,
        clip_skip: Optional[int] = None,
        callback_on_step_end: Optional[Callable[..., Dict[str, Any]]] = None,
        callback_on_step_end_tensor_inputs: Sequence[str] = ("latents",),
        max_sequence_length: int = 256,
        skip_guidance_layers: Optional[List[int]] = None,
        mu: Optional[float] = None,
    ):
        """Generates images from text with the arguments of diffusers' ``StableDiffusion3Pipeline``. ``height`` and
        ``width`` default to the transformer's sample size × the VAE factor (1024 for SD3); ``generator`` is a
        ``torch.Generator`` (a list: one per image) or a numpy ``RandomState``.

        Not available on an ONNX transformer: ``skip_guidance_layers`` (skip-layer guidance needs the transformer run
        without some of its layers, which an exported graph cannot) and ``joint_attention_kwargs`` (LoRA scales, IP
        adapters): refused.

        Returns:
            ``StableDiffusion3PipelineOutput(images)``, or a tuple without return_dict.
        """
        if skip_guidance_layers is not None:
            raise ValueError("skip_guidance_layers: expected None, got "
                             f"{skip_guidance_layers!r}; an exported transformer cannot leave out layers")
        if joint_attention_kwargs is not None:
            raise ValueError(f"joint_attention_kwargs: expected None (an ONNX transformer takes no attention "
                             f"arguments), got {joint_attention_kwargs!r}")
        if sigmas is not None and (not isinstance(sigmas, (list, tuple, np.ndarray)) or len(sigmas) == 0 or
                                   not all(is_real(s) and math.isfinite(s) for s in sigmas)):
            raise ValueError(f"sigmas: expected a non-empty list of finite numbers, got {sigmas!r}")
        if mu is not None and (not is_real(mu) or not math.isfinite(mu)):
            raise ValueError(f"mu: expected a finite number, got {mu!r}")
        height = self.default_image_size if height is None else height
        width = self.default_image_size if width is None else width
        self.check_inputs_sd3(prompt, prompt_2, prompt_3, negative_prompt_2, negative_prompt_3, prompt_embeds,
                              negative_prompt_embeds, pooled_prompt_embeds, negative_pooled_prompt_embeds,
                              max_sequence_length, callback_on_step_end, callback_on_step_end_tensor_inputs)
        self.check_inputs(prompt, height, width, num_inference_steps if sigmas is None else len(sigmas), None,
                          negative_prompt, prompt_embeds, negative_prompt_embeds, output_type,
                          guidance_scale=guidance_scale, num_images_per_prompt=num_images_per_prompt,
                          callback_on_step_end=callback_on_step_end)
        batch_size = self.batch_size_of(prompt, prompt_embeds)
        do_classifier_free_guidance = guidance_scale > 1.0

        # 1. text: both CLIPs' penultimate states and T5's, both CLIPs' pooled projections
        prompt_embeds, pooled = self.encode_prompt(
            prompt, prompt_2, prompt_3, num_images_per_prompt, do_classifier_free_guidance, negative_prompt,
            negative_prompt_2, negative_prompt_3, prompt_embeds, negative_prompt_embeds, pooled_prompt_embeds,
            negative_pooled_prompt_embeds, clip_skip, max_sequence_length)

        # 2. initial noise and the flow-matching schedule
        rows = batch_size * num_images_per_prompt
        latent_height, latent_width = height // self.vae_scale_factor, width // self.vae_scale_factor
        latents_shape = (rows, self.latent_channels, latent_height, latent_width)
        latents = self.prepare_latents(latents_shape, self.transformer.input_dtypes["hidden_states"], generator,
                                       latents)
        timesteps = self.flow_timesteps(num_inference_steps, sigmas, mu, latent_height, latent_width)

        # 3. denoising loop on the device
        latents = self.denoise_sd3(
            latents, timesteps, prompt_embeds, pooled, guidance_scale, self.scheduler_step_kwargs(generator, 0.0),
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
        )

        # 4. decode: diffusers' latents / scaling_factor + shift_factor, written as (latents + shift · scaling) /
        # scaling so that the shared decoder (tiled or not) divides by the scaling factor
        if output_type != "latent":
            latents = latents + self.vae_shift_factor * self.vae_scaling_factor
        return self.finish(latents, output_type, return_dict)

    # ---------------------------------------------------------------------------------------------------- warm-up
    def warmup(
        self,
        heights: Union[int, Sequence[int], None] = None,
        widths: Union[int, Sequence[int], None] = None,
        batch_sizes: Union[int, Sequence[int]] = 1,
        guidance_scales: Union[float, Sequence[float]] = 7.0,
        num_inference_steps: int = 2,
        max_sequence_length: int = 256,
    ) -> None:
        """Creates the sessions and captures the CUDA graphs that calls of these sizes will use (see
        :meth:`OnnxStableDiffusionPipelineBase.warmup`). Every argument is checked before the first call: a refused
        warm-up runs nothing.

        Args:
            max_sequence_length: the T5 prompt length the calls will use (``__call__``'s default: 256). The
                transformer's text sequence is CLIP's 77 tokens plus this many, so a warm-up at another length makes
                graphs the calls do not replay. Without a T5 encoder it counts the same: the T5 part is this many
                tokens of zeros, as in diffusers.
        """
        check_sequence_length(max_sequence_length, MAX_SEQUENCE_LENGTH)
        for height, width, batch_size, guidance_scale in self._warmup_combinations(
                heights, widths, batch_sizes, guidance_scales, num_inference_steps):
            self._warmup_call(height, width, batch_size, guidance_scale, num_inference_steps, max_sequence_length)

    def _warmup_call(self, height: int, width: int, batch_size: int, guidance_scale: float, steps: int,
                     max_sequence_length: int = 256) -> None:
        self(prompt=[""] * batch_size, height=height, width=width, num_inference_steps=steps,
             guidance_scale=guidance_scale, generator=torch.Generator().manual_seed(0), output_type="np",
             max_sequence_length=max_sequence_length)

    def _write_model_index(self, target: Path, written: List[str]) -> None:
        def module(name: str, library: str, class_name: str) -> Optional[Tuple[str, str]]:
            return (library, class_name) if name in written else None

        def tokenizer(name: str) -> Optional[Tuple[str, str]]:
            value = getattr(self, name, None)
            if value is None:
                return None
            class_name = type(value).__name__
            if class_name == "T5Tokenizer" and getattr(value, "is_fast", False):
                class_name = "T5TokenizerFast"  # the name transformers 4 and 5 both load from tokenizer.json
            return ("transformers", class_name)

        write_transformer_model_index(target, "StableDiffusion3Pipeline", {
            "scheduler": ("diffusers", type(self.scheduler).__name__),
            "transformer": ("diffusers", "SD3Transformer2DModel"),
            "vae": ("diffusers", "AutoencoderKL"),
            "text_encoder": module("text_encoder", "transformers", "CLIPTextModelWithProjection"),
            "text_encoder_2": module("text_encoder_2", "transformers", "CLIPTextModelWithProjection"),
            "text_encoder_3": module("text_encoder_3", "transformers", "T5EncoderModel"),
            "tokenizer": tokenizer("tokenizer"), "tokenizer_2": tokenizer("tokenizer_2"),
            "tokenizer_3": tokenizer("tokenizer_3"), "image_encoder": None, "feature_extractor": None,
        })

    def pack_output(self, image: Any, return_dict: bool) -> Any:
        if not return_dict:
            return (image,)
        return StableDiffusion3PipelineOutput(images=image)
