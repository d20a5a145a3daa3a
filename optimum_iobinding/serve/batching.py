"""A replica's batching: its pipeline, which requests it lets into Serve's batch queue and when, and how a batch
becomes pipeline calls and answers — :class:`ImageGenerator` (no HTTP) and its gate, :class:`Admission`.

* At start a replica captures the signatures it will serve (the pipeline's ``warmup``: every batch size up to
  ``max_batch_size`` at the default size), so the first request runs as fast as later ones.
* Requests are batched by ``@serve.batch`` (``max_batch_size`` counts images, ``batch_wait_timeout_s``). Requests
  that come while a batch runs wait (:class:`Admission`) and enter the next batch together. On CUDA a batch is put
  on the GPU and the next one is let in at once, queued behind it on the pipeline's stream, while the first one's
  images come back and are answered: the GPU does not wait for the host between batches (at most two batches are
  unfinished). A request on an idle replica starts its batch at once where its client is alone (the last batch held
  it alone, and nothing came while it ran); otherwise (a fresh replica, a burst) that batch waits up to
  :data:`IDLE_GATHER_WAIT` for a full batch. A batch runs one pipeline call per group of requests that agree on
  what a call cannot mix — size, steps, guidance — so requests of different sizes, step counts or guidance ride in
  the same ``@serve.batch`` window but in different pipeline calls.
* Within a call every request keeps its own prompt, negative prompt and seed: image ``k`` of a request with seed
  ``s`` is drawn from its own ``torch.Generator`` seeded ``s + k`` (the latents and every scheduler noise), so it
  equals the image of a single call ``pipe(prompt, generator=torch.Generator().manual_seed(s + k))`` up to the
  batch's floating-point rounding.
* Requests with an ``image`` run image-to-image on the pipeline's image-to-image sibling, which shares the same
  models (where the family has one and the folder a VAE encoder: :meth:`~optimum_iobinding.pipelines.
  OnnxDiffusionPipeline.image_to_image`), batched with the image-to-image requests of the same strength; with a
  ``mask`` too, inpainting on its inpainting sibling (:meth:`~optimum_iobinding.pipelines.OnnxDiffusionPipeline.
  inpainting`), batched with the inpainting requests of the same strength.
* Requests are checked before batching (:meth:`ImageGenerator.complete_request`: the replica's limits, then the
  pipeline's own checks), so a bad request never fails the others and never queues any work.
* A pipeline call that fails is retried one request at a time, so only the requests whose own call fails get an
  error: 400 for a value the pipeline refuses, 503 for anything else (an allocation failure, a device error); the
  replica goes on with the next batch. A request not answered within ``request_timeout_s`` gets 504.
"""

import asyncio
import collections
import concurrent.futures
import contextlib
import copy
import dataclasses
import logging
import math
import os
import secrets
import threading
import time
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Sequence, Tuple

try:
    from ray import serve
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError("optimum_iobinding.serve needs Ray Serve: pip install 'optimum-iobinding[serve]'") from error

from ..errors import ArgumentError
from ..families import IMAGE_ROLES, family, family_of_class, image_role, image_route
from .config import RequestLimits, ServeConfig
from .schema import MAX_SEED, decode_image, decode_mask, encode_pngs, parse_size, shown

logger = logging.getLogger(__name__)

# the request's JSON fields that give the pipeline's arguments, for a refusal by the pipeline's own checks
PIPELINE_ARGUMENT_FIELDS = {
    "height": "size",
    "width": "size",
    "height and width": "size",
    "num_inference_steps": "steps",
    "guidance_scale": "guidance",
    "num_images_per_prompt": "n",
    "strength": "strength",
    "mask_image": "mask",
    "prompt": "prompt",
    "negative_prompt": "negative_prompt",
    "control_mode": "control_mode",
}


def named_by_field(error: ArgumentError) -> ArgumentError:
    """A pipeline's refusal of an argument, naming the request's JSON field that gave it (``steps``, not
    ``num_inference_steps``; ``size: height and width …`` where the field holds both); others as they are."""
    field = PIPELINE_ARGUMENT_FIELDS.get(error.argument)
    if field is None or field == error.argument:
        return error
    if field == "size":  # one field for two arguments: the reason says which
        return ArgumentError(field, f"{error.argument} {error.reason}")
    return error.renamed(field)


@contextlib.contextmanager
def model_named_as_configured() -> Iterator[None]:
    """Loading refuses the folder as ``pretrained_model_name_or_path``; a replica was given it as ``model`` (the
    setting of ServeConfig, and the argument of ``optimum-iobinding serve``): inside this block it is named so."""
    try:
        yield
    except ArgumentError as error:
        if error.argument != "pretrained_model_name_or_path":
            raise
        raise error.renamed("model") from error


# How long (a share of the batch's time) a batch waits for the clients of the previous one to come back. Too short a
# share fails with several clients per replica: their answers pass the proxy one after another, the late ones miss
# the batch and the groups split (docs/serving.md gives the measurements behind these waits).
REGROUP_WAIT = 0.10
# The same where the next batch queues on the GPU behind the running one (CUDA replicas): it could not start before
# that one ends anyway, so waiting up to half the last batch's time for its whole group costs nothing, where the
# shorter share let a steady load alternate between a batch one image short and a full one.
QUEUED_REGROUP_WAIT = 0.5
# How long a batch that starts on an idle replica waits for more requests (up to ``max_batch_size`` images; it starts
# as soon as they are there) while the replica expects company: at start, and after any batch but one of a single
# request during which nothing else came (a lone client, whose requests then start at once). A burst of clients
# reaches a replica over some milliseconds. Without the wait a fresh server's first burst ran its first request (or
# two) alone, and its first answers took a batch more; with it, its batches are full from the first. Its length costs
# a burst once, a small share of one batch; too short, the burst's last request misses the first batch.
IDLE_GATHER_WAIT = 0.1

