"""The VAE as a latent codec: what a pipeline reads from its VAE once (the scale factor between pixels and latents,
the latent scaling and shift), decoding and encoding one image per call, Flux's 2×2 packing of latents into tokens,
and tiling (with each tile's host transfer overlapping the next tile's compute on CUDA)."""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import torch
from diffusers.utils.torch_utils import randn_tensor

from .part import PipelinePart
from ..errors import ArgumentError, ModelFileError
from ..runtime.model import IOBindingORTModel
from ..runtime.shapes import infer_output_shapes
from .arguments import Generator, is_real, is_torch_generator
from .components import declared_dim
from .tiling import TiledVAE


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


class LatentCodec(PipelinePart):
    """A pipeline's VAE (``vae_decoder``, optional ``vae_encoder``) between pixels in [-1, 1] and the latents the
    denoiser works on: ``latents = (vae_latents - shift) · scaling``.

    Args:
        pipe: the pipeline (its ``vae_decoder``, ``vae_encoder`` and ``device`` are read).
        scaling_factor, shift_factor: the family's constants, for a decoder whose config.json names none
            (``shift_factor=None``: the family has no shift).
        constants_hint: the family's constants, quoted by the error on a bad value in config.json.
    """

    def __init__(self, pipe: Any, scaling_factor: float, shift_factor: Optional[float], constants_hint: str):
        super().__init__(pipe)
        self.constants_hint = constants_hint
        self.tiler: Optional[TiledVAE] = None
        self.scale_factor = self._read_scale_factor()
        self.scaling_factor = self._config_float("scaling_factor", scaling_factor, positive=True)
        self.shift_factor = (
            None if shift_factor is None else self._config_float("shift_factor", shift_factor, positive=False)
        )

    @property
    def decoder(self) -> IOBindingORTModel:
        return self.pipe.vae_decoder

    @property
    def encoder(self) -> Optional[IOBindingORTModel]:
        return self.pipe.vae_encoder

    # -------------------------------------------------------------------------------------- what it reads once
    def _config_float(self, key: str, default: float, positive: bool) -> float:
        """A latent constant of the decoder's config.json: ``default`` where the key is absent or null, refused by
        name where it is not a finite number (or, with ``positive``, not above zero)."""
        value = self.decoder.config.get(key)
        value = default if value is None else value
        if not is_real(value) or not math.isfinite(value) or (positive and value <= 0):
            raise ModelFileError(
                "vae_decoder config.json",
                f"{key}: expected a {'positive ' if positive else ''}finite number, got {value!r} "
                f"({self.constants_hint})",
            )
        return float(value)

    def _read_scale_factor(self) -> int:
        decoder = self.decoder
        channels = declared_dim(decoder, "latent_sample", 1) or 4
        blocks = decoder.config.get("block_out_channels")
        if blocks is not None:
            if not isinstance(blocks, list) or not blocks or len(blocks) > 8:
                raise ModelFileError(
                    "vae_decoder config.json",
                    f"block_out_channels: expected a list of 1 to 8 channel counts, got {blocks!r}",
                )
            factor = 2 ** (len(blocks) - 1)
            try:
                shapes = infer_output_shapes(decoder, {"latent_sample": (1, channels, 8, 8)})
            except ValueError:
                shapes = {}
            image_shape = next(iter(shapes.values()), None)
            if image_shape is not None and image_shape[2] != 8 * factor:
                raise ModelFileError(
                    "vae_decoder config.json",
                    f"block_out_channels: {len(blocks)} blocks mean a scale factor of {factor}, but the decoder "
                    f"turns 8 latent rows into {image_shape[2]} (a factor of {image_shape[2] // 8})",
                )
            return factor
        # No config: ask the decoder how much larger its output is than its input.
        shapes = infer_output_shapes(decoder, {"latent_sample": (1, channels, 8, 8)})
        image_shape = next(iter(shapes.values()))
        if image_shape is None:
            raise ArgumentError(
                "vae_decoder", "cannot tell its upsampling factor: no config.json and its output shape is not inferable"
            )
        return image_shape[2] // 8

    def image_channels(self) -> tuple:
        """The channels an image may have: the VAE encoder's (3 for RGB; unknown: any)."""
        channels = declared_dim(self.encoder, "sample", 1) if self.encoder is not None else None
        return (channels,) if channels else ()

    # ---------------------------------------------------------------------------------------------- tiling
    def enable_tiling(self, tile_sample_size: int, overlap: float, overlap_copies: bool) -> None:
        self.tiler = TiledVAE(self.decoder, self.encoder, tile_sample_size, self.scale_factor, overlap, overlap_copies)

    def disable_tiling(self) -> None:
        self.tiler = None

    def tiles(self, latents: torch.Tensor) -> bool:
        """Whether ``latents`` (unpacked) are decoded tile by tile."""
        return self.tiler is not None and max(latents.shape[-2:]) > self.tiler.tile_latent_size

    # ---------------------------------------------------------------------------------------------- decoding
    def vae_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """The denoiser's latents as the decoder takes them: unscaled and unshifted."""
        latents = latents / self.scaling_factor
        return latents if self.shift_factor is None else latents + self.shift_factor

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images in [-1, 1], NCHW, on the device. One image per VAE call, as diffusers' ONNX pipeline does (fp16 VAE
        exports misbehave at batch > 1); tile by tile where tiling is on and the image is larger than a tile."""
        latents = self.vae_latents(latents)
        if self.tiles(latents):
            return torch.cat([self.tiler.decode(latents[i : i + 1]) for i in range(latents.shape[0])])
        latents = latents.to(self.decoder.input_dtypes["latent_sample"])
        # each call reuses the decoder's output buffer: each image is copied out, into its row of one tensor, before
        # the next call (one copy of the batch, not a copy per image and their concatenation)
        images: Optional[torch.Tensor] = None
        for i in range(latents.shape[0]):
            image = self.decoder(latent_sample=latents[i : i + 1])[0]
            if images is None:
                images = torch.empty((latents.shape[0], *image.shape[1:]), dtype=image.dtype, device=image.device)
            images[i : i + 1].copy_(image)
        return images

    def prepare_decode(self, latents: torch.Tensor) -> None:
        """Starts the decoder's first run for one image of these (unpacked) latents in a background thread, where the
        decoder captures graphs (:meth:`IOBindingORTModel.prepare_signature`): its cuDNN plans are built while the
        denoising loop runs, not after it. Nothing where they will be decoded tile by tile."""
        if latents.dim() == 4 and not self.tiles(latents) and "latent_sample" in self.decoder.input_names:
            self.decoder.prepare_signature({"latent_sample": (1, *latents.shape[1:])})

    def decode_to_host(self, latents: torch.Tensor) -> np.ndarray:
        """Tiled decoding to numpy images in [0, 1], NHWC, each tile downloaded while the next one decodes."""
        latents = self.vae_latents(latents)
        return np.concatenate([self.tiler.decode_to_host(latents[i : i + 1]) for i in range(latents.shape[0])])

    # ---------------------------------------------------------------------------------------------- encoding
    def encode(self, image: torch.Tensor, generator: Generator) -> torch.Tensor:
        """Scaled latents of ``image`` (NCHW in [-1, 1]). An optimum export returns the latent distribution's
        parameters: sampled here with ``generator`` (its mean for a numpy generator)."""
        encoder, device = self.encoder, self.pipe.device
        if encoder is None:
            raise ArgumentError("vae_encoder", "this pipeline needs one, and the folder has no vae_encoder/model.onnx")
        tiler = self.tiler
        if tiler is not None and max(image.shape[-2:]) > tiler.tile_sample_size:
            latents = torch.cat([tiler.encode(image[i : i + 1]) for i in range(image.shape[0])])
        else:
            image = image.to(device=device, dtype=encoder.input_dtypes["sample"])
            latents = torch.cat([encoder(sample=image[i : i + 1])[0].clone() for i in range(image.shape[0])])
        if encoder.output_names[0] == "latent_parameters":
            mean, logvar = latents.chunk(2, dim=1)
            if is_torch_generator(generator):
                std = torch.exp(0.5 * logvar.clamp(-30.0, 20.0))
                latents = mean + std * randn_tensor(mean.shape, generator=generator, device=device, dtype=mean.dtype)
            else:
                latents = mean
        if self.shift_factor is not None:
            latents = latents - self.shift_factor
        return latents * self.scaling_factor
