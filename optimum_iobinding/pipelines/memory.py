"""Whether a call of a size can fit in the memory it would run in, asked before any work: of a folder before
anything loads (the command line), of a loaded pipeline before its first step (a call on the CPU).

The estimate is the largest of what the call's stages hold at once (they run one after another): the denoiser's
attention scores at its finest attention level, where they are computed unfused (ONNX Runtime's CPU kernels keep
rows × heads × tokens² scores; on the GPU the fused attention keeps none), and the VAE decoder's full-resolution stage
(the first resnet there holds its input, the upsampled previous stage, and its output at once) or its mid-block
attention over every latent pixel, whichever is larger. Those grow with the pixels (the attention with their square)
and dominate a large image; the weights and the smaller activations come on top.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple, Union

import torch

from ..errors import ArgumentError
from ..runtime.model import output_byte_limit

# the decoder's full-resolution channels where its folder has no config.json: Stable Diffusion's VAE
# (block_out_channels [128, 256, 512, 512]: 256 channels upsampled into the last stage, 128 out)
DEFAULT_FULL_RESOLUTION_CHANNELS = 256 + 128
ELEMENT_BYTES = 2  # float16, the smallest element the exports use: the floor for an fp32 folder too
# How many score-sized buffers an unfused attention keeps alive on ONNX Runtime's CPU provider, with a margin for
# the rest of the process: the denoiser's (scores, then their softmax) and the VAE decoder's mid-block attention
# (float32 upcasts, scaling and softmax). Peak resident memory of the tiny random SD pipeline at 1024² and 1280²
# over the scores alone, less the idle process: 2.0–2.1 (UNet, latent output) and 4.1–4.2 (with the decode).
DENOISER_ATTENTION_COPIES = 2.5
DECODER_ATTENTION_COPIES = 4.5
CUDA_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")


def full_resolution_channels(decoder_folder: Union[str, os.PathLike]) -> int:
    """The channels the decoder's last stage holds per pixel at once (its input and its output), from the folder's
    ``config.json``: an ``AutoencoderKL`` upsamples ``block_out_channels[1]`` channels into a stage of
    ``block_out_channels[0]``; an ``AutoencoderTiny`` (TAESD) keeps ``decoder_block_out_channels[-1]`` in and out.
    A folder without a readable config is taken as Stable Diffusion's VAE."""
    return _channels_of(read_config(decoder_folder))


def _channels_of(config: dict) -> int:
    channels = config.get("block_out_channels")
    if isinstance(channels, list) and channels and all(isinstance(c, int) for c in channels):
        return channels[0] + channels[min(1, len(channels) - 1)]
    tiny = config.get("decoder_block_out_channels")
    if isinstance(tiny, list) and tiny and all(isinstance(c, int) for c in tiny):
        return 2 * tiny[-1]
    return DEFAULT_FULL_RESOLUTION_CHANNELS


