"""A package's public names imported on their first use (PEP 562's module ``__getattr__``): importing the package,
or a light module of it, pays for none of the heavy libraries its public names bring. Standard library only."""

from __future__ import annotations

from importlib import import_module
from typing import Any, Callable, Dict, List, Mapping, Tuple


def lazy_names(
    package: str, public: Mapping[str, str], namespace: Dict[str, Any]
) -> Tuple[Callable[[str], Any], Callable[[], List[str]]]:
    """The ``__getattr__`` and ``__dir__`` of the package ``package`` (its ``__name__``) whose names in ``public``
    come from the modules they map to (relative to the package), each imported on first use and then kept in
    ``namespace`` (the package's ``globals()``), where Python finds it without the function from then on."""

    def __getattr__(name: str) -> Any:
        module = public.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(module, package), name)
        namespace[name] = value
        return value

    def __dir__() -> List[str]:
        return sorted({*namespace, *public})

    return __getattr__, __dir__
