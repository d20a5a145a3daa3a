"""What the application serves and how: :class:`ServeConfig`, its checks, and its parsing from ``serve run``'s
``key=value`` arguments; the limits a replica puts on requests (:class:`RequestLimits`, resolved from the config and
the pipeline); the environment of a local Ray cluster that listens on loopback only (:func:`prepare_local_ray`);
and, before and after a server starts, whether its address is free (:func:`check_port_free`) and when it answers
(:func:`wait_until_answering`). Needs nothing beyond the standard library."""

import errno
import http.client
import ipaddress
import math
import os
import socket
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, List, Literal, Optional

from ..cache_spec import parse_cache_spec, parse_lora_spec
from ..errors import ArgumentError

# ServeConfig's settings that are positive integers (checked, and parsed from serve run's strings)
_INT_SETTINGS = (
    "replicas",
    "max_batch_size",
    "steps",
    "max_images_per_request",
    "max_ongoing_requests",
    "max_queued_requests",
    "max_steps",
    "max_prompt_chars",
)
# ... and those that are positive integers or None (None: derived by the replica, see RequestLimits)
_OPTIONAL_INT_SETTINGS = ("max_pixels_per_image", "max_pixels_per_batch", "max_prompt_tokens", "max_body_bytes")
# the bytes per pixel of the largest start image a body may carry: a stored 16-bit RGBA PNG (8 bytes a pixel) in
# base64 (4 characters for 3 bytes)
_BODY_BYTES_PER_PIXEL = 11
_BODY_BYTES_BESIDES_THE_IMAGE = 2**20  # the prompts and the other fields, with room to spare

# Ray's switch for a cluster of this machine alone (its node address is 127.0.0.1, so each of its ports listens on
# loopback); read when Ray is imported, by every process of the cluster
LOCAL_RAY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"

# Ray Serve's settings of its request path that a local cluster takes (read when Serve is imported, in each of its
# processes, which inherit them): the replica's handlers run on its main event loop and the proxy's router on the
# proxy's main loop, not on loops of their own, each saving a hand-off between threads per request; the proxy sends
# requests to the replicas, and takes their answers back, over gRPC rather than as Ray actor calls whose answers of
# more than 100 KiB go through Ray's object store (an image's answer takes the shorter way from replica to client).
# Ray's performance guide recommends all three ("throughput-optimized" serving). Serve caps a gRPC message at 4 MiB by
# default, less than one 1024² image in base64: the cap is lifted (-1, gRPC's "no limit"), since what a replica
# answers is bounded by its RequestLimits. The pipeline calls and PNG encoding run on threads; what runs on the loop
# (parsing and checking a request) takes milliseconds.
SERVE_REQUEST_PATH_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_PROXY_USE_GRPC": "1",
    "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": "-1",
}

# Ray's authentication of a local cluster's own connections (its processes, `ray` commands, the dashboard). Ray 2.60
# starts a new local cluster with token authentication unless RAY_AUTH_MODE says otherwise, and then warns, on every
# start, that it did ("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt
# out."). The local cluster asks for it by name: the same authentication, and nothing to warn of.
LOCAL_RAY_AUTH_ENV = {"RAY_AUTH_MODE": "token"}