# the strength of a request with an image and no strength: image to image keeps a fifth of the schedule's noise
# steps out (diffusers' default); inpainting starts from noise (the inpainting pipeline's default), its unmasked area
# kept from the image
IMAGE_TO_IMAGE_STRENGTH = 0.8
INPAINTING_STRENGTH = 1.0


def _images_in(requests: Sequence[Dict[str, Any]]) -> int:
    return sum(request["n"] for request in requests)


def _group_key(request: Dict[str, Any]) -> Tuple:
    """What one pipeline call cannot mix: the pipeline that runs it (image-to-image requests run apart from
    text-to-image ones), the sizes of its images, the LoRAs' weights."""
    images = request.get("images") or {}
    return (
        request["width"],
        request["height"],
        request["steps"],
        request["guidance"],
        request.get("route"),
        tuple(sorted((name, image.shape) for name, image in images.items())),
        request.get("strength"),
        request.get("control_mode"),
        request.get("lora_weights"),
    )


def refusal(error: BaseException) -> Dict[str, Any]:
    """The answer to a request refused (400), naming the field it refused (``param``) where the error names it."""
    return {"error": str(error), "status": 400, "param": getattr(error, "argument", None)}


def _failure(error: BaseException) -> str:
    """The one-line answer to a request whose pipeline call failed through no fault of its own."""
    lines = str(error).strip().splitlines()
    what = f"{type(error).__name__}: {lines[0][:300]}" if lines else type(error).__name__
    return (
        f"pipeline: expected images, got {what}; the replica goes on serving: try again, or ask for fewer or "
        "smaller images"
    )


# ---------------------------------------------------------------------------------------------------- admission
class Admission:
    """The gate in front of Serve's batch queue, counted in images.

    Serve's ``@serve.batch`` (2.60) forms a batch as soon as its first request comes, also while the previous batch
    still runs; that batch then waits for a free batch slot with the requests it had. With ``batch_wait_timeout_s=0``
    each request that comes during a running batch would make a batch of its own, and closed-loop clients stay split
    in those small groups. So requests wait here while a batch runs, and when it ends, the oldest are let into
    Serve's queue together, as many images as one batch holds (:attr:`batch_cap`): the next batch is formed when the
    GPU is free to run it (what Serve documents as opportunistic batching). On CUDA "ends" is when its work is
    queued on the GPU (the next batch queues behind it), with at most ``max_unfinished`` batches unfinished.

    A request calls :meth:`admit` and then enters Serve's queue, or :meth:`withdraw` if it goes away before its batch
    starts; the batch handler reports :meth:`batch_started`, :meth:`batch_queued` and :meth:`batch_finished`. All on
    one event loop.

    Args:
        batch_cap: images of one batch (``max_batch_size``).
        max_unfinished: batches whose images may be on their way at once (2 where a batch's images come back on
            another thread while the next batch runs, else 1).
    """

    def __init__(self, batch_cap: int, max_unfinished: int = 1):
        if isinstance(batch_cap, bool) or not isinstance(batch_cap, int) or batch_cap < 1:
            raise ArgumentError("batch_cap", f"expected a positive integer, got {batch_cap!r}")
        if isinstance(max_unfinished, bool) or not isinstance(max_unfinished, int) or max_unfinished < 1:
            raise ArgumentError("max_unfinished", f"expected a positive integer, got {max_unfinished!r}")
        self._waiting: Deque[Tuple[asyncio.Future, int]] = collections.deque()  # a future and its images each
        self._admitted = 0  # images let in whose batch has not started yet
        self._batch_running = False  # a batch's pipeline call runs (on CUDA: until its work is on the GPU)
        self._unfinished = 0  # batches whose images are not on the host yet
        self._max_unfinished = max_unfinished
        self._batch_cap = batch_cap

    @property
    def admitted(self) -> int:
        """Images let in whose batch has not started yet."""
        return self._admitted

    @property
    def waiting(self) -> int:
        """Requests waiting to be let in."""
        return len(self._waiting)

    @property
    def waiting_images(self) -> int:
        """The images of the requests waiting to be let in."""
        return sum(images for _, images in self._waiting)

    @property
    def idle(self) -> bool:
        """Whether nothing is let in, waiting, running or unfinished: a request now would start a batch at once."""
        return not (self._waiting or self._admitted or self._batch_running or self._unfinished)

    @property
    def batch_running(self) -> bool:
        """Whether a batch's pipeline call runs (on CUDA: until its work is queued on the GPU)."""
        return self._batch_running

    @property
    def unfinished(self) -> int:
        """Batches started whose images are not on the host yet."""
        return self._unfinished

    @property
    def max_unfinished(self) -> int:
        """How many batches may be unfinished when the next one is let in."""
        return self._max_unfinished

    @property
    def batch_cap(self) -> int:
        """The images the next batch may hold (``max_batch_size``, or fewer while clients are expected back)."""
        return self._batch_cap

    def set_batch_cap(self, images: int) -> None:
        """The images the next batch may hold; lets nobody in by itself."""
        self._batch_cap = images

    async def admit(self, images: int) -> None:
        """Returns once a request of ``images`` images may enter Serve's queue: at once on an idle replica, else
        when a batch ends and it is among the oldest that fit. A request cancelled while it waits is forgotten."""
        if not self._waiting and self._fits(images):
            self._admitted += images
            return
        entry = (asyncio.get_running_loop().create_future(), images)
        self._waiting.append(entry)
        try:
            await entry[0]
        except asyncio.CancelledError:
            if entry[0].done() and not entry[0].cancelled():  # let in just before its client went away
                self.withdraw(images)
            elif entry in self._waiting:
                self._waiting.remove(entry)
            raise

    def withdraw(self, images: int) -> None:
        """A request let in went away before its batch started: its images make room for waiting ones."""
        self._admitted -= images
        self._release()

    def batch_started(self, images: int) -> None:
        """A batch started with ``images`` of the admitted images (those whose requests are still there)."""
        self._admitted -= images
        self._batch_running = True
        self._unfinished += 1

    def batch_queued(self) -> None:
        """The running batch's pipeline call returned (on CUDA its work is queued on the GPU): the next may enter."""
        self._batch_running = False
        self._release()

    def batch_finished(self) -> None:
        """A batch's images are on the host and answered."""
        self._unfinished -= 1
        self._release()

    def _fits(self, images: int) -> bool:
        return (
            not self._batch_running
            and self._unfinished < self._max_unfinished
            and self._admitted + images <= self._batch_cap
        )

    def _release(self) -> None:
        while self._waiting and self._fits(self._waiting[0][1]):
            future, images = self._waiting.popleft()
            if not future.done():
                self._admitted += images
                future.set_result(None)


