"""Rank 0 dies right after its group agreed on a step: the survivors complete that step,
the next world resumes from it, and nothing is lost or done twice.

Rank 0 is the only rank that reports ``train.step``, so that step never appears there;
``events.completed_steps`` counts it from the ``ckpt.load`` of the world that resumed
from it. (An end-to-end run that checked ``train.step`` alone failed here, 1 run in ~10.)
"""

from __future__ import annotations

import pytest

from elastic import events
from elastic.etcd.server import EtcdServer
from tests.agent.jobs import Job, assert_models_match

pytestmark = pytest.mark.slow

AGREED = 12  # rank 0 dies after the agreement of this step


def test_rank0_dies_after_the_agreement(tmp_path, etcd: EtcdServer, run_id: str) -> None:
    job = Job(tmp_path, etcd.endpoint, run_id, max_steps=30)
    marker = tmp_path / "killed"
    argv = job.worker_argv()
    module = argv.index("elastic_tools.training.worker")
    worker = [*argv[:module], "tests.recovery.agreed_then_killed", str(AGREED), str(marker)]
    worker += argv[module + 1 :]
    try:
        for name in ("a", "b"):
            job.start(name, worker=worker)
        for name in ("a", "b"):
            assert job.nodes[name].wait(300) == 0, job.logs()
        assert marker.exists(), "rank 0 was never killed: the scenario did not happen"

        reported = {e["step"] for e in job.steps()}
        assert AGREED not in reported, "rank 0 reported the step it died in"
        loads = [e for e in job.events("ckpt.load") if e["step"] == AGREED]
        assert loads and {e.get("source") for e in loads} <= {"memory", "peer"}, loads
        assert events.completed_steps(job.events()) == set(range(1, job.max_steps + 1))
        used = job.ledger()
        assert len(used) == len(set(used)) == job.max_steps * 48, "a sample was skipped or repeated"
        assert_models_match(job.final_model(), job.reference_model())
    finally:
        assert job.cleanup() == [], "no worker may outlive its agent"
