"""A c10d ``Store`` on etcd v3, for the rendezvous handler and torch elastic's agents.

Keys live under ``<prefix>/<run_id>/store/``. Blocking reads use a watch
started at the revision of the read that missed, so no write in between can
be lost and nothing polls; a timeout raises torch's ``DistStoreError`` saying
"timeout". ``add`` and ``compare_set`` are etcd transactions; ``clone`` gives
a second handle on the same data (torch's per-thread store). torch's own store
suite runs against it: tests/rendezvous/test_torch_store_suite.py.

Many keys, one request. ``multi_get``, ``multi_set`` and ``wait`` send one
etcd transaction for up to :data:`MAX_TXN_OPS` keys (etcd's ``--max-txn-ops``
default) instead of one request per key, which is what torch's C++ fallback
(``Store::multiGet``, a loop over ``get``) would do. torch's elastic agent
assigns worker ranks with them (``_assign_worker_ranks``): its rank 0 reads
every node's role and writes every node's ranks, so a rendezvous costs that
agent 4 requests at any size instead of 2 per node. The pybind trampoline
(``PythonStore``) calls these Python methods also when C++ (``PrefixStore``)
is the caller.

Retries. :meth:`EtcdClient.call` re-sends a request whose reply was lost (an
outage, a fail-over), so a write may reach etcd twice. ``set`` and
``compare_set`` give the same result when repeated; ``add`` does not, so each
call writes a fresh token next to its sum, in the same transaction, under
``<prefix>/<run_id>/store-adds/`` (outside the store, so ``num_keys`` does not
count it). A retry whose compare fails finds its own token there and returns
the sum the first attempt made instead of adding again.

etcd refuses requests over ``--max-request-bytes`` (1.5 MiB by default); a
value that large raises :class:`~elastic.errors.StoreError` naming the key.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from elastic.errors import StoreError
from elastic.etcd.client import (
    EtcdClient,
    RequestTooLargeError,
    compare_absent,
    compare_mod,
    compare_value,
    op_get,
    op_put,
)
from elastic.rendezvous.keys import RunKeys
from elastic.rendezvous.lease import RunLease

logger = logging.getLogger(__name__)

T = TypeVar("T")

# etcd refuses a transaction with more operations than its --max-txn-ops (128 by default).
MAX_TXN_OPS = 128
# Bytes of keys and values ``multi_set`` puts in one transaction, well under etcd's
# --max-request-bytes (1.5 MiB by default); a batch that is refused anyway is split in two.
TXN_BYTES = 1 << 20


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
        self._keys = keys
        self._prefix = keys.store
        # One add-token key per (store, thread): a thread has one add in flight at a time, so a
        # retry finds its own token there exactly when its add was applied. Their number stays
        # bounded by stores x threads, however many keys are added to.
        self._adds = keys.store.rstrip(b"/") + b"-adds/" + uuid.uuid4().hex.encode() + b"/"
        self._lease = lease
        self._clones: list[EtcdStore] = []
        if timeout is not None:
            self.set_timeout(timeout)

    def clone(self) -> EtcdStore:
        """A new store on the same data, client, lease and timeout, for another thread.

        The original keeps a reference to it: when C++ calls ``clone`` (``PrefixStore``,
        ``dist._test_python_store``) nothing on the Python side would, and a Python store
        whose Python object is gone answers every call with "Not implemented".
        """
        twin = EtcdStore(self._client, self._keys, self._lease, self.timeout)  # type: ignore[attr-defined]
        self._clones.append(twin)
        return twin

    def _key(self, key: str) -> bytes:
        return self._prefix + key.encode()

    def set(self, key: str, value: bytes | str) -> None:
        data = _bytes(value)
        self._sized(key, data, lambda: self._client.put(self._key(key), data, self._lease.id()))

    def get(self, key: str) -> bytes:
        """Return the value of ``key``, blocking until it exists or the store timeout passes."""
        limit: timedelta = self.timeout  # type: ignore[attr-defined]
        return self._wait_all([key], limit)[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The values of ``keys`` in order, blocking like :meth:`get` until all exist.

        One etcd transaction per :data:`MAX_TXN_OPS` keys while they all exist.
        """
        limit: timedelta = self.timeout  # type: ignore[attr-defined]
        return self._wait_all(keys, limit)

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        """Set every key to its value, in one etcd transaction per :data:`MAX_TXN_OPS` keys."""
        if len(keys) != len(values):
            raise StoreError(
                f"multi_set got {len(keys)} keys and {len(values)} values; give one value per key."
            )
        items = [(key, _bytes(value)) for key, value in zip(keys, values, strict=True)]
        batch: list[tuple[str, bytes]] = []
        size = 0
        for key, value in items:
            grows = len(self._key(key)) + len(value)
            if batch and (len(batch) == MAX_TXN_OPS or size + grows > TXN_BYTES):
                self._put_batch(batch)
                batch, size = [], 0
            batch.append((key, value))
            size += grows
        if batch:
            self._put_batch(batch)

    def has_extended_api(self) -> bool:
        """True: ``multi_get`` and ``multi_set`` are native (``append`` is torch's
        ``compare_set`` loop, which needs nothing more of a store)."""
        return True

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (0 when absent); return the sum.

        Applied once even when the client re-sends the transaction after a lost reply.
        """
        k = self._key(key)
        mark = self._adds + str(threading.get_ident()).encode()
        token = uuid.uuid4().hex.encode()
        kvs = self._client.range(k).kvs
        while True:
            current = int(kvs[0].value) if kvs else 0
            compare = compare_mod(k, kvs[0].mod_revision) if kvs else compare_absent(k)
            new = current + amount
            lease = self._lease.id()
            success = [
                op_put(k, str(new).encode(), lease),
                op_put(mark, token + b" " + str(new).encode(), lease),
            ]
            response = self._client.txn([compare], success, [op_get(k), op_get(mark)])
            if response.succeeded:
                return new
            marks = response.responses[1].response_range.kvs
            if marks:
                seen, _, applied = marks[0].value.partition(b" ")
                if seen == token:
                    logger.debug(
                        "Store add on '%s' was applied before a retry; not adding again.", key
                    )
                    return int(applied)
            kvs = response.responses[0].response_range.kvs

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """TCPStore semantics: set when the value equals ``expected`` (or the key is absent
        and ``expected`` is empty); return the value the key holds afterwards."""
        k, want, new = self._key(key), _bytes(expected), _bytes(desired)
        compare = compare_absent(k) if want == b"" else compare_value(k, want)
        response = self._sized(
            key,
            new,
            lambda: self._client.txn([compare], [op_put(k, new, self._lease.id())], [op_get(k)]),
        )
        if response.succeeded:
            return new
        kvs = response.responses[0].response_range.kvs
        if not kvs:
            return want
        if want == b"" and kvs[0].value == b"":
            self._sized(key, new, lambda: self._client.put(k, new, self._lease.id()))
            return new
        return kvs[0].value

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Block until every key exists; ``DistStoreError`` after ``timeout``."""
        self._wait_all(keys, timeout or self.timeout)  # type: ignore[attr-defined]

    def check(self, keys: list[str]) -> bool:
        return all(self._client.range(self._key(k), count_only=True).count for k in keys)

    def delete_key(self, key: str) -> bool:
        return self._client.delete(self._key(key)).deleted > 0

    def num_keys(self) -> int:
        return self._client.range(self._prefix, prefix=True, count_only=True).count

    # The C++ trampoline looks these up by their C++ names.
    deleteKey = delete_key
    getNumKeys = num_keys

    def _sized(self, key: str, value: bytes, write: Callable[[], T]) -> T:
        """Run ``write``; turn etcd's refusal of an oversized request into a StoreError."""
        try:
            return write()
        except RequestTooLargeError as exc:
            raise StoreError(
                f"The etcd store cannot hold the {len(value):,}-byte value of key '{key}' because "
                "etcd refuses requests over its --max-request-bytes limit (1.5 MiB = 1,572,864 "
                "bytes unless etcd was started with another value); store a smaller value, such "
                "as the path of a file that holds the data."
            ) from exc

    def _put_batch(self, batch: list[tuple[str, bytes]]) -> None:
        """Put ``batch`` in one transaction; halve it while etcd refuses it as too large."""
        if len(batch) == 1:
            key, value = batch[0]
            self.set(key, value)
            return
        try:
            lease = self._lease.id()
            self._client.txn([], [op_put(self._key(k), v, lease) for k, v in batch], [])
        except RequestTooLargeError:
            half = len(batch) // 2
            self._put_batch(batch[:half])
            self._put_batch(batch[half:])

    def _read(self, names: list[str]) -> tuple[dict[str, bytes], int]:
        """The values of those of ``names`` that exist, and the revision they were read at
        (the lowest, when more than one transaction read them)."""
        found: dict[str, bytes] = {}
        revision = 0
        for start in range(0, len(names), MAX_TXN_OPS):
            chunk = names[start : start + MAX_TXN_OPS]
            response = self._read_chunk(chunk)
            revision = min(revision or response.header.revision, response.header.revision)
            for name, op in zip(chunk, response.responses, strict=True):
                kvs = op.response_range.kvs
                if kvs:
                    found[name] = kvs[0].value
        return found, revision

    def _read_chunk(self, chunk: list[str]) -> Any:
        try:
            return self._client.txn([], [op_get(self._key(name)) for name in chunk], [])
        except RequestTooLargeError as exc:  # an answer over gRPC's 4 MiB receive limit
            if len(chunk) == 1:
                raise StoreError(
                    f"The etcd store could not read the value of key '{chunk[0]}' because etcd's "
                    "answer was refused as too large; store a smaller value."
                ) from exc
            half = len(chunk) // 2
            first, second = self._read_chunk(chunk[:half]), self._read_chunk(chunk[half:])
            first.header.revision = min(first.header.revision, second.header.revision)
            first.responses.extend(second.responses)
            return first

    def _wait_all(self, names: list[str], limit: timedelta) -> list[bytes]:
        """The values of ``names`` in order, watching for those missing until ``limit`` passes.

        One transaction reads every missing key; while some are missing, a watch on the first
        from the revision after that read wakes on its write, then the missing are read again.
        """
        deadline = time.monotonic() + limit.total_seconds()
        values: dict[str, bytes] = {}
        missing = list(dict.fromkeys(names))
        while missing:
            found, revision = self._read(missing)
            values.update(found)
            missing = [name for name in missing if name not in found]
            if not missing:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise dist.DistStoreError(
                    f"Store wait timeout after {limit.total_seconds():g} s: {_naming(missing)} "
                    "not appear in the etcd store; a peer may have died before publishing it, "
                    "or the store timeout is too short for this job."
                )
            self._client.wait_for_event(self._key(missing[0]), revision + 1, remaining)
        return [values[name] for name in names]


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _naming(missing: list[str]) -> str:
    """For a timeout's message: "the key 'a' did" or "the keys 'a', 'b', 'c' and 2 more did"."""
    if len(missing) == 1:
        return f"the key '{missing[0]}' did"
    shown = ", ".join(f"'{name}'" for name in missing[:3])
    more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
    return f"the keys {shown}{more} did"


__all__ = ["MAX_TXN_OPS", "EtcdStore"]
