"""Multi-process runs: real torchrun agents, real etcd, real kills."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import pytest

from elastic.etcd.server import EtcdServer, free_port
from elastic.rendezvous.options import ALGORITHMS
from tests.helpers import wait_until
from tests.rendezvous.nodes import Cluster, announce_only, per_algorithm

pytestmark = pytest.mark.slow


@pytest.fixture(params=ALGORITHMS)
def cluster(cluster: Cluster, request: pytest.FixtureRequest) -> Cluster:
    return per_algorithm(cluster, request)


def assert_ranks(records: list[dict], world: int) -> None:
    assert sorted(r["rank"] for r in records) == list(range(world))
    assert {r["sum"] for r in records} == {world}
    assert len({r["master"] for r in records}) == 1


def test_three_agents_rendezvous_then_a_fourth_joins(
    cluster: Cluster, etcd: EtcdServer, run_id: str
) -> None:
    nodes = [cluster.start(n, etcd.endpoint, run_id, "3:4") for n in "abc"]
    formed = wait_until(lambda: len(cluster.formed(3)) == 3 and cluster.formed(3), 90, "3 ranks")
    assert_ranks(formed, 3)
    nodes.append(cluster.start("d", etcd.endpoint, run_id, "3:4"))
    formed = wait_until(lambda: len(cluster.formed(4)) == 4 and cluster.formed(4), 90, "4 ranks")
    assert_ranks(formed, 4)
    assert {r["node"] for r in formed} == set("abcd")
    cluster.stop()
    for node in nodes:
        assert node.wait(60) == 0, cluster.logs()


@pytest.mark.parametrize("backend", ["c10d", "etcd-v3"])
def test_kill_rank0_node(cluster: Cluster, etcd: EtcdServer, run_id: str, backend: str) -> None:
    """c10d keeps its store on the rank-0 node and the job dies with it; etcd-v3 goes on."""
    endpoint = f"127.0.0.1:{free_port()}" if backend == "c10d" else etcd.endpoint
    first = cluster.start("a", endpoint, run_id, "2:3", backend=backend)
    if backend == "c10d":  # a hosts the c10d store: let it bind the port before the others
        wait_until(
            lambda: "a" in {r.get("node") for r in cluster.formed()} or _listening(endpoint),
            60,
            "the c10d store to listen",
        )
    others = [cluster.start(n, endpoint, run_id, "2:3", backend=backend) for n in "bc"]
    formed = wait_until(lambda: len(cluster.formed(3)) == 3 and cluster.formed(3), 90, "3 ranks")
    rank0 = next(r for r in formed if r["rank"] == 0)
    assert rank0["node"] == "a", "the first agent (lowest pid) is rank 0"
    cluster.kill_node_of(rank0)
    if backend == "etcd-v3":
        regrouped = wait_until(
            lambda: len(cluster.formed(2)) == 2 and cluster.formed(2),
            90,
            "the survivors to re-form",
        )
        assert_ranks(regrouped, 2)
        assert {r["node"] for r in regrouped} == {"b", "c"}
        cluster.stop()
        for node in others:
            assert node.wait(60) == 0, cluster.logs()
    else:
        codes = [node.wait(120) for node in others]
        assert all(code != 0 for code in codes), cluster.logs()
        assert cluster.formed(2) == [], "c10d survivors cannot re-form without the store host"
        for node in others:
            assert "The connection to the C10d store has failed" in node.output(), node.output()
    assert first.proc.wait(10) != 0


def test_a_killed_agent_is_removed_before_its_heartbeats_could_expire(
    cluster: Cluster, etcd: EtcdServer, run_id: str, request: pytest.FixtureRequest
) -> None:
    """Heartbeats here expire 40-60 s after a kill (20 s x 3, the last beat up to 20 s old);
    a refused probe port must remove the dead node well before that (elastic.rendezvous.liveness).
    """
    announce_only(request, "has no probe port and waits for heartbeat expiry")
    conf = "join_timeout=90,last_call_timeout=1,keep_alive_interval=20,keep_alive_max_attempt=3"
    nodes = [cluster.start(n, etcd.endpoint, run_id, "1:2", conf=conf) for n in "ab"]
    formed = wait_until(lambda: len(cluster.formed(2)) == 2 and cluster.formed(2), 90, "2 ranks")
    killed_at = time.time()
    cluster.kill_node_of(next(r for r in formed if r["node"] == "b"))
    alone = wait_until(lambda: cluster.formed(1), 60, "the survivor to re-form alone")
    took = time.time() - killed_at  # includes a fresh worker's start (import torch)
    print(f"re-formed alone {took:.1f} s after the kill")
    assert alone[0]["node"] == "a"
    assert took < 30, f"re-formed {took:.1f} s after the kill: heartbeat expiry, not the probe"
    cluster.stop()
    assert nodes[0].wait(60) == 0, cluster.logs()


def _listening(endpoint: str) -> bool:
    import socket

    host, port = endpoint.rsplit(":", 1)
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) == 0


DDP_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1 + dist.get_rank())
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    torch.save(flat, os.path.join(sys.argv[1], f"rank{dist.get_rank()}.pt"))
    dist.destroy_process_group()
    """
)


def test_plain_torchrun_runs_a_ddp_script(
    cluster: Cluster, etcd: EtcdServer, run_id: str, tmp_path: Path
) -> None:
    import torch

    script = tmp_path / "train.py"
    script.write_text(DDP_SCRIPT)
    node = cluster.start(
        "solo", etcd.endpoint, run_id, "1:2", nproc=2, script=[str(script), str(tmp_path)]
    )
    assert node.wait(120) == 0, cluster.logs()
    a, b = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert "etcd-v3" in node.output()
