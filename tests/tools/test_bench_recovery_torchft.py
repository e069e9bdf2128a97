"""bench/recovery.py's torchft baseline, the parts that need no cluster (milliseconds): the
refusal when torchft is missing, the torchft job's data split, the per-phase figures read
from the event log, the side-by-side ratios and the join trace's idle detection."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"


def _load(name: str) -> ModuleType:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def recovery() -> ModuleType:
    return _load("recovery")


@pytest.fixture(scope="module")
def user() -> ModuleType:
    return _load("torchft_user")


def test_refusal_names_the_pip_line(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = _load("torchft_cluster")
    monkeypatch.setattr(cluster.importlib.util, "find_spec", lambda name: None)
    refusal = cluster.missing()
    assert refusal is not None and cluster.INSTALL in refusal
    assert refusal.count(". ") == 0 and refusal.endswith(".")  # one sentence


def test_no_refusal_without_a_torchft_backend(recovery: ModuleType) -> None:
    assert recovery.torchft_refusal(["ours", "mlp-inplace"]) is None


@pytest.mark.parametrize("n", [1, 2, 3])
def test_shares_make_the_global_batch(user: ModuleType, n: int) -> None:
    """At any number of participants the shares of a step are that step's global batch."""
    for step in (0, 7, 99, 100, 250):
        whole = user.batch_indices(step, 1200, 12, 0, 1)
        shares = [user.batch_indices(step, 1200, 12, r, n) for r in range(n)]
        assert torch.equal(torch.cat(shares), whole)
        assert {len(s) for s in shares} == {12 // n}


class _Events:
    def __init__(self, evs: list[dict[str, Any]]) -> None:
        self.evs = evs

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.evs if kind is None or e["kind"] == kind]


def test_torchft_phases_of_a_join(recovery: ModuleType) -> None:
    t0 = 100.0
    cluster = _Events(
        [
            {"ts": 99.0, "kind": "tft.phase", "phase": "started"},  # before: not this event
            {"ts": 102.0, "kind": "tft.phase", "phase": "started"},
            {"ts": 103.5, "kind": "tft.phase", "phase": "ready"},
            {"ts": 103.6, "kind": "tft.phase", "phase": "quorum", "world_size": 3,
             "seconds": 0.1, "healed": True},
            {"ts": 103.61, "kind": "tft.phase", "phase": "quorum", "world_size": 3,
             "seconds": 0.02, "healed": False},
        ]
    )  # fmt: skip
    entry: dict[str, Any] = {"world": 3}
    recovery._torchft_phases(cluster, entry, t0, 104.0)
    assert entry == {
        "world": 3,
        "tft_started_s": 2.0,
        "tft_ready_s": 3.5,
        "tft_quorum_s": 3.61,
        "tft_quorum_took_s": 0.1,
        "tft_healed": True,
    }


def test_spread_by_phase_and_the_ratios(recovery: ModuleType) -> None:
    def run(backend: str, join: float, kill: float) -> dict[str, Any]:
        events = [
            {"kind": "join", "recover_s": join, "pause_s": 0.1, "tft_ready_s": 1.0},
            {"kind": "kill", "recover_s": kill, "steps_lost": 0},
        ]
        return {"backend": backend, "events": events, "worker_processes": 3}

    results = [run("mlp-inplace", 4.0, 0.2), run("mlp-inplace", 6.0, 0.4)]
    results += [run("torchft", 5.0, 1.0)]
    spread = recovery.spread(results, ["mlp-inplace", "torchft"])
    assert spread["mlp-inplace"]["join"]["recover_s"] == {"median": 5.0, "min": 4.0, "max": 6.0}
    assert spread["torchft"]["join"]["tft_ready_s"]["median"] == 1.0
    ratios = recovery.versus_torchft(spread)
    assert ratios["join_recover_s_mlp-inplace_over_torchft"] == 1.0
    assert ratios["kill_recover_s_mlp-inplace_over_torchft"] == 0.3
    assert ratios["leave_recover_s_mlp-inplace_over_torchft"] is None


def test_went_idle(recovery: ModuleType) -> None:
    busy_then_idle = [(0.0, 0.1), (0.02, 0.12), (0.04, 0.14), (0.6, 0.2)]
    assert recovery._went_idle(busy_then_idle) == 0.04
    assert recovery._went_idle([(0.0, 0.1), (0.1, 0.2)]) is None
