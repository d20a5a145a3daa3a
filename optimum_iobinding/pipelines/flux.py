"""FLUX.1 (schnell and dev) text-to-image on ONNX Runtime, the loop on the device: optimum's Flux export layout (a CLIP
text encoder for the pooled prompt, a T5 encoder for the token embeddings, a transformer over 2×2-packed latent
tokens with rotary position ids, an AutoencoderKL of 16 latent channels), diffusers'
``FlowMatchEulerDiscreteScheduler``."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from diffusers.pipelines.flux.pipeline_output import FluxPipelineOutput

from ..errors import ArgumentError
from ..families import FLUX_GUIDANCE, FLUX_IMAGE_IDS, FLUX_TEXT_IDS, family
from ..layout import index_entry, write_transformer_model_index
from .arguments import (
    is_integer,
    Embeds,
    Generator,
    Latents,
    Prompt,
    StepEndCallback,
    TensorNames,
    check_generator,
    check_sequence_length,
    is_real,
)
from .codec import pack_latents
from .components import VAE_COMPONENTS, onnx, tokenizer
from .core import OnnxDiffusionPipeline, VaeConstants, Warmup, on_device_stream
from .denoisers import FluxDenoiser, latent_image_ids
from .loop import Guidance, denoise
from .lora import LoraLoaderMixin
from .prompts import FluxPrompt
from .transfer import tensor_of, upload

logger = logging.getLogger(__name__)

# optimum's Flux folder (T5's length is the call's max_sequence_length)
FLUX_COMPONENTS = (
    onnx("text_encoder"),
    onnx("text_encoder_2"),
    tokenizer("tokenizer"),
    tokenizer("tokenizer_2", fixed_length=False),
    onnx("transformer"),
    *VAE_COMPONENTS,
)
# FLUX.1's VAE latent scaling, for a folder whose vae_decoder config.json names none (diffusers' FLUX.1 VAE config)
FLUX_VAE_SCALING_FACTOR, FLUX_VAE_SHIFT_FACTOR = 0.3611, 0.1159
FLUX = family("flux")
# diffusers' FluxPipeline: 128 latent pixels (1024 px) by default, T5 prompts of at most 512 tokens
MAX_SEQUENCE_LENGTH = 512


class FluxFamilyPipeline(LoraLoaderMixin, Warmup, OnnxDiffusionPipeline):
    """What the FLUX.1 families (FLUX.1, Kontext, Fill, Control) declare alike — optimum's Flux folder, the FLUX.1
    transformer over packed latent tokens, FLUX.1's VAE constants, runtime LoRA, warm-up — and the steps their calls
    share: the checks, the prompts (and true CFG's negative ones), the initial noise, the position ids, the
    transformer's constant inputs, an image's packed latents. Each family is a subclass with its record and its own
    ``__call__``."""

    declared_components = FLUX_COMPONENTS
    denoiser_part = FluxDenoiser
    prompt_part = FluxPrompt
    vae_constants = VaeConstants.of("FLUX.1", FLUX_VAE_SCALING_FACTOR, FLUX_VAE_SHIFT_FACTOR)
    packed_latents = True
    output_class = FluxPipelineOutput
    folder_description = " (a FLUX.1 ONNX folder)"
    model_cpu_offload_seq = "text_encoder->text_encoder_2->transformer->vae_decoder"

    @property
    def guidance_embeds(self) -> bool:
        """Whether the transformer takes the guidance scale as an input (FLUX.1 dev), or not (schnell)."""
        return self.denoiser.guidance_embeds

    def write_model_index(self, target: Path, written: List[str]) -> None:
        """optimum's Flux index, as the export writes it: the torch pipeline's class names (one ``vae`` entry for the
        two VAE folders)."""
        write_transformer_model_index(
            target,
            self.family.index_class_name,
            {
                "scheduler": index_entry(self.scheduler),
                "transformer": ("diffusers", self.family.options["transformer_class"]),
                "vae": ("diffusers", "AutoencoderKL"),
                "text_encoder": ("transformers", "CLIPTextModel"),
                "text_encoder_2": ("transformers", "T5EncoderModel"),
                "tokenizer": index_entry(self.tokenizer),
                "tokenizer_2": index_entry(self.tokenizer_2),
                "image_encoder": None,
                "feature_extractor": None,
            },
        )

    def warmup_arguments(self) -> Dict[str, Callable[[Any], None]]:
        """``max_sequence_length``: the T5 prompt length the calls will use: part of the transformer's input shapes,
        so a warm-up at another length makes graphs the calls do not replay."""
        return {"max_sequence_length": lambda value: check_sequence_length(value, MAX_SEQUENCE_LENGTH)}

    # ------------------------------------------------------------------------------------------------- checks

    def check_inputs_flux(
        self,
        *,
        prompt: Prompt,
        prompt_2: Prompt,
        prompt_embeds: Any,
        pooled_prompt_embeds: Any,
        max_sequence_length: Any,
        negative_prompt: Prompt = None,
        negative_prompt_2: Prompt = None,
        true_cfg_scale: Any = 1.0,
        negative_prompt_embeds: Any = None,
        negative_pooled_prompt_embeds: Any = None,
        **call: Any,
    ) -> None:
        """Refuses, before any work, every argument the call cannot run with, naming it, what was expected and what
        came: the shared ones (:meth:`check_call`; ``call``: its arguments), then FLUX.1's prompts, their
        embeddings and ``true_cfg_scale``."""
        self.check_call(**call)
        # FLUX.1's schedule counts its steps even with sigmas (FLUX.1 dev's config may ignore them), and its guidance
        # scale is an input of FLUX.1 dev's transformer: neither may be left out
        steps = call.get("num_inference_steps")
        if not is_integer(steps) or steps <= 0:
            raise ArgumentError("num_inference_steps", f"expected a positive integer, got {steps!r}")
        for name, value in (("guidance_scale", call.get("guidance_scale")), ("true_cfg_scale", true_cfg_scale)):
            if not is_real(value) or not math.isfinite(value):
                raise ArgumentError(name, f"expected a finite number, got {value!r}")
        check_sequence_length(max_sequence_length, MAX_SEQUENCE_LENGTH)
        if prompt is not None and prompt_embeds is not None:
            raise ArgumentError("prompt and prompt_embeds", "expected one of them, got both")
        if prompt is None and prompt_embeds is None:
            raise ArgumentError("prompt and prompt_embeds", "expected one of them, got neither")
        if prompt_embeds is not None and pooled_prompt_embeds is None:
            raise ArgumentError(
                "pooled_prompt_embeds", "expected them with prompt_embeds (the transformer takes both), got None"
            )
        if pooled_prompt_embeds is not None and prompt_embeds is None:
            raise ArgumentError("pooled_prompt_embeds", "expected them with prompt_embeds, got them alone")
        if negative_prompt_embeds is not None and negative_pooled_prompt_embeds is None:
            raise ArgumentError("negative_pooled_prompt_embeds", "expected them with negative_prompt_embeds, got None")
        batch = self.check_texts("prompt", prompt, None)
        self.check_texts("prompt_2", prompt_2, batch)
        negatives = self.check_texts("negative_prompt", negative_prompt, batch, broadcast=True)
        self.check_texts("negative_prompt_2", negative_prompt_2, negatives, broadcast=True)
        for name, texts, rival, rival_name in (
            ("prompt_2", prompt_2, prompt_embeds, "prompt_embeds"),
            ("negative_prompt", negative_prompt, negative_prompt_embeds, "negative_prompt_embeds"),
            ("negative_prompt_2", negative_prompt_2, negative_prompt_embeds, "negative_prompt_embeds"),
        ):
            if texts is not None and rival is not None:
                raise ArgumentError(f"{name} and {rival_name}", "expected at most one of them, got both")
        rows = batch
        for name, embeds, rank, layout, input_name in (
            ("prompt_embeds", prompt_embeds, 3, "(batch, sequence, hidden)", "encoder_hidden_states"),
            ("pooled_prompt_embeds", pooled_prompt_embeds, 2, "(batch, width)", "pooled_projections"),
            ("negative_prompt_embeds", negative_prompt_embeds, 3, "(batch, sequence, hidden)", "encoder_hidden_states"),
            ("negative_pooled_prompt_embeds", negative_pooled_prompt_embeds, 2, "(batch, width)", "pooled_projections"),
        ):
            if embeds is None:
                continue
            self.check_embeds(name, embeds, rank, layout, input_name)
            rows = embeds.shape[0] if rows is None else rows
            if embeds.shape[0] != rows:
                raise ArgumentError(name, f"expected {rows} rows (one per prompt), got shape {tuple(embeds.shape)}")
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

    # ---------------------------------------------------------------------------------------- the shared steps
    def image_count(self, batch_size: int, num_images_per_prompt: int, generator: Generator) -> int:
        """How many images a call makes (prompts × ``num_images_per_prompt``); a generator of another kind than a
        call takes, or a list of them but one torch.Generator per image, is refused
        (:func:`.arguments.check_generator`)."""
        return check_generator(generator, batch_size, num_images_per_prompt)

    def text_tensors(
        self,
        *,
        prompt: Prompt,
        prompt_2: Prompt,
        negative_prompt: Prompt,
        negative_prompt_2: Prompt,
        true_cfg_scale: float,
        prompt_embeds: Embeds,
        pooled_prompt_embeds: Embeds,
        negative_prompt_embeds: Embeds,
        negative_pooled_prompt_embeds: Embeds,
        num_images_per_prompt: int,
        max_sequence_length: int,
    ) -> Tuple[Dict[str, Optional[torch.Tensor]], torch.Tensor, Guidance]:
        """The loop's text tensors on the device — the prompt's T5 and pooled CLIP embeddings and, with true CFG, the
        negative prompt's (a str: one negative prompt for every prompt; its text at the prompt's token count, since
        given embeddings may be shorter than max_sequence_length) — the text's position ids, and the guidance: true
        CFG in one batch where ``true_cfg_scale`` > 1 and a negative prompt is given, as diffusers decides."""
        batch_size = self.batch_size_of(prompt, prompt_embeds)
        negative = negative_prompt is not None or (
            negative_prompt_embeds is not None and negative_pooled_prompt_embeds is not None
        )
        guidance = Guidance(float(true_cfg_scale), batched=True) if true_cfg_scale > 1 and negative else Guidance()
        prompt_embeds, pooled_prompt_embeds, text_ids = self.encode_prompt(
            prompt, prompt_2, num_images_per_prompt, prompt_embeds, pooled_prompt_embeds, max_sequence_length
        )
        if guidance.batched:
            if negative_prompt_embeds is None:
                negative_prompt = (
                    [negative_prompt] * batch_size if isinstance(negative_prompt, str) else negative_prompt
                )
                negative_prompt_2 = (
                    [negative_prompt_2] * batch_size if isinstance(negative_prompt_2, str) else negative_prompt_2
                )
            negative_prompt_embeds, negative_pooled_prompt_embeds, _ = self.encode_prompt(
                negative_prompt,
                negative_prompt_2,
                num_images_per_prompt,
                negative_prompt_embeds,
                negative_pooled_prompt_embeds,
                prompt_embeds.shape[1],
            )
        tensors = {
            "prompt_embeds": prompt_embeds,
            "pooled_prompt_embeds": pooled_prompt_embeds,
            "negative_prompt_embeds": negative_prompt_embeds,
            "negative_pooled_prompt_embeds": negative_pooled_prompt_embeds,
        }
        return tensors, text_ids, guidance

    def latent_size(self, height: int, width: int) -> Tuple[int, int]:
        """The latents' height and width for a ``height`` × ``width`` image (even: the 2×2 packing)."""
        return 2 * (height // (self.vae_scale_factor * 2)), 2 * (width // (self.vae_scale_factor * 2))

    @property
    def latent_dtype(self) -> torch.dtype:
        """The dtype of the loop's latents: the transformer's ``hidden_states``'."""
        return self.transformer.input_dtypes["hidden_states"]

    def noise(self, image_count: int, latent_height: int, latent_width: int, generator: Generator) -> torch.Tensor:
        """Initial noise on the device, drawn unpacked as diffusers draws it (the same numbers for the same seed)."""
        shape = (image_count, self.latent_channels, latent_height, latent_width)
        return self.prepare_latents(shape, torch.float32, generator).to(self.latent_dtype)

    def given_latents(self, latents: Latents, image_count: int, tokens: int) -> torch.Tensor:
        """A call's packed ``latents`` on the device, refused by name unless ``(images, tokens, 4 × latent
        channels)``."""
        latents = tensor_of(latents, "latents")
        expected = (image_count, tokens, self.latent_channels * 4)
        if tuple(latents.shape) != expected:
            raise ArgumentError(
                "latents",
                f"expected packed latents of shape {expected} (batch, tokens, 4 × latent "
                f"channels), got {tuple(latents.shape)}",
            )
        return latents.to(device=self.device, dtype=self.latent_dtype)

    def initial_latents(
        self, image_count: int, latent_height: int, latent_width: int, generator: Generator, latents: Latents
    ) -> torch.Tensor:
        """A loop's first packed latents from noise: :meth:`noise` packed into tokens, or the given ``latents``."""
        if latents is not None:
            return self.given_latents(latents, image_count, (latent_height // 2) * (latent_width // 2))
        return pack_latents(self.noise(image_count, latent_height, latent_width, generator))

    def position_ids(self, rows: int, columns: int, first: float = 0.0) -> torch.Tensor:
        """The rotary position ids of a ``rows`` × ``columns`` grid of packed tokens, on the device: ``(first, row,
        column)`` (the latents' first id is 0; FLUX.1 Kontext's reference image's is 1)."""
        ids = latent_image_ids(rows, columns)
        ids[:, 0] = first
        return upload(ids.to(self.transformer.input_dtypes[FLUX_IMAGE_IDS]), self.device)

    def transformer_inputs(
        self, text_ids: torch.Tensor, image_ids: torch.Tensor, model_batch: int, guidance_scale: float
    ) -> Dict[str, torch.Tensor]:
        """The transformer's inputs that stay the same over the loop: the position ids and (FLUX.1 dev) the guidance
        scale, made once on the device for ``model_batch`` rows."""
        inputs = {FLUX_TEXT_IDS: text_ids, FLUX_IMAGE_IDS: image_ids}
        if self.guidance_embeds:
            inputs[FLUX_GUIDANCE] = upload(
                torch.full((model_batch,), float(guidance_scale), dtype=torch.float32).to(
                    self.transformer.input_dtypes[FLUX_GUIDANCE]
                ),
                self.device,
            )
        return inputs

    @staticmethod
    def check_tiling(rows: int, count: int, name: str) -> None:
        """Refuses, naming ``name``, ``rows`` images that cannot be repeated as a whole into ``count`` (the images a
        call makes): their number must divide it."""
        if count % rows:
            raise ArgumentError(
                name, f"expected a number of images that divides {count} (the images the call makes), got {rows}"
            )

    def tiled(self, tensor: torch.Tensor, count: int, name: str) -> torch.Tensor:
        """``count`` rows of ``tensor``: its rows repeated as a whole, as diffusers' FLUX.1 pipelines repeat their
        image latents (``torch.cat([x] * k)``), refused by name unless their number divides ``count``."""
        rows = tensor.shape[0]
        self.check_tiling(rows, count, name)
        return torch.cat([tensor] * (count // rows)) if rows != count else tensor

    def pixels(self, image: Any, height: Optional[int] = None, width: Optional[int] = None) -> torch.Tensor:
        """An image argument as diffusers' image processor makes it: NCHW in [-1, 1], ``height`` × ``width`` where
        given, float32 on the device."""
        return self.image_processor.preprocess(image, height=height, width=width).to(self.device, torch.float32)

    def image_latents(self, pixels: torch.Tensor, generator: Generator) -> torch.Tensor:
        """The scaled latents of ``pixels`` (NCHW in [-1, 1]; sampled with a torch ``generator`` where the VAE
        encoder gives a distribution, else its mode: ``None`` for diffusers' ``sample_mode="argmax"``), unpacked, in
        the loop's dtype."""
        return self.encode_image(pixels, generator).to(self.latent_dtype)


def image_rows(image: Any) -> int:
    """How many images an image argument holds: a list's length, a 4-d array's or tensor's first dim, else one."""
    if isinstance(image, list):
        return len(image)
    return int(image.shape[0]) if getattr(image, "ndim", 0) == 4 else 1


class OnnxFluxPipeline(FluxFamilyPipeline):
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

    family = FLUX

    # --------------------------------------------------------------------------------------------------- call
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
        num_inference_steps: int = FLUX.defaults.steps,
        sigmas: Optional[List[float]] = None,
        guidance_scale: float = FLUX.defaults.guidance_scale,
        num_images_per_prompt: int = 1,
        generator: Generator = None,
        latents: Latents = None,
        prompt_embeds: Embeds = None,
        pooled_prompt_embeds: Embeds = None,
        negative_prompt_embeds: Embeds = None,
        negative_pooled_prompt_embeds: Embeds = None,
        output_type: str = "pil",
        return_dict: bool = True,
        joint_attention_kwargs: Optional[Dict[str, Any]] = None,
        callback_on_step_end: StepEndCallback = None,
        callback_on_step_end_tensor_inputs: TensorNames = ("latents",),
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
        self.check_inputs_flux(
            prompt=prompt,
            prompt_2=prompt_2,
            negative_prompt=negative_prompt,
            negative_prompt_2=negative_prompt_2,
            true_cfg_scale=true_cfg_scale,
            prompt_embeds=prompt_embeds,
            pooled_prompt_embeds=pooled_prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            negative_pooled_prompt_embeds=negative_pooled_prompt_embeds,
            max_sequence_length=max_sequence_length,
            height=height,
            width=width,
            num_inference_steps=num_inference_steps,
            sigmas=sigmas,
            guidance_scale=guidance_scale,
            num_images_per_prompt=num_images_per_prompt,
            output_type=output_type,
            joint_attention_kwargs=joint_attention_kwargs,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
        )
        batch_size = self.batch_size_of(prompt, prompt_embeds)
        image_count = self.image_count(batch_size, num_images_per_prompt, generator)

        # 2. prompt embeddings (the negative prompt's with true CFG), on the device
        tensors, text_ids, guidance = self.text_tensors(
            prompt=prompt,
            prompt_2=prompt_2,
            negative_prompt=negative_prompt,
            negative_prompt_2=negative_prompt_2,
            true_cfg_scale=true_cfg_scale,
            prompt_embeds=prompt_embeds,
            pooled_prompt_embeds=pooled_prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            negative_pooled_prompt_embeds=negative_pooled_prompt_embeds,
            num_images_per_prompt=num_images_per_prompt,
            max_sequence_length=max_sequence_length,
        )

        # 3. initial noise (drawn unpacked, as diffusers draws it), packed into tokens, and their position ids
        latent_height, latent_width = self.latent_size(height, width)
        latents = self.initial_latents(image_count, latent_height, latent_width, generator, latents)
        image_ids = self.position_ids(latent_height // 2, latent_width // 2)

        # 4. timesteps, and the transformer's constant inputs (FLUX.1 dev's guidance made once on the device)
        timesteps = self.denoiser.timesteps(num_inference_steps, latents.shape[1], sigmas)
        inputs = self.transformer_inputs(text_ids, image_ids, image_count * guidance.copies, guidance_scale)

        # 5. the denoising loop: every tensor stays on self.device
        latents = denoise(
            self.denoiser,
            latents,
            timesteps,
            tensors=tensors,
            guidance=guidance,
            inputs=inputs,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
        )

        # 6. decode: only now does anything leave the device
        return self.finish(latents, output_type, return_dict, (latent_height, latent_width))
