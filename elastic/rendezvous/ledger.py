"""A run's records in etcd beside the rendezvous state: the job-wide restart ledger.

One key per failed round, so ``--max-restarts`` is a budget of the whole job, not of each
agent. (The commit fence is :mod:`elastic.rendezvous.fence`; liveness under announce is the
members' leases and probe ports, :mod:`elastic.rendezvous.announce.keeper`.) Built on the
client and lease the backend and store share; the handler owns it and closes it on shutdown.
"""

from __future__ import annotations

import logging

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import Token

from elastic.etcd.client import EtcdClient, compare_absent, op_put
from elastic.rendezvous.keys import RunKeys
from elastic.rendezvous.lease import RunLease

logger = logging.getLogger(__name__)


class RunLedger:
    """The restart ledger of one run.

    Args:
        client: the etcd client (shared with the backend and the store).
        keys: the run's key layout.
        lease: the lease attached to every write (keys of an abandoned run expire).
    """

    def __init__(self, client: EtcdClient, keys: RunKeys, lease: RunLease) -> None:
        self._client = client
        self._keys = keys
        self._lease = lease

    @property
    def keys(self) -> RunKeys:
        return self._keys

    def record_failed_round(self, round_: int) -> int:
        """Count a failed round once for the whole job; return how many rounds failed.

        Every agent of a failed round calls this; only the first creates the key.
        """
        key = self._keys.restarts + str(round_).encode()
        self._client.txn([compare_absent(key)], [op_put(key, b"1", self._lease.id())], [])
        return self._client.range(self._keys.restarts, prefix=True, count_only=True).count

    def close(self) -> None:
        """Close the etcd client (the backend and store share it: call once, at the end)."""
        self._client.close()


def as_revision(token: Token | None) -> int | None:
    """The etcd revision a backend token stands for (None for anything else)."""
    if token is None or isinstance(token, bool):
        return None
    try:
        return int(token)
    except (TypeError, ValueError):
        return None


__all__ = ["RunLedger", "as_revision"]
