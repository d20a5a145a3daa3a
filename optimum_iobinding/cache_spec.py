"""The text that names a step cache or a LoRA on the command line and in a server's config (the standard library only:
the server checks its settings before anything heavy is imported).
:func:`optimum_iobinding.pipelines.cache_configs.cache_config_of` makes the config a pipeline takes from it."""

from __future__ import annotations

from pathlib import PurePath
from typing import List, Sequence, Tuple, Union

from .errors import ArgumentError

CACHE_SPEC_FORMS = (
    "fbc:THRESHOLD (First-Block Cache: SD3, FLUX.1, Wan) or deepcache:INTERVAL[:BRANCH] (DeepCache: SD, SDXL)"
)


def parse_cache_spec(spec: object, name: str = "cache") -> Tuple[str, Tuple[Union[float, int], ...]]:
    """``fbc:0.08`` → ``("fbc", (0.08,))``; ``deepcache:3`` → ``("deepcache", (3,))``; ``deepcache:3:1`` →
    ``("deepcache", (3, 1))``. Only the form is checked here; the values by the config a pipeline takes.

    Raises:
        ArgumentError: ``spec`` has none of these forms (naming ``name``)."""
    kind, _, rest = str(spec).partition(":") if isinstance(spec, str) else ("", "", "")
    values = rest.split(":") if rest else []
    try:
        if kind == "fbc" and len(values) == 1:
            return kind, (float(values[0]),)
        if kind == "deepcache" and len(values) in (1, 2):
            return kind, tuple(int(value) for value in values)
    except ValueError:
        pass
    raise ArgumentError(name, f"expected {CACHE_SPEC_FORMS}, got {spec!r}")


def parse_lora_spec(spec: object, name: str = "lora") -> Tuple[str, float]:
    """``PATH[:SCALE]`` → ``(PATH, SCALE)``, a LoRA (a file, a folder or a hub id) and its weight (1 without one): a
    colon whose tail is no number belongs to the path.

    Raises:
        ArgumentError: ``spec`` is no such text, or its scale is not finite (naming ``name``)."""
    if not isinstance(spec, str) or not spec.strip(":"):
        raise ArgumentError(
            name, f"expected PATH[:SCALE] (a LoRA file, folder or hub id, and its weight), got {spec!r}"
        )
    path, scale = spec, 1.0
    head, separator, tail = spec.rpartition(":")
    if separator and head:
        try:
            path, scale = head, float(tail)
        except ValueError:
            pass  # a colon of the path itself
    if scale != scale or scale in (float("inf"), float("-inf")):
        raise ArgumentError(name, f"expected PATH[:SCALE] with a finite SCALE, got {spec!r}")
    return path, scale


def lora_adapter_names(paths: Sequence[str]) -> List[str]:
    """The adapter name of each LoRA path: its file's or folder's name without the extension (``pixel-art`` for
    ``loras/pixel-art.safetensors``, the repository's name for a hub id), ``_2``, ``_3`` … after a repeated one."""
    names: List[str] = []
    for path in paths:
        stem = PurePath(path.rstrip("/\\")).name
        stem = stem.rsplit(".", 1)[0] if stem.endswith((".safetensors", ".bin", ".pt")) else stem
        name, count = stem or "lora", 1
        while name in names:
            count += 1
            name = f"{stem}_{count}"
        names.append(name)
    return names
