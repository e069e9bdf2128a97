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

Its modules: :mod:`~elastic_tools.chaos.plan` (the kinds, a run's options, the seeded schedule),
:mod:`~elastic_tools.chaos.fault` (one fault's record), :mod:`~elastic_tools.chaos.job` (the local
job
under test), :mod:`~elastic_tools.chaos.observers` (the event log, storage and etcd, each fault's
recovery), :mod:`~elastic_tools.chaos.injectors` (the faults), :mod:`~elastic_tools.chaos.stale`
(the
stale writer's process), :mod:`~elastic_tools.chaos.rogue` (the rogue member key),
:mod:`~elastic_tools.chaos.reference` (the fault-free run), :mod:`~elastic_tools.chaos.invariants`
(the
checks), :mod:`~elastic_tools.chaos.report` (the result), :mod:`~elastic_tools.chaos.run` (one run)
and
:mod:`~elastic_tools.chaos.command` (``elastic chaos``).
"""

from __future__ import annotations

from elastic._lazy import lazy_exports

_LAZY = {
    "KINDS": "elastic_tools.chaos.plan",
    "LR": "elastic_tools.chaos.job",
    "MODEL_RTOL": "elastic_tools.chaos.invariants",
    "ChaosOptions": "elastic_tools.chaos.plan",
    "EventTail": "elastic_tools.chaos.observers",
    "kept_samples": "elastic_tools.chaos.invariants",
    "model_differences": "elastic_tools.chaos.invariants",
    "run_chaos": "elastic_tools.chaos.run",
    "sample_problems": "elastic_tools.chaos.invariants",
    "table": "elastic_tools.chaos.report",
}

__all__ = [
    "KINDS",
    "LR",
    "MODEL_RTOL",
    "ChaosOptions",
    "EventTail",
    "kept_samples",
    "model_differences",
    "run_chaos",
    "sample_problems",
    "table",
]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals(), __all__)
