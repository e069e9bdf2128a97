"""A member that is not the closer: it follows the round key and its predecessor's key.

Both on one watch stream (one request): a published round wakes each node once, and a
death wakes only the dead node's successor, which then looks for the next older member,
or, with none left, becomes the closer (no herd).
"""

from __future__ import annotations

from elastic.etcd.client import EtcdClient, KeyEvent, WatchTarget, op_get, txn_kvs
from elastic.rendezvous.announce.policy import IDLE_WATCH_S
from elastic.rendezvous.announce.publisher import older_members
from elastic.rendezvous.announce.records import decode_member
from elastic.rendezvous.announce.state import NodeState
from elastic.rendezvous.keys import RunKeys


class Follower:
    """One watch of the round key and the predecessor at a time (:meth:`step`)."""

    def __init__(self, client: EtcdClient, keys: RunKeys, state: NodeState) -> None:
        self._client, self._keys, self._state = client, keys, state

    def step(self) -> bool:
        """Watch until the round changes or the predecessor goes (at most a minute).

        Returns:
            Whether etcd answered: an event came, or a read completed. A watch that just
            ran out proves nothing (a hung etcd lets it run out too).
        """
        state = self._state
        with state.cond:
            pred, targets = state.pred, [WatchTarget(self._keys.round, state.round_seen + 1)]
            if pred is not None:
                key = self._keys.members + pred.name.encode()
                targets.append(WatchTarget(key, state.pred_seen + 1))
        pred_gone = heard = False

        def on_events(index: int, batch: list[KeyEvent]) -> bool:
            nonlocal pred_gone, heard
            heard = True
            with state.cond:
                if index == 0:
                    kv, before = batch[-1].kv, state.round
                    state.set_round_kv([kv], kv.mod_revision)
                    # The round key created empty (no round yet) changes nothing here: watch on.
                    return state.round is not before
                state.pred_seen = max(e.kv.mod_revision for e in batch)
                pred_gone = any(e.deleted for e in batch)
                return pred_gone

        if not self._client.watch_many(targets, IDLE_WATCH_S, on_events, state.watch):
            self.resync()
            return True
        if pred_gone:
            self.find_pred()
        return heard

    def find_pred(self) -> None:
        """Read the next older member key: the new predecessor (none: the closer)."""
        response = self._client.txn([], [older_members(self._keys, self._state.create_rev)], [])
        kvs = txn_kvs(response, 0)
        pred = decode_member(kvs[0], self._keys.members, self._state.trust) if kvs else None
        with self._state.cond:
            self._state.set_pred(pred, response.header.revision)

    def resync(self) -> None:
        """The watched history was compacted: read the round key and predecessor again."""
        state = self._state
        ops = [op_get(self._keys.round), older_members(self._keys, state.create_rev)]
        response = self._client.txn([], ops, [])
        revision, kvs = response.header.revision, txn_kvs(response, 1)
        with state.cond:
            state.set_round_kv(txn_kvs(response, 0))
            state.round_seen = revision
            pred = decode_member(kvs[0], self._keys.members, state.trust) if kvs else None
            state.set_pred(pred, 0)
            state.pred_seen = revision
            if state.closer:
                state.members_seen = 0


__all__ = ["Follower"]
