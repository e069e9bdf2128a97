"""One worker's part in in-place re-forms: its channel to the agent, its step guard, its round."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

from elastic import env
from elastic.errors import RecoveryError
from elastic.inplace import channel, groups
from elastic.inplace.channel import Assignment, Registration, Watcher
from elastic.inplace.guard import StepGuard

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 300.0  # how long a worker waits for the agent's next round before it gives up
ASK_AFTER_S = 2.0  # a failed step with no new round after this long asks the agent for one

READY_PREFIX = "elastic/ready"  # <round>/<rank>: that rank can form the round now
_alone = False  # set by elastic.init_process_group: this process's group awaits Run's join


def offered() -> bool:
    """Whether this worker's agent offers in-place re-forms (an agent's channel, not off)."""
    if os.environ.get(env.IN_PLACE, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return bool(os.environ.get(env.CHANNEL))


def mark_alone() -> None:
    global _alone
    _alone = True


class Member:
    """The worker side of in-place re-forms (see :mod:`elastic.inplace`)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.guard = StepGuard()
        self.watcher = Watcher(prefix, self.guard.abort)
        self.assignment: Assignment | None = None
        self._ready: tuple[int, Any] | None = None  # (round, its store client)

    @classmethod
    def from_env(cls) -> Member | None:
        """A member when the script formed its group with ``elastic.init_process_group``
        under an agent that offers in-place re-forms; else None (the restart path)."""
        if not (_alone and offered()):
            return None
        return cls(os.environ[env.CHANNEL])

    @property
    def round(self) -> int:
        return self.assignment.round if self.assignment is not None else -1

    def newest_round(self) -> int:
        """The newest round the agent has announced (pending or formed)."""
        newest = self.watcher.newest
        return newest.round if newest is not None else -1

    def ready_to_switch(self) -> bool:
        """Whether a newer round's every rank is ready to form (a join: the survivors train
        on in the old group until the joiner's process reaches ``Run``)."""
        a = self.watcher.newest
        if a is None or a.pending or a.round <= self.round:
            return False
        try:
            store = self._ready_store(a)
            keys = [f"{READY_PREFIX}/{a.round}/{r}" for r in range(a.world_size)]
            return bool(store.check(keys))
        except Exception as exc:  # the store is gone: the round will fail and re-form
            logger.warning("Cannot read round %d's store: %s", a.round, exc)
            return True

    def _ready_store(self, a: Assignment) -> Any:
        if self._ready is None or self._ready[0] != a.round:
            store = groups.client(a.master_addr, a.master_port)
            store.set(f"{READY_PREFIX}/{a.round}/{a.rank}", "1")
            self._ready = (a.round, store)
        return self._ready[1]

    def join(
        self, timeout: float = JOIN_TIMEOUT_S, failed: bool = False
    ) -> tuple[Assignment, float, float]:
        """Wait for a round newer than ours and form its group: ``(assignment, seconds
        waited, seconds forming)``.

        Raises:
            RecoveryError: no round came within ``timeout``, or its group could not form.
        """
        started = time.perf_counter()
        got = self._wait(timeout, failed)
        waited = time.perf_counter() - started
        self._ready_store(got)
        try:
            formed = groups.form(
                got.round, got.rank, got.world_size, got.master_addr, got.master_port
            )
        except Exception as exc:
            raise RecoveryError(
                f"The group of round {got.round} could not form in place ({exc}); the "
                "worker restarts and resumes from memory."
            ) from exc
        self.assignment = got
        self.guard.reset()
        self.watcher.joined(got.round)
        channel.register(self.prefix, Registration(os.getpid(), got.round))
        return got, waited, formed

    def _wait(self, timeout: float, failed: bool) -> Assignment:
        after = self.round
        if self.assignment is not None:  # the agent looks again soon, or forms one now
            channel.register(
                self.prefix, Registration(os.getpid(), after, want_round=failed, waiting=True)
            )
        got = self.watcher.wait_for(after, min(ASK_AFTER_S, timeout))
        if got is None and self.assignment is not None:
            logger.info("No round after %d yet; asking the agent to form one.", after)
            channel.register(
                self.prefix, Registration(os.getpid(), after, want_round=True, waiting=True)
            )
            got = self.watcher.wait_for(after, max(timeout - ASK_AFTER_S, 0.0))
        if got is None:
            raise RecoveryError(
                f"The agent formed no round after round {after} within {timeout:.0f} s; the "
                "worker restarts and resumes from memory."
            )
        return got

    def close(self) -> None:
        self.watcher.close()
        with contextlib.suppress(OSError):
            channel.paths(self.prefix)[1].unlink()


__all__ = ["ASK_AFTER_S", "JOIN_TIMEOUT_S", "Member", "mark_alone", "offered"]
