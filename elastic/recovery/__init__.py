"""Zero-loss recovery from memory: shared-memory snapshots, peer streaming.

* :mod:`elastic.recovery.snapshot`: the double-buffered snapshot files in ``/dev/shm``;
* :mod:`elastic.recovery.jit`: the snapshot interval ("auto") and the failure-time
  snapshot of the last completed step (used by :class:`Run` and the CNN worker);
* :mod:`elastic.recovery.exchange`: agree on the newest state, stream it from a holder;
* :mod:`elastic.recovery.session`: the public :class:`Run` (the loop, the state, one way out);
* :mod:`elastic.recovery.boundary`: the pure step-boundary rule (one vote vector, ``decide``);
* :mod:`elastic.recovery.agreement`: a Run's step boundary (vote, all-reduce, act);
* :mod:`elastic.recovery.group`: the restart path, and the interface the in-place path
  (:mod:`elastic.inplace.reformer`) shares with it;
* :mod:`elastic.recovery.resume`: where a Run's state comes from (agree, load);
* :mod:`elastic.recovery.sampler`: a DistributedSampler with an exact resume point.
"""

from elastic.errors import RecoveryError
from elastic.recovery.sampler import DistributedSampler
from elastic.recovery.session import Run

__all__ = ["DistributedSampler", "RecoveryError", "Run"]
