"""Wan 2.1/2.2's causal 3-D VAE on ONNX Runtime: video ↔ latents chunk by chunk, the causal cache handed from one
graph call to the next on the device.

The export writes two graphs per component (see :mod:`optimum_iobinding.layout`, Wan's section): ``model.onnx`` for
the first chunk and ``chunk.onnx`` for every later one. A decode runs the first graph on latent frame 0, then the chunk
graph on each later latent frame, each call's ``present_features.i`` outputs becoming the next call's
``past_features.i`` inputs as they are (torch tensors on the model's device: no host round trip). After the first
chunk every call of a decode (or encode) has the same input shapes, one signature that a CUDA graph can capture.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import torch

from ..errors import ArgumentError, ArgumentPathError, ArgumentTypeError, ModelFileError
from ..layout import (
    WAN_VAE_CHUNK_PART,
    WAN_VAE_DECODER_INPUT,
    WAN_VAE_DECODER_OUTPUT,
    WAN_VAE_ENCODER_INPUT,
    WAN_VAE_ENCODER_OUTPUT,
    wan_vae_cache_names,
)
from ..runtime.model import IOBindingORTModel
from ..runtime.shapes import infer_output_shapes

__all__ = ["WanVideoCodec", "WanCausalRunner"]


class WanCausalRunner:
    """One component of Wan's VAE (its decoder or its encoder) as two graphs run in turn: ``first`` (model.onnx) on
    the first chunk, ``chunk`` (chunk.onnx) on every later one, the cache passed between them.

    Args:
        first: the first chunk's model (inputs: ``input_name`` alone; outputs: ``output_name`` then the cache).
        chunk: the later chunks' model (inputs: ``input_name`` then the cache; outputs as ``first``'s); ``None``:
            ``first.part`` of the ``chunk.onnx`` beside ``first``'s file, reading ``first``'s weights.
        component: the component's folder name, for errors (``vae_decoder`` or ``vae_encoder``).
        input_name, output_name: the component's own input and output.
    """

    def __init__(
        self,
        first: IOBindingORTModel,
        chunk: Optional[IOBindingORTModel],
        component: str,
        input_name: str,
        output_name: str,
    ):
        if not isinstance(first, IOBindingORTModel):
            raise ArgumentTypeError(component, f"expected an IOBindingORTModel, got {type(first).__name__}")
        if chunk is None:
            if first.model_path is None:
                raise ArgumentError(
                    component,
                    f"expected a model loaded from a file (its {WAN_VAE_CHUNK_PART} is read beside it), got one "
                    "made from a session",
                )
            path = Path(first.model_path).parent / WAN_VAE_CHUNK_PART
            if not path.is_file():
                raise ArgumentPathError(
                    component,
                    f"expected Wan's chunk graph {str(path)!r} beside {first.model_path!r}, got no such file: "
                    "export the VAE with optimum_iobinding.export.wan_vae",
                )
            chunk = first.part(path)
        self.first = first
        self.chunk = chunk
        self.component = component
        self.input_name = input_name
        self.output_name = output_name
        count = sum(1 for name in chunk.input_names if name != input_name)
        self.past_names, self.present_names = wan_vae_cache_names(count)
        expected = {
            "model.onnx": (first, [input_name], [output_name, *self.present_names]),
            WAN_VAE_CHUNK_PART: (chunk, [input_name, *self.past_names], [output_name, *self.present_names]),
        }
        for file, (model, inputs, outputs) in expected.items():
            if list(model.input_names) != inputs or list(model.output_names) != outputs:
                raise ModelFileError(
                    f"{component}/{file}",
                    f"expected a Wan VAE chunk graph with inputs {_listed(inputs)} and outputs {_listed(outputs)}, "
                    f"got inputs {_listed(model.input_names)} and outputs {_listed(model.output_names)}",
                )
        self.first_frames = self._static_dim(first, input_name, 2)
        self.chunk_frames = self._static_dim(chunk, input_name, 2)
        self.channels = self._static_dim(first, input_name, 1)

    def _static_dim(self, model: IOBindingORTModel, name: str, axis: int) -> int:
        dims = model.input_dims.get(name)
        if not dims or len(dims) != 5 or not isinstance(dims[axis], int):
            raise ModelFileError(
                self.component,
                f"expected input {name!r} of 5 dims with a fixed dim {axis}, got dims {dims}",
            )
        return dims[axis]

    @property
    def device(self) -> torch.device:
        return self.first.device

    def prepare(self) -> None:
        """Makes both graphs' shape-free sessions now, side by side, where they are not made yet (nothing off CUDA):
        before the first chunk's graph is captured, so that on CUDA both can share the stream's arena with the
        pipeline's other graph sessions (:mod:`~optimum_iobinding.runtime.shared_arena`)."""
        threads = [thread for thread in (self.first.prepare(wait=False), self.chunk.prepare(wait=False)) if thread]
        for thread in threads:
            thread.join()

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the graphs take their input in (``torch.float32``, or ``torch.float16`` for a float16 export)."""
        return self.first.input_dtypes[self.input_name]

    def run(self, chunks: List[torch.Tensor]) -> torch.Tensor:
        """Runs ``chunks`` in order (the first through ``first``, the rest through ``chunk``), the cache handed from
        each call's outputs to the next call's inputs on the device, each call's output copied into its frames of one
        tensor allocated after the first call.

        Args:
            chunks: tensors on the device in the graphs' dtype, the first of :attr:`first_frames` frames, the
                others of :attr:`chunk_frames` (views of one video: each is made contiguous as its call binds it).

        Returns:
            The chunks' outputs, one after another along dim 2.
        """
        if len(chunks) > 1:
            self.prepare()  # both sessions before the first capture
        results = self.first(**{self.input_name: chunks[0]})
        head, cache = results[0], tuple(results[1:])
        step = 0
        if len(chunks) > 1:
            shapes = {self.input_name: tuple(chunks[1].shape)}
            shapes.update({name: tuple(tensor.shape) for name, tensor in zip(self.past_names, cache, strict=True)})
            step = infer_output_shapes(self.chunk, shapes)[self.output_name][2]
            # the chunk graph made now reads the cache where the first graph writes it: the device holds the cache
            # twice (those buffers and the chunk graph's outputs, copied into them by each later call), not three times
            self.chunk.adopt_graph_inputs(shapes, dict(zip(self.past_names, cache, strict=True)))
        frames = head.shape[2] + step * (len(chunks) - 1)
        output = torch.empty((*head.shape[:2], frames, *head.shape[3:]), dtype=head.dtype, device=head.device)
        # each output buffer is the model's, rewritten by its next call of the same shapes: copied out at once
        output[:, :, : head.shape[2]].copy_(head)
        start = head.shape[2]
        for chunk in chunks[1:]:
            results = self.chunk(**{self.input_name: chunk}, **dict(zip(self.past_names, cache, strict=True)))
            output[:, :, start : start + step].copy_(results[0])
            cache, start = tuple(results[1:]), start + step
        return output


# diffusers' AutoencoderKLWan tiling defaults: tiles of 256 pixels every 192
TILING_DEFAULTS = {
    "tile_sample_min_height": 256,
    "tile_sample_min_width": 256,
    "tile_sample_stride_height": 192,
    "tile_sample_stride_width": 192,
}


class WanVideoCodec:
    """Wan 2.1/2.2's VAE (diffusers' ``AutoencoderKLWan``) exported as chunk graphs: ``decode`` and ``encode`` as
    diffusers' ``vae.decode(...).sample`` and ``retrieve_latents(vae.encode(...), sample_mode="argmax")``, any number
    of frames and any size from one export, torch tensors on the models' device in and out.

    Args:
        vae_decoder: the decoder's first-chunk model (``vae_decoder/model.onnx``); its chunk graph is loaded beside
            it, sharing its weights, unless ``decoder_chunk`` gives it.
        vae_encoder: the encoder's first-chunk model (``vae_encoder/model.onnx``), or ``None`` (no encoding).
        decoder_chunk, encoder_chunk: the chunk graphs' models, where the caller loads them itself.
    """

    def __init__(
        self,
        vae_decoder: IOBindingORTModel,
        vae_encoder: Optional[IOBindingORTModel] = None,
        decoder_chunk: Optional[IOBindingORTModel] = None,
        encoder_chunk: Optional[IOBindingORTModel] = None,
    ):
        self.decoder = WanCausalRunner(
            vae_decoder, decoder_chunk, "vae_decoder", WAN_VAE_DECODER_INPUT, WAN_VAE_DECODER_OUTPUT
        )
        self.encoder = (
            WanCausalRunner(vae_encoder, encoder_chunk, "vae_encoder", WAN_VAE_ENCODER_INPUT, WAN_VAE_ENCODER_OUTPUT)
            if vae_encoder is not None
            else None
        )
        self.tiling: Optional[Dict[str, int]] = None  # enable_tiling's sizes while tiling is on
        config = vae_decoder.config
        try:
            self.spatial_scale_factor = 2 ** (len(config["dim_mult"]) - 1) * (config.get("patch_size") or 1)
        except (KeyError, TypeError) as error:
            raise ModelFileError(
                "vae_decoder config.json",
                f"expected AutoencoderKLWan's dim_mult (a list) and patch_size, got dim_mult="
                f"{config.get('dim_mult')!r}, patch_size={config.get('patch_size')!r}",
            ) from error

    @classmethod
    def from_pretrained(cls, folder: Union[str, os.PathLike], encoder: bool = True, **settings: Any) -> "WanVideoCodec":
        """Loads the codec from a pipeline folder's ``vae_decoder/`` and ``vae_encoder/`` (each ``model.onnx``,
        ``chunk.onnx``, ``model.onnx_data``, ``config.json``).

        Args:
            folder: the pipeline folder.
            encoder: load ``vae_encoder/`` too (where the folder has one).
            **settings: the models' settings, as :meth:`IOBindingORTModel.from_pretrained
                <optimum_iobinding.runtime.model.IOBindingORTModel.from_pretrained>` takes them (``provider``,
                ``io_binding``, ``cuda_graph``, ``options`` …).

        Returns:
            The codec; each chunk graph reads its first-chunk model's weights.
        """
        folder = Path(folder)
        decoder = IOBindingORTModel.from_pretrained(folder, subfolder="vae_decoder", **settings)
        vae_encoder = None
        if encoder and (folder / "vae_encoder" / "model.onnx").is_file():
            vae_encoder = IOBindingORTModel.from_pretrained(folder, subfolder="vae_encoder", **settings)
        return cls(decoder, vae_encoder)

    # ------------------------------------------------------------------------------------------------ properties
    @property
    def device(self) -> torch.device:
        return self.decoder.device

    @property
    def config(self) -> Dict[str, Any]:
        """The VAE's config (``vae_decoder/config.json``: ``z_dim``, ``latents_mean``, ``latents_std`` …)."""
        return self.decoder.first.config

    @property
    def latent_channels(self) -> int:
        return self.decoder.channels

    @property
    def temporal_scale_factor(self) -> int:
        """Video frames per latent frame after the first: 2 per temporal downsampling (Wan's 4)."""
        return 2 ** sum(bool(flag) for flag in self.config.get("temperal_downsample") or ())

    # ---------------------------------------------------------------------------------------------------- tiling
    def enable_tiling(
        self,
        tile_sample_min_height: Optional[int] = None,
        tile_sample_min_width: Optional[int] = None,
        tile_sample_stride_height: Optional[int] = None,
        tile_sample_stride_width: Optional[int] = None,
    ) -> None:
        """Decodes videos larger than a tile tile by tile, as diffusers' ``AutoencoderKLWan.enable_tiling``: every
        tile through all its frames (the causal cache its own), blended with its neighbours over the overlap. The
        chunk graphs then hold a tile's activations instead of the whole frame's. Defaults: diffusers' (tiles of 256
        pixels every 192).

        Args:
            tile_sample_min_height, tile_sample_min_width: a tile's size in pixels.
            tile_sample_stride_height, tile_sample_stride_width: pixels from one tile to the next (at most the tile's
                size; the rest overlaps).

        Raises:
            ArgumentError: a value that is not a positive multiple of :attr:`spatial_scale_factor`, or a stride
                larger than its tile.
        """
        given = {
            "tile_sample_min_height": tile_sample_min_height,
            "tile_sample_min_width": tile_sample_min_width,
            "tile_sample_stride_height": tile_sample_stride_height,
            "tile_sample_stride_width": tile_sample_stride_width,
        }
        values = {name: TILING_DEFAULTS[name] if value is None else value for name, value in given.items()}
        factor = self.spatial_scale_factor
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value % factor:
                raise ArgumentError(
                    name, f"expected a positive multiple of {factor} (the VAE's pixels per latent pixel), got {value!r}"
                )
        for axis in ("height", "width"):
            if values[f"tile_sample_stride_{axis}"] > values[f"tile_sample_min_{axis}"]:
                raise ArgumentError(
                    f"tile_sample_stride_{axis}",
                    f"expected at most tile_sample_min_{axis} ({values[f'tile_sample_min_{axis}']}: tiles that "
                    f"touch or overlap), got {values[f'tile_sample_stride_{axis}']}",
                )
        self.tiling = values

    def disable_tiling(self) -> None:
        """Decodes whole frames again (the default)."""
        self.tiling = None

    # ---------------------------------------------------------------------------------------------------- decode
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """The video of ``latents``, as diffusers' ``vae.decode(latents).sample`` (tile by tile where
        :meth:`enable_tiling` is on and the latents are larger than a tile, as diffusers' ``tiled_decode``).

        Args:
            latents: ``[batch, z_dim, latent frames, latent height, latent width]``, de-normalised as diffusers'
                Wan pipelines pass them to ``vae.decode`` (``latents / (1 / latents_std) + latents_mean``).

        Returns:
            ``[batch, 3, 1 + 4 · (latent frames - 1), height, width]`` in [-1, 1], on the device.
        """
        runner = self.decoder
        _check_video("latents", latents, runner.channels, "latent frames", "latent height", "latent width")
        latents = latents.detach().to(device=runner.device, dtype=runner.dtype)
        tiling, factor = self.tiling, self.spatial_scale_factor
        if tiling is not None and (
            latents.shape[3] > tiling["tile_sample_min_height"] // factor
            or latents.shape[4] > tiling["tile_sample_min_width"] // factor
        ):
            return self._tiled_decode(latents, tiling).clamp_(-1.0, 1.0)
        return self._decode_frames(latents).clamp_(-1.0, 1.0)

    def _decode_frames(self, latents: torch.Tensor) -> torch.Tensor:
        """Every latent frame of ``latents`` through the chunk graphs, the cache handed on (before the clamp)."""
        return self.decoder.run([latents[:, :, index : index + 1] for index in range(latents.shape[2])])

    def _tiled_decode(self, latents: torch.Tensor, tiling: Dict[str, int]) -> torch.Tensor:
        """diffusers' ``AutoencoderKLWan.tiled_decode`` on the chunk graphs: overlapping tiles, each decoded through
        every frame, blended in place (each tile with the blended one above it, then the one on its left), in the
        patched space of a VAE with ``patch_size`` (Wan 2.2's), then cropped and joined."""
        from diffusers.models.autoencoders.autoencoder_kl_wan import patchify, unpatchify

        factor, patch = self.spatial_scale_factor, self.config.get("patch_size")
        height, width = latents.shape[3], latents.shape[4]
        latent_tile = (tiling["tile_sample_min_height"] // factor, tiling["tile_sample_min_width"] // factor)
        latent_stride = (tiling["tile_sample_stride_height"] // factor, tiling["tile_sample_stride_width"] // factor)
        per = patch or 1  # pixels of the decoder's own output per video pixel, each way
        sample_size = (height * factor // per, width * factor // per)
        stride = (tiling["tile_sample_stride_height"] // per, tiling["tile_sample_stride_width"] // per)
        blend = (
            tiling["tile_sample_min_height"] // per - stride[0],
            tiling["tile_sample_min_width"] // per - stride[1],
        )
        rows = []
        for i in range(0, height, latent_stride[0]):
            row = []
            for j in range(0, width, latent_stride[1]):
                tile = self._decode_frames(latents[:, :, :, i : i + latent_tile[0], j : j + latent_tile[1]])
                row.append(patchify(tile, patch_size=patch) if patch else tile)
            rows.append(row)
        result_rows = []
        for i, row in enumerate(rows):
            result_row = []
            for j, tile in enumerate(row):
                if i > 0:
                    _blend(rows[i - 1][j], tile, blend[0], axis=3)
                if j > 0:
                    _blend(row[j - 1], tile, blend[1], axis=4)
                result_row.append(tile[:, :, :, : stride[0], : stride[1]])
            result_rows.append(torch.cat(result_row, dim=-1))
        video = torch.cat(result_rows, dim=3)[:, :, :, : sample_size[0], : sample_size[1]]
        return unpatchify(video, patch_size=patch) if patch else video

    # ---------------------------------------------------------------------------------------------------- encode
    def encode(self, video: torch.Tensor) -> torch.Tensor:
        """The latents of ``video``: the latent distribution's mode, as diffusers'
        ``retrieve_latents(vae.encode(video), sample_mode="argmax")`` (not normalised).

        Args:
            video: ``[batch, 3, 1 + 4k frames, height, width]`` in [-1, 1], height and width multiples of
                :attr:`spatial_scale_factor`.

        Returns:
            ``[batch, z_dim, 1 + k, height / factor, width / factor]`` on the device.
        """
        runner = self.encoder
        if runner is None:
            raise ArgumentError("vae_encoder", "encoding needs one, and this codec was made without vae_encoder")
        _check_video("video", video, runner.channels, "frames", "height", "width")
        frames, height, width = video.shape[2:]
        step, factor = runner.chunk_frames, self.spatial_scale_factor
        if (frames - runner.first_frames) % step:
            raise ArgumentError(
                "video",
                f"expected {runner.first_frames} + {step}·k frames (dim 2) as Wan's VAE encodes them, got {frames}; "
                f"hint: {frames - (frames - runner.first_frames) % step} frames",
            )
        if height % factor or width % factor:
            raise ArgumentError(
                "video",
                f"expected a height and width (dims 3 and 4) that are multiples of {factor}, got {height}×{width}",
            )
        video = video.detach().to(device=runner.device, dtype=runner.dtype)
        first = runner.first_frames
        chunks = [video[:, :, :first]] + [video[:, :, start : start + step] for start in range(first, frames, step)]
        return runner.run(chunks)


def _blend(a: torch.Tensor, b: torch.Tensor, extent: int, axis: int) -> None:
    """diffusers' ``blend_v`` (``axis`` 3) and ``blend_h`` (4), in place on ``b``: its first ``extent`` rows (or
    columns) become ``a``'s last ones weighted 1 − k / extent plus its own weighted k / extent."""
    extent = min(a.shape[axis], b.shape[axis], extent)
    for k in range(extent):
        b.select(axis, k).copy_(
            a.select(axis, a.shape[axis] - extent + k) * (1 - k / extent) + b.select(axis, k) * (k / extent)
        )


def _check_video(argument: str, value: Any, channels: int, *axes: str) -> None:
    """Refuses, naming ``argument``, anything but a floating-point tensor ``[batch, channels, *axes]`` with no empty
    dim."""
    layout = f"[batch, {channels} channels, {', '.join(axes)}]"
    if not isinstance(value, torch.Tensor):
        raise ArgumentTypeError(argument, f"expected a torch.Tensor {layout}, got {type(value).__name__}")
    if value.dim() != 5:
        raise ArgumentError(argument, f"expected a 5-D tensor {layout}, got shape {list(value.shape)}")
    if value.shape[1] != channels:
        raise ArgumentError(
            argument,
            f"expected {channels} channels (dim 1) of {layout}, got {value.shape[1]} (shape {list(value.shape)})",
        )
    if 0 in value.shape:
        raise ArgumentError(argument, f"expected no empty dim in {layout}, got shape {list(value.shape)}")
    if not value.is_floating_point():
        raise ArgumentTypeError(argument, f"expected a floating-point tensor, got {value.dtype}")


def _listed(names: Any) -> str:
    names = list(names)
    return str(names) if len(names) <= 4 else f"{names[:3]} … ({len(names)} in all)"
