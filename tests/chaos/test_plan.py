"""The fault plan: the kinds (the rogue member and the frozen etcd among them), which a run
can inject and why not, and the seeded schedule, pinned for the kinds that came before."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from elastic_tools.chaos.plan import (
    KINDS,
    REMOVES,
    ChaosOptions,
    available_kinds,
    choose_kinds,
    draw_faults,
    schedule,
)

NEW = ("rogue_member", "frozen_etcd")
# Every kind before the rogue member and the frozen etcd, in KINDS' order.
OLD = (
    "kill_agent",
    "kill_worker",
    "kill_in_save",
    "kill_after_fence",
    "kill_in_purge",
    "leave",
    "join",
    "stop_cont",
    "etcd_restart",
    "etcd_member",
    "storage_ro",
    "stale_writer",
    "cut_link",
)
CI = ("kill_in_save", "kill_after_fence", "stale_writer", "storage_ro", "etcd_member")


def test_the_new_kinds_come_after_the_old_ones() -> None:
    assert tuple(KINDS) == (*OLD, *NEW)
    assert not set(NEW) & REMOVES, "neither changes the number of agents"


def test_the_old_kinds_schedules_are_what_they_were_before_the_new_kinds() -> None:
    # Drawn by the plan before rogue_member and frozen_etcd existed (seed 1 is the long run
    # of docs/chaos.md: kill_in_save, etcd_member, kill_worker, kill_in_purge, storage_ro).
    expected = {
        1: ["kill_in_save", "etcd_member", "kill_worker", "kill_in_purge", "storage_ro"],
        2: ["kill_agent", "kill_worker", "stale_writer", "join", "leave"],
        5: ["etcd_member", "kill_in_purge", "leave", "etcd_restart", "join"],
    }
    for seed, faults in expected.items():
        assert schedule(random.Random(seed), ChaosOptions(seed=seed), OLD)[0] == faults, seed
    opts = ChaosOptions(seed=2, every_s=8.0, faults=6)
    faults, gaps = schedule(random.Random(2), opts, [*CI, "kill_in_purge"])
    assert faults == [
        "kill_in_save",
        "kill_in_purge",
        "etcd_member",
        "kill_after_fence",
        "storage_ro",
        "stale_writer",
    ]
    assert [round(g, 3) for g in gaps] == [9.133, 8.815, 7.079, 8.509, 8.513, 8.39]


def test_a_schedule_with_the_new_kinds_is_seeded_and_holds_them() -> None:
    kinds = list(KINDS)
    a = schedule(random.Random(3), ChaosOptions(seed=3, faults=30), kinds)
    assert a == schedule(random.Random(3), ChaosOptions(seed=3, faults=30), kinds)
    assert set(NEW) <= set(a[0])
    b = draw_faults(random.Random(4), [*CI, *NEW], 7, 3, 2, 4)
    assert sorted(b) == sorted([*CI, *NEW]), "one shuffled round holds each kind once"


@pytest.mark.integration
def test_a_run_without_a_secret_skips_the_rogue_member_and_says_why(tmp_path: Path) -> None:
    kinds, skipped = available_kinds(3, secret=True)
    assert set(NEW) <= set(kinds) and not set(NEW) & set(skipped)
    kinds, skipped = available_kinds(3, secret=False)
    assert "rogue_member" not in kinds and "frozen_etcd" in kinds
    assert "no secret" in skipped["rogue_member"]
    opts = ChaosOptions(runs_dir=tmp_path, kinds=list(NEW), secret=False)
    kinds, skipped = choose_kinds(opts)
    assert kinds == ["frozen_etcd"] and "rogue_member" in skipped


@pytest.mark.integration
def test_a_single_etcd_still_gets_frozen(tmp_path: Path) -> None:
    kinds, skipped = choose_kinds(ChaosOptions(runs_dir=tmp_path, kinds=list(NEW), etcd_members=1))
    assert kinds == list(NEW)
    assert "etcd_member" in skipped, "a member loss of a single etcd is a full outage"
