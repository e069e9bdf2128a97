"""One worker's part in in-place re-forms: its channel to the agent, its step guard, its round."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import time
from typing import Any

from elastic import env
from elastic.errors import RecoveryError
from elastic.node import channel
from elastic.node.channel import Assignment, Registration, Watcher
from elastic.worker import groups
from elastic.worker.exchange import Interrupted
from elastic.worker.guard import StepGuard

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 300.0  # how long a worker waits for the agent's next round before it gives up
ASK_AFTER_S = 2.0  # a failed step with no new round after this long asks the agent for one

READY_PREFIX = "elastic/ready"  # <round>/<rank>: that rank can form the round now
NOT_YET, READY, BROKEN = 0, 1, 2  # a rank's vote on moving to a newer round
_alone = False  # set by elastic.init_process_group: this process's group awaits Run's join


def offered() -> bool:
    """Whether this worker's agent offers in-place re-forms (an agent's channel, not off)."""
    if not env.flag(env.IN_PLACE):
        return False
    return bool(os.environ.get(env.CHANNEL))


def mark_alone() -> None:
    global _alone
    _alone = True


class Member:
    """The worker side of in-place re-forms (see :mod:`elastic.worker`)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.guard = StepGuard()
        self.watcher = Watcher(prefix, self.guard.abort, self.guard.in_flight_since)
        self.assignment: Assignment | None = None
        self._ready: tuple[int, Any] | None = None  # (round, its store client)
        # Known to the agent from now on: a newer round reaches us even mid-join.
        channel.register(prefix, Registration(os.getpid(), -1))

    @classmethod
    def from_env(cls) -> Member | None:
        """A member when the script formed its group with ``elastic.init_process_group``
        under an agent that offers in-place re-forms; else None (the restart path)."""
        if not (_alone and offered()):
            return None
        if not faulthandler.is_enabled():  # a crash of a long-lived worker leaves its stacks
            faulthandler.enable(all_threads=True)
        return cls(os.environ[env.CHANNEL])

    @property
    def leaving(self) -> bool:
        """Whether the agent said this node leaves the job (it got SIGTERM)."""
        return self.watcher.leaving

    @property
    def round(self) -> int:
        return self.assignment.round if self.assignment is not None else -1

    def newer_round_formed(self) -> bool:
        """Whether the agent formed a round newer than ours (its workers may not be ready)."""
        a = self.watcher.newest
        return a is not None and a.formed_after(self.round)

    def switch_vote(self) -> int:
        """This rank's vote on moving to a newer round at this step boundary (a join: the
        survivors train on in the old group until the joiner's process reaches ``Run``):
        :data:`READY` when every rank of it is ready, :data:`BROKEN` when this rank cannot
        reach its store (it must restart), else :data:`NOT_YET`."""
        a = self.watcher.newest
        if a is None or not a.formed_after(self.round):
            return NOT_YET
        try:
            store = self._ready_store(a)
        except Exception as exc:
            logger.warning("Cannot reach the store of round %d: %s", a.round, exc)
            return BROKEN
        keys = [f"{READY_PREFIX}/{a.round}/{r}" for r in range(a.world_size)]
        try:
            return READY if store.check(keys) else NOT_YET
        except Exception:  # its host is gone: a newer round replaces it
            return NOT_YET

    def _ready_store(self, a: Assignment) -> Any:
        if self._ready is None or self._ready[0] != a.round:
            store = groups.client(a.master_addr, a.master_port)
            store.set(f"{READY_PREFIX}/{a.round}/{a.rank}", "1")
            self._ready = (a.round, store)
        return self._ready[1]

    def join(
        self, timeout: float | None = None, failed: bool = False
    ) -> tuple[Assignment, float, float]:
        """Wait for a round newer than ours and form its group: ``(assignment, seconds
        waited, seconds forming)``.

        Raises:
            RecoveryError: no round came within ``timeout``, or its group could not form.
        """
        if timeout is None:  # as long as a collective of the group would wait
            timeout = min(JOIN_TIMEOUT_S, groups.timeout_s())
        started = time.perf_counter()
        deadline = time.monotonic() + timeout
        got = self._all_ready(self._wait(timeout, failed), deadline)
        waited = time.perf_counter() - started
        try:
            formed = groups.form(
                got.round,
                got.rank,
                got.world_size,
                got.master_addr,
                got.master_port,
                interrupt=lambda: self.give_up_on(got.round),
            )
        except RecoveryError:  # interrupted by a newer round, or this node leaves
            raise
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

    def give_up_on(self, round_: int) -> None:
        """Raise when a wait in the formation of round ``round_``'s groups is pointless: a
        newer round is formed (a rank of this one is gone, or more came), or this node
        leaves. Called while the formation's store waits (:mod:`.formstore`).

        Raises:
            Interrupted: a newer round is formed.
            RecoveryError: this node leaves the job.
        """
        newer = self._newer(round_)
        if newer is not None:
            raise Interrupted(
                f"Round {newer.round} formed while the groups of round {round_} were forming."
            )

    def _newer(self, round_: int) -> Assignment | None:
        """A formed round newer than ``round_``, else None.

        Raises:
            RecoveryError: this node leaves the job.
        """
        newer = self.watcher.newest
        if newer is not None and newer.formed_after(round_):
            return newer
        if self.leaving:
            raise RecoveryError("This node leaves the job.")
        return None

    def _all_ready(self, got: Assignment, deadline: float) -> Assignment:
        """Wait until every rank of ``got``'s round is ready to form it; a newer round (a
        rank of this one failed before it was ready, or left) replaces it.

        Raises:
            RecoveryError: the round's store cannot be reached, or the deadline passed.
        """
        while True:
            try:
                store = self._ready_store(got)
            except Exception as exc:
                raise RecoveryError(
                    f"The store of round {got.round} at {got.master_addr}:{got.master_port} "
                    f"cannot be reached ({exc}); the worker restarts and resumes from memory."
                ) from exc
            keys = [f"{READY_PREFIX}/{got.round}/{r}" for r in range(got.world_size)]
            newer = self._poll_ready(store, keys, got.round, deadline)
            if newer is None:
                return got
            logger.info(
                "Round %d was replaced by round %d before it formed.", got.round, newer.round
            )
            got = newer

    def _poll_ready(
        self, store: Any, keys: list[str], round_: int, deadline: float
    ) -> Assignment | None:
        """None once every key is set; a newer complete assignment if one comes first."""
        while True:
            try:
                if store is not None and store.check(keys):
                    return None
            except Exception as exc:  # its host is gone: only a newer round can come
                logger.info("The store of round %d went away (%s).", round_, exc)
                store = None
            newer = self._newer(round_)
            if newer is not None:
                return newer
            if time.monotonic() > deadline:
                raise RecoveryError(
                    f"Not every rank of round {round_} became ready in time; the worker "
                    "restarts and resumes from memory."
                )
            time.sleep(channel.POLL_S)

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
        if got is None and self.leaving:
            raise RecoveryError("This node leaves the job.")
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


__all__ = [
    "ASK_AFTER_S",
    "BROKEN",
    "JOIN_TIMEOUT_S",
    "NOT_YET",
    "READY",
    "Member",
    "mark_alone",
    "offered",
]
