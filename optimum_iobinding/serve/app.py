"""The Ray Serve application: the deployment :class:`ImageService` (the HTTP API on each replica), how it is built
(:func:`build_app`, :func:`app_builder`) and run (:func:`run`). One pipeline per replica, one replica per GPU.

The application is one deployment, ``ImageService``: each replica holds one pipeline and its batching
(:class:`~optimum_iobinding.serve.batching.ImageGenerator`, or a subclass given to :func:`build_app`; ``num_gpus=1``
per replica on a GPU cluster, CPU replicas without one) and the HTTP API (FastAPI through ``@serve.ingress``:
``POST /v1/images``, OpenAI's images API ``POST /v1/images/generations`` and ``POST /v1/images/edits``,
``GET /health``, ``GET /v1/models``: the routes of :data:`api`, each answered by its replica's generator). Serve's
proxy routes each HTTP request to a replica. (A separate ingress deployment would add a process hop that carries
every image, for nothing the one deployment cannot do.)

Requests are checked before batching, before any of their work is queued: 413 for a body over ``max_body_bytes``,
422 for a malformed body (400 on OpenAI's routes, in its error shape), 400 naming the limit or the pipeline's own message for values beyond the replica's limits
(:class:`~optimum_iobinding.serve.config.RequestLimits`) or that the pipeline refuses, so a bad request never fails
the others. A pipeline call that fails otherwise (an allocation failure) answers its requests 503 with a one-line
reason and the replica goes on; a request not answered within ``request_timeout_s`` gets 504. The proxy answers 503
when the replicas' queues are full (Serve's ``max_ongoing_requests`` / ``max_queued_requests``). Ray replaces a
replica that dies. No request is answered 500.

Build it with :func:`build_app` (or ``serve run optimum_iobinding.serve:app_builder model=FOLDER ...`` from a config
file); the command line's ``optimum-iobinding serve MODEL`` runs it (:func:`run`) on a local Ray cluster of this
machine alone, every port of which listens on loopback, or joins ``RAY_ADDRESS``. Needs the ``serve`` extra
(``pip install 'optimum-iobinding[serve]'``).
"""

# no `from __future__ import annotations`: FastAPI reads the routes' annotations as objects
import asyncio
import base64
import contextlib
import inspect
import logging
import os
import re
import signal
import threading
import time
from dataclasses import asdict
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Type, Union

try:
    from fastapi import FastAPI, HTTPException, Request
    from fastapi.exception_handlers import http_exception_handler
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from pydantic import ValidationError
    from ray import serve
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from starlette.requests import ClientDisconnect
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError("optimum_iobinding.serve needs Ray Serve: pip install 'optimum-iobinding[serve]'") from error

from .batching import ImageGenerator
from .config import ServeConfig, ServeStartError, check_port_free, is_loopback, local_url, wait_until_answering
from .schema import (
    ImageRequest,
    OpenAIError,
    OpenAIImageEditRequest,
    OpenAIImageRequest,
    encode_pngs,
    openai_edit_request,
    openai_generation_request,
)

logger = logging.getLogger(__name__)

api = FastAPI(title="optimum-iobinding", description="Stable Diffusion on ONNX Runtime, served by Ray Serve")

# OpenAI's images API: every answer of these routes is in OpenAI's error shape, the router's own refusals included
OPENAI_ROUTES = ("/v1/images/generations", "/v1/images/edits")


@api.exception_handler(StarletteHTTPException)
async def routing_refusal(request: Request, error: StarletteHTTPException) -> Response:
    """The router's refusals (405 for another method than POST) in OpenAI's error shape on OpenAI's routes, with
    their headers (``Allow``); FastAPI's own answer elsewhere."""
    if request.url.path not in OPENAI_ROUTES:
        return await http_exception_handler(request, error)
    if error.status_code == 405:
        refused = OpenAIError(405, f"method: expected POST, got {request.method}", None, "method_not_allowed")
    else:
        refused = OpenAIError(error.status_code, f"request: {error.detail}")
    return JSONResponse(refused.body(), status_code=error.status_code, headers=getattr(error, "headers", None))


def replica_generator() -> ImageGenerator:
    """The generator of the replica answering the request (the deployment's instance)."""
    return serve.get_replica_context().servable_object


@api.get("/health")
async def health() -> Dict[str, str]:
    return {"status": "ok"}


