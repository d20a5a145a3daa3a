"""What ``prepare`` fixes for a stream: the scheduler's timesteps and constants at each step, the device tensors the
models read and write, and the arithmetic between the model calls (noising, the x0 prediction, re-noising to the
next step) as captured stages."""

from __future__ import annotations

import copy
import random
from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import ArgumentError
from .stream_frames import CapturedStage, FrameKind, PendingFrame, to_output_frame, to_vae_input

_PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")
# StreamDiffusion's guidance types (its cfg_type): "none" (the text's prediction alone), "full" (classifier-free
# guidance, a negative row per latent row), "self" and "initialize" (residual classifier-free guidance: the negative
# prediction is the stream's stock noise times delta; "initialize" refreshes the stock's first row with one negative
# row of the UNet batch every frame)
CFG_TYPES = ("none", "full", "self", "initialize")


@dataclass
class StreamSchedule:
    """The UNet steps a frame goes through, and the scheduler's constants at each (host floats).

    Attributes:
        timesteps: the scheduler's timestep of each step (what the UNet's ``timestep`` input gets).
        signal, noise: the scheduler's own noising at each step, ``add_noise`` then ``scale_model_input``, as
            ``x_t = signal * x0 + noise * ε``: √ᾱ and √(1 − ᾱ) for every variance-preserving scheduler (DDPM-style
            ones directly, Euler-style ones through their sigmas).
        skip, out: LCM's boundary condition at each step (``c_skip``, ``c_out``); ``None`` for other schedulers.
        prediction_type: what the UNet predicts: ``"epsilon"``, ``"v_prediction"`` or ``"sample"``.
        clip: the x0 prediction is clamped to ``[-clip, clip]`` (the scheduler's ``clip_sample``), or ``None``.
    """

    timesteps: List[float]
    signal: List[float]
    noise: List[float]
    skip: Optional[List[float]]
    out: Optional[List[float]]
    prediction_type: str
    clip: Optional[float]


def stream_schedule(scheduler: Any, timesteps: Sequence[Any], begin_index: int) -> StreamSchedule:
    """The constants of ``timesteps`` (the scheduler's, from its ``begin_index`` on), read off ``scheduler`` itself:
    a copy of it, set at each step, noises a unit signal and a unit noise.

    Raises:
        ValueError: the scheduler is not variance-preserving (an EDM one), thresholds, or predicts something else
            than ε, v or x0.
    """
    config = scheduler.config
    name = type(scheduler).__name__
    prediction_type = config.get("prediction_type", "epsilon")
    if prediction_type not in _PREDICTION_TYPES:
        raise ArgumentError(
            "scheduler", f"expected prediction_type among {list(_PREDICTION_TYPES)}, got {prediction_type!r} ({name})"
        )
    if config.get("thresholding", False):
        raise ArgumentError(
            "scheduler",
            f"expected thresholding=False (dynamic thresholding depends on each frame's values), got True ({name})",
        )
    one, zero = torch.ones(1, 1, 1, 1, dtype=torch.float64), torch.zeros(1, 1, 1, 1, dtype=torch.float64)
    signal, noise, skip, out = [], [], [], []
    boundary = hasattr(scheduler, "get_scalings_for_boundary_condition_discrete")
    for index, timestep in enumerate(timesteps):
        timestep = torch.as_tensor(timestep)
        coefficients = []
        for sample, eps in ((one, zero), (zero, one)):
            probe = copy.deepcopy(scheduler)  # Euler-style schedulers keep the step they are at
            if hasattr(probe, "set_begin_index"):
                probe.set_begin_index(begin_index + index)
            noised = probe.add_noise(sample, eps, timestep.reshape(1))
            coefficients.append(float(probe.scale_model_input(noised, timestep).reshape(())))
        a, b = coefficients
        if not (a > 0 and abs(a * a + b * b - 1) <= 1e-3):
            raise ArgumentError(
                "scheduler",
                f"expected a variance-preserving noise schedule (the model input √ᾱ·x0 + "
                f"√(1 − ᾱ)·noise), got {name}, whose step {index} (timestep {float(timestep):g}) gives "
                f"{a:.4g}·x0 + {b:.4g}·noise; use a DDPM-style or Euler-style scheduler",
            )
        signal.append(a)
        noise.append(b)
        if boundary:
            c_skip, c_out = scheduler.get_scalings_for_boundary_condition_discrete(timestep)
            skip.append(float(c_skip))
            out.append(float(c_out))
    clip = float(config.get("clip_sample_range", 1.0)) if config.get("clip_sample", False) else None
    return StreamSchedule(
        [float(t) for t in timesteps],
        signal,
        noise,
        skip if boundary else None,
        out if boundary else None,
        prediction_type,
        clip,
    )


