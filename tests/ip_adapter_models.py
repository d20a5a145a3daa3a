"""Tiny IP-Adapter models for the tests (CPU and GPU): a CLIP vision encoder, random adapters in the original file
format, the tiny Stable Diffusion pipeline with the encoder, and an image prompt."""

from __future__ import annotations

import numpy as np
import PIL.Image
import torch

# SD-Turbo's scheduler: Euler ancestral with trailing timesteps (2 steps at strength 0.5 are one step)
TURBO = ("EulerAncestralDiscreteScheduler", {"timestep_spacing": "trailing"})


def image_encoder():
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    torch.manual_seed(5)
    config = CLIPVisionConfig(
        hidden_size=32,
        projection_dim=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=4,
        intermediate_size=37,
    )
    return CLIPVisionModelWithProjection(config).eval()


def adapter_state_dict(unet, seed: int):
    """A random IP-Adapter for ``unet`` in the original file format (``image_proj``: a plain adapter's projection
    of 4 tokens; ``ip_adapter``: ``{2i + 1}.to_k_ip`` / ``to_v_ip`` for the ``i``-th cross-attention layer)."""
    from diffusers.models.embeddings import ImageProjection

    generator = torch.Generator().manual_seed(seed)
    cross = unet.config.cross_attention_dim
    weights, key = {}, 1
    for name, module in unet.named_modules():
        if name.endswith("attn2"):
            width = module.to_k.out_features
            weights[f"{key}.to_k_ip.weight"] = torch.randn(width, cross, generator=generator) * 0.2
            weights[f"{key}.to_v_ip.weight"] = torch.randn(width, cross, generator=generator) * 0.2
            key += 2
    torch.manual_seed(seed)
    projection = ImageProjection(cross_attention_dim=cross, image_embed_dim=32, num_image_text_embeds=4).state_dict()
    image_proj = {
        "proj.weight": projection["image_embeds.weight"],
        "proj.bias": projection["image_embeds.bias"],
        "norm.weight": projection["norm.weight"] + 0.1 * torch.randn(cross, generator=generator),
        "norm.bias": projection["norm.bias"] + 0.1 * torch.randn(cross, generator=generator),
    }
    return {"image_proj": image_proj, "ip_adapter": weights}


def full_adapter_state_dict(unet, seed: int):
    """A random "full" IP-Adapter (its projection takes the image encoder's penultimate states, one token each, as
    diffusers' plus adapters do) in the original file format."""
    from diffusers.models.embeddings import IPAdapterFullImageProjection

    state = adapter_state_dict(unet, seed)
    torch.manual_seed(seed)
    cross = unet.config.cross_attention_dim
    projection = IPAdapterFullImageProjection(cross_attention_dim=cross, image_embed_dim=32).state_dict()
    names = {"ff.net.0.proj": "proj.0", "ff.net.2": "proj.2", "norm": "proj.3"}
    image_proj = {}
    for key, value in projection.items():
        module, _, kind = key.rpartition(".")
        image_proj[f"{names[module]}.{kind}"] = value
    return {"image_proj": image_proj, "ip_adapter": state["ip_adapter"]}


def torch_pipeline():
    from optimum_iobinding.export.tiny import build_tiny_random_pipeline

    pipe = build_tiny_random_pipeline()
    pipe.register_modules(image_encoder=image_encoder())
    return pipe


def prompt_image(seed=7):
    pixels = np.random.default_rng(seed).integers(0, 256, (40, 48, 3), dtype=np.uint8)
    return PIL.Image.fromarray(pixels)
