"""The step cache a text names (``generate --cache``, a server's ``cache`` setting), as the config a pipeline's
:meth:`~.core.OnnxDiffusionPipeline.enable_cache` takes."""

from __future__ import annotations

from ..cache_spec import parse_cache_spec
from .block_cache import first_block_cache_config_class
from .deep_cache import DeepCacheConfig


def cache_config_of(spec: str, name: str = "cache") -> object:
    """The config a command line or a server config's text names
    (:func:`~optimum_iobinding.cache_spec.parse_cache_spec`): ``fbc:0.08`` is diffusers' ``FirstBlockCacheConfig(threshold=0.08)``, ``deepcache:3`` and ``deepcache:3:1`` are
    ``DeepCacheConfig(cache_interval=3, cache_branch_id=0 or 1)``. The values are checked by the configs' own rules
    when a pipeline takes them (:meth:`~.core.OnnxDiffusionPipeline.enable_cache`).

    Raises:
        ArgumentError: ``spec`` is none of these forms (naming ``name``)."""
    kind, values = parse_cache_spec(spec, name)
    if kind == "fbc":
        return first_block_cache_config_class()(threshold=values[0])
    return DeepCacheConfig(*values)
