"""Start simulated nodes (one torchrun agent process each) and watch their workers."""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path
from typing import Any

from tests.helpers import PYTHON, REPO, Node, kill_pid, node_env, pid_alive, read_jsonl

WORKER = REPO / "tests" / "scripts" / "allreduce_worker.py"
FAST_CONF = "join_timeout=60,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"


class Cluster:
    """The nodes of one test, their worker records, and cleanup of everything started."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.records = tmp / "records.jsonl"
        self.stop_file = tmp / "stop"
        self.nodes: list[Node] = []

    def start(
        self,
        name: str,
        endpoint: str,
        run_id: str,
        nnodes: str,
        backend: str = "etcd-v3",
        conf: str = FAST_CONF,
        max_restarts: int = 3,
        script: list[str] | None = None,
        nproc: int = 1,
    ) -> Node:
        argv = [
            PYTHON,
            "-m",
            "torch.distributed.run",
            f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc}",
            f"--rdzv-backend={backend}",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_id}",
            f"--rdzv-conf={conf}",
            f"--max-restarts={max_restarts}",
            "--monitor-interval=0.5",
            "--local-addr=127.0.0.1",
            *(script or [str(WORKER), str(self.records), str(self.stop_file)]),
        ]
        node = Node(name, argv, self.tmp, node_env(TEST_NODE=name))
        self.nodes.append(node)
        return node

    def formed(self, world: int | None = None) -> list[dict[str, Any]]:
        recs = [r for r in read_jsonl(self.records) if r["event"] == "formed"]
        return [r for r in recs if world is None or r["world"] == world]

    def stop(self) -> None:
        self.stop_file.touch()

    def worker_pids(self) -> set[int]:
        return {r["pid"] for r in read_jsonl(self.records)}

    def kill_node_of(self, record: dict[str, Any]) -> None:
        """kill -9 a whole node: its agent and its worker."""
        kill_pid(record["agent_pid"])
        kill_pid(record["pid"])

    def logs(self) -> str:
        return "\n".join(f"--- {n.name}\n{n.output()[-3000:]}" for n in self.nodes)

    def cleanup(self) -> None:
        for node in self.nodes:
            node.kill(signal.SIGKILL)
            with contextlib.suppress(Exception):
                node.wait(10)
        for pid in self.worker_pids():
            if pid_alive(pid):
                kill_pid(pid)
