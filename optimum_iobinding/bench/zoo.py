"""The benchmark's model zoo: the architectures it measures (random weights: weights do not change speed), how each
is called (its recipe: size, guidance, step counts, scheduler, the prompt), and the export cache that turns an
architecture into an ONNX folder once per (model, dtype, export) and shares it between processes."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from ..errors import ArgumentError
from ..families import Family, family

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


# the family of each model's pipelines, by its key in optimum_iobinding.families (every other model is Stable
# Diffusion 1.x/2.x's)
MODEL_FAMILIES = {"sdxl": "sdxl", "lcm": "lcm"}


def family_of_model(kind: str) -> Family:
    """The family record that runs ``kind`` (:data:`MODEL_FAMILIES`)."""
    return family(MODEL_FAMILIES.get(kind, "sd"))


PROMPT = "a photo of an astronaut riding a horse on mars"


def build_torch_pipeline(kind: str, seed: int = 0):
    """Random-weights torch pipelines (weights do not change speed): the tiny one, a small UNet (64–256 channels,
    for 256²), the SD1.5 architecture, LCM (SD1.5 with a guidance-embedding input), SD-Turbo (SD 2.1-base) and
    SDXL base."""
    import torch
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
                block_out_channels=(64, 128, 256),
                layers_per_block=2,
                sample_size=32,
                cross_attention_dim=768,
                down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
                attention_head_dim=8,
            )
            text_layers = 4
        elif kind in ("sd15", "lcm"):
            # LCM: the SD1.5 UNet with the guidance-embedding input LCM distillation adds (LCM-Dreamshaper's 256)
            unet = UNet2DConditionModel(
                sample_size=64,
                cross_attention_dim=768,
                attention_head_dim=8,
                time_cond_proj_dim=256 if kind == "lcm" else None,
            )
            text_layers = 12
        elif kind == "turbo":  # SD-Turbo: the SD 2.1-base architecture
            unet = UNet2DConditionModel(
                sample_size=64, cross_attention_dim=1024, attention_head_dim=(5, 10, 20, 20), use_linear_projection=True
            )
            text_layers = 23
        elif kind == "sdxl":
            return _sdxl_architecture(tokenizer)
        else:
            raise ArgumentError("model", f"expected one of {sorted(MODEL_SIZES)}, got {kind!r}")
        width = 1024 if kind == "turbo" else 768
        text_encoder = CLIPTextModel(
            CLIPTextConfig(
                hidden_size=width,
                intermediate_size=4 * width,
                num_attention_heads=width // 64,
                num_hidden_layers=text_layers,
                max_position_embeddings=77,
                vocab_size=len(tokenizer),
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
                hidden_act="gelu" if kind == "turbo" else "quick_gelu",
            )
        )
        vae = _sd_vae()
        if kind == "lcm":
            from diffusers import LatentConsistencyModelPipeline, LCMScheduler

            return LatentConsistencyModelPipeline(
                vae=vae,
                text_encoder=text_encoder,
                tokenizer=tokenizer,
                unet=unet,
                scheduler=LCMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear"),
                safety_checker=None,
                feature_extractor=None,
                requires_safety_checker=False,
            )
        pipe = StableDiffusionPipeline(
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            unet=unet,
            scheduler=DDIMScheduler(
                beta_start=0.00085,
                beta_end=0.012,
                beta_schedule="scaled_linear",
                clip_sample=False,
                set_alpha_to_one=False,
                steps_offset=1,
            ),
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
    set_recipe_scheduler(pipe, kind)
    return pipe


def _sd_vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        block_out_channels=(128, 256, 512, 512),
        layers_per_block=2,
        latent_channels=4,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
    )


def _sdxl_architecture(tokenizer):
    """SDXL base's architecture with random weights: CLIP ViT-L and OpenCLIP bigG text encoders, the 2.6 B UNet."""
    from diffusers import DDIMScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    def text_config(width, layers, heads, projection=None):
        return CLIPTextConfig(
            hidden_size=width,
            intermediate_size=4 * width,
            num_attention_heads=heads,
            num_hidden_layers=layers,
            max_position_embeddings=77,
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            hidden_act="gelu",
            **({"projection_dim": projection} if projection else {}),
        )

    unet = UNet2DConditionModel(
        sample_size=128,
        block_out_channels=(320, 640, 1280),
        layers_per_block=2,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 2, 10),
        attention_head_dim=(5, 10, 20),
        cross_attention_dim=2048,
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=256,
        projection_class_embeddings_input_dim=2816,
    )
    vae = _sd_vae()
    vae.register_to_config(scaling_factor=0.13025, sample_size=1024)
    return StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=CLIPTextModel(text_config(768, 12, 12)),
        text_encoder_2=CLIPTextModelWithProjection(text_config(1280, 32, 20, projection=1280)),
        tokenizer=tokenizer,
        tokenizer_2=tokenizer,
        unet=unet,
        scheduler=DDIMScheduler(
            beta_start=0.00085,
            beta_end=0.012,
            beta_schedule="scaled_linear",
            clip_sample=False,
            set_alpha_to_one=False,
            steps_offset=1,
        ),
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
        pipe.scheduler = EulerAncestralDiscreteScheduler.from_config(pipe.scheduler.config, timestep_spacing="trailing")