@api.get("/v1/models")
async def models() -> Dict[str, Any]:
    generator = replica_generator()
    return {
        "object": "list",
        "data": [
            {"id": generator.model_id, "object": "model", **generator.info(), "replicas": generator.config.replicas}
        ],
    }


_IMAGE_REQUEST_BODY = {
    "requestBody": {"required": True, "content": {"application/json": {"schema": ImageRequest.model_json_schema()}}}
}


@api.post(
    "/v1/images",
    openapi_extra=_IMAGE_REQUEST_BODY,
    responses={200: {"content": {"image/png": {}, "application/json": {}}}},
)
async def images(request: Request) -> Response:
    """The body is read here, not by FastAPI, so that one over ``max_body_bytes`` is refused (413) before it is all
    read; anything that fails outside the client's request answers 503 with a one-line reason, never 500."""
    try:
        return await _images(request)
    except (HTTPException, RequestValidationError):
        raise
    except ClientDisconnect:  # gone while it sent its body: nobody reads the answer
        raise HTTPException(400, "body: expected all of it, got part; the client went away") from None
    except Exception as error:  # noqa: BLE001 — the replica goes on; the reason is logged with its traceback
        logger.exception("POST /v1/images failed")
        raise HTTPException(
            503,
            f"service: expected to answer, got {type(error).__name__}: "
            f"{(str(error).strip().splitlines() or [''])[0][:300]}; try again",
        ) from None


async def _images(http_request: Request) -> Response:
    start = time.perf_counter()
    generator = replica_generator()
    body = await read_body(http_request, generator.limits.max_body_bytes)
    body_s = time.perf_counter() - start
    try:
        request = ImageRequest.model_validate_json(body).model_dump()
    except ValidationError as error:  # 422 as FastAPI answers it, without echoing what was sent
        raise RequestValidationError(
            [
                dict(detail, loc=("body", *detail["loc"]))
                for detail in error.errors(include_url=False, include_input=False, include_context=False)
            ]
        )
    if request["response_format"] == "png" and request["n"] != 1:
        raise HTTPException(
            400, f"n: a png response holds one image; ask for response_format='b64_json' for n={request['n']}"
        )
    result, encoded, headers = await generated(generator, request, start, body_s)
    if "error" in result:
        raise HTTPException(result.get("status", 400), result["error"])
    if request["response_format"] == "png":
        return Response(content=encoded[0], media_type="image/png", headers=headers)
    data = [
        {"b64_json": base64.b64encode(png).decode("ascii"), "seed": seed} for png, seed in zip(encoded, result["seeds"])
    ]
    return JSONResponse(
        {
            "created": int(time.time()),
            "model": generator.model_id,
            "data": data,
            "batch_images": result["batch_images"],
            "batch_requests": result["batch_requests"],
        },
        headers=headers,
    )


async def generated(
    generator: ImageGenerator, request: Dict[str, Any], start: float, body_s: float
) -> Tuple[Dict[str, Any], List[bytes], Dict[str, str]]:
    """A request through the replica's generator: its result (``{"error", "status", "param"}`` where it was
    refused or failed), its images as PNGs and the headers that say where its time went (``start``: when the
    handler began, ``body_s``: the read of its body)."""
    result = await generator.generate(request)
    if "error" in result:
        return result, [], {}
    encoded, encode_s = result.get("pngs"), result.get("encode_s")
    if encoded is None:  # compressed PNGs: on a thread of their own, beside the others
        encoding = time.perf_counter()
        encoded = await asyncio.to_thread(encode_pngs, result["images"], generator.config.png_compression)
        encode_s = time.perf_counter() - encoding
    # where a request's time went: the pipeline call ⊂ the replica's queue and batch ⊂ the server (⊃ its body's
    # read from Serve's proxy; the PNGs' encoding, in the batch for stored PNGs, else after it)
    headers = {
        "X-Batch-Images": str(result["batch_images"]),
        "X-Batch-Requests": str(result["batch_requests"]),
        "X-Seed": str(result["seeds"][0]),
        "X-Pipeline-Seconds": f"{result['pipeline_s']:.6f}",
        "X-Replica-Seconds": f"{result['replica_s']:.6f}",
        "X-Body-Seconds": f"{body_s:.6f}",
        "X-Encode-Seconds": f"{encode_s:.6f}",
        "X-Server-Seconds": f"{time.perf_counter() - start:.6f}",
    }
    return result, encoded, headers


