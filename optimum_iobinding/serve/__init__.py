"""Serving with Ray Serve: one pipeline per replica, one replica per GPU, requests batched into the captured UNet;
and a load test for a running service (which needs nothing beyond the core). The app's names are imported on first
use, so that the load test runs without Ray (``optimum-iobinding[serve]`` installs it)."""

from typing import Any

_APP_NAMES = ("ImageGenerator", "ImageService", "ServeConfig", "app_builder", "build_app", "encode_pngs", "run")

__all__ = list(_APP_NAMES)


def __getattr__(name: str) -> Any:
    if name in _APP_NAMES:
        from . import app

        return getattr(app, name)
    raise AttributeError(f"module 'optimum_iobinding.serve' has no attribute {name!r}")
