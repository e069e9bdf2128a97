"""Every rank's compute time and collective wait, every step, on the step's own agreement.

:class:`StepTimes` is the worker's side of :mod:`elastic.worker.straggler`: before the
step's agreement it measures this rank's step (:meth:`StepTimes.slots`: its wall time since
the previous agreement began, the part some collective of it was in flight, the *wait*, and
the rest, its *compute*), which rides in this rank's own record of the step's agreement
(:mod:`elastic.worker.boundary`: no rank can write another's, and a figure that is not
finite or out of range is refused: no figure); after it, every rank applies the pure rule
to the same figures (:meth:`StepTimes.observe`). Rank 0
records what the rule detects (event ``straggler.detected``) and each step's slowest ranks
(on ``train.step``); when the policy drops a node, that node's lowest rank asks its agent
for probation (:mod:`elastic.worker.probation`: the agent leaves the round in place like a
planned leave, the group re-forms without it and no completed step is lost, then the node
checks its health and rejoins), or, with probation off, to leave the job (SIGTERM).

The wait is known on the in-place path, where the step guard sees every collective
(:meth:`elastic.worker.guard.StepGuard.waited`); on the restart path only the agreement's
own all-gather is timed (a wait inside DDP's backward counts as compute there).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import statistics
import time
import zlib
from collections import deque
from typing import TYPE_CHECKING, Any

from elastic import env, events
from elastic.worker import probation, straggler
from elastic.worker.boundary import Tally

if TYPE_CHECKING:
    from elastic.node.options import StragglerOptions
    from elastic.worker.guard import StepGuard
    from elastic.worker.parts import Place
    from elastic.worker.state import TrainState

logger = logging.getLogger(__name__)
REPORT_ALL_UP_TO = 64  # train.step lists every rank's figures up to this world size
SLOWEST = 3  # and always the slowest ranks
RECENT = 20  # step times kept for the hang bound


def node_id() -> int:
    """A number for this node that every rank of it shares (its agent: host and pid; 32
    bits, exact in the float64 vector)."""
    owner = os.environ.get(env.SNAPSHOT_OWNER) or str(os.getppid())
    return zlib.crc32(f"{socket.gethostname()}:{owner}".encode())


class StepTimes:
    """This rank's step figures and the group's straggler rule (see the module): the step
    of ``train``, the rank and re-forms of ``place``, the waits the group's ``guard`` saw
    (in place), and ``options`` (Run's ``straggler=``; None: ``$ELASTIC_STRAGGLER_*``)."""

    def __init__(
        self,
        train: TrainState,
        place: Place,
        guard: StepGuard | None = None,
        options: StragglerOptions | None = None,
    ) -> None:
        self.train, self.place, self.guard = train, place, guard
        self.options = (
            straggler.options_from_env() if options is None else straggler.from_model(options)
        )
        self.state = straggler.State()
        self.node = node_id()
        self.recent: deque[float] = deque(maxlen=RECENT)  # this rank's step wall times
        self.last: straggler.Decision | None = None
        self.view: straggler.View | None = None
        self._mark: tuple[float, float, int] | None = None  # (time, waited, reforms)
        self._agreed_s = 0.0  # restart path: the agreements' all-gather, summed
        self._left = False

    def _waited(self) -> float:
        guard = self.guard
        return float(guard.waited()) if guard is not None else self._agreed_s

    def slots(self) -> dict[str, float]:
        """This rank's figures for the step just run; zeros when it was not measured (the
        first step, or one that a re-form interrupted)."""
        now, waited, reforms = time.perf_counter(), self._waited(), self.place.reforms
        mark, self._mark = self._mark, (now, waited, reforms)
        out = {"compute_s": 0.0, "wait_s": 0.0, "node": float(self.node), "since_drop_s": 0.0}
        if self.state.last_drop is not None:  # the window, for a joiner to read too
            out["since_drop_s"] = max(time.monotonic() - self.state.last_drop, 1e-6)
        if mark is None or mark[2] != reforms:
            return out
        total, wait = now - mark[0], max(0.0, waited - mark[1])
        self.recent.append(total)
        out["compute_s"], out["wait_s"] = max(total - wait, 1e-6), wait
        return out

    def agreed(self, seconds: float) -> None:
        """The agreement's all-gather took ``seconds`` (the restart path's wait)."""
        self._agreed_s += seconds

    def observe(self, tally: Tally) -> bool:
        """Apply the rule to the group's figures (every rank alike); rank 0 records. True
        when the rule drops a node at this step (every rank's same answer: the boundary
        re-forms, :func:`elastic.worker.boundary.decide`)."""
        if not tally.slots:
            return False
        view = straggler.View(
            self.train.step,
            tuple(s[0] for s in tally.slots),
            tuple(s[1] for s in tally.slots),
            tuple(round(s[2]) for s in tally.slots),
            tuple(s[3] for s in tally.slots),
        )
        decision = straggler.decide(view, self.state, time.monotonic(), self.options)
        self.state, self.last, self.view = decision.state, decision, view
        if self.place.rank == 0:
            for slow in decision.detected:
                logger.warning("A straggler at step %d: %s.", view.step, decision.reason)
                events.emit(
                    "straggler.detected",
                    step=view.step,
                    node=slow.node,
                    ranks=list(slow.ranks),
                    rank=slow.ranks[0],
                    ratio=slow.ratio,
                    steps=slow.steps,
                    slow_s=slow.seconds,
                    threshold=self.options.ratio,
                    policy=self.options.drop,
                    median_s=round(statistics.median(view.compute), 6),
                )
            if decision.drop is not None:
                events.emit(
                    "straggler.dropped",
                    step=view.step,
                    node=decision.drop.node,
                    ranks=list(decision.drop.ranks),
                    ratio=decision.drop.ratio,
                    reason=decision.reason,
                    median_s=round(statistics.median(view.compute), 6),  # a probe's target
                )
        drop = decision.drop
        mine = drop is not None and self.place.rank == min(drop.ranks) and not self._left
        if drop is not None and mine and self._ours(drop):
            median = statistics.median(view.compute)
            self._leave(probation.Request(view.step, drop.ratio, median, decision.reason))
        return drop is not None

    def _ours(self, drop: straggler.Slow) -> bool:
        """Whether the dropped node (this rank's) holds no rank but its own: a rank
        of another node that claims this node's id (its own record: it cannot write
        another's) would make it count as this node's slowest; then nobody leaves."""
        local = os.environ.get(env.LOCAL_WORLD_SIZE, "")
        if not local.isdigit() or len(drop.ranks) <= int(local):
            return True
        logger.warning(
            "Node %d was dropped with ranks %s, more than this node's %s: a rank claims a "
            "node that is not its own; this node stays.",
            drop.node,
            list(drop.ranks),
            local,
        )
        return False

    def _leave(self, request: probation.Request) -> None:
        """This node was dropped: ask its agent for probation (a request in its node-local
        directory: it leaves in place, checks its health and rejoins), or, with
        ``$ELASTIC_PROBATION=off`` or when the request cannot be written, to leave the job
        (SIGTERM, a planned leave)."""
        owner = os.environ.get(env.SNAPSHOT_OWNER, "")
        reason = request.reason
        if not owner.isdigit():
            logger.warning("This node is slow (%s) but runs without an agent to leave.", reason)
            return
        self._left = True
        if probation.options_from_env().enabled:
            try:
                probation.write_request(int(owner), request)
                logger.warning("This node is slow (%s); its agent puts it on probation.", reason)
                return
            except OSError as exc:
                logger.warning("Could not ask the agent for probation (%s); it leaves.", exc)
        logger.warning("This node is slow (%s); its agent leaves the job.", reason)
        os.kill(int(owner), signal.SIGTERM)

    def fields(self) -> dict[str, Any]:
        """For rank 0's ``train.step``: the slowest ranks and, in a small world, every
        rank's figures (empty when the step was not measured)."""
        decision, view = self.last, self.view
        if decision is None or view is None or not decision.ratios or view.step != self.train.step:
            return {}
        order = sorted(range(len(decision.ratios)), key=lambda r: -decision.ratios[r])
        out: dict[str, Any] = {
            "slowest": [[r, round(decision.ratios[r], 3)] for r in order[:SLOWEST]],
        }
        if len(view.compute) <= REPORT_ALL_UP_TO:
            out["compute_s"] = [round(t, 5) for t in view.compute]
            out["wait_s"] = [round(t, 5) for t in view.wait]
        return out


__all__ = ["StepTimes", "node_id"]
