"""examples/train_ddp.py under real elastic-agents: recovery from memory, no step lost.

Two nodes train; one is killed with -9 (agent and worker): the survivor resumes from
its own node's snapshot at the newest completed step. A third node joins: its state
arrives from the survivor's memory over gloo, and nobody reads the storage.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from elastic.node import nodelocal
from elastic_tools.harness.cluster import LocalCluster
from tests.helpers import REPO, wait_until

pytestmark = pytest.mark.slow


def _worker(tmp: Path) -> list[str]:
    return [
        str(REPO / "examples" / "train_ddp.py"),
        "--epochs=1000",
        "--samples=256",
        f"--ckpt={tmp / 'ckpt'}",
        "--step-delay=0.3",
    ]


def _resumes(c: LocalCluster, after: float, world: int) -> list[dict[str, Any]]:
    return [e for e in c.events("recovery.resume") if e["ts"] > after and e["world_size"] == world]


def _files_of(pid: int) -> list[Path]:
    """The snapshot files of agent ``pid``'s node (in its private directory)."""
    found = nodelocal.find(pid)
    return sorted(found.glob("snap-*")) if found is not None else []


def test_kill_9_then_join_recover_from_memory(cluster: LocalCluster, tmp_path: Path) -> None:
    worker = _worker(tmp_path)
    a = cluster.start("a", worker=worker)
    b = cluster.start("b", worker=worker)
    cluster.wait_for(
        lambda: [e for e in cluster.steps() if e["world_size"] == 2 and e["step"] >= 6],
        "step 6 at world 2",
        240,
    )
    assert _files_of(a.pid) and _files_of(b.pid), "each node holds its snapshots"

    before = max(e["step"] for e in cluster.steps())
    killed_at = time.time()
    cluster.kill_node("b")  # kill -9 of the agent and its worker
    resumed = cluster.wait_for(lambda: _resumes(cluster, killed_at, 1), "a resume at world 1", 240)
    assert resumed[0]["source"] == "memory", resumed
    assert resumed[0]["step"] >= before, f"lost steps: completed {before}, resumed {resumed}"
    lost = max(e["step"] for e in cluster.steps() if e["ts"] <= killed_at) - resumed[0]["step"]
    assert lost <= 0, f"{lost} completed steps were lost"
    cluster.wait_for(
        lambda: cluster.first_step_after(resumed[0]["ts"], 1), "a step at world 1", 120
    )

    joined_at = time.time()
    c = cluster.start("c", worker=worker)
    wait_until(lambda: not _files_of(b.pid), 60, "the new agent to remove the killed one's files")
    pair = cluster.wait_for(
        lambda: len(_resumes(cluster, joined_at, 2)) == 2 and _resumes(cluster, joined_at, 2),
        "both ranks to resume at world 2",
        240,
    )
    sources = sorted(e["source"] for e in pair)
    assert sources == ["memory", "peer"], pair
    assert all(e["step"] >= resumed[0]["step"] for e in pair)
    peer = next(e for e in pair if e["source"] == "peer")
    assert peer["bytes"] > 0
    storage_loads = [
        e for e in cluster.events("ckpt.load") if e["ts"] > killed_at and "source" not in e
    ]
    assert storage_loads == [], "nothing may be read from storage"
    cluster.wait_for(lambda: cluster.first_step_after(joined_at, 2), "a step at world 2", 120)

    for node in (a, c):  # a planned stop: each agent removes its node's snapshots
        node.kill(signal.SIGTERM)
    for node in (a, c):
        node.wait(120)
    wait_until(lambda: not _files_of(a.pid) and not _files_of(c.pid), 10, "snapshot cleanup")
