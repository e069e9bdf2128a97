"""A chaos run's result: the report (``report.json`` in the run directory, printed as JSON
by ``elastic chaos``), its short human summary (:func:`table`), and what the storage
observer saw (``observations.json``)."""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from elastic_tools.chaos.fault import Fault
from elastic_tools.chaos.invariants import Verdict
from elastic_tools.chaos.job import ChaosJob
from elastic_tools.chaos.observers import Observations
from elastic_tools.harness.cluster import provenance


def build_report(
    job: ChaosJob,
    faults: Sequence[Fault],
    verdict: Verdict,
    results: Mapping[str, Sequence[Mapping[str, Any]]],
    times: tuple[float, float],
    codes: Mapping[str, int | None],
) -> dict[str, Any]:
    """The report of a run that started and ended at ``times`` (its keys in this order);
    ``results``: what the stale writers and the rogue members reported, by kind."""
    started, ended = times
    opts = job.opts
    return {
        "run_id": job.run_id,
        "run_dir": str(job.run_dir),
        "seed": opts.seed,
        "minutes": opts.minutes,
        "every_s": opts.every_s,
        "max_steps": job.max_steps,
        "etcd_members": len(job.members),
        "wall_s": round(ended - started, 1),
        "faults": len(faults),
        "faults_by_kind": faults_by_kind(faults),
        "skipped_kinds": job.skipped,
        **recovery_figures(faults),
        "time": effective(job.tail.of("train.step"), started, opts.step_s),
        "worst_model_rel_l2": verdict.worst_model_rel_l2,
        "loss_drift": verdict.loss_drift,
        "model_drift": verdict.model_drift,
        "exit_codes": dict(codes),
        "invariants": verdict.checks,
        "ok": verdict.ok,
        "fault_log": [f.as_dict() for f in faults],
        "stale_writers": list(results.get("stale_writer", ())),
        "rogue_members": list(results.get("rogue_member", ())),
        "provenance": provenance(),
    }


def faults_by_kind(faults: Sequence[Fault]) -> dict[str, dict[str, int]]:
    """Per kind: how many were injected, hit, only attempted, recovered."""
    by_kind: dict[str, dict[str, int]] = {}
    for f in faults:
        k = by_kind.setdefault(f.kind, {"injected": 0, "hit": 0, "attempted": 0, "recovered": 0})
        k["injected"] += 1
        k["hit" if f.hit else "attempted"] += 1
        k["recovered"] += f.recover_s is not None and not f.error
    return by_kind


def recovery_figures(faults: Sequence[Fault]) -> dict[str, Any]:
    """How many faults the job recovered from, how fast, and the steps it lost."""
    recs = [f.recover_s for f in faults if f.recover_s is not None]
    lost = [f.steps_lost for f in faults if f.steps_lost is not None]
    return {
        "recoveries": len(recs),
        "recover_s": {
            "mean": round(statistics.fmean(recs), 2) if recs else None,
            "worst": max(recs) if recs else None,
        },
        "steps_lost": {"total": sum(lost), "worst": max(lost, default=0)},
    }


def effective(steps: list[dict[str, Any]], wall_start: float, step_s: float) -> dict[str, float]:
    """Seconds spent on kept steps (each final attempt of a step), over the wall time."""
    if not steps:
        return {"effective": 0.0}
    final = {e["step"]: i for i, e in enumerate(steps)}
    cost = _step_costs(steps)
    typical = statistics.median(list(cost.values())) if cost else step_s
    kept = sum(cost.get(i, typical) for i in final.values())
    first = steps[0]["ts"] - typical
    wall = steps[-1]["ts"] - first
    return {
        "effective": round(kept / wall, 4) if wall > 0 else 0.0,
        "kept_step_s": round(kept, 1),
        "training_wall_s": round(wall, 1),
        "typical_step_s": round(typical, 3),
        "startup_s": round(first - wall_start, 1),
    }


def _step_costs(steps: list[dict[str, Any]]) -> dict[int, float]:
    """Event index -> the seconds since the same process's previous step (where it trained
    the step before)."""
    prev_by_pid: dict[int, dict[str, Any]] = {}
    cost: dict[int, float] = {}
    for i, e in enumerate(steps):
        prev = prev_by_pid.get(e["pid"])
        if prev is not None and prev["step"] == e["step"] - 1:
            cost[i] = e["ts"] - prev["ts"]
        prev_by_pid[e["pid"]] = e
    return cost


def write_observations(seen: Observations, path: Path) -> None:
    out = dataclasses.asdict(seen)
    out["markers"] = {k: sorted(v) for k, v in out["markers"].items()}
    path.write_text(json.dumps(out, indent=1) + "\n")


def table(report: Mapping[str, Any]) -> str:
    """A short human summary of a report."""
    t = report["time"]
    rec = report["recover_s"]
    lines = [
        f"chaos run {report['run_id']}  seed {report['seed']}  {report['wall_s']:.0f} s wall, "
        f"{report['max_steps']} steps, etcd members {report['etcd_members']}",
        f"{'kind':<18}{'injected':>9}{'hit':>5}{'attempted':>10}{'recovered':>10}",
    ]
    for kind, k in sorted(report["faults_by_kind"].items()):
        lines.append(
            f"{kind:<18}{k['injected']:>9}{k['hit']:>5}{k['attempted']:>10}{k['recovered']:>10}"
        )
    lines.append(
        f"recover: mean {rec['mean']} s, worst {rec['worst']} s; steps lost: "
        f"{report['steps_lost']['total']} (worst {report['steps_lost']['worst']}); "
        f"effective time {t.get('effective', 0):.1%}"
    )
    lines += _invariant_lines(report)
    return "\n".join(lines)


def _invariant_lines(report: Mapping[str, Any]) -> list[str]:
    lines = []
    for c in report["invariants"]:
        mark = "ok  " if c["ok"] else "FAIL"
        lines.append(f"{mark} {c['invariant']} ({c['checks']} checks)")
        lines.extend(f"       {p}" for p in c["problems"])
    for kind, why in report["skipped_kinds"].items():
        lines.append(f"skipped {kind}: {why}")
    return lines


__all__ = [
    "build_report",
    "effective",
    "faults_by_kind",
    "recovery_figures",
    "table",
    "write_observations",
]
