"""Throughput with one slowed node, the straggler policy off vs on, in the same run (issue 28).

The user's script (tests/scripts/inplace_user.py: DDP on ``elastic.Run``, in place) runs
under ``--nodes`` local ``elastic-agent`` nodes on an embedded etcd, three times:

* ``healthy``: ``nodes - 1`` nodes, nothing slowed (the world the policy leaves behind);
* ``off``: ``nodes`` nodes; from step ``--slow-after`` on the last node is slowed until the
  job ends: ``--mode work`` (default) makes its step's work ``--factor`` times as long (a
  slower device); ``--mode signal`` stops its worker ``--stop-ms`` of every
  ``--stop-ms + --run-ms`` (SIGSTOP/SIGCONT, far under the agent's 3 s frozen-worker limit;
  its readings depend on where the stops land, see tests/recovery/test_straggler.py);
* ``on``: the same with ``ELASTIC_STRAGGLER=X,K``: the node is named and dropped in place.

Every run sets ``ELASTIC_STRAGGLER_MIN_SLOW_S`` to ``--min-slow-s`` (0.2 s: the K slow steps
of ~0.1 s cross it, so K decides, as before that option; its default, 10 s, would name the
node only some 100 steps after the slowing).

Prints JSON: steps per second of each phase (healthy, slowed, after the drop: from 10 steps
after the first step without the node), the steps from the slowing to ``straggler.detected``,
the seconds from it to the first step without the node, the ratio reported, the settings, the
git commit and the load average.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from elastic.etcd.server import start_etcd
from elastic.node.procs import descendants
from elastic_tools.harness.benchjson import output
from elastic_tools.harness.cluster import AgentOptions, LocalCluster, agent_env, provenance

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.recovery.test_straggler import SLOW_ENV, DutyCycle  # noqa: E402

WRAPPER = REPO / "tests" / "recovery" / "test_straggler.py"  # the user's script, slowed

SAMPLES, BATCH = 240, 12


def _quantiles(values: list[float]) -> dict[str, Any]:
    """n, median, p90, p99 and max of ``values`` (None each when there are none)."""
    v = sorted(values)
    if not v:
        return {"n": 0, "median": None, "p90": None, "p99": None, "max": None}
    at = lambda q: round(v[min(len(v) - 1, int(q * len(v)))], 3)  # noqa: E731
    return {"n": len(v), "median": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": v[-1]}


def rate(steps: list[dict[str, Any]]) -> float | None:
    """Steps per second over ``steps`` (train.step events in order)."""
    if len(steps) < 3:
        return None
    took = steps[-1]["ts"] - steps[0]["ts"]
    return round((len(steps) - 1) / took, 3) if took > 0 else None


def one(
    base: Path, endpoint: str, name: str, nodes: int, slow: bool, policy: str | None, a: Any
) -> dict[str, Any]:
    run_dir = base / name
    out = run_dir / "out"
    worker = [
        str(WRAPPER),
        f"--epochs={a.epochs}",
        f"--samples={SAMPLES}",
        f"--global-batch={BATCH}",
        f"--out={out}",
        f"--step-delay={a.step_delay}",
        f"--step-work={a.step_work}",
    ]
    extra = {"ELASTIC_STRAGGLER_MIN_NODES": "2", "ELASTIC_PROBATION": "off"}  # no rejoin
    extra["ELASTIC_STRAGGLER_MIN_SLOW_S"] = str(a.min_slow_s)
    if policy:
        extra["ELASTIC_STRAGGLER"] = policy
    cluster = LocalCluster(
        run_dir,
        f"bench-{uuid.uuid4().hex[:8]}",
        endpoint,
        options=AgentOptions(nnodes=f"2:{nodes}", join_timeout=120, max_restarts=3),
        env=agent_env(),
    )
    result: dict[str, Any] = {"nodes": nodes, "slowed": slow, "policy": policy}
    cycle: DutyCycle | None = None
    try:
        last_name = chr(ord("a") + nodes - 1)
        slowed_env = {**extra, SLOW_ENV: f"{a.factor:g},{a.slow_after}"}
        started = [
            cluster.start(
                chr(ord("a") + i),
                worker=worker,
                extra_env=slowed_env if slow and a.mode == "work" and i == nodes - 1 else extra,
            )
            for i in range(nodes)
        ]
        full = lambda: [e for e in cluster.steps() if e["world_size"] == nodes]  # noqa: E731
        cluster.wait_for(full, f"world {nodes}", 300)
        cluster.wait_for_step(a.slow_after - 1, 300)
        t_slow = time.time()
        if slow and a.mode == "signal":
            workers = cluster.worker_pids()
            last = cluster.nodes[last_name].pid
            cycle = DutyCycle(
                [p for p in descendants(last) if p in workers], a.stop_ms / 1e3, a.run_ms / 1e3
            )
            cycle.start()
        for node in started:
            node.wait(900)
    finally:
        if cycle is not None:
            cycle.stop()
        steps = cluster.steps()
        detected = cluster.events("straggler.detected")
        cluster.close()
    before = [e for e in steps if e["ts"] < t_slow][5:]
    result["healthy_steps_per_s"] = rate(before)
    after = [e for e in steps if e["ts"] >= t_slow]
    # the slowest rank's ratio to the median at each step: the noise X must clear, and
    # what a slowed node reads (each step's reading, not only the detected one's)
    result["healthy_top_ratio"] = _quantiles(
        [e["slowest"][0][1] for e in before if e.get("slowest")]
    )
    world = [e for e in after[3:] if e.get("slowest") and e["world_size"] == nodes]
    result["slowed_top_ratio"] = _quantiles([e["slowest"][0][1] for e in world]) if slow else None
    result["slowed_pids"] = cycle.pids if cycle is not None else []
    if detected:
        d = detected[0]
        result["detected_after_steps"] = len([e for e in after if e["ts"] < d["ts"]])
        result["ratio"] = d["ratio"]
        result["slowed_steps_per_s"] = rate([e for e in after if e["ts"] < d["ts"]])
        gone = [e for e in after if e["ts"] > d["ts"] and e["world_size"] == nodes - 1]
        if gone:
            result["drop_to_first_step_s"] = round(gone[0]["ts"] - d["ts"], 3)
            result["after_drop_steps_per_s"] = rate(gone[10:])
    else:
        result["slowed_steps_per_s" if slow else "steps_per_s"] = rate(after[5:])
    result["steps"] = len(steps)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--step-delay", type=float, default=0.03)
    p.add_argument(
        "--step-work", type=int, default=0, help="128x128 matrix products a step (CPU work)"
    )
    p.add_argument("--slow-after", type=int, default=40)
    p.add_argument("--stop-ms", type=float, default=20.0)
    p.add_argument("--run-ms", type=float, default=10.0)
    p.add_argument("--policy", default="2,3", help="ELASTIC_STRAGGLER for the 'on' run")
    p.add_argument(
        "--min-slow-s", type=float, default=0.2, help="ELASTIC_STRAGGLER_MIN_SLOW_S (every run)"
    )
    p.add_argument(
        "--mode",
        choices=("work", "signal"),
        default="work",
        help="work: the last node's step work takes --factor times as long from step "
        "--slow-after on; signal: a SIGSTOP/SIGCONT duty cycle of its worker",
    )
    p.add_argument("--factor", type=float, default=3.0)
    p.add_argument("--json-out", type=Path, default=None)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-straggler-") as tmp:
        base = Path(tmp)
        etcd = start_etcd(base / "etcd")
        try:
            runs = {
                "healthy": one(base, etcd.endpoint, "healthy", a.nodes - 1, False, None, a),
                "off": one(base, etcd.endpoint, "off", a.nodes, True, None, a),
                "on": one(base, etcd.endpoint, "on", a.nodes, True, a.policy, a),
            }
        finally:
            etcd.stop()
    healthy = runs["healthy"].get("steps_per_s")
    after = runs["on"].get("after_drop_steps_per_s")
    return output(
        {
            "bench": "straggler",
            "runs": runs,
            "after_drop_vs_healthy": round(after / healthy, 3) if after and healthy else None,
            "settings": vars(a) | {"json_out": str(a.json_out) if a.json_out else None},
            "provenance": provenance(),
            "loadavg": os.getloadavg(),
        },
        a.json_out,
    )


if __name__ == "__main__":
    raise SystemExit(main())
