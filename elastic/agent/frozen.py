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


def frozen_pids(stopped_since: Mapping[int, float], now: float, limit_s: float) -> list[int]:
    """The pids of ``stopped_since`` (pid -> when first seen stopped) stopped for ``limit_s``
    or longer at ``now``, sorted: the verdict, a pure function (:mod:`elastic.agent.tick`)."""
    return sorted(pid for pid, since in stopped_since.items() if now - since >= limit_s)


class FrozenWatch:
    """Tells which workers have been stopped for at least ``limit_s`` seconds."""

    def __init__(
        self, limit_s: float = FROZEN_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limit_s = limit_s
        self._clock = clock
        self._since: dict[int, float] = {}  # pid -> when it was first seen stopped

    def observe(self, pids: Mapping[int, int]) -> dict[int, float]:
        """Read which workers of ``pids`` (local rank -> pid) are stopped now; returns, for
        each, when it was first seen stopped (this watch's clock)."""
        now, stopped = self._clock(), {pid for pid in pids.values() if procs.state(pid) == "T"}
        self._since = {pid: self._since.get(pid, now) for pid in stopped}
        return dict(self._since)

    def frozen(self, pids: Mapping[int, int]) -> list[int]:
        """The pids of ``pids`` (local rank -> pid) stopped for ``limit_s`` or longer."""
        return frozen_pids(self.observe(pids), self._clock(), self.limit_s)

    def kill(self, frozen: list[int]) -> None:
        """SIGKILL the workers ``frozen`` names, and forget them."""
        for pid in frozen:
            logger.warning(
                "Worker %d has been stopped (SIGSTOP) for %.1f s or more while this agent "
                "runs; ending it so that it restarts and the job goes on.",
                pid,
                self.limit_s,
            )
            procs.kill(pid)
            self._since.pop(pid, None)

    def end(self, pids: Mapping[int, int]) -> list[int]:
        """SIGKILL every worker of ``pids`` that :meth:`frozen` names; returns their pids."""
        frozen = self.frozen(pids)
        self.kill(frozen)
        return frozen


__all__ = ["FROZEN_S", "FrozenWatch", "frozen_pids"]
