"""Serving with Ray Serve: one pipeline per replica, one replica per GPU, requests batched into the captured UNet.

The application is one deployment, ``ImageService``: each replica holds one pipeline (``num_gpus=1`` per replica on
a GPU cluster, CPU replicas without one) and the HTTP API (FastAPI through ``@serve.ingress``: ``POST /v1/images``,
``GET /health``, ``GET /v1/models``). Serve's proxy routes each HTTP request to a replica. (A separate ingress
deployment adds a process hop that carries every image; benchmarks/results/h200x2/session8 measured what it cost.)

* At start a replica captures the signatures it will serve (:meth:`~optimum_iobinding.pipelines.base.
  OnnxStableDiffusionPipelineBase.warmup`: every batch size up to ``max_batch_size`` at the default size), so the
  first request runs as fast as later ones.
* Requests are batched by ``@serve.batch`` (``max_batch_size`` counts images, ``batch_wait_timeout_s``). Requests
  that come while a batch runs wait and enter the next batch together. On CUDA a batch is put on the GPU and the
  next one is let in at once, queued behind it on the pipeline's stream, while the first one's images come back and
  are answered: the GPU does not wait for the host between batches (at most two batches are unfinished). A batch
  runs one pipeline call per group of requests that agree on what a call cannot mix — size, steps, guidance — so
  requests of different sizes, step counts or guidance ride in the same ``@serve.batch`` window but in different
  pipeline calls.
* Within a call every request keeps its own prompt, negative prompt and seed: image ``k`` of a request with seed
  ``s`` is drawn from its own ``torch.Generator`` seeded ``s + k`` (the latents and every scheduler noise), so it
  equals the image of a single call ``pipe(prompt, generator=torch.Generator().manual_seed(s + k))`` up to the
  batch's floating-point rounding.
* Requests with an ``image`` run image-to-image (SD and SDXL folders with a VAE encoder) on a pipeline that shares
  the same models, batched with the image-to-image requests of the same strength.
* Requests are checked before batching: 422 for a malformed body, 400 with the pipeline's own message for values the
  pipeline refuses, so a bad request never fails the others. The proxy answers 503 when the replicas' queues are full
  (Serve's ``max_ongoing_requests`` / ``max_queued_requests``). Ray replaces a replica that dies.

Build it with :func:`build_app` (or ``serve run optimum_iobinding.serve:app_builder model=FOLDER ...`` from a config
file); the command line's ``optimum-iobinding serve MODEL`` runs it on a local Ray cluster or joins ``RAY_ADDRESS``.
Needs the ``serve`` extra (``pip install 'optimum-iobinding[serve]'``).
"""

# no `from __future__ import annotations`: FastAPI reads the route methods' annotations as objects
import asyncio
import base64
import collections
import concurrent.futures
import inspect
import io
import logging
import os
import secrets
import signal
import struct
import threading
import time
import zlib
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Deque, Dict, List, Literal, Optional, Sequence, Tuple, Union

try:
    from fastapi import FastAPI, HTTPException
    from fastapi.responses import JSONResponse, Response
    from pydantic import BaseModel, ConfigDict, Field
    from ray import serve
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError("optimum_iobinding.serve needs Ray Serve: pip install 'optimum-iobinding[serve]'") from error

logger = logging.getLogger(__name__)

MAX_SEED = 2**63 - 1
# ServeConfig's settings that are positive integers (checked, and parsed from serve run's strings)
_INT_SETTINGS = ("replicas", "max_batch_size", "steps", "max_images_per_request", "max_ongoing_requests",
                 "max_queued_requests")


