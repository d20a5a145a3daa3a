"""Wan 2.1 / 2.2 text to video on ONNX Runtime, the loop on the device: the export's Wan folder (a UMT5 text encoder
taking the attention mask, one transformer over latent videos or Wan 2.2's two experts, Wan's causal 3-D VAE),
diffusers' ``UniPCMultistepScheduler`` (or its flow-matching Euler scheduler), with the arguments and output of
diffusers' ``WanPipeline``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from diffusers.pipelines.wan.pipeline_output import WanPipelineOutput
from diffusers.video_processor import VideoProcessor

from ..errors import ArgumentError, ModelFileError
from ..families import WAN_SETTINGS, WAN_TEXT_CONTEXT, family
from ..layout import WAN_VAE_CHUNK_PART, index_entry, write_transformer_model_index
from ..runtime.model import IOBindingORTModel
from .arguments import (
    Embeds,
    Generator,
    Latents,
    Prompt,
    StepEndCallback,
    TensorNames,
    check_generator,
    check_sequence_length,
    is_integer,
    is_real,
)
from .components import onnx, tokenizer
from .core import OnnxDiffusionPipeline, Warmup, on_device_stream
from .denoisers import WanDenoiser
from .loop import Guidance, Stage, denoise
from .prompts import WanPrompt
from .transfer import upload
from .wan_codec import WanVideoCodec

WAN = family("wan")
# the export's Wan folder: Wan 2.2's low-noise expert in transformer_2; the VAE's folders where the export wrote them
WAN_COMPONENTS = (
    onnx("text_encoder"),
    tokenizer("tokenizer", fixed_length=False),
    onnx("transformer"),
    onnx("transformer_2", optional=True),
    onnx("vae_encoder", optional=True),
    onnx("vae_decoder", optional=True),
)
# diffusers' WanPipeline defaults where the pipeline has no VAE: 4 video frames per latent frame, 8 pixels per latent
# pixel each way; the VAE config's per-channel mean and standard deviation of the latents
DEFAULT_TEMPORAL_FACTOR, DEFAULT_SPATIAL_FACTOR = 4, 8
WAN_LATENT_NORMS = ("latents_mean", "latents_std")


class WanCodec:
    """Wan's causal 3-D VAE as the pipeline's latent codec: what its config says of the latents (pixels per latent
    pixel each way, video frames per latent frame after the first, the per-channel mean and standard deviation the
    denoiser's latents are normalized by) and the chunk-by-chunk decoder (:class:`~.wan_codec.WanVideoCodec`).
    Without a VAE decoder (a folder of latents only) the factors are diffusers' defaults and nothing decodes.

    Args:
        pipe: the pipeline (its ``vae_decoder`` and ``vae_encoder`` are read).
    """

    #: the image VAEs' tiler: none (the video codec decodes tile by tile itself: ``enable_vae_tiling``)
    tiler = None

    def __init__(self, pipe: Any):
        decoder = getattr(pipe, "vae_decoder", None)
        self.video = WanVideoCodec(decoder, getattr(pipe, "vae_encoder", None)) if decoder is not None else None
        config = decoder.config if decoder is not None else {}

        def positive(key: str, default: int) -> int:
            value = config.get(key, default)
            if not is_integer(value) or value < 1:
                raise ModelFileError("vae_decoder config.json", f"{key}: expected a positive integer, got {value!r}")
            return int(value)

        self.scale_factor = positive("scale_factor_spatial", DEFAULT_SPATIAL_FACTOR)
        self.temporal_scale_factor = positive("scale_factor_temporal", DEFAULT_TEMPORAL_FACTOR)
        channels = self.video.latent_channels if self.video is not None else None
        self.latents_mean, self.latents_std = (self._channel_values(config, key, channels) for key in WAN_LATENT_NORMS)

    @staticmethod
    def _channel_values(config: Dict[str, Any], key: str, channels: Optional[int]) -> Optional[torch.Tensor]:
        """A per-channel list of the config (``None`` where absent), refused by name unless ``channels`` finite
        numbers (positive ones for a standard deviation)."""
        value = config.get(key)
        if value is None:
            return None
        if (
            not isinstance(value, list)
            or (channels is not None and len(value) != channels)
            or not all(is_real(v) and math.isfinite(v) and (key != "latents_std" or v > 0) for v in value)
        ):
            raise ModelFileError(
                "vae_decoder config.json", f"{key}: expected {channels or 'z_dim'} finite numbers, got {value!r}"
            )
        return torch.tensor(value, dtype=torch.float32)

    def vae_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """The denoiser's latents as the VAE decodes them: diffusers' ``latents / (1 / std) + mean`` per channel."""
        if self.latents_mean is None or self.latents_std is None:
            return latents
        shape = (1, latents.shape[1], 1, 1, 1)
        mean = upload(self.latents_mean.view(shape), latents.device).to(latents.dtype)
        inverse_std = 1.0 / upload(self.latents_std.view(shape), latents.device).to(latents.dtype)
        return latents / inverse_std + mean

    def session_parts(self, encodes: bool) -> List[IOBindingORTModel]:
        """The chunk graphs' models (the decoder's, and the encoder's where ``encodes``): models beside the
        pipeline's components whose sessions the pipeline starts building with theirs."""
        video = self.video
        if video is None:
            return []
        runners = [video.decoder, *([video.encoder] if encodes and video.encoder is not None else [])]
        return [runner.chunk for runner in runners]

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Videos ``(batch, 3, frames, height, width)`` in [-1, 1] on the device, of the denoiser's latents."""
        if self.video is None:
            raise ArgumentError("output_type", "expected 'latent' for a folder without vae_decoder/model.onnx")
        return self.video.decode(self.vae_latents(latents))

    def enable_tiling(self, **sizes: Optional[int]) -> None:
        """Tile by tile decoding (:meth:`~.wan_codec.WanVideoCodec.enable_tiling`'s sizes)."""
        if self.video is None:
            raise ArgumentError("enable_vae_tiling", "expected a folder with vae_decoder/model.onnx, got none")
        self.video.enable_tiling(**sizes)

    def disable_tiling(self) -> None:
        if self.video is not None:
            self.video.disable_tiling()

    def tiles(self, latents: torch.Tensor) -> bool:
        """Whether the image path's host-side tiling applies: never (the video codec tiles on the device itself)."""
        return False


class WanFamilyPipeline(Warmup, OnnxDiffusionPipeline):
    """What the Wan families (text to video, image to video) declare alike — the export's Wan folder, the Wan
    transformer(s) over latent videos, the UMT5 prompt, the video VAE, warm-up — and the steps their calls share: the
    checks, the experts' stages, the latent videos' shape, the frames' output. Each family is a subclass with its
    record and its own ``__call__``.

    The latents are videos ``(batch, 16, (num_frames − 1) / 4 + 1, height / 8, width / 8)``. Classifier-free guidance
    runs the negative and positive prompts in one transformer batch (diffusers makes two calls). A folder with Wan
    2.2's two experts (``transformer_2``, model_index.json's ``boundary_ratio``) runs the second below
    ``boundary_ratio`` × the scheduler's training timesteps, guided at ``guidance_scale_2``."""

    declared_components = WAN_COMPONENTS
    denoiser_part = WanDenoiser
    prompt_part = WanPrompt
    codec_part = WanCodec
    settings = dict(WAN_SETTINGS)
    broadcasts_negative_prompt = True
    output_class = WanPipelineOutput
    output_field = "frames"
    folder_description = " (a Wan ONNX folder)"
    model_cpu_offload_seq = "text_encoder->transformer->transformer_2->vae_decoder"

    def __init__(self, **components: Any):
        super().__init__(**components)
        self.video_processor = VideoProcessor(vae_scale_factor=self.vae_scale_factor)
        ratio = self.config.boundary_ratio
        if ratio is not None and (not is_real(ratio) or not 0.0 <= ratio <= 1.0):
            raise ModelFileError(
                "model_index.json", f"boundary_ratio: expected null or a number in [0, 1], got {ratio!r}"
            )
        if ratio is not None and getattr(self, "transformer_2", None) is None:
            raise ModelFileError(
                "model_index.json",
                f"boundary_ratio {ratio} needs Wan 2.2's low-noise expert (transformer_2), got none: the folder has no "
                "transformer_2/model.onnx",
            )

    def enable_vae_tiling(
        self,
        tile_sample_min_height: Optional[int] = None,
        tile_sample_min_width: Optional[int] = None,
        tile_sample_stride_height: Optional[int] = None,
        tile_sample_stride_width: Optional[int] = None,
    ) -> None:
        """Decodes each video tile by tile, as diffusers' ``pipe.vae.enable_tiling(...)`` with the same arguments
        (defaults: tiles of 256 pixels every 192): the VAE's memory is a tile's instead of a whole frame's
        (:meth:`~.wan_codec.WanVideoCodec.enable_tiling`)."""
        self.codec.enable_tiling(
            tile_sample_min_height=tile_sample_min_height,
            tile_sample_min_width=tile_sample_min_width,
            tile_sample_stride_height=tile_sample_stride_height,
            tile_sample_stride_width=tile_sample_stride_width,
        )

    @property
    def vae_tiling(self) -> Optional[Dict[str, int]]:
        """The tile sizes :meth:`enable_vae_tiling` set (``None`` while tiling is off)."""
        return self.codec.video.tiling if self.codec.video is not None else None

    @property
    def vae_scale_factor_temporal(self) -> int:
        """Video frames per latent frame after the first (diffusers' name)."""
        return self.codec.temporal_scale_factor

    @property
    def vae_scale_factor_spatial(self) -> int:
        """Pixels per latent pixel, each way (diffusers' name)."""
        return self.codec.scale_factor

    # ------------------------------------------------------------------------------------------------- checks
    def check_num_frames(self, num_frames: Any) -> None:
        """A video of ``num_frames`` frames must be one the VAE decodes: a first frame, then whole latent frames of
        :attr:`vae_scale_factor_temporal` frames (diffusers rounds others with a warning; here they are refused, so
        that the video has the frames asked for)."""
        factor = self.vae_scale_factor_temporal
        if not is_integer(num_frames) or num_frames < 1 or (num_frames - 1) % factor:
            nearest = max(num_frames // factor * factor + 1, 1) if is_integer(num_frames) else 1 + factor
            raise ArgumentError(
                "num_frames",
                f"expected a positive integer of the form {factor}k + 1 (a first frame, then {factor} frames per "
                f"latent frame of the VAE), got {num_frames!r}; e.g. {nearest} or {nearest + factor}",
            )

    def check_inputs_wan(
        self,
        *,
        num_frames: Any,
        num_videos_per_prompt: Any,
        guidance_scale_2: Any,
        attention_kwargs: Any,
        max_sequence_length: Any,
        generator: Generator,
        **call: Any,
    ) -> int:
        """Refuses, before any work, every argument a Wan call cannot run with: what Wan adds to
        :meth:`check_inputs` — the frame count, the videos per prompt, ``guidance_scale_2`` (only with two experts),
        ``attention_kwargs`` (an ONNX transformer has no attention processors), the UMT5 length (a prompt is encoded
        at it, in one batch with given ``prompt_embeds`` or ``negative_prompt_embeds``), a decoded output without a VAE
        decoder — then :meth:`check_inputs` (``call``: its arguments), then the generator (one of the kinds a call
        takes; a list, one per video).

        Returns:
            How many videos the call makes (prompts × ``num_videos_per_prompt``).
        """
        if attention_kwargs:
            raise ArgumentError(
                "attention_kwargs",
                f"expected None (an ONNX transformer has no attention processors to pass them to), "
                f"got {attention_kwargs!r}",
            )
        self.check_num_frames(num_frames)
        if not is_integer(num_videos_per_prompt) or num_videos_per_prompt < 1:
            raise ArgumentError("num_videos_per_prompt", f"expected a positive integer, got {num_videos_per_prompt!r}")
        if guidance_scale_2 is not None:
            if self.config.boundary_ratio is None:
                raise ArgumentError(
                    "guidance_scale_2",
                    "expected None for a pipeline of one transformer (model_index.json's boundary_ratio is null: "
                    f"Wan 2.2's two experts have one), got {guidance_scale_2!r}",
                )
            if not is_real(guidance_scale_2) or not math.isfinite(guidance_scale_2):
                raise ArgumentError("guidance_scale_2", f"expected a finite number, got {guidance_scale_2!r}")
        check_sequence_length(max_sequence_length, WAN_TEXT_CONTEXT)
        output_type = call.get("output_type")
        if output_type != "latent" and getattr(self, "vae_decoder", None) is None:
            raise ArgumentError(
                "output_type",
                f"expected 'latent' for a folder without vae_decoder/model.onnx (nothing decodes the latents), "
                f"got {output_type!r}",
            )
        guidance_scale, prompt_embeds = call.get("guidance_scale"), call.get("prompt_embeds")
        if (
            is_real(guidance_scale)
            and guidance_scale > 1.0
            and prompt_embeds is not None
            and call.get("negative_prompt_embeds") is None
            and getattr(prompt_embeds, "ndim", 0) == 3
            and prompt_embeds.shape[1] != max_sequence_length
        ):
            raise ArgumentError(
                "max_sequence_length",
                f"expected {prompt_embeds.shape[1]}, the length of prompt_embeds (the negative prompt is encoded at "
                f"it and goes into the transformer in one batch with them), got {max_sequence_length}; or give "
                "negative_prompt_embeds",
            )
        negative_prompt_embeds = call.get("negative_prompt_embeds")
        if (
            is_real(guidance_scale)
            and guidance_scale > 1.0
            and prompt_embeds is None
            and getattr(negative_prompt_embeds, "ndim", 0) == 3
            and negative_prompt_embeds.shape[1] != max_sequence_length
        ):
            raise ArgumentError(
                "negative_prompt_embeds",
                f"expected sequence length {max_sequence_length} (max_sequence_length: the prompt is encoded at it "
                "and goes into the transformer in one batch with them), got shape "
                f"{tuple(negative_prompt_embeds.shape)}",
            )
        self.check_inputs(**call)
        prompts = self.batch_size_of(call.get("prompt"), prompt_embeds)
        return check_generator(generator, prompts, num_videos_per_prompt, "video")

    # ----------------------------------------------------------------------------------------------- the steps
    def text_tensors(
        self,
        prompt: Prompt,
        negative_prompt: Prompt,
        guidance: Guidance,
        num_videos_per_prompt: int,
        prompt_embeds: Embeds,
        negative_prompt_embeds: Embeds,
        max_sequence_length: int,
    ) -> Dict[str, Optional[torch.Tensor]]:
        """The loop's text tensors on the device: the prompts' UMT5 states and, with classifier-free guidance, the
        negative prompts' (see :class:`~.prompts.WanPrompt`)."""
        prompt_embeds, negative_prompt_embeds = self.encode_prompt(
            prompt,
            negative_prompt,
            guidance.batched,
            num_videos_per_prompt,
            prompt_embeds,
            negative_prompt_embeds,
            max_sequence_length,
        )
        return {"prompt_embeds": prompt_embeds, "negative_prompt_embeds": negative_prompt_embeds}

    def schedule(
        self, num_inference_steps: int, guidance: Guidance, guidance_scale: float, guidance_scale_2: Optional[float]
    ) -> Tuple[torch.Tensor, List[Stage]]:
        """The scheduler's timesteps and the loop's later stages (:meth:`expert_stages`; ``guidance_scale_2``
        defaults to ``guidance_scale``)."""
        timesteps = self.set_timesteps(num_inference_steps)
        second = guidance_scale if guidance_scale_2 is None else guidance_scale_2
        return timesteps, self.expert_stages(timesteps, guidance, second)

    def latent_video_shape(self, videos: int, num_frames: int, height: int, width: int) -> Tuple[int, ...]:
        """The latents of ``videos`` videos of ``num_frames`` frames of ``height`` × ``width`` pixels."""
        frames = (num_frames - 1) // self.vae_scale_factor_temporal + 1
        factor = self.vae_scale_factor_spatial
        return (videos, self.latent_channels, frames, height // factor, width // factor)

    def expert_stages(self, timesteps: torch.Tensor, guidance: Guidance, guidance_scale_2: float) -> List[Stage]:
        """Wan 2.2's low-noise stage: ``transformer_2`` from the first step whose timestep is below
        ``boundary_ratio`` × the scheduler's training timesteps, guided at ``guidance_scale_2`` where the first stage
        guides (as diffusers decides); none for one transformer, or where no step is below the boundary."""
        ratio = self.config.boundary_ratio
        if ratio is None:
            return []
        boundary = ratio * self.scheduler.config.num_train_timesteps
        start = next((i for i, t in enumerate(timesteps.tolist()) if t < boundary), None)
        if start is None:
            return []
        return [Stage(start, self.transformer_2, Guidance(float(guidance_scale_2), guidance.batched))]

    def finish_video(self, latents: torch.Tensor, output_type: str, return_dict: bool) -> Any:
        """The call's output: the latents, or the decoded videos as diffusers' ``VideoProcessor`` gives them."""
        frames = (
            latents if output_type == "latent" else self.postprocess_frames(self.codec.decode(latents), output_type)
        )
        self.maybe_free_model_hooks()
        return self.pack_output(frames, return_dict)

    # ------------------------------------------------------------------------------------------------ warm-up
    def warmup_arguments(self) -> Dict[str, Callable[[Any], None]]:
        """``num_frames`` and ``max_sequence_length``: part of the transformer's input shapes, so a warm-up at other
        values makes graphs the calls do not replay."""
        return {
            "num_frames": self.check_num_frames,
            "max_sequence_length": lambda value: check_sequence_length(value, WAN_TEXT_CONTEXT),
        }

    def warmup_default_size(self) -> Tuple[int, int]:
        """diffusers' WanPipeline default: 480 × 832."""
        return 480, 832

    # -------------------------------------------------------------------------------------------------- saving
    def save_parts(self, target: Path) -> None:
        """The VAE's chunk graphs beside its components' ``model.onnx`` (reading the same weights file)."""
        video = self.codec.video
        runners = {"vae_decoder": video.decoder, "vae_encoder": video.encoder} if video is not None else {}
        for name, runner in runners.items():
            if runner is not None:
                runner.chunk.save_pretrained(target / name, file_name=WAN_VAE_CHUNK_PART, overwrite=True)

    def write_model_index(self, target: Path, written: List[str]) -> None:
        """The export's Wan index: the torch pipeline's class names, its ``boundary_ratio`` and
        ``expand_timesteps``."""
        transformer = ("diffusers", self.family.options["transformer_class"])
        image = {}
        if "image_encoder" in written:  # Wan 2.1 I2V's
            image["image_encoder"] = ("transformers", "CLIPVisionModel")
            image["image_processor"] = index_entry(getattr(self, "image_processor", None))
        write_transformer_model_index(
            target,
            self.family.index_class_name,
            {
                "scheduler": index_entry(self.scheduler),
                "transformer": transformer,
                "transformer_2": transformer if "transformer_2" in written else None,
                "vae": ("diffusers", "AutoencoderKLWan") if "vae_decoder" in written else None,
                "text_encoder": ("transformers", "UMT5EncoderModel"),
                "tokenizer": index_entry(self.tokenizer),
                **image,
            },
            {name: self.config.get(name, default) for name, default in self.settings.items()},
        )


class OnnxWanPipeline(WanFamilyPipeline):
    """Wan 2.1 / 2.2 text to video with the arguments and output of diffusers' ``WanPipeline``: every tensor of the
    loop stays on the transformer's device with ``io_binding=True``; ``io_binding=False`` is the numpy-like baseline.
    A folder whose transformer takes a timestep per latent token (Wan 2.2 TI2V, ``expand_timesteps``) gets it."""

    family = WAN

    @on_device_stream
    def __call__(
        self,
        prompt: Prompt = None,
        negative_prompt: Prompt = None,
        height: int = 480,
        width: int = 832,
        num_frames: int = 81,
        num_inference_steps: int = WAN.defaults.steps,
        guidance_scale: float = WAN.defaults.guidance_scale,
        guidance_scale_2: Optional[float] = None,
        num_videos_per_prompt: int = 1,
        generator: Generator = None,
        latents: Latents = None,
        prompt_embeds: Embeds = None,
        negative_prompt_embeds: Embeds = None,
        output_type: str = "np",
        return_dict: bool = True,
        attention_kwargs: Optional[Dict[str, Any]] = None,
        callback_on_step_end: StepEndCallback = None,
        callback_on_step_end_tensor_inputs: TensorNames = ("latents",),
        max_sequence_length: int = WAN_TEXT_CONTEXT,
    ):
        """Generates videos from text, with the arguments of diffusers' ``WanPipeline``.

        ``num_frames`` must be of the form 4k + 1 and ``height`` and ``width`` multiples of 16 (diffusers rounds
        others with a warning; here they are refused before any work). ``generator`` is a ``torch.Generator`` (a
        list: one per video; the same noise as diffusers for the same seed) or a numpy ``RandomState``; ``latents``
        are ``(videos, channels, latent frames, height / 8, width / 8)``. ``callback_on_step_end(pipe, step, t,
        tensors)`` gets and may replace ``latents``, ``prompt_embeds`` and ``negative_prompt_embeds``, on the device.
        ``guidance_scale_2``: the low-noise expert's guidance scale (Wan 2.2; default: ``guidance_scale``).

        Returns:
            ``WanPipelineOutput(frames)`` — "np": ``(videos, frames, height, width, 3)`` in [0, 1]; "pil": a list of
            frames per video; "pt": ``(videos, frames, 3, height, width)``; "latent": the latents — or
            ``(frames,)`` without ``return_dict``.
        """
        # 1. check inputs, before any work
        videos = self.check_inputs_wan(
            num_frames=num_frames,
            num_videos_per_prompt=num_videos_per_prompt,
            guidance_scale_2=guidance_scale_2,
            attention_kwargs=attention_kwargs,
            max_sequence_length=max_sequence_length,
            generator=generator,
            prompt=prompt,
            negative_prompt=negative_prompt,
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            height=height,
            width=width,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            output_type=output_type,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
        )
        guidance = Guidance.classifier_free(guidance_scale)

        # 2. the prompts' UMT5 states (the negative prompt's with guidance), on the device
        tensors = self.text_tensors(
            prompt,
            negative_prompt,
            guidance,
            num_videos_per_prompt,
            prompt_embeds,
            negative_prompt_embeds,
            max_sequence_length,
        )

        # 3. the schedule, and Wan 2.2's low-noise expert from the first step below its boundary
        timesteps, stages = self.schedule(num_inference_steps, guidance, guidance_scale, guidance_scale_2)

        # 4. initial noise: latent videos, float32 as diffusers draws them
        latents = self.prepare_latents(
            self.latent_video_shape(videos, num_frames, height, width), torch.float32, generator, latents
        )

        # 5. the denoising loop: every tensor stays on self.device
        latents = denoise(
            self.denoiser,
            latents,
            timesteps,
            tensors=tensors,
            guidance=guidance,
            stages=stages,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
        )

        # 6. decode: only now does anything leave the device
        return self.finish_video(latents, output_type, return_dict)
