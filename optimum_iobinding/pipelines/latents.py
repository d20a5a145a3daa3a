"""Latents and schedules (:class:`Latents`, a part of :class:`~.core.OnnxDiffusionPipeline`): initial noise of any
shape (images' ``(rows, channels, height, width)``, a video's with frames too) from a numpy or torch generator, the
scheduler's timesteps kept on the CPU, image-to-image's shortened schedule and noised start."""

from __future__ import annotations

import inspect
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch
from diffusers.utils.torch_utils import randn_tensor

from ..errors import ArgumentError, ArgumentTypeError
from .arguments import Generator, generator_kinds, is_real, is_torch_generator, no_denoising_step
from .transfer import on_cpu, tensor_of, upload


class Latents:
    """Initial latents, timesteps and the scheduler step's arguments of a call."""

    def prepare_latents(
        self,
        shape: Tuple[int, ...],
        dtype: torch.dtype,
        generator: Generator,
        latents: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Initial noise on ``self.device``: from a numpy ``RandomState`` (the same numbers as diffusers' ONNX
        pipeline for the same seed; ``None`` means ``np.random``), from a ``torch.Generator``, or given."""
        if latents is not None:
            latents = tensor_of(latents, "latents")
            if tuple(latents.shape) != tuple(shape):
                raise ArgumentError("latents", f"expected shape {tuple(shape)}, got {tuple(latents.shape)}")
            return latents.to(device=self.device, dtype=dtype)
        if generator is None or isinstance(generator, np.random.RandomState):
            numpy_dtype = torch.empty((), dtype=dtype).numpy().dtype
            noise = (generator or np.random).randn(*shape).astype(numpy_dtype)
            return upload(torch.from_numpy(noise), self.device)
        if is_torch_generator(generator):
            if self.device.type == "cuda" and on_cpu(generator):
                # drawn on the host as diffusers draws it, then uploaded without making the host wait
                return upload(
                    randn_tensor(shape, generator=generator, device=torch.device("cpu"), dtype=dtype), self.device
                )
            return randn_tensor(shape, generator=generator, device=self.device, dtype=dtype)
        raise ArgumentTypeError("generator", f"expected {generator_kinds()}, got {type(generator).__name__}")

    def scheduler_step_kwargs(self, generator: Generator, eta: float) -> Dict[str, Any]:
        """``eta`` for DDIM-like schedulers, and the generator a stochastic one draws its noise from: the caller's
        torch generator, or for a numpy ``RandomState`` a torch generator on the device seeded from a copy of its
        state (the caller's generator is not advanced, so the initial noise stays diffusers'), so that the same seed
        gives the same image with every scheduler."""
        if not is_real(eta) or not 0.0 <= eta <= 1.0:
            raise ArgumentError("eta", f"expected a number in [0, 1] (DDIM's noise share), got {eta!r}")
        accepted = set(inspect.signature(self.scheduler.step).parameters)
        kwargs: Dict[str, Any] = {}
        if "eta" in accepted:
            kwargs["eta"] = eta
        if "generator" in accepted and is_torch_generator(generator):
            kwargs["generator"] = generator  # a list: one per image, as diffusers' schedulers take it
        elif "generator" in accepted and isinstance(generator, np.random.RandomState):
            copy = np.random.RandomState()
            copy.set_state(generator.get_state())
            seed = int(copy.randint(0, 2**63 - 1, dtype=np.int64))
            kwargs["generator"] = torch.Generator(device=self.device).manual_seed(seed)
        return kwargs

    def set_timesteps(self, num_inference_steps: int, **scheduler_arguments: Any) -> torch.Tensor:
        """Sets the scheduler's timesteps from the first (``scheduler_arguments``: the scheduler's own, as LCM's
        ``original_inference_steps``), keeping its state on the CPU: its per-step scalars (sigmas, alphas) then meet
        the device tensors as CPU scalars, which never makes the host wait; a schedule on the GPU would (Euler
        compares a sigma with a Python float, DDIM indexes a CPU table with the timestep)."""
        self.scheduler.set_timesteps(num_inference_steps, **scheduler_arguments)
        if hasattr(self.scheduler, "set_begin_index"):
            self.scheduler.set_begin_index(0)
        return self.scheduler.timesteps

    def initial_noise(
        self,
        rows: int,
        height: int,
        width: int,
        dtype: torch.dtype,
        generator: Generator,
        latents: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """A text-to-image loop's first latents on ``self.device``: ``rows`` of noise (or the given ``latents``) of
        :meth:`latent_shape`, scaled by the scheduler's initial sigma."""
        shape = self.latent_shape(rows, height, width)
        return self.prepare_latents(shape, dtype, generator, latents) * self.scheduler.init_noise_sigma

    def latent_shape(self, rows: int, height: int, width: int) -> Tuple[int, ...]:
        """The shape of ``rows`` latents of a ``height`` × ``width`` output: ``(rows, channels, height / f, width /
        f)`` for an image (``f``: the VAE's scale factor); a family whose latents have more axes (a video's frames)
        says its own."""
        return (rows, self.latent_channels, height // self.vae_scale_factor, width // self.vae_scale_factor)

    def strength_timesteps(self, num_inference_steps: int, strength: float) -> torch.Tensor:
        """The scheduler's timesteps after skipping the first ``1 - strength`` of them (img2img, inpainting)."""
        self.set_timesteps(num_inference_steps)
        init_timestep = min(int(num_inference_steps * strength), num_inference_steps)
        t_start = max(num_inference_steps - init_timestep, 0)
        timesteps = self.scheduler.timesteps[t_start * self.scheduler.order :]
        if hasattr(self.scheduler, "set_begin_index"):
            self.scheduler.set_begin_index(t_start * self.scheduler.order)
        if len(timesteps) == 0:
            raise no_denoising_step(strength, num_inference_steps)
        return timesteps

    def start_image(self, image: Any, height: Optional[int] = None, width: Optional[int] = None) -> torch.Tensor:
        """The image an image-to-image call starts from, checked and preprocessed (NCHW in [-1, 1], resized to
        ``height`` × ``width`` where both are given, else of its own size rounded down to the VAE's factor)."""
        if image is None:
            raise ArgumentError(
                "image", "expected an image to start from (a PIL image, numpy array or tensor), got None"
            )
        self.check_image(image, "image", resized=height is not None and width is not None)
        pixels = self.image_processor.preprocess(image, height=height, width=width).to(torch.float32)
        self.check_image_size(*pixels.shape[-2:], "image")
        return pixels

    def noised_image_latents(
        self,
        pixels: torch.Tensor,
        timesteps: torch.Tensor,
        generator: Generator,
        batch_size: int,
        num_images_per_prompt: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """The latents an image-to-image loop starts from: ``pixels`` encoded (one image for every prompt, or one
        per prompt, each ``num_images_per_prompt`` times), noised to the first of ``timesteps``."""
        image_latents = self.encode_image(pixels, generator).to(dtype)
        image_latents = expand_to_batch(image_latents, batch_size, num_images_per_prompt, "image")
        noise = self.prepare_latents(tuple(image_latents.shape), dtype, generator)
        return self.scheduler.add_noise(image_latents, noise, timesteps[:1].repeat(image_latents.shape[0]))


def expand_to_batch(tensor: torch.Tensor, batch_size: int, num_images_per_prompt: int, name: str) -> torch.Tensor:
    """One image for every prompt, or one per prompt; then ``num_images_per_prompt`` copies of each."""
    if tensor.shape[0] == 1 and batch_size > 1:
        tensor = tensor.expand(batch_size, *tensor.shape[1:])
    elif tensor.shape[0] != batch_size:
        expected = "1 image (one prompt)" if batch_size == 1 else f"1 or {batch_size} images (one per prompt)"
        raise ArgumentError(name, f"expected {expected}, got {tensor.shape[0]}")
    return tensor.repeat_interleave(num_images_per_prompt, dim=0)