# ---------------------------------------------------------------------------------------------------- settings
@dataclass
class ServeConfig:
    """What the application serves and how.

    Args:
        model: a pipeline folder (diffusers ONNX layout; SD, SDXL or LCM, picked from the folder) or a hub id.
        replicas: ``ImageService`` replicas; each takes one GPU on a GPU cluster.
        max_batch_size: images per pipeline call (``@serve.batch`` counts a request's ``n`` images).
        batch_wait_timeout_s: how long a replica waits for a batch to fill once its first request came. 0 (the
            default) adds no latency to a lone request, and batches still form under load: requests that come while
            a batch runs wait in the replica and ride in the next batch together.
        device: ``"auto"`` (a GPU per replica if the cluster has GPUs), ``"cuda"`` or ``"cpu"``.
        provider: the ONNX Runtime provider; default CUDA on a GPU replica, CPU otherwise.
        steps, guidance: the defaults of requests that give none.
        warmup_batch_sizes: batch sizes captured at replica start; default 1 … ``max_batch_size``. ``[]``: none.
        warmup_sizes: image sizes (pixels, squares) captured at start; default the pipeline's default size.
        max_images_per_request: the most images one request may ask for (at most ``max_batch_size``).
        max_ongoing_requests: requests a replica holds at once (waiting for or riding in a batch; the rest queue in
            Serve's proxy).
        max_queued_requests: requests waiting in the proxy for a replica before new ones get 503.
        png_compression: 0 (default) answers uncompressed PNGs, a copy of the pixels; 1–9 are zlib's levels with
            PNG's row filters (Pillow), about half the bytes of a smooth image for tens of times the encoding time,
            which at concurrency 1 is a visible part of a request's latency.
        pipeline_options: extra keyword arguments for the pipeline's ``from_pretrained``.
        engine: ``"optimum-iobinding"``, or ``"diffusers-numpy"``: diffusers' ``OnnxStableDiffusionPipeline`` (the
            numpy loop), the anchor the serving benchmark compares against. Its batches draw every image's noise
            from one ``RandomState`` seeded with the first request's seed, so a batched image is not the single
            call's; without batching (``max_batch_size=1``) it is.
    """

    model: str
    replicas: int = 1
    max_batch_size: int = 4
    batch_wait_timeout_s: float = 0.0
    device: Literal["auto", "cuda", "cpu"] = "auto"
    provider: Optional[str] = None
    steps: int = 30
    guidance: float = 7.5
    warmup_batch_sizes: Optional[List[int]] = None
    warmup_sizes: Optional[List[int]] = None
    max_images_per_request: int = 4
    max_ongoing_requests: int = 64
    max_queued_requests: int = 256
    png_compression: int = 0
    pipeline_options: Dict[str, Any] = field(default_factory=dict)
    engine: Literal["optimum-iobinding", "diffusers-numpy"] = "optimum-iobinding"

    def __post_init__(self) -> None:
        def positive_int(name: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")

        if not isinstance(self.model, (str, os.PathLike)) or not str(self.model):
            raise ValueError(f"model: expected a pipeline folder or a hub id, got {self.model!r}")
        self.model = os.fspath(self.model)
        for name in _INT_SETTINGS:
            positive_int(name)
        if not isinstance(self.batch_wait_timeout_s, (int, float)) or not 0 <= self.batch_wait_timeout_s <= 60:
            raise ValueError(f"batch_wait_timeout_s: expected seconds in [0, 60], got {self.batch_wait_timeout_s!r}")
        if isinstance(self.png_compression, bool) or self.png_compression not in range(10):
            raise ValueError(f"png_compression: expected a zlib level 0–9, got {self.png_compression!r}")
        if self.engine not in ("optimum-iobinding", "diffusers-numpy"):
            raise ValueError(f"engine: expected 'optimum-iobinding' or 'diffusers-numpy', got {self.engine!r}")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device: expected 'auto', 'cuda' or 'cpu', got {self.device!r}")
        if self.max_images_per_request > self.max_batch_size:
            self.max_images_per_request = self.max_batch_size
        for name in ("warmup_batch_sizes", "warmup_sizes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (list, tuple)) or any(
                    isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in value)):
                raise ValueError(f"{name}: expected a list of positive integers, got {value!r}")

    @classmethod
    def from_args(cls, args: Dict[str, Any]) -> "ServeConfig":
        """From ``serve run``'s ``key=value`` arguments (strings) or a config file's ``args`` (typed)."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(args) - set(known))
        if unknown:
            raise ValueError(f"args: unknown {unknown}; expected some of {sorted(known)}")
        typed: Dict[str, Any] = {}
        for name, value in args.items():
            if isinstance(value, str) and name in (*_INT_SETTINGS, "png_compression"):
                value = _parse(name, value, int)
            elif isinstance(value, str) and name in ("batch_wait_timeout_s", "guidance"):
                value = _parse(name, value, float)
            elif isinstance(value, str) and name in ("warmup_batch_sizes", "warmup_sizes"):
                value = [_parse(name, part, int) for part in value.split(",") if part.strip()]
            typed[name] = value
        return cls(**typed)


def _parse(name: str, text: str, kind: type) -> Any:
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"{name}: expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None


# ------------------------------------------------------------------------------------------------------ requests
class ImageRequest(BaseModel):
    """The body of ``POST /v1/images``."""

    model_config = ConfigDict(extra="forbid")

    prompt: str
    negative_prompt: Optional[str] = None
    seed: Optional[int] = Field(default=None, ge=0, le=MAX_SEED)
    steps: Optional[int] = None
    guidance: Optional[float] = None
    size: Union[int, str, None] = Field(default=None, description="pixels: 512 (square) or '768x512' (width x height)")
    n: int = Field(default=1, ge=1)
    response_format: Literal["png", "b64_json"] = "png"
    image: Optional[str] = Field(default=None, description="image-to-image: the start image, base64 PNG or JPEG")
    strength: Optional[float] = Field(default=None, description="image-to-image: how much of the schedule runs")


def parse_size(size: Union[int, str, None], default: int) -> Tuple[int, int]:
    """``(width, height)`` of a request's ``size``: an int (a square), ``"WxH"``, or ``None`` (the default)."""
    if size is None:
        return default, default
    if isinstance(size, int) and not isinstance(size, bool):
        return size, size
    if isinstance(size, str):
        parts = size.lower().split("x")
        if len(parts) == 2 and all(part.strip().isdigit() for part in parts):
            return int(parts[0]), int(parts[1])
    raise ValueError(f"size: expected pixels as 512 or '768x512' (width x height), got {size!r}")


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def stored_png(pixels: Any) -> bytes:
    """An uncompressed PNG of a uint8 HxWx3 array: rows unfiltered, zlib's stored blocks (PNG spec, level 0)."""
    import numpy as np

    height, width, channels = pixels.shape
    if pixels.dtype != np.uint8 or channels != 3:
        raise ValueError(f"pixels: expected uint8 HxWx3, got {pixels.dtype} {pixels.shape}")
    rows = np.zeros((height, 1 + width * 3), np.uint8)  # each row: filter type 0 (none), then its bytes
    rows[:, 1:] = pixels.reshape(height, width * 3)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bits, truecolour, no interlace
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", zlib.compress(rows.tobytes(), 0))
            + _png_chunk(b"IEND", b""))


