"""elastic: fault-tolerant, elastic PyTorch training on etcd v3.

The public API (imported on first use, so ``import elastic`` stays light)::

    run = elastic.Run(model, optimizer, scheduler, sampler, checkpoint_url="runs/ckpt")
    for epoch in run.epochs(num_epochs):
        for x, y in run.batches(loader):
            ...

* :func:`init_process_group`: torch's, plus in-place re-forms under our agent (gloo);
* :class:`Run`: resume (memory, peer, storage), per-step snapshots, fenced checkpoints;
* :class:`DistributedSampler`: torch's, with an exact mid-epoch resume point;
* :class:`RecoveryError`: a state that cannot be snapshotted, exchanged or restored;
* :data:`EXIT_CODE`: a worker's exit code when a peer asked the group to stop.
"""

from __future__ import annotations

from elastic._lazy import lazy_exports

__version__ = "0.1.0"

_LAZY = {
    "Run": "elastic.worker.session",
    "DistributedSampler": "elastic.worker.sampler",
    "RecoveryError": "elastic.errors",
    "EXIT_CODE": "elastic.node.reform",
    "init_process_group": "elastic.worker.process_group",
}

__all__ = [
    "EXIT_CODE",
    "DistributedSampler",
    "RecoveryError",
    "Run",
    "__version__",
    "init_process_group",
]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals(), __all__)
