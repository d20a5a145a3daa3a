"""Stable Diffusion 3 / 3.5 text-to-image on ONNX Runtime, the loop on the device: optimum's SD3 export layout (two
CLIP text encoders with projections and hidden states, an optional T5 encoder, an MMDiT ``transformer`` taking
``hidden_states``, ``encoder_hidden_states``, ``pooled_projections`` and ``timestep``), diffusers'
``FlowMatchEulerDiscreteScheduler``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from diffusers.pipelines.stable_diffusion_3 import StableDiffusion3PipelineOutput

from ..errors import ArgumentError
from ..families import family
from ..layout import index_entry, write_transformer_model_index
from .arguments import Embeds, Generator, Latents, Prompt, StepEndCallback, TensorNames, check_sequence_length, is_real
from .components import VAE_COMPONENTS, onnx, tokenizer
from .core import OnnxDiffusionPipeline, VaeConstants, Warmup, on_device_stream
from .denoisers import MMDiTDenoiser
from .loop import Guidance, denoise
from .lora import LoraLoaderMixin
from .prompts import SD3Prompt

# optimum's SD3 folder (a T5-less export leaves text_encoder_3 out; T5's length is the call's max_sequence_length)
SD3_COMPONENTS = (
    onnx("text_encoder"),
    onnx("text_encoder_2"),
    onnx("text_encoder_3", optional=True),
    tokenizer("tokenizer"),
    tokenizer("tokenizer_2"),
    tokenizer("tokenizer_3", optional=True, fixed_length=False),
    onnx("transformer"),
    *VAE_COMPONENTS,
)
SD3 = family("sd3")
# diffusers' limit on the T5 sequence (its check_inputs refuses more)
MAX_SEQUENCE_LENGTH = 512
# SD3's VAE latent scaling (SD3 and SD3.5 share the VAE), for a folder whose vae_decoder config.json names none
SD3_VAE_SCALING_FACTOR, SD3_VAE_SHIFT_FACTOR = 1.5305, 0.0609


class OnnxStableDiffusion3Pipeline(LoraLoaderMixin, Warmup, OnnxDiffusionPipeline):
    """Stable Diffusion 3 / 3.5 text-to-image with the arguments of diffusers' ``StableDiffusion3Pipeline``: every
    tensor of the loop stays on the transformer's device with ``io_binding=True``; on CUDA every component replays
    its CUDA graphs by default (``cuda_graph="auto"``). ``io_binding=False`` is the numpy-like baseline.

    A folder without ``text_encoder_3`` (a T5-less export) runs as diffusers does with ``text_encoder_3=None``: the T5
    part of the text embeddings is zeros.
    """

    family = SD3
    declared_components = SD3_COMPONENTS
    denoiser_part = MMDiTDenoiser
    prompt_part = SD3Prompt
    vae_constants = VaeConstants.of("SD3", SD3_VAE_SCALING_FACTOR, SD3_VAE_SHIFT_FACTOR)
    output_class = StableDiffusion3PipelineOutput
    model_cpu_offload_seq = "text_encoder->text_encoder_2->text_encoder_3->transformer->vae_decoder"

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
    ) -> None:
        """What SD3 adds to :meth:`check_inputs`, refused before any work: the second and third prompts (a str or a
        list of str, one per prompt), the pooled embeddings (``(batch, width)`` of the transformer's
        ``pooled_projections``, with their hidden states) and ``max_sequence_length``."""
        check_sequence_length(max_sequence_length, MAX_SEQUENCE_LENGTH)
        prompts = self.batch_size_of(prompt, prompt_embeds) if prompt is not None or prompt_embeds is not None else None
        for name, texts, rival, rival_name in (
            ("prompt_2", prompt_2, prompt_embeds, "prompt_embeds"),
            ("prompt_3", prompt_3, prompt_embeds, "prompt_embeds"),
            ("negative_prompt_2", negative_prompt_2, negative_prompt_embeds, "negative_prompt_embeds"),
            ("negative_prompt_3", negative_prompt_3, negative_prompt_embeds, "negative_prompt_embeds"),
        ):
            if texts is None:
                continue
            if rival is not None:
                raise ArgumentError(f"{name} and {rival_name}", "expected at most one of them, got both")
            self.check_texts(name, texts, prompts, broadcast=True)
        if prompt_embeds is not None and pooled_prompt_embeds is None:
            raise ArgumentError(
                "pooled_prompt_embeds", "expected them with prompt_embeds (SD3's transformer takes both), got None"
            )
        if negative_prompt_embeds is not None and negative_pooled_prompt_embeds is None:
            raise ArgumentError("negative_pooled_prompt_embeds", "expected them with negative_prompt_embeds, got None")
        for name, pooled, embeds in (
            ("pooled_prompt_embeds", pooled_prompt_embeds, prompt_embeds),
            ("negative_pooled_prompt_embeds", negative_pooled_prompt_embeds, negative_prompt_embeds),
        ):
            if pooled is None:
                continue
            if embeds is None:
                raise ArgumentError(name, f"expected it with {name.replace('pooled_', '')}, got it alone")
            self.check_embeds(name, pooled, 2, "(batch, width)", "pooled_projections")
            if pooled.shape[0] != embeds.shape[0]:
                raise ArgumentError(
                    name,
                    f"expected {embeds.shape[0]} rows like {name.replace('pooled_', '')}, got "
                    f"shape {tuple(pooled.shape)}",
                )

    # ------------------------------------------------------------------------------------------------ prompts
    @on_device_stream
    def __call__(
        self,
        prompt: Prompt = None,
        prompt_2: Prompt = None,
        prompt_3: Prompt = None,
        height: Optional[int] = None,
        width: Optional[int] = None,
        num_inference_steps: int = SD3.defaults.steps,
        sigmas: Optional[List[float]] = None,
        guidance_scale: float = SD3.defaults.guidance_scale,
        negative_prompt: Prompt = None,
        negative_prompt_2: Prompt = None,
        negative_prompt_3: Prompt = None,
        num_images_per_prompt: int = 1,
        generator: Generator = None,
        latents: Latents = None,
        prompt_embeds: Embeds = None,
        negative_prompt_embeds: Embeds = None,
        pooled_prompt_embeds: Embeds = None,
        negative_pooled_prompt_embeds: Embeds = None,
        output_type: str = "pil",
        return_dict: bool = True,
        joint_attention_kwargs: Optional[Dict[str, Any]] = None,
        clip_skip: Optional[int] = None,
        callback_on_step_end: StepEndCallback = None,
        callback_on_step_end_tensor_inputs: TensorNames = ("latents",),
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
            raise ArgumentError(
                "skip_guidance_layers",
                f"expected None, got {skip_guidance_layers!r}; an exported transformer cannot leave out layers",
            )
        if mu is not None and (not is_real(mu) or not math.isfinite(mu)):
            raise ArgumentError("mu", f"expected a finite number, got {mu!r}")
        height = self.default_image_size if height is None else height
        width = self.default_image_size if width is None else width
        self.check_inputs_sd3(
            prompt,
            prompt_2,
            prompt_3,
            negative_prompt_2,
            negative_prompt_3,
            prompt_embeds,
            negative_prompt_embeds,
            pooled_prompt_embeds,
            negative_pooled_prompt_embeds,
            max_sequence_length,
        )
        self.check_inputs(
            prompt=prompt,
            negative_prompt=negative_prompt,
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            height=height,
            width=width,
            num_inference_steps=num_inference_steps,
            sigmas=sigmas,
            output_type=output_type,
            guidance_scale=guidance_scale,
            num_images_per_prompt=num_images_per_prompt,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
            generator=generator,
            joint_attention_kwargs=joint_attention_kwargs,
        )
        batch_size = self.batch_size_of(prompt, prompt_embeds)
        do_classifier_free_guidance = guidance_scale > 1.0

        # 1. text: both CLIPs' penultimate states and T5's, both CLIPs' pooled projections
        prompt_embeds, pooled = self.encode_prompt(
            prompt,
            prompt_2,
            prompt_3,
            num_images_per_prompt,
            do_classifier_free_guidance,
            negative_prompt,
            negative_prompt_2,
            negative_prompt_3,
            prompt_embeds,
            negative_prompt_embeds,
            pooled_prompt_embeds,
            negative_pooled_prompt_embeds,
            clip_skip,
            max_sequence_length,
        )

        # 2. initial noise and the flow-matching schedule
        rows = batch_size * num_images_per_prompt
        latent_height, latent_width = height // self.vae_scale_factor, width // self.vae_scale_factor
        latents_shape = (rows, self.latent_channels, latent_height, latent_width)
        latents = self.prepare_latents(
            latents_shape, self.transformer.input_dtypes["hidden_states"], generator, latents
        )
        timesteps = self.denoiser.timesteps(num_inference_steps, sigmas, mu, latent_height, latent_width)

        # 3. denoising loop on the device
        latents = denoise(
            self.denoiser,
            latents,
            timesteps,
            tensors={"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled},
            guidance=Guidance.classifier_free(guidance_scale),
            step_kwargs=self.scheduler_step_kwargs(generator, 0.0),
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
        )

        # 4. decode (diffusers' latents / scaling_factor + shift_factor): only now does anything leave the device
        return self.finish(latents, output_type, return_dict)

    def warmup_arguments(self) -> Dict[str, Callable[[Any], None]]:
        """``max_sequence_length``: the T5 prompt length the calls will use (``__call__``'s default: 256). The
        transformer's text sequence is CLIP's 77 tokens plus this many, so a warm-up at another length makes graphs
        the calls do not replay; without a T5 encoder it counts the same (that many tokens of zeros)."""
        return {"max_sequence_length": lambda value: check_sequence_length(value, MAX_SEQUENCE_LENGTH)}

    def write_model_index(self, target: Path, written: List[str]) -> None:
        def module(name: str, library: str, class_name: str) -> Optional[Tuple[str, str]]:
            return (library, class_name) if name in written else None

        write_transformer_model_index(
            target,
            self.family.index_class_name,
            {
                "scheduler": index_entry(self.scheduler),
                "transformer": ("diffusers", self.family.options["transformer_class"]),
                "vae": ("diffusers", "AutoencoderKL"),
                "text_encoder": module("text_encoder", "transformers", "CLIPTextModelWithProjection"),
                "text_encoder_2": module("text_encoder_2", "transformers", "CLIPTextModelWithProjection"),
                "text_encoder_3": module("text_encoder_3", "transformers", "T5EncoderModel"),
                "tokenizer": index_entry(getattr(self, "tokenizer", None)),
                "tokenizer_2": index_entry(getattr(self, "tokenizer_2", None)),
                "tokenizer_3": index_entry(getattr(self, "tokenizer_3", None)),
                "image_encoder": None,
                "feature_extractor": None,
            },
        )