@dataclass
class ServeConfig:
    """What the application serves and how.

    Args:
        model: a pipeline folder (diffusers ONNX layout; any text-to-image family, picked from the folder) or a hub
            id.
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
            PNG's row filters (Pillow): fewer bytes for many times the encoding time, which at concurrency 1 is a
            visible part of a request's latency.
        max_pixels_per_image: the most pixels (width × height) of one image, a start image's too. Default: an image
            of twice the side of the largest size the replica is made for (the larger of the pipeline's default size
            and ``warmup_sizes``): 1024² = 1048576 for SD 1.5 (512), 2048² for SDXL (1024). Beyond that the
            activations grow past what the service was sized for, and the model was not trained for it.
        max_pixels_per_batch: the most pixels of one pipeline call, its images together; a request's ``n`` images
            must fit in it, and a batch runs in as many calls as it needs to stay within it. Default
            ``max_batch_size`` images of the default ``max_pixels_per_image`` (or one image of
            ``max_pixels_per_image`` where that is more). Lower it where a full batch of large images does not fit
            in the device's memory.
        max_steps: the most denoising steps of a request (default 150: five times the usual 30; the schedulers'
            quality stops improving long before, while the cost grows linearly). At least ``steps``.
        max_prompt_chars: the most characters of a prompt or negative prompt (default 2000: several times what the
            text encoder reads; bounds the tokenizer's work on a hostile prompt).
        max_prompt_tokens: the most tokens of a prompt or negative prompt, its start and end tokens included.
            Default the tokenizer's ``model_max_length`` (77 for CLIP): the text encoder reads no more, and a longer
            prompt would be cut off without the client knowing. Set it higher to let such prompts through, cut off.
        max_body_bytes: the most bytes of a request's body (a larger one gets 413 before it is read). Default room
            for a start image of ``max_pixels_per_image`` (a base64 16-bit RGBA PNG, 11 bytes a pixel) and 1 MiB
            for the rest: 12.5 MB for SD 1.5.
        request_timeout_s: how long a request may take in its replica, waiting for its batch included, before it
            gets 504 (default 300: minutes beyond any single batch; a replica that far behind is overloaded).
        pipeline_options: extra keyword arguments for the pipeline's ``from_pretrained``.
        engine: ``"optimum-iobinding"``, or ``"diffusers-numpy"``: diffusers' numpy ONNX pipeline of Stable Diffusion
            (the numpy loop), the anchor the serving benchmark compares against. Its batches draw every image's noise
            from one ``RandomState`` seeded with the first request's seed, so a batched image is not the single
            call's; without batching (``max_batch_size=1``) it is.
        cache: a step cache for every request (default ``None``: off), as ``generate --cache`` names it:
            ``fbc:THRESHOLD`` (First-Block Cache, SD3 and FLUX.1) or ``deepcache:INTERVAL[:BRANCH]`` (DeepCache, SD
            and SDXL); the model folder needs the parts (``export --step-cache``).
        loras: LoRAs each replica loads at start, as ``serve --lora`` names them: ``PATH[:SCALE]`` (a file, a
            folder or a hub id; its weight, default 1), each an adapter named after its file (``pixel-art`` for
            ``pixel-art.safetensors``). A request uses them all at these weights unless its ``loras`` field says
            which and how much (switched in place between batches: no reload, graphs kept).
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
    max_pixels_per_image: Optional[int] = None
    max_pixels_per_batch: Optional[int] = None
    max_steps: int = 150
    max_prompt_chars: int = 2000
    max_prompt_tokens: Optional[int] = None
    max_body_bytes: Optional[int] = None
    request_timeout_s: float = 300.0
    pipeline_options: Dict[str, Any] = field(default_factory=dict)
    engine: Literal["optimum-iobinding", "diffusers-numpy"] = "optimum-iobinding"
    cache: Optional[str] = None
    loras: List[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        def positive_int(name: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ArgumentError(name, f"expected a positive integer, got {value!r}")

        if not isinstance(self.model, (str, os.PathLike)) or not str(self.model):
            raise ArgumentError("model", f"expected a pipeline folder or a hub id, got {self.model!r}")
        self.model = os.fspath(self.model)
        for name in _INT_SETTINGS:
            positive_int(name)
        for name in _OPTIONAL_INT_SETTINGS:
            if getattr(self, name) is not None:
                positive_int(name)
        if (
            isinstance(self.guidance, bool)
            or not isinstance(self.guidance, (int, float))
            or not math.isfinite(self.guidance)
            or self.guidance < 0
        ):
            raise ArgumentError("guidance", f"expected a finite number ≥ 0, got {self.guidance!r}")
        if self.steps > self.max_steps:
            raise ArgumentError(
                "steps", f"expected at most max_steps={self.max_steps}, got {self.steps}; raise max_steps"
            )
        if (
            self.max_pixels_per_image is not None
            and self.max_pixels_per_batch is not None
            and self.max_pixels_per_batch < self.max_pixels_per_image
        ):
            raise ArgumentError(
                "max_pixels_per_batch",
                f"expected at least max_pixels_per_image="
                f"{self.max_pixels_per_image} (one image must fit), got {self.max_pixels_per_batch}",
            )
        if (
            isinstance(self.request_timeout_s, bool)
            or not isinstance(self.request_timeout_s, (int, float))
            or not math.isfinite(self.request_timeout_s)
            or self.request_timeout_s <= 0
        ):
            raise ArgumentError(
                "request_timeout_s", f"expected a positive number of seconds, got {self.request_timeout_s!r}"
            )
        if not isinstance(self.batch_wait_timeout_s, (int, float)) or not 0 <= self.batch_wait_timeout_s <= 60:
            raise ArgumentError(
                "batch_wait_timeout_s", f"expected seconds in [0, 60], got {self.batch_wait_timeout_s!r}"
            )
        if isinstance(self.png_compression, bool) or self.png_compression not in range(10):
            raise ArgumentError("png_compression", f"expected a zlib level 0–9, got {self.png_compression!r}")
        if self.engine not in ("optimum-iobinding", "diffusers-numpy"):
            raise ArgumentError("engine", f"expected 'optimum-iobinding' or 'diffusers-numpy', got {self.engine!r}")
        if self.cache is not None:
            parse_cache_spec(self.cache, "cache")
            if self.engine == "diffusers-numpy":
                raise ArgumentError(
                    "cache",
                    f"expected None with engine='diffusers-numpy' (diffusers' ONNX pipeline "
                    f"runs its model whole), got {self.cache!r}",
                )
        if not isinstance(self.loras, (list, tuple)):
            raise ArgumentError("loras", f"expected a list of PATH[:SCALE], got {self.loras!r}")
        self.loras = list(self.loras)
        for spec in self.loras:
            parse_lora_spec(spec, "loras")
        if self.loras and self.engine == "diffusers-numpy":
            raise ArgumentError(
                "loras", f"expected none with engine='diffusers-numpy' (its ONNX models take none), got {self.loras}"
            )
        if self.device not in ("auto", "cuda", "cpu"):
            raise ArgumentError("device", f"expected 'auto', 'cuda' or 'cpu', got {self.device!r}")
        if self.max_images_per_request > self.max_batch_size:
            self.max_images_per_request = self.max_batch_size
        for name in ("warmup_batch_sizes", "warmup_sizes"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, (list, tuple))
                or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in value)
            ):
                raise ArgumentError(name, f"expected a list of positive integers, got {value!r}")

    @classmethod
    def from_args(cls, args: Dict[str, Any]) -> "ServeConfig":
        """From ``serve run``'s ``key=value`` arguments (strings) or a config file's ``args`` (typed)."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(args) - set(known))
        if unknown:
            raise ArgumentError("args", f"unknown {unknown}; expected some of {sorted(known)}")
        typed: Dict[str, Any] = {}
        for name, value in args.items():
            if isinstance(value, str) and name in (*_INT_SETTINGS, *_OPTIONAL_INT_SETTINGS, "png_compression"):
                value = _parse(name, value, int)
            elif isinstance(value, str) and name in ("batch_wait_timeout_s", "guidance", "request_timeout_s"):
                value = _parse(name, value, float)
            elif isinstance(value, str) and name in ("warmup_batch_sizes", "warmup_sizes"):
                value = [_parse(name, part, int) for part in value.split(",") if part.strip()]
            elif isinstance(value, str) and name == "loras":  # PATH[:SCALE],PATH[:SCALE]…
                value = [part.strip() for part in value.split(",") if part.strip()]
            typed[name] = value
        return cls(**typed)

    def limits(self, default_size: int, tokenizer_max_length: Optional[int] = None) -> "RequestLimits":
        """The limits a replica puts on requests: the settings given, the others derived (see the class's Args) from
        the pipeline's ``default_size`` (pixels, the side of its default square) and its tokenizer's
        ``model_max_length`` (``None``: no token limit unless ``max_prompt_tokens`` is given)."""
        largest = max([default_size, *(self.warmup_sizes or [])])  # what a request without a size, or warm-up, makes
        side = 2 * largest
        per_image = self.max_pixels_per_image or side * side
        if per_image < largest * largest:  # every request without a size would be refused
            raise ArgumentError(
                "max_pixels_per_image",
                f"expected at least {largest}×{largest} = {largest * largest} pixels (the size of a request without "
                f"one, and of the warm-up), got {per_image}",
            )
        per_batch = self.max_pixels_per_batch or max(self.max_batch_size * side * side, per_image)
        return RequestLimits(
            max_pixels_per_image=per_image,
            max_pixels_per_batch=per_batch,
            max_images_per_request=self.max_images_per_request,
            max_steps=self.max_steps,
            max_prompt_chars=self.max_prompt_chars,
            max_prompt_tokens=self.max_prompt_tokens or tokenizer_max_length,
            max_body_bytes=self.max_body_bytes or _BODY_BYTES_PER_PIXEL * per_image + _BODY_BYTES_BESIDES_THE_IMAGE,
            request_timeout_s=float(self.request_timeout_s),
        )


