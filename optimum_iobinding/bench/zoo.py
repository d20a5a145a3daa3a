"""The benchmark's model zoo: the architectures it measures (random weights: weights do not change speed), how each
is called (its recipe: size, guidance, step counts, scheduler, the prompt), and the export cache that turns an
architecture into an ONNX folder once per (model, dtype, export) and shares it between processes."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Dict

import torch

try:  # the export lock; absent on Windows, where bench processes then must not share a work folder
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

MODEL_SIZES = {"tiny": 512, "small": 256, "sd15": 512, "sdxl": 1024, "lcm": 512, "turbo": 512}
# How each model is called: guidance, the step count of the short run (per-step time = the difference / steps),
# a fixed step count for few-step models (else --steps), and the scheduler.
RECIPES: Dict[str, Dict[str, Any]] = {
    "default": dict(guidance=7.5, short_steps=2, steps=None, scheduler="ddim"),
    "sdxl": dict(guidance=5.0, short_steps=2, steps=None, scheduler="ddim"),
    "lcm": dict(guidance=8.5, short_steps=1, steps=4, scheduler="lcm"),  # guidance as an embedding, no CFG batch
    "turbo": dict(guidance=0.0, short_steps=1, steps=4, scheduler="euler-a-trailing"),  # SD-Turbo: no guidance
}


def recipe_of(kind: str) -> Dict[str, Any]:
    """How ``kind`` is called (:data:`RECIPES`; every model without a recipe of its own runs the default one)."""
    return RECIPES.get(kind, RECIPES["default"])


PROMPT = "a photo of an astronaut riding a horse on mars"


def build_torch_pipeline(kind: str, seed: int = 0):
    """Random-weights torch pipelines (weights do not change speed): the tiny one, a small UNet (64–256 channels,
    for 256²), the SD1.5 architecture, LCM (SD1.5 with a guidance-embedding input), SD-Turbo (SD 2.1-base) and
    SDXL base."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from ..export.tiny import build_tiny_random_pipeline, write_tiny_tokenizer

    if kind == "tiny":
        pipe = build_tiny_random_pipeline(seed)
    else:
        torch.manual_seed(seed)
        with tempfile.TemporaryDirectory() as folder:
            tokenizer = write_tiny_tokenizer(folder)
        if kind == "small":
            unet = UNet2DConditionModel(
                block_out_channels=(64, 128, 256), layers_per_block=2, sample_size=32, cross_attention_dim=768,
                down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"), attention_head_dim=8,
            )
            text_layers = 4
        elif kind in ("sd15", "lcm"):
            # LCM: the SD1.5 UNet with the guidance-embedding input LCM distillation adds (LCM-Dreamshaper's 256)
            unet = UNet2DConditionModel(sample_size=64, cross_attention_dim=768, attention_head_dim=8,
                                        time_cond_proj_dim=256 if kind == "lcm" else None)
            text_layers = 12
        elif kind == "turbo":  # SD-Turbo: the SD 2.1-base architecture
            unet = UNet2DConditionModel(sample_size=64, cross_attention_dim=1024, attention_head_dim=(5, 10, 20, 20),
                                        use_linear_projection=True)
            text_layers = 23
        elif kind == "sdxl":
            return _sdxl_architecture(tokenizer)
        else:
            raise ValueError(f"model: expected one of {sorted(MODEL_SIZES)}, got {kind!r}")
        width = 1024 if kind == "turbo" else 768
        text_encoder = CLIPTextModel(CLIPTextConfig(
            hidden_size=width, intermediate_size=4 * width, num_attention_heads=width // 64,
            num_hidden_layers=text_layers, max_position_embeddings=77, vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, hidden_act="gelu" if kind == "turbo" else "quick_gelu",
        ))
        vae = _sd_vae()
        if kind == "lcm":
            from diffusers import LatentConsistencyModelPipeline, LCMScheduler

            return LatentConsistencyModelPipeline(
                vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                scheduler=LCMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear"),
                safety_checker=None, feature_extractor=None, requires_safety_checker=False,
            )
        pipe = StableDiffusionPipeline(
            vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
            scheduler=DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                    clip_sample=False, set_alpha_to_one=False, steps_offset=1),
            safety_checker=None, feature_extractor=None, requires_safety_checker=False,
        )
    set_recipe_scheduler(pipe, kind)
    return pipe


def _sd_vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=4,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
    )


