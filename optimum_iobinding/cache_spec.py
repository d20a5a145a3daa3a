"""The text that names a step cache on the command line and in a server's config (the standard library only: the
server checks its settings before anything heavy is imported).
:func:`optimum_iobinding.pipelines.cache_configs.cache_config_of` makes the config a pipeline takes from it."""

from __future__ import annotations

from typing import Tuple, Union

from .errors import ArgumentError

CACHE_SPEC_FORMS = "fbc:THRESHOLD (First-Block Cache: SD3, FLUX.1) or deepcache:INTERVAL[:BRANCH] (DeepCache: SD, SDXL)"


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
