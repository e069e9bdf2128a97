"""A package's public names, imported on first use (PEP 562), so importing it stays light.

``elastic`` and ``elastic_tools.chaos`` both re-export names from their modules this way: a
table says which module holds each name; :func:`lazy_exports` builds the package's
``__getattr__`` (import the module, keep the value in the package) and ``__dir__``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def lazy_exports(
    package: str, table: Mapping[str, str], namespace: dict[str, Any], public: Iterable[str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: a name of ``table`` is imported from its
    module on first use and kept in ``namespace`` (the package's ``globals()``); ``__dir__``
    lists ``public`` (its ``__all__``)."""
    names = sorted(public)

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return list(names)

    return __getattr__, __dir__