def build_taesd_architecture(seed: int = 0):
    """A random-weights ``AutoencoderTiny`` with TAESD's architecture (diffusers' defaults are TAESD's: 64 channels,
    blocks 1-3-3-3 down and 3-3-3-1 up, 4 latent channels, scaling factor 1): the tiny VAE of the stream scenario."""
    import torch
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
                raise FileExistsError(
                    f"--work: {str(folder)!r} exists but is not a finished tiny VAE export (no "
                    "vae_decoder/model.onnx); move it away or choose another --work folder"
                )
            export_pipeline(
                None,
                folder,
                dtype=dtype,
                optimize=optimize_target(export, "cuda"),
                progress=False,
                tiny_vae=build_taesd_architecture(),
            )
    return folder


EXPORT_DEVICES = ("cuda", "cpu")


def optimize_target(export: str, device: str) -> Optional[str]:
    """``export_pipeline``'s ``optimize`` for an ``export`` ("plain" or "optimized") that runs on ``device`` ("cuda"
    or "cpu"): an optimized export for the CPU gets only the fusions whose operators the CPU execution provider has
    (the CUDA ones, such as NhwcConv and GroupNorm, have no CPU kernel: such a folder does not load there)."""
    if export not in ("plain", "optimized"):
        raise ArgumentError("export", f"expected 'plain' or 'optimized', got {export!r}")
    if device not in EXPORT_DEVICES:
        raise ArgumentError("device", f"expected one of {', '.join(EXPORT_DEVICES)}, got {device!r}")
    return device if export == "optimized" else None


def ensure_export(kind: str, dtype: str, export: str, work: Path, step_cache: bool = False) -> Path:
    """The export of one configuration under ``work``, made once and shared by every process that asks for it.

    Exports are built beside the folder and renamed into place, so a folder with a model_index.json is always whole;
    a lock file serialises processes that want the same export (``--export-only`` can make the next models' exports in
    the background while the GPU measures the current one). ``step_cache``: with DeepCache's parts beside the UNet
    (a folder of its own, ``…-step-cache``).
    """
    name = f"{kind}-{dtype}-{export}" + ("-step-cache" if step_cache else "")
    return _ensure_pipeline_export(
        work / name, dtype, export, lambda: build_torch_pipeline(kind), step_cache=step_cache
    )


def build_controlnet_pipeline(kind: str, controlnets: int = 1, seed: int = 0):
    """``kind``'s torch pipeline (:func:`build_torch_pipeline`) with ``controlnets`` ControlNets of its UNet
    (``ControlNetModel.from_unet``, random weights: weights do not change speed): a
    ``StableDiffusionControlNetPipeline``, with a ``MultiControlNetModel`` for more than one. SD 1.x/2.x
    architectures only (SDXL's ControlNets condition on its pooled text and time ids)."""
    import torch
    from diffusers import ControlNetModel, StableDiffusionControlNetPipeline

    _check_controlnet_model(kind, controlnets)
    base = build_torch_pipeline(kind, seed)
    torch.manual_seed(seed + 1)
    nets = [ControlNetModel.from_unet(base.unet, load_weights_from_unet=False) for _ in range(controlnets)]
    return StableDiffusionControlNetPipeline(
        **{**base.components, "controlnet": nets[0] if controlnets == 1 else nets, "safety_checker": None},
        requires_safety_checker=False,
    )


def _check_controlnet_model(kind: str, controlnets: int) -> None:
    """Refuses, naming what it takes, a model without a Stable Diffusion 1.x/2.x pipeline or fewer than one
    ControlNet."""
    plain = [name for name in MODEL_SIZES if family_of_model(name) is family("sd")]
    if kind not in plain:
        raise ArgumentError("kind", f"expected one of {', '.join(plain)} for a ControlNet, got {kind!r}")
    if isinstance(controlnets, bool) or not isinstance(controlnets, int) or controlnets < 1:
        raise ArgumentError("controlnets", f"expected an integer ≥ 1, got {controlnets!r}")


def controlnet_export_name(kind: str, dtype: str, export: str, controlnets: int = 1) -> str:
    """The folder name of ``kind``'s export with ``controlnets`` ControlNets under ``--work``."""
    return f"{kind}-controlnet{controlnets}-{dtype}-{export}"


