"""The real-time stream with ControlNets (Stable Diffusion 1.x/2.x, SD-Turbo): the stream of :mod:`.stream` whose
UNet takes the residuals of one or several ControlNets, run before it at every step on the same rows, each with a
control image that is fixed for the stream or comes with each frame."""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..errors import ArgumentError
from ..families import family
from ..layout import CONTROLNET_CONDITION, CONTROLNET_SCALE, controlnet_component_names
from ..runtime.model import IOBindingORTModel
from .clip_unet import STABLE_DIFFUSION_COMPONENTS
from .components import onnx
from .controlnet import ControlNetUNet, ControlSums, UNetControlNets
from .core import on_device_stream
from .stream import OnnxStreamDiffusionPipeline
from .stream_frames import FrameInput, read_frame
from .stream_plan import StreamPlan

ControlImage = Any  # PIL, numpy (H, W, 3), a float tensor in [0, 1]; a list of them with several ControlNets


class OnnxStreamDiffusionControlNetPipeline(UNetControlNets, OnnxStreamDiffusionPipeline):
    """:class:`OnnxStreamDiffusionPipeline` on a folder exported with ControlNets (``export MODEL --controlnet ID``,
    repeatable: ``controlnet/``, ``controlnet_1/`` … beside a UNet that takes their residuals).
    ``OnnxStreamDiffusionPipeline.from_pretrained`` of such a folder gives this class.

    A frame's UNet step is diffusers' ``StableDiffusionControlNetImg2ImgPipeline``'s: every ControlNet runs on the
    UNet's rows (the latents, and the negative prompt's rows under classifier-free guidance) with its control image
    (diffusers' preprocessing: RGB, resized to the prepared size, in [0, 1]) and its conditioning scale, and the UNet
    takes the sum of their residuals. The control image is either fixed for the stream (``prepare(...,
    control_image=…)``) or given with each frame (``stream(frame, control_image=…)``, e.g. an edge or depth map the
    caller computes per frame; a CUDA tensor stays on the device). In a stream batch each frame keeps its own control
    image through its steps: a new one enters the newest row as the older rows move down with their frames. Each
    ControlNet is captured as a CUDA graph in the same stream as the UNet. :meth:`frames` needs a fixed control image.
    """

    family = family("stream-controlnet")
    base_components = STABLE_DIFFUSION_COMPONENTS
    declared_components = STABLE_DIFFUSION_COMPONENTS + (onnx("controlnet"),)
    denoiser_part = ControlNetUNet

    def __init__(self, **components: Any):
        super().__init__(**components)
        self._control_request: Optional[Tuple[Optional[List[Any]], List[float]]] = None
        self._frame_controls: Optional[List[torch.Tensor]] = None  # the control images of the frame being enqueued
        self._sums: Optional[ControlSums] = None

    @classmethod
    def model_folders(
        cls,
        pretrained_model_name_or_path: Union[str, os.PathLike],
        hub_kwargs: Dict[str, Any],
        tiny_vae: Union[str, os.PathLike, None] = None,
    ) -> Tuple[Path, Dict[str, Path]]:
        """The stream's folders (a tiny VAE's where given) and every ControlNet's (``controlnet_1`` … too)."""
        folder, folders = super().model_folders(pretrained_model_name_or_path, hub_kwargs, tiny_vae)
        for name in cls.onnx_names_in(folder):
            folders.setdefault(name, folder / name)
        return folder, folders

    @classmethod
    def download_names(cls) -> Sequence[str]:
        return (*super().download_names(), "controlnet*")

    # -------------------------------------------------------------------------------------------------- prepare
    def prepare(
        self,
        prompt: Any,
        *args: Any,
        control_image: Optional[ControlImage] = None,
        controlnet_conditioning_scale: Union[float, List[float]] = 0.8,
        **kwargs: Any,
    ) -> None:
        """:meth:`OnnxStreamDiffusionPipeline.prepare` with the ControlNets' arguments.

        Args:
            control_image: the control image of every frame (one per ControlNet in a list with several), or
                ``None``: each frame brings its own (``stream(frame, control_image=…)``).
            controlnet_conditioning_scale: how much each ControlNet's residuals count (one number, or one per
                ControlNet); 0.8 as in diffusers' ControlNet image to image.
        """
        bound = inspect.signature(OnnxStreamDiffusionPipeline.prepare).bind(self, prompt, *args, **kwargs)
        bound.apply_defaults()
        options = bound.arguments
        with self.call_guard.lock:  # a prepare in another thread waits: the request is this call's (re-entrant)
            scales, _, _ = self.check_control_arguments(controlnet_conditioning_scale, 0.0, 1.0)
            guided = options["guidance_scale"] > 1.0 and options["cfg_type"] in ("full", "initialize")
            pooled = [
                name
                for name, net in zip(controlnet_component_names(len(self.controlnets)), self.controlnets)
                if net.config.get("global_pool_conditions")
            ]
            if guided and pooled:
                raise ArgumentError(
                    pooled[0],
                    "a ControlNet with global_pool_conditions conditions the prompt's rows alone under guidance "
                    f"(diffusers' guess mode), which the stream does not run; got guidance_scale "
                    f"{options['guidance_scale']} with cfg_type {options['cfg_type']!r}: use guidance_scale ≤ 1 or "
                    "cfg_type 'self'",
                )
            images = None
            if control_image is not None:  # preprocessed now: a refused one leaves the stream prepared as it was
                images = self._control_tensors(control_image, options["height"], options["width"])
            self._control_request = (images, scales)
            try:
                super().prepare(prompt, *args, **kwargs)
            finally:
                self._control_request = None

    def _make_tensors(self, plan: StreamPlan, seeds: Any, lcm: bool, conditioning_shapes: Any) -> None:
        super()._make_tensors(plan, seeds, lcm, conditioning_shapes)
        images, scales = self._control_request or (None, [0.8] * len(self.controlnets))
        rows = plan.rows
        residuals = len(self.denoiser.residual_inputs)
        # images: each ControlNet's rows; last: the control images the newest frame takes (None: none given yet);
        # uniform: whether every row holds the last ones (in a stream batch nothing has to move down with the frames)
        plan.control = {"images": [], "timesteps": [], "last": None, "uniform": True}
        controls = []
        with torch.inference_mode(False):  # written in place by later frames
            for k, net in enumerate(self.controlnets):
                tensor = torch.zeros(
                    rows, 3, plan.height, plan.width, device=self.device, dtype=net.input_dtypes[CONTROLNET_CONDITION]
                )
                if images is not None:  # preprocessed by prepare
                    controls.append(images[k])
                    tensor.copy_(controls[-1].expand_as(tensor))
                plan.control["images"].append(tensor)
                plan.tensors[f"control_scale_{k}"] = self.scale_table(net, [torch.full((residuals,), scales[k])])[0]
                steps = [plan.unet_inputs["timestep"]] if plan.batched else plan.step_timesteps
                plan.control["timesteps"].append([self._net_timestep(net, value, rows) for value in steps])
        plan.control["last"] = controls or None
        self._sums = ControlSums([self.unet.input_dtypes[name] for name in self.denoiser.residual_inputs])

    def _control_tensors(self, control_image: Any, height: int, width: int) -> List[torch.Tensor]:
        """``control_image`` (one per ControlNet in a list with several) as the ControlNets take them: each
        ``(1, 3, height, width)`` in [0, 1], on the device; a bad one refused naming ``control_image`` (``[k]``)."""
        images = self._control_images(control_image, "control_image")
        labels = ["control_image"] if len(images) == 1 else [f"control_image[{k}]" for k in range(len(images))]
        return [
            self.prepare_control_image(image, label, height, width, 1, 1, False, False, net)
            for image, label, net in zip(images, labels, self.controlnets)
        ]

    @staticmethod
    def _net_timestep(net: IOBindingORTModel, value: torch.Tensor, rows: int) -> torch.Tensor:
        """The UNet's timestep input ``value`` in the rank and dtype the ControlNet declares."""
        dims = net.input_dims.get("timestep") or []
        value = value.to(net.input_dtypes["timestep"]).reshape(-1)
        if not dims:
            if value.numel() != 1 and not torch.equal(value, value[:1].expand_as(value)):
                raise ArgumentError(
                    "stream_batch",
                    "expected ControlNets whose timestep input has one row per sample (a stream batch gives each "
                    "step its own timestep), got a scalar one; pass stream_batch=False",
                )
            return value[0]
        if dims[0] == 1:
            if not torch.equal(value, value[:1].expand_as(value)):
                raise ArgumentError(
                    "stream_batch",
                    "expected ControlNets whose timestep input has one row per sample (a stream batch gives each "
                    "step its own timestep), got one of a single row; pass stream_batch=False",
                )
            return value[:1]
        return value.expand(rows).contiguous() if value.numel() == 1 else value

    def _model_shapes(self, plan: StreamPlan) -> List[Tuple[IOBindingORTModel, Dict[str, Tuple[int, ...]]]]:
        """The models a frame runs and their input shapes: the VAE's, each ControlNet's, and the UNet's with the
        residuals it takes."""
        shapes = super()._model_shapes(plan)
        unet = {name: tuple(value.shape) for name, value in plan.unet_inputs.items()}
        residuals = self._residual_shapes(
            unet["sample"],
            unet["encoder_hidden_states"],
            tuple(plan.control["images"][0].shape),
            self._control_conditioning(plan.unet_inputs),
        )
        for index, (model, model_shapes) in enumerate(shapes):
            if model is self.unet:
                shapes[index] = (model, {**model_shapes, **dict(zip(self.denoiser.residual_inputs, residuals))})
        for k, net in enumerate(self.controlnets):
            inputs = {
                "sample": unet["sample"],
                "timestep": tuple(plan.control["timesteps"][k][0].shape),
                "encoder_hidden_states": unet["encoder_hidden_states"],
                CONTROLNET_CONDITION: tuple(plan.control["images"][k].shape),
                CONTROLNET_SCALE: tuple(plan.tensors[f"control_scale_{k}"].shape),
                **{name: tuple(value.shape) for name, value in self._control_conditioning(plan.unet_inputs).items()},
            }
            shapes.insert(1, (net, inputs))
        return shapes

    def _control_conditioning(self, unet_inputs: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The UNet's inputs a ControlNet takes beside its own (none here; SDXL's ``text_embeds`` and ``time_ids``)."""
        return {}

    @property
    def control_inputs(self) -> List[Dict[str, torch.Tensor]]:
        """Each ControlNet's inputs as a frame's (first) step gives them, by name; empty before :meth:`prepare`. The
        tensors are the stream's: read them, do not write them."""
        plan = self._plan
        if plan is None:
            return []
        return [
            {
                "sample": plan.unet_inputs["sample"],
                "timestep": plan.control["timesteps"][k][0],
                "encoder_hidden_states": plan.unet_inputs["encoder_hidden_states"],
                CONTROLNET_CONDITION: plan.control["images"][k],
                CONTROLNET_SCALE: plan.tensors[f"control_scale_{k}"],
                **self._control_conditioning(plan.unet_inputs),
            }
            for k in range(len(self.controlnets))
        ]

    # --------------------------------------------------------------------------------------------------- frames
    @on_device_stream
    def __call__(self, frame: FrameInput, control_image: Optional[ControlImage] = None) -> Any:
        """One frame in, one frame out (see :class:`OnnxStreamDiffusionPipeline`), with its own control image (one per
        ControlNet in a list with several) where ``prepare`` fixed none; given with a fixed one, it replaces it from
        this frame on."""
        plan = self._require_plan("frame")
        controls = self._frame_control_images(plan, control_image)
        source, kind = read_frame(frame, self.device)
        self._frame_controls = controls
        try:
            pending = self._enqueue(plan, source, kind)
        finally:
            self._frame_controls = None
        return None if pending is None else pending.result()

    def frames(self, frames: Any) -> Any:
        """See :meth:`OnnxStreamDiffusionPipeline.frames`: every frame takes the last control image given (``prepare``'s,
        or the last frame's)."""
        plan = self._require_plan("frames")
        if plan.control["last"] is None:
            raise ArgumentError(
                "control_image",
                "frames() gives every frame the last control image, got a stream without one; pass control_image to "
                "prepare, or call the stream frame by frame with control_image=",
            )
        return super().frames(frames)

    def _frame_control_images(self, plan: StreamPlan, control_image: Any) -> Optional[List[torch.Tensor]]:
        """A frame's control images, preprocessed (before any of the frame's work); ``None`` keeps the stream's."""
        if control_image is None:
            if plan.control["last"] is None:
                raise ArgumentError(
                    "control_image",
                    "expected a control image with the frame (neither prepare nor an earlier frame gave one), got "
                    "None; pass stream(frame, control_image=…) or prepare(…, control_image=…)",
                )
            return None
        return self._control_tensors(control_image, plan.height, plan.width)

    def _brings_more(self) -> bool:
        """A frame with a control image of its own is kept by the similarity filter (its pixels are all it compares)."""
        return self._frame_controls is not None

    def _frame_kept(self, plan: StreamPlan) -> None:
        """A frame goes through the models with its control images (or the last ones given): without a stream batch
        they are written into every row now; in a stream batch they enter the newest rows at the batch's next move
        (:meth:`_denoise`)."""
        new = self._frame_controls
        if new is None:
            return
        plan.control["last"] = new
        if plan.batched:
            plan.control["uniform"] = False
            return
        for tensor, control in zip(plan.control["images"], new):
            tensor.copy_(control.expand_as(tensor))

    def _denoise(self, plan: StreamPlan, encoded: torch.Tensor) -> None:
        """In a stream batch, the control images move one row down with their frames (as :meth:`_flush` moves them
        too) and the newest rows take the last control images given; then the stream's step."""
        if plan.batched and not plan.control["uniform"]:
            for tensor, control in zip(plan.control["images"], plan.control["last"]):
                for block in self._row_blocks(plan):
                    rows = tensor[block]
                    rows[1:].copy_(rows[:-1].clone())
                    rows[:1].copy_(control)
                if plan.cfg_type == "initialize":
                    tensor[:1].copy_(control)
        super()._denoise(plan, encoded)

    @staticmethod
    def _row_blocks(plan: StreamPlan) -> List[slice]:
        """The UNet batch's blocks of one row per latent row (newest frame first): the negative prompt's and the
        text's under "full" guidance, the text's alone otherwise ("initialize": after its one negative row)."""
        steps = plan.latent_rows
        if plan.cfg_type == "full":
            return [slice(0, steps), slice(steps, 2 * steps)]
        first = 1 if plan.cfg_type == "initialize" else 0
        return [slice(first, first + steps)]

    def _unet_output(self, plan: StreamPlan, inputs: Dict[str, torch.Tensor], step: Optional[int]) -> torch.Tensor:
        """Every ControlNet on the UNet's rows, then the UNet with the sum of their residuals."""
        index = 0 if step is None else step

        def runs():
            for k, net in enumerate(self.controlnets):
                yield net(
                    sample=inputs["sample"],
                    timestep=plan.control["timesteps"][k][index],
                    encoder_hidden_states=inputs["encoder_hidden_states"],
                    **{
                        CONTROLNET_CONDITION: plan.control["images"][k],
                        CONTROLNET_SCALE: plan.tensors[f"control_scale_{k}"],
                    },
                    **self._control_conditioning(inputs),
                )

        residuals = self._sums(runs(), len(self.controlnets))
        return self.unet(**inputs, **dict(zip(self.denoiser.residual_inputs, residuals)))[0]
