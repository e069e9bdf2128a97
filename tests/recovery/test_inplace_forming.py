"""A node killed while the group that takes it in still forms (tests/scripts/inplace_user.py
on Run, in place, with checkpoints: each round forms a default group, then the checkpoints'
side group).

Node c joins a and b; its worker forms the round's default group, then stops before it
writes its address for the side group (this file, run as c's worker, makes the side group
a hang), so a's and b's workers wait in the store for it. c is killed (kill -9 of its agent
and worker). The agents form the next round at once; the survivors' store waits give the
dead round up (:mod:`elastic.worker.formstore`) and they re-form in place: the job
finishes with the same two worker processes, every step once, each sample once per epoch,
the fault-free model. (Seen in a chaos run: both survivors held 10 minutes in that wait,
the side group's timeout, deaf to every newer round, and outliving their agents.)
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest
import torch  # noqa: F401  (before any os.environ: the worker below starts warm)

from elastic_tools.harness.cluster import LocalCluster

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "inplace_user.py"
HANG_MARK = "side-group-hang"  # written by c's worker once it hangs


@pytest.mark.timeout(420)
def test_a_node_killed_while_its_side_group_forms_leaves_the_survivors_in_place(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    from tests.recovery.test_inplace import (
        _args,
        _check_result,
        _records,
        _reference,
        _signal_node,
    )

    epochs = 20
    out, ref = tmp_path / "out", tmp_path / "ref"
    _reference(ref, epochs)
    args = [*_args(out), f"--epochs={epochs}", "--step-delay=0.05", f"--ckpt={tmp_path / 'ckpt'}"]
    a = cluster.start("a", worker=[str(SCRIPT), *args])
    b = cluster.start("b", worker=[str(SCRIPT), *args])
    cluster.wait_for(
        lambda: [e for e in cluster.steps() if e["world_size"] == 2 and e["step"] >= 20],
        "20 steps at world 2",
        240,
    )
    cluster.start("c", worker=[str(Path(__file__)), *args])
    hung = out / HANG_MARK
    cluster.wait_for(lambda: hung.exists() or None, "c's worker in the side group", 120)
    killed = time.time()
    _signal_node(cluster, "c", signal.SIGKILL)
    assert a.wait(240) == 0 and b.wait(240) == 0, cluster.logs()
    pids = {r["pid"] for r in _records(out)}
    assert len(pids) == 2, f"the survivors' workers were replaced: pids {pids}"
    after = [e for e in cluster.events("recovery.inplace") if e["ts"] > killed]
    assert {e["pid"] for e in after if e["world_size"] == 2} == pids, after
    _check_result(cluster, out, ref, epochs)
    resumed = min(e["ts"] for e in cluster.steps() if e["ts"] > killed)
    print(f"first step {resumed - killed:.2f} s after the kill")


def _hang_in_side_group() -> None:
    """Run the user's script with the side group's formation a hang (this node's worker
    never writes its address), after marking it."""
    import runpy

    from elastic.worker import groups

    out = Path(next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--out=")))

    def hang() -> None:
        out.mkdir(parents=True, exist_ok=True)
        (out / HANG_MARK).touch()
        while True:
            time.sleep(1)

    groups.side_group = hang  # type: ignore[assignment]
    sys.argv = [str(SCRIPT), *sys.argv[1:]]
    runpy.run_path(str(SCRIPT), run_name="__main__")


if __name__ == "__main__":
    _hang_in_side_group()