def _sdxl_architecture(tokenizer):
    """SDXL base's architecture with random weights: CLIP ViT-L and OpenCLIP bigG text encoders, the 2.6 B UNet."""
    from diffusers import DDIMScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    def text_config(width, layers, heads, projection=None):
        return CLIPTextConfig(
            hidden_size=width, intermediate_size=4 * width, num_attention_heads=heads, num_hidden_layers=layers,
            max_position_embeddings=77, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, hidden_act="gelu",
            **({"projection_dim": projection} if projection else {}),
        )

    unet = UNet2DConditionModel(
        sample_size=128, block_out_channels=(320, 640, 1280), layers_per_block=2,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), cross_attention_dim=2048,
        use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
        projection_class_embeddings_input_dim=2816,
    )
    vae = _sd_vae()
    vae.register_to_config(scaling_factor=0.13025, sample_size=1024)
    return StableDiffusionXLPipeline(
        vae=vae, text_encoder=CLIPTextModel(text_config(768, 12, 12)),
        text_encoder_2=CLIPTextModelWithProjection(text_config(1280, 32, 20, projection=1280)),
        tokenizer=tokenizer, tokenizer_2=tokenizer, unet=unet,
        scheduler=DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                clip_sample=False, set_alpha_to_one=False, steps_offset=1),
    )


def set_recipe_scheduler(pipe: Any, kind: str) -> None:
    """Gives ``pipe`` (any peer's pipeline) the scheduler of ``kind``'s recipe, made from its own scheduler's config."""
    from diffusers import DDIMScheduler, EulerAncestralDiscreteScheduler, LCMScheduler

    name = recipe_of(kind)["scheduler"]
    if name == "ddim":
        # clip_sample off as in SD's own DDIM config: a config without the key (the tiny pipeline's PNDM one) would
        # turn it on, while diffusers' ONNX pipeline turns it off when it loads such a config — different loops
        pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config, clip_sample=False)
    elif name == "lcm":
        pipe.scheduler = LCMScheduler.from_config(pipe.scheduler.config)
    else:
        pipe.scheduler = EulerAncestralDiscreteScheduler.from_config(pipe.scheduler.config,
                                                                     timestep_spacing="trailing")


def build_taesd_architecture(seed: int = 0):
    """A random-weights ``AutoencoderTiny`` with TAESD's architecture (diffusers' defaults are TAESD's: 64 channels,
    blocks 1-3-3-3 down and 3-3-3-1 up, 4 latent channels, scaling factor 1): the tiny VAE of the stream scenario."""
    from diffusers import AutoencoderTiny

    torch.manual_seed(seed)
    return AutoencoderTiny().to(torch.float32)


def ensure_tiny_vae_export(dtype: str, export: str, work: Path) -> Path:
    """The export of the TAESD-shaped tiny VAE alone (``vae_encoder/``, ``vae_decoder/``) under ``work``, made once
    and shared as :func:`ensure_export` shares the pipelines'."""
    from ..export import export_pipeline

    folder = work / f"taesd-{dtype}-{export}"
    work.mkdir(parents=True, exist_ok=True)
    with _ExportLock(work / f".{folder.name}.lock"):
        if not (folder / "vae_decoder" / "model.onnx").is_file():
            if folder.exists():
                raise FileExistsError(f"--work: {str(folder)!r} exists but is not a finished tiny VAE export (no "
                                      "vae_decoder/model.onnx); move it away or choose another --work folder")
            export_pipeline(None, folder, fp16=dtype == "fp16", optimize="cuda" if export == "optimized" else None,
                            progress=False, tiny_vae=build_taesd_architecture())
    return folder


def ensure_export(kind: str, dtype: str, export: str, work: Path) -> Path:
    """The export of one configuration under ``work``, made once and shared by every process that asks for it.

    Exports are built beside the folder and renamed into place, so a folder with a model_index.json is always whole;
    a lock file serialises processes that want the same export (``--export-only`` can make the next models' exports in
    the background while the GPU measures the current one).
    """
    from ..export import export_pipeline

    folder = work / f"{kind}-{dtype}-{export}"
    work.mkdir(parents=True, exist_ok=True)
    with _ExportLock(work / f".{folder.name}.lock"):
        if not (folder / "model_index.json").is_file():
            if folder.exists():  # not one of ours (ours appear whole, by a rename): never delete it
                raise FileExistsError(f"--work: {str(folder)!r} exists but is not a finished export (no "
                                      "model_index.json); move it away or choose another --work folder")
            # export_pipeline builds beside the folder and renames it into place once whole
            export_pipeline(None, folder, fp16=dtype == "fp16", optimize="cuda" if export == "optimized" else None,
                            progress=False, torch_pipeline=build_torch_pipeline(kind))
    return folder


class _ExportLock:
    """An exclusive advisory lock on a file (POSIX flock); where flock does not exist, no lock."""

    def __init__(self, path: Path):
        self.path = path
        self.handle: Any = None

    def __enter__(self) -> "_ExportLock":
        self.handle = open(self.path, "a")
        if fcntl is not None:
            fcntl.flock(self.handle.fileno(), fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: Any) -> None:
        if fcntl is not None:
            fcntl.flock(self.handle.fileno(), fcntl.LOCK_UN)
        self.handle.close()

