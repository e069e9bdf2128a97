"""torch's rendezvous round logic with three changes, each a small subclass or wrapper.

* :class:`WaitListExecutor`: completing a round takes in the wait list, so a
  node that woke too late for the last call does not force one more round.
* Early close (:func:`may_close_early`, applied by :class:`WaitListExecutor`): a
  round closes as soon as every live member of the previous round is back, instead
  of waiting out the last call.
* :class:`ProbingStateHolder`: a node whose heartbeats are late but whose agent
  answers its probe port is not dropped (see :mod:`elastic.rendezvous.liveness`).

Early close. torch closes a round ``last_call_timeout`` after ``min_nodes`` have
joined, so that several nodes arriving at about the same time land in one round.
When the round only re-forms the previous one (a member was killed, left or
failed), nobody else is coming: the round may close as soon as

* it has at least ``min_nodes`` (and at most ``max_nodes``) participants,
* nobody waits to join (wait list and redundancy list empty), and
* its participants are exactly the members of the previous completed round less
  those that are gone: removed as dead (heartbeat expiry, or a refused probe, see
  :mod:`elastic.rendezvous.liveness`) or departed (:class:`LeaveOp`).

A participant that was not a member of the previous round (a new node) gets the
last call as before, and so does the first round of a run. The members are kept
in the shared state itself (an attribute of torch's pickled ``_RendezvousState``,
:data:`MEMBERS_ATTR`), so every node decides on the same facts; a state written by
an agent without this change simply has no record, and the last call applies.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta, timezone
from typing import Any

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    _Action,
    _BackendRendezvousStateHolder,
    _DistributedRendezvousOpExecutor,
    _NodeDesc,
    _RendezvousContext,
    _RendezvousJoinOp,
    _RendezvousState,
)

from elastic.rendezvous.liveness import SPARE_FACTOR, DeathDetector

logger = logging.getLogger(__name__)

MEMBERS_ATTR = "elastic_members"  # on the state: (round, members of that completed round)


def _members(state: _RendezvousState, round_: int) -> frozenset[_NodeDesc] | None:
    record = getattr(state, MEMBERS_ATTR, None)
    if not isinstance(record, tuple) or len(record) != 2 or record[0] != round_:
        return None
    return frozenset(record[1])


def previous_members(state: _RendezvousState) -> frozenset[_NodeDesc] | None:
    """The live members of the round before ``state.round``; None if not on record."""
    return _members(state, state.round - 1)


def completed_members(state: _RendezvousState) -> frozenset[_NodeDesc]:
    """The live members of ``state.round`` once it completed (empty if not on record)."""
    if not state.complete:
        return frozenset()
    return _members(state, state.round) or frozenset()


def record_members(state: _RendezvousState) -> None:
    """Remember the participants of the round just completed (called as it completes)."""
    setattr(state, MEMBERS_ATTR, (state.round, frozenset(state.participants)))


def forget_members(state: _RendezvousState, nodes: Iterable[_NodeDesc]) -> None:
    """Drop ``nodes`` (dead or departed) from the record: the next round need not wait
    for them."""
    record = getattr(state, MEMBERS_ATTR, None)
    if isinstance(record, tuple) and len(record) == 2:
        setattr(state, MEMBERS_ATTR, (record[0], frozenset(record[1]) - set(nodes)))


def may_close_early(state: _RendezvousState, settings: RendezvousSettings) -> bool:
    """Whether the open round only re-forms the previous one and everyone is back."""
    if state.complete or state.closed or state.wait_list or state.redundancy_list:
        return False
    if not settings.min_nodes <= len(state.participants) <= settings.max_nodes:
        return False
    members = previous_members(state)
    return members is not None and members == frozenset(state.participants)


class EarlyCloseJoin:
    """torch's join op, except that a participant waiting for the last call completes the
    round at once when :func:`may_close_early` holds."""

    def __init__(self, join: Callable[[_RendezvousContext, float], _Action]) -> None:
        self._join = join

    def __call__(self, ctx: _RendezvousContext, deadline: float) -> _Action:
        action = self._join(ctx, deadline)
        if (
            action in (_Action.SYNC, _Action.KEEP_ALIVE)
            and ctx.node in ctx.state.participants
            and may_close_early(ctx.state, ctx.settings)
        ):
            return _Action.MARK_RENDEZVOUS_COMPLETE
        return action


class WaitListExecutor(_DistributedRendezvousOpExecutor):
    """torch's op executor, except that completing a round takes in the wait list.

    A node that arrives while a round is complete waits on the wait list; when the
    round breaks up it must notice, wake and add itself as a participant before
    the last call ends (1 s with tuned settings). On a loaded machine a waiter can
    miss that: the round completes without it and it is still "waiting", which
    forces one more re-form at once (measured: 2 of 5 joins, +15-25 s). It asked
    to join, so the node completing the round makes it a participant (up to
    ``max_nodes``, and only if it sent a heartbeat within two intervals); on its
    next read it finds itself in the completed round and takes its rank.

    It also closes a round early (see the module docstring): a join op runs as
    :class:`EarlyCloseJoin`, and the node whose own join makes the round whole
    completes it in the same write.
    """

    _departing = False  # running a LeaveOp: a removal of this node is a departure

    def run(
        self,
        state_handler: Callable[[_RendezvousContext, float], _Action],
        deadline: float,
        update_deadline: Callable[[timedelta], float] | None = None,
    ) -> None:
        """See base class."""
        if isinstance(state_handler, _RendezvousJoinOp):
            state_handler = EarlyCloseJoin(state_handler)
        self._departing = isinstance(state_handler, LeaveOp)
        try:
            super().run(state_handler, deadline, update_deadline)
        finally:
            self._departing = False

    def _add_to_participants(self) -> None:
        super()._add_to_participants()
        if may_close_early(self._state, self._settings):
            logger.info(
                "Round %d of the rendezvous '%s' re-forms the previous one and every live "
                "member is back: closing it without the last call.",
                self._state.round,
                self._settings.run_id,
            )
            self._mark_rendezvous_complete()

    def _remove_from_participants(self) -> None:
        if self._departing:
            forget_members(self._state, [self._node])
        super()._remove_from_participants()

    def _remove_from_wait_list(self) -> None:
        if self._departing:
            forget_members(self._state, [self._node])
        super()._remove_from_wait_list()

    def _remove_from_redundancy_list(self) -> None:
        if self._departing:
            forget_members(self._state, [self._node])
        super()._remove_from_redundancy_list()

    def _mark_rendezvous_complete(self) -> None:
        state = self._state
        recent = datetime.now(timezone.utc) - 2 * self._settings.keep_alive_interval
        for node in sorted(state.wait_list):
            if len(state.participants) >= self._settings.max_nodes:
                break
            if state.last_heartbeats.get(node, recent) < recent:
                continue  # not heard from lately: it may have given up; let it rejoin itself
            state.wait_list.remove(node)
            state.participants[node] = 0
        super()._mark_rendezvous_complete()
        record_members(state)


class LeaveOp:
    """torch's exit op, also for a node that is only waiting to join (wait or redundancy
    list), where torch's leaves it to block the next round until its heartbeats expire."""

    def __call__(self, ctx: _RendezvousContext, deadline: float) -> _Action:
        state = ctx.state
        if ctx.node in state.participants:
            action = _Action.REMOVE_FROM_PARTICIPANTS
        elif ctx.node in state.wait_list:
            action = _Action.REMOVE_FROM_WAIT_LIST
        elif ctx.node in state.redundancy_list:
            action = _Action.REMOVE_FROM_REDUNDANCY_LIST
        else:
            return _Action.FINISH
        return _Action.ERROR_TIMEOUT if time.monotonic() > deadline else action