def ensure_controlnet_export(kind: str, dtype: str, export: str, work: Path, controlnets: int = 1) -> Path:
    """The export of ``kind`` with ``controlnets`` random ControlNets (:func:`build_controlnet_pipeline`:
    ``controlnet/`` … beside a UNet that takes their residuals) under ``work``, made once and shared as
    :func:`ensure_export` shares the others; a model it cannot take refused before any work."""
    _check_controlnet_model(kind, controlnets)
    return _ensure_pipeline_export(
        work / controlnet_export_name(kind, dtype, export, controlnets),
        dtype,
        export,
        lambda: build_controlnet_pipeline(kind, controlnets),
    )


# IP-Adapter's image encoder per model (a ``CLIPVisionModelWithProjection``, random weights): for the full-size
# architectures the shape of h94/IP-Adapter's Stable Diffusion adapters' one (OpenCLIP ViT-H/14 at 224², 632 M
# parameters: its ``image_embeds`` 1024 wide), for the shrunken ones (tiny, small) a tiny one, as fast as the rest of
# them (its ``image_embeds`` 16 wide: not the tiny UNet's cross-attention width, which the adapter's projection gives)
IP_ADAPTER_IMAGE_ENCODERS: Dict[str, Dict[str, Any]] = {
    "vit-h": dict(
        hidden_size=1280,
        num_hidden_layers=32,
        num_attention_heads=16,
        intermediate_size=5120,
        patch_size=14,
        image_size=224,
        projection_dim=1024,
        hidden_act="gelu",
    ),
    "tiny": dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        patch_size=4,
        image_size=32,
        projection_dim=16,
    ),
}
IP_ADAPTER_MODELS = {"tiny": "tiny", "small": "tiny", "sd15": "vit-h", "turbo": "vit-h"}
# the image-prompt tokens of a plain IP-Adapter (diffusers reads a plain adapter's ``proj`` as 4 tokens)
IP_ADAPTER_TOKENS = 4


def _check_ip_adapter_model(kind: str) -> None:
    """Refuses, naming what it takes, a model without an IP-Adapter image encoder of :data:`IP_ADAPTER_MODELS`."""
    if kind not in IP_ADAPTER_MODELS:
        raise ArgumentError("kind", f"expected one of {', '.join(IP_ADAPTER_MODELS)} for an IP-Adapter, got {kind!r}")


def build_ip_adapter_image_encoder(kind: str, seed: int = 0):
    """``kind``'s IP-Adapter image encoder (:data:`IP_ADAPTER_MODELS`, :data:`IP_ADAPTER_IMAGE_ENCODERS`): a
    ``CLIPVisionModelWithProjection`` with random weights, float32."""
    import torch
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    _check_ip_adapter_model(kind)
    torch.manual_seed(seed)
    config = CLIPVisionConfig(**IP_ADAPTER_IMAGE_ENCODERS[IP_ADAPTER_MODELS[kind]])
    return CLIPVisionModelWithProjection(config).to(torch.float32).eval()


def build_ip_adapter_pipeline(kind: str, seed: int = 0):
    """``kind``'s torch pipeline (:func:`build_torch_pipeline`) with its IP-Adapter image encoder
    (:func:`build_ip_adapter_image_encoder`) as ``image_encoder``."""
    _check_ip_adapter_model(kind)
    pipe = build_torch_pipeline(kind, seed)
    pipe.register_modules(image_encoder=build_ip_adapter_image_encoder(kind, seed + 1))
    return pipe


def ip_adapter_export_name(kind: str, dtype: str, export: str) -> str:
    """The folder name of ``kind``'s export for IP-Adapter under ``--work``."""
    return f"{kind}-ip-adapter-{dtype}-{export}"


def ensure_ip_adapter_export(kind: str, dtype: str, export: str, work: Path) -> Path:
    """The export of ``kind`` for IP-Adapter (``export_pipeline(..., ip_adapter=True)``: a UNet that takes each
    cross-attention layer's image-prompt keys and values, and ``image_encoder/``, :func:`build_ip_adapter_pipeline`)
    under ``work``, made once and shared as :func:`ensure_export` shares the others; a model it cannot take refused
    before any work."""
    _check_ip_adapter_model(kind)
    return _ensure_pipeline_export(
        work / ip_adapter_export_name(kind, dtype, export),
        dtype,
        export,
        lambda: build_ip_adapter_pipeline(kind),
        ip_adapter=True,
    )


