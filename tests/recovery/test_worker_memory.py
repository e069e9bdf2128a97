"""Our built-in CNN worker under elastic-agents: in place, from memory, from a peer.

A node is killed with -9: the survivor re-forms in place, in the same process, with its
live state at the newest completed step (no rollback to the last checkpoint); a joiner
receives the state from a peer while the survivor keeps its own; the job still trains
each sample once and ends with the model of a fault-free run.
"""

from __future__ import annotations

import time

import pytest

from elastic import events
from elastic.etcd.server import EtcdServer
from tests.agent.jobs import Job, assert_models_match
from tests.helpers import wait_until

pytestmark = pytest.mark.slow


def test_worker_recovers_from_memory_then_peer(tmp_path, etcd: EtcdServer, run_id: str) -> None:
    job = Job(tmp_path, etcd.endpoint, run_id, max_steps=90)
    try:
        job.start("a")
        job.start("b")
        wait_until(
            lambda: job.last_step() >= 8 and job.worlds_after(0)[-1] == 2, 180, "step 8 at world 2"
        )
        before = job.last_step()
        killed_at = time.time()
        job.kill_node("b")
        survivor = {e["pid"] for e in job.events("train.step")}
        reformed = wait_until(
            lambda: [e for e in job.events("recovery.inplace") if e["ts"] > killed_at],
            180,
            "an in-place re-form after the kill",
        )
        assert reformed[0]["state"] == "live" and reformed[0]["pid"] in survivor, reformed
        assert reformed[0]["step"] >= before, f"rolled back: completed {before}, {reformed}"
        assert not [e for e in job.events("ckpt.load") if e["ts"] > killed_at], "it reloaded"

        wait_until(lambda: job.first_step_after(reformed[0]["ts"], 1), 120, "a step at world 1")
        joined_at = time.time()
        job.start("c")
        pair = wait_until(
            lambda: (
                [
                    e
                    for e in job.events("ckpt.load")
                    if e["ts"] > joined_at and e["world_size"] == 2
                ][:2]
                if len([e for e in job.events("ckpt.load") if e["ts"] > joined_at]) >= 2
                else None
            ),
            180,
            "both ranks to resume at world 2",
        )
        assert sorted(e.get("source", "storage") for e in pair) == ["memory", "peer"], pair

        for name in ("a", "c"):
            assert job.nodes[name].wait(300) == 0, job.logs()
        steps = sorted(events.completed_steps(job.events()))
        assert steps == list(range(1, job.max_steps + 1)), steps
        used = job.ledger()
        assert len(used) == len(set(used)) == job.max_steps * 48, "a sample was skipped or repeated"
        assert_models_match(job.final_model(), job.reference_model())
    finally:
        assert job.cleanup() == [], "no worker may outlive its agent"
