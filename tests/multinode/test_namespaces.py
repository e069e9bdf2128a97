"""Each node in its own network namespace with its own address: join, then a cut cable."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from elastic.etcd.server import EtcdServer
from elastic_tools.harness.faults import Net
from tests.agent.jobs import Job
from tests.agent.test_membership import assert_continuous, first_step_after
from tests.helpers import wait_until

pytestmark = pytest.mark.slow


@pytest.mark.timeout(600)
def test_nodes_in_namespaces_join_and_survive_a_cut_link(
    net: Net, bridge_etcd: EtcdServer, tmp_path: Path, run_id: str
) -> None:
    job = Job(tmp_path, bridge_etcd.endpoint, run_id, max_steps=160)
    hosts = [net.add_node() for _ in range(3)]
    try:
        # The survivors' collectives would time out only after 90 s: they must not wait for it.
        a, b = (
            job.start(n, netns=ns, addr=addr, **{"distributed.timeout_s": 90})
            for n, (ns, addr) in zip("ab", hosts, strict=False)
        )
        wait_until(lambda: job.last_step() >= 6, 150, "step 6 at world 2")
        joined_at = time.time()
        c = job.start("c", netns=hosts[2][0], addr=hosts[2][1], **{"distributed.timeout_s": 10})
        first_step_after(job, joined_at, 3)
        rounds = job.events("rdzv.round")
        assert {h[1] for h in hosts} <= {r["node"].split("_")[0] for r in rounds}, rounds

        wait_until(lambda: job.worlds_after(joined_at).count(3) >= 5, 120, "5 steps at world 3")
        cut_at = time.time()
        net.link(hosts[2][0], up=False)  # node c's processes live on, unreachable
        recovered = first_step_after(job, cut_at, 2)
        took = recovered["ts"] - cut_at
        assert took < 45, f"recovered {took:.0f} s after the cut: survivors waited for a timeout"
        assert job.events("node.lost"), "survivors must notice the lost node from etcd"
        for node in (a, b):
            assert node.wait(240) == 0, job.logs()
        # it rides out what looks like an etcd outage while its workers live, then gives up
        # when they fail (each etcd request it makes meanwhile waits request_timeout, 30 s)
        assert c.wait(240) != 0, "the cut-off node cannot finish the job on its own"
        assert_continuous(job)
    finally:
        assert job.cleanup() == [], "no worker may outlive its agent"
