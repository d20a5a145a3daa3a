"""The argument checks every family shares (:class:`ArgumentChecks`, a part of :class:`~.core.OnnxDiffusionPipeline`),
written once: the shared call arguments (:meth:`ArgumentChecks.check_call`), prompts and their embeddings, images
and sizes. A family adds only its own rules. Every refusal is an :class:`~optimum_iobinding.errors.ArgumentError`
(or its Type sibling) naming the argument, what was expected and what came."""

from __future__ import annotations

import math
from typing import Any, List, Optional, Tuple, Union

import numpy as np
import PIL.Image
import torch

from ..errors import ArgumentError, ArgumentTypeError
from .arguments import check_generator, is_integer, is_real
from .loop import check_callback_arguments
from .memory import CallMemory, check_image_fits
from .transfer import check_holds_values


class ArgumentChecks:
    """The shared checks, refusing before any work."""

    #: whether a str negative prompt serves every prompt and a str prompt takes a list of one negative prompt (as
    #: diffusers' Wan pipelines encode them); otherwise a negative prompt is of the prompt's type and count
    broadcasts_negative_prompt = False

    def check_call(
        self,
        *,
        height: Any,
        width: Any,
        num_inference_steps: Any,
        guidance_scale: Any = None,
        num_images_per_prompt: Any = 1,
        output_type: Any = "pil",
        strength: Any = None,
        sigmas: Any = None,
        callback_steps: Any = None,
        callback_on_step_end: Any = None,
        callback_on_step_end_tensor_inputs: Any = ("latents",),
        joint_attention_kwargs: Any = None,
        guidance_rescale: Any = None,
        prompts: int = 1,
        generator: Any = None,
        callback: Any = None,
    ) -> None:
        """Refuses, before any work, a shared argument the call cannot run with (every family's, checked here
        once), naming it, what was expected and what came: the size, the steps (or ``sigmas``, one per step), the
        guidance scale, images per prompt, the output type, ``strength``, the callbacks and the tensors a step-end
        callback asks for (among the family's :attr:`~optimum_iobinding.families.Family.callback_tensors`), the
        ``generator`` (one per image where a list: ``prompts`` × ``num_images_per_prompt``), the step ``callback``,
        and diffusers' ``joint_attention_kwargs``, which an exported transformer has no attention processors to take."""
        if joint_attention_kwargs:
            raise ArgumentError(
                "joint_attention_kwargs",
                f"expected None (an ONNX transformer has no attention processors to pass them to), "
                f"got {joint_attention_kwargs!r}",
            )
        check_callback_arguments(callback_on_step_end, callback_on_step_end_tensor_inputs, self.family.callback_tensors)
        if strength is not None and (not is_real(strength) or not 0.0 <= strength <= 1.0):
            raise ArgumentError("strength", f"expected a value in [0, 1], got {strength!r}")
        if guidance_scale is not None and (not is_real(guidance_scale) or not math.isfinite(guidance_scale)):
            raise ArgumentError("guidance_scale", f"expected a finite number, got {guidance_scale!r}")
        if guidance_rescale is not None and (not is_real(guidance_rescale) or not 0.0 <= guidance_rescale <= 1.0):
            raise ArgumentError("guidance_rescale", f"expected a number in [0, 1], got {guidance_rescale!r}")
        if not is_integer(num_images_per_prompt) or num_images_per_prompt < 1:
            raise ArgumentError("num_images_per_prompt", f"expected a positive integer, got {num_images_per_prompt!r}")
        check_generator(generator, prompts, num_images_per_prompt)
        if callback is not None and not callable(callback):
            raise ArgumentTypeError(
                "callback", f"expected a callable, callback(step, timestep, latents), got {type(callback).__name__}"
            )
        self.check_size(height, width)
        if self.device.type == "cpu" and not self.family.frames:
            self.check_fits(height, width, prompts * num_images_per_prompt, guidance_scale)
        if sigmas is not None:
            values = list(sigmas) if isinstance(sigmas, (list, tuple, np.ndarray)) else None
            if not values or not all(is_real(v) and math.isfinite(v) for v in values):
                raise ArgumentError(
                    "sigmas", f"expected a non-empty list of finite numbers (one per step), got {sigmas!r}"
                )
        elif not is_integer(num_inference_steps) or num_inference_steps <= 0:
            raise ArgumentError("num_inference_steps", f"expected a positive integer, got {num_inference_steps!r}")
        if output_type not in ("pil", "np", "pt", "latent"):
            raise ArgumentError("output_type", f"expected 'pil', 'np', 'pt' or 'latent', got {output_type!r}")
        if callback_steps is not None and (not is_integer(callback_steps) or callback_steps <= 0):
            raise ArgumentError("callback_steps", f"expected a positive integer, got {callback_steps!r}")

    def check_inputs(
        self,
        *,
        prompt: Union[str, List[str], None],
        negative_prompt: Union[str, List[str], None] = None,
        prompt_embeds: Optional[torch.Tensor] = None,
        negative_prompt_embeds: Optional[torch.Tensor] = None,
        **call: Any,
    ) -> None:
        """:meth:`check_call` (``call``: its arguments), then the prompts of a CLIP family: a prompt or its
        embeddings (one of them), a negative prompt like it (a str for every prompt where
        :attr:`broadcasts_negative_prompt`) or its embeddings (at most one of them), embeddings of the denoiser's
        width."""
        if isinstance(prompt, list):  # the rows the memory check counts (a bad prompt is refused below)
            prompts = len(prompt)
        elif prompt is None and isinstance(prompt_embeds, torch.Tensor) and prompt_embeds.ndim == 3:
            prompts = prompt_embeds.shape[0]
        else:
            prompts = 1
        self.check_call(**call, prompts=prompts)
        steps = len(call["sigmas"]) if call.get("sigmas") is not None else call["num_inference_steps"]
        train_steps = getattr(self.scheduler.config, "num_train_timesteps", None)
        if train_steps and steps > train_steps:  # a discrete-time schedule has no more steps than it was trained on
            raise ArgumentError(
                "num_inference_steps",
                f"expected at most {train_steps} (the scheduler's num_train_timesteps), got {steps}",
            )
        self.check_texts("prompt", prompt, None)
        self.check_texts("negative_prompt", negative_prompt, None)
        for name, embeds in (("prompt_embeds", prompt_embeds), ("negative_prompt_embeds", negative_prompt_embeds)):
            if embeds is not None:
                self.check_embeds(name, embeds, 3, "(batch, sequence, hidden)", "encoder_hidden_states")
        if prompt is not None and prompt_embeds is not None:
            raise ArgumentError("prompt and prompt_embeds", "expected one of them, got both")
        if prompt is None and prompt_embeds is None:
            raise ArgumentError("prompt and prompt_embeds", "expected one of them, got neither")
        if negative_prompt is not None and negative_prompt_embeds is not None:
            raise ArgumentError("negative_prompt and negative_prompt_embeds", "expected at most one of them, got both")
        if self.broadcasts_negative_prompt:
            count = self.batch_size_of(prompt, prompt_embeds)
            self.check_texts("negative_prompt", negative_prompt, count, broadcast=True)
        elif isinstance(prompt, list) and isinstance(negative_prompt, list) and len(prompt) != len(negative_prompt):
            raise ArgumentError(
                "negative_prompt", f"expected a list of {len(prompt)} (as many as prompt), got {len(negative_prompt)}"
            )
        elif negative_prompt is not None and prompt is not None and type(prompt) is not type(negative_prompt):
            raise ArgumentTypeError(
                "negative_prompt",
                f"expected a {type(prompt).__name__} like prompt, got {type(negative_prompt).__name__}",
            )
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
        if (
            prompt is not None
            and negative_prompt_embeds is not None
            and negative_prompt_embeds.shape[0] != self.batch_size_of(prompt, None)
        ):
            raise ArgumentError(
                "negative_prompt_embeds",
                f"expected {self.batch_size_of(prompt, None)} rows (one per "
                f"prompt), got shape {tuple(negative_prompt_embeds.shape)}",
            )

    def check_embeds(self, name: str, embeds: Any, rank: int, layout: str, unet_input: str) -> None:
        """Given embeddings must be a float tensor (or numpy array) of ``rank`` dims whose last (the hidden size)
        is the width the denoiser's (UNet's or transformer's) ``unet_input`` declares, and whose sequence length is
        the one it declares (where static): refused before any work otherwise, naming ``name``."""
        if isinstance(embeds, np.ndarray):
            dtype, floating = embeds.dtype, embeds.dtype.kind == "f" and embeds.dtype.itemsize <= 8
        elif isinstance(embeds, torch.Tensor) and embeds.layout == torch.strided and not embeds.is_nested:
            dtype, floating = embeds.dtype, embeds.dtype.is_floating_point
        else:
            kind = f"a {str(embeds.layout)[6:]} tensor" if isinstance(embeds, torch.Tensor) else type(embeds).__name__
            raise ArgumentTypeError(name, f"expected a dense torch.Tensor or numpy array {layout}, got {kind}")
        if not floating:
            raise ArgumentTypeError(name, f"expected a float tensor (the text encoder's output), got dtype {dtype}")
        if isinstance(embeds, torch.Tensor):
            check_holds_values(embeds, name)
        if embeds.ndim != rank:
            raise ArgumentError(name, f"expected shape {layout}, got {tuple(embeds.shape)}")
        if 0 in embeds.shape:
            raise ArgumentError(name, f"expected a non-empty tensor {layout}, got shape {tuple(embeds.shape)}")
        denoiser = "UNet" if self.denoiser.component == "unet" else self.denoiser.component
        declared = self.denoiser.model.input_dims.get(unet_input) or []
        if len(declared) == rank and isinstance(declared[-1], int) and embeds.shape[-1] != declared[-1]:
            raise ArgumentError(
                name,
                f"expected hidden size {declared[-1]} (the width of the {denoiser}'s "
                f"{unet_input}), got {embeds.shape[-1]} (shape {tuple(embeds.shape)})",
            )
        if rank == 3 and len(declared) == 3 and isinstance(declared[1], int) and embeds.shape[1] != declared[1]:
            raise ArgumentError(
                name,
                f"expected sequence length {declared[1]} (the {denoiser}'s {unet_input}), got "
                f"{embeds.shape[1]} (shape {tuple(embeds.shape)})",
            )

    @staticmethod
    def check_texts(name: str, texts: Any, count: Optional[int], broadcast: bool = False) -> Optional[int]:
        """A prompt argument, refused before any work otherwise, naming ``name``: a str or a non-empty list of str,
        as many as ``count`` (a str goes with any count where ``broadcast``). Returns how many it holds (``None``
        for ``None``)."""
        if texts is None:
            return None
        if not isinstance(texts, (str, list)):
            raise ArgumentTypeError(name, f"expected a str or a list of str, got {type(texts).__name__} {texts!r}")
        if isinstance(texts, list):
            if not texts:
                raise ArgumentError(name, "expected a str or a non-empty list of str, got an empty list")
            wrong = next((i for i, item in enumerate(texts) if not isinstance(item, str)), None)
            if wrong is not None:
                raise ArgumentTypeError(
                    f"{name}[{wrong}]", f"expected a str, got {type(texts[wrong]).__name__} {texts[wrong]!r}"
                )
        given = 1 if isinstance(texts, str) else len(texts)
        if count is not None and given != count and not (broadcast and isinstance(texts, str)):
            raise ArgumentError(
                name, f"expected {count} prompt{'s' if count > 1 else ''} (as many as prompt), got {given}"
            )
        return given

    def check_image(
        self,
        image: Any,
        name: str = "image",
        resized: bool = False,
        mask: bool = False,
        channels: Optional[Tuple[int, ...]] = None,
    ) -> Tuple[int, int]:
        """Refuses, before any work, an image the pipeline cannot use, naming ``name``: not a PIL image, numpy array
        (``(height, width, channels)``, or a batch of them) or torch tensor (``([batch, ]channels, height,
        width)``), or a list of them; empty (a size of 0); with other ``channels`` than these (default: the VAE
        encoder's; ``()``: any); or, where the image's own size becomes the call's (``resized=False``: img2img),
        smaller than one latent pixel (the VAE's scale factor). A ``mask`` may also be ``(height, width)`` or a
        batch of those, of any channels (it is made grayscale).

        Returns:
            The (first) image's height and width.
        """
        allowed = () if mask else self.codec.image_channels() if channels is None else channels
        items = image if isinstance(image, list) else [image]
        if not items:
            raise ArgumentError(name, "expected an image or a non-empty list of images, got an empty list")
        sizes = []
        for index, item in enumerate(items):
            label = f"{name}[{index}]" if isinstance(image, list) else name
            if isinstance(item, PIL.Image.Image):
                shape, size = None, (item.height, item.width)
            elif isinstance(item, (np.ndarray, torch.Tensor)):
                shape = tuple(item.shape)
                layout = "(height, width, channels)" if isinstance(item, np.ndarray) else "(channels, height, width)"
                if not (2 if mask else 3) <= len(shape) <= 4:
                    also = " or (height, width)" if mask else ""
                    raise ArgumentError(
                        label, f"expected an image of shape {layout}{also}, or a batch of them, got shape {shape}"
                    )
                if isinstance(item, np.ndarray):
                    size, given = (shape[-3:-1], shape[-1]) if len(shape) >= 3 else (shape, 1)
                    if mask and len(shape) == 3 and shape[-1] != 1:  # a mask's (batch, height, width), as diffusers
                        size = shape[1:]
                else:
                    size, given = shape[-2:], (shape[-3] if len(shape) >= 3 else 1)
                if allowed and given not in allowed and 0 not in shape:
                    raise ArgumentError(
                        label,
                        f"expected {' or '.join(map(str, allowed))} channel"
                        f"{'s' if allowed != (1,) else ''} in the layout {layout}, got shape {shape}",
                    )
            else:
                raise ArgumentTypeError(
                    label,
                    f"expected a PIL image, a numpy array or a torch tensor (or a list of them), "
                    f"got {type(item).__name__}",
                )
            if 0 in (shape or size):
                got = f"shape {shape}" if shape is not None else f"{size[0]} × {size[1]} pixels"
                raise ArgumentError(label, f"expected a non-empty image, got {got}")
            factor = self.vae_scale_factor
            if not resized and min(size) < factor:
                raise ArgumentError(
                    label,
                    f"expected at least {factor} × {factor} pixels (one latent pixel: the VAE's "
                    f"scale factor), got {size[0]} × {size[1]}",
                )
            sizes.append(tuple(int(d) for d in size))
        return sizes[0]

    def check_image_size(self, height: int, width: int, name: str = "image") -> None:
        """:meth:`check_size` for a size that an image gave (img2img), naming the image."""
        try:
            self.check_size(height, width)
        except ValueError as error:
            raise ArgumentError(
                name,
                f"a {height} × {width} image (after rounding down to the VAE factor "
                f"{self.vae_scale_factor}) cannot be used: {error}; resize it",
            ) from None

    def check_fits(self, height: int, width: int, images: int, guidance_scale: Any) -> None:
        """On the CPU, where running out of memory ends the process, a call whose largest stage cannot fit the host's
        available memory is refused before any work, naming the largest size that fits (:mod:`.memory`: the
        denoiser's attention and the VAE decoder, with a row per image and classifier-free guidance's second)."""
        record = self.family
        rows = images * record.rows_per_image(guidance_scale)
        denoiser = getattr(self, record.denoiser, None)
        decoder = getattr(self, "vae_decoder", None)
        memory = CallMemory(
            decoder=getattr(decoder, "config", None) or {},
            denoiser=getattr(denoiser, "config", None) or {},
            component=record.denoiser,
            vae_scale_factor=self.vae_scale_factor,
            element_bytes=4,
            attention=True,
        )
        check_image_fits(memory, width, height, "CPUExecutionProvider", images, rows, self.size_multiple)

    def check_size(self, height: Any, width: Any) -> None:
        """Height and width must be positive integers the denoiser can run: multiples of :attr:`size_multiple`
        (diffusers rounds others down with a warning; here they are refused, so that the image has the size asked
        for)."""
        multiple = self.size_multiple
        for name, value in (("height", height), ("width", width)):
            if not is_integer(value) or value <= 0:
                raise ArgumentError(name, f"expected a positive integer multiple of {multiple}, got {value!r}")
        if height % multiple != 0 or width % multiple != 0:
            raise ArgumentError(
                "height and width",
                f"expected multiples of {multiple} (the VAE's scale factor "
                f"{self.vae_scale_factor} × {self.denoiser.size_multiple_reason}), got {height} and {width}; e.g. "
                f"{-(-height // multiple) * multiple} × {-(-width // multiple) * multiple}",
            )

    @staticmethod
    def batch_size_of(prompt: Union[str, List[str], None], prompt_embeds: Optional[torch.Tensor]) -> int:
        """How many prompts a call has: one string, a list, or the rows of ``prompt_embeds``."""
        if prompt is not None:
            if not isinstance(prompt, (str, list)):
                raise ArgumentTypeError(
                    "prompt", f"expected a str or a list of str, got {type(prompt).__name__} {prompt!r:.80}"
                )
            return 1 if isinstance(prompt, str) else len(prompt)
        return prompt_embeds.shape[0]
