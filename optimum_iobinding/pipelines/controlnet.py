"""ControlNet: diffusers' ``StableDiffusionControlNetPipeline`` and its img2img, with the ControlNets and the UNet
on ONNX Runtime and the loop on the device; and what every ControlNet family shares (:class:`ControlNets`: SD's,
SDXL's in :mod:`.controlnet_xl`, FLUX.1's in :mod:`.flux_controlnet`) and what the UNet ones share
(:class:`UNetControlNets`).

The folder (``export_pipeline(..., controlnet=...)`` or ``optimum-iobinding export MODEL --controlnet ID``) holds
``controlnet`` (``controlnet_1`` … for multi-ControlNet) beside a denoiser exported to take their outputs. Each
ControlNet takes ``conditioning_scale`` as an input (a UNet's: one factor per residual), so the conditioning scale,
guess mode's ramp and the guidance window are input values, not graphs: a captured CUDA graph serves every call of
its shape. Steps where every ControlNet is outside its guidance window skip the ControlNets (their outputs would be
zero).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Callable, ClassVar, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from diffusers.image_processor import VaeImageProcessor

from ..errors import ArgumentError, ArgumentTypeError, ModelFileError
from ..families import family
from ..layout import (
    CONTROLNET_CONDITION,
    CONTROLNET_SCALE,
    DOWN_RESIDUAL_INPUT,
    MID_RESIDUAL_INPUT,
    controlnet_component_names,
)
from ..runtime.model import IOBindingORTModel
from ..runtime.shapes import infer_output_shapes
from .arguments import Embeds, Generator, Latents, Prompt, StepCallback, StepEndCallback, TensorNames, is_real
from .clip_unet import STABLE_DIFFUSION_COMPONENTS, ClipUNetPipeline
from .components import Component, declared_dim, names_of, onnx
from .core import on_device_stream
from .denoisers import UNetDenoiser, timestep_inputs
from .img2img import ImageInput
from .loop import Guidance, denoise
from .transfer import upload

CONTROLNET, CONTROLNET_IMG2IMG = family("controlnet"), family("controlnet-img2img")
_EXTRA_CONTROLNET = re.compile(r"controlnet_([1-9][0-9]*)")


class ControlSums:
    """The ControlNets' outputs of a step as the denoiser takes them, in buffers made once per shape: several
    ControlNets' outputs summed in place, cast to the denoiser's dtype, and where the denoiser's batch is twice the
    ControlNets' (classifier-free guidance) written into the half ``rows`` names, the other half a copy (``"same"``:
    FLUX.1's true CFG, whose negative prompt takes the same samples) or zeros (``"zeros"``: guess mode). One
    ControlNet whose outputs the denoiser takes as they are is passed through: no copy at all.

    Args:
        dtypes: the denoiser's dtype of each output, in order.
        other_half: ``None`` (the batches match), ``"same"`` or ``"zeros"``.
    """

    def __init__(self, dtypes: Sequence[torch.dtype], other_half: Optional[str] = None):
        self.dtypes = list(dtypes)
        self.other_half = other_half
        self._buffers: Dict[Tuple, List[torch.Tensor]] = {}

    def __call__(self, runs: Iterator[Sequence[torch.Tensor]], count: int) -> List[torch.Tensor]:
        """The denoiser's inputs from ``count`` ControlNet runs (at least one), each made when ``runs`` yields it: a
        run's outputs are taken in before the next run, which may be the same ControlNet's (whose output buffers it
        then overwrites: one union ControlNet run once per condition)."""
        first = next(runs)
        if count == 1 and self.other_half is None and all(o.dtype == d for o, d in zip(first, self.dtypes)):
            return list(first)
        buffers = self._buffers_for(first)
        targets = [
            buffer[buffer.shape[0] - o.shape[0] :] if self.other_half else buffer for buffer, o in zip(buffers, first)
        ]
        for target, output in zip(targets, first):
            target.copy_(output)
        for more in runs:
            for target, output in zip(targets, more):
                target.add_(output)
        if self.other_half == "same":
            for buffer, target in zip(buffers, targets):
                buffer[: target.shape[0]].copy_(target)
        return buffers

    def _buffers_for(self, first: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        key = tuple(tuple(o.shape) for o in first)
        buffers = self._buffers.get(key)
        if buffers is None:
            rows = 2 if self.other_half else 1
            with torch.inference_mode(False):  # written in place by later steps, in or out of inference mode
                buffers = [
                    torch.zeros((o.shape[0] * rows, *o.shape[1:]), dtype=dtype, device=o.device)
                    for o, dtype in zip(first, self.dtypes)
                ]
            self._buffers[key] = buffers
        return buffers


class ControlNetUNet(UNetDenoiser):
    """A UNet exported with its ControlNets: beside its family's inputs (Stable Diffusion's three, SDXL's
    ``text_embeds`` and ``time_ids`` too) it takes the residuals the ControlNets give, one input per output, in the
    same order (:attr:`residual_inputs`)."""

    @property
    def residual_inputs(self) -> List[str]:
        outputs = self.pipe.controlnets[0].output_names
        return [f"{DOWN_RESIDUAL_INPUT}{i}" for i in range(len(outputs) - 1)] + [MID_RESIDUAL_INPUT]

    def check_model(self) -> None:
        expected = self.residual_inputs
        declared = self.model.input_names
        missing = [name for name in expected if name not in declared]
        if missing:
            raise ArgumentError(
                "unet",
                f"a ControlNet pipeline needs the UNet exported with its ControlNet (inputs "
                f"{expected[0]} … {expected[-1]}); this folder's UNet takes {declared}, so it is not "
                "the UNet of this ControlNet. Export the pipeline with optimum-iobinding export MODEL "
                "--controlnet ID (or export_pipeline(..., controlnet=...))",
            )
        family_inputs = list(self.pipe.family.interface.inputs)
        optional = self.pipe.family.interface.optional_prefixed or ("\0",)  # IP-Adapter's image-prompt inputs
        unexpected = [
            name for name in declared if name not in [*family_inputs, *expected] and not name.startswith(optional)
        ]
        if unexpected:
            raise ArgumentError(
                "unet",
                f"expected inputs {family_inputs} and {expected}, got {declared} (a UNet of another family: "
                f"{type(self.pipe).__name__} runs {self.pipe.family.title})",
            )
        conditioning = [name for name in family_inputs if name not in ("sample", "encoder_hidden_states")]
        self.pipe.check_controlnet_inputs(
            ["sample", "encoder_hidden_states", CONTROLNET_CONDITION, CONTROLNET_SCALE, *conditioning]
        )
        for k, net in enumerate(self.pipe.controlnets):
            if len(net.output_names) != len(expected):
                raise ModelFileError(
                    controlnet_component_names(k + 1)[-1],
                    f"gives {len(net.output_names)} residuals, the UNet takes {len(expected)}: a ControlNet of "
                    "another architecture",
                )


class ControlNets:
    """What every ControlNet family declares beside its own components (:attr:`base_components`): ``controlnet``
    (``controlnet_1`` … for multi-ControlNet), found in its folder and loaded with the first one's options; the
    per-ControlNet arguments (conditioning scale, guidance window) and the steps each ControlNet runs at. A family
    is a subclass of it and of its own pipeline declaration."""

    base_components: ClassVar[Tuple[Component, ...]] = ()
    numbered_components = ("controlnet",)

    def __init__(self, **components: Any):
        controlnet = components.get("controlnet")
        if controlnet is None:
            raise ArgumentError(
                "controlnet",
                "this pipeline needs a ControlNet; the folder has no controlnet/model.onnx "
                "(export one with optimum-iobinding export MODEL --controlnet ID)",
            )
        more = {name: value for name, value in components.items() if name.startswith("controlnet_")}
        wrong = sorted(name for name in more if not _EXTRA_CONTROLNET.fullmatch(name))
        if wrong:
            raise ArgumentTypeError(", ".join(wrong), f"unexpected arguments of {type(self).__name__}")
        names = controlnet_component_names(len(more) + 1)
        if sorted(more) != sorted(names[1:]):
            raise ArgumentError("controlnet_1 …", f"expected {list(names[1:])}, got {sorted(more)}")
        # this pipeline's ControlNets, in order, are components of their own
        self.declared_components = self.base_components + tuple(onnx(name) for name in names)
        self.controlnets: List[IOBindingORTModel] = [components[name] for name in names]
        super().__init__(**components)

    @classmethod
    def download_names(cls) -> Sequence[str]:
        return (*names_of(cls.base_components, "onnx"), "controlnet*")

    @classmethod
    def onnx_names_in(cls, folder: Path) -> Tuple[str, ...]:
        numbers = sorted(
            int(match.group(1))
            for entry in Path(folder).iterdir()
            if (match := _EXTRA_CONTROLNET.fullmatch(entry.name)) and (entry / "model.onnx").is_file()
        )
        if numbers != list(range(1, len(numbers) + 1)):
            raise ArgumentError(
                "pretrained_model_name_or_path",
                f"expected ControlNet folders controlnet, controlnet_1, "
                f"controlnet_2 … without gaps, got controlnet_{numbers} in {str(folder)!r}",
            )
        return (*names_of(cls.base_components, "onnx"), *controlnet_component_names(len(numbers) + 1))

    def check_controlnet_inputs(self, required: Sequence[str], optional: Sequence[str] = ()) -> None:
        """Refuses, when loading, a ControlNet that does not take the ``required`` inputs (and no others than the
        ``optional`` ones): one of another family, naming its folder."""
        for name, net in zip(controlnet_component_names(len(self.controlnets)), self.controlnets):
            declared = net.input_names
            if set(required) <= set(declared) and set(declared) <= {*required, *optional}:
                continue
            extra = f" (and {list(optional)} where it has them)" if optional else ""
            raise ArgumentError(
                name,
                f"expected a ControlNet of {self.family.title} taking {list(required)}{extra}, got one taking "
                f"{declared} in {net.model_path!r}: a ControlNet of another family",
            )

    # ---------------------------------------------------------------------------------------------- arguments
    def _per_net(
        self, value: Any, name: str, check: Callable[[Any], bool], expected: str, count: Optional[int] = None
    ) -> List[Any]:
        """A per-ControlNet argument as a list of one value per ControlNet (one value is every net's); ``count``: how
        many ControlNet runs a call has, where it is not one per ControlNet (one union ControlNet per condition)."""
        count = len(self.controlnets) if count is None else count
        values = list(value) if isinstance(value, (list, tuple)) else [value] * count
        if len(values) != count:
            raise ArgumentError(name, f"expected {count} values (one per ControlNet), got {len(values)}")
        if not values or not all(check(v) for v in values):
            raise ArgumentError(name, f"expected {expected}, got {value!r}")
        return values

    def check_control_arguments(
        self, conditioning_scale: Any, guidance_start: Any, guidance_end: Any, count: Optional[int] = None
    ) -> Tuple[List[float], List[float], List[float]]:
        real = lambda v: is_real(v) and math.isfinite(v)  # noqa: E731
        unit = lambda v: real(v) and 0 <= v <= 1  # noqa: E731
        scales = self._per_net(conditioning_scale, "controlnet_conditioning_scale", real, "finite numbers", count)
        starts = self._per_net(guidance_start, "control_guidance_start", unit, "numbers in [0, 1]", count)
        ends = self._per_net(guidance_end, "control_guidance_end", unit, "numbers in [0, 1]", count)
        for k, (start, end) in enumerate(zip(starts, ends)):
            if start >= end:
                raise ArgumentError(
                    "control_guidance_start",
                    f"expected each start below its end, got start {start} and end {end} for ControlNet {k}",
                )
        return [float(s) for s in scales], [float(s) for s in starts], [float(e) for e in ends]

    def _control_images(self, image: Any, name: str, count: Optional[int] = None) -> List[Any]:
        """One control image (or list of images, one per prompt) per ControlNet (per run: ``count``)."""
        count = len(self.controlnets) if count is None else count
        if image is None:
            raise ArgumentError(name, "expected a control image (PIL, numpy or a float tensor), got None")
        if count == 1:
            return [image]
        if not isinstance(image, (list, tuple)) or len(image) != count:
            raise ArgumentError(
                name,
                f"expected a list of {count} control images (one per ControlNet, or per condition of a union one), "
                f"got {type(image).__name__}{f' of {len(image)}' if isinstance(image, (list, tuple)) else ''}",
            )
        return list(image)

    @staticmethod
    def control_keep(steps: int, starts: List[float], ends: List[float]) -> List[List[float]]:
        """diffusers' ``controlnet_keep``: for each step and ControlNet, 1 inside its guidance window, else 0."""
        return [[1.0 - float(i / steps < s or (i + 1) / steps > e) for s, e in zip(starts, ends)] for i in range(steps)]

    def scale_table(self, net: IOBindingORTModel, factors: List[torch.Tensor]) -> torch.Tensor:
        """``net``'s ``conditioning_scale`` input for every step (row ``i``: step ``i``'s), in its dtype, on the
        device once per call."""
        table = torch.stack(factors).to(net.input_dtypes[CONTROLNET_SCALE])
        return upload(table, self.device) if self.device.type == "cuda" else table


class UNetControlNets(ControlNets):
    """What the UNet ControlNet families (Stable Diffusion's, SDXL's) share: their control images (diffusers'
    preprocessing, doubled for guidance), guess mode, and the UNet's residual inputs made each step."""

    def blank_control_images(self, height: int, width: int) -> Any:
        """A blank control image of this size for each ControlNet (a warm-up's)."""
        image = torch.zeros(1, 3, height, width)
        return image if len(self.controlnets) == 1 else [image] * len(self.controlnets)

    @property
    def control_image_processor(self) -> VaeImageProcessor:
        """diffusers' control-image preprocessing: RGB, resized to a multiple of the VAE factor, in [0, 1]."""
        return VaeImageProcessor(vae_scale_factor=self.vae_scale_factor, do_convert_rgb=True, do_normalize=False)

    def _check_channels(self, image: Any, name: str, channels: int) -> None:
        """A control image must have the ControlNet's channels (RGB): PIL images are converted, arrays checked."""
        items = image if isinstance(image, (list, tuple)) else [image]
        for index, item in enumerate(items):
            label = f"{name}[{index}]" if isinstance(image, (list, tuple)) else name
            if isinstance(item, torch.Tensor):
                got = item.shape[-3] if item.ndim >= 3 else None
                layout = "(batch, channels, height, width) or (channels, height, width)"
            elif isinstance(item, np.ndarray):
                got = item.shape[-1] if item.ndim >= 3 else (1 if item.ndim == 2 else None)
                layout = "(height, width, channels) or (batch, height, width, channels)"
            else:
                continue  # PIL: converted to RGB by the image processor
            if got != channels or item.ndim > 4:
                raise ArgumentError(
                    label,
                    f"expected a control image with {channels} channels in the layout {layout}, "
                    f"got shape {tuple(item.shape)}",
                )
            if isinstance(item, torch.Tensor) and not item.dtype.is_floating_point:
                raise ArgumentTypeError(label, f"expected a float tensor in [0, 1], got dtype {item.dtype}")

    def prepare_control_image(
        self,
        image: Any,
        name: str,
        height: Optional[int],
        width: Optional[int],
        batch_size: int,
        num_images_per_prompt: int,
        do_classifier_free_guidance: bool,
        guess_mode: bool,
        net: IOBindingORTModel,
    ) -> torch.Tensor:
        """diffusers' ``prepare_image``: preprocessed to ``height`` × ``width`` (default: its own size, rounded down
        to the VAE factor), one per image of the call, doubled for guidance unless in guess mode; on the device in
        the ControlNet's input dtype."""
        channels = declared_dim(net, CONTROLNET_CONDITION, 1) or 3
        self._check_channels(image, name, channels)
        self.check_image(image, name, resized=height is not None and width is not None, mask=channels == 1, channels=())
        try:
            tensor = self.control_image_processor.preprocess(image, height=height, width=width).to(torch.float32)
        except (ValueError, TypeError) as error:
            raise ArgumentError(name, f"{error}") from error
        try:
            self.check_size(*tensor.shape[-2:])
        except ValueError as error:
            raise ArgumentError(
                name,
                f"a control image of {tensor.shape[-2]} × {tensor.shape[-1]} (after rounding "
                f"down to the VAE factor {self.vae_scale_factor}) cannot be used: {error}; resize it or "
                "give height and width",
            ) from None
        images = batch_size * num_images_per_prompt
        if tensor.shape[0] not in (1, batch_size):
            raise ArgumentError(
                name, f"expected 1 control image or {batch_size} (one per prompt), got {tensor.shape[0]}"
            )
        tensor = tensor.repeat_interleave(images if tensor.shape[0] == 1 else num_images_per_prompt, dim=0)
        tensor = tensor.to(device=self.device, dtype=net.input_dtypes[CONTROLNET_CONDITION])
        if do_classifier_free_guidance and not guess_mode:
            tensor = torch.cat([tensor] * 2)
        return tensor

    def prepare_control_images(
        self,
        image: Any,
        name: str,
        height: Optional[int],
        width: Optional[int],
        batch_size: int,
        num_images_per_prompt: int,
        do_classifier_free_guidance: bool,
        guess_mode: bool,
    ) -> List[torch.Tensor]:
        """Every ControlNet's control images; all of one size (the first image's, where no size is given)."""
        given = self._control_images(image, name)
        prepared = []
        for k, (item, net) in enumerate(zip(given, self.controlnets)):
            label = name if len(given) == 1 else f"{name}[{k}]"
            prepared.append(
                self.prepare_control_image(
                    item,
                    label,
                    height,
                    width,
                    batch_size,
                    num_images_per_prompt,
                    do_classifier_free_guidance,
                    guess_mode,
                    net,
                )
            )
            if k and tuple(prepared[k].shape[-2:]) != tuple(prepared[0].shape[-2:]):
                raise ArgumentError(
                    label,
                    f"expected a control image of {prepared[0].shape[-2]} × "
                    f"{prepared[0].shape[-1]} like {name}[0] (or give height and width), got "
                    f"{prepared[k].shape[-2]} × {prepared[k].shape[-1]}",
                )
        return prepared

    # -------------------------------------------------------------------------------------------- the residuals
    def controlnet_step_inputs(
        self,
        images: List[torch.Tensor],
        timesteps: torch.Tensor,
        scales: List[float],
        starts: List[float],
        ends: List[float],
        guess_mode: bool,
        do_classifier_free_guidance: bool,
        conditioning: Optional[Dict[str, torch.Tensor]] = None,
    ) -> Callable[[int, torch.Tensor, torch.Tensor], Dict[str, torch.Tensor]]:
        """The UNet's residual inputs for step ``i``, as diffusers computes them: each ControlNet on the scaled
        model input (in guess mode with guidance: the text half only, the other half zeros), scaled by its
        conditioning scale while step ``i`` is inside its guidance window, and summed over the ControlNets. The
        per-step factors go to the device once per call. ``conditioning``: the ControlNets' further inputs, the
        same every step and batched as the UNet's (SDXL's ``text_embeds`` and ``time_ids``)."""
        steps = len(timesteps)
        residual_inputs = self.denoiser.residual_inputs
        residuals = len(residual_inputs)
        pool = bool(self.controlnets[0].config.get("global_pool_conditions", False))
        ramp = torch.logspace(-1, 0, residuals) if guess_mode and not pool else torch.ones(residuals)
        keep = self.control_keep(steps, starts, ends)
        factors, timestep_rows = [], []
        half = guess_mode and do_classifier_free_guidance
        control_batch = images[0].shape[0]  # prepared for the ControlNets' batch (doubled for guidance or not)
        for k, net in enumerate(self.controlnets):
            factors.append(self.scale_table(net, [ramp * (scales[k] * keep[i][k]) for i in range(steps)]))
            timestep_rows.append(timestep_inputs(net, timesteps, control_batch, self.device))
        runs = [[scales[k] * keep[i][k] != 0.0 for k in range(len(self.controlnets))] for i in range(steps)]
        conditioning = dict(conditioning or {})
        control_conditioning = (
            {name: value.chunk(2)[1] for name, value in conditioning.items()} if half else conditioning
        )
        zeros: Dict[Tuple, List[torch.Tensor]] = {}
        # guess mode: the ControlNets see the text's half, the negative prompt's half of the UNet takes no residual
        sums = ControlSums([self.unet.input_dtypes[name] for name in residual_inputs], "zeros" if half else None)

        def zero_residuals(sample: torch.Tensor, embeds: torch.Tensor) -> List[torch.Tensor]:
            key = (tuple(sample.shape), tuple(embeds.shape))
            if key not in zeros:
                shapes = self._residual_shapes(
                    tuple(sample.shape), tuple(embeds.shape), tuple(images[0].shape), conditioning
                )
                zeros[key] = [
                    torch.zeros(shape, device=self.device, dtype=self.unet.input_dtypes[name])
                    for name, shape in zip(residual_inputs, shapes)
                ]
            return zeros[key]

        def step_inputs(
            i: int, latent_model_input: torch.Tensor, prompt_embeds: torch.Tensor
        ) -> Dict[str, torch.Tensor]:
            control_input, embeds = latent_model_input, prompt_embeds
            if half:
                control_input, embeds = latent_model_input.chunk(2)[1], prompt_embeds.chunk(2)[1]
            active = [k for k in range(len(self.controlnets)) if runs[i][k]]  # outside its window: zeros
            if not active:
                return dict(zip(residual_inputs, zero_residuals(latent_model_input, prompt_embeds)))
            outputs = (  # each run's outputs are taken in before the next runs
                self.controlnets[k](
                    sample=control_input,
                    timestep=timestep_rows[k][i],
                    encoder_hidden_states=embeds,
                    **{CONTROLNET_CONDITION: images[k], CONTROLNET_SCALE: factors[k][i]},
                    **control_conditioning,
                )
                for k in active
            )
            return dict(zip(residual_inputs, sums(outputs, len(active))))

        return step_inputs

    def _residual_shapes(
        self,
        sample_shape: Tuple[int, ...],
        embeds_shape: Tuple[int, ...],
        image_shape: Tuple[int, ...],
        conditioning: Dict[str, torch.Tensor],
    ) -> List[Tuple[int, ...]]:
        """The residuals' shapes for the UNet's ``sample`` and ``encoder_hidden_states`` of these shapes, from the
        ControlNet's graph (as if it ran on the UNet's whole batch, with its ``conditioning`` inputs)."""
        net = self.controlnets[0]
        batch = sample_shape[0]
        shapes = infer_output_shapes(
            net,
            {
                "sample": sample_shape,
                "timestep": (batch,) if net.input_dims.get("timestep") else (),
                "encoder_hidden_states": embeds_shape,
                CONTROLNET_CONDITION: (batch, *image_shape[1:]),
                CONTROLNET_SCALE: (len(self.denoiser.residual_inputs),),
                **{name: (batch, *value.shape[1:]) for name, value in conditioning.items()},
            },
        )
        result = list(shapes.values())
        if any(shape is None for shape in result):
            raise ArgumentError(
                "controlnet",
                "expected residual outputs whose height and width the file declares in terms of the sample's (so "
                "that zero residuals can be made before anything runs), got dims that only running it would tell: "
                "export the folder again",
            )
        return result

    def _controlnet_guess_mode(self, guess_mode: bool) -> bool:
        if not isinstance(guess_mode, (bool, np.bool_)):
            raise ArgumentTypeError("guess_mode", f"expected True or False, got {guess_mode!r}")
        return bool(guess_mode) or bool(self.controlnets[0].config.get("global_pool_conditions", False))


class ControlNetPipeline(UNetControlNets, ClipUNetPipeline):
    """The declaration the Stable Diffusion ControlNet families share: Stable Diffusion's components and
    ``controlnet`` (``controlnet_1`` … for multi-ControlNet), the UNet that takes their residuals."""

    base_components = STABLE_DIFFUSION_COMPONENTS
    declared_components = STABLE_DIFFUSION_COMPONENTS + (onnx("controlnet"),)
    denoiser_part = ControlNetUNet


class OnnxStableDiffusionControlNetPipeline(ControlNetPipeline):
    """Text-to-image with one or several ControlNets on ONNX Runtime, with diffusers'
    ``StableDiffusionControlNetPipeline`` call arguments (``image``, ``controlnet_conditioning_scale``,
    ``guess_mode``, ``control_guidance_start``/``control_guidance_end``; lists for multi-ControlNet)."""

    family = CONTROLNET

    def warmup_images(self, height: int, width: int) -> Dict[str, Any]:
        return {"image": self.blank_control_images(height, width)}

    @on_device_stream
    def __call__(
        self,
        prompt: Prompt = None,
        image: ImageInput = None,
        height: Optional[int] = None,
        width: Optional[int] = None,
        num_inference_steps: int = CONTROLNET.defaults.steps,
        guidance_scale: float = CONTROLNET.defaults.guidance_scale,
        negative_prompt: Prompt = None,
        num_images_per_prompt: int = 1,
        eta: float = 0.0,
        generator: Generator = None,
        latents: Latents = None,
        prompt_embeds: Embeds = None,
        negative_prompt_embeds: Embeds = None,
        output_type: str = "pil",
        return_dict: bool = True,
        controlnet_conditioning_scale: Union[float, List[float]] = 1.0,
        guess_mode: bool = False,
        control_guidance_start: Union[float, List[float]] = 0.0,
        control_guidance_end: Union[float, List[float]] = 1.0,
        callback: StepCallback = None,
        callback_steps: int = 1,
        callback_on_step_end: StepEndCallback = None,
        callback_on_step_end_tensor_inputs: TensorNames = ("latents",),
        ip_adapter_image: Any = None,
        ip_adapter_image_embeds: Any = None,
    ):
        """Generates images from text guided by control images, with the arguments of diffusers'
        ``StableDiffusionControlNetPipeline``.

        ``image``: the control image — PIL, numpy (H, W, 3) in [0, 1], a float tensor (B, 3, H, W) in [0, 1], or a
        list of them (one per prompt); for multi-ControlNet a list with one such entry per ControlNet. ``height`` and
        ``width`` default to the control image's size. ``controlnet_conditioning_scale`` multiplies the residuals (0:
        the plain pipeline's image); ``guess_mode`` runs the ControlNet on the text branch only, its residuals ramped
        from 0.1 to 1 (diffusers' guess mode); ``control_guidance_start``/``_end`` is the fraction of the steps
        where a ControlNet applies. Per-ControlNet lists for multi-ControlNet. The rest as the Stable Diffusion
        pipeline's.
        """
        # 1. check inputs (the size once the control images give it)
        self.check_image_prompt(ip_adapter_image, ip_adapter_image_embeds)
        scales, starts, ends = self.check_control_arguments(
            controlnet_conditioning_scale, control_guidance_start, control_guidance_end
        )
        guess_mode = self._controlnet_guess_mode(guess_mode)
        for value in (height, width):
            if value is not None:
                self.check_size(height or value, width or value)
        self.check_inputs(
            prompt=prompt,
            negative_prompt=negative_prompt,
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            height=self.size_multiple,
            width=self.size_multiple,
            num_inference_steps=num_inference_steps,
            output_type=output_type,
            callback_steps=callback_steps,
            guidance_scale=guidance_scale,
            num_images_per_prompt=num_images_per_prompt,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
            generator=generator,
            callback=callback,
        )
        batch_size = self.batch_size_of(prompt, prompt_embeds)
        do_classifier_free_guidance = guidance_scale > 1.0
        images = self.prepare_control_images(
            image, "image", height, width, batch_size, num_images_per_prompt, do_classifier_free_guidance, guess_mode
        )
        height, width = images[0].shape[-2:]

        # 2. text embeddings, on the device
        prompt_embeds = self.encode_prompt(
            prompt,
            num_images_per_prompt,
            do_classifier_free_guidance,
            negative_prompt,
            prompt_embeds,
            negative_prompt_embeds,
        )

        # 3. timesteps and initial noise
        timesteps = self.set_timesteps(num_inference_steps)
        latents = self.initial_noise(
            batch_size * num_images_per_prompt, height, width, prompt_embeds.dtype, generator, latents
        )

        # 4. denoising loop, the ControlNets' residuals made each step: every tensor stays on self.device
        residuals = self.controlnet_step_inputs(
            images, timesteps, scales, starts, ends, guess_mode, do_classifier_free_guidance
        )
        latents = denoise(
            self.denoiser,
            latents,
            timesteps,
            tensors={"prompt_embeds": prompt_embeds},
            inputs=self.image_prompt_inputs(
                ip_adapter_image,
                ip_adapter_image_embeds,
                batch_size * num_images_per_prompt,
                do_classifier_free_guidance,
            ),
            guidance=Guidance.classifier_free(guidance_scale),
            step_kwargs=self.scheduler_step_kwargs(generator, eta),
            callback=callback,
            callback_steps=callback_steps,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
            step_inputs=residuals,
        )

        # 5. decode: only now does anything leave the device
        return self.finish(latents, output_type, return_dict)


class OnnxStableDiffusionControlNetImg2ImgPipeline(ControlNetPipeline):
    """Image-to-image with ControlNets on ONNX Runtime, with diffusers' ``StableDiffusionControlNetImg2ImgPipeline``
    call arguments (``image`` to start from, ``control_image``, ``strength``, …); needs the folder's
    ``vae_encoder``."""

    family = CONTROLNET_IMG2IMG

    encodes_images = True

    def warmup_images(self, height: int, width: int) -> Dict[str, Any]:
        return {
            "image": torch.zeros(1, 3, height, width),
            "control_image": self.blank_control_images(height, width),
            "strength": 1.0,
        }

    @on_device_stream
    def __call__(
        self,
        prompt: Prompt = None,
        image: ImageInput = None,
        control_image: ImageInput = None,
        height: Optional[int] = None,
        width: Optional[int] = None,
        strength: float = 0.8,
        num_inference_steps: int = CONTROLNET_IMG2IMG.defaults.steps,
        guidance_scale: float = CONTROLNET_IMG2IMG.defaults.guidance_scale,
        negative_prompt: Prompt = None,
        num_images_per_prompt: int = 1,
        eta: float = 0.0,
        generator: Generator = None,
        prompt_embeds: Embeds = None,
        negative_prompt_embeds: Embeds = None,
        output_type: str = "pil",
        return_dict: bool = True,
        controlnet_conditioning_scale: Union[float, List[float]] = 0.8,
        guess_mode: bool = False,
        control_guidance_start: Union[float, List[float]] = 0.0,
        control_guidance_end: Union[float, List[float]] = 1.0,
        callback: StepCallback = None,
        callback_steps: int = 1,
        callback_on_step_end: StepEndCallback = None,
        callback_on_step_end_tensor_inputs: TensorNames = ("latents",),
        ip_adapter_image: Any = None,
        ip_adapter_image_embeds: Any = None,
    ):
        """Transforms ``image`` as ``prompt`` says, guided by ``control_image``, with the arguments of diffusers'
        ``StableDiffusionControlNetImg2ImgPipeline`` (``controlnet_conditioning_scale`` defaults to 0.8 there too).
        ``image`` is resized to ``height`` × ``width`` where given, else kept at its size (rounded down to the VAE
        factor); the control image is brought to the same size."""
        # 1. check inputs
        self.check_image_prompt(ip_adapter_image, ip_adapter_image_embeds)
        scales, starts, ends = self.check_control_arguments(
            controlnet_conditioning_scale, control_guidance_start, control_guidance_end
        )
        guess_mode = self._controlnet_guess_mode(guess_mode)
        if height is not None or width is not None:
            self.check_size(height or width, width or height)
        start_image = self.start_image(image, height, width)
        height, width = start_image.shape[-2:]
        self.check_inputs(
            prompt=prompt,
            negative_prompt=negative_prompt,
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            height=height,
            width=width,
            num_inference_steps=num_inference_steps,
            output_type=output_type,
            strength=strength,
            callback_steps=callback_steps,
            guidance_scale=guidance_scale,
            num_images_per_prompt=num_images_per_prompt,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
            generator=generator,
            callback=callback,
        )
        batch_size = self.batch_size_of(prompt, prompt_embeds)
        do_classifier_free_guidance = guidance_scale > 1.0
        images = self.prepare_control_images(
            control_image,
            "control_image",
            height,
            width,
            batch_size,
            num_images_per_prompt,
            do_classifier_free_guidance,
            guess_mode,
        )

        # 2. text embeddings, on the device
        prompt_embeds = self.encode_prompt(
            prompt,
            num_images_per_prompt,
            do_classifier_free_guidance,
            negative_prompt,
            prompt_embeds,
            negative_prompt_embeds,
        )

        # 3. timesteps for this strength; the image's latents noised to the first of them
        timesteps = self.strength_timesteps(num_inference_steps, strength)
        latents = self.noised_image_latents(
            start_image, timesteps, generator, batch_size, num_images_per_prompt, prompt_embeds.dtype
        )

        # 4. denoising loop, the ControlNets' residuals made each step: every tensor stays on self.device
        residuals = self.controlnet_step_inputs(
            images, timesteps, scales, starts, ends, guess_mode, do_classifier_free_guidance
        )
        latents = denoise(
            self.denoiser,
            latents,
            timesteps,
            tensors={"prompt_embeds": prompt_embeds},
            inputs=self.image_prompt_inputs(
                ip_adapter_image,
                ip_adapter_image_embeds,
                batch_size * num_images_per_prompt,
                do_classifier_free_guidance,
            ),
            guidance=Guidance.classifier_free(guidance_scale),
            step_kwargs=self.scheduler_step_kwargs(generator, eta),
            callback=callback,
            callback_steps=callback_steps,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
            step_inputs=residuals,
        )

        # 5. decode: only now does anything leave the device
        return self.finish(latents, output_type, return_dict)
