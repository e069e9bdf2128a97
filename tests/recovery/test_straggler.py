"""Slow and stuck nodes under real agents (tests/scripts/inplace_user.py, in place).

* A node slowed to 1/3 speed (its step's work takes 3 times as long) is named K steps after
  the slowing (``straggler.detected``), and with the policy on (``ELASTIC_STRAGGLER=X,K``)
  dropped in place: with ``ELASTIC_PROBATION=off`` its agent leaves for good (probation and
  the rejoin: tests/recovery/test_probation.py), the others go on, no completed step is
  redone, each sample is used once per epoch and the final model is the fault-free one.
* Beside a CPU hog (one busy loop per core), a fault-free 3-node job with the policy on and
  the default K and T names nobody and runs every step: on a loaded host a scheduler hiccup
  slows a node's steps for a while, but never for T (10 s) of its compute time.
* A worker stuck in ``time.sleep(3600)`` inside a step (its agent alive) names itself past
  the hang bound (``worker.hang``), its stack reaches the event log (``worker.stacks``), it
  exits, and the group goes on.

This file is also the tests' worker: run as a script it wraps the user's script
(tests/scripts/inplace_user.py), whose step ends in ``time.sleep(step_delay)`` (the step's
work): ``$STRAGGLER_TEST_SLOW=F,N`` makes that F times longer from the N-th step on (a slower
device: 3 is a node at 1/3 speed), ``$STRAGGLER_TEST_HANG_AT=N`` makes the N-th one a
``time.sleep(3600)`` (once per job); with ``$STRAGGLER_TEST_SLOW_WHILE=PATH`` the steps are
F times longer only while PATH exists (tests/recovery/test_probation.py). A SIGSTOP/SIGCONT
duty cycle (:class:`DutyCycle`, used by bench/straggler.py ``--mode signal``) slows a node
too, but its readings depend on where the stops land: a stop while the rank's own collective
is in flight counts as its wait.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch  # noqa: F401  (before any os.environ: the hang worker starts warm)

from elastic_tools.harness.cluster import LocalCluster

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "inplace_user.py"
SAMPLES, BATCH = 240, 12
HANG_AT_ENV = "STRAGGLER_TEST_HANG_AT"  # N: the N-th step's sleep is a hang
SLOW_ENV = "STRAGGLER_TEST_SLOW"  # "F,N": from the N-th step on, each step's sleep is F times
SLOW_WHILE_ENV = "STRAGGLER_TEST_SLOW_WHILE"  # PATH: F times only while PATH exists


def _args(out: Path, epochs: int) -> list[str]:
    return [f"--epochs={epochs}", f"--samples={SAMPLES}", f"--global-batch={BATCH}", f"--out={out}"]


class DutyCycle:
    """SIGSTOP/SIGCONT the given pids: stopped ``stop_s`` of every ``stop_s + run_s``."""

    def __init__(self, pids: list[int], stop_s: float = 0.02, run_s: float = 0.01) -> None:
        self.pids, self.stop_s, self.run_s = pids, stop_s, run_s
        self.started: float | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> DutyCycle:
        self.started = time.time()
        self._thread.start()
        return self

    def _signal(self, sig: int) -> None:
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def _loop(self) -> None:
        try:
            while not self._done.is_set():
                self._signal(signal.SIGSTOP)
                self._done.wait(self.stop_s)
                self._signal(signal.SIGCONT)
                self._done.wait(self.run_s)
        finally:
            self._signal(signal.SIGCONT)

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)


@pytest.mark.timeout(300)
def test_a_slowed_node_is_named_and_dropped(cluster: LocalCluster, tmp_path: Path) -> None:
    from tests.recovery.test_inplace import _check_result, _records, _reference

    epochs, k, slow_after = 10, 3, 40
    out, ref = tmp_path / "out", tmp_path / "ref"
    _reference(ref, epochs)
    worker = [str(Path(__file__)), *_args(out, epochs), "--step-delay=0.03"]
    # never below --nnodes MIN (2); probation off: the dropped node leaves for good
    # (probation and rejoin: tests/recovery/test_probation.py)
    # T = 0.2 s: K slow steps (3 x 0.09 s) cross it, so K decides the step it is named at
    extra = {
        "ELASTIC_STRAGGLER": f"2,{k}",
        "ELASTIC_STRAGGLER_MIN_SLOW_S": "0.2",
        "ELASTIC_PROBATION": "off",
    }
    slow = {**extra, SLOW_ENV: f"3,{slow_after}"}
    nodes = [
        cluster.start(name, worker=worker, extra_env=slow if name == "c" else extra, nnodes="2:3")
        for name in "abc"
    ]
    detected = cluster.wait_for(
        lambda: cluster.events("straggler.detected"), "straggler.detected", 180
    )
    dropped = cluster.wait_for(lambda: cluster.events("straggler.dropped"), "straggler.dropped", 60)
    cluster.wait_for(lambda: cluster.first_step_after(dropped[0]["ts"], 2), "world 2", 60)
    assert all(n.wait(120) == 0 for n in nodes), cluster.logs()
    d = detected[0]
    assert d["ratio"] > 2 and d["steps"] == k and d["policy"] is True, d
    assert d["slow_s"] >= 0.2, d
    # the N-th sleep ends step N (run.step counts from 1): named after exactly K slow steps
    assert d["step"] == slow_after + k - 1, f"named at step {d['step']}"
    assert cluster.nodes["c"].pid in {e["pid"] for e in cluster.events("node.leave")}
    assert any("slowest" in e for e in cluster.steps()), "train.step carries no ratios"
    _check_result(cluster, out, ref, epochs)
    # the drop takes effect at the boundary where it is decided: no step in flight is redone
    rounds: dict[int, set[int]] = {}
    for record in _records(out):
        rounds.setdefault(record["step"], set()).add(record["round"])
    redone = sorted(step for step, seen in rounds.items() if len(seen) > 1)
    assert not redone, f"steps attempted in two rounds (redone): {redone}"
    print(f"named at step {d['step']} (slowed from {slow_after}), ratio {d['ratio']}")


def _hog(per_core: int) -> list[subprocess.Popen[bytes]]:
    """``per_core`` busy loops per core (stopped by the caller, by PID)."""
    loop = [sys.executable, "-c", "while True: pass"]
    return [subprocess.Popen(loop) for _ in range(per_core * (os.cpu_count() or 1))]


def _longest_streaks(steps: list[dict[str, Any]], ratio: float) -> tuple[int, float]:
    """The longest run of consecutive steps in which one rank's compute time was above
    ``ratio`` times the median (what the count-only rule counted), and the most seconds of
    compute time such a run added up to."""
    longest, most = 0, 0.0
    runs: dict[int, tuple[int, float]] = {}
    for e in steps:
        compute = e.get("compute_s") or []
        if not compute or min(compute) <= 0:
            runs = {}
            continue
        median = statistics.median(compute)
        for rank, t in enumerate(compute):
            n, s = runs.get(rank, (0, 0.0))
            runs[rank] = (n + 1, s + t) if t > ratio * median else (0, 0.0)
            longest, most = max(longest, runs[rank][0]), max(most, runs[rank][1])
    return longest, most


@pytest.mark.timeout(300)
def test_a_fault_free_job_beside_a_cpu_hog_names_nobody(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """Three nodes, the policy on with its defaults (X = 2, K = 5, T = 10 s), every core
    busy with a hog: nobody is named or dropped, every step runs once, all exit 0."""
    from tests.recovery.test_inplace import _check_result, _reference

    epochs = 6  # 120 steps
    out, ref = tmp_path / "out", tmp_path / "ref"
    _reference(ref, epochs)
    # each step ~0.02 s of sleep and ~20 ms of CPU work (matrix products), which the hog slows
    worker = [str(Path(__file__)), *_args(out, epochs), "--step-delay=0.02", "--step-work=150"]
    extra = {"ELASTIC_STRAGGLER_DROP": "on"}
    hogs = _hog(4)  # load ~12 on 2 cores, as the runs that named a healthy node
    try:
        nodes = [
            cluster.start(name, worker=worker, extra_env=extra, nnodes="2:3") for name in "abc"
        ]
        codes = [n.wait(240) for n in nodes]
        load = os.getloadavg()[0]
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait(10)
    assert codes == [0, 0, 0], cluster.logs()
    named = cluster.events("straggler.detected")
    assert not named and not cluster.events("straggler.dropped"), named
    assert not cluster.events("node.probation")
    steps = cluster.steps()
    assert max(e["step"] for e in steps) == epochs * SAMPLES // BATCH
    full = next(i for i, e in enumerate(steps) if e["world_size"] == 3)  # c may join late
    assert all(e["world_size"] == 3 for e in steps[full:]), "a node left the job"
    _check_result(cluster, out, ref, epochs)
    streak, seconds = _longest_streaks(steps, 2.0)
    worst = max((r for e in steps for _, r in e.get("slowest", [])), default=0.0)
    compute = sorted(t for e in steps for t in e.get("compute_s", []))
    print(
        f"{len(steps)} steps beside {len(hogs)} hogs, load {load:.1f}: compute median "
        f"{statistics.median(compute):.3f} s, max {compute[-1]:.3f} s; worst ratio {worst}; "
        f"longest run of steps above 2x the median {streak} ({seconds:.2f} s of compute); "
        "nobody named"
    )


@pytest.mark.timeout(240)
def test_a_stuck_worker_is_named_and_the_group_goes_on(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    epochs, bound = 4, 2.0
    out = tmp_path / "out"
    worker = [str(Path(__file__)), *_args(out, epochs), "--step-delay=0.03"]
    calm = {"ELASTIC_HANG": f"{bound:g},5"}
    # a's steps take 8 times as long from the hang on: b's new worker (2-5 s away) must come
    # back before the job's last step for its resume to be seen (a fast run once finished
    # the 60 steps left in 2 s, before it did)
    a = cluster.start("a", worker=worker, extra_env={**calm, SLOW_ENV: "8,21"})
    b = cluster.start("b", worker=worker, extra_env={**calm, HANG_AT_ENV: "20"})
    hang = cluster.wait_for(lambda: cluster.events("worker.hang"), "worker.hang", 120)[0]
    stacks = cluster.events("worker.stacks")
    assert stacks and "_hang" in stacks[0]["stacks"], stacks
    assert hang["seconds"] >= bound and hang["bound_s"] >= bound, hang
    # The rank that waited names the one that never reached the step's collectives.
    named = cluster.wait_for(lambda: cluster.events("worker.hang.peers"), "worker.hang.peers", 30)
    assert [(e["step"], e["ranks"]) for e in named] == [(hang["step"], [hang["rank"]])], named
    reformed = cluster.wait_for(
        lambda: [e for e in cluster.events("recovery.inplace") if e["ts"] > hang["ts"]],
        "a re-form after the hang",
        60,
    )[0]
    went_on = cluster.wait_for(
        lambda: [e for e in cluster.steps() if e["ts"] > reformed["ts"]], "a step after it", 60
    )[0]
    assert a.wait(120) == 0 and b.wait(120) == 0, cluster.logs()
    # The stuck worker's node came back in a later round with a new worker: either it left
    # its round first (the others went on without it) or, when its agent saw the others'
    # re-form before its worker's exit, it joined that round at once.
    b_pid = cluster.nodes["b"].pid
    back = [e for e in cluster.events("rdzv.round") if e["pid"] == b_pid and e["ts"] > hang["ts"]]
    assert back, cluster.logs()
    resumed = {e["pid"] for e in cluster.events("recovery.resume") if e["ts"] > hang["ts"]}
    assert hang["pid"] not in resumed and resumed - {named[0]["pid"]}, (hang, named, resumed)
    steps = [e["step"] for e in cluster.steps()]
    assert steps == sorted(set(steps)), "a completed step was redone"
    assert max(steps) == epochs * SAMPLES // BATCH
    print(
        f"stuck for {hang['seconds']} s (bound {hang['bound_s']} s); re-formed "
        f"{reformed['ts'] - hang['ts']:.2f} s and the next step "
        f"{went_on['ts'] - hang['ts']:.2f} s after the hang event"
    )


def _hang_worker() -> None:
    """Run the user's script with its N-th ``time.sleep`` made a hang (once per job)."""
    import runpy

    at = int(os.environ.get(HANG_AT_ENV, "0") or 0)
    out = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--out="))
    marker = Path(out) / "hung"
    delay = float(next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--step-delay=")))
    real_sleep, calls = time.sleep, [0]

    def _hang(seconds: float) -> None:
        real_sleep(seconds)

    factor, slow_from = (float(x) for x in (os.environ.get(SLOW_ENV) or "1,0").split(","))
    slow_while = os.environ.get(SLOW_WHILE_ENV)

    def slowed() -> bool:
        return os.path.exists(slow_while) if slow_while else calls[0] >= slow_from

    def sleep(seconds: float) -> None:
        step = seconds == delay and threading.current_thread() is threading.main_thread()
        if step:
            calls[0] += 1  # the user's loop: one sleep of --step-delay per step
            if slowed():
                seconds *= factor  # a slower device: the step's own work takes longer
        if step and calls[0] == at and not marker.exists():
            Path(out).mkdir(parents=True, exist_ok=True)
            marker.touch()
            _hang(3600)
        real_sleep(seconds)

    if at or factor != 1:
        time.sleep = sleep  # type: ignore[assignment]
    sys.argv = [str(SCRIPT), *sys.argv[1:]]
    runpy.run_path(str(SCRIPT), run_name="__main__")


if __name__ == "__main__":
    _hang_worker()