def encode_pngs(images: Sequence[Any], compression: int = 0) -> List[bytes]:
    """PNG bytes of uint8 HxWx3 arrays. ``compression`` 0: stored (:func:`stored_png`, a copy of the pixels);
    1–9: zlib's levels through Pillow, whose adaptive row filters make about half the bytes of a smooth image."""
    if compression == 0:
        return [stored_png(pixels) for pixels in images]
    from PIL import Image

    encoded = []
    for pixels in images:
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG", compress_level=compression)
        encoded.append(buffer.getvalue())
    return encoded


def _group_key(request: Dict[str, Any]) -> Tuple:
    """What one pipeline call cannot mix (image-to-image requests run apart from text-to-image ones)."""
    return (request["width"], request["height"], request["steps"], request["guidance"],
            request.get("start_image") is not None, request.get("strength"))


def decode_image(data: str) -> Any:
    """A base64 PNG or JPEG → float32 HxWx3 in [0, 1] (what the image-to-image pipelines take)."""
    import binascii

    import numpy as np
    from PIL import Image, UnidentifiedImageError

    try:
        raw = base64.b64decode(data, validate=True)
        with Image.open(io.BytesIO(raw)) as image:
            pixels = np.asarray(image.convert("RGB"))
    except (binascii.Error, ValueError, UnidentifiedImageError, OSError) as error:
        raise ValueError(f"image: expected a base64 PNG or JPEG, could not read it: {error}") from None
    return pixels.astype(np.float32) / 255.0


