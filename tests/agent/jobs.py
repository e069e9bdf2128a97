"""Run our CNN worker under real elastic-agent processes and read what happened."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from typing import Any

from elastic import env
from elastic.procs import WORKER_NAME, descendants
from elastic.procs import name as proc_name
from tests.helpers import PYTHON, REPO, Node, kill_pid, node_env, pid_alive, read_jsonl

# A small learning rate keeps float-summation differences between world sizes from growing
# chaotically over 100 steps (measured: 1.2e-7 at lr 0.005, 9e-3 at tiny.yaml's 0.05).
LR = 0.005
FAST_CONF = "join_timeout=90,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"


# Largest relative L2 difference allowed between any tensor of a faulted job's final model
# and the fault-free world-1 run's. Measured: the reordered float sums of world sizes 1-3
# leave 3e-5..1.1e-4 after 60-100 steps at LR; one step more or less at mid-training changes
# some tensor by 5e-2. The threshold sits a decade from both.
MODEL_RTOL = 1e-3


def assert_models_match(final: dict[str, Any], reference: dict[str, Any]) -> None:
    """``final`` equals ``reference`` up to float summation order (see :data:`MODEL_RTOL`)."""
    assert final.keys() == reference.keys(), "the final checkpoint has other parameters"
    for key, ref in reference.items():
        if not ref.is_floating_point():
            assert (final[key] == ref).all(), key
            continue
        rel = float((final[key] - ref).norm() / ref.norm().clamp_min(1e-12))
        assert rel < MODEL_RTOL, f"{key} differs from the fault-free run by {rel:.1e} (relative)"


class Job:
    """Agents of one run, its event log and checkpoints, and cleanup of every process."""

    def __init__(self, tmp: Path, endpoint: str, run_id: str, max_steps: int = 100) -> None:
        self.tmp, self.endpoint, self.run_id, self.max_steps = tmp, endpoint, run_id, max_steps
        self.event_log = tmp / "events.jsonl"
        self.nodes: dict[str, Node] = {}

    def start(
        self,
        name: str,
        nnodes: str = "1:3",
        max_restarts: int = 3,
        netns: str | None = None,
        addr: str = "127.0.0.1",
        **cfg: Any,
    ) -> Node:
        """Start one agent (inside network namespace ``netns`` when given)."""
        overrides = {
            "job.run_id": self.run_id,
            "job.max_steps": self.max_steps,
            "job.log_every": 1,
            "job.min_step_s": 0.4,
            "job.sample_ledger": True,
            "optimizer.lr": LR,
            "checkpoint.url": self.tmp / "ckpt",
            "checkpoint.interval": 5,
            **cfg,
        }
        argv = [
            PYTHON,
            "-m",
            "agents.launch",
            f"--nnodes={nnodes}",
            "--nproc-per-node=1",
            f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={self.run_id}",
            f"--rdzv-conf={FAST_CONF}",
            f"--max-restarts={max_restarts}",
            "--monitor-interval=0.3",
            f"--local-addr={addr}",
            "-m",
            "elastic.training.worker",
            "--config",
            str(REPO / "configs" / "tiny.yaml"),
            *(f"{k}={v}" for k, v in overrides.items()),
        ]
        environ = node_env(**{env.EVENT_LOG: str(self.event_log)})
        if netns:
            argv = ["ip", "netns", "exec", netns, *argv]
            environ["GLOO_SOCKET_IFNAME"] = "eth0"
        self.nodes[name] = Node(name, argv, self.tmp, environ)
        return self.nodes[name]

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in read_jsonl(self.event_log) if e.get("kind") == kind]

    def steps(self) -> list[dict[str, Any]]:
        return self.events("train.step")

    def last_step(self) -> int:
        steps = self.steps()  # the newest step, not the highest: a rollback goes back
        return steps[-1]["step"] if steps else 0

    def worlds_after(self, ts: float) -> list[int]:
        return [e["world_size"] for e in self.steps() if e["ts"] > ts]

    def worker_pids(self) -> set[int]:
        return {e["pid"] for e in read_jsonl(self.event_log) if "pid" in e} - {
            n.pid for n in self.nodes.values()
        }

    def workers_of(self, name: str) -> list[int]:
        """The live worker pids under node ``name``'s agent (however deep they sit)."""
        return [p for p in descendants(self.nodes[name].pid) if proc_name(p) == WORKER_NAME]

    def final_model(self, url: Path | None = None, run_id: str | None = None) -> dict[str, Any]:
        """The model state of the newest complete checkpoint."""
        import torch.distributed.checkpoint as dcp

        from elastic.checkpoint import find_latest_complete
        from elastic.checkpoint.storage import make_reader
        from elastic.training.config import load_config
        from elastic.training.model import build_model

        info = find_latest_complete(str(url or self.tmp / "ckpt"), run_id or self.run_id)
        assert info is not None and info.step == self.max_steps, info
        cfg = load_config(REPO / "configs" / "tiny.yaml", [])
        state = {"model": build_model(cfg.model).state_dict()}
        dcp.load(state, storage_reader=make_reader(info.url))
        return state["model"]

    def reference_model(self) -> dict[str, Any]:
        """Train the same job fault-free in one process (world 1) and return its model."""
        url = self.tmp / "reference"
        argv = [
            PYTHON,
            "-m",
            "elastic.training.worker",
            "--config",
            str(REPO / "configs" / "tiny.yaml"),
            f"job.run_id={self.run_id}",
            f"job.max_steps={self.max_steps}",
            f"checkpoint.url={url}",
            "checkpoint.interval=1000",
            f"optimizer.lr={LR}",
        ]
        environ = {k: v for k, v in node_env().items() if k != env.EVENT_LOG}
        subprocess.run(argv, env=environ, cwd=REPO, check=True, capture_output=True, timeout=300)
        return self.final_model(url)

    def ledger(self) -> list[int]:
        """Sample indices of the trajectory that survived (a redone step replaces the old)."""
        per_step: dict[tuple[int, int], list[int]] = {}
        for e in self.events("train.samples"):
            per_step[(e["step"], e["rank"], e["world_size"])] = e["indices"]
        latest: dict[int, tuple[int, list[int]]] = {}
        for (step, _rank, world), indices in per_step.items():
            latest.setdefault(step, (world, []))
            if latest[step][0] != world:
                latest[step] = (world, [])
            latest[step][1].extend(indices)
        return [i for _, (_, indices) in sorted(latest.items()) for i in indices]

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{node.output()[-4000:]}" for n, node in self.nodes.items())

    def cleanup(self) -> list[int]:
        """Kill everything still running; return the worker pids that were left behind."""
        for node in self.nodes.values():
            node.kill(signal.SIGKILL)
            node.proc.wait(10)
        orphans = [pid for pid in self.worker_pids() if pid_alive(pid)]
        for pid in orphans:
            kill_pid(pid)
        return orphans