def random_ip_adapter_state_dict(
    layer_widths: Sequence[int], cross_attention_dim: int, image_embed_dim: int, seed: int = 0
) -> Dict[str, Dict[str, Any]]:
    """A plain IP-Adapter with random weights (weights do not change speed) in its files' format, as
    ``load_ip_adapter`` reads them: ``image_proj`` (``proj``: the image encoder's ``image_embeds``,
    ``image_embed_dim`` wide, to :data:`IP_ADAPTER_TOKENS` image-prompt tokens of ``cross_attention_dim``; their
    ``norm``) and ``ip_adapter`` (``{2i + 1}.to_k_ip`` / ``to_v_ip``: from the tokens to the ``i``-th cross-attention
    layer's width ``layer_widths[i]``). Weights at a linear layer's initial scale (1 / √ its input width)."""
    import torch

    generator = torch.Generator().manual_seed(seed)

    def linear(out_width: int, in_width: int) -> torch.Tensor:
        return torch.randn(out_width, in_width, generator=generator) / in_width**0.5

    weights = {}
    for index, width in enumerate(layer_widths):
        weights[f"{2 * index + 1}.to_k_ip.weight"] = linear(width, cross_attention_dim)
        weights[f"{2 * index + 1}.to_v_ip.weight"] = linear(width, cross_attention_dim)
    image_proj = {
        "proj.weight": linear(IP_ADAPTER_TOKENS * cross_attention_dim, image_embed_dim),
        "proj.bias": torch.zeros(IP_ADAPTER_TOKENS * cross_attention_dim),
        "norm.weight": torch.ones(cross_attention_dim),
        "norm.bias": torch.zeros(cross_attention_dim),
    }
    return {"image_proj": image_proj, "ip_adapter": weights}


def _ensure_pipeline_export(
    folder: Path,
    dtype: str,
    export: str,
    build: Callable[[], Any],
    device: str = "cuda",
    step_cache: bool = False,
    components: Optional[Sequence[str]] = None,
    vae_dtype: Optional[str] = None,
    ip_adapter: bool = False,
) -> Path:
    """``folder``: the export of the torch pipeline ``build()`` makes, made once under the folder's lock; an
    "optimized" export gets the fusions ``device``'s execution provider runs (:func:`optimize_target`);
    ``step_cache``: with the parts a step cache runs (``export_pipeline(step_cache=True)``); ``components``: which
    of them to write (default: all the pipeline has); ``vae_dtype``: a Wan VAE's own precision; ``ip_adapter``: a
    UNet that takes IP-Adapter's image prompt (``export_pipeline(ip_adapter=True)``)."""
    from ..export import export_pipeline

    folder.parent.mkdir(parents=True, exist_ok=True)
    with _ExportLock(folder.parent / f".{folder.name}.lock"):
        if not (folder / "model_index.json").is_file():
            if folder.exists():  # not one of ours (ours appear whole, by a rename): never delete it
                raise FileExistsError(
                    f"--work: {str(folder)!r} exists but is not a finished export (no "
                    "model_index.json); move it away or choose another --work folder"
                )
            # export_pipeline builds beside the folder and renames it into place once whole
            export_pipeline(
                None,
                folder,
                dtype=dtype,
                optimize=optimize_target(export, device),
                progress=False,
                torch_pipeline=build(),
                step_cache=step_cache,
                components=components,
                **({"vae_dtype": vae_dtype} if vae_dtype is not None else {}),
                **({"ip_adapter": True} if ip_adapter else {}),
            )
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


# ------------------------------------------------------------------------------ the transformer scenario's models
# ``--scenario transformer``: SD3.5 Medium's and FLUX.1's architectures (random weights) at their own recipes, and
# tiny versions of both for the CPU. ``family``: which pipelines run it; ``steps``/``short_steps``: the step counts
# whose difference gives the per-step time; ``max_sequence_length``: T5's tokens; ``guidance``: diffusers' defaults
# (SD3.5: CFG 7 at 28 steps; FLUX.1 schnell: 4 steps, no guidance; FLUX.1 dev: 28 steps, embedded guidance 3.5).
TRANSFORMER_RECIPES: Dict[str, Dict[str, Any]] = {
    "sd35m": dict(family="sd3", size=1024, steps=28, short_steps=2, guidance=7.0, max_sequence_length=256),
    "flux-schnell": dict(family="flux", size=1024, steps=4, short_steps=1, guidance=0.0, max_sequence_length=256),
    "flux-dev": dict(family="flux", size=1024, steps=28, short_steps=2, guidance=3.5, max_sequence_length=512),
    "tiny-sd3": dict(family="sd3", size=64, steps=3, short_steps=1, guidance=7.0, max_sequence_length=16),
    "tiny-flux": dict(family="flux", size=64, steps=3, short_steps=1, guidance=0.0, max_sequence_length=16),
}
# the full models' transformer depth: (double-stream blocks, single-stream blocks); SD3's are all joint blocks
TRANSFORMER_BLOCKS = {
    "sd35m": (24, 0),
    "flux-schnell": (19, 38),
    "flux-dev": (19, 38),
    "tiny-sd3": (2, 0),
    "tiny-flux": (1, 1),
}
# the text encoders' depth in the full models: CLIP ViT-L, OpenCLIP bigG (SD3 only), T5-XXL's encoder
TEXT_LAYERS = {"clip_l": 12, "clip_g": 32, "t5": 24}


