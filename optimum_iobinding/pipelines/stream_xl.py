"""The real-time stream on SDXL folders (SDXL-Turbo, SDXL, an SDXL LCM): the stream of :mod:`.stream` with SDXL's two
text encoders and the UNet's ``text_embeds`` and ``time_ids``, each written once per prompt or plan."""

from __future__ import annotations

from typing import Dict, Optional

import torch

from ..families import SDXL_TEXT_EMBEDS, SDXL_TIME_IDS, family
from .stable_diffusion_xl import XL_COMPONENTS, OnnxStableDiffusionXLPipelineBase
from .stream import OnnxStreamDiffusionPipeline
from .stream_plan import StreamPlan

# diffusers' SDXL image-to-image defaults for a refiner's micro-conditioning (requires_aesthetics_score)
AESTHETIC_SCORE, NEGATIVE_AESTHETIC_SCORE = 6.0, 2.5


class OnnxStreamDiffusionXLPipeline(OnnxStreamDiffusionPipeline, OnnxStableDiffusionXLPipelineBase):
    """:class:`OnnxStreamDiffusionPipeline` on an SDXL folder (optimum's SDXL layout: ``text_encoder`` and
    ``text_encoder_2`` with their hidden states, a UNet taking ``text_embeds`` and ``time_ids``): SDXL-Turbo (one
    step at 512², as StreamDiffusion runs SD-Turbo), SDXL with more steps, an SDXL LCM UNet.
    ``OnnxStreamDiffusionPipeline.from_pretrained`` of an SDXL folder gives this class.

    What a frame computes is diffusers' ``StableDiffusionXLImg2ImgPipeline`` at the prepared size: the prompt through
    both text encoders (their penultimate hidden states concatenated, the second one's pooled projection as
    ``text_embeds``; an absent negative prompt gives zeros where the folder's ``force_zeros_for_empty_prompt`` says
    so, as diffusers), and ``time_ids`` = original size, crop corner (0, 0), target size, all the prepared size (a
    refiner's folder, ``requires_aesthetics_score``: the aesthetic score 6 and 2.5 for the negative rows instead of the
    target size). Prompt blends average the hidden states and the pooled embeddings alike. Everything else — steps,
    stream batch, guidance types, the similarity filter, seed blends, tiny VAEs, frames — is the stream's. SDXL's own
    VAE overflows in float16 (its activations pass 65504); a tiny VAE (``tiny_vae=``, taesdxl's architecture: an
    ``AutoencoderTiny`` export) or a float32 VAE avoids that."""

    family = family("stream-xl")
    declared_components = XL_COMPONENTS
    denoiser_part = OnnxStableDiffusionXLPipelineBase.denoiser_part
    prompt_part = OnnxStableDiffusionXLPipelineBase.prompt_part
    settings = OnnxStableDiffusionXLPipelineBase.settings

    def _prompt_conditioning(
        self, text: str, negative: bool, negative_prompt: Optional[str]
    ) -> Dict[str, torch.Tensor]:
        """Both text encoders' embeddings as ``encoder_hidden_states`` and the pooled one as ``text_embeds``
        (``[negative; positive]`` rows with ``negative``)."""
        embeddings, pooled = self.prompt.encode(text, None, 1, negative, negative_prompt)
        return {"encoder_hidden_states": embeddings, SDXL_TEXT_EMBEDS: pooled}

    def _fixed_unet_inputs(self, plan: StreamPlan) -> Dict[str, torch.Tensor]:
        """``time_ids`` for every UNet row: the negative rows' first (a refiner's with the negative aesthetic score),
        then one per latent row."""
        size = (plan.height, plan.width)
        positive = self.time_ids(size, (0, 0), size, AESTHETIC_SCORE, torch.float32)
        negative = self.time_ids(size, (0, 0), size, NEGATIVE_AESTHETIC_SCORE, torch.float32)
        negative_rows = plan.rows - plan.latent_rows
        return {SDXL_TIME_IDS: torch.cat([negative.repeat(negative_rows, 1), positive.repeat(plan.latent_rows, 1)])}
