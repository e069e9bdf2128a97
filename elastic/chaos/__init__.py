"""``elastic chaos``: seeded faults against a local job, then the invariants (nothing lost,
nothing corrupted).

The public names (imported on first use, so that ``elastic``'s command line, which reads
this package's options, stays light):

* :class:`ChaosOptions` and :func:`run_chaos`: one seeded run, its report as a dict;
* :data:`KINDS`: every fault kind and what it does;
* :func:`table`: a report's human summary;
* :func:`kept_samples`, :func:`sample_problems`, :func:`model_differences`,
  :data:`MODEL_RTOL` and :data:`LR`: the checks, shared with the tests' own jobs;
* :class:`EventTail`: the event log by kind, read incrementally.
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "KINDS": "elastic.chaos.run",
    "LR": "elastic.chaos.run",
    "MODEL_RTOL": "elastic.chaos.run",
    "ChaosOptions": "elastic.chaos.run",
    "EventTail": "elastic.chaos.run",
    "kept_samples": "elastic.chaos.run",
    "model_differences": "elastic.chaos.run",
    "run_chaos": "elastic.chaos.run",
    "sample_problems": "elastic.chaos.run",
    "table": "elastic.chaos.run",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'elastic.chaos' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
