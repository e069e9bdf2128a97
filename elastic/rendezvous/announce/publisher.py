"""The publisher: every write of a node's announcement and of the round key.

* :meth:`Publisher.announce` writes this node's member key on its own lease, in one
  transaction that also reads the round key and the node's predecessor (the next-older
  member key), granting a fresh lease first if there is none or it expired. The write is a
  compare-and-set on the key's version as this node last wrote it (or on its absence), so
  the record can be signed for the version it creates (:mod:`.records`, replay); if someone
  else wrote or deleted the key meanwhile, one more transaction reads it and writes again.
* :meth:`Publisher.put_round` writes the round key as the closer, in one transaction fenced
  three ways: by the round key's ``mod_revision``, by this node's own member key (a closer
  whose lease expired cannot publish) and, for a new round, by the commit fence's high mark,
  which the same transaction advances with the fence (:mod:`elastic.rendezvous.fence`), so
  a round is never visible before its fence. The round is signed for the key's next
  version; an absent round key is first created empty (no round), once per run.
* :meth:`Publisher.close_run` marks the rendezvous closed (the job finished).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

from elastic.errors import EtcdConnectionError
from elastic.etcd.client import (
    EtcdClient,
    KeyValue,
    compare_absent,
    compare_created,
    compare_less,
    compare_mod,
    key_value,
    op_get,
    op_put,
    op_range,
    txn_kvs,
)
from elastic.rendezvous.announce.keeper import MemberLease
from elastic.rendezvous.announce.records import (
    Announcement,
    Round,
    decode_members,
    round_of,
)
from elastic.rendezvous.announce.state import NodeState
from elastic.rendezvous.fence import _round_bytes, high_key
from elastic.rendezvous.keys import RunKeys
from elastic.rendezvous.lease import RunLease

logger = logging.getLogger(__name__)

_ANNOUNCE_TRIES = 3  # leases granted in a row before an announcement gives up
_WRITE_TRIES = 3  # compare-and-sets lost in a row (someone else writes our key) before that


def older_members(keys: RunKeys, create_revision: int) -> Any:
    """A read op: the newest member key created before ``create_revision`` if given, else
    the two newest (the caller's own fresh key and its predecessor)."""
    if create_revision:
        return op_range(
            keys.members, prefix=True, limit=1, newest_first=True, created_before=create_revision
        )
    return op_range(keys.members, prefix=True, limit=2, newest_first=True)


class Publisher:
    """Writes this node's announcement and, as the closer, the round key.

    Args:
        client: the etcd client.
        keys: the run's key layout.
        run_lease: the run's lease (the round key expires with an abandoned run).
        lease: this node's own lease (its member key).
        state: the node's shared state (the revisions the writes are fenced by).
    """

    def __init__(
        self,
        client: EtcdClient,
        keys: RunKeys,
        run_lease: RunLease,
        lease: MemberLease,
        state: NodeState,
    ) -> None:
        self._client, self._keys = client, keys
        self._run_lease, self._lease, self._state = run_lease, lease, state
        self.key = keys.members + state.name.encode()  # this node's member key
        self._mine: KeyValue | None = None  # our key as we last wrote or read it (None: unknown)

    def forget(self) -> None:
        """etcd lost its data: our key as we last wrote it is gone with it."""
        self._mine = None

    def announce(self, announcement: Announcement) -> bool:
        """Write this node's key and take the round and the predecessor it read.

        Returns:
            Whether this node must look for its predecessor (:meth:`Follower.find_pred`):
            its key is not the one it knew (reaped and created anew, or written over on a
            fresh lease: the key kept its place among the members), so the read did not
            look below it.

        Raises:
            EtcdConnectionError: the lease expired again before each of a few tries.
        """
        response, below = self._write(announcement)
        revision = response.header.revision
        older = decode_members(txn_kvs(response, 2), self._keys.members, self._state.trust)
        mine = txn_kvs(response, 3)
        created = mine[0].create_revision if mine else revision
        state = self._state
        with state.cond:
            # The read found our predecessor if it read the keys older than ours: those
            # created before the key we knew, still ours; or, knowing none, the two newest,
            # ours being created by this very write.
            found = created == below if below else created == revision
            state.create_rev = created
            state.mine_rev = mine[0].mod_revision if mine else revision
            pred = [m for m in older if m.name != state.name and m.create_revision < created]
            if found:
                state.set_pred(pred[0] if pred else None, revision)
            state.set_round_kv(txn_kvs(response, 1), revision)
            if state.closer:
                state.touch(time.monotonic())
        return not found

    def _write(self, announcement: Announcement) -> tuple[Any, int]:
        """Put the announcement on this node's lease, signed for that lease and for the
        version of the key it creates, in a fresh lease when there is none or it expired.
        The response, and the create_revision below which it read the members (0: it read
        the two newest)."""
        state = self._state
        leases = writes = 0
        while leases < _ANNOUNCE_TRIES and writes < _WRITE_TRIES:
            if not self._lease.id or state.expired:
                self._lease.grant()
                self._mine = None
                with state.cond:
                    state.expired, state.create_rev = False, 0
            mine = self._mine  # None: absent, we think; create it (its first version)
            below = state.create_rev
            compare = compare_mod(self.key, mine.mod_revision) if mine else compare_absent(self.key)
            at = (mine.create_revision, mine.version + 1) if mine else (0, 1)
            value = state.trust.seal(self.key, announcement, lease=self._lease.id, at=at)
            ops = [
                op_put(self.key, value, self._lease.id),
                op_get(self._keys.round),
                older_members(self._keys, below),
                op_get(self.key),
            ]
            response = self._client.txn_on_lease([compare], ops, [op_get(self.key)])
            if response is None:
                leases += 1
                with state.cond:
                    state.expire()
            elif response.succeeded:
                self._mine = txn_kvs(response, 3)[0]
                return response, below
            else:  # someone else wrote or deleted our key: write over what is there
                writes += 1
                kvs = txn_kvs(response, 0)
                self._mine = kvs[0] if kvs else None
        raise EtcdConnectionError(
            f"The node '{state.name}' could not announce itself: its etcd lease kept "
            "expiring, or its member key kept changing under it; check etcd's health, the "
            "keep_alive_* options, and who else writes etcd."
        )

    def put_round(self, round_: Round, high: int | None) -> tuple[int, tuple[int, int]] | None:
        """Write the round key if nobody did since this node read it and this node's key
        is the one it created; with ``high`` (a new round) also advance the commit fence.

        Returns:
            The revision of the write and the key's ``at`` then, or None when a compare
            failed: the state then holds what etcd holds (the round, the high mark, and
            ``expired`` if our key is gone).
        """
        state, key, fence_high = self._state, self._keys.round, high_key(self._keys)
        with state.cond:  # one snapshot: the signed version must be the compared one's next
            round_rev, (create, version) = state.round_rev, state.round_at
        if not version:
            if not self._create_round_key():
                return None
            with state.cond:
                round_rev, (create, version) = state.round_rev, state.round_at
        at = (create, version + 1)  # what this write makes of the key
        compares = [
            compare_mod(key, round_rev),
            compare_created(self.key, state.create_rev),
        ]
        puts = [op_put(key, state.trust.seal(key, round_, at=at), self._run_lease.id())]
        if high is not None:
            value = _round_bytes(high)
            compares.append(
                compare_absent(fence_high)
                if state.high is None
                else compare_less(fence_high, value)
            )
            puts += [op_put(fence_high, value), op_put(self._keys.fence, value)]
        reads = [op_get(key), op_get(fence_high), op_get(self.key)]
        response = self._client.txn(compares, puts, reads)
        if response.succeeded:
            return int(response.header.revision), at
        self._lost(response)
        return None

    def _create_round_key(self) -> bool:
        """Create the absent round key empty (no round): a signed round is never its first
        version. Whether it was absent (else the state takes what is there)."""
        key, state = self._keys.round, self._state
        put = op_put(key, b"", self._run_lease.id())
        response = self._client.txn([compare_absent(key)], [put, op_get(key)], [op_get(key)])
        with state.cond:
            state.set_round_kv(txn_kvs(response, 1 if response.succeeded else 0))
        return bool(response.succeeded)

    def _lost(self, response: Any) -> None:
        """Take what a failed :meth:`put_round` read instead."""
        high, mine = txn_kvs(response, 1), txn_kvs(response, 2)
        state = self._state
        with state.cond:
            state.set_round_kv(txn_kvs(response, 0))
            state.high = int(high[0].value) if high else None
            if not mine or mine[0].create_revision != state.create_rev:
                state.expire()

    def is_closed(self) -> bool:
        """Whether the rendezvous is closed (one read)."""
        kvs = self._client.range(self._keys.round).kvs
        return bool(kvs and round_of(key_value(kvs[0]), self._state.trust).closed)

    def close_run(self) -> None:
        """Mark the rendezvous closed: every node's next rendezvous then ends."""
        key, trust = self._keys.round, self._state.trust
        kvs = [key_value(kv) for kv in self._client.range(key).kvs]
        while True:
            if not kvs:  # create it first (a signed round is never its first version)
                put = op_put(key, b"", self._run_lease.id())
                self._client.txn([compare_absent(key)], [put], [])
                kvs = [key_value(kv) for kv in self._client.range(key).kvs]
                continue
            round_ = round_of(kvs[0], trust)
            if round_.closed:
                return
            at = (kvs[0].create_revision, kvs[0].version + 1)
            closed = trust.seal(key, replace(round_, closed=True), at=at)
            put = op_put(key, closed, self._run_lease.id())
            compare = compare_mod(key, kvs[0].mod_revision)
            response = self._client.txn([compare], [put], [op_get(key)])
            if response.succeeded:
                return
            kvs = txn_kvs(response, 0)


__all__ = ["Publisher", "older_members"]
