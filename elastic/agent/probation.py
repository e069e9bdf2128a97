"""The agent's side of probation (the rule: :mod:`elastic.worker.probation`).

When the straggler policy drops this node (its lowest rank leaves a request in the agent's
node-local directory), the agent does not exit. :meth:`Probation.sit_out`:

1. leaves the round in place exactly as a planned leave does (the rendezvous key is deleted,
   the local workers are told the node leaves: they drop the step in flight and exit 0, the
   others re-form without this node and redo nothing), and reaps the workers;
2. sits out, running the health check when the rule says (event ``probation.check``): a timed
   run of a fixed workload on this node alone, no collective (:func:`builtin_workload`, a
   small MLP's forward and backward on the CPU, in the agent's process), or the command in
   ``$ELASTIC_PROBATION_PROBE`` (its last line of output, if a number, is the seconds its
   work took; else its wall time; a non-zero exit or a run past :data:`PROBE_TIMEOUT_S` fails
   the check), compared with the same probe's healthy time (its *baseline*, below);
3. rejoins once a check passes (event ``node.rejoin``): the agent runs the rendezvous again
   as a joiner and starts fresh workers, which take the group's state from a peer; or, after
   the rule's bound of failed checks, leaves the job for good (event ``probation.gave_up``,
   exit 0).

A worker stuck inside a step that ended itself (exit 76) makes its node take the same path,
a probation with no health check (:func:`sit_out_stuck`): it leaves its round at once (the
local workers are stopped, not told), so that the others go on without it, and rejoins
:data:`STUCK_REJOIN_S` later. Both go through :func:`leave_then_rejoin`, and both answer
with a :class:`SatOut`: the agent rejoined, found the job finished, or leaves the job.

The baseline is timed while the node trains steadily (:meth:`Probation.observe`, each
healthy tick; the rule: :func:`elastic.worker.probation.baseline_due`), in a thread so that a
probe never holds up the agent's tick (event ``probation.baseline`` per probe). It includes the
load of the node's own training, which a check (its workers gone) does not carry.

A stop signal during probation ends the agent as a planned leave does (exit 0); a job that
finishes meanwhile (its rendezvous closed) ends it with 0 too.
"""

from __future__ import annotations

import enum
import logging
import math
import os
import shlex
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.elastic.agent.server.api import WorkerGroup, WorkerState
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

from elastic import events
from elastic.agent.inplace_host import InPlaceHost
from elastic.node import nodelocal, procs
from elastic.rendezvous.contract import MembershipHandler
from elastic.worker import probation, straggler
from elastic.worker.probation import Action, Baseline, History, Request

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 60.0  # a probe command that runs longer fails its check
WORKERS_EXIT_S = 30.0  # the local workers' time to exit after the leave, then they are killed
POLL_S = 0.5  # how often a waiting probation looks for a closed job (one etcd read)
# A node whose stuck worker ended itself rejoins this long after it left: the others' round
# without it forms first (a lost node's round forms in 0.1-0.3 s), so the rejoin is a join.
STUCK_REJOIN_S = 1.0


class Ending(enum.Enum):
    """How a sit-out ended."""

    REJOINED = "rejoined"  # the node is back in the job, fresh workers started
    FINISHED = "finished"  # the job finished meanwhile (its rendezvous closed): exit 0
    LEFT = "left"  # the node leaves the job for good (exit 0; the others go on)


@dataclass(frozen=True)
class SatOut:
    """A sit-out's answer, and why (a sentence for the log)."""

    ending: Ending
    reason: str


_REJOINED = SatOut(Ending.REJOINED, "the node rejoined the job")
_FINISHED = SatOut(Ending.FINISHED, "the job finished before this node could rejoin it")


