"""Serving with Ray Serve: one pipeline per replica, one replica per GPU, requests batched into captured graphs;
and a load test for a running service (which needs nothing beyond the core). One job per module: ``config``
(ServeConfig, the request limits), ``schema`` (what goes into and comes out of a request), ``batching`` (a
replica's batching: the generator and its admission), ``app`` (the deployment, building and running it),
``loadtest``. The names below are imported on first use, so that the load test runs without Ray
(``optimum-iobinding[serve]`` installs it), and so that :func:`run` can set up the local Ray cluster before Ray is
imported."""

from importlib import import_module
from typing import Any, Callable, Optional

# each name and the module that defines it
_APP_NAMES = {
    "ServeConfig": "config",
    "RequestLimits": "config",
    "ServeStartError": "config",
    "ImageRequest": "schema",
    "encode_pngs": "schema",
    "REGROUP_WAIT": "batching",
    "QUEUED_REGROUP_WAIT": "batching",
    "IDLE_GATHER_WAIT": "batching",
    "Admission": "batching",
    "ImageGenerator": "batching",
    "ImageService": "app",
    "app_builder": "app",
    "build_app": "app",
}

__all__ = [*_APP_NAMES, "run"]


def run(
    config: Any,
    host: str = "127.0.0.1",
    port: int = 8000,
    blocking: bool = True,
    address: Optional[str] = None,
    dashboard: bool = False,
    on_ready: Optional[Callable[[], Any]] = None,
    ready_timeout_s: float = 120.0,
) -> Any:
    """:func:`optimum_iobinding.serve.app.run` (see it for the arguments and what it returns), where no cluster is
    given, with the local Ray cluster set to listen on 127.0.0.1 only before Ray is imported
    (:func:`~optimum_iobinding.serve.config.prepare_local_ray`)."""
    from .config import prepare_local_ray

    prepare_local_ray(address)
    return import_module(".app", __name__).run(
        config,
        host=host,
        port=port,
        blocking=blocking,
        address=address,
        dashboard=dashboard,
        on_ready=on_ready,
        ready_timeout_s=ready_timeout_s,
    )


def __getattr__(name: str) -> Any:
    if name in _APP_NAMES:
        return getattr(import_module(f".{_APP_NAMES[name]}", __name__), name)
    raise AttributeError(f"module 'optimum_iobinding.serve' has no attribute {name!r}")