# ------------------------------------------------------------------------------------------ OpenAI's images API
_OPENAI_RESPONSES = {
    200: {"description": "OpenAI's images response: created, data [{b64_json, seed}], size, output_format"},
    400: {"description": "OpenAI's error shape: {error: {message, type, param, code}}"},
}
_OPENAI_GENERATION_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": OpenAIImageRequest.model_json_schema()}},
    }
}
_EDIT_FIELDS = OpenAIImageEditRequest.model_json_schema()
_OPENAI_EDIT_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": dict(
                    _EDIT_FIELDS,
                    properties={
                        "image": {"type": "string", "format": "binary", "description": "a PNG or JPEG"},
                        "mask": {
                            "type": "string",
                            "format": "binary",
                            "description": "inpainting: a PNG of the image's size, repainted where transparent",
                        },
                        **_EDIT_FIELDS["properties"],
                    },
                    required=["image", *_EDIT_FIELDS.get("required", [])],
                )
            }
        },
    }
}


@api.post("/v1/images/generations", openapi_extra=_OPENAI_GENERATION_BODY, responses=_OPENAI_RESPONSES)
async def openai_generations(request: Request) -> Response:
    """OpenAI's ``images.generate``: a JSON body (:class:`~optimum_iobinding.serve.schema.OpenAIImageRequest`)."""
    return await openai_images(request, edit=False)


@api.post("/v1/images/edits", openapi_extra=_OPENAI_EDIT_BODY, responses=_OPENAI_RESPONSES)
async def openai_edits(request: Request) -> Response:
    """OpenAI's ``images.edit``: a multipart form with an ``image`` file, an optional ``mask`` file (inpainting;
    without it, image to image) and text fields (:class:`~optimum_iobinding.serve.schema.OpenAIImageEditRequest`)."""
    return await openai_images(request, edit=True)


async def openai_images(http_request: Request, edit: bool) -> Response:
    """An OpenAI images request, answered as OpenAI's API answers: refusals and failures in its error shape
    (``{"error": {"message", "type", "param", "code"}}``) with the status ``POST /v1/images`` gives them, except
    that a malformed field is 400 (OpenAI's), not 422; a model this server does not serve is 404."""
    try:
        return await _openai_images(http_request, edit)
    except OpenAIError as error:
        return JSONResponse(error.body(), status_code=error.status)
    except HTTPException as error:  # the body's size (413)
        return JSONResponse(OpenAIError(error.status_code, error.detail).body(), status_code=error.status_code)
    except ClientDisconnect:
        refused = OpenAIError(400, "body: expected all of it, got part; the client went away")
        return JSONResponse(refused.body(), status_code=400)
    except Exception as error:  # noqa: BLE001 — the replica goes on; the reason is logged with its traceback
        logger.exception("POST %s failed", http_request.url.path)
        failed = OpenAIError(503, f"service: expected to answer, got {error_line(error, 300)}; try again")
        return JSONResponse(failed.body(), status_code=503)


