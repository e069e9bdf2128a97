"""A worker stuck inside a step names itself, leaves its stacks, and lets the group go on.

In a synchronous group a rank stuck in its own code (a hung data loader, a dead NFS read, a
deadlock, ``time.sleep(3600)``) holds every peer in the step's first collective; nothing
fails, so nothing recovers. The one who knows is the stuck rank itself: its step has run
longer than the bound (:func:`elastic.worker.straggler.hang_bound`: a multiple of its
recent step time, at least a floor; option ``hang.enabled``, off by default:
:func:`~elastic.worker.straggler.hang_from_env` says why) while none of its collectives is in
flight (its peers, waiting for it, have theirs in flight: they are not the ones). A thread
of :class:`HangWatch` then

1. dumps every thread's Python stack (:mod:`faulthandler`) into the event log (event
   ``worker.stacks``) and names itself (event ``worker.hang``: rank, step, seconds, bound);
2. ends its process (exit :data:`elastic.node.reform.HUNG`): its peers' collectives fail at
   once; its agent leaves the round at once, so they re-form in place without it, then
   rejoins as a joiner and starts it again (a failure: it spends one of the job's
   restarts, so a hang that comes back every time ends the job), to take their state.

The ranks that did reach their collectives name the ones that did not, from what they
know: at the same bound, each waiting rank marks itself in the round's store
(``elastic/arrived/<round>/<step>/<rank>``; nothing is written in a healthy step), reads the
others' marks after :data:`ROLL_CALL_GRACE_S`, and the lowest of them names every rank
without a mark (event ``worker.hang.peers``: step, ranks, seconds). So a rank that cannot
name itself (stuck with the GIL held) is named too.

The lowest waiting rank also leaves a verdict where the named ranks' agents look
(``elastic/hung/<round>/<rank>`` in the round's store, the value the step): first
:data:`VERDICT_AFTER_S` into the roll call, for every rank without a mark by then (event
``worker.hang.suspects``), cleared at its end for a rank whose mark came later. An agent
whose worker is named *and* stopped (SIGSTOP: it cannot name itself, nor exit) ends it at
once and leaves the round, so the others go on without it (:mod:`elastic.agent.stuck`); a
verdict alone moves nothing (any member can write one). A mark is a random token whose
commitment (a hash) its rank wrote into its own record of the last step boundary
(:mod:`elastic.worker.boundary`), so no client of the store can plant another rank's mark
(a stuck rank never reveals its token); a mark once seen stays counted and a rank sets its
own again at every poll, so a deletion names nobody. In a round's first step no
commitments are known yet: any mark counts.

It runs on the in-place path only, where the step guard sees this rank's collectives (on
the restart path a peer waiting inside DDP's all-reduce would look stuck too). A worker
stuck with the GIL held (inside a C call that does not release it) cannot run the thread;
its agent's heartbeat or frozen-worker watch remains the way out.
"""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import logging
import os
import secrets
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

from elastic import events
from elastic.node import reform
from elastic.worker import straggler

logger = logging.getLogger(__name__)
POLL_S = 0.05
MAX_STACKS = 32_000  # characters of stacks kept in the event
ARRIVED_PREFIX = "elastic/arrived"  # <round>/<step>/<rank>: that rank waits in the step
ROLL_CALL_GRACE_S = 0.3  # the waiting ranks mark themselves within this of one another
HUNG_PREFIX = "elastic/hung"  # <round>/<rank>: the waiting ranks name that rank stuck
VERDICT_AFTER_S = POLL_S  # into the roll call (its 2nd poll): who has no mark is suspect
MARK_WAIT_S = 3 * POLL_S  # a stuck rank waits this long at most for the waiting ranks' marks

# The round's store, its number and its world size; None off the in-place path.
RoundStore = Callable[[], "tuple[Any, int, int] | None"]


def absent(world_size: int, present: Iterable[int]) -> list[int]:
    """The ranks of a world of ``world_size`` that are not ``present``, sorted."""
    return sorted(set(range(world_size)) - set(present))


def commitment(token: str) -> float:
    """The public half of a mark's ``token``: 48 bits of its SHA-256, exact in float64."""
    return float(int.from_bytes(hashlib.sha256(token.encode()).digest()[:6], "big"))


def new_token() -> str:
    return secrets.token_hex(16)


def verdict_key(round_: int, rank: int) -> str:
    """Where the waiting ranks of round ``round_`` name ``rank`` stuck (its agent looks)."""
    return f"{HUNG_PREFIX}/{round_}/{rank}"