def read_config(folder: Union[str, os.PathLike]) -> dict:
    """A component folder's ``config.json`` (``{}`` where it has none or it does not parse)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _per_level(value: object, level: int, default: int) -> int:
    if isinstance(value, (list, tuple)):
        value = value[min(level, len(value) - 1)] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def denoiser_attention_bytes(
    config: dict, component: str, height: int, width: int, vae_scale_factor: int, rows: int, element_bytes: int
) -> int:
    """The attention a denoiser call holds at once, computed unfused: :data:`DENOISER_ATTENTION_COPIES` of its
    scores, ``rows`` × heads × tokens² × ``element_bytes``, at its finest attention level. A UNet (``component`` ``"unet"``): the first level whose down
    block attends (diffusers' ``attention_head_dim`` is its heads where ``num_attention_heads`` is unset); a
    diffusion transformer: the 2 × 2 patches of the latents and up to 512 text tokens, ``num_attention_heads``
    heads."""
    if component == "unet":
        heads = config.get("num_attention_heads") or config.get("attention_head_dim")
        need = 0
        for level, kind in enumerate(config.get("down_block_types") or ("CrossAttnDownBlock2D",)):
            if "Attn" in str(kind):
                factor = vae_scale_factor * 2**level
                tokens = math.ceil(height / factor) * math.ceil(width / factor)
                need = max(need, rows * _per_level(heads, level, 8) * tokens * tokens * element_bytes)
        return int(need * DENOISER_ATTENTION_COPIES)
    tokens = math.ceil(height / (2 * vae_scale_factor)) * math.ceil(width / (2 * vae_scale_factor)) + 512
    scores = rows * _per_level(config.get("num_attention_heads"), 0, 24) * tokens * tokens * element_bytes
    return int(scores * DENOISER_ATTENTION_COPIES)


def decoder_bytes(config: dict, height: int, width: int, images: int, element_bytes: int) -> int:
    """What the VAE decoder (its ``config``) holds at once for ``images`` images of ``height`` × ``width``: its
    full-resolution stage (:func:`full_resolution_channels`) or, for an ``AutoencoderKL``, its mid-block attention over
    every latent pixel (one head; :data:`DECODER_ATTENTION_COPIES` of its scores), whichever is larger."""
    activations = height * width * images * _channels_of(config) * element_bytes
    levels = config.get("block_out_channels")
    if not isinstance(levels, list) or not levels:
        return activations  # a tiny VAE (TAESD): no attention
    factor = 2 ** (len(levels) - 1)
    tokens = math.ceil(height / factor) * math.ceil(width / factor)
    return max(activations, int(images * tokens * tokens * element_bytes * DECODER_ATTENTION_COPIES))


def available_memory(provider: str, device_id: int = 0) -> Optional[Tuple[int, str]]:
    """``(bytes free, what that is)`` for the memory a call on ``provider`` allocates its activations in, as the
    runtime bounds an output buffer (:func:`~optimum_iobinding.runtime.model.output_byte_limit`): the CUDA device's
    free memory for CUDA and TensorRT, the host's available memory for the CPU; ``None`` where it cannot be known
    (another accelerator, CUDA without a CUDA build of torch)."""
    if provider in CUDA_PROVIDERS:
        if not torch.cuda.is_available():
            return None
        return output_byte_limit(torch.device("cuda", device_id))
    if provider != "CPUExecutionProvider":
        return None
    return output_byte_limit(torch.device("cpu"))


def gigabytes(count: float) -> str:
    if count >= 1e13:  # far beyond any machine: whole terabytes, grouped
        return f"{count / 1e12:,.0f} TB"
    return f"{count / 1e12:.1f} TB" if count >= 1e12 else f"{count / 1e9:.1f} GB"


@dataclass(frozen=True)
class CallMemory:
    """What a call holds at once, by size (see the module's docstring): the VAE decoder's config, the denoiser's
    (``None``: not counted) and its ``component`` (``"unet"`` or ``"transformer"``), the VAE's scale factor, the
    bytes of an activation, and whether the denoiser's attention scores are counted (``attention``: computed
    unfused, as ONNX Runtime's CPU kernels compute them)."""

    decoder: dict
    denoiser: Optional[dict] = None
    component: str = "unet"
    vae_scale_factor: int = 8
    element_bytes: int = ELEMENT_BYTES
    attention: bool = False

    @classmethod
    def of_folder(
        cls, folder: Union[str, os.PathLike], provider: str, decoder_folder: Union[str, os.PathLike, None] = None
    ) -> "CallMemory":
        """Of a pipeline folder run on ``provider`` (its decoder from ``decoder_folder`` where given: a stream's tiny
        VAE): on the CPU float32 activations and unfused attention, elsewhere the float16 floor without the
        attention a fused export keeps none of."""
        folder = Path(folder)
        vae = read_config(folder / "vae_decoder")
        decoder = vae if decoder_folder is None else read_config(decoder_folder)
        component = "unet" if (folder / "unet").is_dir() else "transformer"
        denoiser = read_config(folder / component) if (folder / component).is_dir() else None
        levels = vae.get("block_out_channels")
        factor = 2 ** (len(levels) - 1) if isinstance(levels, list) and levels else 8
        cpu = provider == "CPUExecutionProvider"
        return cls(decoder, denoiser, component, factor, 4 if cpu else ELEMENT_BYTES, cpu)

    def need(self, width: int, height: int, images: int = 1, rows: Optional[int] = None) -> Tuple[int, str]:
        """``(bytes, what holds them)`` of the largest stage of a call making ``images`` images of ``width`` ×
        ``height``, its denoiser running ``rows`` rows (default ``images``; twice that with classifier-free
        guidance)."""
        stages = {"the VAE decoder": decoder_bytes(self.decoder, height, width, images, self.element_bytes)}
        if self.denoiser is not None and self.attention:
            stages[f"the {'UNet' if self.component == 'unet' else 'transformer'}'s attention"] = (
                denoiser_attention_bytes(
                    self.denoiser,
                    self.component,
                    height,
                    width,
                    self.vae_scale_factor,
                    rows or images,
                    self.element_bytes,
                )
            )
        what = max(stages, key=stages.__getitem__)
        return stages[what], what


def check_image_fits(
    memory: CallMemory,
    width: int,
    height: int,
    provider: str,
    images: int = 1,
    rows: Optional[int] = None,
    multiple: int = 8,
    device_id: int = 0,
    argument: str = "height and width",
) -> None:
    """Refuses ``width`` × ``height`` (``images`` images, ``rows`` denoiser rows: see :meth:`CallMemory.need`) where
    what the call holds at once exceeds the memory :func:`available_memory` reports, naming the largest size of the
    same aspect ratio (in steps of ``multiple``) that fits. Nothing is refused where that memory cannot be known."""
    need, what = memory.need(width, height, images, rows)
    available = available_memory(provider, device_id)
    if available is None or need <= available[0]:
        return
    free, where = available

    def sides(scale: float) -> Tuple[int, int]:
        return tuple(max(multiple, int(side * scale) // multiple * multiple) for side in (width, height))

    low, high = 0.0, 1.0  # the largest scale whose size fits (the need grows with the scale)
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if memory.need(*sides(middle), images, rows)[0] <= free else (low, middle)
    fit_width, fit_height = sides(low)
    fits = (
        f"at most about {fit_width}×{fit_height} fits"
        if memory.need(fit_width, fit_height, images, rows)[0] <= free
        else "no size fits"
    )
    several = f" × {images} images" if images > 1 else ""
    raise ArgumentError(
        argument,
        f"{width}×{height}{several} needs about {gigabytes(need)} at once for {what}, more than {gigabytes(free)}, "
        f"{where}; {fits}",
    )