def transformer_blocks(kind: str, blocks: Optional[int]) -> Optional[Tuple[int, int]]:
    """The (double, single) block counts ``--blocks N`` builds: SD3's first ``N`` joint blocks; FLUX.1's first ``N``
    double-stream and ``2 N`` single-stream blocks (the full model's 19:38), each at most the full model's. ``None``
    where the model keeps its own depth (no ``--blocks``)."""
    if blocks is None:
        return None
    double, single = TRANSFORMER_BLOCKS[kind]
    return min(blocks, double), min(2 * blocks, single)


def transformer_export_name(
    kind: str, dtype: str, export: str, blocks: Optional[int], text_layers: Optional[int], device: str = "cuda"
) -> str:
    """The folder name of one transformer export under ``--work``: every setting that changes the files is in it (an
    optimized export for the CPU ends its name in ``-cpu``; a plain one is the same files for either device)."""
    name = f"{kind}-{dtype}-{export}"
    if optimize_target(export, device) == "cpu":
        name += "-cpu"
    depth = transformer_blocks(kind, blocks)
    if depth is not None:
        name += f"-blocks{depth[0]}x{depth[1]}"
    if text_layers is not None and not kind.startswith("tiny"):
        name += f"-text{text_layers}"
    return name


def build_transformer_pipeline(
    kind: str, blocks: Optional[int] = None, text_layers: Optional[int] = None, seed: int = 0
):
    """A random-weights diffusers pipeline of ``kind`` (:data:`TRANSFORMER_RECIPES`): ``StableDiffusion3Pipeline`` with
    SD3.5 Medium's MMDiT, CLIP-L, CLIP-G and T5-XXL's encoder, or ``FluxPipeline`` with FLUX.1's transformer (dev:
    with the guidance embedding), CLIP-L and T5-XXL's encoder; the tiny ones from :mod:`optimum_iobinding.export.tiny`.
    Weights are drawn in the current default dtype and device.

    Args:
        kind: a key of :data:`TRANSFORMER_RECIPES`.
        blocks: build the transformer with fewer blocks, full width (:func:`transformer_blocks`).
        text_layers: at most this many layers in each text encoder; full models only.
        seed: the random weights' seed.
    """
    import torch

    if kind not in TRANSFORMER_RECIPES:
        raise ArgumentError("model", f"expected one of {', '.join(TRANSFORMER_RECIPES)}, got {kind!r}")
    if kind.startswith("tiny"):
        return _tiny_transformer_pipeline(kind, blocks, seed)
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from ..export.tiny import write_tiny_t5_tokenizer, write_tiny_tokenizer

    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory() as folder:
        tokenizer = write_tiny_tokenizer(Path(folder) / "clip")
        tokenizer_t5 = write_tiny_t5_tokenizer(Path(folder) / "t5")
    depth = lambda name: min(TEXT_LAYERS[name], text_layers or TEXT_LAYERS[name])  # noqa: E731

    def clip(width: int, layers: int, heads: int, act: str, projection: bool):
        # the real vocabularies' sizes (their embedding tables), the tiny tokenizer's special ids
        config = CLIPTextConfig(
            vocab_size=49408,
            hidden_size=width,
            intermediate_size=4 * width,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            max_position_embeddings=77,
            hidden_act=act,
            projection_dim=width,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config).eval()

    t5 = T5EncoderModel(
        T5Config(
            vocab_size=32128,
            d_model=4096,
            d_kv=64,
            d_ff=10240,
            num_layers=depth("t5"),
            num_heads=64,
            relative_attention_num_buckets=32,
            feed_forward_proj="gated-gelu",
            dropout_rate=0.0,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
            is_encoder_decoder=False,
            use_cache=False,
        )
    ).eval()
    recipe = TRANSFORMER_RECIPES[kind]
    double, single = transformer_blocks(kind, blocks) or TRANSFORMER_BLOCKS[kind]
    if recipe["family"] == "sd3":
        from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

        transformer = SD3Transformer2DModel(
            sample_size=128,
            patch_size=2,
            in_channels=16,
            out_channels=16,
            num_layers=double,
            attention_head_dim=64,
            num_attention_heads=24,
            joint_attention_dim=4096,
            caption_projection_dim=1536,
            pooled_projection_dim=2048,
            pos_embed_max_size=384,
            dual_attention_layers=tuple(range(min(13, double))),
            qk_norm="rms_norm",
        )
        return StableDiffusion3Pipeline(
            transformer=transformer,
            scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
            vae=_transformer_vae(AutoencoderKL, scaling_factor=1.5305, shift_factor=0.0609),
            text_encoder=clip(768, depth("clip_l"), 12, "quick_gelu", True),
            tokenizer=tokenizer,
            text_encoder_2=clip(1280, depth("clip_g"), 20, "gelu", True),
            tokenizer_2=tokenizer,
            text_encoder_3=t5,
            tokenizer_3=tokenizer_t5,
        )
    from diffusers import FluxPipeline, FluxTransformer2DModel

    dev = kind == "flux-dev"
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,
        num_layers=double,
        num_single_layers=single,
        attention_head_dim=128,
        num_attention_heads=24,
        joint_attention_dim=4096,
        pooled_projection_dim=768,
        guidance_embeds=dev,
        axes_dims_rope=(16, 56, 56),
    )
    # FLUX.1 dev's schedule shifts with the resolution; schnell's has a fixed shift of 1
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0 if dev else 1.0,
        use_dynamic_shifting=dev,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    return FluxPipeline(
        scheduler=scheduler,
        vae=_transformer_vae(AutoencoderKL, scaling_factor=0.3611, shift_factor=0.1159),
        text_encoder=clip(768, depth("clip_l"), 12, "quick_gelu", False),
        tokenizer=tokenizer,
        text_encoder_2=t5,
        tokenizer_2=tokenizer_t5,
        transformer=transformer,
    )