async def _openai_images(http_request: Request, edit: bool) -> Response:
    start = time.perf_counter()
    generator = replica_generator()
    body = await read_body(http_request, generator.limits.max_body_bytes)
    body_s = time.perf_counter() - start
    if edit:
        request = openai_edit_request(body, http_request.headers.get("content-type", ""), generator.model_id)
    else:
        request = openai_generation_request(body, generator.model_id)
    result, encoded, headers = await generated(generator, request, start, body_s)
    if "error" in result:
        raise OpenAIError(result.get("status", 400), result["error"], result.get("param"))
    height, width = result["images"][0].shape[:2]
    return JSONResponse(
        {
            "created": int(time.time()),
            "data": [
                {"b64_json": base64.b64encode(png).decode("ascii"), "seed": seed}
                for png, seed in zip(encoded, result["seeds"])
            ],
            "model": generator.model_id,
            "output_format": "png",
            "size": f"{width}x{height}",
        },
        headers=headers,
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, or 413 as soon as it is known to be over ``limit`` bytes (its Content-Length, else
    while it comes)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise HTTPException(413, f"body: expected at most {limit} bytes (max_body_bytes), got {int(declared)}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPException(413, f"body: expected at most {limit} bytes (max_body_bytes), got more")
        chunks.append(chunk)
    return b"".join(chunks)


def keep_replica_grpc_on_loopback() -> bool:
    """In a replica's process on a cluster whose node address is loopback (the local cluster :func:`run` starts),
    binds the replica's inter-deployment gRPC server to 127.0.0.1 instead of every interface.

    Ray Serve 2.60 starts that server in every replica on ``[::]:0``, with no setting to bind it elsewhere
    (``ray/serve/_private/replica.py``, ``Replica._on_initialized``). On a loopback-only cluster its peers are on this
    machine alone, so a loopback address serves them all; the bind function that module calls is wrapped, in this
    process only, to narrow an any-address (``[::]``, ``0.0.0.0``) to ``127.0.0.1`` — nothing else changes. Where Ray's
    module no longer has that name, a warning says the port stays on every interface.

    Returns:
        Whether the bind is narrowed (``False`` on a cluster with a network address: nothing is changed there).
    """
    import ray

    if not is_loopback(ray.util.get_node_ip_address()):
        return False
    try:
        from ray.serve._private import replica as replica_module
    except ImportError:  # pragma: no cover - a Ray without that module
        replica_module = None
    bind = getattr(replica_module, "add_port_to_grpc_server", None)
    if bind is None:
        logger.warning(
            "this Ray version binds replicas' gRPC servers where optimum-iobinding cannot see: they may "
            "listen on every interface"
        )
        return False
    if getattr(bind, "narrowed_to_loopback", False):
        return True

    def bind_on_loopback(server: Any, address: str) -> Any:
        host, _, port = address.rpartition(":")
        if host in ("[::]", "0.0.0.0", ""):
            address = f"127.0.0.1:{port}"
        return bind(server, address)

    bind_on_loopback.narrowed_to_loopback = True
    replica_module.add_port_to_grpc_server = bind_on_loopback
    return True


def http_deployment(generator_class: Type[ImageGenerator]) -> "serve.Deployment":
    """The deployment ``ImageService`` for replicas of ``generator_class``: its instances answer :data:`api`'s
    routes; on a loopback-only cluster their gRPC servers listen on loopback (:func:`keep_replica_grpc_on_loopback`)."""
    if not (isinstance(generator_class, type) and issubclass(generator_class, ImageGenerator)):
        raise TypeError(f"generator_class: expected ImageGenerator or a subclass, got {generator_class!r}")

    class Replica(generator_class):  # type: ignore[misc, valid-type]
        async def __init__(self, config: Dict[str, Any]):  # Serve awaits it
            keep_replica_grpc_on_loopback()  # before Serve starts the replica's gRPC server, once this returns
            if inspect.iscoroutinefunction(generator_class.__init__):
                await generator_class.__init__(self, config)
                return
            # the pipeline's load and warm-up (tens of seconds) on a thread: the replica's event loop, where its
            # handlers may run (SERVE_REQUEST_PATH_ENV), goes on answering Serve meanwhile
            await asyncio.to_thread(generator_class.__init__, self, config)

    Replica.__doc__ = generator_class.__doc__
    return serve.deployment(name="ImageService")(serve.ingress(api)(Replica))


ImageService = http_deployment(ImageGenerator)
"""The deployment of the application: a replica per pipeline, the HTTP API on each (Serve's proxy routes requests
straight to a replica: no second hop through an ingress deployment, which carried every image between processes)."""


# ------------------------------------------------------------------------------------------------- building it
def cluster_has_gpus() -> bool:
    import ray

    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) >= 1
    import torch

    return torch.cuda.is_available()


def build_app(
    config: Union[ServeConfig, str, os.PathLike],
    generator_class: Type[ImageGenerator] = ImageGenerator,
    **settings: Any,
) -> "serve.Application":
    """The Serve application for ``config`` (a :class:`ServeConfig`, or a model folder plus its settings):
    ``serve.run(build_app("folder", replicas=2))``. ``generator_class``: what each replica runs, ImageGenerator or a
    subclass of it (one that wraps its pipeline, say: the HTTP API is the same)."""
    if not isinstance(config, ServeConfig):
        config = ServeConfig(model=os.fspath(config), **settings)
    elif settings:
        raise TypeError("build_app: give either a ServeConfig or a model and settings, not both")
    deployment = ImageService if generator_class is ImageGenerator else http_deployment(generator_class)
    gpus = config.device == "cuda" or (config.device == "auto" and cluster_has_gpus())
    actor_options = {"num_gpus": 1, "num_cpus": 1} if gpus else {"num_cpus": 1}
    return deployment.options(
        num_replicas=config.replicas,
        ray_actor_options=actor_options,
        max_ongoing_requests=config.max_ongoing_requests,
        max_queued_requests=config.max_queued_requests,
    ).bind(asdict(config))


def app_builder(args: Dict[str, Any]) -> "serve.Application":
    """For ``serve run optimum_iobinding.serve:app_builder model=FOLDER replicas=2 ...`` and config files
    (``import_path: optimum_iobinding.serve:app_builder`` with ``args``)."""
    return build_app(ServeConfig.from_args(dict(args)))


# ---------------------------------------------------------------------------------------------------- running it
APP_NAME = "optimum-iobinding"


class _Stop(KeyboardInterrupt):
    """Raised in the main thread by a SIGINT or SIGTERM while :func:`run` blocks (or starts). A
    ``KeyboardInterrupt``, the one exception that ends Ray's waits (``ray.get`` and the Serve calls made of it): they
    run the signal handlers and raise a ``KeyboardInterrupt`` of their own in its place; any other exception they
    drop and wait on, after a signal that stopped the cluster too until Ray ends the process (status 1). The signal
    is :attr:`_StopSignals.received`, read there whichever of the two arrives."""


class _StopSignals:
    """SIGINT and SIGTERM raise :class:`_Stop` in the main thread while installed (:meth:`install` again once Ray
    started: ``ray.init`` replaces the SIGTERM handler, and its core worker's dumps a stack, aborts and leaves Ray
    processes behind), and are kept in :attr:`received` (what a ``KeyboardInterrupt`` raised by Ray in place of
    :class:`_Stop` stands for); :meth:`ignore` during the shutdown, :meth:`restore` the handlers there were."""

    NAMES = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.active = threading.current_thread() is threading.main_thread()
        self.previous = {signum: signal.getsignal(signum) for signum in self.NAMES} if self.active else {}
        self.received: Optional[signal.Signals] = None

    def _raise(self, signum: int, frame: Any) -> None:
        self.received = signal.Signals(signum)
        raise _Stop(self.received.name)

    def install(self) -> None:
        for signum in self.previous:
            signal.signal(signum, self._raise)

    def ignore(self) -> None:
        for signum in self.previous:
            signal.signal(signum, signal.SIG_IGN)

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def run(
    config: ServeConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    blocking: bool = True,
    address: Optional[str] = None,
    dashboard: bool = False,
    on_ready: Optional[Callable[[], Any]] = None,
    ready_timeout_s: float = 120.0,
) -> Any:
    """Runs the application on ``host:port``, on the Ray cluster at ``address`` (or ``RAY_ADDRESS``), else on a
    local Ray cluster it starts.

    The local cluster is this machine's alone: every port Ray opens listens on 127.0.0.1 (only the HTTP API listens
    on ``host``), provided Ray was not imported before :func:`optimum_iobinding.serve.run` set it so (a warning says
    when it was); its dashboard is off unless ``dashboard`` (then on 127.0.0.1:8265). Before Ray starts, ``host:port``
    must be free (:func:`~optimum_iobinding.serve.config.check_port_free`): Serve's proxy would share a port another
    server holds rather than fail. The application is ready once ``GET /health`` answers on ``host:port``.

    Args:
        config: what to serve.
        host, port: where the HTTP API listens (a non-loopback ``host`` such as ``0.0.0.0`` exposes it).
        blocking: wait until SIGINT or SIGTERM, then shut Serve and the Ray cluster this call started down (a
            second signal during the shutdown is ignored); otherwise return once the application is ready.
        address: a Ray cluster to join (``ray://`` or ``host:port``). Its proxies listen on its nodes, which this
            machine may not reach at ``host:port``: neither the port check nor the wait for ``/health`` applies, and
            the application is ready once Serve reports it running.
        dashboard: start Ray's dashboard with the local cluster.
        on_ready: called once the application is ready (the command line prints its "serving" line there).
        ready_timeout_s: how long ``/health`` may take to answer once Serve reports the application running.

    Returns:
        Blocking: the signal that stopped it (``signal.SIGINT`` or ``signal.SIGTERM``), the application shut down.
        Otherwise: the application's handle (Serve and Ray keep running; ``serve.shutdown()``, ``ray.shutdown()``).

    Raises:
        ArgumentError: ``port`` where something listens on ``host:port`` already, ``host`` where it is no address of
            this machine (on a local cluster, before Ray starts).
        ServeStartError: Ray, Serve's proxy or the replicas did not start, or ``/health`` did not answer: one line
            saying what failed and what to do; what Ray raised is its ``__cause__``. What this call started is shut
            down.
    """
    import ray

    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is None:
        check_port_free(host, port)
    signals = _StopSignals() if blocking else None
    started_ray = False
    stopped_by = None
    try:
        if signals:
            signals.install()  # a signal while Ray or the replicas start stops them too
        stage = "ray"
        try:
            if not ray.is_initialized():
                if address is None and not is_loopback(ray.util.get_node_ip_address()):
                    logger.warning(
                        "Ray was imported before optimum_iobinding.serve.run could keep the local cluster "
                        "on 127.0.0.1: its ports listen on every interface. Set "
                        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before Ray is imported."
                    )
                started_ray = True
                if address is None:
                    ray.init(include_dashboard=dashboard, dashboard_host="127.0.0.1", log_to_driver=False)
                else:
                    ray.init(address=address, log_to_driver=False)
            if signals:
                signals.install()  # over Ray's SIGTERM handlers
            stage = "proxy"
            serve.start(http_options={"host": host, "port": port})
            stage = "replicas"
            with serve_started_here():
                handle = serve.run(build_app(config), name=APP_NAME, route_prefix="/", blocking=False)
            stage = "health"
            health = f"{local_url(host, port)}/health"
            if address is None and not wait_until_answering(health, ready_timeout_s):
                raise ServeStartError(
                    f"the application runs, but {health} did not answer within "
                    f"{ready_timeout_s:g} s; see Ray's logs (/tmp/ray/session_latest/logs)"
                )
        except ServeStartError:
            if not blocking and started_ray:
                _shut_down(started_ray, local=address is None)
            raise
        except Exception as error:
            failure = start_failure(stage, error, host, port)
            if not blocking and started_ray:
                _shut_down(started_ray, local=address is None)
            raise failure from error
        if on_ready is not None:
            on_ready()
        if not blocking:
            return handle
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:  # _Stop, or Ray's own in its place
        if signals is None or signals.received is None:
            raise
        stopped_by = signals.received
    finally:
        if signals:
            signals.ignore()
            try:
                _shut_down(started_ray, local=address is None)
            finally:
                signals.restore()
    return stopped_by


class _ServeStartedHere(logging.Filter):
    """Drops Serve's note that ``serve.run`` connects to an existing Serve app whose new HTTP options "will not be
    applied": Serve 2.60's ``serve.run`` starts Serve itself, always, with no way to give it the HTTP options; so
    :func:`run` starts Serve with them first, and the note is about the start :func:`run` has just made."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Connecting to existing Serve app")


@contextlib.contextmanager
def serve_started_here() -> Iterator[None]:
    """Within the block, Serve's logger (``ray.serve``) leaves out its note that it connects to the Serve instance
    started just before (:class:`_ServeStartedHere`); it says everything else."""
    serve_logger = logging.getLogger("ray.serve")
    note = _ServeStartedHere()
    serve_logger.addFilter(note)
    try:
        yield
    finally:
        serve_logger.removeFilter(note)


# what failed at each stage of the start, and what to do
_START_STAGES = {
    "ray": ("Ray did not start", "see Ray's logs (/tmp/ray/session_latest/logs)"),
    "proxy": (
        "Serve's HTTP proxy did not start on {where}",
        "stop what listens there or choose another port; see Ray's logs (/tmp/ray/session_latest/logs)",
    ),
    "replicas": (
        "the replicas did not start",
        "fix what it names and start again; Ray's logs: /tmp/ray/session_latest/logs/serve",
    ),
    "health": ("the application did not answer", "see Ray's logs (/tmp/ray/session_latest/logs)"),
}
# the project's refusals of an argument: their message names the argument already
_ARGUMENT_ERRORS = ("ArgumentError", "ArgumentTypeError", "ArgumentPathError")


def start_failure(stage: str, error: BaseException, host: str, port: int) -> ServeStartError:
    """One line for a failed start: what failed (``stage``: ``ray``, ``proxy``, ``replicas`` or ``health``), why (the
    last line of the error's own report: Ray's remote errors carry the remote traceback as text; a failed application
    is asked of Serve, whose status holds the replicas' error), and what to do."""
    what, todo = _START_STAGES[stage]
    reason = error_line(getattr(error, "cause", None) or error)
    if stage == "replicas":
        reason = _replica_error(APP_NAME) or reason
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return ServeStartError(f"{what.format(where=where)}: {reason}; {todo}")


def _replica_error(app_name: str) -> Optional[str]:
    """The error of the application's replicas that failed to start, from Serve's status (``None`` where there is
    none, or Serve cannot be asked)."""
    try:
        application = serve.status().applications.get(app_name)
    except Exception:  # noqa: BLE001 — the status is a better reason, not the only one
        return None
    if application is None:
        return None
    for deployment in application.deployments.values():
        if str(deployment.status).endswith(("UNHEALTHY", "DEPLOY_FAILED")) and deployment.message:
            return error_line(deployment.message)
    return error_line(application.message) if application.message else None


_ERROR_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:\([\w.]+\))?): (.+)$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def error_line(error: Union[BaseException, str], limit: int = 400) -> str:
    """An error's report in one line: an exception's type and message, or, where its text is a traceback (Ray's
    remote errors, a failed deployment's status), its last ``Type: message`` line (what was raised last); the
    project's argument refusals by their message alone (it names the argument); at most ``limit`` characters."""
    lines = [line.strip() for line in _ANSI.sub("", str(error)).splitlines() if line.strip()]
    found = [match for match in map(_ERROR_LINE.match, lines) if match]
    if isinstance(error, BaseException) and len(lines) <= 1:
        name, message = type(error).__name__, lines[0] if lines else ""
    elif found:
        name, message = found[-1].group(1), found[-1].group(2)
    else:
        name, message = "", lines[-1] if lines else "no reason given"
    name = name.rsplit(".", 1)[-1]
    line = message if name in _ARGUMENT_ERRORS or not name else f"{name}: {message}" if message else name
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _shut_down(started_ray: bool, local: bool) -> None:
    """The application, then Serve and the Ray cluster where this process started it (its processes stopped);
    quietly where they are already gone. On a local cluster, deleting the application (its replicas finish their
    requests) and stopping Ray ends Serve's actors too: ``serve.shutdown()`` there makes Ray print a failed task of
    Serve's controller, which kills itself. Where the cluster goes away meanwhile (a SIGTERM sent to the whole
    process group, systemd's default, stops its processes with this one), Serve is left to go with it: its calls
    would wait a minute for the GCS, and once this process disconnects they must not start a cluster of their own
    (:class:`NoNewCluster`)."""
    import ray

    guard = NoNewCluster(ray)

    def stop_serve() -> None:
        try:
            if started_ray and local:
                serve.delete(APP_NAME)
            else:
                serve.shutdown()
        except Exception as error:  # noqa: BLE001 — the cluster going away with it is no error of the service's
            logger.warning("Serve did not shut down cleanly: %s", error)
        finally:
            guard.done()

    if ray.is_initialized():
        stopping = threading.Thread(target=stop_serve, name="serve-shutdown", daemon=True)
        stopping.start()
        while stopping.is_alive() and _cluster_answers():
            stopping.join(0.25)
        guard.refuse_until_done()  # the cluster went away under Serve's call, or nothing: it is done
    if started_ray:
        ray.shutdown()


