"""Decoding and output (:class:`Output`, a part of :class:`~.core.OnnxDiffusionPipeline`): the VAE through the latent
codec (tiled where enabled), the one download of a call through pinned memory (of images, or of a video family's
frames), and the family's diffusers output (its ``output_field``: ``images``; a video family's ``frames``)."""

from __future__ import annotations

import inspect
from typing import Any, ClassVar, Optional, Tuple

import torch
from diffusers.pipelines.stable_diffusion import StableDiffusionPipelineOutput

from ..errors import ModelFileError
from ..runtime.cuda_policy import DEVICE_SETUP
from .arguments import Generator, is_integer
from .codec import LatentCodec, unpack_latents
from .tiling import TiledVAE


class Output:
    """The VAE's decode, the download and the family's output."""

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

    def prepare_decode(self, latents: torch.Tensor) -> None:
        """At the denoising loop's start, where the call decodes (its ``output_type`` is not "latent") latents that are
        not packed: the VAE decoder's first run for one image of them starts beside the loop
        (:meth:`LatentCodec.prepare_decode`)."""
        decodes_here = self.call_decodes and not self.packed_latents and isinstance(self.codec, LatentCodec)
        if decodes_here and self.prepare_in_background:
            self.codec.prepare_decode(latents)

    def encode_image(self, image: torch.Tensor, generator: Generator) -> torch.Tensor:
        """Scaled latents of ``image`` (NCHW in [-1, 1] on the device; see :meth:`LatentCodec.encode`)."""
        return self.codec.encode(image, generator)

    def postprocess(self, image: torch.Tensor, output_type: str) -> Any:
        """ "pt" stays on the device; "np" and "pil" come back through a pinned buffer, the one wait of the call."""
        if output_type == "pt" or image.device.type != "cuda":
            return self.image_processor.postprocess(image.float(), output_type=output_type)
        # one float32 copy, scaled in place: the call's peak holds one image of float32 more, not two
        image = image.to(torch.float32, copy=True).div_(2).add_(0.5).clamp_(0, 1)
        # pinning may allocate and the wait synchronizes: neither may run beside a graph capture in another thread
        with DEVICE_SETUP.setup():
            host = torch.empty(image.shape, dtype=image.dtype, pin_memory=True)
            host.copy_(image, non_blocking=True)
            torch.cuda.current_stream(image.device).synchronize()
        return self.image_processor.postprocess(host, output_type=output_type, do_denormalize=[False] * len(host))

    def postprocess_frames(self, video: torch.Tensor, output_type: str) -> Any:
        """Videos ``(batch, channels, frames, height, width)`` in [-1, 1] as diffusers' ``VideoProcessor`` gives them
        (a video family's ``video_processor``): "np" ``(batch, frames, height, width, channels)``, "pil" a list of
        frames per video, "pt" ``(batch, frames, channels, height, width)``, which stays on the device; "np" and "pil"
        come back through a pinned buffer, the one wait of the call."""
        if output_type == "pt" or video.device.type != "cuda":
            return self.video_processor.postprocess_video(video.float(), output_type=output_type)
        video = video.to(torch.float32, copy=True).div_(2).add_(0.5).clamp_(0, 1)  # one float32 copy, in place
        with DEVICE_SETUP.setup():  # as postprocess: no allocation or wait beside a capture in another thread
            host = torch.empty(video.shape, dtype=video.dtype, pin_memory=True)
            host.copy_(video, non_blocking=True)
            torch.cuda.current_stream(video.device).synchronize()
        return self.video_processor.postprocess_video(
            host, output_type=output_type, do_denormalize=[False] * host.shape[2]
        )

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
    #: the output's field holding what a call made (``images``; a video family's ``frames``)
    output_field: ClassVar[str] = "images"

    def pack_output(self, result: Any, return_dict: bool) -> Any:
        """diffusers' output for this family: ``result`` in its :attr:`output_field`, the other fields ``None`` (no
        safety checker runs: ``nsfw_content_detected`` is ``None``)."""
        fields = [name for name in inspect.signature(self.output_class).parameters if name != self.output_field]
        if not return_dict:
            return (result, *([None] * len(fields)))
        return self.output_class(**{self.output_field: result}, **{name: None for name in fields})
