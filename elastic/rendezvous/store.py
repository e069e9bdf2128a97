"""A c10d ``Store`` on etcd v3, for the rendezvous handler and torch elastic's agents.

Keys live under ``<prefix>/<run_id>/store/``. Blocking reads use a watch
started at the revision of the read that missed, so no write in between can
be lost and nothing polls. ``add`` and ``compare_set`` are etcd transactions.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

from elastic.etcd.client import (
    EtcdClient,
    compare_absent,
    compare_mod,
    compare_value,
    op_get,
    op_put,
)
from elastic.rendezvous.keys import RunKeys
from elastic.rendezvous.lease import RunLease


class EtcdStore(dist.Store):
    """A ``torch.distributed.Store`` whose data lives in etcd.

    Args:
        client: the etcd client.
        keys: the run's key layout (keys of two run ids never mix).
        lease: the lease attached to every write.
        timeout: how long ``get`` and ``wait`` block; torch's default (300 s) if None.
    """

    def __init__(
        self,
        client: EtcdClient,
        keys: RunKeys,
        lease: RunLease,
        timeout: timedelta | None = None,
    ) -> None:
        super().__init__()  # required for the pybind trampoline
        self._client = client
        self._prefix = keys.store
        self._lease = lease
        if timeout is not None:
            self.set_timeout(timeout)

    def _key(self, key: str) -> bytes:
        return self._prefix + key.encode()

    def set(self, key: str, value: bytes | str) -> None:
        self._client.put(self._key(key), _bytes(value), self._lease.id())

    def get(self, key: str) -> bytes:
        """Return the value of ``key``, blocking until it exists or the store timeout passes."""
        return self._wait_get(self._key(key), self.timeout, key)

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (0 when absent); return the sum."""
        k = self._key(key)
        kvs = self._client.range(k).kvs
        while True:
            current = int(kvs[0].value) if kvs else 0
            compare = compare_mod(k, kvs[0].mod_revision) if kvs else compare_absent(k)
            new = current + amount
            put = op_put(k, str(new).encode(), self._lease.id())
            response = self._client.txn([compare], [put], [op_get(k)])
            if response.succeeded:
                return new
            kvs = response.responses[0].response_range.kvs

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """TCPStore semantics: set when the value equals ``expected`` (or the key is absent
        and ``expected`` is empty); return the value the key holds afterwards."""
        k, want, new = self._key(key), _bytes(expected), _bytes(desired)
        compare = compare_absent(k) if want == b"" else compare_value(k, want)
        response = self._client.txn([compare], [op_put(k, new, self._lease.id())], [op_get(k)])
        if response.succeeded:
            return new
        kvs = response.responses[0].response_range.kvs
        if not kvs:
            return want
        if want == b"" and kvs[0].value == b"":
            self._client.put(k, new, self._lease.id())
            return new
        return kvs[0].value

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Block until every key exists; ``DistStoreError`` after ``timeout``."""
        deadline = time.monotonic() + (timeout or self.timeout).total_seconds()
        for key in keys:
            remaining = timedelta(seconds=max(0.0, deadline - time.monotonic()))
            self._wait_get(self._key(key), remaining, key)

    def check(self, keys: list[str]) -> bool:
        return all(self._client.range(self._key(k), count_only=True).count for k in keys)

    def delete_key(self, key: str) -> bool:
        return self._client.delete(self._key(key)).deleted > 0

    def num_keys(self) -> int:
        return self._client.range(self._prefix, prefix=True, count_only=True).count

    # The C++ trampoline looks these up by their C++ names.
    deleteKey = delete_key
    getNumKeys = num_keys

    def _wait_get(self, k: bytes, timeout: timedelta, name: str) -> bytes:
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            response = self._client.range(k)
            if response.kvs:
                return response.kvs[0].value
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise dist.DistStoreError(
                    f"The key '{name}' did not appear in the etcd store within "
                    f"{timeout.total_seconds():g} s; a peer may have died before publishing it."
                )
            self._client.wait_for_event(k, response.header.revision + 1, remaining)


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


__all__ = ["EtcdStore"]
