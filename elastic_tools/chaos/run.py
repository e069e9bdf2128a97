"""One chaos run: a seeded random schedule of faults against a local elastic job, then the
checks that no state was lost or corrupted.

A job of 3-4 ``elastic-agent`` nodes trains our CNN worker (``configs/tiny.yaml`` at a small
learning rate, fenced and signed checkpoints every few steps) on a 3-member etcd cluster
(one embedded etcd when a cluster cannot start; :mod:`elastic_tools.chaos.job`). While it trains,
:func:`run_chaos` injects faults drawn from :data:`~elastic_tools.chaos.plan.KINDS` by a seeded
generator (:mod:`elastic_tools.chaos.plan`, :mod:`elastic_tools.chaos.injectors`), waits for each to
recover, and keeps two observers running (:mod:`elastic_tools.chaos.observers`): one polls the
checkpoint storage and etcd's commit records, the other is the event log. After the job
ends it checks the invariants (:mod:`elastic_tools.chaos.invariants`) and writes ``report.json``
into the run directory (:mod:`elastic_tools.chaos.report`).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Mapping, Sequence
from typing import Any

from elastic_tools.chaos.compound import CompoundInjector, compound_schedule
from elastic_tools.chaos.fault import Fault
from elastic_tools.chaos.injectors import Injector
from elastic_tools.chaos.invariants import check_invariants
from elastic_tools.chaos.job import ChaosJob
from elastic_tools.chaos.observers import pause, wait_stable
from elastic_tools.chaos.plan import ChaosOptions, schedule
from elastic_tools.chaos.report import build_report, write_observations
from elastic_tools.chaos.script import ScriptReference
from elastic_tools.chaos.script_checks import check_script_invariants


def run_chaos(opts: ChaosOptions) -> dict[str, Any]:
    """Run one seeded chaos schedule and return its report (also in ``report.json``).

    Raises:
        ValueError: ``opts.kinds`` names a kind that does not exist.
        RuntimeError: the job did not start.
    """
    return Chaos(opts).run()


class Chaos:
    """One run: the job, its faults, then the checks."""

    def __init__(self, opts: ChaosOptions) -> None:
        self.opts = opts
        self.rng = random.Random(opts.seed)
        self.job = ChaosJob(opts)
        self.injector = (CompoundInjector if opts.compound else Injector)(self.job, self.rng)
        self.faults: list[Fault] = []
        self.reference: ScriptReference | None = None

    def run(self) -> dict[str, Any]:
        job = self.job
        job.write_secret()
        job.start_etcd()
        kinds, gaps = self._schedule()
        self.opts.say(f"run {job.run_id}: {job.max_steps} steps, faults {kinds}")
        job.start_cluster()
        started = time.time()
        try:
            self._start_reference()
            self._start(started)
            self._inject_all(kinds, gaps, started)
            codes = job.wait_end()
            self.injector.collect_stale()
        finally:
            self.injector.undo()
            orphans = job.close()
        try:
            return self._finish((started, time.time()), codes, orphans)
        finally:
            if self.reference is not None:
                self.reference.stop()

    def _schedule(self) -> tuple[list[str], list[float]]:
        """The faults in order and the seconds before each: the compound schedule (a short
        settle between faults), else the seeded random one."""
        opts = self.opts
        if not opts.compound:
            return schedule(self.rng, opts, self.job.kinds)
        kinds = [
            k
            for k in compound_schedule(opts.compound)
            if opts.compound_kinds is None or k in opts.compound_kinds
        ]
        return kinds, [opts.every_s] * len(kinds)

    def _start_reference(self) -> None:
        """A user's script: its fault-free reference runs beside the job from the start."""
        job = self.job
        if self.opts.script is None:
            return
        self.reference = ScriptReference(self.opts.script, job.run_dir, job.environ(), job.secret())
        self.reference.start()

    def _start(self, started: float) -> None:
        """Start the observer and the first agents; wait for stable training."""
        self.job.observer.start()
        for _ in range(self.opts.agents):
            self.job.start_node()
        begin = Fault("start", started, 0, t_end=started)
        self._wait_stable(begin, timeout=max(600.0, self.opts.recover_timeout))
        if begin.error:
            raise RuntimeError(f"The job did not start: {begin.error}. Logs: {self.job.run_dir}")
        self.injector.capture_spec()

    def _inject_all(self, kinds: Sequence[str], gaps: Sequence[float], started: float) -> None:
        """Inject the schedule, each fault ``gap`` after the one before, until the fault
        window ends, the job nears its last step, or every agent exited."""
        opts, job = self.opts, self.job
        timed = opts.faults is None and not opts.compound
        window_end = time.time() + opts.minutes * 60 if timed else math.inf
        next_at = time.time() + gaps[0]
        for kind, gap in zip(kinds, [*gaps[1:], 0.0], strict=True):
            while time.time() < next_at and job.cluster.running():
                pause(0.2)
            if time.time() > window_end or self._near_end():
                break
            if not job.cluster.running():
                break
            fault = self._inject(kind, started)
            next_at = max(time.time() + 2 * opts.step_s, fault.t + gap)

    def _near_end(self) -> bool:
        """Whether the job is too near its end for another fault: past 90 % of its steps;
        for compound faults, with less than ``margin_s`` of training left at the recent
        pace (a join takes a joiner's start-up, and a fault must not meet the job's end)."""
        job = self.job
        last = job.tail.last_step()
        if not self.opts.compound:
            return last > 0.9 * job.max_steps
        recent = job.tail.of("train.step")[-21:]
        if len(recent) < 2:
            return False
        pace = (recent[-1]["ts"] - recent[0]["ts"]) / (len(recent) - 1)
        return (job.max_steps - last) * pace < self.opts.margin_s

    def _inject(self, kind: str, started: float) -> Fault:
        say = self.opts.say
        say(f"  t+{time.time() - started:5.0f}s step {self.job.tail.last_step()}: {kind}")
        fault = self.injector.inject(kind)
        self.faults.append(fault)
        self._wait_stable(fault)
        say(
            f"    recovered in {fault.recover_s} s, {fault.steps_lost} steps lost"
            f"{' (' + fault.error + ')' if fault.error else ''}"
        )
        return fault

    def _wait_stable(self, fault: Fault, timeout: float | None = None) -> None:
        job = self.job
        timeout = timeout or self.opts.recover_timeout
        wait_stable(job.tail, fault, job.world, job.max_steps, timeout)

    def _finish(
        self, times: tuple[float, float], codes: Mapping[str, int | None], orphans: list[int]
    ) -> dict[str, Any]:
        """Check the invariants; write the observations and the report; the report."""
        job, injector = self.job, self.injector
        write_observations(job.observer.seen, job.run_dir / "observations.json")
        results = {"stale_writer": injector.stale_results, "rogue_member": injector.rogue_results}
        if self.reference is not None:
            verdict = check_script_invariants(job, self.faults, codes, orphans, self.reference)
        else:
            verdict = check_invariants(job, self.faults, results, codes, orphans)
        report = build_report(job, self.faults, verdict, results, times, codes)
        (job.run_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        return report


__all__ = ["Chaos", "run_chaos"]
