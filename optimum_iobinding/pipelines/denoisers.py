"""The denoisers: the model a pipeline calls at every step, as a part its family declares. Each owns what its model
takes (the inputs and their checks), what an image's size must be a multiple of, the latent channels it denoises, the
default sample size, its step cache, and the component that must be captured (its family's denoiser).

- :class:`UNetDenoiser`: SD 1.x/2.x, SDXL, LCM, ControlNet, inpainting (extra inputs and channels per family);
- :class:`MMDiTDenoiser`: Stable Diffusion 3 / 3.5's transformer, flow matching, CFG in one batch;
- :class:`FluxDenoiser`: FLUX.1's transformer over 2×2-packed latent tokens with rotary position ids, true CFG;
- :class:`WanDenoiser`: Wan's video transformer(s) over latent videos, CFG in one batch, Wan 2.2's two experts.

Each fills the one denoising loop's hooks (:func:`.loop.denoise`): ``sample_input``, ``scale_model_input``,
``timestep_inputs``, ``conditioning``, ``copies_unguided_output``, ``step_model`` (the model or its step cache).
A part reads the pipeline's public surface only (its components, ``scheduler``, ``device``, ``progress_bar``,
``family``)."""

from __future__ import annotations

import abc
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import numpy as np
import torch

from .part import PipelinePart
from ..errors import ArgumentError, ModelFileError
from ..families import FAMILIES, FLUX_GUIDANCE, UNET_INPUTS, WAN_TRANSFORMERS, detect, family
from ..runtime.model import IOBindingORTModel
from .arguments import is_integer
from .caching import StepCache
from .components import component_kind, declared_dim
from .loop import GraphFeed, Guidance, replaced_tensors
from .transfer import upload


def family_hint(
    component: str, declared: Sequence[str], channels: Optional[Dict[str, Optional[int]]] = None
) -> Optional[str]:
    """What a denoiser taking ``declared`` (of these ``channels``, by component, where known) is, by the family whose
    interface it matches (``None``: none), for a refusal of a model in the wrong folder: ``"a UNet (SDXL): use"`` and
    the SDXL pipeline's class."""
    # every folder a text-to-image family may need is assumed there: the hint names the text-to-image pipeline first
    record = detect(None, {"unet": declared, "transformer": declared}, channels, folders=("text_encoder",))
    if record is None:
        return None
    kind = "UNet" if record.denoiser == "unet" else "transformer"
    sibling = f" or {family(record.image_to_image).class_name}" if record.image_to_image else ""
    return f"a {kind} ({record.title}): use {record.class_name}{sibling}"


def config_int(model: IOBindingORTModel, key: str, default: int, component: str) -> int:
    """A positive integer from a component's config.json (``default`` where absent), or an error naming it."""
    value = model.config.get(key, default)
    if not is_integer(value) or value <= 0:
        raise ModelFileError(f"{component} config.json", f"{key}: expected a positive integer, got {value!r}")
    return int(value)


def timestep_shape(model: IOBindingORTModel, rows: int) -> Tuple[int, ...]:
    """The shape of ``model``'s ``timestep`` input in a step of ``rows`` rows, as the model declares its rank: a
    scalar, ``[1]`` or ``[rows]``."""
    timestep_dims = model.input_dims["timestep"] or []
    if len(timestep_dims) == 0:
        return ()
    return (1,) if timestep_dims[0] == 1 else (rows,)


