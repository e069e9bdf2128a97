"""A worker stuck inside a step names itself, leaves its stacks, and lets the group go on.

In a synchronous group a rank stuck in its own code (a hung data loader, a dead NFS read, a
deadlock, ``time.sleep(3600)``) holds every peer in the step's first collective; nothing
fails, so nothing recovers. The one who knows is the stuck rank itself: its step has run
longer than the bound (:func:`elastic.recovery.straggler.hang_bound`: a multiple of its
recent step time, at least a floor; ``$ELASTIC_HANG``, off by default:
:func:`~elastic.recovery.straggler.hang_from_env` says why) while none of its collectives is in
flight (its peers, waiting for it, have theirs in flight: they are not the ones). A thread
of :class:`HangWatch` then

1. dumps every thread's Python stack (:mod:`faulthandler`) into the event log (event
   ``worker.stacks``) and names itself (event ``worker.hang``: rank, step, seconds, bound);
2. ends its process (exit :data:`elastic.reform.FAILED`), as the agent ends a frozen
   worker: its peers' collectives fail at once, they re-form in place, and its agent
   starts it again (a failure: it spends one of the job's restarts, so a hang that comes
   back every time ends the job), to rejoin from their state.

It runs on the in-place path only, where the step guard sees this rank's collectives (on
the restart path a peer waiting inside DDP's all-reduce would look stuck too). A worker
stuck with the GIL held (inside a C call that does not release it) cannot run the thread;
its agent's heartbeat or frozen-worker watch remains the way out.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from elastic import events, reform
from elastic.recovery import straggler

logger = logging.getLogger(__name__)
POLL_S = 0.05
MAX_STACKS = 32_000  # characters of stacks kept in the event


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
    ) -> None:
        self.guard = guard
        self.recent = recent
        self.describe = describe
        self.exit = exit
        self.limits = straggler.hang_from_env() if guard is not None else None
        self._step_began: float | None = None  # None: between steps (at the boundary)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def pause(self) -> None:
        """The step reached its boundary: the agreement, a save or a re-form is not a step."""
        self._step_began = None

    def resume(self) -> None:
        """A step begins now."""
        if self.limits is None:
            return
        self._step_began = time.monotonic()
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="elastic-hang", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def bound(self) -> float:
        assert self.limits is not None
        return straggler.hang_bound(self.recent(), *self.limits)

    def stuck_for(self, now: float) -> float | None:
        """Seconds this rank's step has run past the bound while none of its collectives
        was in flight; None when it is not stuck."""
        began = self._step_began
        if began is None or self.guard.in_flight_since() is not None:
            return None
        return now - began if now - began > self.bound() else None

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                seconds = self.stuck_for(time.monotonic())
            except Exception as exc:  # never let the watch end the worker by mistake
                logger.warning("The hang watch failed (%s); it stops.", exc)
                return
            if seconds is not None:
                self.give_up(seconds)
                return

    def give_up(self, seconds: float) -> None:
        """Record the stacks and the hang, then end this process."""
        rank, step = self.describe()
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
        events.emit("worker.stacks", rank=rank, step=step, pid=os.getpid(), stacks=stacks)
        events.emit(
            "worker.hang",
            rank=rank,
            step=step,
            pid=os.getpid(),
            seconds=round(seconds, 3),
            bound_s=round(bound, 3),
        )
        self.exit(reform.FAILED)


def dump_stacks() -> str:
    """Every thread's Python stack, as :func:`faulthandler.dump_traceback` writes it."""
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        text = f.read()
    return text[-MAX_STACKS:]


__all__ = ["HangWatch", "dump_stacks"]
