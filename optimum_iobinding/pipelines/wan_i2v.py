"""Wan 2.1 / 2.2 image to video on ONNX Runtime, the loop on the device: the export's Wan image-to-video folder
(transformers taking the first frame's mask and latents beside the latents; Wan 2.1's also a CLIP image encoder's
states), with the arguments and output of diffusers' ``WanImageToVideoPipeline``."""

from __future__ import annotations

import functools
from typing import Any, Dict, Optional

import PIL.Image
import torch

from ..errors import ArgumentError, ArgumentTypeError, ModelFileError
from ..families import WAN_IMAGE_EMBEDS, WAN_IMAGE_INPUT, WAN_IMAGE_PIXELS, WAN_TEXT_CONTEXT, family
from .arguments import Embeds, Generator, Latents, Prompt, StepEndCallback, TensorNames
from .components import onnx, processor
from .core import on_device_stream
from .denoisers import WanDenoiser
from .loop import Guidance, denoise
from .transfer import upload
from .wan import WAN_COMPONENTS, WanFamilyPipeline

WAN_I2V = family("wan-i2v")
# the Wan folder, with Wan 2.1 I2V's CLIP image encoder and its processor
WAN_I2V_COMPONENTS = (
    *WAN_COMPONENTS,
    onnx("image_encoder", optional=True),
    processor("image_processor", optional=True),
)


def first_frame_channels(latent_channels: int, temporal_scale_factor: int) -> int:
    """What image to video concatenates to the latents: the first frame's mask (one channel per video frame of a latent
    frame) and its latents."""
    return temporal_scale_factor + latent_channels