# ------------------------------------------------------------------------------------------ the similarity filter
class SimilarityFilter:
    """StreamDiffusion's stochastic similarity filter: a frame whose preprocessed image is nearly the last kept one's is
    skipped with a probability that grows with their cosine similarity ``s``, ``max(0, 1 − (1 − s) / (1 − threshold))``
    (0 for a threshold of 1 or more), drawn against ``uniform(0, 1)``; a frame that would be skipped once the count of
    skips is past ``max_skip_frame`` is kept and the count starts again (StreamDiffusion counts skips since that reset,
    not in a row). A kept frame becomes the one the next frames are compared with.

    The similarity is computed on the device in float32 (``torch.nn.functional.cosine_similarity`` over the whole
    image, eps 1e-6, as StreamDiffusion's ``CosineSimilarity(dim=0)``); the decision is the host's, so it reads that
    one number back: the host waits for the frames before to finish (see docs/streams.md for what that costs). The
    draws come from ``random.Random(seed)`` (StreamDiffusion draws from Python's global generator), one per compared
    frame."""

    def __init__(self, threshold: float, max_skip_frame: int, seed: int):
        self.threshold = threshold
        self.max_skip_frame = max_skip_frame
        self.random = random.Random(seed)
        self.kept: Optional[torch.Tensor] = None
        self.skip_count = 0
        self.frames = self.skipped = 0  # frames compared, and skipped

    def keep(self, image: torch.Tensor) -> None:
        """``image`` is the one the next frames are compared with, without a comparison (the first frame, or one of
        another kind than the last output)."""
        with torch.inference_mode(False):
            self.kept = image.detach().float().clone()

    def skip(self, image: torch.Tensor) -> bool:
        """Whether the frame whose preprocessed image is ``image`` is skipped (and the kept image after it)."""
        if self.kept is None:
            self.keep(image)
            return False
        similarity = float(
            torch.nn.functional.cosine_similarity(self.kept.reshape(-1), image.float().reshape(-1), dim=0, eps=1e-6)
        )
        sample = self.random.uniform(0, 1)
        probability = 0.0 if self.threshold >= 1 else max(0.0, 1 - (1 - similarity) / (1 - self.threshold))
        self.frames += 1
        if probability < sample:  # kept (the count of skips in a row goes on: StreamDiffusion resets it below only)
            self.kept.copy_(image)
            return False
        if self.skip_count > self.max_skip_frame:
            self.skip_count = 0
            self.kept.copy_(image)
            return False
        self.skip_count += 1
        self.skipped += 1
        return True