def leave_then_rejoin(
    worker_group: WorkerGroup,
    host: InPlaceHost,
    handler: MembershipHandler,
    stop: Callable[[WorkerGroup], None],
    rejoin: Callable[[WorkerGroup], None],
    sit: Callable[[], SatOut | None],
    *,
    tell_workers: bool,
) -> SatOut:
    """The one "leave, then rejoin" path. Leave the round: in place as a planned leave does
    (``tell_workers``: the local workers are told the node leaves, exit, and are reaped), or
    at once (the rendezvous key is deleted and the local workers stopped: one of them is
    stuck); then ``sit`` (None: rejoin now; else its answer ends the sit-out); then rejoin
    as a joiner (``rejoin``: torch's rendezvous and a fresh start of the workers)."""
    if tell_workers:
        host.leave(worker_group)
        _reap(worker_group, stop)
    else:
        try:
            handler.leave()
        except Exception as exc:  # the others drop us at heartbeat expiry instead
            logger.warning("Could not leave the rendezvous: %s", exc)
        stop(worker_group)
    sat = sit()
    if sat is not None:
        return sat
    host.left = False
    try:
        rejoin(worker_group)
    except RendezvousClosedError:
        logger.warning("The job finished before this node could rejoin it; it exits.")
        return _FINISHED
    return _REJOINED


def sit_out_stuck(
    worker_group: WorkerGroup,
    host: InPlaceHost,
    handler: MembershipHandler,
    stop: Callable[[WorkerGroup], None],
    rejoin: Callable[[WorkerGroup], None],
    sleep: Callable[[float], None] = time.sleep,
    why: str = "a worker was stuck inside a step and ended itself",
) -> SatOut:
    """A worker of ours was stuck inside a step (``why``: it ended itself, or it was named
    stuck and stopped and its agent ended it): a probation with no health check. This node
    leaves its round at once, as a frozen node is dropped, so that the others go on without
    it (they need not wait for our new worker), sits out :data:`STUCK_REJOIN_S` (the
    others' round without it forms first), then rejoins as a joiner, which they admit at a
    step boundary."""
    logger.warning(
        "%s; this node leaves its round so that the others go on, and rejoins in %g s.",
        why[:1].upper() + why[1:],
        STUCK_REJOIN_S,
    )

    def sit() -> None:
        sleep(STUCK_REJOIN_S)

    return leave_then_rejoin(worker_group, host, handler, stop, rejoin, sit, tell_workers=False)


def _reap(worker_group: WorkerGroup, stop: Callable[[WorkerGroup], None]) -> None:
    """Wait for the local workers to exit (they were told the node leaves), then stop
    what is left (after :data:`WORKERS_EXIT_S`) and reap them."""
    deadline = time.monotonic() + WORKERS_EXIT_S
    pids = [w.id for w in worker_group.workers if isinstance(w.id, int)]
    while any(procs.alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)  # real time: the workers' own exit
    stop(worker_group)
    worker_group.state = WorkerState.STOPPED


