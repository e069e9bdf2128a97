"""A member that is not the closer: it follows the round key and its predecessor's key.

Both on one watch stream (one request): a published round wakes each node once, and a
death wakes only the dead node's successor, which then looks for the next older member,
or, with none left, becomes the closer (no herd). The same stream follows the node's own
key from its last write on: a new announcement (which may make this node the closer: after
an outage that expired every lease, the first node to announce again is the oldest) or the
key's loss (this node is then no member until it announces again) ends the watch at once,
so the watch thread takes up its new role; no other thread need interrupt it.
"""

from __future__ import annotations

from elastic.etcd.client import EtcdClient, KeyEvent, WatchTarget, op_get, txn_kvs
from elastic.rendezvous.announce.policy import IDLE_WATCH_S
from elastic.rendezvous.announce.publisher import older_members
from elastic.rendezvous.announce.records import decode_member
from elastic.rendezvous.announce.state import NodeState
from elastic.rendezvous.keys import RunKeys

UNKEYED_WATCH_S = 1.0  # the longest watch while this node's key has no known revision


class Follower:
    """One watch of the round key and the predecessor at a time (:meth:`step`)."""

    def __init__(self, client: EtcdClient, keys: RunKeys, state: NodeState) -> None:
        self._client, self._keys, self._state = client, keys, state

    def step(self) -> bool:
        """Watch until the predecessor goes or our own key changes (at most a minute),
        taking each round as it comes.

        Returns:
            Whether etcd answered: an event came, or a read completed. A watch that just
            ran out proves nothing (a hung etcd lets it run out too).
        """
        state = self._state
        with state.cond:
            if state.closer:  # made the closer since the watch loop looked (an announcement)
                return False
            targets = {"round": WatchTarget(self._keys.round, state.round_seen + 1)}
            # Without our key to follow (etcd lost its data: no revision of it is known) an
            # announcement cannot end the watch: look at the role again every second.
            idle_s = IDLE_WATCH_S if state.mine_rev else UNKEYED_WATCH_S
            if state.mine_rev:
                targets["own"] = WatchTarget(self._own_key, state.mine_rev + 1)
            if state.pred is not None:
                key = self._keys.members + state.pred.name.encode()
                targets["pred"] = WatchTarget(key, state.pred_seen + 1)
        kinds = list(targets)
        pred_gone = heard = False

        def on_events(index: int, batch: list[KeyEvent]) -> bool:
            nonlocal pred_gone, heard
            heard = True
            with state.cond:
                if kinds[index] == "round":
                    kv = batch[-1].kv
                    state.set_round_kv([kv], kv.mod_revision)
                    # Watch on: this watch is synced, so the closer's next write (a round
                    # published right after it told the running round who was lost) comes
                    # at once. A new watch from a revision etcd has reached is "unsynced":
                    # etcd's catch-up loop sends its events every 100 ms (measured: the
                    # round reached this node 0.1 s after the closer, kill -9 3 -> 2).
                    return False
                if kinds[index] == "own":
                    return self._own_events(batch)
                state.pred_seen = max(e.kv.mod_revision for e in batch)
                pred_gone = any(e.deleted for e in batch)
                return pred_gone

        if not self._client.watch_many(list(targets.values()), idle_s, on_events, state.watch):
            self.resync()
            return True
        if pred_gone:
            self.find_pred()
        return heard

    @property
    def _own_key(self) -> bytes:
        return self._keys.members + self._state.name.encode()

    def _own_events(self, batch: list[KeyEvent]) -> bool:
        """Our own key changed after the watch began (the caller holds the lock): end the
        watch, so the watch thread looks at its role again (our own announcement may have
        made this node the closer). If the key is gone (its lease expired, or it was
        reaped), announce again (:meth:`.NodeState.key_deleted`)."""
        if batch[-1].deleted:
            self._state.key_deleted(batch[-1].kv.mod_revision)
        return True

    def find_pred(self) -> None:
        """Read the next older member key: the new predecessor (none: the closer). A node
        whose own key is gone meanwhile (every lease expired in one etcd outage, so its
        predecessor's did too) is no closer: it announces again first."""
        state = self._state
        with state.cond:
            create_rev = state.create_rev
        ops = [older_members(self._keys, create_rev), op_get(self._own_key)]
        response = self._client.txn([], ops, [])
        kvs, mine = txn_kvs(response, 0), txn_kvs(response, 1)
        pred = decode_member(kvs[0], self._keys.members, state.trust) if kvs else None
        with state.cond:
            if state.create_rev != create_rev:
                return  # announced again meanwhile: that announcement found the predecessor
            if not mine or mine[0].create_revision != create_rev:
                state.expire()
                return
            state.set_pred(pred, response.header.revision)

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