def _tiny_transformer_pipeline(kind: str, blocks: Optional[int], seed: int):
    """The tiny SD3 or FLUX.1 pipeline of :mod:`optimum_iobinding.export.tiny`; with ``blocks``, its transformer
    rebuilt from its own config with fewer blocks (so that the CPU runs exercise ``--blocks``)."""
    import torch
    from ..export.tiny import build_tiny_random_flux_pipeline, build_tiny_random_sd3_pipeline

    pipe = (build_tiny_random_sd3_pipeline if kind == "tiny-sd3" else build_tiny_random_flux_pipeline)(seed)
    depth = transformer_blocks(kind, blocks)
    if depth is not None:
        config = dict(pipe.transformer.config)
        overrides: Dict[str, Any] = {"num_layers": depth[0]}
        if "num_single_layers" in config:
            overrides["num_single_layers"] = depth[1]
        if "dual_attention_layers" in config:
            overrides["dual_attention_layers"] = tuple(i for i in config["dual_attention_layers"] if i < depth[0])
        torch.manual_seed(seed)
        pipe.register_modules(transformer=type(pipe.transformer).from_config(config, **overrides).eval())
    return pipe


def _transformer_vae(autoencoder: Any, scaling_factor: float, shift_factor: float):
    """SD3's and FLUX.1's VAE: SD's four blocks with 16 latent channels and no quant convolutions."""
    return autoencoder(
        in_channels=3,
        out_channels=3,
        block_out_channels=(128, 256, 512, 512),
        layers_per_block=2,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=16,
        sample_size=1024,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def ensure_transformer_export(
    kind: str,
    dtype: str,
    export: str,
    work: Path,
    blocks: Optional[int] = None,
    text_layers: Optional[int] = None,
    device: str = "cuda",
) -> Path:
    """The export of one transformer configuration under ``work`` (:func:`transformer_export_name`), made once and
    shared as :func:`ensure_export` shares the UNet pipelines', with the parts First-Block Cache runs. The exporter
    decides each component's precision (T5 stays float32 in a float16 export; a bf16 export's transformer is bfloat16,
    its CLIP and VAE float16) and writes external data for the large ones; ``device``: where the export runs, which
    decides an optimized export's fusions (:func:`optimize_target`)."""
    folder = work / transformer_export_name(kind, dtype, export, blocks, text_layers, device)
    # with First-Block Cache's parts (files beside the transformer that the uncached runs never read) where the
    # transformer has a block to skip
    depth = transformer_blocks(kind, blocks) or TRANSFORMER_BLOCKS[kind]
    return _ensure_pipeline_export(
        folder,
        dtype,
        export,
        lambda: build_transformer_pipeline(kind, blocks, text_layers),
        device,
        step_cache=sum(depth) >= 2,
    )


# ------------------------------------------------------------------------------------ the video scenario's models
# ``--scenario video``: Wan 2.1 T2V 1.3B's architecture (random weights) at diffusers' recipe of its model card — 480 ×
# 832, 81 frames, classifier-free guidance 5, UniPC with flow shift 3, 50 steps (a run times ``--steps`` of them), the
# transformer and UMT5 in bfloat16 and the VAE in float32 for diffusers' pipeline — and a tiny version for the CPU.
# ``recipe_steps``: the model card's step count (the report states it beside the steps timed); ``steps``: the steps a
# run times unless ``--steps`` says otherwise; ``replays``: the floor's back-to-back graph replays (of about a second
# each at full size).
VIDEO_RECIPES: Dict[str, Dict[str, Any]] = {
    "wan2.1-t2v-1.3b": dict(
        height=480, width=832, num_frames=81, guidance=5.0, recipe_steps=50, max_sequence_length=512, steps=4, replays=5
    ),
    "tiny-wan": dict(
        height=32, width=32, num_frames=9, guidance=5.0, recipe_steps=50, max_sequence_length=16, steps=3, replays=20
    ),
}
# The MLPerf Inference v6.0 text-to-video shape: Wan 2.2 T2V A14B's transformer (one of its two experts runs each
# step) at 720 × 1280, 81 frames, two rows (classifier-free guidance), UMT5's 512 tokens; and a tiny one for the CPU.
MLPERF_VIDEO_RECIPES: Dict[str, Dict[str, Any]] = {
    "wan2.2-t2v-a14b": dict(height=720, width=1280, num_frames=81, max_sequence_length=512, rows=2),
    "tiny-wan": dict(height=32, width=48, num_frames=9, max_sequence_length=16, rows=2),
}
# the configs of diffusers' WanTransformer3DModel of the hub's Wan-AI/Wan2.1-T2V-1.3B-Diffusers and
# Wan-AI/Wan2.2-T2V-A14B-Diffusers (transformer/config.json)
WAN_TRANSFORMER_CONFIGS: Dict[str, Dict[str, Any]] = {
    "wan2.1-t2v-1.3b": dict(
        patch_size=(1, 2, 2),
        num_attention_heads=12,
        attention_head_dim=128,
        in_channels=16,
        out_channels=16,
        text_dim=4096,
        freq_dim=256,
        ffn_dim=8960,
        num_layers=30,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        rope_max_seq_len=1024,
    ),
    "wan2.2-t2v-a14b": dict(
        patch_size=(1, 2, 2),
        num_attention_heads=40,
        attention_head_dim=128,
        in_channels=16,
        out_channels=16,
        text_dim=4096,
        freq_dim=256,
        ffn_dim=13824,
        num_layers=40,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        rope_max_seq_len=1024,
    ),
}
# the tiny Wan transformer's depth (optimum_iobinding.export.tiny)
TINY_WAN_BLOCKS = 2
# Wan's UMT5-XXL encoder: 24 layers of width 4096 and its vocabulary (the embedding table's real size); the video
# scenario keeps VIDEO_TEXT_LAYERS of them unless told otherwise (the text encoder runs once per video)
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64)
VIDEO_TEXT_LAYERS = 2
# what a Wan text-to-video export holds for the video scenario (no VAE encoder: text to video never encodes)
VIDEO_COMPONENTS = ("text_encoder", "transformer", "vae_decoder")


