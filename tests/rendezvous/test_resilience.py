"""etcd trouble: a cluster member killed, etcd restarted, etcd unreachable, bad options."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from elastic.etcd.server import EtcdServer, free_port, start_cluster
from elastic.rendezvous.options import ALGORITHMS
from tests.helpers import agent_argv, run_process, wait_until
from tests.rendezvous.nodes import WORKER, Cluster, announce_only, per_algorithm

pytestmark = pytest.mark.slow


@pytest.fixture(params=ALGORITHMS)
def cluster(cluster: Cluster, request: pytest.FixtureRequest) -> Cluster:
    return per_algorithm(cluster, request)


def test_member_killed_mid_rendezvous_fails_over(
    cluster: Cluster, tmp_path: Path, run_id: str
) -> None:
    members = start_cluster(tmp_path / "cluster", 3)
    try:
        endpoints = ",".join(m.endpoint for m in members)
        first = [cluster.start(n, endpoints, run_id, "3") for n in "ab"]
        # a and b wait in the rendezvous, talking to the first member; kill it.
        wait_until(
            lambda: all("Rendezvous'ing worker group" in n.output() for n in first), 60, "joins"
        )
        members[0].stop(signal.SIGKILL)
        last = cluster.start("c", endpoints, run_id, "3")
        formed = wait_until(lambda: len(cluster.formed(3)) == 3 and cluster.formed(3), 90, "3")
        assert sorted(r["rank"] for r in formed) == [0, 1, 2]
        cluster.stop()
        for node in [*first, last]:
            assert node.wait(60) == 0, cluster.logs()
    finally:
        for m in members:
            m.stop(signal.SIGKILL)


def test_agents_ride_out_an_etcd_restart(
    cluster: Cluster, own_etcd: EtcdServer, run_id: str, request: pytest.FixtureRequest
) -> None:
    announce_only(request, "drops every node after an outage longer than the heartbeat window")
    nodes = [cluster.start(n, own_etcd.endpoint, run_id, "2:3") for n in "ab"]
    wait_until(lambda: len(cluster.formed(2)) == 2, 90, "2 ranks")
    own_etcd.stop(signal.SIGKILL)
    down_until = time.monotonic() + 3  # an outage of a few heartbeats
    wait_until(lambda: time.monotonic() > down_until, 10, "the outage to last 3 s")
    own_etcd.start().wait_ready()  # same data dir, same ports
    nodes.append(cluster.start("c", own_etcd.endpoint, run_id, "2:3"))
    formed = wait_until(lambda: len(cluster.formed(3)) == 3 and cluster.formed(3), 90, "3")
    assert {r["node"] for r in formed} == {"a", "b", "c"}
    cluster.stop()
    for node in nodes:
        assert node.wait(60) == 0, cluster.logs()


def test_training_rides_out_an_etcd_outage_longer_than_the_request_timeout(
    cluster: Cluster, own_etcd: EtcdServer, run_id: str, request: pytest.FixtureRequest
) -> None:
    announce_only(request, "has none of our outage riding (outage_timeout)")
    conf = "profile=fast-failover,join_timeout=60,request_timeout=2,outage_timeout=120"
    nodes = [cluster.start(n, own_etcd.endpoint, run_id, "2", conf=conf) for n in "ab"]
    wait_until(lambda: len(cluster.formed(2)) == 2, 90, "2 ranks")
    own_etcd.stop(signal.SIGKILL)
    wait_until(
        lambda: all("etcd is unreachable" in n.output() for n in nodes), 30, "both to notice"
    )
    down_until = time.monotonic() + 6  # 3x the request timeout: the old agents exited here
    wait_until(lambda: time.monotonic() > down_until, 10, "the outage to last 6 s more")
    assert all(n.proc.poll() is None for n in nodes), cluster.logs()
    own_etcd.start().wait_ready()
    wait_until(lambda: all("etcd is reachable again" in n.output() for n in nodes), 60, "back")
    cluster.stop()
    for node in nodes:
        assert node.wait(90) == 0, cluster.logs()


def agent(worker: list[str], **options: str) -> subprocess.CompletedProcess[str]:
    """Run the ``elastic-agent`` console script (:func:`agent_argv`) to its end."""
    return run_process(agent_argv(worker, console_script=True, **options))


def test_unreachable_etcd_is_one_clear_line(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    worker = [str(WORKER), str(tmp_path / "r"), str(tmp_path / "s")]
    result = agent(worker, endpoint=endpoint, nnodes="1", rdzv_conf="join_timeout=600")
    assert result.returncode == 1
    assert time.monotonic() - started < 60, "must fail long before the join timeout"
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert any(f"Could not reach etcd at {endpoint}" in line for line in errors), result.stderr
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"nnodes": "3:1"}, "min_nodes must be > 0 and <= max_nodes"),
        ({"rdzv_conf": "keep_alive_interval=1,keep_alive_max_attempt=2"}, "split brain"),
        ({"endpoint": "ftp://x:1"}, "is malformed"),
    ],
)
def test_bad_options_are_one_line_with_exit_2(options: dict[str, str], needle: str) -> None:
    result = agent([str(WORKER), "r", "s"], **{"nnodes": "1", "rdzv_conf": "", **options})
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr
    assert "Traceback" not in result.stderr
