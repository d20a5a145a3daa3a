"""Whether an image of a size can fit in the memory it would run in, asked of a folder before anything loads.

The bound is the VAE decoder's full-resolution stage, the one part whose activations grow with the image's pixels
at the full channel count: the first resnet there holds its input (the upsampled previous stage) and its output at
once. That is a floor of what a call needs, not an estimate of it (the denoiser, the decoder's attention and ORT's
workspaces come on top), so a size this check lets through can still run out; a size it refuses cannot run.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Optional, Tuple, Union

import torch

from ..errors import ArgumentError
from ..runtime.model import output_byte_limit

# the decoder's full-resolution channels where its folder has no config.json: Stable Diffusion's VAE
# (block_out_channels [128, 256, 512, 512]: 256 channels upsampled into the last stage, 128 out)
DEFAULT_FULL_RESOLUTION_CHANNELS = 256 + 128
ELEMENT_BYTES = 2  # float16, the smallest element the exports use: the floor for an fp32 folder too
CUDA_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")


def full_resolution_channels(decoder_folder: Union[str, os.PathLike]) -> int:
    """The channels the decoder's last stage holds per pixel at once (its input and its output), from the folder's
    ``config.json``: an ``AutoencoderKL`` upsamples ``block_out_channels[1]`` channels into a stage of
    ``block_out_channels[0]``; an ``AutoencoderTiny`` (TAESD) keeps ``decoder_block_out_channels[-1]`` in and out.
    A folder without a readable config is taken as Stable Diffusion's VAE."""
    try:
        config = json.loads((Path(decoder_folder) / "config.json").read_text())
    except (OSError, ValueError):
        return DEFAULT_FULL_RESOLUTION_CHANNELS
    channels = config.get("block_out_channels") if isinstance(config, dict) else None
    if isinstance(channels, list) and channels and all(isinstance(c, int) for c in channels):
        return channels[0] + channels[min(1, len(channels) - 1)]
    tiny = config.get("decoder_block_out_channels") if isinstance(config, dict) else None
    if isinstance(tiny, list) and tiny and all(isinstance(c, int) for c in tiny):
        return 2 * tiny[-1]
    return DEFAULT_FULL_RESOLUTION_CHANNELS


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
    return f"{count / 1e12:.1f} TB" if count >= 1e12 else f"{count / 1e9:.1f} GB"


def check_image_fits(
    decoder_folder: Union[str, os.PathLike],
    width: int,
    height: int,
    provider: str,
    batch_size: int = 1,
    multiple: int = 8,
    device_id: int = 0,
    argument: str = "height and width",
) -> None:
    """Refuses ``width`` × ``height`` (× ``batch_size`` images decoded at once) where the decoder's full-resolution
    activations alone (:func:`full_resolution_channels`, float16) exceed the memory :func:`available_memory` reports,
    naming the largest size of the same aspect ratio (in steps of ``multiple``) that the bound admits. Nothing is
    refused where that memory cannot be known."""
    need = width * height * batch_size * full_resolution_channels(decoder_folder) * ELEMENT_BYTES
    memory = available_memory(provider, device_id)
    if memory is None or need <= memory[0]:
        return
    free, where = memory
    scale = math.sqrt(free / need)
    fit_width = max(multiple, int(width * scale) // multiple * multiple)
    fit_height = max(multiple, int(height * scale) // multiple * multiple)
    images = f" × {batch_size} images" if batch_size > 1 else ""
    raise ArgumentError(
        argument,
        f"{width}×{height}{images} needs at least {gigabytes(need)} for the VAE decoder's "
        f"full-resolution activations alone, more than {gigabytes(free)}, {where}; at most "
        f"about {fit_width}×{fit_height} fits that bound",
    )
