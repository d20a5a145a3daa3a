"""Serving with Ray Serve: one pipeline per replica, one replica per GPU, requests batched into the captured UNet;
and a load test for a running service (which needs nothing beyond the core). One job per module: ``config``
(ServeConfig), ``schema`` (what goes into and comes out of a request), ``batching`` (a replica's batching: the
generator and its admission), ``app`` (the deployment, building and running it), ``loadtest``. The names below are
imported on first use, so that the load test runs without Ray (``optimum-iobinding[serve]`` installs it)."""

from importlib import import_module
from typing import Any

# each name and the module that defines it
_APP_NAMES = {
    "ServeConfig": "config",
    "ImageRequest": "schema",
    "encode_pngs": "schema",
    "REGROUP_WAIT": "batching",
    "Admission": "batching",
    "ImageGenerator": "batching",
    "ImageService": "app",
    "app_builder": "app",
    "build_app": "app",
    "run": "app",
}

__all__ = list(_APP_NAMES)


def __getattr__(name: str) -> Any:
    if name in _APP_NAMES:
        return getattr(import_module(f".{_APP_NAMES[name]}", __name__), name)
    raise AttributeError(f"module 'optimum_iobinding.serve' has no attribute {name!r}")
