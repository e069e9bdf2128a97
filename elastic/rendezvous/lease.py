"""A lease that makes an abandoned run's keys expire while a live run keeps them."""

from __future__ import annotations

import logging
import threading
import time

from elastic.etcd.client import EtcdClient

logger = logging.getLogger(__name__)

DEFAULT_TTL_S = 7200


class RunLease:
    """One etcd lease per client, attached to every key the client writes.

    The lease is refreshed lazily: a write that finds it older than a third of
    its TTL refreshes it first, and an expired lease is replaced. Live runs
    write (heartbeats) every few seconds, so their keys never expire; when
    every node of a run is gone, its keys vanish ``ttl`` seconds after the last
    write.
    """

    def __init__(self, client: EtcdClient, ttl: int = DEFAULT_TTL_S) -> None:
        if ttl <= 0:
            raise ValueError(f"The state TTL ({ttl}) must be a positive number of seconds.")
        self._client = client
        self._ttl = ttl
        self._id = 0
        self._refreshed = 0.0
        self._lock = threading.Lock()
        client.on_reset.append(self._forget)

    def _forget(self, reason: str) -> None:
        """etcd lost its data, and the lease with it: the next write takes a new one. No
        lock: the reset may be seen by the very grant :meth:`id` makes under it (a plain
        assignment is atomic; a grant under way assigns the new store's lease after it)."""
        del reason
        self._id = 0

    @property
    def ttl(self) -> int:
        return self._ttl

    def id(self) -> int:
        """The lease to attach to a write, granted or refreshed as needed."""
        with self._lock:
            age = time.monotonic() - self._refreshed
            if self._id and age < self._ttl / 3:
                return self._id
            if self._id and self._client.keepalive(self._id) > 0:
                self._refreshed = time.monotonic()
                return self._id
            self._id = self._client.grant(self._ttl)
            self._refreshed = time.monotonic()
            logger.debug("Granted etcd lease %x with a TTL of %d s.", self._id, self._ttl)
            return self._id


__all__ = ["DEFAULT_TTL_S", "RunLease"]
