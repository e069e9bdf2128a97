"""Slow and stuck nodes under real agents (tests/scripts/inplace_user.py, in place).

* A node slowed to ~1/3 of its CPU (a SIGSTOP/SIGCONT duty cycle of its worker, each stop
  well under the agent's 3 s frozen-worker limit) is named within K steps of the slowing
  (``straggler.detected``), and with the policy on (``ELASTIC_STRAGGLER=X,K``) dropped in
  place: its agent leaves, the others go on, no completed step is redone, each sample is
  used once per epoch and the final model is the fault-free one.
* A worker stuck in ``time.sleep(3600)`` inside a step (its agent alive) names itself past
  the hang bound (``worker.hang``), its stack reaches the event log (``worker.stacks``), it
  exits, and the group goes on.

This file is also the hang test's worker: run as a script it makes the N-th
``time.sleep(step_delay)`` of the user's script (``$STRAGGLER_TEST_HANG_AT``) a
``time.sleep(3600)`` once per job, then runs tests/scripts/inplace_user.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch  # noqa: F401  (before any os.environ: the hang worker starts warm)

from elastic.harness.cluster import LocalCluster
from elastic.procs import descendants

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "inplace_user.py"
SAMPLES, BATCH = 240, 12
HANG_AT_ENV = "STRAGGLER_TEST_HANG_AT"


def _args(out: Path, epochs: int) -> list[str]:
    return [f"--epochs={epochs}", f"--samples={SAMPLES}", f"--global-batch={BATCH}", f"--out={out}"]


class DutyCycle:
    """SIGSTOP/SIGCONT the given pids: stopped ``stop_s`` of every ``stop_s + run_s``."""

    def __init__(self, pids: list[int], stop_s: float = 0.1, run_s: float = 0.05) -> None:
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
    from tests.recovery.test_inplace import _check_result, _reference

    epochs, k = 10, 3
    out, ref = tmp_path / "out", tmp_path / "ref"
    _reference(ref, epochs)
    worker = [str(SCRIPT), *_args(out, epochs), "--step-delay=0.03"]
    extra = {"ELASTIC_STRAGGLER": f"2,{k}", "ELASTIC_STRAGGLER_MIN_NODES": "2"}
    nodes = [cluster.start(name, worker=worker, extra_env=extra, nnodes="2:3") for name in "abc"]
    cluster.wait_for(lambda: [e for e in cluster.steps() if e["world_size"] == 3], "world 3", 120)
    cluster.train_more(5, 60)
    workers = cluster.worker_pids()
    slowed = [p for p in descendants(cluster.nodes["c"].pid) if p in workers]
    assert slowed, "node c's worker was not found"
    cycle = DutyCycle(slowed).start()
    try:
        detected = cluster.wait_for(
            lambda: cluster.events("straggler.detected"), "straggler.detected", 60
        )
        dropped = cluster.wait_for(
            lambda: cluster.events("straggler.dropped"), "straggler.dropped", 60
        )
        cluster.wait_for(lambda: cluster.first_step_after(dropped[0]["ts"], 2), "world 2", 60)
    finally:
        cycle.stop()
    assert all(n.wait(120) == 0 for n in nodes), cluster.logs()
    slow_steps = [
        e for e in cluster.steps() if e["ts"] > (cycle.started or 0) and e["ts"] < detected[0]["ts"]
    ]
    assert len(slow_steps) <= k + 2, f"named after {len(slow_steps)} slow steps (K={k})"
    d = detected[0]
    assert d["ratio"] > 2 and d["steps"] == k and d["policy"] is True, d
    steps_with_ratios = [e for e in cluster.steps() if "slowest" in e]
    assert steps_with_ratios, "train.step carries no ratios"
    _check_result(cluster, out, ref, epochs)
    print(
        f"named {len(slow_steps)} steps after the slowing, ratio {d['ratio']}; "
        f"dropped at step {dropped[0]['step']}"
    )


@pytest.mark.timeout(240)
def test_a_stuck_worker_is_named_and_the_group_goes_on(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    epochs, bound = 4, 2.0
    out = tmp_path / "out"
    worker = [str(Path(__file__)), *_args(out, epochs), "--step-delay=0.03"]
    calm = {"ELASTIC_HANG": f"{bound:g},5"}
    a = cluster.start("a", worker=worker, extra_env=calm)
    b = cluster.start("b", worker=worker, extra_env={**calm, HANG_AT_ENV: "20"})
    hang = cluster.wait_for(lambda: cluster.events("worker.hang"), "worker.hang", 120)[0]
    stacks = cluster.events("worker.stacks")
    assert stacks and "_hang" in stacks[0]["stacks"], stacks
    assert hang["seconds"] >= bound and hang["bound_s"] >= bound, hang
    reformed = cluster.wait_for(
        lambda: [e for e in cluster.events("recovery.inplace") if e["ts"] > hang["ts"]],
        "a re-form after the hang",
        60,
    )[0]
    went_on = cluster.wait_for(
        lambda: [e for e in cluster.steps() if e["ts"] > reformed["ts"]], "a step after it", 60
    )[0]
    assert a.wait(120) == 0 and b.wait(120) == 0, cluster.logs()
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

    def sleep(seconds: float) -> None:
        if seconds == delay and threading.current_thread() is threading.main_thread():
            calls[0] += 1  # the user's loop: one sleep of --step-delay per step
        if calls[0] == at and not marker.exists():
            Path(out).mkdir(parents=True, exist_ok=True)
            marker.touch()
            _hang(3600)
        real_sleep(seconds)

    if at:
        time.sleep = sleep
    sys.argv = [str(SCRIPT), *sys.argv[1:]]
    runpy.run_path(str(SCRIPT), run_name="__main__")


if __name__ == "__main__":
    _hang_worker()