def timestep_inputs(model: IOBindingORTModel, timesteps: torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    """``model``'s ``timestep`` input for every step, made once on ``device``: row ``i`` is step ``i``'s, in the dtype
    and the shape the model declares (:func:`timestep_shape`)."""
    shape = timestep_shape(model, rows)
    values = timesteps.to(dtype=model.input_dtypes["timestep"])
    if device.type == "cuda":
        # from pinned memory the upload is asynchronous: a pageable one would make the host wait
        values = upload(values, device)
    return values.reshape(-1, *(1 for _ in shape)).expand(-1, *shape).contiguous()


class Denoiser(PipelinePart, abc.ABC):
    """What every denoiser offers its pipeline. ``component`` is the pipeline component it runs: the one whose
    session decides where the loop's tensors live, whose stream the call runs on, and whose CUDA graphs
    ``cuda_graph=True`` requires."""

    #: the input the loop's latents go into
    sample_input = "sample"
    #: the axis of the latents' channels, on which the loop concatenates a family's extra channels
    channel_dim = 1
    #: whether the loop copies an unguided prediction before the scheduler step (see :func:`.loop.denoise`)
    copies_unguided_output = False

    def __init__(self, pipe: Any, default_sample_size: int):
        super().__init__(pipe)
        self.fallback_sample_size = default_sample_size
        self.cache: Optional[StepCache] = None

    def make_cache(self, config: Any) -> StepCache:
        """The step cache ``config`` asks for on this denoiser (the families that can cache override it).

        Raises:
            ArgumentError: this family cannot cache steps."""
        cached = {"first-block": "FirstBlockCacheConfig", "deepcache": "DeepCacheConfig"}
        caching = ", ".join(
            f"{cached[record.step_cache]}: {record.class_name}" for record in FAMILIES if record.step_cache
        )
        raise ArgumentError(
            "config",
            f"{type(self.pipe).__name__} cannot cache steps, got {type(config).__name__}; expected a pipeline of a "
            f"family that caches ({caching})",
        )

    def enable_cache(self, config: Any) -> None:
        """Caches steps as ``config`` says from the next call on (see :meth:`make_cache`); nothing changes where it
        is refused."""
        self.cache = self.make_cache(config)

    def disable_cache(self) -> None:
        self.cache = None

    def cache_groups(self, guidance: Optional[Guidance]) -> int:
        """How many slices of a step's batch an enabled step cache decides apart (:meth:`StepCache.start`): one, as
        diffusers decides for a batch it makes (SD3's guided batch); the families whose diffusers pipeline calls the
        model once per prompt kind, each call in a cache context of its own, say so here."""
        return 1

    def step_model(
        self, steps: int, model: Optional[IOBindingORTModel] = None, guidance: Optional[Guidance] = None
    ) -> Tuple[Callable[[int, Dict[str, torch.Tensor]], torch.Tensor], Optional[IOBindingORTModel]]:
        """What a loop of ``steps`` steps calls at each step (``run(step, inputs) -> output``: the model, or the
        enabled cache), and the model whose CUDA-graph input buffers the loop may write into (:class:`GraphFeed`).
        ``model``: another of the pipeline's models of the same inputs (a later :class:`~.loop.Stage`'s), run
        through the cache where the cache runs it (:meth:`StepCache.switch`), else whole. ``guidance``: how the
        loop guides (the cache's groups, :meth:`cache_groups`)."""
        cache = self.cache
        if cache is not None and model is None:
            cache.start(steps, self.cache_groups(guidance))
            return cache, cache.feed_model
        if cache is not None and cache.switch(model):
            return cache, cache.feed_model
        model = self.model if model is None else model
        return (lambda step, inputs: model(**inputs)[0]), model

    @property
    def component(self) -> str:
        """The pipeline component it runs (its family's denoiser: ``"unet"`` or ``"transformer"``)."""
        return self.pipe.family.denoiser

    @property
    def callback_tensor_inputs(self) -> Tuple[str, ...]:
        """The loop's tensors a step-end callback may ask for and replace (its family's)."""
        return self.pipe.family.callback_tensors

    @property
    def model(self) -> IOBindingORTModel:
        return getattr(self.pipe, self.component)

    def check_model(self) -> None:
        """Refuses, when loading, a model that is not this denoiser's (raises ``ValueError`` naming the component)."""

    @property
    def default_sample_size(self) -> int:
        """The latent size a call gets where it gives none: the model config's ``sample_size``, else the family's."""
        return config_int(self.model, "sample_size", self.fallback_sample_size, self.component)

    @property
    @abc.abstractmethod
    def size_multiple(self) -> int:
        """What heights and widths must be multiples of."""

    @property
    @abc.abstractmethod
    def size_multiple_reason(self) -> str:
        """Why :attr:`size_multiple` is what it is beyond the VAE's scale factor (for the size check's message)."""

    @abc.abstractmethod
    def latent_channels(self, vae_decoder: IOBindingORTModel) -> int:
        """The channels of the latents it denoises, read from the model and checked against ``vae_decoder``."""

    def timestep_inputs(self, timesteps: torch.Tensor, rows: int, latent_shape: Sequence[int] = ()) -> torch.Tensor:
        """The model's ``timestep`` input for every step (see :func:`timestep_inputs`; ``latent_shape``: the loop's
        latents', for a model whose timestep input has an axis of their tokens)."""
        return timestep_inputs(self.model, timesteps, rows, self.pipe.device)

    def scale_model_input(self, latents: torch.Tensor, t: Any) -> torch.Tensor:
        """The latents as step ``t`` feeds them to the model (flow matching: as they are)."""
        return latents

    def conditioning(self, tensors: Dict[str, torch.Tensor], guidance: Guidance) -> Dict[str, torch.Tensor]:
        """The model's conditioning inputs made of the loop's tensors (``prompt_embeds``: the text states)."""
        return {"encoder_hidden_states": tensors["prompt_embeds"]}

    def step_end(
        self,
        callback: Callable[..., Any],
        names: Sequence[str],
        step: int,
        t: Any,
        available: Dict[str, torch.Tensor],
        feed: GraphFeed,
    ) -> Dict[str, torch.Tensor]:
        """Runs a step-end callback on the tensors it asked for and returns the loop's tensors with its
        replacements (the feed copies its constant inputs again: the callback may have changed them in place)."""
        feed.forget()
        tensors = {name: available[name] for name in names}
        return replaced_tensors(
            callback, step, callback(self.pipe, step, t, tensors), available, self.callback_tensor_inputs
        )


class UNetDenoiser(Denoiser):
    """A Stable Diffusion UNet: ``sample``, ``timestep``, ``encoder_hidden_states`` and the family's
    ``extra_inputs`` (SDXL's ``text_embeds``/``time_ids``, LCM's ``timestep_cond``, a ControlNet's residuals)."""

    copies_unguided_output = True

    def __init__(self, pipe: Any, default_sample_size: int = 64):
        super().__init__(pipe, default_sample_size)

    @property
    def extra_inputs(self) -> Tuple[str, ...]:
        """The inputs the family feeds beyond ``sample``, ``timestep`` and ``encoder_hidden_states``: its interface's
        (:attr:`~optimum_iobinding.families.Family.interface`), and those of its optional ones the UNet takes."""
        interface = self.pipe.family.interface
        declared = self.model.input_names
        return (
            *(name for name in interface.inputs if name not in UNET_INPUTS),
            *(name for name in interface.optional if name in declared),
        )

    def check_model(self) -> None:
        declared = self.model.input_names
        expected = [*UNET_INPUTS, *self.extra_inputs]
        optional = self.pipe.family.interface.optional_prefixed  # IP-Adapter's image-prompt inputs
        unexpected = [name for name in declared if name not in expected and not name.startswith(optional or ("\0",))]
        missing = [name for name in expected if name not in declared]
        if not unexpected and not missing:
            return
        hint = family_hint("unet", declared) if unexpected else None
        found = component_kind(declared)
        if hint is None and found not in (None, "a UNet"):
            hint = f"{found}, not a UNet: put the right model.onnx in the unet folder"
        if hint is None and missing:
            hint = f"{type(self.pipe).__name__} needs a UNet exported with {missing}"
        raise ArgumentError("unet", f"expected inputs {expected}, got {declared}" + (f" ({hint})" if hint else ""))

    def first_step_shapes(
        self, images: int, height: int, width: int, guidance: Guidance, text_shape: Tuple[int, Optional[int]]
    ) -> Optional[Dict[str, Tuple[int, ...]]]:
        """The input shapes of the UNet's first step in a text-to-image call of ``images`` images of ``height`` ×
        ``width`` under ``guidance``, whose text states are ``text_shape`` (tokens, width; ``None``: the width the UNet
        declares), known before the prompt is encoded; ``None`` where the UNet takes more than ``sample``, ``timestep``
        and ``encoder_hidden_states`` or declares no fixed width for its text states."""
        model = self.model
        if sorted(model.input_names) != sorted(UNET_INPUTS):
            return None
        rows = images * guidance.copies
        sample_dims = model.input_dims["sample"] or []
        text_dims = model.input_dims["encoder_hidden_states"] or []
        tokens, text_width = text_shape
        if text_width is None:
            text_width = text_dims[2] if len(text_dims) == 3 and isinstance(text_dims[2], int) else None
        if len(sample_dims) != 4 or text_width is None:
            return None
        _, channels, latent_height, latent_width = self.pipe.latent_shape(images, height, width)
        if isinstance(sample_dims[1], int):  # an inpainting UNet's mask and masked image channels besides the latents
            channels = sample_dims[1]
        return {
            "sample": (rows, channels, latent_height, latent_width),
            "timestep": timestep_shape(model, rows),
            "encoder_hidden_states": (rows, tokens, text_width),
        }

    def prepare_first_step(
        self, images: int, height: int, width: int, guidance: Guidance, text_shape: Tuple[int, Optional[int]]
    ) -> None:
        """Starts the UNet's first run without a graph for :meth:`first_step_shapes` in a background thread, where the
        UNet captures graphs (:meth:`IOBindingORTModel.prepare_signature`): cuDNN builds the UNet's plans while the
        text encoder runs, and the loop's first step finds them made. Nothing where the shapes are not known before
        the prompt is encoded."""
        if self.cache is not None:  # a step cache runs models of its own
            return
        shapes = self.first_step_shapes(images, height, width, guidance, text_shape)
        if shapes is not None:
            self.model.prepare_signature(shapes)

    def latent_channels(self, vae_decoder: IOBindingORTModel) -> int:
        configured = vae_decoder.config.get("latent_channels")
        if configured is not None:
            declared = {
                "vae_decoder": declared_dim(vae_decoder, "latent_sample", 1),
                "unet": declared_dim(self.model, "sample", 1),
            }
            if not is_integer(configured) or configured < 1:
                raise ModelFileError(
                    "vae_decoder config.json", f"latent_channels: expected a positive integer, got {configured!r}"
                )
            if declared["vae_decoder"] is not None and declared["vae_decoder"] != configured:
                raise ModelFileError(
                    "vae_decoder config.json",
                    f"latent_channels: expected {declared['vae_decoder']} (the "
                    f"decoder's latent_sample channels), got {configured}",
                )
            if declared["vae_decoder"] is None and declared["unet"] is not None and declared["unet"] < configured:
                raise ModelFileError(
                    "vae_decoder config.json",
                    f"latent_channels: expected at most {declared['unet']} (the "
                    f"UNet's sample channels), got {configured}",
                )
            return int(configured)
        if self.model.config.get("out_channels"):
            return int(self.model.config["out_channels"])
        channels = declared_dim(vae_decoder, "latent_sample", 1) or declared_dim(self.model, "sample", 1)
        if channels is None:
            raise ArgumentError(
                "vae_decoder", "cannot tell the number of latent channels: no config.json and a dynamic channel dim"
            )
        return channels

    @property
    def downsamples(self) -> int:
        """How often the UNet halves the latents (its down blocks minus one), from its config; 0 if unknown."""
        blocks = self.model.config.get("down_block_types") or self.model.config.get("block_out_channels")
        return max(len(blocks) - 1, 0) if isinstance(blocks, (list, tuple)) else 0

    @property
    def size_multiple(self) -> int:
        """8 × 2^(down blocks − 1) for Stable Diffusion: a latent the UNet halves to an odd size cannot be
        concatenated with its skip connection again."""
        return self.pipe.vae_scale_factor * 2**self.downsamples

    @property
    def size_multiple_reason(self) -> str:
        return f"2^{self.downsamples}, the UNet's downsamplings"

    def scale_model_input(self, latents: torch.Tensor, t: Any) -> torch.Tensor:
        return self.pipe.scheduler.scale_model_input(latents, t)

    def make_cache(self, config: Any) -> StepCache:
        """DeepCache (:mod:`.deep_cache`): a ``DeepCacheConfig``."""
        from .deep_cache import deep_cache_for

        return deep_cache_for(self, config)

    @property
    def time_cond_proj_dim(self) -> int:
        """The width of an LCM UNet's ``timestep_cond`` (the guidance embedding), declared or from its config."""
        declared = self.model.input_dims["timestep_cond"]
        if declared and isinstance(declared[-1], int):
            return declared[-1]
        if "time_cond_proj_dim" not in self.model.config:
            raise ArgumentError(
                "unet",
                "its timestep_cond width is dynamic and its config.json has no time_cond_proj_dim; "
                "expected one of them to give the guidance embedding's size",
            )
        return config_int(self.model, "time_cond_proj_dim", 0, "unet")


class FlowTransformer(Denoiser):
    """What SD3's and Flux's transformers share: the ``transformer`` component, its patch size, flow matching."""

    sample_input = "hidden_states"

    def __init__(self, pipe: Any, default_sample_size: int = 128):
        super().__init__(pipe, default_sample_size)

    def shift(self, tokens: int, max_shift: float) -> float:
        """The schedule's shift ``mu`` for ``tokens`` latent tokens (:func:`linear_shift` with the scheduler
        config's values; ``max_shift``: the family's where the config gives none)."""
        config = self.pipe.scheduler.config
        return linear_shift(
            tokens,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", max_shift),
        )

    def check_model(self) -> None:
        """The transformer must have its family's interface (:attr:`Family.interface`)."""
        declared = self.model.input_names
        interface = self.pipe.family.interface
        # the names here; a FLUX.1 transformer's token width where the latent channels are read (its own message)
        if interface.matches(declared, interface.sample_channels):
            return
        hint = family_hint(self.component, declared) or (
            f"put a {self.pipe.family.title} transformer's model.onnx in the transformer folder (optimum-iobinding "
            "export or optimum-cli export onnx)"
        )
        optional = f" (and {list(interface.optional)} where the model has them)" if interface.optional else ""
        raise ArgumentError(
            "transformer",
            f"expected inputs {list(interface.inputs)}{optional}, got {declared} in {self.model.model_path!r} ({hint})",
        )

    def make_cache(self, config: Any) -> StepCache:
        """First-Block Cache (:mod:`.block_cache`): diffusers' ``FirstBlockCacheConfig``."""
        from .block_cache import first_block_cache_for

        return first_block_cache_for(self, config)

    def set_flow_timesteps(
        self, num_inference_steps: Optional[int], sigmas: Optional[Sequence[float]], mu: Optional[float]
    ) -> torch.Tensor:
        """The scheduler's timesteps for this call (``sigmas`` when given, else ``num_inference_steps``), shifted by
        ``mu`` where given, its state kept on the CPU: its per-step scalars meet the device tensors without making
        the host wait."""
        scheduler = self.pipe.scheduler
        kwargs: Dict[str, Any] = {} if mu is None else {"mu": float(mu)}
        if sigmas is not None:
            scheduler.set_timesteps(sigmas=list(sigmas), **kwargs)
        else:
            scheduler.set_timesteps(num_inference_steps, **kwargs)
        if hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(0)
        return scheduler.timesteps


def linear_shift(tokens: int, base_tokens: int, max_tokens: int, base_shift: float, max_shift: float) -> float:
    """The resolution-dependent shift ``mu`` of a flow-matching schedule: linear in the number of latent tokens,
    ``base_shift`` at ``base_tokens`` and ``max_shift`` at ``max_tokens`` (SD3.5's and FLUX.1 dev's rule)."""
    slope = (max_shift - base_shift) / (max_tokens - base_tokens)
    return tokens * slope + base_shift - slope * base_tokens


class MMDiTDenoiser(FlowTransformer):
    """Stable Diffusion 3's MMDiT transformer: ``hidden_states`` (latents), ``encoder_hidden_states`` (CLIP and T5
    tokens), ``pooled_projections`` and ``timestep``; cut into patches of ``patch_size``."""

    def conditioning(self, tensors: Dict[str, torch.Tensor], guidance: Guidance) -> Dict[str, torch.Tensor]:
        """The text states and both CLIPs' pooled projections (``[negative; positive]`` with guidance)."""
        return {
            "encoder_hidden_states": tensors["prompt_embeds"],
            "pooled_projections": tensors["pooled_prompt_embeds"],
        }

    @property
    def patch_size(self) -> int:
        return config_int(self.model, "patch_size", 2, "transformer")

    @property
    def size_multiple(self) -> int:
        """The VAE's scale factor times the transformer's patch size: the transformer cuts the latents into
        patches."""
        return self.pipe.vae_scale_factor * self.patch_size

    @property
    def size_multiple_reason(self) -> str:
        return f"the transformer's patch size {self.patch_size}"

    @property
    def joint_attention_dim(self) -> int:
        """The width of the transformer's ``encoder_hidden_states`` (T5's width)."""
        declared = declared_dim(self.model, "encoder_hidden_states", 2)
        return declared or config_int(self.model, "joint_attention_dim", 4096, "transformer")

    def latent_channels(self, vae_decoder: IOBindingORTModel) -> int:
        configured = self.model.config.get("out_channels") or self.model.config.get("in_channels")
        declared = declared_dim(self.model, "hidden_states", 1)
        decoder = declared_dim(vae_decoder, "latent_sample", 1) or vae_decoder.config.get("latent_channels")
        channels = declared or configured or decoder
        if not is_integer(channels) or channels < 1:
            raise ArgumentError(
                "transformer", "cannot tell the number of latent channels: no config.json and a dynamic channel dim"
            )
        if decoder is not None and decoder != channels:
            raise ArgumentError(
                "vae_decoder", f"expected {channels} latent channels (the transformer's hidden_states), got {decoder}"
            )
        return int(channels)

    def timesteps(
        self,
        num_inference_steps: Optional[int],
        sigmas: Optional[Sequence[float]],
        mu: Optional[float],
        latent_height: int,
        latent_width: int,
    ) -> torch.Tensor:
        """The schedule of a call. With ``use_dynamic_shifting`` (SD3.5) and no ``mu``, ``mu`` is the shift for this
        image's token count (:func:`linear_shift` with the scheduler config's values, as diffusers computes it)."""
        if mu is None and self.pipe.scheduler.config.get("use_dynamic_shifting", False):
            mu = self.shift((latent_height // self.patch_size) * (latent_width // self.patch_size), max_shift=1.16)
        return self.set_flow_timesteps(num_inference_steps, sigmas, mu)


def latent_image_ids(height: int, width: int) -> torch.Tensor:
    """The rotary position ids of the packed tokens of a ``height`` × ``width`` token grid: ``(0, row, column)``."""
    rows = torch.arange(height, dtype=torch.float32)[:, None].expand(height, width)
    columns = torch.arange(width, dtype=torch.float32)[None, :].expand(height, width)
    return torch.stack([torch.zeros_like(rows), rows, columns], dim=-1).reshape(height * width, 3)


ExtraWidths = Callable[[int, int], Dict[str, int]]


class FluxDenoiser(FlowTransformer):
    """FLUX.1's transformer: latent tokens of 2×2 patches (``hidden_states``), T5 tokens, CLIP's pooled prompt,
    ``timestep`` (t / 1000), rotary position ids of both (``txt_ids``, ``img_ids``) and, for FLUX.1 dev, the distilled
    ``guidance`` scale.

    Args:
        pipe: the pipeline.
        default_sample_size: the latent size a call gets where it gives none.
        extra_widths: ``extra_widths(latent_channels, vae_scale_factor) -> {what: width}``: what the family
            concatenates to each latent token's values (FLUX.1 Fill: its masked image's packed latents and its packed
            mask; Control: its control image's packed latents), so that the transformer's token width is checked
            when it loads; ``None``: nothing (FLUX.1, Kontext).
    """

    #: packed tokens ``(batch, tokens, values)``: a token's values are its channels
    channel_dim = 2

    def __init__(self, pipe: Any, default_sample_size: int = 128, extra_widths: Optional[ExtraWidths] = None):
        super().__init__(pipe, default_sample_size)
        self.extra_widths = extra_widths

    def conditioning(self, tensors: Dict[str, torch.Tensor], guidance: Guidance) -> Dict[str, torch.Tensor]:
        """T5's states and CLIP's pooled prompt; with true CFG the negative ones first, in one batch."""
        if not guidance.batched:
            return {
                "encoder_hidden_states": tensors["prompt_embeds"],
                "pooled_projections": tensors["pooled_prompt_embeds"],
            }
        return {
            "encoder_hidden_states": torch.cat([tensors["negative_prompt_embeds"], tensors["prompt_embeds"]]),
            "pooled_projections": torch.cat(
                [tensors["negative_pooled_prompt_embeds"], tensors["pooled_prompt_embeds"]]
            ),
        }

    def timestep_inputs(self, timesteps: torch.Tensor, rows: int, latent_shape: Sequence[int] = ()) -> torch.Tensor:
        """The transformer's ``timestep`` (t / 1000, computed in the latents' dtype as diffusers does) for every step
        and row, made once on the device."""
        dtype = self.model.input_dtypes["hidden_states"]
        values = (timesteps.to(dtype) / 1000).to(self.model.input_dtypes["timestep"])
        return upload(values[:, None].expand(-1, rows).contiguous(), self.pipe.device)

    @property
    def default_sample_size(self) -> int:
        """diffusers' FluxPipeline default: 128 latent pixels, whatever the config says."""
        return self.fallback_sample_size

    @property
    def guidance_embeds(self) -> bool:
        """Whether the transformer takes the guidance scale as an input (FLUX.1 dev), or not (schnell)."""
        return FLUX_GUIDANCE in self.model.input_names

    @property
    def size_multiple(self) -> int:
        """The VAE's scale factor × 2 (the 2×2 token packing)."""
        return self.pipe.vae_scale_factor * 2

    @property
    def size_multiple_reason(self) -> str:
        return "2, Flux's 2×2 packing of latents into tokens"

    @property
    def token_width(self) -> Optional[int]:
        """The values per token the transformer takes (its ``hidden_states``' last dim, else its config's
        ``in_channels``; ``None``: unknown)."""
        width = declared_dim(self.model, "hidden_states", 2) or self.model.config.get("in_channels")
        return width if is_integer(width) else None

    def latent_channels(self, vae_decoder: IOBindingORTModel) -> int:
        """The VAE's latent channels: a quarter of the transformer's predicted token width (its output's last dim,
        else its config's ``out_channels``, else its input's), checked against the VAE's, and the input's token width
        against the latents' and what the family adds to them (:attr:`extra_widths`)."""
        output = self.model.output_names[0] if self.model.output_names else None
        dims = self.model.shape_inferencer.output_dims.get(output) if output is not None else None
        declared = dims[2] if dims is not None and len(dims) > 2 and isinstance(dims[2], int) else None
        width = declared or self.model.config.get("out_channels") or self.token_width
        if not is_integer(width) or width < 4 or width % 4:
            raise ArgumentError(
                "transformer",
                f"expected hidden_states of 4 × latent channels per token (Flux's 2×2 "
                f"packing), got a width of {width!r}",
            )
        channels = width // 4
        declared = declared_dim(vae_decoder, "latent_sample", 1) or vae_decoder.config.get("latent_channels")
        if declared is not None and declared != channels:
            raise ArgumentError(
                "vae_decoder",
                f"expected {channels} latent channels (the transformer's token width {width} / 4), got {declared}",
            )
        self.check_token_width(channels)
        return channels

    def check_token_width(self, latent_channels: int) -> None:
        """Refuses, when loading, a transformer whose token width is not the packed latents' plus what the family
        concatenates to them, naming the family whose width it has (FLUX.1, Fill, Control)."""
        extra = self.extra_widths(latent_channels, self.pipe.vae_scale_factor) if self.extra_widths else {}
        expected = 4 * latent_channels + sum(extra.values())
        width = self.token_width
        if width is None or width == expected:
            return
        parts = "".join(f" + {value} ({what})" for what, value in extra.items())
        hint = family_hint(self.component, self.model.input_names, {self.component: width})
        raise ArgumentError(
            "transformer",
            f"expected hidden_states of {expected} values per token (the packed latents' 4 × {latent_channels}"
            f"{parts}), got {width} in {self.model.model_path!r}"
            + (f" ({hint})" if hint else f" (a {self.pipe.family.title} transformer's)"),
        )

    def timesteps(
        self, num_inference_steps: int, image_seq_len: int, sigmas: Optional[Sequence[float]] = None
    ) -> torch.Tensor:
        """The schedule of a call over ``image_seq_len`` latent tokens, as diffusers' FluxPipeline sets it: sigmas
        evenly from 1 to 1/steps (or the given ones), shifted by the scheduler (FLUX.1 dev: by
        :func:`linear_shift` of the token count)."""
        config = self.pipe.scheduler.config
        if sigmas is None:
            sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
        if getattr(config, "use_flow_sigmas", False):
            sigmas = None
        return self.set_flow_timesteps(num_inference_steps, sigmas, self.shift(image_seq_len, max_shift=1.15))


class WanDenoiser(FlowTransformer):
    """Wan's video transformer: latent videos ``(batch, channels, frames, height, width)`` (``hidden_states``) cut into
    patches (1 × 2 × 2), the UMT5 states of the prompt (``encoder_hidden_states``: negative then positive ones with
    classifier-free guidance, in one batch where diffusers makes two calls) and the ``timestep``: one per row, or (Wan
    2.2 TI2V, a transformer whose ``timestep`` has two axes) one per row and latent token. Wan 2.2's second transformer
    (``transformer_2``, the low-noise expert, of the same inputs) runs the steps below the pipeline's boundary (a
    :class:`~.loop.Stage` of the loop). Multistep schedulers (Wan's UniPC) keep predictions across steps: an unguided
    one is copied out of the model's reused buffer. Image to video's transformers take the first frame's mask and
    latents beside the latents (:attr:`condition_channels`: the loop's extra channels), Wan 2.1 I2V's also the image
    encoder's states."""

    copies_unguided_output = True

    def __init__(
        self,
        pipe: Any,
        default_sample_size: int = 60,
        condition_channels: Optional[Callable[[int, int], int]] = None,
    ):
        super().__init__(pipe, default_sample_size)
        #: ``condition_channels(latent_channels, temporal_scale_factor)``: the channels a family concatenates to the
        #: latents (image to video: the first frame's mask, one channel per video frame of a latent frame, and its
        #: latents); ``None``: none
        self.condition_channels = condition_channels

    @property
    def models(self) -> Dict[str, IOBindingORTModel]:
        """The pipeline's transformers by component (``transformer``, and Wan 2.2's ``transformer_2`` where there is
        one)."""
        return {name: getattr(self.pipe, name) for name in WAN_TRANSFORMERS if getattr(self.pipe, name, None)}

    def check_model(self) -> None:
        """Every transformer must have Wan's interface (the second one's refusal names its folder)."""
        interface = self.pipe.family.interface
        for name, model in self.models.items():
            # the names here; the channels where the latent channels are read (their own message)
            if not interface.matches(model.input_names, interface.sample_channels):
                hint = family_hint("transformer", model.input_names) or (
                    f"put a {self.pipe.family.title} transformer's model.onnx in the {name} folder"
                )
                raise ArgumentError(
                    name,
                    f"expected inputs {list(interface.inputs)}, got {model.input_names} in {model.model_path!r} "
                    f"({hint})",
                )

    def make_cache(self, config: Any) -> StepCache:
        """First-Block Cache (:mod:`.block_cache`: diffusers' ``FirstBlockCacheConfig``) on each transformer, Wan
        2.2's experts each with its own parts and state, as diffusers' ``enable_cache`` on each of them."""
        from .block_cache import first_block_cache_for

        return first_block_cache_for(self, config, list(self.models.values()))

    def cache_groups(self, guidance: Optional[Guidance]) -> int:
        """The guided batch's negative and positive prompts apart: diffusers' WanPipeline calls the transformer once
        for each, in cache contexts of their own (``"cond"``, ``"uncond"``)."""
        return guidance.copies if guidance is not None else 1

    def conditioning(self, tensors: Dict[str, torch.Tensor], guidance: Guidance) -> Dict[str, torch.Tensor]:
        """The prompt's UMT5 states; with classifier-free guidance the negative prompt's first, in one batch."""
        if not guidance.batched:
            return {"encoder_hidden_states": tensors["prompt_embeds"]}
        return {"encoder_hidden_states": torch.cat([tensors["negative_prompt_embeds"], tensors["prompt_embeds"]])}

    def scale_model_input(self, latents: torch.Tensor, t: Any) -> torch.Tensor:
        """The latents in the transformer's dtype (the loop's stay float32, as diffusers keeps them)."""
        return latents.to(self.model.input_dtypes[self.sample_input])

    @property
    def patch_size(self) -> Tuple[int, int, int]:
        """The transformer's patches (frames, rows, columns): its config's ``patch_size``, else Wan's (1, 2, 2)."""
        patch = self.model.config.get("patch_size", (1, 2, 2))
        if not isinstance(patch, (list, tuple)) or len(patch) != 3 or not all(is_integer(p) and p > 0 for p in patch):
            raise ModelFileError("transformer config.json", f"patch_size: expected 3 positive integers, got {patch!r}")
        return tuple(int(p) for p in patch)

    @property
    def per_token_timesteps(self) -> bool:
        """Whether the transformer takes a timestep per latent token (Wan 2.2 TI2V's ``expand_timesteps``)."""
        return len(self.model.input_dims["timestep"] or []) == 2

    def timestep_inputs(self, timesteps: torch.Tensor, rows: int, latent_shape: Sequence[int] = ()) -> torch.Tensor:
        """The ``timestep`` of every step, made once on the device: one per row or, for a transformer that takes one
        per latent token (TI2V), one per row and token of latents of ``latent_shape`` (diffusers' ``mask[0][0][:,
        ::2, ::2] * t``: every token at ``t`` in text to video)."""
        if not self.per_token_timesteps:
            return timestep_inputs(self.model, timesteps, rows, self.pipe.device)
        _, _, frames, height, width = latent_shape
        _, p_h, p_w = self.patch_size
        tokens = frames * -(-height // p_h) * -(-width // p_w)
        values = timesteps.to(torch.float32).to(self.model.input_dtypes["timestep"])
        return upload(values[:, None, None].expand(-1, rows, tokens).contiguous(), self.pipe.device)

    @property
    def size_multiple(self) -> int:
        """The VAE's spatial scale factor times the transformer's patch size (diffusers' ``check_inputs`` asks 16)."""
        return self.pipe.vae_scale_factor * self.patch_size[1]

    @property
    def size_multiple_reason(self) -> str:
        return f"the transformer's patch size {self.patch_size[1]}"

    def latent_channels(self, vae_decoder: Optional[IOBindingORTModel]) -> int:
        """The latent channels the transformers predict (their config's ``out_channels``, else their
        ``hidden_states``' channels), checked against the VAE decoder's (``z_dim``) where there is one, and each
        transformer's ``hidden_states`` against them plus what the family concatenates to them
        (:attr:`condition_channels`: image to video's first frame), naming the family a transformer of other channels
        is for."""
        taken = {
            name: declared_dim(model, "hidden_states", 1) or model.config.get("in_channels")
            for name, model in self.models.items()
        }
        channels = self.model.config.get("out_channels") or taken["transformer"]
        if not is_integer(channels) or channels < 1:
            raise ArgumentError(
                "transformer", "cannot tell the number of latent channels: no config.json and a dynamic channel dim"
            )
        decoder = None
        if vae_decoder is not None:
            decoder = declared_dim(vae_decoder, "latent_sample", 1) or vae_decoder.config.get("z_dim")
        if decoder is not None and decoder != channels:
            raise ArgumentError(
                "vae_decoder", f"expected {channels} latent channels (the transformer's), got {decoder}"
            )
        extra = (
            self.condition_channels(channels, self.pipe.codec.temporal_scale_factor) if self.condition_channels else 0
        )
        for name, width in taken.items():
            if width is not None and width != channels + extra:
                hint = family_hint("transformer", self.models[name].input_names, {"transformer": width})
                raise ArgumentError(
                    name,
                    f"expected hidden_states of {channels + extra} channels (the latents' {channels}"
                    f"{f' + {extra} of the first frame' if extra else ''}), got {width}"
                    + (f" ({hint})" if hint else ""),
                )
        return int(channels)