@dataclass(frozen=True)
class RequestLimits:
    """What a replica accepts (:meth:`ServeConfig.limits`); a request beyond one gets 400 naming it (413 for the
    body), before any of its work is queued. ``max_prompt_tokens`` ``None``: no token limit."""

    max_pixels_per_image: int
    max_pixels_per_batch: int
    max_images_per_request: int
    max_steps: int
    max_prompt_chars: int
    max_prompt_tokens: Optional[int]
    max_body_bytes: int
    request_timeout_s: float


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) names this machine's loopback interface only."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


class ServeStartError(RuntimeError):
    """The service did not start: one line saying what failed and what to do (the error behind it, with Ray's
    traceback, is its ``__cause__``)."""


def _socket_family(host: str) -> int:
    """The address family Serve's proxy binds ``host`` with: IPv6 for an IPv6 address, IPv4 otherwise (a name such as
    ``localhost`` resolves to its IPv4 address)."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def check_port_free(host: str, port: int) -> None:
    """Refuses ``host:port`` where a server could not listen there alone: something listens on it already (another
    optimum-iobinding server, any other program), or ``host`` is no address of this machine.

    Serve's proxy binds its port with ``SO_REUSEPORT``: a second server on a port another one holds would not fail,
    the two would share it and the kernel would hand each connection to either. So this check binds a socket of its
    own to ``(host, port)`` and closes it, without ``SO_REUSEPORT``: on Linux such a bind fails (``EADDRINUSE``)
    while any socket listens on the port, with or without ``SO_REUSEPORT``, and on any address that overlaps
    (``0.0.0.0`` and ``127.0.0.1``). It sets ``SO_REUSEADDR`` on Linux, which there shares no port with a listener but
    lets the bind pass where only connections of a stopped server linger (``TIME_WAIT``), so a server restarted at
    once is not refused; elsewhere the bind is plain.

    Raises:
        ArgumentError: ``port`` when the port is taken or needs privileges; ``host`` when it cannot be bound here.
    """
    family = _socket_family(host)
    where = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            if sys.platform.startswith("linux"):
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except socket.gaierror as error:
        raise ArgumentError("host", f"expected an address of this machine, got {host!r}: {error.strerror}") from None
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            raise ArgumentError(
                "port",
                f"expected a free port, got {port}: something already listens on {where} "
                "(another server?); stop it or choose another port",
            ) from None
        if error.errno in (errno.EACCES, errno.EPERM):
            raise ArgumentError(
                "port",
                f"expected a port this user may listen on, got {port} on {where}: "
                f"{error.strerror}; choose one above 1023",
            ) from None
        raise ArgumentError(
            "host", f"expected an address of this machine to listen on, got {host!r}: {error.strerror or error}"
        ) from None


def local_url(host: str, port: int) -> str:
    """The URL that reaches a server listening on ``host:port`` from this machine: an any-address (``0.0.0.0``,
    ``::``) is reached on loopback."""
    address = host.strip().strip("[]")
    if address in ("", "0.0.0.0"):
        address = "127.0.0.1"
    elif address == "::":
        address = "::1"
    return f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"


def wait_until_answering(
    url: str,
    timeout_s: float,
    interval_s: float = 0.05,
    keep_waiting: Callable[[], bool] = lambda: True,
    try_timeout_s: float = 5.0,
) -> bool:
    """Asks ``GET url`` until it answers 200: ``True`` once it did, ``False`` once ``timeout_s`` passed or
    ``keep_waiting()`` (asked between tries) says no more. A refused or dropped connection, an answer of another
    status, or no answer within the try's own timeout (``try_timeout_s``, at most what is left of ``timeout_s``):
    the server is still starting, asked again ``interval_s`` later."""
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        try:
            with urllib.request.urlopen(url, timeout=max(0.1, min(try_timeout_s, remaining))) as answer:
                if answer.status == 200:
                    return True
        except (OSError, http.client.HTTPException, urllib.error.URLError):  # HTTPError is one: another status
            pass
        if time.monotonic() + interval_s > deadline or not keep_waiting():
            return False
        time.sleep(interval_s)


def prepare_local_ray(address: Optional[str] = None) -> bool:
    """Before Ray is imported: where no cluster is given (``address`` nor ``RAY_ADDRESS``), makes the local Ray
    cluster that will be started one of this machine alone, every port of it on 127.0.0.1 (Ray's
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, the default of Ray on Windows and macOS; an explicit setting is kept),
    whose processes (Serve's proxy among them) take :data:`SERVE_REQUEST_PATH_ENV`, with the token authentication
    Ray gives a new local cluster asked for by name (:data:`LOCAL_RAY_AUTH_ENV`: no warning that Ray enabled it, a
    setting of the user's kept). Returns whether Ray is set to
    loopback. Once Ray is imported it is too late (this process read the setting, the processes it starts would
    read another): nothing is changed then, and :func:`~optimum_iobinding.serve.app.run` warns."""
    if address or os.environ.get("RAY_ADDRESS"):
        return False
    if "ray" not in sys.modules:
        os.environ.setdefault(LOCAL_RAY_ENV, "0")
        for name, value in {**SERVE_REQUEST_PATH_ENV, **LOCAL_RAY_AUTH_ENV}.items():
            os.environ.setdefault(name, value)
    return os.environ.get(LOCAL_RAY_ENV, "").lower() not in ("", "1", "true")  # how Ray reads it


def _parse(name: str, text: str, kind: type) -> Any:
    try:
        return kind(text)
    except ValueError:
        raise ArgumentError(name, f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