# ---------------------------------------------------------------------------------------------------- the plan
class StreamPlan:
    """What ``prepare`` fixes for the frames that follow: the schedule, the device tensors the models read and write
    (their graphs' own input buffers where they have graphs), the captured stages and the frames in flight."""

    def __init__(
        self,
        height: int,
        width: int,
        schedule: StreamSchedule,
        batched: bool,
        cfg_type: str,
        guidance_scale: float,
        prompt: str,
        negative_prompt: Optional[str],
        delta: float = 1.0,
    ):
        self.height, self.width = height, width
        self.schedule = schedule
        self.steps = len(schedule.timesteps)
        self.batched = batched
        self.cfg_type = cfg_type  # the guidance the UNet batch carries: see CFG_TYPES ("none": no guidance)
        self.guidance = cfg_type != "none"
        self.guidance_scale = guidance_scale
        self.delta = delta
        self.prompt, self.negative_prompt = prompt, negative_prompt
        # whether the prompt is encoded with its negative: "full" guides with a negative row per latent row,
        # "initialize" with one negative row (the newest frame's first step); "self" guides without one
        self.negative = cfg_type in ("full", "initialize")
        self.copies = 2 if cfg_type == "full" else 1  # the UNet batch holds the latents once, or twice for "full"
        self.latent_rows = self.steps if batched else 1
        self.rows = self.copies * self.latent_rows + (1 if cfg_type == "initialize" else 0)
        self.tensors: Dict[str, torch.Tensor] = {}
        self.unet_inputs: Dict[str, torch.Tensor] = {}
        self.step_timesteps: List[torch.Tensor] = []  # one UNet timestep input per step (a frame at a time)
        self.outputs: Dict[Tuple, torch.Tensor] = {}
        self.stages: Dict[str, CapturedStage] = {}
        self.step_stages: List[CapturedStage] = []
        self.encoded: Optional[torch.Tensor] = None  # the encoder's last output
        self.in_flight: Deque[Optional[FrameKind]] = deque()  # a stream batch's frames, oldest first
        self.filter: Optional[SimilarityFilter] = None  # the similarity filter, where prepare set one
        self.last: Optional[PendingFrame] = None  # the last output handed out (what a skipped frame gives again)
        # a ControlNet stream's: each ControlNet's control image rows, timestep input(s), the last control images
        self.control: Dict[str, Any] = {}

    def output(self, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The device tensor outputs of this layout are written into (then copied out: see :meth:`FrameCopies.take`)."""
        key = (tuple(shape), dtype)
        if key not in self.outputs:
            with torch.inference_mode(False):
                self.outputs[key] = torch.zeros(shape, dtype=dtype, device=device)
        return self.outputs[key]


# --------------------------------------------------------------------------------------------- the arithmetic
def make_stages(plan: StreamPlan, graphs: bool, channels: int, scaling: float) -> None:
    """The torch arithmetic between the model calls, as :class:`CapturedStage`\\ s in ``plan.stages`` (and one
    per step in ``plan.step_stages`` without a stream batch); ``graphs``: replayed as CUDA graphs.

    Residual classifier-free guidance (``cfg_type`` "self" or "initialize") is StreamDiffusion's: the negative
    prediction is ``delta · stock`` where the stock noise (one row per latent row, zeros at first) is, after every
    UNet call, the stream's noise rolled one row up plus the step's own estimate of the noise it left,
    ``α_next · step(ε̂, β · stock) / β_next`` (``step`` the x0 prediction, ``α_next``, ``β_next`` the next row's
    constants, 1 after the last); in a stream batch of several steps the stock moves one row down with the frames
    before each call, the stream's first noise entering at the top. "initialize" first sets the stock's top row to the
    UNet's prediction for the newest frame under the negative prompt.

    Args:
        channels: the latent channels (an encoder output of twice as many holds (mean, logvar)).
        scaling: the VAE's scaling factor.
    """
    tensors, schedule = plan.tensors, plan.schedule
    signal, noise_scale, noise = tensors["signal"], tensors["noise_scale"], tensors["noise"]
    skip, out, stock = tensors.get("skip"), tensors.get("out"), tensors.get("stock")
    steps, cfg_type, guidance_scale, delta = plan.steps, plan.cfg_type, plan.guidance_scale, plan.delta
    residual = cfg_type in ("self", "initialize")

    def write_sample(sample: torch.Tensor, noised: torch.Tensor) -> None:
        # the UNet batch: the latents once, [negative; text] rows for "full", the newest frame's first row ahead of
        # them (under the negative prompt) for "initialize"
        if cfg_type == "full":
            sample[: noised.shape[0]].copy_(noised)
            sample[noised.shape[0] :].copy_(noised)
        elif cfg_type == "initialize":
            sample[:1].copy_(noised[:1])
            sample[1:].copy_(noised)
        else:
            sample.copy_(noised)

    def latents_of(sample: torch.Tensor) -> torch.Tensor:
        """The noised latents in the UNet batch, one row per latent row."""
        return sample[1:] if cfg_type == "initialize" else sample[: plan.latent_rows]

    def guided(model_output: torch.Tensor) -> torch.Tensor:
        """The UNet's prediction for each latent row, guided as ``cfg_type`` says."""
        prediction = model_output.float()
        if cfg_type == "full":
            half = prediction.shape[0] // 2
            return torch.lerp(prediction[:half], prediction[half:], guidance_scale)
        if not residual:
            return prediction
        if cfg_type == "initialize":
            stock[:1].copy_(prediction[:1])
            prediction = prediction[1:]
        negative = stock * delta
        return negative + guidance_scale * (prediction - negative)

    def x0_of(x_t: torch.Tensor, prediction: torch.Tensor, rows: slice, clip: bool = True) -> torch.Tensor:
        """x0 from the (guided) prediction, as the scheduler's prediction_type says."""
        if schedule.prediction_type == "epsilon":
            x0 = (x_t - noise_scale[rows] * prediction) / signal[rows]
        elif schedule.prediction_type == "v_prediction":
            x0 = signal[rows] * x_t - noise_scale[rows] * prediction
        else:
            x0 = prediction
        if clip and schedule.clip is not None:
            x0 = x0.clamp(-schedule.clip, schedule.clip)
        if skip is not None:
            x0 = out[rows] * x0 + skip[rows] * x_t
        return x0

    def renew_stock(prediction: torch.Tensor, rows: slice, last: bool) -> None:
        """StreamDiffusion's stock noise after a call (see above); ``rows``: the latent rows' constants, ``last``:
        whether their last row is the schedule's last step (its next constants are 1)."""
        left = x0_of(noise_scale[rows] * stock, prediction, rows, clip=False)
        following = slice(rows.start + 1, rows.stop + 1)
        alpha_next, beta_next = signal[following], noise_scale[following]
        if last:
            one = torch.ones_like(signal[:1])
            alpha_next, beta_next = torch.cat([alpha_next, one]), torch.cat([beta_next, one])
        stock.copy_(torch.cat([noise[rows][1:], noise[rows][:1]]) + alpha_next * left / beta_next)

    def encoded_latents(encoded: torch.Tensor) -> torch.Tensor:
        # an optimum export gives the latent distribution's (mean, logvar): its mean, as a numpy generator would
        return encoded[:, :channels].float() * scaling

    plan.stages["pre"] = CapturedStage(to_vae_input, graphs)
    plan.stages["post"] = CapturedStage(to_output_frame, graphs)
    if plan.batched:

        def start(encoded: torch.Tensor, x0: torch.Tensor, sample: torch.Tensor) -> None:
            # row 0: the new frame at step 1; row i: the frame that came i calls ago, at step i + 1
            latents = torch.cat([encoded_latents(encoded), x0[:-1]])
            write_sample(sample, signal * latents + noise_scale * noise)
            if residual:  # the stock moves down with its frames; the new frame's row starts from the first noise
                stock.copy_(torch.cat([noise[:1], stock[:-1]]))

        def step(model_output: torch.Tensor, sample: torch.Tensor, x0: torch.Tensor, latent: torch.Tensor) -> None:
            x_t = latents_of(sample).float()
            prediction = guided(model_output)
            denoised = x0_of(x_t, prediction, slice(None))
            if residual:
                renew_stock(prediction, slice(0, steps), last=True)
            x0.copy_(denoised)
            latent.copy_(denoised[-1:] / scaling)

        plan.stages["start"] = CapturedStage(start, graphs)
        plan.stages["step"] = CapturedStage(step, graphs)
        return

    def start_alone(encoded: torch.Tensor, sample: torch.Tensor) -> None:
        write_sample(sample, signal[:1] * encoded_latents(encoded) + noise_scale[:1] * noise[:1])

    def step_at(index: int):
        rows, following = slice(index, index + 1), slice(index + 1, index + 2)

        def step(model_output: torch.Tensor, sample: torch.Tensor, latent: torch.Tensor) -> None:
            prediction = guided(model_output)
            denoised = x0_of(latents_of(sample).float(), prediction, rows)
            if residual:  # one step (prepare refuses residual guidance over several steps one after another)
                renew_stock(prediction, rows, last=True)
            if index + 1 < steps:
                write_sample(sample, signal[following] * denoised + noise_scale[following] * noise[following])
            else:
                latent.copy_(denoised / scaling)

        return step

    plan.stages["start"] = CapturedStage(start_alone, graphs)
    plan.step_stages = [CapturedStage(step_at(index), graphs) for index in range(steps)]