def roll_call(
    store: Any,
    round_: int,
    step: int,
    rank: int,
    world_size: int,
    grace_s: float,
    token: str = "1",
    commits: tuple[float, ...] | None = None,
    suspect: Callable[[list[int]], None] | None = None,
) -> tuple[list[int], bool]:
    """Mark ``rank`` as waiting in ``step`` in the round's ``store`` (its ``token``), give
    the other waiting ranks ``grace_s`` to mark themselves, and return ``(the ranks without
    a mark, whether this rank is the lowest that has one)``: the lowest names them.

    With ``commits`` (every rank's :func:`commitment` of its token for this step, from its
    own record of the last step boundary) a mark counts only when its token matches its
    rank's commitment: no client of the store can plant another rank's mark. A mark once
    seen stays counted, and this rank sets its own again at every poll until the grace
    ends (also once it saw every mark): a deletion by another client changes nothing.

    ``suspect`` is called once, :data:`VERDICT_AFTER_S` in, with the ranks without a mark
    then, when this rank is the lowest with one so far (ranks that tripped a poll apart
    have marked by then: a rank named later is not waiting, or is slow to mark)."""
    prefix = f"{ARRIVED_PREFIX}/{round_}/{step}"
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    started = time.monotonic()
    deadline = started + grace_s
    present = {rank}
    while True:
        try:
            store.set(keys[rank], token)
            for r, key in enumerate(keys):
                if r not in present and store.check([key]) and _valid(store, key, r, commits):
                    present.add(r)
        except Exception as exc:  # the round's store closed (a new round): what was seen
            logger.info("The roll call of step %d ended early: %s", step, exc)
            deadline = 0.0
        now = time.monotonic()
        if suspect is not None and (now >= started + VERDICT_AFTER_S or now >= deadline):
            if min(present) == rank and len(present) < world_size:
                suspect(absent(world_size, present))
            suspect = None
        if now >= deadline:  # not before: a rank that saw every mark keeps
            # setting its own for the others, whose view a deleting client may still hide
            return absent(world_size, present), min(present) == rank
        time.sleep(POLL_S)


def _valid(store: Any, key: str, rank: int, commits: tuple[float, ...] | None) -> bool:
    if commits is None:
        return True
    value = store.get(key).decode(errors="replace")
    return rank < len(commits) and commitment(value) == commits[rank]