def wan_full_blocks(kind: str) -> int:
    """The transformer depth of ``kind`` (a key of :data:`WAN_TRANSFORMER_CONFIGS`, or ``tiny-wan``)."""
    return TINY_WAN_BLOCKS if kind == "tiny-wan" else WAN_TRANSFORMER_CONFIGS[kind]["num_layers"]


def wan_blocks(kind: str, blocks: Optional[int]) -> Optional[int]:
    """The transformer blocks ``--blocks N`` builds (at most the full model's); ``None`` where the model keeps its
    own depth."""
    return None if blocks is None else min(blocks, wan_full_blocks(kind))


def build_wan_transformer(kind: str, blocks: Optional[int] = None, seed: int = 0):
    """A random-weights ``WanTransformer3DModel`` of ``kind`` (:data:`WAN_TRANSFORMER_CONFIGS`, or ``tiny-wan``: the
    tiny pipeline's) with ``blocks`` of its blocks (full width), in the current default dtype and device."""
    import torch

    if kind == "tiny-wan":
        from ..export.tiny import build_tiny_random_wan_pipeline

        config = dict(build_tiny_random_wan_pipeline(seed).transformer.config)
    elif kind in WAN_TRANSFORMER_CONFIGS:
        config = dict(WAN_TRANSFORMER_CONFIGS[kind])
    else:
        raise ArgumentError(
            "model", f"expected one of {', '.join([*WAN_TRANSFORMER_CONFIGS, 'tiny-wan'])}, got {kind!r}"
        )
    from diffusers import WanTransformer3DModel

    config["num_layers"] = wan_blocks(kind, blocks) or wan_full_blocks(kind)
    torch.manual_seed(seed)
    return WanTransformer3DModel.from_config(config).eval()


def build_wan21_vae():
    """A random-weights ``AutoencoderKLWan`` at Wan 2.1's config (base width 96, z 16, widths × 1, 2, 4, 4, 2 residual
    blocks, temporal downsampling in the last two stages), drawn from torch's current generator."""
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(
        base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True]
    ).eval()