class OnnxWanImageToVideoPipeline(WanFamilyPipeline):
    """Wan 2.1 / 2.2 image to video with the arguments and output of diffusers' ``WanImageToVideoPipeline``: the
    video starts from ``image`` (and, with ``last_image``, ends at it); every tensor of the loop stays on the
    transformer's device with ``io_binding=True``.

    The first frame (a video of it followed by black frames, as diffusers makes it) is encoded once by the VAE's
    encoder; its latents and a mask of the frames it fixes go into the transformer beside the latents at every step
    (the loop's extra channels). Wan 2.1 I2V's transformer also takes the CLIP image encoder's penultimate states of the
    image; diffusers' attention then reads the last 512 tokens of the text context as the prompt's, so its prompts are
    512 tokens long (``max_sequence_length``). Wan 2.2 I2V has no image encoder and may have two experts."""

    family = WAN_I2V
    declared_components = WAN_I2V_COMPONENTS
    denoiser_part = functools.partial(WanDenoiser, condition_channels=first_frame_channels)
    encodes_images = True
    folder_description = " (a Wan image-to-video ONNX folder)"
    model_cpu_offload_seq = "text_encoder->image_encoder->transformer->transformer_2->vae_encoder->vae_decoder"

    def __init__(self, **components: Any):
        super().__init__(**components)
        if self.config.expand_timesteps:
            raise ModelFileError(
                "model_index.json",
                "expand_timesteps: expected false (Wan 2.2 TI2V's image to video, which blends the first frame "
                "into the latents, is not run here), got true",
            )
        if self.takes_image_embeds and (getattr(self, "image_encoder", None) is None or self.image_processor is None):
            raise ModelFileError(
                "image_encoder",
                f"expected a CLIP image encoder and its image_processor with a transformer that takes "
                f"{WAN_IMAGE_INPUT}, got the folder without image_encoder/model.onnx or image_processor/",
            )
        encoder = getattr(self, "image_encoder", None)
        if encoder is not None and (
            encoder.input_names != [WAN_IMAGE_PIXELS] or WAN_IMAGE_EMBEDS not in encoder.output_names
        ):
            raise ModelFileError(
                "image_encoder",
                f"expected a CLIP image encoder export ({WAN_IMAGE_PIXELS} → {WAN_IMAGE_EMBEDS}, its penultimate states), "
                f"got inputs {encoder.input_names} and outputs {encoder.output_names} in {encoder.model_path!r}",
            )
        for name in ("vae_encoder", "vae_decoder"):
            if getattr(self, name, None) is None:
                raise ModelFileError(name, f"expected the VAE's {name} (image to video encodes its image), got none")

    @property
    def takes_image_embeds(self) -> bool:
        """Whether the transformer takes the image encoder's states (Wan 2.1 I2V)."""
        return WAN_IMAGE_INPUT in self.transformer.input_names

    @property
    def takes_first_and_last_frames(self) -> bool:
        """Whether the transformer takes the image encoder's states of a first and a last frame side by side (Wan
        2.1 FLF2V: its config's ``pos_embed_seq_len``, diffusers' position embedding of the two images' tokens)."""
        return self.takes_image_embeds and self.transformer.config.get("pos_embed_seq_len") is not None

    # ------------------------------------------------------------------------------------------------- checks
    def check_images(
        self,
        image: Any,
        last_image: Any,
        image_embeds: Any,
        max_sequence_length: Any,
        num_frames: Any,
        prompt_embeds: Any = None,
        negative_prompt_embeds: Any = None,
    ) -> None:
        """What image to video adds to the Wan checks, refused before any work: an ``image`` (a PIL image or a torch
        tensor, as diffusers takes it; one), ``last_image`` likewise (with a video of more than one frame; with a
        Wan 2.1 transformer only where it is a first-last-frame one, which needs it), no ``image_embeds`` beside an
        image (diffusers refuses both) or with two experts, and 512-token prompts (or given embeddings) where the
        transformer takes the image's states."""
        if image_embeds is not None:
            if image is not None:
                raise ArgumentError("image and image_embeds", "expected one of them, got both (as diffusers refuses)")
            if self.config.boundary_ratio is not None:
                raise ArgumentError("image_embeds", "expected None for Wan 2.2's two experts, got a tensor")
        for name, value in (("image", image), ("last_image", last_image)):
            if value is None:
                if name == "image":
                    raise ArgumentError(
                        "image", "expected an image to start the video from (a PIL image or a torch tensor), got None"
                    )
                continue
            if not isinstance(value, (PIL.Image.Image, torch.Tensor)):
                raise ArgumentTypeError(name, f"expected a PIL image or a torch.Tensor, got {type(value).__name__}")
            self.check_image(value, name, resized=True, channels=(3,))
            if isinstance(value, torch.Tensor) and value.ndim == 4 and value.shape[0] != 1:
                raise ArgumentError(name, f"expected one image, got a batch of {value.shape[0]}")
        if last_image is not None and num_frames == 1:
            raise ArgumentError("num_frames", "expected more than 1 with last_image (a first and a last frame), got 1")
        if self.takes_image_embeds and not self.takes_first_and_last_frames and last_image is not None:
            raise ArgumentError(
                "last_image",
                "expected None for a Wan 2.1 I2V transformer (its config has no pos_embed_seq_len): a first-last-frame "
                "transformer (Wan 2.1 FLF2V) takes a last image, got an image",
            )
        if self.takes_first_and_last_frames and last_image is None:
            raise ArgumentError(
                "last_image",
                "expected an image for a first-last-frame transformer (Wan 2.1 FLF2V: its config's pos_embed_seq_len "
                "embeds a first and a last image), got None",
            )
        if self.takes_image_embeds and max_sequence_length != WAN_TEXT_CONTEXT:
            raise ArgumentError(
                "max_sequence_length",
                f"expected {WAN_TEXT_CONTEXT} for a transformer that takes the image encoder's states (diffusers' "
                f"Wan attention reads the last {WAN_TEXT_CONTEXT} tokens of its context as the prompt's), got "
                f"{max_sequence_length!r}",
            )
        for name, embeds in (("prompt_embeds", prompt_embeds), ("negative_prompt_embeds", negative_prompt_embeds)):
            if self.takes_image_embeds and getattr(embeds, "ndim", 0) == 3 and embeds.shape[1] != WAN_TEXT_CONTEXT:
                raise ArgumentError(
                    name,
                    f"expected sequence length {WAN_TEXT_CONTEXT} for a transformer that takes the image encoder's "
                    f"states (diffusers' Wan attention reads the last {WAN_TEXT_CONTEXT} tokens of its context as "
                    f"the prompt's), got shape {tuple(embeds.shape)}",
                )

    # --------------------------------------------------------------------------------------------------- call
    @on_device_stream
    def __call__(
        self,
        image: Any = None,
        prompt: Prompt = None,
        negative_prompt: Prompt = None,
        height: int = 480,
        width: int = 832,
        num_frames: int = 81,
        num_inference_steps: int = WAN_I2V.defaults.steps,
        guidance_scale: float = WAN_I2V.defaults.guidance_scale,
        guidance_scale_2: Optional[float] = None,
        num_videos_per_prompt: int = 1,
        generator: Generator = None,
        latents: Latents = None,
        prompt_embeds: Embeds = None,
        negative_prompt_embeds: Embeds = None,
        image_embeds: Embeds = None,
        last_image: Any = None,
        output_type: str = "np",
        return_dict: bool = True,
        attention_kwargs: Optional[Dict[str, Any]] = None,
        callback_on_step_end: StepEndCallback = None,
        callback_on_step_end_tensor_inputs: TensorNames = ("latents",),
        max_sequence_length: int = WAN_TEXT_CONTEXT,
    ):
        """Generates videos from an image and text, with the arguments of diffusers' ``WanImageToVideoPipeline``.

        ``image`` (a PIL image or a torch tensor) is resized to ``height`` × ``width`` and becomes the first frame;
        ``last_image`` the last one. ``num_frames`` must be of the form 4k + 1 and ``height`` and ``width`` multiples
        of 16 (refused otherwise before any work). ``image_embeds``: diffusers refuses them beside an image, which
        every call needs, so they are refused here too. The rest as the text-to-video pipeline's.

        Returns:
            ``WanPipelineOutput(frames)`` ("np": ``(videos, frames, height, width, 3)`` in [0, 1]), or ``(frames,)``
            without ``return_dict``.
        """
        # 1. check inputs, before any work
        self.check_images(
            image, last_image, image_embeds, max_sequence_length, num_frames, prompt_embeds, negative_prompt_embeds
        )
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

        # 2. the prompts' UMT5 states (the negative prompt's with guidance), and the image's CLIP states (Wan 2.1)
        tensors = self.text_tensors(
            prompt,
            negative_prompt,
            guidance,
            num_videos_per_prompt,
            prompt_embeds,
            negative_prompt_embeds,
            max_sequence_length,
        )
        inputs = {}
        if self.takes_image_embeds:
            embeds = self.image_states(image if last_image is None else [image, last_image])
            rows = embeds.repeat(videos, 1, 1)  # diffusers repeats them per prompt: the same where one video each
            inputs[WAN_IMAGE_INPUT] = torch.cat([rows] * guidance.copies)

        # 3. the schedule, and Wan 2.2's low-noise expert from the first step below its boundary
        timesteps, stages = self.schedule(num_inference_steps, guidance, guidance_scale, guidance_scale_2)

        # 4. initial noise, then the first frame's mask and latents (the VAE encodes the video of it once)
        shape = self.latent_video_shape(videos, num_frames, height, width)
        latents = self.prepare_latents(shape, torch.float32, generator, latents)
        condition = self.first_frame_condition(image, last_image, videos, num_frames, height, width)
        condition = condition.to(self.transformer.input_dtypes["hidden_states"])

        # 5. the denoising loop: the condition beside the latents at every step, every tensor on self.device
        latents = denoise(
            self.denoiser,
            latents,
            timesteps,
            tensors=tensors,
            guidance=guidance,
            inputs=inputs,
            extra_channels=torch.cat([condition] * guidance.copies),
            stages=stages,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
        )

        # 6. decode: only now does anything leave the device
        return self.finish_video(latents, output_type, return_dict)

    # ----------------------------------------------------------------------------------------------- the steps
    def image_states(self, images: Any) -> torch.Tensor:
        """The CLIP image encoder's penultimate states of ``images`` (diffusers' ``encode_image``), on the device in
        the transformer's dtype: one row per image."""
        pixels = self.image_processor(images=images, return_tensors="pt").pixel_values
        encoder = self.image_encoder
        outputs = encoder(**{WAN_IMAGE_PIXELS: pixels.to(self.device, encoder.input_dtypes[WAN_IMAGE_PIXELS])})
        states = dict(zip(encoder.output_names, outputs))[WAN_IMAGE_EMBEDS]
        return states.to(self.transformer.input_dtypes[WAN_IMAGE_INPUT])

    def first_frame_condition(
        self, image: Any, last_image: Any, videos: int, num_frames: int, height: int, width: int
    ) -> torch.Tensor:
        """The first frame's mask and normalized latents, ``(videos, 4 + latent channels, latent frames, height / 8,
        width / 8)``, as diffusers' ``prepare_latents`` makes them: the VAE encodes the video of ``image`` followed by
        black frames (and ending with ``last_image``); the mask is 1 on the frames given."""
        first = self.video_processor.preprocess(image, height=height, width=width).to(self.device, torch.float32)
        frames = [first.unsqueeze(2)]
        blank = num_frames - 1 if last_image is None else num_frames - 2
        frames.append(first.new_zeros(first.shape[0], first.shape[1], blank, height, width))
        if last_image is not None:
            last = self.video_processor.preprocess(last_image, height=height, width=width)
            frames.append(last.to(self.device, torch.float32).unsqueeze(2))
        encoded = self.codec.video.encode(torch.cat(frames, dim=2)).to(torch.float32)
        mean = upload(self.codec.latents_mean.view(1, -1, 1, 1, 1), encoded.device)
        inverse_std = 1.0 / upload(self.codec.latents_std.view(1, -1, 1, 1, 1), encoded.device)
        latent_condition = ((encoded - mean) * inverse_std).repeat(videos, 1, 1, 1, 1)
        return torch.cat(
            [self.first_frame_mask(videos, num_frames, last_image is not None, encoded), latent_condition], 1
        )

    def first_frame_mask(self, videos: int, num_frames: int, last: bool, like: torch.Tensor) -> torch.Tensor:
        """The mask of the frames given, one channel per video frame of a latent frame: the first latent frame's
        (the first video frame, repeated as the VAE's first chunk stands for it), the others' (the last, with a
        ``last`` image)."""
        temporal = self.vae_scale_factor_temporal
        _, _, latent_frames, latent_height, latent_width = like.shape
        mask = torch.zeros(videos, 1, num_frames + temporal - 1, latent_height, latent_width, device=like.device)
        mask[:, :, :temporal] = 1.0
        if last:
            mask[:, :, -1] = 1.0
        return mask.view(videos, latent_frames, temporal, latent_height, latent_width).transpose(1, 2)

    def warmup_images(self, height: int, width: int) -> Dict[str, Any]:
        """A warm-up call's image: a black one of this size (and a last one, for a first-last-frame transformer)."""
        images = {"image": torch.zeros(1, 3, height, width), "height": height, "width": width}
        if self.takes_first_and_last_frames:
            images["last_image"] = torch.zeros(1, 3, height, width)
        return images
