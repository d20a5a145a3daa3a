"""One ONNX Runtime arena for the graph sessions of a pipeline, where that is safe.

Each ONNX Runtime session has an arena of its own by default: a pipeline's text encoder, UNet and VAE decoder each keep
the most device memory any of their runs needed, although they run one after the other on one stream and never need
it at the same time. An allocator registered in ORT's environment (``create_and_register_allocator_v2``) and sessions
made with ``session.use_env_allocators=1`` share one arena instead: the UNet's activations and the decoder's reuse the
same memory, and a pipeline's peak is its largest component's, not their sum.

Sharing is safe only where no memory one session keeps can be memory a captured graph uses as scratch. A captured
graph replays into the addresses its capture ran on, which its arena took back after the capture; what another
session allocates there for the length of a run is done with before the replay on the same stream, but what it keeps
is not. A member's weights are allocated apart, outside the arena (``session.use_device_allocator_for_initializers``),
but ORT keeps a session's prepacked weights in the session's allocator (``session_state.cc``,
``PrepackConstantInitializedTensors``), made when the session is. So a session joins the device's shared arena only:

- made by the project for the CUDA graphs its graph runners capture, on the CUDA provider, with no session options of
  the user's and no arena option of the user's (an external allocator included);
- on the stream of the first session that joined (memory freed by one stream's run is reused by the next run of the
  same stream only), after the device has run what is queued on it where sessions joined before;
- before the first graph is captured on the device while the arena has members (:meth:`SharedArenas.close`: a
  capture), decided while no capture can start (inside the device gate's build).

What this stands on: a member's run writes what it allocates before reading it (memory another member used last
holds nothing it needs); only graph sessions join, whose outputs are bound to the caller's tensors (a session without a
graph hands outputs of data-dependent shape, allocated from its arena, to the caller); and a capture finds its memory
in the arena, as ORT's regular run right before it did (the arena only grows, and what other members allocate for a
run they free by its end; a capture waits until no other run is under way, :data:`~.cuda_policy.DEVICE_SETUP`). A
capture that finds no memory fails as any capture ORT refuses: the signature then runs without a graph.

Once every session that joined is gone, so is every graph that could replay into the arena: it is open again to the
next pipeline's sessions, on any stream. ORT's environment keeps the arena's memory (the largest activations its
members needed, not their weights) for the process's life: a dropped pipeline's sessions free their weights, and the
next pipeline's sessions reuse the activations' memory."""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Callable, Dict, Mapping, Optional

import onnxruntime as ort

from .cuda_policy import CUDA_DIFFUSION_DEFAULTS

logger = logging.getLogger(__name__)

# what makes a session's memory its own: these provider options, set otherwise than the project's defaults, keep the
# session's own arena
ARENA_PROVIDER_OPTIONS = frozenset(
    {
        "gpu_mem_limit",
        "arena_extend_strategy",
        "default_memory_arena_cfg",
        "gpu_external_alloc",
        "gpu_external_free",
        "gpu_external_empty_cache",
    }
)
# the shared arena grows as each session's own does with the project's defaults
SHARED_ARENA_STRATEGY = CUDA_DIFFUSION_DEFAULTS["arena_extend_strategy"]
_ARENA_STRATEGIES = {"kNextPowerOfTwo": 0, "kSameAsRequested": 1}  # OrtArenaCfg's arena_extend_strategy
USE_ENV_ALLOCATORS = "session.use_env_allocators"
# a member's weights are allocated by themselves, outside the shared arena: freed with their session, and never placed
# in memory another member's queued kernels may still use
WEIGHTS_APART = "session.use_device_allocator_for_initializers"


def synchronize_device(device_index: int) -> None:
    """Waits until the device has run everything queued on it (every stream)."""
    import torch

    torch.cuda.synchronize(device_index)


def register_cuda_arena(device_index: int) -> None:
    """Registers a CUDA arena for ``device_index`` in ORT's environment, for sessions with
    ``session.use_env_allocators=1``."""
    ort.create_and_register_allocator_v2(
        "CUDAExecutionProvider",
        ort.OrtMemoryInfo("Cuda", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, device_index, ort.OrtMemType.DEFAULT),
        {"device_id": str(device_index)},
        ort.OrtArenaCfg({"arena_extend_strategy": _ARENA_STRATEGIES[SHARED_ARENA_STRATEGY]}),
    )


