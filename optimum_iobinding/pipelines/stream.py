"""Real-time image to image on a stream of frames: the prompt encoded once, the noise and the scheduler's constants
fixed per stream, a few UNet steps per frame, and on CUDA every frame a handful of graph replays on one stream with
no host wait (the ideas of StreamDiffusion, Kodaira et al. 2023, on ONNX Runtime)."""

from __future__ import annotations

import inspect
import math
import os
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from diffusers.utils.torch_utils import randn_tensor

from ..errors import ArgumentError, ArgumentTypeError
from ..families import family
from ..layout import download_from_hub, looks_like_hub_id, read_json_object, resolve_pipeline_folder
from ..runtime.hub import hub_keywords
from ..runtime.model import IOBindingORTModel
from .arguments import is_integer, no_denoising_step
from .clip_unet import STABLE_DIFFUSION_COMPONENTS
from .components import TINY_VAE_COMPONENTS, check_latent_channels, names_of, tiny_vae_folder
from .core import OnnxDiffusionPipeline, on_device_stream
from .denoisers import UNetDenoiser
from .ip_adapter import IPAdapterMixin
from .latent_consistency import guidance_scale_embedding
from .lora import LoraLoaderMixin
from .prompts import CLIPPrompt
from .transfer import upload
from .stream_frames import FrameCopies, FrameInput, FrameKind, PendingFrame, output_layout, read_frame
from .stream_plan import CFG_TYPES, SimilarityFilter, StreamPlan, make_stages, stream_schedule

STREAM = family("stream")
_KEEP = object()  # update_prompt: the negative prompt that prepare was given


