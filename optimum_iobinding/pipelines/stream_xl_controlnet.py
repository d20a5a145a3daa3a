"""The real-time SDXL stream with ControlNets: the ControlNet stream of :mod:`.stream_controlnet` on an SDXL folder
(:mod:`.stream_xl`'s two text encoders, ``text_embeds`` and ``time_ids``), every SDXL ControlNet taking the UNet's
``text_embeds`` and ``time_ids`` rows too."""

from __future__ import annotations

from typing import Dict

import torch

from ..families import SDXL_TEXT_EMBEDS, SDXL_TIME_IDS, family
from .components import onnx
from .stable_diffusion_xl import XL_COMPONENTS
from .stream_controlnet import OnnxStreamDiffusionControlNetPipeline
from .stream_xl import OnnxStreamDiffusionXLPipeline


class OnnxStreamDiffusionXLControlNetPipeline(OnnxStreamDiffusionControlNetPipeline, OnnxStreamDiffusionXLPipeline):
    """:class:`~.stream_controlnet.OnnxStreamDiffusionControlNetPipeline` on an SDXL folder exported with ControlNets
    (``export SDXL_MODEL --controlnet ID``): a frame's UNet step is diffusers'
    ``StableDiffusionXLControlNetImg2ImgPipeline``'s, each ControlNet run on the UNet's rows with their
    ``text_embeds`` and ``time_ids``. ``OnnxStreamDiffusionPipeline.from_pretrained`` of such a folder gives this
    class; everything else is the SDXL stream's (:class:`~.stream_xl.OnnxStreamDiffusionXLPipeline`) and the
    ControlNet stream's."""

    family = family("stream-xl-controlnet")
    base_components = XL_COMPONENTS
    declared_components = XL_COMPONENTS + (onnx("controlnet"),)
    prompt_part = OnnxStreamDiffusionXLPipeline.prompt_part
    settings = OnnxStreamDiffusionXLPipeline.settings

    def _control_conditioning(self, unet_inputs: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The UNet's ``text_embeds`` and ``time_ids``, which an SDXL ControlNet takes too."""
        return {name: unet_inputs[name] for name in (SDXL_TEXT_EMBEDS, SDXL_TIME_IDS) if name in unet_inputs}
