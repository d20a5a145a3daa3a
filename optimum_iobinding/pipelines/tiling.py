"""Tiled VAE decoding and encoding for images larger than the VAE is comfortable with (2048² and up), on the same
tiling as diffusers' ``AutoencoderKL`` (tiles overlapping by a quarter, linear blending of each tile's top and left
edges into its neighbours, raster order), with the PCIe transfer of one tile overlapped with the compute of another:

* decoding to the host: tile k is decoded, blended and converted on the model's (compute) stream while the finished
  tile k-1 travels to a pinned staging buffer on a copy stream, and the host files tile k-2 into the output array;
* encoding from the host: tile k+1 is uploaded from pinned memory on the copy stream while tile k is encoded.

Events order the two streams; the host waits only for copies it is about to read. Off CUDA the same tiles and blends
run one after another.

On CUDA each tile shape (the full tile, the right and bottom edge tiles, the corner) runs in a session of its own:
ORT's CUDA convolutions choose their algorithms again whenever a session's input shape changes
(benchmarks/vae_shapes.py shows what that costs). A model with a graph pool (the default on CUDA) already runs each input signature apart (a graph
of its own, or a fixed-shape session), all reading its weights; for a model without one, each tile shape gets a :meth:`IOBindingORTModel.sibling`
(``max_tile_sessions`` bounds them).

``overlap_copies=False`` runs the sequential CUDA version (each tile's copy waited for before the next tile starts)
— the comparison the benchmark makes (benchmarks/tiled_vae.py).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from ..errors import ArgumentError
from ..runtime.cuda_policy import DEVICE_SETUP
from ..runtime.model import IOBindingORTModel
from .arguments import is_integer, is_real

__all__ = ["TiledVAE"]


def _starts(size: int, stride: int) -> List[int]:
    return list(range(0, size, stride))


def _blend_v(above: torch.Tensor, tile: torch.Tensor, extent: int) -> None:
    """Blends ``above``'s last ``extent`` rows into ``tile``'s first rows, in place (weights linear in the row)."""
    extent = min(above.shape[2], tile.shape[2], extent)
    if extent <= 0:
        return
    weight = torch.arange(extent, device=tile.device, dtype=torch.float32).div_(extent).to(tile.dtype)[:, None]
    tile[:, :, :extent, :] = above[:, :, above.shape[2] - extent :, :] * (1 - weight) + tile[:, :, :extent, :] * weight


def _blend_h(left: torch.Tensor, tile: torch.Tensor, extent: int) -> None:
    """Blends ``left``'s last ``extent`` columns into ``tile``'s first columns, in place."""
    extent = min(left.shape[3], tile.shape[3], extent)
    if extent <= 0:
        return
    weight = torch.arange(extent, device=tile.device, dtype=torch.float32).div_(extent).to(tile.dtype)
    tile[:, :, :, :extent] = left[:, :, :, left.shape[3] - extent :] * (1 - weight) + tile[:, :, :, :extent] * weight


class TiledVAE:
    """Decodes latents and encodes images tile by tile with an ONNX VAE decoder / encoder.

    Args:
        vae_decoder: the decoder (latents → image in [-1, 1]).
        vae_encoder: the encoder (image → latents or latent parameters), or ``None``.
        tile_sample_size: tile size in pixels (diffusers: the VAE's ``sample_size``, 512 for SD1.5).
        scale_factor: pixels per latent (8 for every Stable Diffusion VAE).
        overlap: fraction of a tile shared with each neighbour, in [0, 0.5] (diffusers: 0.25).
        overlap_copies: on CUDA, overlap each tile's host transfer with the next tile's compute.
        session_per_shape: run each tile shape in a sibling of its own (default: on CUDA for a model without a
            graph pool, where a shape change costs an algorithm search; the first shape runs in the given model,
            the others in its siblings).
        max_tile_sessions: how many tile shapes per model keep their session (least recently used go first); four
            cover every tile of one image size.
    """

    def __init__(
        self,
        vae_decoder: Optional[IOBindingORTModel],
        vae_encoder: Optional[IOBindingORTModel] = None,
        tile_sample_size: int = 512,
        scale_factor: int = 8,
        overlap: float = 0.25,
        overlap_copies: bool = True,
        session_per_shape: Optional[bool] = None,
        max_tile_sessions: int = 4,
    ):
        if not is_integer(scale_factor) or scale_factor < 1:
            raise ArgumentError(
                "scale_factor",
                f"expected a positive integer (pixels per latent, 8 for Stable Diffusion), got {scale_factor!r}",
            )
        if not is_integer(tile_sample_size) or tile_sample_size <= 0 or tile_sample_size % scale_factor != 0:
            raise ArgumentError(
                "tile_sample_size",
                f"expected a positive multiple of {scale_factor} (the VAE's scale factor), got {tile_sample_size!r}",
            )
        if not is_real(overlap) or not 0.0 <= overlap <= 0.5:
            # past a half, a tile's blended edge reaches beyond its neighbour's: tiles would blend with tiles that
            # are not their neighbours, and the tile count grows without bound as the overlap nears 1
            raise ArgumentError("overlap", f"expected a fraction in [0, 0.5] (diffusers uses 0.25), got {overlap!r}")
        if not is_integer(max_tile_sessions) or max_tile_sessions < 1:
            raise ArgumentError("max_tile_sessions", f"expected an integer ≥ 1, got {max_tile_sessions!r}")
        self.vae_decoder = vae_decoder
        self.vae_encoder = vae_encoder
        self.tile_sample_size = int(tile_sample_size)
        self.tile_latent_size = self.tile_sample_size // int(scale_factor)
        self.scale_factor = int(scale_factor)
        self.overlap = float(overlap)
        self.overlap_copies = overlap_copies
        self.session_per_shape = session_per_shape
        self.max_tile_sessions = max_tile_sessions
        # per role ("decoder"/"encoder"): the model the sessions were made for, and tile shape → the model that runs
        # it, least recently used first (a different model given later starts afresh)
        self._shape_models: Dict[str, Tuple[IOBindingORTModel, "OrderedDict[Tuple[int, ...], IOBindingORTModel]"]] = {}
        self._copy_streams: Dict[torch.device, "torch.cuda.Stream"] = {}
        self._staging: Dict[Tuple[int, Tuple[int, ...], torch.dtype], torch.Tensor] = {}

    # ------------------------------------------------------------------------------------------------ geometry
    def tile_models(self, role: str) -> Dict[Tuple[int, ...], IOBindingORTModel]:
        """The model each tile shape ran in so far, by input shape, for ``role`` ``"decoder"`` or ``"encoder"``
        (empty where tiles share the model's own session: ``session_per_shape`` off)."""
        entry = self._shape_models.get(role)
        return dict(entry[1]) if entry is not None else {}

    def _geometry(self, tile_in: int, tile_out: int) -> Tuple[int, int, int]:
        stride = int(tile_in * (1 - self.overlap))
        blend = int(tile_out * self.overlap)
        return stride, blend, tile_out - blend

    def _tiles(
        self, source: torch.Tensor, tile_in: int, tile_out: int, run: Callable[[torch.Tensor], torch.Tensor]
    ) -> Iterator[Tuple[int, int, torch.Tensor]]:
        """Yields ``(row offset, column offset, cropped tile)`` in raster order, each blended with its upper and
        left neighbours (themselves already blended), as diffusers does."""
        stride, blend, limit = self._geometry(tile_in, tile_out)
        rows, cols = _starts(source.shape[2], stride), _starts(source.shape[3], stride)
        previous_row: List[torch.Tensor] = []
        top = 0
        for i in rows:
            row: List[torch.Tensor] = []
            left_offset = 0
            for j, start in enumerate(cols):
                tile = run(source[:, :, i : i + tile_in, start : start + tile_in])
                if previous_row:
                    _blend_v(previous_row[j], tile, blend)
                if row:
                    _blend_h(row[-1], tile, blend)
                row.append(tile)
                cropped = tile[:, :, :limit, :limit]
                yield top, left_offset, cropped
                left_offset += cropped.shape[3]
            top += row[0][:, :, :limit, :limit].shape[2]
            previous_row = row

    def _assembled_size(self, shape: Tuple[int, ...], tile_in: int, tile_out: int) -> Tuple[int, int]:
        """Height and width of the blended result: the tiles' crops, summed down a column and along a row."""
        stride, _, limit = self._geometry(tile_in, tile_out)

        def along(size: int) -> int:
            return sum(min(limit, min(tile_in, size - start) * tile_out // tile_in) for start in _starts(size, stride))

        return along(shape[2]), along(shape[3])

    def _model_for(self, role: str, model: IOBindingORTModel, shape: Tuple[int, ...]) -> IOBindingORTModel:
        """The model that runs tiles of ``shape``: ``model`` itself, or with ``session_per_shape`` the sibling that
        has only ever seen this shape (the first shape seen runs in ``model``)."""
        per_shape = self.session_per_shape
        if per_shape is None:  # a model with a graph pool already runs each shape apart (graph or fixed session)
            per_shape = model.device.type == "cuda" and not model.keeps_session_per_signature
        if not per_shape:
            return model
        if role not in self._shape_models or self._shape_models[role][0] is not model:
            self._shape_models[role] = (model, OrderedDict())
        models = self._shape_models[role][1]
        if shape not in models:
            if model in models.values():
                models[shape] = model.sibling()
            else:
                models[shape] = model
            while len(models) > self.max_tile_sessions:
                models.popitem(last=False)
        models.move_to_end(shape)
        return models[shape]

    def _decode_tile(self, latents: torch.Tensor) -> torch.Tensor:
        # a copy: the next call reuses the decoder's output buffer, and neighbours blend from this tile later
        latents = latents.contiguous()
        return self._model_for("decoder", self.vae_decoder, tuple(latents.shape))(latent_sample=latents)[0].clone()

    def _encode_tile(self, pixels: torch.Tensor) -> torch.Tensor:
        pixels = pixels.contiguous()
        return self._model_for("encoder", self.vae_encoder, tuple(pixels.shape))(sample=pixels)[0].clone()

    # -------------------------------------------------------------------------------------------------- decode
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Image in [-1, 1], NCHW, on the decoder's device (already-unscaled latents, as ``vae.decode`` takes)."""
        if self.vae_decoder is None:
            raise ArgumentError("vae_decoder", "decoding needs one, got None")
        tile_out = self.tile_sample_size
        height, width = self._assembled_size(latents.shape, self.tile_latent_size, tile_out)
        image = None
        for top, left, tile in self._tiles(latents, self.tile_latent_size, tile_out, self._decode_tile):
            if image is None:
                image = tile.new_empty((tile.shape[0], tile.shape[1], height, width))
            image[:, :, top : top + tile.shape[2], left : left + tile.shape[3]] = tile
        return image

    def decode_to_host(self, latents: torch.Tensor) -> np.ndarray:
        """Image in [0, 1] as a float32 NHWC numpy array (what ``output_type="np"`` returns), each tile downloaded
        as soon as it is final; on CUDA the download overlaps the next tile's decoding (``overlap_copies``)."""
        if self.vae_decoder is None:
            raise ArgumentError("vae_decoder", "decoding needs one, got None")
        tile_out = self.tile_sample_size
        height, width = self._assembled_size(latents.shape, self.tile_latent_size, tile_out)
        result: Optional[np.ndarray] = None
        on_cuda = latents.device.type == "cuda"
        pending = None  # (copy done event, pinned staging, top, left)
        compute = torch.cuda.current_stream(latents.device) if on_cuda else None
        copies = self._copy_stream(latents.device) if on_cuda else None
        for index, (top, left, tile) in enumerate(
            self._tiles(latents, self.tile_latent_size, tile_out, self._decode_tile)
        ):
            finished = (tile.float() / 2 + 0.5).clamp_(0, 1).permute(0, 2, 3, 1).contiguous()
            if result is None:
                result = np.empty((finished.shape[0], height, width, finished.shape[3]), np.float32)
            if not on_cuda:
                result[:, top : top + finished.shape[1], left : left + finished.shape[2]] = finished.numpy()
                continue
            staging = self._staging_buffer(index % 2, tuple(finished.shape), finished.dtype)
            ready = torch.cuda.Event()
            ready.record(compute)
            copies.wait_event(ready)
            with torch.cuda.stream(copies):
                staging.copy_(finished, non_blocking=True)
                done = torch.cuda.Event()
                done.record(copies)
            finished.record_stream(copies)  # the allocator must not reuse it before the copy has read it
            if not self.overlap_copies:
                done.synchronize()
            if pending is not None:
                self._file(result, *pending)
            pending = (done, staging, top, left)
        if pending is not None:
            self._file(result, *pending)
        return result

    @staticmethod
    def _file(result: np.ndarray, done: "torch.cuda.Event", staging: torch.Tensor, top: int, left: int) -> None:
        done.synchronize()
        result[:, top : top + staging.shape[1], left : left + staging.shape[2]] = staging.numpy()

    # -------------------------------------------------------------------------------------------------- encode
    def encode(self, image: torch.Tensor) -> torch.Tensor:
        """The encoder's output (latents, or latent parameters) for an NCHW image in [-1, 1]. A CPU image is uploaded
        tile by tile from pinned memory when the encoder runs on CUDA, each upload overlapping the previous tile's
        encoding (``overlap_copies``); a device image is tiled where it is."""
        if self.vae_encoder is None:
            raise ArgumentError("vae_encoder", "encoding needs one, got None")
        device = self.vae_encoder.device
        tile_in, tile_out = self.tile_sample_size, self.tile_latent_size
        stride, _, _ = self._geometry(tile_in, tile_out)
        height, width = self._assembled_size(image.shape, tile_in, tile_out)
        dtype = self.vae_encoder.input_dtypes["sample"]
        if device.type == "cuda" and image.device.type == "cpu":
            run = self._uploading_encoder(image.to(dtype), tile_in, stride)
            source = torch.empty((image.shape[0], image.shape[1], image.shape[2], image.shape[3]), device="meta")
        else:
            run, source = self._encode_tile, image.to(device=device, dtype=dtype)
        latents = None
        for top, left, tile in self._tiles(source, tile_in, tile_out, run):
            if latents is None:
                latents = tile.new_empty((tile.shape[0], tile.shape[1], height, width))
            latents[:, :, top : top + tile.shape[2], left : left + tile.shape[3]] = tile
        return latents

    def _uploading_encoder(
        self, image: torch.Tensor, tile_in: int, stride: int
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """An encoder for ``_tiles`` over a placeholder of the image's shape: it encodes the uploaded tile and has
        the next one's upload (host → pinned → device, on the copy stream) already under way."""
        device = self.vae_encoder.device
        compute = torch.cuda.current_stream(device)
        copies = self._copy_stream(device)
        order = [(i, j) for i in _starts(image.shape[2], stride) for j in _starts(image.shape[3], stride)]
        uploads: Dict[int, Tuple[torch.Tensor, "torch.cuda.Event"]] = {}

        def upload(index: int) -> None:
            if index >= len(order) or index in uploads:
                return
            i, j = order[index]
            block = image[:, :, i : i + tile_in, j : j + tile_in]
            staging = self._staging_buffer(index % 2, tuple(block.shape), block.dtype)
            staging.copy_(block)  # host memcpy into pinned memory; the slot's last upload was waited for below
            with torch.cuda.stream(copies):
                on_device = staging.to(device, non_blocking=True)
                arrived = torch.cuda.Event()
                arrived.record(copies)
            on_device.record_stream(compute)
            uploads[index] = (on_device, arrived)

        position = iter(range(len(order)))

        def run(_: torch.Tensor) -> torch.Tensor:
            index = next(position)
            upload(index)
            on_device, arrived = uploads.pop(index)
            compute.wait_event(arrived)
            if not self.overlap_copies:
                arrived.synchronize()
            encoded = self._encode_tile(on_device)
            arrived.synchronize()  # the staging slot of this tile may be refilled for tile index + 2 now
            upload(index + 1)  # travels while this tile is encoded
            return encoded

        return run

    # ------------------------------------------------------------------------------------------------- buffers
    def _copy_stream(self, device: torch.device) -> "torch.cuda.Stream":
        if device not in self._copy_streams:
            self._copy_streams[device] = torch.cuda.Stream(device)
        return self._copy_streams[device]

    def _staging_buffer(self, slot: int, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        key = (slot, shape, dtype)
        if key not in self._staging:
            with DEVICE_SETUP.setup():  # pinning may allocate, which a graph capture in another thread must not see
                self._staging[key] = torch.empty(shape, dtype=dtype, pin_memory=True)
        return self._staging[key]