def build_video_pipeline(kind: str, blocks: Optional[int] = None, text_layers: Optional[int] = None, seed: int = 0):
    """A random-weights diffusers ``WanPipeline`` of ``kind`` (:data:`VIDEO_RECIPES`): Wan 2.1 T2V 1.3B's transformer
    (:data:`WAN_TRANSFORMER_CONFIGS`), its VAE (``AutoencoderKLWan`` at Wan 2.1's config: base width 96, z 16, widths
    × 1, 2, 4, 4, 2 residual blocks, temporal downsampling in the last two stages), UMT5-XXL's encoder at full width
    with ``text_layers`` of its 24 layers (default :data:`VIDEO_TEXT_LAYERS`; the tiny T5 tokenizer: the vocabulary
    is the embedding table's, the tokens the tiny one's), and Wan 2.1's scheduler (UniPC, flow sigmas, shift 3); the
    tiny one from :mod:`optimum_iobinding.export.tiny` (``blocks``: its transformer rebuilt with fewer). Weights are
    drawn in the current default dtype and device.

    Args:
        kind: a key of :data:`VIDEO_RECIPES`.
        blocks: build the transformer with fewer blocks, full width.
        text_layers: at most this many UMT5 layers (full model only).
        seed: the random weights' seed.
    """
    import torch

    if kind not in VIDEO_RECIPES:
        raise ArgumentError("model", f"expected one of {', '.join(VIDEO_RECIPES)}, got {kind!r}")
    if kind == "tiny-wan":
        from ..export.tiny import build_tiny_random_wan_pipeline

        pipe = build_tiny_random_wan_pipeline(seed)
        if blocks is not None:
            pipe.register_modules(transformer=build_wan_transformer(kind, blocks, seed))
        return pipe
    from diffusers import UniPCMultistepScheduler, WanPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    from ..export.tiny import write_tiny_t5_tokenizer

    with tempfile.TemporaryDirectory() as folder:
        tokenizer = write_tiny_t5_tokenizer(folder)
    torch.manual_seed(seed)
    text_encoder = UMT5EncoderModel(
        UMT5Config(
            **{**UMT5_XXL, "num_layers": min(UMT5_XXL["num_layers"], text_layers or VIDEO_TEXT_LAYERS)},
            relative_attention_num_buckets=32,
            relative_attention_max_distance=128,
            feed_forward_proj="gated-gelu",
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.pad_token_id,
            is_encoder_decoder=False,
            tie_word_embeddings=False,
            use_cache=False,
            dropout_rate=0.0,
        )
    ).eval()
    vae = build_wan21_vae()
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=3.0
    )
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=scheduler,
        transformer=build_wan_transformer(kind, blocks, seed),
    )


def video_export_name(
    kind: str,
    dtype: str,
    export: str,
    blocks: Optional[int],
    text_layers: Optional[int],
    device: str = "cuda",
    vae_dtype: Optional[str] = None,
) -> str:
    """The folder name of one video export under ``--work``: every setting that changes the files is in it."""
    name = f"{kind}-{dtype}-{export}" + ("-vae16" if vae_dtype == "fp16" else "")
    if optimize_target(export, device) == "cpu":
        name += "-cpu"
    depth = wan_blocks(kind, blocks)
    if depth is not None:
        name += f"-blocks{depth}"
    if kind != "tiny-wan":
        name += f"-text{text_layers or VIDEO_TEXT_LAYERS}"
    return name


def ensure_video_export(
    kind: str,
    dtype: str,
    export: str,
    work: Path,
    blocks: Optional[int] = None,
    text_layers: Optional[int] = None,
    device: str = "cuda",
    vae_dtype: Optional[str] = None,
) -> Path:
    """The export of one video configuration under ``work`` (:func:`video_export_name`): UMT5, the transformer and
    the VAE decoder (:data:`VIDEO_COMPONENTS`), made once and shared as :func:`ensure_export` shares the others. The
    exporter decides each component's precision (UMT5 float32, the VAE float32 unless ``vae_dtype="fp16"``; the
    transformer ``dtype``) and writes external data for the large ones."""
    folder = work / video_export_name(kind, dtype, export, blocks, text_layers, device, vae_dtype)
    return _ensure_pipeline_export(
        folder,
        dtype,
        export,
        lambda: build_video_pipeline(kind, blocks, text_layers),
        device,
        components=VIDEO_COMPONENTS,
        vae_dtype=vae_dtype,
    )


def mlperf_export_name(kind: str, dtype: str, export: str, blocks: int, device: str = "cuda") -> str:
    """The folder name of one MLPerf-shape transformer export under ``--work``."""
    name = f"{kind}-transformer-{dtype}-{export}"
    if optimize_target(export, device) == "cpu":
        name += "-cpu"
    return f"{name}-blocks{wan_blocks(kind, blocks)}"


def ensure_mlperf_export(kind: str, dtype: str, export: str, work: Path, blocks: int, device: str = "cuda") -> Path:
    """The export of the MLPerf shape's transformer alone (``transformer/``, with ``blocks`` of its blocks) under
    ``work``, made once and shared: a Wan folder whose other components (the tiny pipeline's) are not written."""

    def build() -> Any:
        from ..export.tiny import build_tiny_random_wan_pipeline

        pipe = build_tiny_random_wan_pipeline()
        pipe.register_modules(transformer=build_wan_transformer(kind, blocks))
        return pipe

    folder = work / mlperf_export_name(kind, dtype, export, blocks, device)
    return _ensure_pipeline_export(folder, dtype, export, build, device, components=("transformer",))
