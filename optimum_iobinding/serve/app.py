"""The Ray Serve application: the deployment :class:`ImageService` (the HTTP API on each replica), how it is built
(:func:`build_app`, :func:`app_builder`) and run (:func:`run`). One pipeline per replica, one replica per GPU.

The application is one deployment, ``ImageService``: each replica holds one pipeline and its batching
(:class:`~optimum_iobinding.serve.batching.ImageGenerator`; ``num_gpus=1`` per replica on a GPU cluster, CPU
replicas without one) and the HTTP API (FastAPI through ``@serve.ingress``: ``POST /v1/images``, ``GET /health``,
``GET /v1/models``). Serve's proxy routes each HTTP request to a replica. (A separate ingress deployment adds a
process hop that carries every image; benchmarks/results/h200x2/2026-11-23-36d6c4e measured what it cost.)

Requests are checked before batching: 422 for a malformed body, 400 with the pipeline's own message for values the
pipeline refuses, so a bad request never fails the others. The proxy answers 503 when the replicas' queues are full
(Serve's ``max_ongoing_requests`` / ``max_queued_requests``). Ray replaces a replica that dies.

Build it with :func:`build_app` (or ``serve run optimum_iobinding.serve:app_builder model=FOLDER ...`` from a config
file); the command line's ``optimum-iobinding serve MODEL`` runs it on a local Ray cluster or joins ``RAY_ADDRESS``.
Needs the ``serve`` extra (``pip install 'optimum-iobinding[serve]'``).
"""

# no `from __future__ import annotations`: FastAPI reads the route methods' annotations as objects
import asyncio
import base64
import os
import signal
import threading
import time
from dataclasses import asdict
from typing import Any, Dict, Optional, Union

try:
    from fastapi import FastAPI, HTTPException
    from fastapi.responses import JSONResponse, Response
    from ray import serve
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError("optimum_iobinding.serve needs Ray Serve: pip install 'optimum-iobinding[serve]'") from error

from .batching import ImageGenerator
from .config import ServeConfig
from .schema import ImageRequest, encode_pngs

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