# ------------------------------------------------------------------------------------------------ the generator
class ImageGenerator:
    """One pipeline and its batched calls, without HTTP: what a replica of
    :class:`~optimum_iobinding.serve.app.ImageService` runs (see the module's docstring); usable in a process of its
    own (``complete_request`` then ``run_batch``)."""

    def __init__(self, config: Dict[str, Any]):
        import torch

        from ..pipelines import pipeline_class_for, resolve_model_folder

        self.config = ServeConfig(**config)
        use_cuda = self.config.device == "cuda" or (self.config.device == "auto" and torch.cuda.is_available())
        provider = self.config.provider or ("CUDAExecutionProvider" if use_cuda else "CPUExecutionProvider")
        self.numpy_engine = self.config.engine == "diffusers-numpy"
        self.img2img: Any = None  # the image-to-image pipeline on the same models, where there is one
        self.inpaint: Any = None  # the inpainting pipeline on the same models, where there is one
        with model_named_as_configured():
            # a hub id: the files any text-to-image family reads, downloaded once per replica's machine
            folder = str(resolve_model_folder(self.config.model))
            if self.numpy_engine:
                from ..pipelines import load_numpy_pipeline

                self.pipe = load_numpy_pipeline(folder, provider, **self.config.pipeline_options)
            else:
                pipeline_class = pipeline_class_for(folder, text_to_image=False)  # an image-to-image family too
                refusal = family_of_class(pipeline_class.__name__).images_only_refusal()
                if refusal is not None:  # the replica returns images: a video family is refused before it loads
                    raise ArgumentError("model", refusal)
                options = dict(self.config.pipeline_options)
                if self.config.loras and provider == "CUDAExecutionProvider":  # changed in place by the LoRAs
                    options["component_options"] = pipeline_class.weights_owned_from_load(
                        folder, options.get("component_options")
                    )
                self.pipe = pipeline_class.from_pretrained(folder, provider=provider, **options)
        if self.numpy_engine:  # diffusers' numpy ONNX pipeline of Stable Diffusion
            self.family = family("sd")
            self.pipeline_name = f"diffusers.{type(self.pipe).__name__}"
            self.default_size = 512  # its call's default
        else:
            self.family = family_of_class(pipeline_class.__name__)
            self.pipeline_name = self.family.class_name
            self.default_size = self.pipe.default_image_size
            self.img2img = self.pipe.image_to_image()  # no second copy of any model
            self.inpaint = self.pipe.inpainting()
            for sibling in (self.img2img, self.inpaint):
                if sibling is not None:
                    sibling.set_progress_bar_config(disable=True)
            if self.config.cache is not None:  # every request's steps, image to image's and inpainting's too
                from ..pipelines.cache_configs import cache_config_of

                for pipe in (self.pipe, self.img2img, self.inpaint):
                    if pipe is not None:
                        pipe.enable_cache(cache_config_of(self.config.cache))
        self.pipe.set_progress_bar_config(disable=True)
        self.lora_weights: Dict[str, float] = {}  # the LoRAs loaded at start and their weights by default
        if self.config.loras:
            self._load_loras()
        self._active_loras = self._default_loras = tuple(self.lora_weights.items())
        self.model_id = os.path.basename(os.path.normpath(self.config.model)) or self.config.model
        tokenizer = getattr(self.pipe, "tokenizer", None)
        # the token limit is counted on the event loop while a batch may be encoding its prompts on the pipeline's
        # thread: a fast tokenizer's truncation and padding are settings of the one object each call sets, so a
        # count on the pipeline's own tokenizer can leave the batch's prompts unpadded: the counter is a copy
        self._token_counter = copy.deepcopy(tokenizer) if tokenizer is not None else None
        tokenizer_max = getattr(tokenizer, "model_max_length", None)
        if not isinstance(tokenizer_max, int) or tokenizer_max > 100_000:  # transformers' "no limit" is 1e30
            tokenizer_max = None
        self.limits: RequestLimits = self.config.limits(self.default_size, tokenizer_max)
        self.takes_negative_prompt = self.family.negative_prompt
        # on CUDA the call returns once its work is queued on the GPU: a second batch may queue behind it
        self._deferred = not self.numpy_engine and self.pipe.device.type == "cuda"
        self.admission = Admission(self.config.max_batch_size, max_unfinished=2 if self._deferred else 1)
        self._default_limits = (self.config.max_batch_size, self.config.batch_wait_timeout_s)
        self._regroup_until = 0.0  # when the wait of the last regroup (expect_return) ran out
        self._limit_batches(*self._default_limits)
        # every pipeline call on one thread, the warm-up's too: ONNX Runtime's CUDA provider keeps its captured
        # graphs per thread, as the models keep their reused output buffers, so a warm-up on another thread would
        # leave the first batches to capture again; the images come back on other threads
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pipeline")
        try:
            self.warmup_s = self._worker.submit(self._warm_up).result()
        except BaseException:
            self._worker.shutdown(wait=False)
            raise
        self.batches_run = 0
        self._arrivals = 0  # requests that passed the checks and went to the gate
        self._company_expected = True  # a batch that starts idle waits for more (IDLE_GATHER_WAIT)
        self._finisher = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="images")

    def _load_loras(self) -> None:
        """Loads ``config.loras`` as adapters named after their files, all active at their weights; a LoRA the
        family or the models cannot take fails the replica naming ``loras``."""
        from ..cache_spec import lora_adapter_names, parse_lora_spec

        if self.family.lora is None:
            raise ArgumentError("loras", f"expected none for {self.pipeline_name} ({self.family.title} takes no LoRA)")
        specs = [parse_lora_spec(spec, "loras") for spec in self.config.loras]
        names = lora_adapter_names([path for path, _ in specs])
        for name, (path, _) in zip(names, specs):
            try:
                self.pipe.load_lora_weights(path, adapter_name=name)
            except (OSError, ValueError) as error:  # a file or hub id that is no LoRA, or none of these models'
                raise ArgumentError("loras", f"{path}: {error}") from None
        self.lora_weights = {name: scale for name, (_, scale) in zip(names, specs)}
        self.pipe.set_adapters(names, adapter_weights=[scale for _, scale in specs])

    def _use_loras(self, weights: Tuple[Tuple[str, float], ...]) -> None:
        """Gives the loaded LoRAs the weights of the next call (the unnamed ones 0), where they differ from the last
        call's: the weights change in place, on the pipeline's thread, between calls."""
        if weights != self._active_loras:
            chosen = dict(weights)
            self.pipe.set_adapters(list(self.lora_weights), [chosen.get(name, 0.0) for name in self.lora_weights])
            self._active_loras = weights

    def _warm_up(self) -> float:
        """Captures every batch size the replica will run (``warmup_batch_sizes``, default 1 … ``max_batch_size``) at
        ``warmup_sizes``; on the pipeline's thread. Returns the seconds it took."""
        self._pipeline_thread = threading.get_ident()
        batches = self.config.warmup_batch_sizes
        if batches is None:
            batches = list(range(1, self.config.max_batch_size + 1))
        if not batches:
            return 0.0
        start = time.perf_counter()
        if self.numpy_engine:  # no graphs to capture: one short call per batch size (cuDNN's algorithm search)
            for size in self.config.warmup_sizes or [self.default_size]:
                for batch in batches:
                    self.pipe(
                        [""] * batch,
                        height=size,
                        width=size,
                        num_inference_steps=2,
                        guidance_scale=self.config.guidance,
                        output_type="np",
                    )
        else:
            self.pipe.warmup(
                heights=self.config.warmup_sizes or self.default_size,
                batch_sizes=batches,
                guidance_scales=self.config.guidance,
            )
        return time.perf_counter() - start

    @property
    def defers_images(self) -> bool:
        """Whether a batch's pipeline call returns with its images still on the device (CUDA): they come back on
        another thread while the next batch runs."""
        return self._deferred

    @property
    def batch_limits(self) -> Tuple[int, float]:
        """``(max_batch_size, batch_wait_timeout_s)`` of the next batch, as last given to Serve's batch queue."""
        return self._batch_limits

    def info(self) -> Dict[str, Any]:
        return {
            "pipeline": self.pipeline_name,
            "default_size": self.default_size,
            "warmup_s": self.warmup_s,
            "image_to_image": self.img2img is not None,
            "inpainting": self.inpaint is not None,
            "images": sorted({image_role(self.family, argument) for argument in self.family.image_inputs}),
            "loras": dict(self.lora_weights),
            "max_batch_size": self.config.max_batch_size,
            "device": str(self.pipe.device),
            "batches_run": self.batches_run,
            "limits": dataclasses.asdict(self.limits),
        }

    def check_health(self) -> None:
        """Serve calls this periodically; a replica whose pipeline is gone is replaced."""
        if getattr(self, "pipe", None) is None:
            raise RuntimeError("the pipeline is not loaded")

    def complete_request(self, request: Dict[str, Any]) -> Dict[str, Any]:
        """The request with its defaults filled in, checked against the replica's :attr:`limits` (cheapest first:
        nothing large is decoded or tokenized before the checks that bound it) and by the pipeline's own checks
        (ValueError/TypeError naming the value and, for a limit, the setting)."""
        limits = self.limits
        request = dict(request)
        request.setdefault("n", 1)
        for name in ("prompt", "negative_prompt"):
            text = request.get(name)
            if text is not None and len(text) > limits.max_prompt_chars:
                raise ArgumentError(
                    name, f"expected at most {limits.max_prompt_chars} characters (max_prompt_chars), got {len(text)}"
                )
        if request["n"] > limits.max_images_per_request:
            raise ArgumentError(
                "n",
                f"expected at most {limits.max_images_per_request} images per request "
                f"(max_images_per_request), got {shown(request['n'])}",
            )
        if request.get("seed") is None:
            request["seed"] = secrets.randbelow(2**31)
        if request.get("steps") is None:
            request["steps"] = self.config.steps
        if not 1 <= request["steps"] <= limits.max_steps:
            raise ArgumentError("steps", f"expected 1 to {limits.max_steps} (max_steps), got {shown(request['steps'])}")
        if request.get("guidance") is None:
            request["guidance"] = self.config.guidance
        self._complete_images(request)
        self._complete_loras(request)
        request["width"], request["height"] = width, height = parse_size(request.get("size"), self.default_size)
        if width * height > limits.max_pixels_per_image:
            raise ArgumentError(
                "size",
                f"expected at most {limits.max_pixels_per_image} pixels (max_pixels_per_image), "
                f"got {shown(width)}×{shown(height)}",
            )
        if request["n"] * width * height > limits.max_pixels_per_batch:
            raise ArgumentError(
                "n",
                f"expected at most {limits.max_pixels_per_batch} pixels in one request's images "
                f"(max_pixels_per_batch), got {request['n']}×{width}×{height}; ask for fewer images",
            )
        if request.get("negative_prompt") is not None and not self.takes_negative_prompt:
            raise ArgumentError("negative_prompt", f"{self.pipeline_name} takes none")
        if request["seed"] + request["n"] - 1 > MAX_SEED:
            raise ArgumentError(
                "seed", f"expected at most {MAX_SEED - request['n'] + 1} for n={request['n']}, got {request['seed']}"
            )
        self._check_tokens(request)
        if self.numpy_engine:  # its own checks run when it is called (a failing batch is retried one by one)
            return request
        checks = dict(
            prompt=request["prompt"],
            height=request["height"],
            width=request["width"],
            num_inference_steps=request["steps"],
            callback_steps=None,
            guidance_scale=request["guidance"],
            num_images_per_prompt=request["n"],
            strength=request.get("strength"),
        )
        if self.takes_negative_prompt:
            checks["negative_prompt"] = request.get("negative_prompt")
        try:
            self.pipe.check_inputs(**checks)
        except ArgumentError as error:
            named = named_by_field(error)
            source = request.get("size_from")
            if named.argument == "size" and source is not None:  # the request gave no size: its image did
                size = f"{request['width']}x{request['height']}"
                named = ArgumentError(source, f"its size {size} (the request gives no size): {named.reason}")
            raise named from None
        return request

    def _complete_images(self, request: Dict[str, Any]) -> None:
        """The request's images (``image``, ``mask``, ``control_image``) decoded into ``request["images"]`` (call
        argument → pixels) of the pipeline that takes them (``request["route"]``: the folder's own, ``None``, or its
        ``"image_to_image"`` or ``"inpainting"`` sibling; ``request["runs"]``: that one's family), the size the
        image's where the family's output has it (image to image) or the request gives none; refusals name the
        field."""
        limits = self.limits
        request["images"], request["route"], request["runs"] = {}, None, self.family.key
        roles = {role for role in IMAGE_ROLES if request.get(role) is not None}
        if request.get("control_mode") is not None and "control_image" not in roles:
            raise ArgumentError("control_mode", "expected it beside a control image (control_image), got it alone")
        if not roles:
            if request.get("strength") is not None:
                raise ArgumentError("strength", "only an image-to-image request (with image) takes one")
            return
        if "mask" in roles and "image" not in roles:
            raise ArgumentError("mask", "expected it beside an image to repaint (image), got a mask alone")
        route, runs = image_route(self.family, roles, request.get("strength") is not None)
        if request.get("control_mode") is not None and not runs.options.get("control_mode"):
            raise ArgumentError(
                "control_mode", f"expected none for {runs.class_name} ({runs.title} takes no union ControlNet's mode)"
            )
        if runs.options.get("control_mode") and not self.numpy_engine:  # a union ControlNet needs its mode
            pipe = {None: self.pipe, "image_to_image": self.img2img, "inpainting": self.inpaint}[route]
            pipe.check_control_modes(request.get("control_mode"))
        if route == "image_to_image" and self.img2img is None:
            raise ArgumentError(
                "image",
                f"{self.pipeline_name} on this folder has no image-to-image pipeline (its family has none, or the "
                "folder has no VAE encoder)",
            )
        if route == "inpainting" and self.inpaint is None:
            raise ArgumentError(
                "mask",
                f"{self.pipeline_name} on this folder has no inpainting pipeline (its family has none, or the folder "
                "has no VAE encoder); leave the mask out for image to image",
            )
        decoded = {
            role: decode_image(request.pop(role), limits.max_pixels_per_image, role)
            for role in ("image", "control_image")
            if role in roles
        }
        sizing = "image" if "image" in decoded else "control_image"
        height, width = decoded[sizing].shape[:2]
        if runs.sized_by_image:
            if request.get("size") is not None and parse_size(request["size"], self.default_size) != (width, height):
                raise ArgumentError(
                    "size", f"the image is {width}x{height}; leave size out or give that, got {shown(request['size'])}"
                )
        if request.get("size") is None:  # the image's: a size the pipeline refuses is the image's field's
            request["size"], request["size_from"] = f"{width}x{height}", sizing
        elif runs.sized_by_image:  # the same size, written as the image's
            request["size"] = f"{width}x{height}"
        if "mask" in roles:
            decoded["mask"] = decode_mask(request.pop("mask"), (width, height), limits.max_pixels_per_image)
        request["images"] = {argument: decoded[image_role(runs, argument)] for argument in runs.image_inputs}
        request["route"], request["runs"] = route, runs.key
        if request.get("strength") is None and route is not None:
            request["strength"] = IMAGE_TO_IMAGE_STRENGTH if route == "image_to_image" else INPAINTING_STRENGTH

    def _complete_loras(self, request: Dict[str, Any]) -> None:
        """``request["lora_weights"]``: the weight of each loaded LoRA in the request's call, its ``loras`` field's
        (a name it does not give: 0) or, without one, the service's."""
        chosen = request.pop("loras", None)
        if chosen is None:
            request["lora_weights"] = self._default_loras
            return
        if not isinstance(chosen, dict):
            raise ArgumentError("loras", f"expected a map of LoRA names to weights, got {shown(chosen)}")
        unknown = sorted(set(chosen) - set(self.lora_weights), key=str)
        if unknown:
            loaded = sorted(self.lora_weights) or "none: the service loaded no LoRA"
            raise ArgumentError("loras", f"expected names among {loaded}, got {shown(unknown)}")
        for name, weight in chosen.items():
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise ArgumentError("loras", f"expected a finite weight for {name!r}, got {shown(weight)}")
        request["lora_weights"] = tuple((name, float(chosen.get(name, 0.0))) for name in self.lora_weights)

    def _check_tokens(self, request: Dict[str, Any]) -> None:
        limit = self.limits.max_prompt_tokens
        tokenizer = self._token_counter
        if limit is None or tokenizer is None:
            return
        for name in ("prompt", "negative_prompt"):
            text = request.get(name)
            if not text:
                continue
            tokens = len(tokenizer(text, truncation=False, verbose=False).input_ids)  # with its start and end
            if tokens > limit:
                raise ArgumentError(
                    name,
                    f"expected at most {limit} tokens (max_prompt_tokens), got {tokens}; the text encoder reads "
                    f"{tokenizer.model_max_length}: shorten it",
                )

    async def generate(self, request: Dict[str, Any]) -> Dict[str, Any]:
        """One request → ``{"images": [uint8 HxWx3], "seeds", "batch_images", "batch_requests", "replica_s"}`` (with
        ``"pngs"`` and ``"encode_s"`` where the answers are stored PNGs: :meth:`answers_of_batch`), or
        ``{"error": message, "status": code}``: 400 for a request the limits or the pipeline refuse (checked before
        any of its work is queued), 503 where its pipeline call failed, 504 where no answer came within
        ``request_timeout_s``."""
        arrived = time.perf_counter()
        try:
            request = self.complete_request(request)
        except (ValueError, TypeError) as error:
            return refusal(error)
        timeout = self.limits.request_timeout_s
        try:
            result = await asyncio.wait_for(self._queue_and_run(request), timeout)
        except asyncio.TimeoutError:
            return {
                "error": f"request_timeout_s: expected an answer within {timeout:g} s, got none; the replica is "
                "busy: try again later",
                "status": 504,
            }
        if "error" not in result:
            result = dict(result, replica_s=time.perf_counter() - arrived)
        return result

    async def _queue_and_run(self, request: Dict[str, Any]) -> Dict[str, Any]:
        """A completed request through the gate and Serve's batch queue into a batch."""
        images = request["n"]
        self._arrivals += 1
        self.on_arrival()
        await self.admission.admit(images)
        try:
            return await self._batched(request)
        finally:
            if not request.get("_started"):  # let in, but gone before its batch started (cancelled, timed out)
                request["_abandoned"] = True
                self.admission.withdraw(images)

    def expect_return(self, images: int, seconds: float) -> None:
        """After a batch of ``images`` that took ``seconds``, when fewer images wait: the next batch waits up to
        :data:`REGROUP_WAIT` of that time for as many images (up to ``max_batch_size``), since clients that got
        their answers tend to send their next requests at once; it starts as soon as they are there. Without this, a
        group of clients split once (the first of them to come back runs alone) stays split. The requests already
        waiting ride with them (up to ``max_batch_size``): capped at the returning images alone, a returning group
        and a request left over from it stayed apart, a batch one image short and a full one in turn. After a lone
        client's batch (one request, nothing else came: :attr:`expects_company` is false) nothing waits. Where the
        next batch queues behind the running one on the GPU (:attr:`defers_images`), it waits up to
        :data:`QUEUED_REGROUP_WAIT` of that time instead. A request that finds the replica idle once that wait has run
        out (its clients did not come back) starts as on a fresh replica (:meth:`on_arrival`)."""
        expected = min(images, self.config.max_batch_size)
        pending = self.admission.waiting_images + self.admission.admitted
        if expected <= 1 or pending >= expected or not self._company_expected:
            return
        share = QUEUED_REGROUP_WAIT if self._deferred else REGROUP_WAIT
        wait = max(self.config.batch_wait_timeout_s, share * seconds)
        self._limit_batches(min(self.config.max_batch_size, expected + pending), wait)
        self._regroup_until = time.monotonic() + wait

    def on_arrival(self) -> None:
        """A request passed the checks and goes to the gate. On an idle replica: a regroup whose clients did not
        come back within its wait is over (the next batch takes the defaults), and where the replica expects
        company, the batch this request starts gathers (:meth:`gather_on_idle`)."""
        if not self.admission.idle:
            return
        if self._batch_limits != self._default_limits and time.monotonic() >= self._regroup_until:
            self._limit_batches(*self._default_limits)
        if self._company_expected:
            self.gather_on_idle()

    def gather_on_idle(self) -> None:
        """The batch a request on an idle replica starts waits up to :data:`IDLE_GATHER_WAIT` for as many images as
        a batch holds (the rest of a burst), unless a regroup (:meth:`expect_return`) already set its limits. Called
        while the replica expects company (:attr:`expects_company`)."""
        if self.config.max_batch_size > 1 and self._batch_limits == self._default_limits:
            self._limit_batches(self.config.max_batch_size, max(self.config.batch_wait_timeout_s, IDLE_GATHER_WAIT))

    @property
    def expects_company(self) -> bool:
        """Whether a request on an idle replica waits for others (:meth:`gather_on_idle`): at start, and after any
        batch but a lone client's (one request, and nothing else came while it ran)."""
        return self._company_expected

    def _limit_batches(self, max_batch_size: int, wait_timeout_s: float) -> None:
        """The next batch's limits, for the gate and for Serve's batch queue (kept: :attr:`batch_limits`)."""
        self.admission.set_batch_cap(max_batch_size)
        self._batched.set_max_batch_size(max_batch_size)
        self._batched.set_batch_wait_timeout_s(wait_timeout_s)
        self._batch_limits = (max_batch_size, wait_timeout_s)

    @serve.batch(max_batch_size=4, batch_wait_timeout_s=0.0, batch_size_fn=_images_in, max_concurrent_batches=2)
    async def _batched(self, requests: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        for request in requests:
            request["_started"] = True
        self.admission.batch_started(_images_in([r for r in requests if not r.get("_abandoned")]))
        self._limit_batches(*self._default_limits)
        arrivals = self._arrivals
        start = time.perf_counter()
        loop = asyncio.get_running_loop()
        try:
            try:
                # the pipeline call blocks: run it off the event loop, which keeps taking requests
                started = await loop.run_in_executor(self._worker, self.start_batch, requests)
            finally:
                self.admission.batch_queued()  # on CUDA the next batch queues behind this one on the GPU
            return await loop.run_in_executor(self._finisher, self.answers_of_batch, started)
        finally:
            # a batch of one request with nothing else coming while it ran: a lone client, whose next request
            # starts at once
            self._company_expected = len(requests) > 1 or self._arrivals > arrivals
            self.expect_return(_images_in(requests), time.perf_counter() - start)
            self.admission.batch_finished()

    def run_batch(self, requests: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        """Completed requests → one result each: a pipeline call per group that agrees on size, steps and guidance
        (a group whose call the pipeline refuses runs one request at a time, so only the bad one fails)."""
        return self.finish_batch(self.on_pipeline_thread(self.start_batch, requests))

    def on_pipeline_thread(self, function: Callable[..., Any], *args: Any) -> Any:
        """``function(*args)`` on the thread that runs every pipeline call (and ran the warm-up), waited for: where
        per-thread state lives (ONNX Runtime's captured CUDA graphs, the models' reused output buffers), and where a
        change to the pipeline (a LoRA scale, a scheduler) cannot race a running batch."""
        if threading.get_ident() == self._pipeline_thread:
            return function(*args)
        return self._worker.submit(function, *args).result()

    def start_batch(self, requests: List[Dict[str, Any]]) -> Tuple[List[Optional[Dict[str, Any]]], List[Tuple]]:
        """:meth:`run_batch` up to the point where every call's work is on the device (on CUDA the images are
        still being made when it returns); :meth:`finish_batch` waits for them. On the pipeline's thread.

        A call runs a group of requests that agree on size, steps and guidance, as many as fit in
        ``max_pixels_per_batch``. A call that fails runs its requests again one at a time, so only a request whose
        own call fails gets an error: 400 where the pipeline refuses a value (ValueError, TypeError), else 503."""
        results: List[Optional[Dict[str, Any]]] = [None] * len(requests)
        calls: List[Tuple[List[int], _Images]] = []
        groups: Dict[Tuple, List[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(_group_key(request), []).append(index)
        for indices in groups.values():
            for chunk in self._within_pixels(requests, indices):
                members = [requests[i] for i in chunk]
                try:
                    calls.append((chunk, self._call(members)))
                    continue
                except Exception as error:  # noqa: BLE001 — each request alone says whose it is
                    if len(chunk) == 1:
                        results[chunk[0]] = self._error_result(error)
                        continue
                for index, member in zip(chunk, members):
                    try:
                        calls.append(([index], self._call([member])))
                    except Exception as error:  # noqa: BLE001
                        results[index] = self._error_result(error)
        self.batches_run += 1
        return results, calls

    def _within_pixels(self, requests: List[Dict[str, Any]], indices: List[int]) -> List[List[int]]:
        """A group's requests (same size) split into calls of at most ``max_pixels_per_batch`` pixels (each request
        fits alone: :meth:`complete_request` checked it)."""
        limit = self.limits.max_pixels_per_batch
        chunks: List[List[int]] = []
        pixels = 0
        for index in indices:
            request = requests[index]
            more = request["n"] * request["width"] * request["height"]
            if not chunks or pixels + more > limit:
                chunks.append([])
                pixels = 0
            chunks[-1].append(index)
            pixels += more
        return chunks

    @staticmethod
    def _error_result(error: BaseException) -> Dict[str, Any]:
        if isinstance(error, (ValueError, TypeError)):  # a value the pipeline's checks let through and it refused
            return refusal(named_by_field(error) if isinstance(error, ArgumentError) else error)
        logger.error("a pipeline call failed; its requests get 503", exc_info=error)
        return {"error": _failure(error), "status": 503}

    @classmethod
    def finish_batch(cls, started: Tuple[List[Optional[Dict[str, Any]]], List[Tuple]]) -> List[Dict[str, Any]]:
        """The results of a :meth:`start_batch`, once its images are on the host (any thread); a call whose images
        do not come back (a device error) answers its requests 503."""
        results, calls = started
        for indices, images in calls:
            try:
                outputs = images.outputs()
            except Exception as error:  # noqa: BLE001
                outputs = [cls._error_result(error)] * len(indices)
            for index, output in zip(indices, outputs):
                results[index] = output
        return results  # type: ignore[return-value]

    def answers_of_batch(self, started: Tuple[List[Optional[Dict[str, Any]]], List[Tuple]]) -> List[Dict[str, Any]]:
        """:meth:`finish_batch`, and where the answers are stored PNGs (``png_compression`` 0: three passes over
        the pixels, short next to the batch's own time) each result's ``"pngs"`` and ``"encode_s"``,
        made here on the batch's finishing thread rather than on another thread after the result reached the event
        loop: a request at concurrency 1 saves that hand-off. Compressed PNGs (many times slower to make) are left to
        the HTTP handler, which encodes them on threads of their own, in parallel."""
        results = self.finish_batch(started)
        if self.config.png_compression == 0:
            for result in results:
                if "images" in result:
                    start = time.perf_counter()
                    result["pngs"] = encode_pngs(result["images"], 0)
                    result["encode_s"] = time.perf_counter() - start
        return results

    def _call(self, members: List[Dict[str, Any]]) -> "_Images":
        import numpy as np
        import torch

        prompts, negatives, seeds = [], [], []
        images: Dict[str, List[Any]] = {}  # one image (and mask) per image row, each row with its own generator
        for member in members:
            for k in range(member["n"]):
                prompts.append(member["prompt"])
                negatives.append(member.get("negative_prompt") or "")
                seeds.append(member["seed"] + k)
                for argument, pixels in member["images"].items():
                    images.setdefault(argument, []).append(pixels)
        first = members[0]
        if self.numpy_engine:
            generator: Any = np.random.RandomState(seeds[0] % 2**32)
        else:
            generator = [torch.Generator().manual_seed(seed) for seed in seeds]
        arguments = dict(
            prompt=prompts,
            num_inference_steps=first["steps"],
            guidance_scale=first["guidance"],
            generator=generator,
            output_type="np",
        )
        if self.takes_negative_prompt and any(negatives):
            arguments["negative_prompt"] = negatives
        pipe = {None: self.pipe, "image_to_image": self.img2img, "inpainting": self.inpaint}[first["route"]]
        runs = family(first["runs"])
        arguments.update({argument: np.stack(rows) for argument, rows in images.items()})
        if not runs.sized_by_image:
            arguments.update(height=first["height"], width=first["width"])
        if runs.options.get("size_by_area"):  # FLUX.1 Kontext: the size asked for, not about a megapixel
            arguments["max_area"] = first["height"] * first["width"]
        if first.get("strength") is not None:
            arguments["strength"] = first["strength"]
        if first.get("control_mode") is not None:
            arguments["control_mode"] = first["control_mode"]
        if self.lora_weights:
            self._use_loras(first["lora_weights"])
        start = time.perf_counter()
        if self._deferred:
            # the images stay on the device (no host wait): made uint8 HWC there, copied to pinned memory behind
            # the call on the stream, and waited for in _Images.outputs (another thread), while the next call runs
            images = pipe(**dict(arguments, output_type="pt")).images
            with torch.cuda.device(images.device):
                pixels = (images.float().clamp(0.0, 1.0) * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
                host = torch.empty(pixels.shape, dtype=torch.uint8, pin_memory=True)
                host.copy_(pixels, non_blocking=True)
                done = torch.cuda.Event()
                done.record(torch.cuda.current_stream(images.device))
            return _Images(members, seeds, start, host=host, done=done)
        images = pipe(**arguments).images
        pixels = (np.clip(images, 0.0, 1.0) * 255).round().astype(np.uint8)  # as diffusers' numpy_to_pil
        return _Images(members, seeds, start, pixels=pixels)


class _Images:
    """One pipeline call's images: uint8 HxWx3 on the host, or on their way there (a pinned buffer and the CUDA
    event after its copy); :meth:`outputs` gives each request its images once they are there."""

    def __init__(
        self,
        members: List[Dict[str, Any]],
        seeds: List[int],
        start: float,
        pixels: Any = None,
        host: Any = None,
        done: Any = None,
    ):
        self.members, self.seeds, self.start = members, seeds, start
        self.pixels, self.host, self.done = pixels, host, done
        self.seconds = None if pixels is None else time.perf_counter() - start

    def outputs(self) -> List[Dict[str, Any]]:
        if self.pixels is None:
            self.done.synchronize()
            self.seconds = time.perf_counter() - self.start  # the call and its images' way to the host
            self.pixels = self.host.numpy().copy()  # out of pinned memory, which is scarce
            self.host = self.done = None
        outputs, row = [], 0
        for member in self.members:
            outputs.append(
                {
                    "images": [self.pixels[row + k] for k in range(member["n"])],
                    "seeds": self.seeds[row : row + member["n"]],
                    "batch_images": len(self.seeds),
                    "batch_requests": len(self.members),
                    "pipeline_s": self.seconds,
                }
            )
            row += member["n"]
        return outputs
