"""Frozen workers: a worker that stays stopped (SIGSTOP, ``T`` in ``/proc``) while its agent runs.

A stopped worker gives no error and no answer: the other workers wait in a collective with it
until their group's timeout, fall back to a restart, and the next round, whose agents are all
alive, takes the frozen worker in again. Its agent is the one process that can see it: when a
worker has been stopped for :data:`FROZEN_S` seconds, the agent ends it (SIGKILL) and restarts
it like any failed worker; in place the others re-form without it and stream it the state
when it is back. A worker hung while running (``R``/``S``/``D``: a stuck GPU kernel) is not
told apart from a long step here; the others' group timeout bounds that.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from elastic.node import procs

logger = logging.getLogger(__name__)

FROZEN_S = 3.0  # as long as fast-failover's heartbeat expiry: a frozen node is dropped as fast


class FrozenWatch:
    """Tells which workers have been stopped for at least ``limit_s`` seconds."""

    def __init__(
        self, limit_s: float = FROZEN_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limit_s = limit_s
        self._clock = clock
        self._since: dict[int, float] = {}  # pid -> when it was first seen stopped

    def frozen(self, pids: Mapping[int, int]) -> list[int]:
        """The pids of ``pids`` (local rank -> pid) stopped for ``limit_s`` or longer."""
        now, stopped = self._clock(), {pid for pid in pids.values() if procs.state(pid) == "T"}
        self._since = {pid: self._since.get(pid, now) for pid in stopped}
        return sorted(pid for pid, since in self._since.items() if now - since >= self.limit_s)

    def end(self, pids: Mapping[int, int]) -> list[int]:
        """SIGKILL every worker of ``pids`` that :meth:`frozen` names; returns their pids."""
        frozen = self.frozen(pids)
        for pid in frozen:
            logger.warning(
                "Worker %d has been stopped (SIGSTOP) for %.1f s or more while this agent "
                "runs; ending it so that it restarts and the job goes on.",
                pid,
                self.limit_s,
            )
            procs.kill(pid)
            self._since.pop(pid, None)
        return frozen


__all__ = ["FROZEN_S", "FrozenWatch"]
