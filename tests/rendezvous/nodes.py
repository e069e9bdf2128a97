"""Start simulated nodes (one torchrun agent process each) and watch their workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from elastic import events
from elastic.rendezvous.options import SINGLE_KEY
from elastic_tools.harness.cluster import ETCD_V3, AgentOptions, LocalCluster
from tests.helpers import FAST_CONF, REPO, Node, kill_pid, node_env

WORKER = REPO / "tests" / "scripts" / "allreduce_worker.py"


class Cluster(LocalCluster):
    """The nodes of one test (plain torchrun agents), their worker records, and cleanup of
    everything started."""

    def __init__(self, tmp: Path) -> None:
        options = AgentOptions(torchrun=True, join_timeout=60, monitor_interval=0.5)
        super().__init__(tmp, options=options, env=node_env())
        self.tmp = tmp
        self.records = tmp / "records.jsonl"
        self.stop_file = tmp / "stop"

    def start(
        self,
        name: str,
        endpoint: str,
        run_id: str,
        nnodes: str,
        backend: str = ETCD_V3,
        conf: str | None = None,
        max_restarts: int = 3,
        script: list[str] | None = None,
        nproc: int = 1,
    ) -> Node:
        """Start node ``name``; ``conf`` None: the fast-failover settings, 60 s to join."""
        return super().start(
            name,
            worker=script or [str(WORKER), str(self.records), str(self.stop_file)],
            endpoint=endpoint,
            run_id=run_id,
            extra_env={"TEST_NODE": name},
            nnodes=nnodes,
            nproc=nproc,
            backend=backend,
            rdzv_conf=conf,
            max_restarts=max_restarts,
        )

    def formed(self, world: int | None = None) -> list[dict[str, Any]]:
        recs = [r for r in events.read(self.records) if r["event"] == "formed"]
        return [r for r in recs if world is None or r["world"] == world]

    def stop(self) -> None:
        self.stop_file.touch()

    def worker_pids(self) -> set[int]:
        return {r["pid"] for r in events.read(self.records)}

    def kill_node_of(self, record: dict[str, Any]) -> None:
        """kill -9 a whole node: its agent and its worker."""
        kill_pid(record["agent_pid"])
        kill_pid(record["pid"])

    def logs(self, tail: int = 3000) -> str:
        return super().logs(tail)

    def cleanup(self) -> None:
        self.close()


def per_algorithm(cluster: Cluster, request: pytest.FixtureRequest) -> Cluster:
    """Every etcd-v3 node of these tests runs once per rendezvous algorithm (``algorithm=``
    appended to its --rdzv-conf); c10d baselines run once."""
    algorithm = request.param
    callspec = getattr(request.node, "callspec", None)
    if (
        callspec is not None
        and callspec.params.get("backend") == "c10d"
        and algorithm != SINGLE_KEY
    ):
        pytest.skip("c10d has no rendezvous algorithm option")
    # Both spelled out: the tests must not depend on which algorithm is the default.
    start = cluster.start

    def start_with(*args: Any, conf: str | None = None, **kwargs: Any) -> Node:
        if kwargs.get("backend", ETCD_V3) == ETCD_V3:
            conf = f"{FAST_CONF if conf is None else conf},algorithm={algorithm}"
        return start(*args, conf=conf, **kwargs)

    cluster.start = start_with  # type: ignore[method-assign]
    return cluster


def announce_only(request: pytest.FixtureRequest, why: str) -> None:
    """Skip the single-key run of a test of what only announce does: single-key is torch's
    stock handler (elastic.rendezvous.handler), which ``why``."""
    if request.node.callspec.params.get("cluster") == SINGLE_KEY:
        pytest.skip(f"single-key is torch's own handler, which {why}")