def builtin_workload(iterations: int = 20, repeats: int = 3) -> float:
    """Seconds for ``iterations`` forward and backward passes of a small MLP on the CPU
    (the median of ``repeats`` timings): this node's compute, with no collective."""
    import torch

    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)
    )
    x = torch.randn(64, 256, generator=gen)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(iterations):
            model.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def run_command(command: str, timeout_s: float = PROBE_TIMEOUT_S) -> float:
    """Seconds the probe command's work took (its last line of output if a number, else its
    wall time); ``inf`` when it failed, could not start or ran past ``timeout_s``."""
    started = time.perf_counter()
    try:
        done = subprocess.run(
            shlex.split(command), capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        logger.warning("The probation probe %r did not complete: %s", command, exc)
        return math.inf
    wall = time.perf_counter() - started
    if done.returncode != 0:
        logger.warning(
            "The probation probe %r exited %d: %s",
            command,
            done.returncode,
            done.stderr.strip()[-500:],
        )
        return math.inf
    lines = done.stdout.strip().splitlines()
    try:
        return float(lines[-1]) if lines else wall
    except ValueError:
        return wall


def probe_from_env(environ: Mapping[str, str] | None = None) -> Callable[[], float]:
    """The health check: ``$ELASTIC_PROBATION_PROBE``'s command, else the built-in one."""
    command = (os.environ if environ is None else environ).get(probation.PROBE_ENV, "").strip()
    if command:
        return lambda: run_command(command)
    return builtin_workload


def in_thread(work: Callable[[], None]) -> None:
    """Run ``work`` in a daemon thread (a baseline probe, off the agent's tick)."""
    threading.Thread(target=work, name="probation-baseline", daemon=True).start()


class Probation:
    """One agent's probations: the baseline timed while training is steady
    (:meth:`observe`), then :meth:`sit_out` each time its node is dropped."""

    def __init__(
        self,
        options: probation.Options,
        probe: Callable[[], float],
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        spawn: Callable[[Callable[[], None]], None] = in_thread,
    ) -> None:
        self.options = options
        self.probe = probe
        self.clock, self.sleep, self.spawn = clock, sleep, spawn
        self.baseline = Baseline()
        self.baseline_s: float | None = None  # the baseline's seconds (None: none yet)
        self.count = 0  # probations so far in this job
        self.finished = False  # the job finished while this node sat out
        self._sampling = False  # a baseline probe runs (its thread)
        self._sampled: list[tuple[int, int, float]] = []  # (generation, round, seconds)
        self._generation = 0  # a sit-out discards the probe in flight

    @classmethod
    def from_env(cls) -> Probation | None:
        """With the straggler policy on and probation not off: one (``$ELASTIC_PROBATION``,
        ``$ELASTIC_PROBATION_PROBE``); else None. Its baseline is timed later, while the
        node trains steadily (:meth:`observe`)."""
        options = probation.options_from_env()
        if not (straggler.options_from_env().drop and options.enabled):
            return None
        return cls(options, probe_from_env())

    # -- the baseline, while the node trains --------------------------------------------

    def observe(self, running: int | None, run_id: str = "") -> None:
        """One healthy tick: ``running`` is the round this node's workers run in place
        (None: not now). Keep a baseline probe that finished in the same round, then start
        the next when :func:`elastic.worker.probation.baseline_due` says (``spawn``: in a
        thread, so that a probe never holds up the tick)."""
        self._collect(running, run_id)
        if self._sampling or self.baseline.done:
            return
        decision = probation.baseline_due(self.baseline, running, self.clock())
        self.baseline = decision.baseline
        if not decision.probe or running is None:
            return
        logger.info("Probation baseline: %s.", decision.reason)
        self._sampling = True
        generation, round_ = self._generation, running

        def sample() -> None:
            try:
                seconds = self.probe()
            except Exception as exc:  # a probe of the user's: never ends the agent
                logger.warning("The probation probe failed while timing its baseline: %s", exc)
                seconds = math.inf
            self._sampled.append((generation, round_, seconds))
            self._sampling = False

        self.spawn(sample)

    def _collect(self, running: int | None, run_id: str) -> None:
        while self._sampled:
            self._keep(*self._sampled.pop(0), running, run_id)

    def _keep(
        self, generation: int, round_: int, seconds: float, running: int | None, run_id: str
    ) -> None:
        if generation != self._generation or round_ != running:
            logger.info("A baseline probe spanned a re-form or a drop; it is not kept.")
            return
        self.baseline = self.baseline.with_sample(seconds)
        self.baseline_s = self.baseline.seconds
        logger.info(
            "Probation baseline probe %d: %s s (the baseline: %s s).",
            len(self.baseline.samples),
            _rounded(seconds),
            _rounded(self.baseline_s),
        )
        events.emit(
            "probation.baseline",
            run_id=run_id,
            round=round_,
            seconds=_rounded(seconds),
            samples=len(self.baseline.samples),
            baseline_s=_rounded(self.baseline_s),
        )

    # -- one probation -------------------------------------------------------------------

    def sit_out(
        self,
        request: Request,
        worker_group: WorkerGroup,
        host: InPlaceHost,
        handler: MembershipHandler,
        stop: Callable[[WorkerGroup], None],
        rejoin: Callable[[WorkerGroup], None],
    ) -> SatOut:
        """Leave in place, check until the rule says, then rejoin (:attr:`Ending.REJOINED`),
        find the job finished (:attr:`Ending.FINISHED`, :attr:`finished`) or leave the job
        for good (:attr:`Ending.LEFT`, the rule's bound: the agent ends as a planned leave
        does, exit 0)."""
        self.count += 1
        self._generation += 1  # a baseline probe in flight ran on a slow node: not kept
        run_id = handler.get_run_id()
        history = History(self.clock(), self.baseline_s, self.count)
        first = probation.decide(history, None, self.clock(), self.options)
        if first.action is Action.LEAVE:
            return self._give_up(run_id, first.reason, history)
        logger.warning(
            "This node was dropped as a straggler (%s); it leaves the round and sits out on "
            "probation (%d), its first health check in %g s.",
            request.reason,
            self.count,
            self.options.first_s,
        )
        events.emit(
            "node.probation",
            run_id=run_id,
            step=request.step,
            ratio=request.ratio,
            median_s=round(request.median_s, 6),
            reason=request.reason,
            baseline_s=_rounded(self.baseline_s),
            probation=self.count,
            next_check_in=self.options.first_s,
        )
        state: dict[str, Any] = {"history": history, "due": first.next_check_at, "started": 0.0}

        def sit() -> SatOut | None:
            return self._check_until_pass(state, handler, run_id)

        def timed_rejoin(group: WorkerGroup) -> None:
            state["started"] = self.clock()
            rejoin(group)

        sat = leave_then_rejoin(
            worker_group, host, handler, stop, timed_rejoin, sit, tell_workers=True
        )
        if sat.ending is Ending.FINISHED:
            self.finished = True
        elif sat.ending is Ending.REJOINED:
            self._rejoined(worker_group, host, run_id, state)
        return sat

    def _check_until_pass(
        self, state: dict[str, Any], handler: MembershipHandler, run_id: str
    ) -> SatOut | None:
        """Sit out, running the health check when the rule says: None once a check passed
        (rejoin), else how the probation ends (the job finished; the node gives up)."""
        history: History = state["history"]
        while True:
            if not self._wait_until(state["due"], handler):
                return _FINISHED
            seconds = self.probe()
            decision = probation.decide(history, seconds, self.clock(), self.options)
            history = state["history"] = decision.history
            check = history.checks[-1]
            next_in = None if decision.next_check_at is None else decision.next_check_at - check.at
            logger.warning("Probation health check: %s.", decision.reason)
            events.emit(
                "probation.check",
                run_id=run_id,
                seconds=_rounded(seconds),
                baseline_s=_rounded(self.baseline_s),
                passed=check.passed,
                failures=history.failures,
                next_check_in=round(next_in, 3) if next_in is not None else None,
                reason=decision.reason,
            )
            if decision.action is Action.LEAVE:
                return self._give_up(run_id, decision.reason, history)
            if decision.action is Action.REJOIN:
                return None
            state["due"] = decision.next_check_at

    def _wait_until(self, due: float | None, handler: MembershipHandler) -> bool:
        """Sleep until ``due``; False when the job finished meanwhile (its rendezvous closed)."""
        while True:
            if self._closed(handler):
                logger.warning("The job finished while this node was on probation; it exits.")
                self.finished = True
                return False
            left = (due if due is not None else self.clock()) - self.clock()
            if left <= 0:
                return True
            self.sleep(min(left, POLL_S))

    @staticmethod
    def _closed(handler: MembershipHandler) -> bool:
        try:
            return bool(handler.is_closed())
        except Exception:  # etcd does not answer: nothing says the job finished
            return False

    def _rejoined(
        self, worker_group: WorkerGroup, host: InPlaceHost, run_id: str, state: dict[str, Any]
    ) -> None:
        history: History = state["history"]
        world = worker_group.workers[0].world_size if worker_group.workers else None
        logger.warning(
            "This node passed its health check and rejoined the job: round %d, world size %s.",
            host.joined_round(),
            world,
        )
        events.emit(
            "node.rejoin",
            run_id=run_id,
            round=host.joined_round(),
            world_size=world,
            group_world_size=worker_group.group_world_size,
            probation_s=round(state["started"] - history.entered, 3),
            rendezvous_s=round(self.clock() - state["started"], 3),
            checks=len(history.checks),
        )

    def _give_up(self, run_id: str, reason: str, history: History) -> SatOut:
        logger.warning("Probation %d ends, the node exits 0: %s.", self.count, reason)
        events.emit(
            "probation.gave_up",
            run_id=run_id,
            reason=reason,
            probation=self.count,
            checks=len(history.checks),
        )
        return SatOut(Ending.LEFT, f"the node left the job on probation: {reason}")


def _rounded(seconds: float | None) -> float | None:
    return round(seconds, 4) if seconds is not None and math.isfinite(seconds) else None


def request_path(owner: int) -> Path | None:
    """Where a worker of agent ``owner`` leaves its request (None without the directory)."""
    folder = nodelocal.find(owner)
    return None if folder is None else folder / probation.REQUEST


__all__ = [
    "STUCK_REJOIN_S",
    "Ending",
    "Probation",
    "SatOut",
    "builtin_workload",
    "in_thread",
    "leave_then_rejoin",
    "probe_from_env",
    "request_path",
    "run_command",
    "sit_out_stuck",
]
