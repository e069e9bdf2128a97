"""Zero-loss recovery from memory: shared-memory snapshots, peer streaming.

* :mod:`elastic.recovery.snapshot`: the double-buffered snapshot files in ``/dev/shm``;
* :mod:`elastic.recovery.jit`: the snapshot interval ("auto") and the failure-time
  snapshot of the last completed step (used by :class:`Run` and the CNN worker);
* :mod:`elastic.recovery.exchange`: agree on the newest state, stream it from a holder;
* :mod:`elastic.recovery.session`: the public :class:`Run`;
* :mod:`elastic.recovery.sampler`: a DistributedSampler with an exact resume point.
"""

from elastic.errors import RecoveryError
from elastic.recovery.sampler import DistributedSampler
from elastic.recovery.session import Run

__all__ = ["DistributedSampler", "RecoveryError", "Run"]
