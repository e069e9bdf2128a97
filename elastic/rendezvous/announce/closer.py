"""The closer: the member with the oldest key executes :func:`.policy.decide`.

It reads every member key once when it takes the role, then follows them (and the round
key) with one prefix watch. At each change it decides again: publish a round, tell the
running round who waits and who was lost, or watch on until the decision's ``wake_at``
(a watch is cut short when a change brings that nearer). Losing a race costs nothing:
the failed write reads what won, and the next decision starts from there.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

from elastic.etcd.client import (
    EtcdClient,
    KeyEvent,
    WatchHandle,
    WatchTarget,
    op_get,
    op_range,
    txn_kvs,
)
from elastic.rendezvous.announce import policy
from elastic.rendezvous.announce.policy import Action, Decision, Limits
from elastic.rendezvous.announce.publisher import Publisher
from elastic.rendezvous.announce.records import decode_member, decode_members
from elastic.rendezvous.announce.state import NodeState
from elastic.rendezvous.fence import high_key
from elastic.rendezvous.keys import RunKeys

logger = logging.getLogger(__name__)

_MIN_WATCH_S = 0.05  # the shortest watch the closer opens


class Closer:
    """The closer's executor (:meth:`step`), over the node's shared state."""

    def __init__(
        self,
        client: EtcdClient,
        keys: RunKeys,
        state: NodeState,
        publisher: Publisher,
        limits: Limits,
    ) -> None:
        self._client, self._keys, self._state = client, keys, state
        self._publisher, self._limits = publisher, limits
        self._reason = ""

    def step(self) -> bool:
        """Read the members if needed, decide, act, and watch if there is nothing to do.

        Returns:
            Whether etcd answered: a read or write completed, or the watch saw an event
            (a watch that just ran out proves nothing: a hung etcd lets it run out too).
        """
        state = self._state
        heard = not state.members_seen
        if heard:
            self.read_members()
            if not state.closer:
                return True
        with state.cond:
            action = self._decide(time.monotonic()).action
        if action is Action.PUBLISH:
            self._publish()
            return True
        if action is Action.UPDATE:
            self._tell_running()
            heard = True
        return self._watch() or heard

    def _decide(self, now: float) -> Decision:
        """:func:`.policy.decide` on the state (the caller holds the lock); keeps its timers."""
        state = self._state
        decision = policy.decide(state.view(self._limits), state.timers, now)
        state.timers = decision.timers
        if decision.reason != self._reason:
            self._reason = decision.reason
            logger.debug(
                "The closer '%s' will %s: %s.", state.name, decision.action.value, decision.reason
            )
        return decision

    def read_members(self) -> None:
        """The closer's one read of every member key (and of the round and the high mark)."""
        keys, state = self._keys, self._state
        ops = [op_range(keys.members, prefix=True), op_get(keys.round), op_get(high_key(keys))]
        response = self._client.txn([], ops, [])
        kvs = txn_kvs(response, 0)
        members = {m.name: m for m in decode_members(kvs, keys.members, state.trust)}
        high, revision = txn_kvs(response, 2), response.header.revision
        with state.cond:
            state.members = members
            state.ports.update({m.name: m.probe for m in members.values()})
            state.members_seen = revision
            state.set_round_kv(txn_kvs(response, 1))
            state.round_seen = revision
            state.high = int(high[0].value) if high else None
            state.touch(time.monotonic())
            mine = members.get(state.name)
            if mine is None or mine.create_revision != state.create_rev:
                state.key_deleted(revision)  # an outage expired it: announce again first
                if not state.closer:
                    return
            older = [m for m in members.values() if m.create_revision < state.create_rev]
            if older:  # not the oldest after all (a stale view): follow again
                state.set_pred(max(older, key=lambda m: m.create_revision), revision)

    def _publish(self) -> None:
        state = self._state
        with state.cond:
            view = state.view(self._limits)
            number = policy.next_round(view, policy.newest(state.high, state.floor))
            round_ = policy.compose(view, number, state.name)
        written = self._publisher.put_round(round_, number)
        if written is None:
            return
        revision, at = written
        with state.cond:
            state.high = number
            state.set_round(round_, revision, revision, at)
            state.timers = replace(state.timers, first_ready=None, last_change=time.monotonic())
        logger.info(
            "The closer '%s' published round %d of '%s' with %d nodes.",
            state.name,
            number,
            state.run_id,
            len(round_.members),
        )

    def _tell_running(self) -> None:
        """Tell the running round how many nodes wait and which members were lost."""
        state = self._state
        with state.cond:
            round_ = policy.tell_running(state.view(self._limits), state.timers, time.monotonic())
        written = self._publisher.put_round(round_, None)
        if written is not None:
            with state.cond:
                state.set_round(round_, written[0], written[0], written[1])

    def _watch(self) -> bool:
        """Watch the members and the round until the decision changes or its time comes;
        whether etcd sent anything."""
        keys, state = self._keys, self._state
        with state.cond:
            targets = [
                WatchTarget(keys.members, state.members_seen + 1, prefix=True),
                WatchTarget(keys.round, state.round_seen + 1),
            ]
            before = self._decide(time.monotonic())
        wait_s = max(before.wake_at - time.monotonic(), _MIN_WATCH_S)
        deadline = _Deadline(state.watch, wait_s)
        heard = False

        def on_events(index: int, batch: list[KeyEvent]) -> bool:
            nonlocal heard
            heard = True
            return self._on_events(index, batch, before, deadline)

        try:
            if not self._client.watch_many(targets, wait_s, on_events, state.watch):
                state.members_seen = 0  # compacted: read everything again
                return True
        finally:
            deadline.cancel()
        return heard

    def _on_events(
        self, index: int, batch: list[KeyEvent], before: Decision, deadline: _Deadline
    ) -> bool:
        """Take a batch of the watch (0: members, 1: the round); True ends the watch."""
        state = self._state
        with state.cond:
            if index == 1:
                kv = batch[-1].kv
                state.set_round_kv([kv], kv.mod_revision)
                return True
            if self._take(batch) or not state.closer:
                return True  # our own key is gone, or an older node is back: follow
            now = time.monotonic()
            state.touch(now)
            decision = self._decide(now)
            if decision.action != before.action or before.action is Action.PUBLISH:
                return True
            deadline.shorten(decision.wake_at, now)
            return False

    def _take(self, batch: list[KeyEvent]) -> bool:
        """Apply member events (the caller holds the lock); True if our own key is gone."""
        state, prefix = self._state, self._keys.members
        for event in batch:
            name = event.kv.key[len(prefix) :].decode(errors="replace")
            state.members_seen = max(state.members_seen, event.kv.mod_revision)
            if event.deleted:
                state.members.pop(name, None)
                if name == state.name:
                    state.key_deleted(event.kv.mod_revision)
                    return True
            elif (member := decode_member(event.kv, prefix, state.trust)) is not None:
                state.members[name] = member
                state.ports[name] = member.probe
                if member.name in state.round.members:
                    # A member asks for a new round: probe the ones that still run the old
                    # one now, bypassing the alive cache (one may be dead), not at the tick.
                    state.probe_now.set()
        return False


class _Deadline:
    """When the closer's watch ends; a change that brings the decision nearer cuts it
    short (a timer interrupts the stream then)."""

    def __init__(self, handle: WatchHandle, wait_s: float) -> None:
        self._handle = handle
        self._stream = handle.current_id + 1  # the stream this watch will open
        self._at = time.monotonic() + wait_s
        self._timers: list[threading.Timer] = []

    def shorten(self, wake_at: float, now: float) -> None:
        if wake_at < self._at - 0.01:
            self._at = wake_at
            timer = threading.Timer(wake_at - now, self._handle.interrupt, (self._stream,))
            timer.daemon = True
            timer.start()
            self._timers.append(timer)

    def cancel(self) -> None:
        for timer in self._timers:
            timer.cancel()


__all__ = ["Closer"]
