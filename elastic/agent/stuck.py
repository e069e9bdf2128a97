"""A worker its peers named stuck while it is stopped: gone around at once, not after 3 s.

A worker stopped inside a step (SIGSTOP; a hung device looks the same to its peers) cannot
name itself nor exit: its peers wait in the step's collectives. Past the hang bound the
waiting ranks call the roll (:mod:`elastic.worker.hang`) and the lowest of them leaves a
verdict in the round's store for every rank without a mark (``elastic/hung/<round>/<rank>``,
under the job's key space: :func:`elastic.secret.key_space`). The named rank's agent looks
for it while one of its workers is stopped, and when its own worker is both named and seen
stopped for :data:`CONFIRM_S` (a verdict alone moves nothing: any member can write one, and
a healthy worker is never stopped), it ends that worker at once and leaves the round with
no health check (:func:`elastic.agent.probation.sit_out_stuck`): the others re-form in place
without its node, which rejoins as a joiner with a fresh worker. No restart of the job's
budget is spent. Without a verdict (hang watch off) the frozen-worker kill
(:mod:`elastic.agent.frozen`) remains the way out.

:func:`stuck_pids` is the verdict, a pure function (:mod:`elastic.agent.tick` decides on
it); :class:`VerdictReader` reads the store, only while a worker is stopped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping
from datetime import timedelta
from typing import Any

from elastic.worker import groups
from elastic.worker.hang import verdict_key

logger = logging.getLogger(__name__)

CONFIRM_S = 0.1  # a named worker must have been seen stopped this long, without a break
CONNECT_TIMEOUT = timedelta(seconds=1)  # a round's store that does not answer: no verdict
RETRY_S = 1.0  # after a failed connection, the same store is not tried again for this long


def stuck_pids(
    stopped_since: Mapping[int, float], named: Collection[int], now: float, confirm_s: float
) -> list[int]:
    """The pids that the waiting ranks ``named`` stuck and that have been stopped since
    ``stopped_since`` (pid -> when first seen stopped) for ``confirm_s`` or longer at
    ``now``, sorted."""
    return sorted(
        pid for pid, since in stopped_since.items() if pid in named and now - since >= confirm_s
    )


def _connect(host: str, port: int) -> Any:
    """A client of the round's store at ``host:port`` in the workers' key space, with a
    short timeout."""
    return groups.client(host, port, CONNECT_TIMEOUT)


class VerdictReader:
    """Reads which ranks of a round the waiting ranks named stuck, through one client of
    the round's store per address (made on first use)."""

    def __init__(
        self,
        connect: Callable[[str, int], Any] = _connect,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._connect = connect
        self._clock = clock
        self._client: tuple[tuple[str, int], Any] | None = None
        self._failed: dict[tuple[str, int], float] = {}  # address -> when it failed last

    def named(self, host: str, port: int, round_: int, ranks: Mapping[int, int]) -> set[int]:
        """The pids of ``ranks`` (global rank -> pid) that round ``round_``'s store at
        ``host:port`` names stuck; empty when the store cannot be read."""
        store = self._store((host, port))
        if store is None:
            return set()
        try:
            return {pid for rank, pid in ranks.items() if store.check([verdict_key(round_, rank)])}
        except Exception as exc:  # the round's store is gone: a new round is forming
            logger.info("Could not read the stuck verdict of round %d: %s", round_, exc)
            self._client = None
            self._failed[(host, port)] = self._clock()
            return set()

    def _store(self, address: tuple[str, int]) -> Any:
        if self._client is not None and self._client[0] == address:
            return self._client[1]
        failed = self._failed.get(address)
        if failed is not None and self._clock() - failed < RETRY_S:
            return None
        try:
            store = self._connect(*address)
        except Exception as exc:
            logger.info("Could not reach the round's store at %s:%d: %s", *address, exc)
            self._failed[address] = self._clock()
            return None
        self._client = (address, store)
        return store


__all__ = ["CONFIRM_S", "VerdictReader", "stuck_pids"]
