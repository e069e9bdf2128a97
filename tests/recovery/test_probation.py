"""Probation under real agents: a dropped straggler checks its health and rejoins.

Three nodes run the in-place user script (tests/scripts/inplace_user.py through the slowing
wrapper of tests/recovery/test_straggler.py) with the straggler policy on. Node c is slowed
(its steps take 3 times as long while a marker file exists); it is named and dropped in
place (0 steps lost, the job goes on at world 2), its agent stays and sits out on
probation; its health check (:data:`PROBE`: a timed sleep, 3 times as long while the
marker exists) fails once, the slowdown ends, the next check passes, and the node
rejoins: a later step runs at world 3, and every agent exits 0 with every step done once
and the fault-free model.
"""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from elastic.worker.probation import BASELINE_SAMPLES
from elastic_tools.harness.cluster import LocalCluster

pytestmark = pytest.mark.slow
STRAGGLER = Path(__file__).resolve().parent / "test_straggler.py"
# The test's health check: its work (0.1 s) takes 3 times as long while the marker exists.
PROBE = (
    "import os, sys, time; t = time.perf_counter(); "
    "time.sleep(0.1 * (3 if os.path.exists(sys.argv[1]) else 1)); "
    "print(time.perf_counter() - t)"
)


@pytest.mark.timeout(240)
def test_a_dropped_node_checks_its_health_and_rejoins(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    from tests.recovery.test_inplace import _check_result, _reference
    from tests.recovery.test_straggler import SAMPLES, SLOW_ENV, SLOW_WHILE_ENV, _args

    epochs, k, hold = 12, 3, 150
    out, ref = tmp_path / "out", tmp_path / "ref"
    slow, go = tmp_path / "slow", tmp_path / "go"
    _reference(ref, epochs)
    worker = [str(STRAGGLER), *_args(out, epochs), "--step-delay=0.05", f"--hold-at={hold}:{go}"]
    probe = f"{sys.executable} -c {shlex.quote(PROBE)} {slow}"
    extra = {
        "ELASTIC_STRAGGLER": f"2,{k}",
        "ELASTIC_STRAGGLER_MIN_SLOW_S": "0.3",  # K slow steps (3 x 0.15 s) cross it
        "ELASTIC_PROBATION": "1,2,4",  # first check after 1 s, back-off 2 s, 4 failures
        "ELASTIC_PROBATION_PROBE": probe,
    }
    slowed = {**extra, SLOW_ENV: "3,0", SLOW_WHILE_ENV: str(slow)}
    nodes = {
        name: cluster.start(
            name, worker=worker, extra_env=slowed if name == "c" else extra, nnodes="2:3"
        )
        for name in "abc"
    }
    started = time.monotonic()
    cluster.wait_for(
        lambda: [e for e in cluster.steps() if e["world_size"] == 3 and e["step"] >= 8],
        "step 8 at world 3",
        120,
    )
    # each node times its healthy baseline once its round has run in place a while
    baselines = cluster.wait_for(
        lambda: _complete(cluster.events("probation.baseline"), 3), "3 baselines", 90
    )
    slow.touch()
    entered = cluster.wait_for(lambda: cluster.events("node.probation"), "node.probation", 60)[0]
    failed = cluster.wait_for(
        lambda: [e for e in cluster.events("probation.check") if not e["passed"]],
        "a failed check",
        60,
    )[0]
    slow.unlink()  # the node is healthy again
    rejoined = cluster.wait_for(lambda: cluster.events("node.rejoin"), "node.rejoin", 60)[0]
    go.touch()
    back = cluster.wait_for_world(3, rejoined["ts"], 90)
    codes = {name: node.wait(120) for name, node in nodes.items()}
    assert codes == {"a": 0, "b": 0, "c": 0}, cluster.logs()
    took = time.monotonic() - started

    dropped = cluster.events("straggler.dropped")
    assert len(dropped) == 1 and dropped[0]["ratio"] > 2, dropped
    assert entered["pid"] == nodes["c"].pid and entered["ratio"] > 2, entered
    assert failed["seconds"] > 2 * failed["baseline_s"] and failed["next_check_in"] == 2, failed
    ours = [e for e in baselines if e["pid"] == nodes["c"].pid]
    assert failed["baseline_s"] == ours[-1]["baseline_s"] < 0.2, (failed, ours)
    first_step = min(e["ts"] for e in cluster.steps())
    assert all(e["ts"] > first_step for e in baselines), "a baseline probe before training"
    passed = [e for e in cluster.events("probation.check") if e["passed"]]
    assert len(passed) == 1 and passed[0]["ts"] < rejoined["ts"], passed
    assert rejoined["world_size"] == 3 and rejoined["pid"] == nodes["c"].pid, rejoined
    assert cluster.first_step_after(dropped[0]["ts"], 2) is not None, "no step at world 2"
    assert not cluster.events("probation.gave_up")
    # 0 steps lost, each sample once per epoch, the fault-free model
    _check_result(cluster, out, ref, epochs)
    assert max(e["step"] for e in cluster.steps()) == epochs * SAMPLES // 12
    print(
        f"dropped at step {dropped[0]['step']} (ratio {dropped[0]['ratio']}); failed check "
        f"{failed['seconds']} s vs {failed['baseline_s']} s; rejoined "
        f"{rejoined['ts'] - entered['ts']:.2f} s after the drop (rendezvous "
        f"{rejoined['rendezvous_s']} s); first step at world 3 after it: step {back['step']}, "
        f"{back['ts'] - rejoined['ts']:.2f} s later; job {took:.1f} s"
    )


def _complete(baselines: list[dict[str, Any]], nodes: int) -> list[dict[str, Any]]:
    """``baselines`` once ``nodes`` agents each took every baseline probe; else empty."""
    done = {e["pid"] for e in baselines if e["samples"] == BASELINE_SAMPLES}
    return baselines if len(done) >= nodes else []


@pytest.mark.timeout(180)
def test_a_node_that_fails_its_checks_leaves_for_good(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """Its probe fails (exit 1): after the bound (here one failed check) it leaves the job
    for good with exit 0, and the others finish the job without it (the rendezvous stays
    open to them: the leave is not the job's end)."""
    from tests.recovery.test_inplace import _check_result, _reference
    from tests.recovery.test_straggler import SLOW_ENV, _args

    epochs = 6
    out, ref = tmp_path / "out", tmp_path / "ref"
    _reference(ref, epochs)
    worker = [str(STRAGGLER), *_args(out, epochs), "--step-delay=0.05"]
    extra = {
        "ELASTIC_STRAGGLER": "2,3",
        "ELASTIC_STRAGGLER_MIN_SLOW_S": "0.3",
        "ELASTIC_PROBATION": "1,1,1",
    }
    failing = f"{sys.executable} -c {shlex.quote('raise SystemExit(1)')}"
    slowed = {**extra, SLOW_ENV: "3,8", "ELASTIC_PROBATION_PROBE": failing}
    nodes = {
        name: cluster.start(
            name, worker=worker, extra_env=slowed if name == "c" else extra, nnodes="2:3"
        )
        for name in "abc"
    }
    gave_up = cluster.wait_for(lambda: cluster.events("probation.gave_up"), "gave up", 120)[0]
    assert nodes["c"].wait(60) == 0, cluster.logs()
    assert nodes["a"].wait(120) == 0 and nodes["b"].wait(120) == 0, cluster.logs()
    assert gave_up["pid"] == nodes["c"].pid and gave_up["checks"] == 1, gave_up
    checks = cluster.events("probation.check")
    assert [c["passed"] for c in checks] == [False] and checks[0]["seconds"] is None, checks
    assert not cluster.events("node.rejoin")
    assert cluster.first_step_after(gave_up["ts"], 2) is not None, "no step after it left"
    _check_result(cluster, out, ref, epochs)