class _Device:
    def __init__(self) -> None:
        self.registered: Optional[bool] = None  # None: not tried; False: ORT refused the allocator
        self.stream: Optional[str] = None  # the stream of the sessions in the arena (user_compute_stream)
        self.closed = False  # a graph was captured on the device while sessions were in the arena
        self.members = 0  # sessions in the arena, alive
        self.joined = 0  # sessions that ever joined


class SharedArenas:
    """Per CUDA device, which sessions share one arena of ORT's environment (see the module).

    Args:
        register: registers the arena of one device with ORT (``register_cuda_arena``); called once per device, on
            the first session that may join.
        synchronize: waits for the device (``synchronize_device``); called before a session joins a group whose
            stream may still run kernels on the arena's memory (it has members, or had some).
    """

    def __init__(
        self,
        register: Callable[[int], None] = register_cuda_arena,
        synchronize: Callable[[int], None] = synchronize_device,
    ):
        self._register = register
        self._synchronize = synchronize
        # reentrant: a member's finalizer (``_left``) may run in a garbage collection inside this object's own calls
        self._lock = threading.RLock()
        self._devices: Dict[int, _Device] = {}

    def may_join(
        self,
        device_index: int,
        provider: str,
        provider_options: Mapping[str, str],
        graph: bool,
        user_sess_options: bool,
    ) -> bool:
        """Whether a session about to be made with these options joins the device's shared arena: the caller then
        sets :data:`USE_ENV_ALLOCATORS` and :data:`WEIGHTS_APART` on its session options, makes the session, and
        hands it to :meth:`joined` (or calls :meth:`not_made` where ORT did not make it). Called while no capture can
        start.

        Args:
            device_index: the CUDA device.
            provider: the session's first provider.
            provider_options: its options as the session gets them (``user_compute_stream``; an arena option other
                than the project's default keeps the session's own arena).
            graph: whether the project makes the session for CUDA graphs its graph runners capture (and so close the
                group): a ``enable_cuda_graph`` of the user's own captures in plain runs, which close nothing.
            user_sess_options: whether the session is made from the user's own ``sess_options``.
        """
        if provider != "CUDAExecutionProvider" or user_sess_options or not graph:
            return False
        if any(
            name in provider_options and provider_options[name] != CUDA_DIFFUSION_DEFAULTS.get(name)
            for name in ARENA_PROVIDER_OPTIONS
        ):
            return False
        stream = provider_options.get("user_compute_stream")
        if stream is None:
            return False
        with self._lock:
            if device_index not in self._devices:
                self._devices[device_index] = _Device()
            device = self._devices[device_index]
            if device.closed or (device.stream is not None and device.stream != stream):
                return False
            if device.registered is None:
                try:
                    self._register(device_index)
                    device.registered = True
                except Exception as error:  # an onnxruntime without the CUDA provider, or one that refuses it
                    device.registered = False
                    logger.info("no shared ONNX Runtime arena on cuda:%d: %s", device_index, error)
            if not device.registered:
                return False
            if device.joined:  # kernels of members (alive or gone) may still run on the arena's memory
                self._synchronize(device_index)
            device.stream = stream
            device.members += 1  # counted now, so that no other stream takes the arena meanwhile
            return True

    def joined(self, device_index: int, session: Any) -> None:
        """``session`` was made in the device's arena (after :meth:`may_join` said yes): it leaves it when it is
        garbage-collected."""
        with self._lock:
            self._devices[device_index].joined += 1
        weakref.finalize(session, self._left, device_index)

    def not_made(self, device_index: int) -> None:
        """The session :meth:`may_join` let in was not made (ORT refused it)."""
        self._left(device_index)

    def _left(self, device_index: int) -> None:
        with self._lock:
            device = self._devices[device_index]
            device.members -= 1
            if device.members == 0:  # no session, so no graph, is left in the arena: open to the next ones
                device.closed = False
                device.stream = None

    def close(self, device_index: int) -> None:
        """A graph is being captured on the device: no session joins the arena until every one in it is gone."""
        with self._lock:
            device = self._devices.get(device_index)
            if device is not None and device.members:
                device.closed = True

    def members(self, device_index: int) -> int:
        """Sessions in the device's shared arena now."""
        with self._lock:
            device = self._devices.get(device_index)
            return device.members if device is not None else 0

    def joined_count(self, device_index: int) -> int:
        """Sessions that ever joined the device's shared arena."""
        with self._lock:
            device = self._devices.get(device_index)
            return device.joined if device is not None else 0


SHARED_ARENAS = SharedArenas()