class NoNewCluster:
    """Keeps a Serve call that outlives this process's connection from starting a Ray cluster.

    Serve's client and ``ray.get`` call ``ray.init()`` where no cluster is connected: a shutdown call still waiting
    on a cluster that went away would, once :func:`ray.shutdown` disconnects this process, start a new local
    cluster (its dashboard included) and then fail on it. From :meth:`refuse_until_done` until the call ends
    (:meth:`done`), ``ray.init`` raises instead; nothing changes where the call ended first."""

    def __init__(self, ray_module: Any):
        self.ray = ray_module
        self.init = ray_module.init
        self._lock = threading.Lock()
        self._finished = False
        self._refusing = False

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("ray.init: the cluster went away while Serve shut down; no other is started for it")

    def refuse_until_done(self) -> None:
        with self._lock:
            if not self._finished:
                self._refusing = True
                self.ray.init = self._refuse

    def done(self) -> None:
        with self._lock:
            self._finished = True
            if self._refusing:
                self._refusing = False
                self.ray.init = self.init


def _cluster_answers() -> bool:
    """Whether the cluster's GCS still accepts connections: a SIGTERM sent to the whole process group (systemd's
    default) stops the local cluster's processes with this one, and Serve's calls would wait a minute for it."""
    import socket

    import ray

    host, _, port = ray.get_runtime_context().gcs_address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=5):
            return True
    except (OSError, ValueError):
        return False
