"""What the application serves and how: :class:`ServeConfig`, its checks, and its parsing from ``serve run``'s
``key=value`` arguments. Needs nothing beyond the standard library."""

import os
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Literal, Optional

# ServeConfig's settings that are positive integers (checked, and parsed from serve run's strings)
_INT_SETTINGS = ("replicas", "max_batch_size", "steps", "max_images_per_request", "max_ongoing_requests",
                 "max_queued_requests")


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
