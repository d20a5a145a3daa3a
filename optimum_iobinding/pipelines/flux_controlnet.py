"""FLUX.1 with ControlNets on ONNX Runtime, the loop on the device: diffusers' ``FluxControlNetPipeline``.

The folder (``optimum-iobinding export FLUX --controlnet ID``, or the export of a torch ``FluxControlNetPipeline``)
is optimum's Flux layout with ``controlnet`` (``controlnet_1`` … for multi-ControlNet) beside a transformer exported
to take their block samples (:data:`~optimum_iobinding.layout.FLUX_CONTROLNET_BLOCK_SAMPLE` …). At every step each
ControlNet runs on the latents, the prompt and its control image's latents (an XLabs ControlNet: its pixels), its
samples scaled by its conditioning scale inside its guidance window and summed over the ControlNets; the transformer
takes them beside its own inputs (both halves of true CFG's batch the same samples, as diffusers feeds both of its
calls). The scale and the window are input values: one captured graph of each model serves every call of a shape."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from ..errors import ArgumentError, ArgumentTypeError, ModelFileError
from ..families import FLUX_GUIDANCE, FLUX_IMAGE_IDS, FLUX_INPUTS, FLUX_TEXT_IDS, MMDIT_INPUTS, family
from ..layout import (
    CONTROLNET_CONDITION,
    CONTROLNET_SCALE,
    FLUX_CONTROLNET_BLOCK_SAMPLE,
    FLUX_CONTROLNET_MODE,
    FLUX_CONTROLNET_SINGLE_BLOCK_SAMPLE,
    controlnet_component_names,
)
from ..runtime.model import IOBindingORTModel
from .arguments import Embeds, Generator, Latents, Prompt, StepEndCallback, TensorNames, is_integer
from .codec import pack_latents
from .components import declared_dim, onnx
from .controlnet import ControlNets, ControlSums
from .core import on_device_stream
from .denoisers import Denoiser, FluxDenoiser
from .flux import FLUX_COMPONENTS, MAX_SEQUENCE_LENGTH, FluxFamilyPipeline
from .img2img import ImageInput
from .loop import Guidance, denoise
from .transfer import upload

FLUX_CONTROLNET = family("flux-controlnet")
_SAMPLE_PREFIXES = (FLUX_CONTROLNET_BLOCK_SAMPLE, FLUX_CONTROLNET_SINGLE_BLOCK_SAMPLE)


def sample_number(name: str) -> Tuple[int, int]:
    """The order of a block-sample input: double-stream blocks first, each kind by its number."""
    kind = next(k for k, prefix in enumerate(_SAMPLE_PREFIXES) if name.startswith(prefix))
    return kind, int(name[len(_SAMPLE_PREFIXES[kind]) :])


# the MMDiT inputs a FLUX.1 ControlNet takes as the transformer does
HIDDEN_STATES, ENCODER_HIDDEN_STATES, POOLED_PROJECTIONS, TIMESTEP = MMDIT_INPUTS


class FluxControlNetTransformer(FluxDenoiser):
    """FLUX.1's transformer exported to take its ControlNets' block samples (:attr:`sample_inputs`) beside its own
    inputs; no step cache runs it (First-Block Cache's parts take no samples)."""

    @property
    def sample_inputs(self) -> List[str]:
        """The block-sample inputs the transformer takes, in the order the ControlNets give them."""
        names = [name for name in self.model.input_names if name.startswith(_SAMPLE_PREFIXES)]
        return sorted(names, key=sample_number)

    def check_model(self) -> None:
        """The transformer has FLUX.1 ControlNet's interface, and every ControlNet is a FLUX.1 ControlNet giving the
        samples it takes, by name and in order."""
        super().check_model()
        pipe = self.pipe
        pipe.check_controlnet_inputs(
            [*FLUX_INPUTS, CONTROLNET_CONDITION, CONTROLNET_SCALE], (FLUX_GUIDANCE, FLUX_CONTROLNET_MODE)
        )
        expected = self.sample_inputs
        for name, net in zip(controlnet_component_names(len(pipe.controlnets)), pipe.controlnets):
            if list(net.output_names) != expected:
                raise ModelFileError(
                    name,
                    f"gives {net.output_names}, the transformer takes {expected}: a ControlNet of another "
                    "architecture, or a transformer exported for other ControlNets",
                )

    def make_cache(self, config: Any) -> Any:
        """Refused: no step cache runs a transformer that takes ControlNets' samples (see
        :meth:`Denoiser.make_cache`)."""
        return Denoiser.make_cache(self, config)


class OnnxFluxControlNetPipeline(ControlNets, FluxFamilyPipeline):
    """FLUX.1 guided by one or several ControlNets on ONNX Runtime, with the arguments of diffusers'
    ``FluxControlNetPipeline`` (``control_image``, ``controlnet_conditioning_scale``,
    ``control_guidance_start``/``control_guidance_end``: lists for multi-ControlNet; ``control_mode`` for a union
    ControlNet; true CFG) and its output, ``FluxPipelineOutput``."""

    family = FLUX_CONTROLNET
    base_components = FLUX_COMPONENTS
    declared_components = FLUX_COMPONENTS + (onnx("controlnet"),)
    denoiser_part = FluxControlNetTransformer
    encodes_images = True  # the control images' latents

    def warmup_images(self, height: int, width: int) -> Dict[str, Any]:
        """A blank control image of the size for each ControlNet (a union one's first mode)."""
        image = torch.zeros(1, 3, height, width)
        images = image if len(self.controlnets) == 1 else [image] * len(self.controlnets)
        modes = [0 if self.takes_mode(net) else None for net in self.controlnets]
        mode = modes[0] if len(modes) == 1 else modes
        return {"control_image": images, "height": height, "width": width, "control_mode": mode}

    def write_model_index(self, target: Path, written: List[str]) -> None:
        """FLUX.1's index, with an entry for each ControlNet (as the export writes it)."""
        super().write_model_index(target, written)
        path = target / "model_index.json"
        index = json.loads(path.read_text())
        index.update({name: ["diffusers", "FluxControlNetModel"] for name in written if name.startswith("controlnet")})
        path.write_text(json.dumps(index, indent=2, sort_keys=True))

    # ------------------------------------------------------------------------------------------------- checks
    @staticmethod
    def takes_mode(net: IOBindingORTModel) -> bool:
        """Whether a ControlNet is a union one (it takes a ``controlnet_mode``)."""
        return FLUX_CONTROLNET_MODE in net.input_names

    @staticmethod
    def takes_pixels(net: IOBindingORTModel) -> bool:
        """Whether a ControlNet encodes the control image itself (XLabs': pixels in), or takes its latents."""
        return len(net.input_dims.get(CONTROLNET_CONDITION) or ()) == 4

    def condition_nets(self, control_mode: Any) -> List[IOBindingORTModel]:
        """The ControlNet each condition of a call runs: each ControlNet once, or, for a folder of one union
        ControlNet given a list of modes, that ControlNet once per mode (diffusers' ``FluxMultiControlNetModel`` of
        one union model: one control image, mode and scale per condition, their samples summed)."""
        nets = self.controlnets
        if len(nets) == 1 and self.takes_mode(nets[0]) and isinstance(control_mode, (list, tuple)) and control_mode:
            return nets * len(control_mode)
        return nets

    def check_control_modes(
        self, control_mode: Any, nets: Optional[List[IOBindingORTModel]] = None
    ) -> List[Optional[int]]:
        """Each ControlNet's mode, refused by name before any work: an int (or ``None``), or for multi-ControlNet
        one per ControlNet (one value is every net's); a union ControlNet needs one of its modes, the others ignore
        theirs (as diffusers' do). ``nets``: the call's :meth:`condition_nets` (default: each ControlNet once)."""
        nets = self.controlnets if nets is None else nets
        count = len(nets)
        conditions = len(self.controlnets) == 1 and self.takes_mode(self.controlnets[0])  # a mode per condition
        if isinstance(control_mode, (list, tuple)):
            if count == 1 and not conditions:
                raise ArgumentTypeError(
                    "control_mode", f"expected an int or None for one ControlNet, got {control_mode!r}"
                )
            if len(control_mode) != count:
                raise ArgumentError(
                    "control_mode", f"expected {count} values (one per ControlNet), got {len(control_mode)}"
                )
            modes = list(control_mode)
        else:
            modes = [control_mode] * count
        for k, (mode, net) in enumerate(zip(modes, nets)):
            label = (
                "control_mode" if count == 1 and not isinstance(control_mode, (list, tuple)) else f"control_mode[{k}]"
            )
            if mode is not None and not is_integer(mode):
                raise ArgumentTypeError(label, f"expected an int or None, got {type(mode).__name__} {mode!r}")
            if not self.takes_mode(net):
                continue
            number = net.config.get("num_mode")
            if mode is None or mode < 0 or (is_integer(number) and mode >= number):
                modes_of = f"0 … {number - 1}" if is_integer(number) else "a mode ≥ 0"
                raise ArgumentError(
                    label, f"expected one of the union ControlNet's modes ({modes_of}) for ControlNet {k}, got {mode!r}"
                )
        return [None if mode is None else int(mode) for mode in modes]

    def check_control_images(
        self, control_image: Any, height: int, width: int, prompts: int, count: Optional[int] = None
    ) -> List[Any]:
        """Each ControlNet's control image, refused by name before any work: an image (PIL, numpy, a list: one for
        every prompt or one per prompt), or a tensor of pixels in [-1, 1] of the call's size ``(rows, 3, height,
        width)``, which diffusers takes as it is."""
        given = self._control_images(control_image, "control_image", count)
        for k, image in enumerate(given):
            label = "control_image" if len(given) == 1 else f"control_image[{k}]"
            if not isinstance(image, torch.Tensor):
                self.check_image(image, label, resized=True)
                batched = isinstance(image, np.ndarray) and image.ndim == 4  # (rows, height, width, channels)
                rows = len(image) if isinstance(image, list) or batched else 1
            else:
                if image.ndim != 4 or tuple(image.shape[1:]) != (3, height, width):
                    raise ArgumentError(
                        label,
                        f"expected a tensor of shape (rows, 3, {height}, {width}): pixels in [-1, 1] of the call's "
                        f"size, got {tuple(image.shape)}",
                    )
                if not image.dtype.is_floating_point:
                    raise ArgumentTypeError(label, f"expected a float tensor in [-1, 1], got dtype {image.dtype}")
                rows = image.shape[0]
            if rows not in (1, prompts):
                raise ArgumentError(
                    label,
                    f"expected {'1 image' if prompts == 1 else f'1 or {prompts} images (one for every prompt or one per prompt)'}, "
                    f"got {rows}",
                )
        return given

    # ------------------------------------------------------------------------------------ the control images
    def control_conditions(
        self,
        images: List[Any],
        height: int,
        width: int,
        image_count: int,
        num_images_per_prompt: int,
        generator: Generator,
        nets: Optional[List[IOBindingORTModel]] = None,
    ) -> List[torch.Tensor]:
        """Each ControlNet's ``controlnet_cond`` for every image of the call, as diffusers makes it: one image for
        every prompt or one per prompt (each ``num_images_per_prompt`` times), encoded (sampled with a torch
        generator where the VAE encoder gives a distribution) and packed; pixels for an XLabs ControlNet."""
        conditions = []
        for image, net in zip(images, nets or self.controlnets):
            if isinstance(image, torch.Tensor):
                pixels = image.to(self.device, torch.float32)
            else:
                pixels = self.pixels(image, height, width)
            repeats = image_count if pixels.shape[0] == 1 else num_images_per_prompt
            pixels = pixels.repeat_interleave(repeats, dim=0)
            condition = pixels if self.takes_pixels(net) else pack_latents(self.image_latents(pixels, generator))
            conditions.append(condition.to(net.input_dtypes[CONTROLNET_CONDITION]))
        return conditions

    # ------------------------------------------------------------------------------------------ the samples
    def controlnet_step_inputs(
        self,
        conditions: List[torch.Tensor],
        modes: List[Optional[int]],
        timesteps: torch.Tensor,
        scales: List[float],
        starts: List[float],
        ends: List[float],
        guidance: Guidance,
        constants: Dict[str, torch.Tensor],
        pooled_prompt_embeds: torch.Tensor,
        guidance_scale: float,
        nets: Optional[List[IOBindingORTModel]] = None,
    ) -> Callable[[int, torch.Tensor, torch.Tensor], Dict[str, torch.Tensor]]:
        """The transformer's block-sample inputs for step ``i``, as diffusers computes them: each ControlNet on the
        latents and the prompt (true CFG's positive one), its samples scaled by its conditioning scale while step
        ``i`` is inside its guidance window, summed over the ControlNets, and given to both halves of true CFG's
        batch. ``constants``: the transformer's position ids. What stays the same over the loop (the scales of every
        step, the timesteps, the ids, the pooled prompt, the guidance, the modes) goes to the device once."""
        nets = self.controlnets if nets is None else nets  # one union ControlNet may run once per condition
        steps, rows = len(timesteps), conditions[0].shape[0]
        keep = self.control_keep(steps, starts, ends)
        runs = [[scales[k] * keep[i][k] != 0.0 for k in range(len(nets))] for i in range(steps)]
        sample_inputs = self.denoiser.sample_inputs
        transformer_dtype = self.latent_dtype
        tables, timestep_rows, fixed = [], [], []
        for k, net in enumerate(nets):
            tables.append(self.scale_table(net, [torch.tensor([scales[k] * keep[i][k]]) for i in range(steps)]))
            dtype = net.input_dtypes[TIMESTEP]
            values = (timesteps.to(net.input_dtypes[HIDDEN_STATES]) / 1000).to(dtype)
            timestep_rows.append(upload(values[:, None].expand(-1, rows).contiguous(), self.device))
            inputs = {
                FLUX_TEXT_IDS: constants[FLUX_TEXT_IDS].to(net.input_dtypes[FLUX_TEXT_IDS]),
                FLUX_IMAGE_IDS: constants[FLUX_IMAGE_IDS].to(net.input_dtypes[FLUX_IMAGE_IDS]),
                POOLED_PROJECTIONS: pooled_prompt_embeds.to(net.input_dtypes[POOLED_PROJECTIONS]),
                CONTROLNET_CONDITION: conditions[k],
            }
            if FLUX_GUIDANCE in net.input_names:
                scale = torch.full((rows,), float(guidance_scale), dtype=torch.float32)
                inputs[FLUX_GUIDANCE] = upload(scale.to(net.input_dtypes[FLUX_GUIDANCE]), self.device)
            if self.takes_mode(net):
                inputs[FLUX_CONTROLNET_MODE] = upload(torch.full((rows, 1), modes[k], dtype=torch.int64), self.device)
            fixed.append(inputs)
        zeros: Dict[Tuple[int, ...], List[torch.Tensor]] = {}
        # true CFG: the negative prompt's half of the transformer's batch takes the same samples
        sums = ControlSums([transformer_dtype] * len(sample_inputs), "same" if guidance.batched else None)

        def zero_samples(model_input: torch.Tensor) -> List[torch.Tensor]:
            key = tuple(model_input.shape[:2])
            if key not in zeros:
                zeros[key] = [
                    torch.zeros((*key, self.sample_width(name)), device=self.device, dtype=transformer_dtype)
                    for name in sample_inputs
                ]
            return zeros[key]

        def step_inputs(i: int, model_input: torch.Tensor, prompt_embeds: torch.Tensor) -> Dict[str, torch.Tensor]:
            latents = model_input.chunk(2)[1] if guidance.batched else model_input
            active = [k for k in range(len(nets)) if runs[i][k]]  # outside its window (or scale 0): zeros
            if not active:
                return dict(zip(sample_inputs, zero_samples(model_input)))
            outputs = (  # each run's outputs are taken in before the next runs (maybe the same union ControlNet)
                nets[k](
                    hidden_states=latents.to(nets[k].input_dtypes[HIDDEN_STATES]),
                    encoder_hidden_states=prompt_embeds.to(nets[k].input_dtypes[ENCODER_HIDDEN_STATES]),
                    timestep=timestep_rows[k][i],
                    **{CONTROLNET_SCALE: tables[k][i]},
                    **fixed[k],
                )
                for k in active
            )
            return dict(zip(sample_inputs, sums(outputs, len(active))))

        return step_inputs

    def sample_width(self, name: str) -> int:
        """The width of the block-sample input ``name`` (the ControlNet's inner width)."""
        width = declared_dim(self.transformer, name, 2)
        if width is None:
            config = self.controlnets[0].config
            width = config.get("num_attention_heads", 0) * config.get("attention_head_dim", 0)
        if not width:
            raise ModelFileError(
                "controlnet config.json", f"cannot tell the width of {name}: a dynamic dim and no attention sizes"
            )
        return int(width)

    # --------------------------------------------------------------------------------------------------- call
    @on_device_stream
    def __call__(
        self,
        prompt: Prompt = None,
        prompt_2: Prompt = None,
        negative_prompt: Prompt = None,
        negative_prompt_2: Prompt = None,
        true_cfg_scale: float = 1.0,
        height: Optional[int] = None,
        width: Optional[int] = None,
        num_inference_steps: int = FLUX_CONTROLNET.defaults.steps,
        sigmas: Optional[List[float]] = None,
        guidance_scale: float = FLUX_CONTROLNET.defaults.guidance_scale,
        control_guidance_start: Union[float, List[float]] = 0.0,
        control_guidance_end: Union[float, List[float]] = 1.0,
        control_image: Union[ImageInput, Sequence[ImageInput]] = None,
        control_mode: Union[int, List[Optional[int]], None] = None,
        controlnet_conditioning_scale: Union[float, List[float]] = 1.0,
        num_images_per_prompt: int = 1,
        generator: Generator = None,
        latents: Latents = None,
        prompt_embeds: Embeds = None,
        pooled_prompt_embeds: Embeds = None,
        negative_prompt_embeds: Embeds = None,
        negative_pooled_prompt_embeds: Embeds = None,
        output_type: str = "pil",
        return_dict: bool = True,
        joint_attention_kwargs: Optional[Dict[str, Any]] = None,
        callback_on_step_end: StepEndCallback = None,
        callback_on_step_end_tensor_inputs: TensorNames = ("latents",),
        max_sequence_length: int = MAX_SEQUENCE_LENGTH,
    ):
        """Generates images that follow the control images as ``prompt`` says, with the arguments of diffusers'
        ``FluxControlNetPipeline`` (IP-Adapter aside).

        ``control_image``: PIL, numpy, a list of them (one per prompt), or a tensor of pixels in [-1, 1] of the
        call's size; for multi-ControlNet a list with one such entry per ControlNet. It is resized to ``height`` ×
        ``width`` (default: diffusers' 1024²). ``controlnet_conditioning_scale`` multiplies each ControlNet's
        samples (0: FLUX.1's own image); ``control_guidance_start``/``_end`` is the fraction of the steps where a
        ControlNet applies; ``control_mode``: a union ControlNet's mode (an int; for multi-ControlNet one per
        ControlNet, ``None`` for those that are not union ones). A folder of one union ControlNet given a list of
        modes runs it once per mode, as diffusers' ``FluxMultiControlNetModel([union])`` does: ``control_image``,
        the scales and the windows then have one entry per mode (each window given once applies to every
        condition; diffusers, given one start and end, runs the first condition alone). ``true_cfg_scale`` > 1 with
        a negative prompt runs true classifier-free guidance. ``latents`` are packed, ``(batch, tokens, 4 × latent
        channels)``; ``output_type="latent"`` returns them packed too.

        Returns:
            ``FluxPipelineOutput(images)``, or ``(images,)`` without ``return_dict``.
        """
        # 1. check inputs
        height = self.default_image_size if height is None else height
        width = self.default_image_size if width is None else width
        self.check_inputs_flux(
            prompt=prompt,
            prompt_2=prompt_2,
            negative_prompt=negative_prompt,
            negative_prompt_2=negative_prompt_2,
            true_cfg_scale=true_cfg_scale,
            prompt_embeds=prompt_embeds,
            pooled_prompt_embeds=pooled_prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            negative_pooled_prompt_embeds=negative_pooled_prompt_embeds,
            max_sequence_length=max_sequence_length,
            height=height,
            width=width,
            num_inference_steps=num_inference_steps,
            sigmas=sigmas,
            guidance_scale=guidance_scale,
            num_images_per_prompt=num_images_per_prompt,
            output_type=output_type,
            joint_attention_kwargs=joint_attention_kwargs,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
        )
        nets = self.condition_nets(control_mode)
        scales, starts, ends = self.check_control_arguments(
            controlnet_conditioning_scale, control_guidance_start, control_guidance_end, len(nets)
        )
        modes = self.check_control_modes(control_mode, nets)
        batch_size = self.batch_size_of(prompt, prompt_embeds)
        image_count = self.image_count(batch_size, num_images_per_prompt, generator)
        images = self.check_control_images(control_image, height, width, batch_size, len(nets))

        # 2. prompt embeddings (the negative prompt's with true CFG), on the device
        tensors, text_ids, guidance = self.text_tensors(
            prompt=prompt,
            prompt_2=prompt_2,
            negative_prompt=negative_prompt,
            negative_prompt_2=negative_prompt_2,
            true_cfg_scale=true_cfg_scale,
            prompt_embeds=prompt_embeds,
            pooled_prompt_embeds=pooled_prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            negative_pooled_prompt_embeds=negative_pooled_prompt_embeds,
            num_images_per_prompt=num_images_per_prompt,
            max_sequence_length=max_sequence_length,
        )

        # 3. the control images' latents (encoded before the noise is drawn, as diffusers does), the noise, the ids
        conditions = self.control_conditions(images, height, width, image_count, num_images_per_prompt, generator, nets)
        latent_height, latent_width = self.latent_size(height, width)
        latents = self.initial_latents(image_count, latent_height, latent_width, generator, latents)
        image_ids = self.position_ids(latent_height // 2, latent_width // 2)

        # 4. timesteps, the transformer's constant inputs, the ControlNets' per-step samples
        timesteps = self.denoiser.timesteps(num_inference_steps, latents.shape[1], sigmas)
        inputs = self.transformer_inputs(text_ids, image_ids, image_count * guidance.copies, guidance_scale)
        samples = self.controlnet_step_inputs(
            conditions,
            modes,
            timesteps,
            scales,
            starts,
            ends,
            guidance,
            inputs,
            tensors["pooled_prompt_embeds"],
            guidance_scale,
            nets,
        )

        # 5. the denoising loop: every tensor stays on self.device
        latents = denoise(
            self.denoiser,
            latents,
            timesteps,
            tensors=tensors,
            guidance=guidance,
            inputs=inputs,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
            step_inputs=samples,
        )

        # 6. decode: only now does anything leave the device
        return self.finish(latents, output_type, return_dict, (latent_height, latent_width))