class HangWatch:
    """The watch thread of one worker (see the module).

    Args:
        guard: the step guard (``in_flight_since()``), or None: no watch.
        recent: this rank's recent step times (seconds).
        describe: ``(rank, step)`` now.
        exit: how the process ends (tests pass their own).
    """

    def __init__(
        self,
        guard: Any,
        recent: Callable[[], tuple[float, ...]],
        describe: Callable[[], tuple[int, int]],
        exit: Callable[[int], None] = os._exit,
        round_store: RoundStore | None = None,
    ) -> None:
        self.guard = guard
        self.round_store = round_store
        self._named: int | None = None  # the step whose absent ranks this rank looked for
        # this rank's mark token for the next step, and the round and step whose tokens
        # every rank committed to in the last step boundary's records (their commitments)
        self._next_token = new_token()
        self._token = ""
        self._commits: tuple[int, int, tuple[float, ...]] | None = None
        self.recent = recent
        self.describe = describe
        self.exit = exit
        self.limits = straggler.hang_from_env() if guard is not None else None
        self._step_began: float | None = None  # when the step (or the last one) began
        self._in_step = False  # False at the boundary
        self.agreeing = False  # set around the boundary's agreement (it waits for peers)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def pause(self) -> None:
        """The step reached its boundary: the agreement, a save or a re-form is not a step."""
        self._in_step = False

    def resume(self) -> None:
        """A step begins now."""
        if self.limits is None:
            return
        self._step_began, self._in_step = time.monotonic(), True
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="elastic-hang", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def commit(self) -> float:
        """The commitment to this rank's mark token for the next step, for its record of
        this step boundary (:mod:`elastic.worker.agreement`)."""
        self._next_token = new_token()
        return commitment(self._next_token)

    def committed(self, round_: int, step: int, commits: tuple[float, ...]) -> None:
        """The boundary's records were gathered: every rank's commitment for ``step``."""
        self._token, self._commits = self._next_token, (round_, step, commits)

    def bound(self) -> float:
        assert self.limits is not None
        return straggler.hang_bound(self.recent(), *self.limits)

    def stuck_for(self, now: float) -> float | None:
        """Seconds this rank's step has run past the bound while none of its collectives
        was in flight; None when it is not stuck."""
        began = self._step_began
        if began is None or not self._in_step or self.guard.in_flight_since() is not None:
            return None
        return now - began if now - began > self.bound() else None

    def waiting_for(self, now: float) -> float | None:
        """Seconds since this rank's step began, past the bound, while it waits in a
        collective of the step or in the step's agreement (it arrived; a peer has not);
        None otherwise (a save or a re-form is no such wait)."""
        began = self._step_began
        waiting = self._in_step or self.agreeing
        if began is None or not waiting or self.guard.in_flight_since() is None:
            return None
        return now - began if now - began > self.bound() else None

    def step_in_question(self) -> tuple[int, int]:
        """``(rank, the step it runs or agrees on)``: inside a step, the one after the
        completed ``run.step``; in the agreement, the step just completed."""
        rank, completed = self.describe()
        return rank, completed + 1 if self._in_step else completed

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                now = time.monotonic()
                seconds = self.stuck_for(now)
                waited = None if seconds is not None else self.waiting_for(now)
                if waited is not None:
                    self.name_absent(waited)
            except Exception as exc:  # never let the watch end the worker by mistake
                logger.warning("The hang watch failed (%s); it stops.", exc)
                return
            if seconds is not None:
                self.give_up(seconds)
                return

    def name_absent(self, seconds: float) -> None:
        """Once per step: the roll call of the waiting ranks; the lowest of them names the
        ranks that never reached the step's collectives (event ``worker.hang.peers``)."""
        rank, step = self.step_in_question()
        found = self.round_store() if self.round_store is not None else None
        if found is None or self._named == step:
            return
        self._named = step
        store, round_, world_size = found
        known = self._commits
        commits = known[2] if known is not None and known[:2] == (round_, step) else None
        token = self._token if commits is not None else new_token()
        store.set_timeout(timedelta(seconds=1))  # a mark deleted between check and get
        suspects: list[int] = []

        def suspect(ranks: list[int]) -> None:
            suspects.extend(ranks)
            self.publish(store, round_, step, ranks, seconds)

        missing, lowest = roll_call(
            store, round_, step, rank, world_size, ROLL_CALL_GRACE_S, token, commits, suspect
        )
        cleared = [r for r in suspects if r not in missing]
        if cleared:  # they marked late: not stuck (their agents would not act: not stopped)
            with contextlib.suppress(Exception):
                for r in cleared:
                    store.delete_key(verdict_key(round_, r))
        if not missing or not lowest:
            return
        logger.error(
            "Step %d has waited %.1f s for rank(s) %s, which never reached its collectives "
            "(bound %.1f s).",
            step,
            seconds,
            missing,
            self.bound(),
        )
        events.emit(
            "worker.hang.peers",
            rank=rank,
            step=step,
            ranks=missing,
            seconds=round(seconds, 3),
            round=round_,
        )

    def publish(self, store: Any, round_: int, step: int, ranks: list[int], seconds: float) -> None:
        """Name ``ranks`` stuck in ``step`` where their agents look (:func:`verdict_key`)."""
        try:
            for r in ranks:
                store.set(verdict_key(round_, r), str(step))
        except Exception as exc:  # the round's store closed: a new round goes on anyway
            logger.info("The verdict on step %d was not published: %s", step, exc)
            return
        began = self._step_began
        waited = time.monotonic() - began if began is not None else seconds
        events.emit(
            "worker.hang.suspects",
            step=step,
            ranks=ranks,
            round=round_,
            seconds=round(waited, 3),
            bound_s=round(self.bound(), 3),
        )

    def give_up(self, seconds: float) -> None:
        """Record the stacks and the hang, then end this process."""
        rank, step = self.step_in_question()
        bound = self.bound()
        logger.error(
            "Rank %d has been inside step %d for %.1f s (bound %.1f s) and never reached its "
            "collectives: it is stuck. Its stacks go to the event log; it exits so that the "
            "group goes on without it.",
            rank,
            step,
            seconds,
            bound,
        )
        stacks = dump_stacks()
        self.await_roll_call(rank, step)
        events.emit("worker.stacks", rank=rank, step=step, pid=os.getpid(), stacks=stacks)
        events.emit(
            "worker.hang",
            rank=rank,
            step=step,
            pid=os.getpid(),
            seconds=round(seconds, 3),
            bound_s=round(bound, 3),
        )
        self.exit(reform.HUNG)

    def await_roll_call(self, rank: int, step: int) -> None:
        """Before this stuck rank ends (which ends its peers' wait), give the waiting ranks
        up to :data:`MARK_WAIT_S` to begin their roll call (their marks appear), so that
        they name it too: their watches tripped at the same bound, a poll apart."""
        found = self.round_store() if self.round_store is not None else None
        if found is None:
            return
        store, round_, world_size = found
        keys = [f"{ARRIVED_PREFIX}/{round_}/{step}/{r}" for r in range(world_size) if r != rank]
        deadline = time.monotonic() + MARK_WAIT_S
        while time.monotonic() < deadline:
            try:
                if store.check(keys):
                    return
            except Exception:  # the store is gone: nobody can call the roll
                return
            time.sleep(POLL_S / 5)


def dump_stacks() -> str:
    """Every thread's Python stack, as :func:`faulthandler.dump_traceback` writes it."""
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        text = f.read()
    return text[-MAX_STACKS:]


__all__ = [
    "ARRIVED_PREFIX",
    "HUNG_PREFIX",
    "VERDICT_AFTER_S",
    "HangWatch",
    "absent",
    "commitment",
    "dump_stacks",
    "new_token",
    "roll_call",
    "verdict_key",
]
