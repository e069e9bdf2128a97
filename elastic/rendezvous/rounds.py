"""torch's rendezvous round logic with two changes, each a small subclass.

* :class:`WaitListExecutor`: completing a round takes in the wait list, so a
  node that woke too late for the last call does not force one more round.
* :class:`ProbingStateHolder`: a node whose heartbeats are late but whose agent
  answers its probe port is not dropped (see :mod:`elastic.rendezvous.liveness`).
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timezone
from typing import Any

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    _Action,
    _BackendRendezvousStateHolder,
    _DistributedRendezvousOpExecutor,
    _RendezvousContext,
)

from elastic.rendezvous.liveness import SPARE_FACTOR, DeathDetector

logger = logging.getLogger(__name__)


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
    """

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


__all__ = ["LeaveOp", "ProbingStateHolder", "WaitListExecutor"]