class ProbingStateHolder(_BackendRendezvousStateHolder):
    """torch's state holder, except that a late node that still answers its probe is kept.

    torch drops every node whose last heartbeat is older than the keep-alive window
    whenever anyone reads the state. Here a node whose probe port accepts is spared
    until ``SPARE_FACTOR`` windows have passed (see :mod:`elastic.rendezvous.liveness`).
    """

    detector: DeathDetector | None = None

    def _sanitize(self) -> None:
        spared = self._alive_but_late()
        saved = {node: self._state.last_heartbeats[node] for node in spared}
        now = datetime.now(timezone.utc)
        for node in spared:  # fresh for torch's check only; the real beat is put back
            self._state.last_heartbeats[node] = now
        try:
            super()._sanitize()
        finally:
            self._state.last_heartbeats.update(saved)
        forget_members(self._state, self._dead_nodes)  # dead: the next round won't wait

    def _alive_but_late(self) -> list[Any]:
        if self.detector is None:
            return []
        window = self._settings.keep_alive_interval * self._settings.keep_alive_max_attempt
        now = datetime.now(timezone.utc)
        late = {
            str(node): node
            for node, beat in self._state.last_heartbeats.items()
            if now - window * SPARE_FACTOR <= beat < now - window
        }
        if not late:
            return []
        alive = self.detector.alive([(name, node.addr) for name, node in late.items()])
        if alive:
            logger.info(
                "Keeping %s: heartbeats late but the agents answer their probe ports.",
                sorted(alive),
            )
        return [late[name] for name in alive]


__all__ = [
    "MEMBERS_ATTR",
    "EarlyCloseJoin",
    "LeaveOp",
    "ProbingStateHolder",
    "WaitListExecutor",
    "completed_members",
    "forget_members",
    "may_close_early",
    "previous_members",
    "record_members",
]
