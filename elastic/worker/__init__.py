"""The worker process: :class:`Run`, its recovery and its in-place re-forms.

Everything here runs inside a training process (a user's script on :class:`elastic.Run`, or
our CNN worker). It talks to its agent only through :mod:`elastic.node` (node-local files,
the channel, the markers) and to its peers through the round's process group.

* the loop and the state: :mod:`~elastic.worker.session` (:class:`Run`),
  :mod:`~elastic.worker.sampler`, :mod:`~elastic.worker.boundary` (the pure step-boundary
  rule), :mod:`~elastic.worker.agreement` (the boundary's vote), :mod:`~elastic.worker.ending`;
* where the state comes from: :mod:`~elastic.worker.resume`, :mod:`~elastic.worker.exchange`,
  :mod:`~elastic.worker.snapshot`, :mod:`~elastic.worker.jit`, :mod:`~elastic.worker.codec`;
* the group: :mod:`~elastic.worker.group` (the restart path) and, in place,
  :mod:`~elastic.worker.reformer`, :mod:`~elastic.worker.member`,
  :mod:`~elastic.worker.groups`, :mod:`~elastic.worker.formstore`,
  :mod:`~elastic.worker.guard`; :mod:`~elastic.worker.process_group`
  (:func:`init_process_group`);
* slow and stuck ranks: :mod:`~elastic.worker.timing`, :mod:`~elastic.worker.straggler`,
  :mod:`~elastic.worker.hang`, :mod:`~elastic.worker.probation`.

The public names are imported on first use, so importing one module here stays light.
"""

from __future__ import annotations

from elastic._lazy import lazy_exports

_LAZY = {
    "Run": "elastic.worker.session",
    "DistributedSampler": "elastic.worker.sampler",
    "RecoveryError": "elastic.errors",
    "Member": "elastic.worker.member",
    "offered": "elastic.worker.member",
    "init_process_group": "elastic.worker.process_group",
}

__all__ = ["DistributedSampler", "Member", "RecoveryError", "Run", "init_process_group", "offered"]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals(), __all__)
