"""A run's records in etcd beside the rendezvous state, in one object the handler is given.

The backend (:mod:`elastic.rendezvous.backend`) stores torch's rendezvous state and
nothing else. Everything else a run keeps in etcd lives here:

* the **commit fence**: the newest completed round, the only one whose workers may
  commit checkpoints (:mod:`elastic.rendezvous.fence`);
* the **restart ledger**: one key per failed round, so ``--max-restarts`` is a budget of
  the whole job, not of each agent;
* the agents' **probe ports** (:mod:`elastic.rendezvous.liveness`);
* the **change watch** on the state key, which wakes a waiting node as soon as anyone
  changes the state.

Built by :func:`elastic.rendezvous.registry.create_rdzv_handler` on the client and lease
the backend and store share; the handler owns it and closes it on shutdown.
"""

from __future__ import annotations

import logging
import time

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import Token

from elastic.etcd.client import EtcdClient, compare_absent, op_put
from elastic.rendezvous.keys import RunKeys
from elastic.rendezvous.lease import RunLease

logger = logging.getLogger(__name__)


class RunLedger:
    """The fence, restart ledger, probe registry and change watch of one run.

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

    def publish_fence(self, round_: int) -> str:
        """Advance the commit fence to ``round_``; return the spec workers need (JSON)."""
        from elastic.rendezvous.fence import FenceSpec, publish_round

        publish_round(self._client, self._keys, round_, self._lease.id())
        return FenceSpec.for_run(self._client.options, self._keys, round_).to_env()

    def record_failed_round(self, round_: int) -> int:
        """Count a failed round once for the whole job; return how many rounds failed.

        Every agent of a failed round calls this; only the first creates the key.
        """
        key = self._keys.restarts + str(round_).encode()
        self._client.txn([compare_absent(key)], [op_put(key, b"1", self._lease.id())], [])
        return self._client.range(self._keys.restarts, prefix=True, count_only=True).count

    def publish_probe(self, node: str, port: int) -> None:
        """Record the probe port of this agent's node."""
        self._client.put(self._keys.probes + node.encode(), str(port).encode(), self._lease.id())

    def probe_ports(self) -> dict[str, int]:
        """Every published probe port, by node name."""
        kvs = self._client.range(self._keys.probes, prefix=True).kvs
        start = len(self._keys.probes)
        return {kv.key[start:].decode(): int(kv.value) for kv in kvs if kv.value.isdigit()}

    def wait_for_change(self, token: Token | None, timeout: float) -> bool:
        """Block until the state changes after revision ``token`` (True) or ``timeout`` passes."""
        revision = as_revision(token)
        if revision is None:
            time.sleep(timeout)
            return False
        return self._client.wait_for_event(self._keys.state, revision + 1, timeout)

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