# How long (a share of the batch's time) a batch waits for the clients of the previous one to come back. 5 % (64 ms
# after a 1.28 s batch of 8) was too short on two H200s with 8 clients per replica: their 8 answers of 786 KB pass
# the proxy one after another (36 ms per request from replica to client on average), the late ones missed the batch
# and the groups split into 4, 5 and 7 images (benchmarks/results/h200x2/session8/run3-994f4f2).
REGROUP_WAIT = 0.10


def _images_in(requests: Sequence[Dict[str, Any]]) -> int:
    return sum(request["n"] for request in requests)


# ------------------------------------------------------------------------------------------------ the generator
class ImageGenerator:
    """One pipeline and its batched calls, without HTTP: what a replica of :class:`ImageService` runs (see the
    module's docstring); usable in a process of its own (``complete_request`` then ``run_batch``)."""

    def __init__(self, config: Dict[str, Any]):
        import torch

        from ..pipelines import pipeline_class_for

        self.config = ServeConfig(**config)
        use_cuda = self.config.device == "cuda" or (self.config.device == "auto" and torch.cuda.is_available())
        provider = self.config.provider or ("CUDAExecutionProvider" if use_cuda else "CPUExecutionProvider")
        # a hub id: the files every pipeline kind reads (SD, SDXL, LCM), downloaded once per replica's machine
        from ..layout import resolve_pipeline_folder
        from ..pipelines.stable_diffusion_xl import XL_COMPONENTS

        folder = str(resolve_pipeline_folder(self.config.model, XL_COMPONENTS, ("tokenizer", "tokenizer_2")))
        self.numpy_engine = self.config.engine == "diffusers-numpy"
        if self.numpy_engine:
            from ..pipelines import load_numpy_pipeline

            self.pipe = load_numpy_pipeline(folder, provider, **self.config.pipeline_options)
            self.pipeline_name = "diffusers.OnnxStableDiffusionPipeline"
            self.default_size = 512  # its call's default
        else:
            pipeline_class = pipeline_class_for(folder)
            self.pipe = pipeline_class.from_pretrained(folder, provider=provider, **self.config.pipeline_options)
            self.pipeline_name = pipeline_class.__name__
            self.default_size = self.pipe.default_image_size
            self.img2img = self._image_to_image(pipeline_class)
        self.pipe.set_progress_bar_config(disable=True)
        self.accepts = set(inspect.signature(self.pipe.__call__).parameters)
        self._batched.set_max_batch_size(self.config.max_batch_size)
        self._batched.set_batch_wait_timeout_s(self.config.batch_wait_timeout_s)
        batches = self.config.warmup_batch_sizes
        if batches is None:
            batches = list(range(1, self.config.max_batch_size + 1))
        self.warmup_s = 0.0
        if batches:
            start = time.perf_counter()
            if self.numpy_engine:  # no graphs to capture: one short call per batch size (cuDNN's algorithm search)
                for size in self.config.warmup_sizes or [self.default_size]:
                    for batch in batches:
                        self.pipe([""] * batch, height=size, width=size, num_inference_steps=2,
                                  guidance_scale=self.config.guidance, output_type="np")
            else:
                self.pipe.warmup(heights=self.config.warmup_sizes or self.default_size, batch_sizes=batches,
                                 guidance_scales=self.config.guidance)
            self.warmup_s = time.perf_counter() - start
        self.batches_run = 0
        # admission into Serve's batch queue (see generate): the waiting requests (a future and its images each),
        # the images let in whose batch has not started yet, whether a batch runs
        self._waiting: Deque[Tuple[asyncio.Future, int]] = collections.deque()
        self._admitted = 0
        self._batch_running = False  # a batch's pipeline call runs (on CUDA: until its work is on the GPU)
        self._unfinished = 0  # batches whose images are not on the host yet
        # on CUDA the call returns once its work is queued on the GPU: a second batch may queue behind it
        self._deferred = not self.numpy_engine and self.pipe.device.type == "cuda"
        self._max_unfinished = 2 if self._deferred else 1
        self._batch_cap = self.config.max_batch_size  # images of the next batch (see _expect_return)
        # every pipeline call on one thread: the models' reused output buffers are per thread, and a pool would
        # make new ones for each new thread; the images come back on other threads
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pipeline")
        self._finisher = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="images")

    def _image_to_image(self, pipeline_class: type) -> Any:
        """The image-to-image pipeline on the same models (no second copy of anything), where the folder has a VAE
        encoder and the pipeline has an image-to-image sibling; else ``None``."""
        from ..pipelines import (OnnxStableDiffusionImg2ImgPipeline, OnnxStableDiffusionPipeline,
                                OnnxStableDiffusionXLImg2ImgPipeline, OnnxStableDiffusionXLPipeline)

        sibling = {OnnxStableDiffusionPipeline: OnnxStableDiffusionImg2ImgPipeline,
                   OnnxStableDiffusionXLPipeline: OnnxStableDiffusionXLImg2ImgPipeline}.get(pipeline_class)
        if sibling is None or getattr(self.pipe, "vae_encoder", None) is None:
            return None
        accepted = inspect.signature(sibling.__init__).parameters
        pipe = sibling(**{name: module for name, module in self.pipe.components.items() if name in accepted})
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def info(self) -> Dict[str, Any]:
        return {"pipeline": self.pipeline_name, "default_size": self.default_size, "warmup_s": self.warmup_s,
                "image_to_image": getattr(self, "img2img", None) is not None,
                "max_batch_size": self.config.max_batch_size, "device": str(self.pipe.device),
                "batches_run": self.batches_run}

    def check_health(self) -> None:
        """Serve calls this periodically; a replica whose pipeline is gone is replaced."""
        if getattr(self, "pipe", None) is None:
            raise RuntimeError("the pipeline is not loaded")

    def complete_request(self, request: Dict[str, Any]) -> Dict[str, Any]:
        """The request with its defaults filled in and checked by the pipeline's own checks (ValueError/TypeError
        with the pipeline's message)."""
        request = dict(request)
        request.setdefault("n", 1)
        if request.get("seed") is None:
            request["seed"] = secrets.randbelow(2**31)
        if request.get("steps") is None:
            request["steps"] = self.config.steps
        if request.get("guidance") is None:
            request["guidance"] = self.config.guidance
        request["start_image"] = None
        if request.get("image") is not None:
            if getattr(self, "img2img", None) is None:
                raise ValueError(f"image: {self.pipeline_name} on this folder has no image-to-image pipeline (it "
                                 "needs a vae_encoder, and SD or SDXL)")
            request["start_image"] = decode_image(request["image"])
            height, width = request["start_image"].shape[:2]
            if request.get("size") is not None and parse_size(request["size"], self.default_size) != (width, height):
                raise ValueError(f"size: the image is {width}x{height}; leave size out or give that, got "
                                 f"{request['size']!r}")
            request["size"] = f"{width}x{height}"
            if request.get("strength") is None:
                request["strength"] = 0.8
        elif request.get("strength") is not None:
            raise ValueError("strength: only an image-to-image request (with image) takes one")
        request.pop("image", None)
        request["width"], request["height"] = parse_size(request.get("size"), self.default_size)
        if request["n"] > self.config.max_images_per_request:
            raise ValueError(f"n: expected at most {self.config.max_images_per_request} images per request, got "
                             f"{request['n']}")
        if request.get("negative_prompt") is not None and "negative_prompt" not in self.accepts:
            raise ValueError(f"negative_prompt: {self.pipeline_name} takes none")
        if request["seed"] + request["n"] - 1 > MAX_SEED:
            raise ValueError(f"seed: expected at most {MAX_SEED - request['n'] + 1} for n={request['n']}, got "
                             f"{request['seed']}")
        if self.numpy_engine:  # its own checks run when it is called (a failing batch is retried one by one)
            return request
        checks = dict(prompt=request["prompt"], height=request["height"], width=request["width"],
                      num_inference_steps=request["steps"], callback_steps=None, guidance_scale=request["guidance"],
                      num_images_per_prompt=request["n"], strength=request.get("strength"))
        if "negative_prompt" in self.accepts:
            checks["negative_prompt"] = request.get("negative_prompt")
        self.pipe.check_inputs(**checks)
        return request

    async def generate(self, request: Dict[str, Any]) -> Dict[str, Any]:
        """One request → ``{"images": [uint8 HxWx3], "seeds", "batch_images", "batch_requests"}`` or
        ``{"error": message}`` for a request the pipeline refuses."""
        arrived = time.perf_counter()
        try:
            request = self.complete_request(request)
        except (ValueError, TypeError) as error:
            return {"error": str(error)}
        images = request["n"]
        await self._enter(images)
        try:
            result = await self._batched(request)
        finally:
            if not request.get("_started"):  # let in, but gone before its batch started (cancelled)
                request["_abandoned"] = True
                self._admitted -= images
                self._release()
        if "error" not in result:
            result = dict(result, replica_s=time.perf_counter() - arrived)
        return result

    # Admission. Serve's @serve.batch (2.60) forms a batch as soon as its first request comes, also while the
    # previous batch still runs; that batch then waits for a free batch slot with the requests it had.
    # With batch_wait_timeout_s=0 each request that comes during a running batch would make a batch of its own,
    # and closed-loop clients stay split in those small groups. So requests wait here while a batch runs, and when
    # it ends, the oldest are let into Serve's queue together, as many images as one batch holds: the next batch is
    # formed when the GPU is free to run it (what Serve documents as opportunistic batching). On CUDA "ends" is when
    # its work is queued on the GPU (the next batch queues behind it), with at most two batches unfinished.
    async def _enter(self, images: int) -> None:
        if not self._waiting and self._fits(images):
            self._admitted += images
            return
        entry = (asyncio.get_running_loop().create_future(), images)
        self._waiting.append(entry)
        try:
            await entry[0]
        except asyncio.CancelledError:
            if entry[0].done() and not entry[0].cancelled():  # let in just before its client went away
                self._admitted -= images
                self._release()
            elif entry in self._waiting:
                self._waiting.remove(entry)
            raise

    def _fits(self, images: int) -> bool:
        return (not self._batch_running and self._unfinished < self._max_unfinished
                and self._admitted + images <= self._batch_cap)

    def _release(self) -> None:
        while self._waiting and self._fits(self._waiting[0][1]):
            future, images = self._waiting.popleft()
            if not future.done():
                self._admitted += images
                future.set_result(None)

    def _expect_return(self, images: int, seconds: float) -> None:
        """After a batch of ``images`` that took ``seconds``, when fewer images wait: the next batch waits up to
        :data:`REGROUP_WAIT` of that time for as many images (up to ``max_batch_size``), since clients that got
        their answers tend to send their next requests at once; it starts as soon as they are there. Without this, a
        group of clients split once (the first of them to come back runs alone) stays split. A lone client's batch
        waits for nothing."""
        expected = min(images, self.config.max_batch_size)
        if expected <= 1 or sum(waiting for _, waiting in self._waiting) >= expected:
            return
        self._batch_cap = expected
        self._batched.set_max_batch_size(expected)
        self._batched.set_batch_wait_timeout_s(max(self.config.batch_wait_timeout_s, REGROUP_WAIT * seconds))

    @serve.batch(max_batch_size=4, batch_wait_timeout_s=0.0, batch_size_fn=_images_in, max_concurrent_batches=2)
    async def _batched(self, requests: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        for request in requests:
            if not request.get("_abandoned"):
                self._admitted -= request["n"]
            request["_started"] = True
        self._batch_running = True
        self._unfinished += 1
        self._batch_cap = self.config.max_batch_size
        self._batched.set_max_batch_size(self.config.max_batch_size)
        self._batched.set_batch_wait_timeout_s(self.config.batch_wait_timeout_s)
        start = time.perf_counter()
        loop = asyncio.get_running_loop()
        try:
            try:
                # the pipeline call blocks: run it off the event loop, which keeps taking requests
                started = await loop.run_in_executor(self._worker, self.start_batch, requests)
            finally:
                self._batch_running = False
                self._release()  # on CUDA the next batch queues behind this one on the GPU
            return await loop.run_in_executor(self._finisher, self.finish_batch, started)
        finally:
            self._unfinished -= 1
            self._expect_return(_images_in(requests), time.perf_counter() - start)
            self._release()

    def run_batch(self, requests: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        """Completed requests → one result each: a pipeline call per group that agrees on size, steps and guidance
        (a group whose call the pipeline refuses runs one request at a time, so only the bad one fails)."""
        return self.finish_batch(self.start_batch(requests))

    def start_batch(self, requests: List[Dict[str, Any]]) -> Tuple[List[Optional[Dict[str, Any]]], List[Tuple]]:
        """:meth:`run_batch` up to the point where every call's work is on the device (on CUDA the images are
        still being made when it returns); :meth:`finish_batch` waits for them. On the pipeline's thread."""
        results: List[Optional[Dict[str, Any]]] = [None] * len(requests)
        calls: List[Tuple[List[int], _Images]] = []
        groups: Dict[Tuple, List[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(_group_key(request), []).append(index)
        for indices in groups.values():
            members = [requests[i] for i in indices]
            try:
                calls.append((indices, self._call(members)))
            except (ValueError, TypeError):
                # one request the checks let through: run each alone, so only it fails
                for index, member in zip(indices, members):
                    try:
                        calls.append(([index], self._call([member])))
                    except (ValueError, TypeError) as error:
                        results[index] = {"error": str(error)}
        self.batches_run += 1
        return results, calls

    @staticmethod
    def finish_batch(started: Tuple[List[Optional[Dict[str, Any]]], List[Tuple]]) -> List[Dict[str, Any]]:
        """The results of a :meth:`start_batch`, once its images are on the host (any thread)."""
        results, calls = started
        for indices, images in calls:
            for index, output in zip(indices, images.outputs()):
                results[index] = output
        return results  # type: ignore[return-value]

    def _call(self, members: List[Dict[str, Any]]) -> "_Images":
        import numpy as np
        import torch

        prompts, negatives, seeds, starts = [], [], [], []
        for member in members:
            for k in range(member["n"]):
                prompts.append(member["prompt"])
                negatives.append(member.get("negative_prompt") or "")
                seeds.append(member["seed"] + k)
                starts.append(member.get("start_image"))
        first = members[0]
        if self.numpy_engine:
            generator: Any = np.random.RandomState(seeds[0] % 2**32)
        else:
            generator = [torch.Generator().manual_seed(seed) for seed in seeds]
        arguments = dict(prompt=prompts, num_inference_steps=first["steps"], guidance_scale=first["guidance"],
                         generator=generator, output_type="np")
        if "negative_prompt" in self.accepts and any(negatives):
            arguments["negative_prompt"] = negatives
        pipe = self.pipe
        if first.get("start_image") is not None:  # one start image per image row, each with its own generator
            pipe = self.img2img
            arguments.update(image=np.stack(starts), strength=first["strength"])
        else:
            arguments.update(height=first["height"], width=first["width"])
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

    def __init__(self, members: List[Dict[str, Any]], seeds: List[int], start: float, pixels: Any = None,
                 host: Any = None, done: Any = None):
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
            outputs.append({"images": [self.pixels[row + k] for k in range(member["n"])],
                            "seeds": self.seeds[row: row + member["n"]], "batch_images": len(self.seeds),
                            "batch_requests": len(self.members), "pipeline_s": self.seconds})
            row += member["n"]
        return outputs


# ----------------------------------------------------------------------------------------------- the deployment
api = FastAPI(title="optimum-iobinding", description="Stable Diffusion on ONNX Runtime, served by Ray Serve")


@serve.deployment(name="ImageService")
@serve.ingress(api)
class ImageService(ImageGenerator):
    """The HTTP API on each generator replica: Serve's proxy routes requests straight to a replica (no second hop
    through an ingress deployment, which carried every image between processes)."""

    def __init__(self, config: Dict[str, Any]):
        super().__init__(config)
        self.model_id = os.path.basename(os.path.normpath(self.config.model)) or self.config.model

    @api.get("/health")
    async def health(self) -> Dict[str, str]:
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(self) -> Dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_id, "object": "model", **self.info(),
                                            "replicas": self.config.replicas}]}

    @api.post("/v1/images", responses={200: {"content": {"image/png": {}, "application/json": {}}}})
    async def images(self, body: ImageRequest) -> Response:
        start = time.perf_counter()
        request = body.model_dump()
        if request["response_format"] == "png" and request["n"] != 1:
            raise HTTPException(400, f"n: a png response holds one image; ask for response_format='b64_json' for "
                                     f"n={request['n']}")
        result = await self.generate(request)
        if "error" in result:
            raise HTTPException(400, result["error"])
        encoded = await asyncio.to_thread(encode_pngs, result["images"], self.config.png_compression)
        # where a request's time went: the pipeline call ⊂ the replica's queue and batch ⊂ the server (+ PNGs)
        headers = {"X-Batch-Images": str(result["batch_images"]), "X-Batch-Requests": str(result["batch_requests"]),
                   "X-Seed": str(result["seeds"][0]), "X-Pipeline-Seconds": f"{result['pipeline_s']:.4f}",
                   "X-Replica-Seconds": f"{result['replica_s']:.4f}",
                   "X-Server-Seconds": f"{time.perf_counter() - start:.4f}"}
        if request["response_format"] == "png":
            return Response(content=encoded[0], media_type="image/png", headers=headers)
        data = [{"b64_json": base64.b64encode(png).decode("ascii"), "seed": seed}
                for png, seed in zip(encoded, result["seeds"])]
        return JSONResponse({"created": int(time.time()), "model": self.model_id, "data": data,
                             "batch_images": result["batch_images"], "batch_requests": result["batch_requests"]},
                            headers=headers)


# ------------------------------------------------------------------------------------------------- building it
def cluster_has_gpus() -> bool:
    import ray

    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) >= 1
    import torch

    return torch.cuda.is_available()