# ------------------------------------------------------------------------------------------------ the pipeline
class OnnxStreamDiffusionPipeline(IPAdapterMixin, LoraLoaderMixin, OnnxDiffusionPipeline):
    """Few-step image to image on a stream of frames: one frame in, one frame out, every frame's work on the device.

    ``prepare`` encodes the prompt, fixes the noise of every step from ``seed``, computes the img2img timesteps with
    the folder's scheduler and its constants at each, creates the sessions and captures every graph; a frame is then
    preprocess → VAE encode → noise to the first timestep → UNet step(s) → scheduler arithmetic → decode → back to the
    frame's kind. On CUDA with graphs (the default) each of these is a CUDA-graph replay: the models' own (ONNX
    Runtime's), and torch's for the arithmetic between them, all on the pipeline's one stream; the models' graph
    inputs are written in place, and nothing in a frame makes the host wait. For SD 1.x/2.x, SD-Turbo and LCM folders
    (an LCM UNet's ``timestep_cond`` is the guidance embedding, as in the LCM pipeline).

    **Steps.** A frame does not run the pipelines' denoising loop (:func:`~.loop.denoise`), which asks the
    scheduler at every step: its few steps are a fixed schedule whose scheduler arithmetic is computed once per stream
    (:mod:`.stream_plan`) and captured with the UNet, and consecutive frames' steps can share one UNet batch. Each step
    predicts x0 from the UNet's output (ε, v or x0, as the scheduler's ``prediction_type``
    says; LCMScheduler's boundary condition ``c_skip``/``c_out`` applied); the next step re-noises that x0 to its
    timestep with the stream's fixed noise of that step (StreamDiffusion's rule), and the last step's x0 is decoded.
    With one step this is what Euler, Euler ancestral, LCM, DPM-Solver and DDIM with ``set_alpha_to_one=True`` give
    after their last step, so it equals diffusers' img2img pipeline; DDIM with ``set_alpha_to_one=False`` keeps a
    share √(1 − ᾱ₀) ≈ 0.03 of the predicted noise in its last step, which the stream drops. The noising at each
    step is the scheduler's own (``add_noise``, ``scale_model_input``): √ᾱ and √(1 − ᾱ) for DDPM-style schedulers,
    the same through the sigmas for Euler-style ones; schedulers that are not variance-preserving (EDM) are refused.

    **Stream batch** (``stream_batch=True`` and more than one step): one UNet call of batch k per frame holds frame t
    at step 1, frame t − 1 at step 2, …, so a frame costs one UNet call and comes out k − 1 frames later: the first
    k − 1 calls return ``None`` and :meth:`flush` returns the last k − 1 outputs. :meth:`frames` yields exactly one
    output per frame, in order. ``stream_batch=False`` runs a frame's k steps one after another (k UNet calls).

    **Frames**: torch tensors (CUDA or CPU: float ``(3, H, W)`` or ``(1, 3, H, W)`` in [-1, 1], or uint8
    ``(H, W, 3)``), numpy uint8 ``(H, W, 3)`` arrays and PIL images (made RGB). Each output is of the kind, dtype,
    layout and device of the frame it comes from (in a stream batch, the frame given k − 1 calls earlier; a CUDA
    tensor in, a CUDA tensor out with no host copy), at the prepared size: a frame of another size is resized on
    the device to ``(height, width)`` (bilinear with antialiasing, stretched, not cropped); its first frame
    captures the preprocessing of that size once. A float output is clamped to [-1, 1], a uint8 one rounded as
    diffusers rounds. **Outputs are fresh tensors** from torch's caching allocator (pinned host
    memory for host outputs): no later frame overwrites one the caller holds.

    ``prepare`` reads the scheduler (``stream.scheduler = …`` before it, as for the other pipelines) and the prompt;
    :meth:`update_prompt` changes the prompt alone. Calls from several threads are serialized.
    """

    family = STREAM
    declared_components = STABLE_DIFFUSION_COMPONENTS
    # an SD 1.x/2.x, SD-Turbo or LCM UNet; an LCM UNet's timestep_cond is optional in the stream family's interface
    denoiser_part = UNetDenoiser
    prompt_part = CLIPPrompt
    settings = {"requires_safety_checker": False}
    encodes_images = True
    loading_arguments = ("tiny_vae",)

    def __init__(self, **components: Any):
        if components.get("vae_encoder") is None:
            raise ArgumentError(
                "vae_encoder",
                "expected a VAE encoder (the stream encodes every frame), got none: the "
                "folder has no vae_encoder/model.onnx; export one, or pass tiny_vae=<an AutoencoderTiny "
                "export>",
            )
        super().__init__(**components)
        self._check_vae()
        self._plan: Optional[StreamPlan] = None
        self._copies = FrameCopies(self.device)

    # -------------------------------------------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: Union[str, os.PathLike],
        provider: Any = None,
        provider_options: Optional[Dict[str, Any]] = None,
        sess_options: Any = None,
        io_binding: bool = True,
        cuda_graph: Any = "auto",
        component_options: Optional[Dict[str, Dict[str, Any]]] = None,
        **kwargs: Any,
    ) -> "OnnxStreamDiffusionPipeline":
        """Loads a stream (see :meth:`OnnxDiffusionPipeline.from_pretrained`; ``tiny_vae=`` a tiny VAE's folder or hub
        id). An SDXL folder (``text_encoder_2`` beside the UNet) gives an
        :class:`~.stream_xl.OnnxStreamDiffusionXLPipeline`, a folder with ControlNets (``controlnet``) an
        :class:`~.stream_controlnet.OnnxStreamDiffusionControlNetPipeline`; for a hub id its model_index.json says
        which (it alone is fetched first)."""
        chosen = cls._layout_class(pretrained_model_name_or_path, kwargs) if cls is OnnxStreamDiffusionPipeline else cls
        loader = super().from_pretrained if chosen is cls else chosen.from_pretrained
        return loader(
            pretrained_model_name_or_path,
            provider=provider,
            provider_options=provider_options,
            sess_options=sess_options,
            io_binding=io_binding,
            cuda_graph=cuda_graph,
            component_options=component_options,
            **kwargs,
        )

    @classmethod
    def _layout_class(cls, name_or_path: Any, kwargs: Dict[str, Any]) -> type:
        """The stream class of a folder's (or hub repository's) layout: SDXL's, with ControlNets (SD's or SDXL's), or
        this one."""
        if not isinstance(name_or_path, (str, os.PathLike)):
            return cls  # refused by the loading, naming the argument
        path = Path(name_or_path).expanduser()
        if path.is_dir():
            has = {name: (path / name / "model.onnx").is_file() for name in ("unet", "text_encoder_2", "controlnet")}
        elif not path.exists() and looks_like_hub_id(os.fspath(name_or_path)):
            hub = {key: kwargs[key] for key in hub_keywords() if key in kwargs}
            index = (
                read_json_object(
                    download_from_hub(
                        os.fspath(name_or_path), ["model_index.json"], "pretrained_model_name_or_path", **hub
                    )
                    / "model_index.json"
                )
                or {}
            )
            has = {name: name in index for name in ("unet", "text_encoder_2", "controlnet")}
        else:
            return cls
        xl, controlnet = has["unet"] and has["text_encoder_2"], has["controlnet"]
        if xl and controlnet:
            from .stream_xl_controlnet import OnnxStreamDiffusionXLControlNetPipeline

            return OnnxStreamDiffusionXLControlNetPipeline
        if xl:
            from .stream_xl import OnnxStreamDiffusionXLPipeline

            return OnnxStreamDiffusionXLPipeline
        if controlnet:
            from .stream_controlnet import OnnxStreamDiffusionControlNetPipeline

            return OnnxStreamDiffusionControlNetPipeline
        return cls

    @classmethod
    def model_folders(
        cls,
        pretrained_model_name_or_path: Union[str, os.PathLike],
        hub_kwargs: Dict[str, Any],
        tiny_vae: Union[str, os.PathLike, None] = None,
    ) -> Tuple[Path, Dict[str, Path]]:
        """The folder's components, with the VAE from ``tiny_vae`` where given: a folder (or hub id) holding
        ``vae_encoder/`` and ``vae_decoder/`` of an AutoencoderTiny export (TAESD-shaped, far cheaper a frame than
        the full VAE), whose latent channels must match the UNet's; the folder's own VAE is then neither downloaded
        nor loaded (``component_options`` for ``"vae_encoder"``/``"vae_decoder"`` apply to the tiny VAE)."""
        if tiny_vae is not None and not isinstance(tiny_vae, (str, os.PathLike)):
            raise ArgumentTypeError(
                "tiny_vae",
                f"expected a folder or hub id of an AutoencoderTiny export (vae_encoder/ and "
                f"vae_decoder/), or None, got {type(tiny_vae).__name__} {tiny_vae!r:.80}",
            )
        own = tuple(
            name
            for name in names_of(cls.declared_components, "onnx")
            if tiny_vae is None or name not in TINY_VAE_COMPONENTS
        )
        # what a hub id downloads: the family's own folders (every ControlNet's too), less a tiny VAE's halves
        downloads = tuple(name for name in cls.download_names() if tiny_vae is None or name not in TINY_VAE_COMPONENTS)
        folder = resolve_pipeline_folder(
            pretrained_model_name_or_path, downloads, names_of(cls.declared_components, "tokenizer"), **hub_kwargs
        )
        folders = {name: folder / name for name in own}
        if tiny_vae is not None:
            tiny_folder = tiny_vae_folder(tiny_vae, **hub_kwargs)
            folders.update({name: tiny_folder / name for name in TINY_VAE_COMPONENTS})
        return folder, folders

    def _check_vae(self) -> None:
        """A VAE from another folder than the UNet's (a tiny VAE) must have the UNet's latent channels."""
        vae_folder = Path(self.vae_decoder.model_path or ".").parent.parent
        if self.unet.model_path is not None and vae_folder != Path(self.unet.model_path).parent.parent:
            check_latent_channels(self.vae_encoder, self.vae_decoder, self.unet, f"tiny_vae: {str(vae_folder)!r}")

    def warmup(self, *args: Any, **kwargs: Any) -> None:
        """A stream warms up in :meth:`prepare`: its sessions, graphs and captures are made there."""
        raise ArgumentTypeError(
            f"{type(self).__name__}.warmup",
            "a stream warms up in prepare(prompt, …), which makes its sessions and captures its graphs for the "
            "prepared size and steps; call that instead",
        )

    # ---------------------------------------------------------------------------------------------- properties
    @property
    def prepared(self) -> bool:
        """Whether :meth:`prepare` has run (frames can come)."""
        return self._plan is not None

    @property
    def timesteps(self) -> List[float]:
        """The prepared UNet steps' timesteps (empty before :meth:`prepare`)."""
        return list(self._plan.schedule.timesteps) if self._plan is not None else []

    @property
    def frames_in_flight(self) -> int:
        """Frames given to the stream batch whose outputs have not come out yet (:meth:`flush` returns them)."""
        return sum(kind is not None for kind in self._plan.in_flight) if self._plan is not None else 0

    @property
    def unet_inputs(self) -> Dict[str, torch.Tensor]:
        """The UNet inputs every frame's call passes (the UNet graph's own input buffers where it has a graph),
        by name; empty before :meth:`prepare`. The tensors are the stream's: read them, do not write them."""
        return dict(self._plan.unet_inputs) if self._plan is not None else {}

    @property
    def skipped_frames(self) -> int:
        """How many frames the similarity filter skipped since :meth:`prepare` (0 without one)."""
        plan = self._plan
        return 0 if plan is None or plan.filter is None else plan.filter.skipped

    @property
    def captured_graphs(self) -> int:
        """How many torch CUDA graphs the prepared stream has captured (the models' own graphs are counted by
        each model's ``graph_signatures``): ``prepare`` captures what frames of the prepared size need."""
        if self._plan is None:
            return 0
        return sum(stage.captures for stage in [*self._plan.stages.values(), *self._plan.step_stages])

    # ------------------------------------------------------------------------------------------------- prepare
    @on_device_stream
    def prepare(
        self,
        prompt: Union[str, Sequence[Tuple[str, float]]],
        negative_prompt: Optional[str] = None,
        num_inference_steps: int = 2,
        strength: float = 0.5,
        guidance_scale: float = 0.0,
        seed: Union[int, Sequence[Tuple[int, float]]] = 0,
        height: int = 512,
        width: int = 512,
        stream_batch: bool = True,
        cfg_type: str = "full",
        delta: float = 1.0,
        similarity_threshold: Optional[float] = None,
        max_skip_frame: int = 10,
        ip_adapter_image: Any = None,
        ip_adapter_image_embeds: Any = None,
    ) -> None:
        """Fixes everything the frames that follow share, and makes every session and graph they use.

        Args:
            prompt: what the frames should become (one prompt: a stream is a batch of one), or a blend of prompts,
                ``[(text, weight), …]``: their text embeddings averaged with the weights (:meth:`update_prompt`).
            negative_prompt: what to guide away from (with ``guidance_scale > 1`` on a UNet without
                ``timestep_cond``; default: the empty prompt).
            num_inference_steps, strength: the img2img schedule: the scheduler's ``num_inference_steps`` timesteps
                after skipping the first ``1 − strength`` of them (diffusers' img2img rule; a scheduler whose
                ``set_timesteps`` takes ``strength``, as LCMScheduler's does, applies it itself, as diffusers' LCM
                img2img pipeline lets it). Each remaining timestep is one UNet step. SD-Turbo: ``2, 0.5`` is one step.
            guidance_scale: > 1 on a UNet without ``timestep_cond``: classifier-free guidance (the UNet batch
                doubles); an LCM UNet gets it as its guidance embedding (``w = guidance_scale − 1``).
            seed: the stream's fixed noise (one draw per step from ``torch.Generator().manual_seed(seed)``, the
                first being the noise diffusers' img2img pipeline draws from the same generator), or a blend of
                seeds, ``[(seed, weight), …]``: each seed's noise weighted, ``Σ wᵢ nᵢ / √(Σ wᵢ²)`` (unit variance
                again, the draws being independent; :meth:`update_seed`).
            height, width: the size frames are denoised (and returned) at; multiples of :attr:`size_multiple`.
            stream_batch: with more than one step, one UNet call of batch k per frame (outputs come k − 1 frames
                late); ``False``: each frame's k steps in turn.
            cfg_type: how ``guidance_scale > 1`` guides, StreamDiffusion's choices: ``"full"`` (classifier-free
                guidance: a negative-prompt row beside every latent row of the UNet batch), ``"self"`` (residual
                classifier-free guidance, RCFG: the negative prediction is the stream's stock noise times ``delta``,
                no extra row), ``"initialize"`` (RCFG whose stock is refreshed every frame by one negative-prompt row
                for the newest frame), ``"none"`` (no guidance). RCFG needs an ε-predicting UNet without
                ``timestep_cond`` and, over several steps, a stream batch (:mod:`.stream_plan` writes its formulas).
            delta: RCFG's scale of the stock noise (StreamDiffusion's ``delta``).
            similarity_threshold: StreamDiffusion's stochastic similarity filter (:class:`.stream_plan.SimilarityFilter`):
                a frame nearly equal to the last kept one is skipped with a probability that reaches 1 at a cosine
                similarity of 1, and gives the last output again (a fresh copy); e.g. 0.98. ``None``: no filter.
            max_skip_frame: with the filter, after this many skips the next frame that would be skipped is kept.
            ip_adapter_image, ip_adapter_image_embeds: the image prompt of the IP-Adapter loaded before
                (:meth:`load_ip_adapter`, on a UNet exported for it), as diffusers takes them; every frame shares it
                until :meth:`update_image_prompt`.

        Raises:
            ValueError, TypeError: a bad argument (named), before any work.
        """
        # 1. every argument, before any work
        blend = prompt_blend(prompt)
        if negative_prompt is not None and not isinstance(negative_prompt, str):
            raise ArgumentTypeError(
                "negative_prompt", f"expected a str (a stream has one prompt), got {type(negative_prompt).__name__}"
            )
        self.check_inputs(
            prompt=blend[0][0],
            negative_prompt=negative_prompt,
            height=height,
            width=width,
            num_inference_steps=num_inference_steps,
            output_type="pt",
            strength=strength,
            guidance_scale=guidance_scale,
        )
        seeds = seed_blend(seed)
        if not isinstance(stream_batch, bool):
            raise ArgumentTypeError(
                "stream_batch", f"expected True or False, got {type(stream_batch).__name__} {stream_batch!r}"
            )
        if not isinstance(cfg_type, str) or cfg_type not in CFG_TYPES:
            raise ArgumentError("cfg_type", f"expected one of {', '.join(map(repr, CFG_TYPES))}, got {cfg_type!r}")
        if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not math.isfinite(delta):
            raise ArgumentError("delta", f"expected a finite number, got {delta!r}")
        if similarity_threshold is not None and (
            isinstance(similarity_threshold, bool)
            or not isinstance(similarity_threshold, (int, float))
            or not 0 <= similarity_threshold <= 1
        ):
            raise ArgumentError(
                "similarity_threshold", f"expected None or a number in [0, 1], got {similarity_threshold!r}"
            )
        if not is_integer(max_skip_frame) or max_skip_frame < 0:
            raise ArgumentError("max_skip_frame", f"expected an integer ≥ 0, got {max_skip_frame!r}")
        self.check_image_prompt(ip_adapter_image, ip_adapter_image_embeds)

        # 2. the timesteps for this strength, and the scheduler's constants at each (refused schedulers are named)
        timesteps, begin = self.stream_timesteps(num_inference_steps, strength)
        schedule = stream_schedule(self.scheduler, timesteps, begin)
        lcm = "timestep_cond" in self.unet.input_names
        batched = stream_batch and len(timesteps) > 1
        guiding = cfg_type if guidance_scale > 1.0 and not lcm else "none"
        if cfg_type in ("self", "initialize") and guidance_scale > 1.0:
            self._check_residual_guidance(cfg_type, lcm, schedule.prediction_type, batched, len(timesteps))
        if batched:
            self._check_timestep_rows()
        # the image prompt before anything of the last prepare goes (a refused one leaves that stream as it was)
        image_prompt = self.image_prompt_inputs(
            ip_adapter_image, ip_adapter_image_embeds, 1, guiding in ("full", "initialize")
        )
        self._plan = None  # the last prepare's buffers and graphs go before this one's are made
        plan = StreamPlan(
            height, width, schedule, batched, guiding, float(guidance_scale), prompt, negative_prompt, float(delta)
        )

        # 3. the prompt (encoded once), the noise, the constants and the models' inputs, on the device
        conditioning = self._blended_embeddings(blend, plan.negative, negative_prompt)
        conditioning.update(image_prompt)
        self._make_tensors(plan, seeds, lcm, {name: tuple(value.shape[1:]) for name, value in conditioning.items()})
        self._write_embeddings(plan, conditioning)

        # 4. sessions and the models' graphs (3 runs: ORT captures after one regular run), then their buffers
        if self.device.type == "cuda":
            for model, shapes in self._model_shapes(plan):
                model.warmup(shapes)
            self._adopt_graph_buffers(plan)
        make_stages(plan, self._uses_graphs(), self.latent_channels, self.vae_scaling_factor)
        if self.device.type == "cuda":
            self._warm_stages(plan)
            torch.cuda.current_stream(self.device).synchronize()  # set-up ends here: the first frame waits for none
        if similarity_threshold is not None:
            plan.filter = SimilarityFilter(float(similarity_threshold), int(max_skip_frame), seeds[0][0])
        self._plan = plan

    def stream_timesteps(self, num_inference_steps: int, strength: float) -> Tuple[List[Any], int]:
        """The scheduler's timesteps for ``num_inference_steps`` and ``strength``, and the index of the first in its
        full schedule (see :meth:`prepare`)."""
        if "strength" in inspect.signature(self.scheduler.set_timesteps).parameters:
            self.scheduler.set_timesteps(num_inference_steps, strength=strength)
            timesteps = list(self.scheduler.timesteps)
            if not timesteps:
                raise no_denoising_step(strength, num_inference_steps)
            return timesteps, 0
        timesteps = list(self.strength_timesteps(num_inference_steps, strength))
        return timesteps, len(self.scheduler.timesteps) - len(timesteps)

    def _check_residual_guidance(
        self, cfg_type: str, lcm: bool, prediction_type: str, batched: bool, steps: int
    ) -> None:
        """Residual guidance's conditions (StreamDiffusion's formulas are written for them), each refused by name."""
        if lcm:
            raise ArgumentError(
                "cfg_type",
                f"{cfg_type!r} guides with the UNet's noise prediction, got an LCM UNet that takes guidance_scale as "
                "its timestep_cond; use the cfg type 'none' or 'full'",
            )
        if prediction_type != "epsilon":
            raise ArgumentError(
                "cfg_type",
                f"{cfg_type!r} expects a scheduler with prediction_type='epsilon' (the stock is a noise), got "
                f"{prediction_type!r}",
            )
        if steps > 1 and not batched:
            raise ArgumentError(
                "cfg_type",
                f"{cfg_type!r} over {steps} steps expects the stream batch (the stock noise moves with the frames of "
                "a stream batch), got the stream batch off",
            )

    def _check_timestep_rows(self) -> None:
        dims = self.unet.input_dims.get("timestep") or []
        if len(dims) != 1 or dims[0] == 1:
            declared = "a scalar" if not dims else f"shape {dims}"
            raise ArgumentError(
                "stream_batch",
                f"expected a UNet whose timestep input has one row per sample (a stream "
                f"batch gives each step its own timestep), got {declared}; pass stream_batch=False",
            )

    def _noise(self, plan: StreamPlan, seeds: List[Tuple[int, float]]) -> torch.Tensor:
        """The stream's noise on the host, one row per step: each seed's draws (one per step from one generator), the
        blend ``Σ wᵢ nᵢ / √(Σ wᵢ²)`` of several."""
        shape = (1, self.latent_channels, plan.height // self.vae_scale_factor, plan.width // self.vae_scale_factor)

        def draws(seed: int) -> torch.Tensor:
            generator = torch.Generator().manual_seed(seed)
            return torch.cat(
                [randn_tensor(shape, generator=generator, device=torch.device("cpu")) for _ in range(plan.steps)]
            )

        if len(seeds) == 1:
            return draws(seeds[0][0])
        norm = math.sqrt(sum(weight * weight for _, weight in seeds))
        return sum(draws(seed) * (weight / norm) for seed, weight in seeds)

    def _prompt_conditioning(
        self, text: str, negative: bool, negative_prompt: Optional[str]
    ) -> Dict[str, torch.Tensor]:
        """The UNet's prompt inputs for one prompt (``[negative; positive]`` rows with ``negative``): the text
        encoder's embeddings as ``encoder_hidden_states``."""
        return {"encoder_hidden_states": self.prompt.encode(text, 1, negative, negative_prompt)}

    def _blended_embeddings(
        self, blend: List[Tuple[str, float]], negative: bool, negative_prompt: Optional[str]
    ) -> Dict[str, torch.Tensor]:
        """The UNet's prompt inputs (``[negative; positive]`` rows with ``negative``): one prompt's, or the weighted
        mean of several prompts' positive rows (weights normalized to sum 1), input by input."""
        if len(blend) == 1:
            return self._prompt_conditioning(blend[0][0], negative, negative_prompt)
        total = sum(weight for _, weight in blend)
        encoded = [self._prompt_conditioning(text, negative, negative_prompt) for text, _ in blend]
        blended = {}
        for name, first in encoded[0].items():
            positive = sum(inputs[name][-1:] * (weight / total) for inputs, (_, weight) in zip(encoded, blend))
            blended[name] = torch.cat([first[:1], positive]) if negative else positive
        return blended

    def _fixed_unet_inputs(self, plan: StreamPlan) -> Dict[str, torch.Tensor]:
        """UNet inputs beyond the prompt's that stay the same for every frame of a plan, one row per UNet row, on the
        host (none here)."""
        return {}

    def _make_tensors(
        self,
        plan: StreamPlan,
        seeds: List[Tuple[int, float]],
        lcm: bool,
        conditioning_shapes: Dict[str, Tuple[int, ...]],
    ) -> None:
        device, unet = self.device, self.unet
        channels = self.latent_channels
        latent_height, latent_width = plan.height // self.vae_scale_factor, plan.width // self.vae_scale_factor
        noise = self._noise(plan, seeds)
        schedule = plan.schedule
        columns = {"noise": noise, "signal": schedule.signal, "noise_scale": schedule.noise}
        if plan.cfg_type in ("self", "initialize"):
            columns["stock"] = torch.zeros(plan.latent_rows, *noise.shape[1:])  # RCFG's stock noise
        if schedule.skip is not None:
            columns.update(skip=schedule.skip, out=schedule.out)
        with torch.inference_mode(False):  # later frames write them in place, in or out of inference mode
            for name, values in columns.items():
                values = (
                    values
                    if isinstance(values, torch.Tensor)
                    else torch.tensor(values, dtype=torch.float32).reshape(-1, 1, 1, 1)
                )
                plan.tensors[name] = upload(values, device)
            rows = plan.rows
            plan.tensors["image"] = torch.zeros(
                1, 3, plan.height, plan.width, device=device, dtype=self.vae_encoder.input_dtypes["sample"]
            )
            plan.tensors["latent"] = torch.zeros(
                1,
                channels,
                latent_height,
                latent_width,
                device=device,
                dtype=self.vae_decoder.input_dtypes["latent_sample"],
            )
            plan.tensors["x0"] = torch.zeros(plan.steps, channels, latent_height, latent_width, device=device)
            plan.unet_inputs["sample"] = torch.zeros(
                rows, channels, latent_height, latent_width, device=device, dtype=unet.input_dtypes["sample"]
            )
            for name, shape in conditioning_shapes.items():
                plan.unet_inputs[name] = torch.zeros(rows, *shape, device=device, dtype=unet.input_dtypes[name])
            for name, values in self._fixed_unet_inputs(plan).items():
                plan.unet_inputs[name] = upload(values.to(unet.input_dtypes[name]), device)
            timestep_dtype = unet.input_dtypes["timestep"]
            if plan.batched:  # rows [negative: steps 1…k;] text: steps 1…k (or "initialize"'s one negative first)
                values = torch.tensor(schedule.timesteps, dtype=torch.float64).repeat(plan.copies)
                if plan.cfg_type == "initialize":
                    values = torch.cat([values[:1], values])
                plan.unet_inputs["timestep"] = upload(values.to(timestep_dtype), device)
            else:
                plan.step_timesteps = [
                    upload(self._timestep_input(t, rows).to(timestep_dtype), device) for t in schedule.timesteps
                ]
                plan.unet_inputs["timestep"] = plan.step_timesteps[0]
            if lcm:
                w = torch.full((rows,), plan.guidance_scale - 1.0)
                embedding = guidance_scale_embedding(w, self.denoiser.time_cond_proj_dim)
                plan.unet_inputs["timestep_cond"] = upload(embedding.to(unet.input_dtypes["timestep_cond"]), device)

    def _timestep_input(self, timestep: float, rows: int) -> torch.Tensor:
        """One step's UNet timestep input, in the rank the UNet declares (a scalar, ``[1]`` or ``[rows]``)."""
        dims = self.unet.input_dims.get("timestep") or []
        value = torch.tensor(timestep, dtype=torch.float64)
        if not dims:
            return value
        return value.reshape(1) if dims[0] == 1 else value.repeat(rows)

    def _write_embeddings(self, plan: StreamPlan, conditioning: Dict[str, torch.Tensor]) -> None:
        """The prompt's UNet inputs (``[negative; positive]`` when the plan guides with a negative prompt) into the
        UNet's inputs, one row per latent row ("initialize": the negative once, first): always the same tensors, so
        captured graphs keep reading them."""
        for name, values in conditioning.items():
            if plan.cfg_type == "initialize":
                rows = torch.cat([values[:1], values[1:].repeat_interleave(plan.latent_rows, dim=0)])
            else:
                rows = values.repeat_interleave(plan.latent_rows, dim=0)
            plan.unet_inputs[name].copy_(rows)

    def _model_shapes(self, plan: StreamPlan) -> List[Tuple[IOBindingORTModel, Dict[str, Tuple[int, ...]]]]:
        return [
            (self.vae_encoder, {"sample": tuple(plan.tensors["image"].shape)}),
            (self.unet, {name: tuple(value.shape) for name, value in plan.unet_inputs.items()}),
            (self.vae_decoder, {"latent_sample": tuple(plan.tensors["latent"].shape)}),
        ]

    def _adopt_graph_buffers(self, plan: StreamPlan) -> None:
        """Where a model has a CUDA graph for the plan's shapes, its input buffers become the plan's tensors (with
        the values written so far): the stages write straight into them, and a call passing them copies nothing."""
        own = {"vae_encoder": {"sample": "image"}, "vae_decoder": {"latent_sample": "latent"}}
        for model, shapes in self._model_shapes(plan):
            if model not in (self.unet, self.vae_encoder, self.vae_decoder):
                continue  # a ControlNet's inputs are the UNet's and its own
            buffers = model.graph_input_buffers(shapes) or {}
            for name, buffer in buffers.items():
                if model is self.unet:
                    current, store, key = plan.unet_inputs.get(name), plan.unet_inputs, name
                else:
                    key = own["vae_encoder" if model is self.vae_encoder else "vae_decoder"][name]
                    current, store = plan.tensors[key], plan.tensors
                if current is None or buffer.shape != current.shape or buffer.dtype != current.dtype:
                    continue
                if model is self.unet and name == "timestep" and not plan.batched:
                    continue  # each step passes its own: the graph copies it in
                buffer.copy_(current)
                store[key] = buffer

    def _uses_graphs(self) -> bool:
        return self.device.type == "cuda" and self.unet.cuda_graph is not False

    def _warm_stages(self, plan: StreamPlan) -> None:
        """One frame through every stage for the frame layouts most streams send (uint8 HWC and float32 NCHW at the
        prepared size): their graphs are captured here, not by the first frame. Then the stream starts empty."""
        layouts = [(torch.uint8, (plan.height, plan.width, 3)), (torch.float32, (1, 3, plan.height, plan.width))]
        for dtype, shape in layouts:
            staging = self._copies.staging(dtype, shape)
            plan.stages["pre"](staging, plan.tensors["image"])
            self._copies.read(staging)
        plan.encoded = self.vae_encoder(sample=plan.tensors["image"])[0]
        self._denoise(plan, plan.encoded)
        for dtype, _ in layouts:
            self._emit(plan, FrameKind("torch", self.device, dtype, batched=True))
        plan.tensors["x0"].zero_()
        plan.last = None  # the warm-up's outputs are no frame's
        if "stock" in plan.tensors:  # RCFG's stock starts from zeros, as without the warm-up
            plan.tensors["stock"].zero_()

    # -------------------------------------------------------------------------------------------- prompt updates
    @on_device_stream
    def update_prompt(self, prompt: Union[str, Sequence[Tuple[str, float]]], negative_prompt: Any = _KEEP) -> None:
        """Encodes a new prompt once into the same device tensor the UNet reads: no graph is captured again and no
        session made. Frames already in a stream batch take it for their remaining steps.

        Args:
            prompt: the new prompt, or a blend ``[(text, weight), …]``: the weighted mean of the prompts' text
                embeddings (weights ≥ 0, normalized to sum 1; the negative prompt's embedding stays one), e.g.
                ``[("a cat", 0.7), ("a dog", 0.3)]``, moved step by step to morph one prompt into another.
            negative_prompt: a new negative prompt (``None``: the empty one); default: the one given to prepare.
        """
        plan = self._require_plan("update_prompt")
        blend = prompt_blend(prompt)
        if negative_prompt is _KEEP:
            negative_prompt = plan.negative_prompt
        elif negative_prompt is not None and not isinstance(negative_prompt, str):
            raise ArgumentTypeError("negative_prompt", f"expected a str or None, got {type(negative_prompt).__name__}")
        self._write_embeddings(plan, self._blended_embeddings(blend, plan.negative, negative_prompt))
        plan.prompt, plan.negative_prompt = prompt, negative_prompt

    @on_device_stream
    def update_image_prompt(self, ip_adapter_image: Any = None, ip_adapter_image_embeds: Any = None) -> None:
        """Writes a new image prompt for the loaded IP-Adapter into the same device tensors the UNet reads: no graph
        is captured again. Neither argument: no image prompt. The adapter's scale and weights are read here (and by
        :meth:`prepare`): after :meth:`set_ip_adapter_scale`, :meth:`load_ip_adapter` (of the same number of image
        tokens) or :meth:`unload_ip_adapter`, the frames change at the next update. Frames already in a stream batch
        take it for their remaining steps."""
        plan = self._require_plan("update_image_prompt")
        self.check_image_prompt(ip_adapter_image, ip_adapter_image_embeds)
        if ip_adapter_image is None and ip_adapter_image_embeds is None:  # keys and values of zeros: no prompt
            for pair in self.image_prompt_layers:
                for name in pair:
                    plan.unet_inputs[name].zero_()
            return
        inputs = self.image_prompt_inputs(ip_adapter_image, ip_adapter_image_embeds, 1, plan.negative)
        for name, values in inputs.items():
            prepared = tuple(plan.unet_inputs[name].shape[1:])
            if tuple(values.shape[1:]) != prepared:
                raise ArgumentError(
                    "ip_adapter_image" if ip_adapter_image is not None else "ip_adapter_image_embeds",
                    f"expected an image prompt of {prepared[0]} tokens, as prepared (the graphs' shapes; a stream "
                    f"prepared without an image prompt has 1), got {values.shape[1]}: prepare the stream again with "
                    "an image prompt of this adapter and number of images",
                )
        self._write_embeddings(plan, inputs)

    @on_device_stream
    def update_seed(self, seed: Union[int, Sequence[Tuple[int, float]]]) -> None:
        """Writes new fixed noise (one seed's, or a blend ``[(seed, weight), …]``: ``Σ wᵢ nᵢ / √(Σ wᵢ²)``) into the
        same device tensor the stream reads: no graph is captured again. Frames already in a stream batch take it for
        their remaining steps."""
        plan = self._require_plan("update_seed")
        plan.tensors["noise"].copy_(self._noise(plan, seed_blend(seed)))

    # -------------------------------------------------------------------------------------------------- frames
    @on_device_stream
    def __call__(self, frame: FrameInput) -> Any:
        """One frame in, one frame out (see the class docstring for the kinds).

        With a CUDA frame the call returns as soon as the frame's work is enqueued on the pipeline's stream (the
        caller's stream waits for it on the device, not the host); a host frame's output is waited for. How far the
        host runs ahead of the device is bounded by the CUDA driver, which holds only so many launches of a graph in
        flight (a few replays of one graph), so a host that keeps feeding frames waits there, a few frames ahead.

        Returns:
            The output frame, of the input's kind; in a stream batch, the output of the frame given k − 1 calls
            earlier (``None`` for the first k − 1 calls: :meth:`flush` returns the last ones).
        """
        plan = self._require_plan("frame")
        source, kind = read_frame(frame, self.device)
        pending = self._enqueue(plan, source, kind)
        return None if pending is None else pending.result()

    @on_device_stream
    def flush(self) -> List[Any]:
        """The outputs of the frames still in the stream batch, in order (an empty list without a stream batch or
        when none is in flight); the stream is empty after it."""
        plan = self._require_plan("flush")
        return [pending.result() for pending in self._flush(plan)]

    def frames(self, frames: Iterable[FrameInput]) -> Iterator[Any]:
        """Yields one output per frame of ``frames``, in order, overlapping the frames' copies with the compute.

        Host frames (numpy, PIL, CPU tensors) on CUDA go up through pinned double buffers on an upload stream while
        the previous frame computes, and their outputs come down on a download stream into fresh pinned memory, each
        handed out one frame behind, once its download has arrived. CUDA frames never pass through the host, and their outputs are yielded as
        soon as they are enqueued. In a stream batch the first output comes after k frames, and the last k − 1 are
        flushed when ``frames`` ends; stopping the loop early drops the frames still in flight.

        Raises:
            RuntimeError: before :meth:`prepare`, or with frames of earlier calls still in the stream batch.
        """
        self._require_plan("frames")
        if self.frames_in_flight:
            raise RuntimeError(
                f"frames: expected an empty stream batch, got {self.frames_in_flight} frames of earlier "
                "calls still in it; call flush() first (it returns their outputs)"
            )
        return self._overlapped(frames)

    def _overlapped(self, frames: Iterable[FrameInput]) -> Iterator[Any]:
        held: Optional[PendingFrame] = None  # a host output waiting for its download
        try:
            for frame in frames:
                pending = self._enqueue_frame(frame)
                if pending is None:
                    continue
                if held is not None:
                    yield held.result()
                    held = None
                if pending.waits:
                    held = pending
                else:
                    yield pending.result()
            if held is not None:
                yield held.result()
                held = None
            for pending in self._flush_frames():
                yield pending.result()
        finally:
            self._drop_in_flight()

    @on_device_stream
    def _enqueue_frame(self, frame: FrameInput) -> Optional[PendingFrame]:
        plan = self._require_plan("frame")
        source, kind = read_frame(frame, self.device)
        return self._enqueue(plan, source, kind)

    @on_device_stream
    def _flush_frames(self) -> List[PendingFrame]:
        return self._flush(self._require_plan("flush"))

    @on_device_stream
    def _drop_in_flight(self) -> None:
        if self._plan is not None:
            self._plan.in_flight.clear()

    def _require_plan(self, what: str) -> StreamPlan:
        if self._plan is None:
            raise RuntimeError(
                f"{what}: expected a prepared stream, got none; call prepare(prompt, …) first (it "
                "encodes the prompt and captures the graphs every frame replays)"
            )
        return self._plan

    # ------------------------------------------------------------------------------------------- a frame's work
    def _enqueue(self, plan: StreamPlan, source: Any, kind: FrameKind) -> Optional[PendingFrame]:
        """Enqueues a frame's work on the current (the pipeline's) stream; returns the output that comes out."""
        staging = self._copies.bring(source)
        plan.stages["pre"](staging, plan.tensors["image"])
        self._copies.read(staging)
        if plan.filter is not None and plan.last is not None and plan.last.kind == kind and not self._brings_more():
            if plan.filter.skip(plan.tensors["image"]):
                return plan.last.again()
        elif plan.filter is not None:  # the first frame, another kind than the last output's, new conditioning: kept
            plan.filter.keep(plan.tensors["image"])
        self._frame_kept(plan)
        plan.encoded = self.vae_encoder(sample=plan.tensors["image"])[0]
        self._denoise(plan, plan.encoded)
        if not plan.batched:
            return self._emit(plan, kind)
        plan.in_flight.append(kind)
        if len(plan.in_flight) < plan.steps:
            return None  # the batch fills: the oldest frame is not through its last step yet
        oldest = plan.in_flight.popleft()
        return None if oldest is None else self._emit(plan, oldest)

    def _brings_more(self) -> bool:
        """Whether the frame being enqueued brings more than its pixels (a new control image), which the similarity
        filter does not compare: such a frame is kept (none here)."""
        return False

    def _frame_kept(self, plan: StreamPlan) -> None:
        """A new frame goes through the models (the similarity filter kept it): what it brings beside its pixels
        is written now (nothing here)."""

    def _unet_output(self, plan: StreamPlan, inputs: Dict[str, torch.Tensor], step: Optional[int]) -> torch.Tensor:
        """The UNet's prediction for ``inputs`` (``step``: the step's index without a stream batch, else ``None``)."""
        return self.unet(**inputs)[0]

    def _denoise(self, plan: StreamPlan, encoded: torch.Tensor) -> None:
        """Noises the encoded frame and runs the UNet step(s): a stream batch moves every frame one step on."""
        sample = plan.unet_inputs["sample"]
        if plan.batched:
            plan.stages["start"](encoded, plan.tensors["x0"], sample)
            model_output = self._unet_output(plan, plan.unet_inputs, None)
            plan.stages["step"](model_output, sample, plan.tensors["x0"], plan.tensors["latent"])
            return
        plan.stages["start"](encoded, sample)
        for index, stage in enumerate(plan.step_stages):
            inputs = {**plan.unet_inputs, "timestep": plan.step_timesteps[index]}
            stage(self._unet_output(plan, inputs, index), sample, plan.tensors["latent"])

    def _emit(self, plan: StreamPlan, kind: FrameKind) -> PendingFrame:
        """Decodes the last step's x0 into the output of a frame of ``kind``, copied out for the caller."""
        image = self.vae_decoder(latent_sample=plan.tensors["latent"])[0]
        shape, dtype = output_layout(kind, plan.height, plan.width)
        output = plan.output(shape, dtype, self.device)
        self._copies.before_write(output)
        plan.stages["post"](image, output)
        tensor, arrived = self._copies.take(output, to_host=not kind.on_cuda)
        plan.last = PendingFrame(kind, tensor, arrived)
        return plan.last

    def _flush(self, plan: StreamPlan) -> List[PendingFrame]:
        """Moves the stream batch on without new frames until every frame in it has come out."""
        pending: List[PendingFrame] = []
        while any(kind is not None for kind in plan.in_flight):
            self._denoise(plan, plan.encoded)  # row 0 holds no frame: what it computes never comes out
            plan.in_flight.append(None)
            if len(plan.in_flight) >= plan.steps:
                oldest = plan.in_flight.popleft()
                if oldest is not None:
                    pending.append(self._emit(plan, oldest))
        plan.in_flight.clear()
        return pending


def prompt_blend(prompt: Any) -> List[Tuple[str, float]]:
    """``prompt`` as ``[(text, weight), …]``: a str is one prompt of weight 1; a blend is a non-empty list of
    ``(str, weight)`` pairs, each weight a finite number ≥ 0, their sum > 0."""
    if isinstance(prompt, str):
        return [(prompt, 1.0)]
    expected = "a str (a stream has one prompt) or a list of (str, weight) pairs"
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise ArgumentTypeError("prompt", f"expected {expected}, got {prompt!r:.80}")
    return _weighted("prompt", prompt, lambda text: isinstance(text, str), "a str", expected)


def seed_blend(seed: Any) -> List[Tuple[int, float]]:
    """``seed`` as ``[(seed, weight), …]``: an integer in [0, 2**64) is one seed of weight 1; a blend is a non-empty
    list of ``(seed, weight)`` pairs, each weight a finite number ≥ 0, their sum > 0."""
    if is_integer(seed):
        if not 0 <= seed < 2**64:
            raise ArgumentError("seed", f"expected an integer in [0, 2**64), got {seed!r}")
        return [(int(seed), 1.0)]
    expected = "an integer in [0, 2**64) or a list of (seed, weight) pairs"
    if not isinstance(seed, (list, tuple)) or not seed:
        raise ArgumentError("seed", f"expected {expected}, got {seed!r:.80}")
    pairs = _weighted("seed", seed, lambda value: is_integer(value) and 0 <= value < 2**64, "a seed", expected)
    return [(int(value), weight) for value, weight in pairs]


def _weighted(name: str, pairs: Sequence[Any], valid: Any, what: str, expected: str) -> List[Tuple[Any, float]]:
    blend = []
    for index, pair in enumerate(pairs):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ArgumentTypeError(name, f"expected {expected}, got {pair!r:.80} at index {index}")
        if not valid(pair[0]):
            raise ArgumentError(name, f"expected {expected}, got {pair[0]!r:.80} in the pair at index {index}")
        weight = pair[1]
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
            raise ArgumentError(name, f"expected a finite weight ≥ 0 beside {what}, got {weight!r} at index {index}")
        blend.append((pair[0], float(weight)))
    if sum(weight for _, weight in blend) <= 0:
        raise ArgumentError(name, f"expected weights that sum to more than 0, got {[w for _, w in blend]}")
    return blend