def build_app(config: Union[ServeConfig, str, os.PathLike], **settings: Any) -> "serve.Application":
    """The Serve application for ``config`` (a :class:`ServeConfig`, or a model folder plus its settings):
    ``serve.run(build_app("folder", replicas=2))``."""
    if not isinstance(config, ServeConfig):
        config = ServeConfig(model=os.fspath(config), **settings)
    elif settings:
        raise TypeError("build_app: give either a ServeConfig or a model and settings, not both")
    gpus = config.device == "cuda" or (config.device == "auto" and cluster_has_gpus())
    actor_options = {"num_gpus": 1, "num_cpus": 1} if gpus else {"num_cpus": 1}
    return ImageService.options(
        num_replicas=config.replicas, ray_actor_options=actor_options,
        max_ongoing_requests=config.max_ongoing_requests, max_queued_requests=config.max_queued_requests,
    ).bind(asdict(config))


def app_builder(args: Dict[str, Any]) -> "serve.Application":
    """For ``serve run optimum_iobinding.serve:app_builder model=FOLDER replicas=2 ...`` and config files
    (``import_path: optimum_iobinding.serve:app_builder`` with ``args``)."""
    return build_app(ServeConfig.from_args(dict(args)))


def run(config: ServeConfig, host: str = "127.0.0.1", port: int = 8000, blocking: bool = True,
        address: Optional[str] = None) -> Any:
    """Starts (or joins, with ``address`` or ``RAY_ADDRESS``) a Ray cluster and runs the application on
    ``host:port``. Blocking: until interrupted, then Serve is shut down. Returns the ingress handle otherwise."""
    import ray

    address = address or os.environ.get("RAY_ADDRESS")
    if not ray.is_initialized():
        ray.init(address=address or None, log_to_driver=False)
    serve.start(http_options={"host": host, "port": port})
    app = build_app(config)
    handle = serve.run(app, name="optimum-iobinding", route_prefix="/", blocking=False)
    if not blocking:
        return handle
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        # a second Ctrl-C during the shutdown must not leave Ray half shut down
        main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main_thread else None
        try:
            serve.shutdown()
            ray.shutdown()
        finally:
            if main_thread:
                signal.signal(signal.SIGINT, previous)
    return None
