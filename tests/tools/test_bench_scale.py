"""bench/scale.py, the parts that need no cluster (milliseconds): the job's batch at N nodes,
the correctness of a run's step records, the summary's median / p90 and the run order."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def scale() -> ModuleType:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_scale", BENCH / "scale.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("n", "batch"), [(3, 12), (4, 12), (8, 56), (16, 240)])
def test_the_global_batch_divides_among_n_and_n_minus_1(
    scale: ModuleType, n: int, batch: int
) -> None:
    got, samples = scale.job(n)
    assert got == batch
    assert got % n == 0 and got % (n - 1) == 0
    assert samples == batch * scale.STEPS_PER_EPOCH


def _records(
    steps: int, world: int, batch: int, samples: int, rnd: int = 1
) -> list[dict[str, Any]]:
    """A fault-free run's records: step s uses samples s*batch .. (s+1)*batch - 1 (mod
    samples), split among ``world`` ranks."""
    out = []
    for step in range(steps):
        first = (step * batch) % samples
        idx = list(range(first, first + batch))
        share = batch // world
        for rank in range(world):
            out.append(
                {"step": step, "round": rnd, "rank": rank, "world": world,
                 "idx": idx[rank * share : (rank + 1) * share]}
            )  # fmt: skip
    return out


def test_a_fault_free_run_is_correct(scale: ModuleType) -> None:
    records = _records(10, 3, 6, 24)  # 4 steps an epoch: 2 complete epochs
    got = scale.correctness(records, list(range(1, 11)), 6, 24)
    assert got["ok"] and got["no_step_redone"] and got["samples_once"]
    assert got["steps_checked"] == 10


def test_a_failed_attempt_redone_in_a_later_round_counts_once(scale: ModuleType) -> None:
    records = _records(4, 3, 6, 24)
    # step 2 was first tried at world 3 in round 1, then redone at world 2 in round 2 with
    # the same samples: the round-2 attempt is the one kept
    retry = [r for r in _records(4, 2, 6, 24, rnd=2) if r["step"] == 2]
    failed = [{**r, "idx": [0]} for r in records if r["step"] == 2]  # whatever it held
    records = [r for r in records if r["step"] != 2] + failed + retry
    assert scale.kept(records)[2] == {0: [12, 13, 14], 1: [15, 16, 17]}
    assert scale.correctness(records, [1, 2, 3, 4], 6, 24)["ok"]


def test_a_quorum_not_yet_known_is_the_oldest_round(scale: ModuleType) -> None:
    records = [
        {"step": 0, "round": None, "rank": 0, "idx": [9]},
        {"step": 0, "round": 3, "rank": 0, "idx": [1]},
    ]
    assert scale.kept(records) == {0: {0: [1]}}


def test_a_redone_completed_step_is_caught(scale: ModuleType) -> None:
    got = scale.correctness(_records(6, 3, 6, 24), [1, 2, 3, 3, 4, 5, 6], 6, 24)
    assert not got["ok"] and not got["no_step_redone"] and got["samples_once"]
    assert "recorded again" in got["problems"][0]


def test_a_sample_used_twice_is_caught(scale: ModuleType) -> None:
    records = _records(4, 3, 6, 24)
    records[-1]["idx"] = records[0]["idx"]  # step 3, rank 2 trains step 0's first share
    got = scale.correctness(records, [1, 2, 3, 4], 6, 24)
    assert not got["ok"] and got["no_step_redone"] and not got["samples_once"]


def test_a_missing_share_is_caught(scale: ModuleType) -> None:
    records = [r for r in _records(4, 3, 6, 24) if (r["step"], r["rank"]) != (1, 1)]
    got = scale.correctness(records, [1, 2, 3, 4], 6, 24)
    assert not got["ok"]
    assert any("ranks [0, 2]" in p for p in got["problems"])


def test_steps_not_completed_are_not_checked(scale: ModuleType) -> None:
    records = _records(5, 3, 6, 24)
    records = [r for r in records if (r["step"], r["rank"]) != (4, 2)]  # cut short at the end
    assert scale.correctness(records, [1, 2, 3, 4], 6, 24)["ok"]


def test_p90_and_the_figure(scale: ModuleType) -> None:
    assert scale.p90([1.0]) == 1.0
    assert scale.p90([float(i) for i in range(1, 11)]) == pytest.approx(9.1)
    few = scale.figure([0.3, None, 0.1, 0.2])
    assert few == {"n": 3, "median": 0.2, "min": 0.1, "max": 0.3, "missing": 1}
    many = scale.figure([0.1, 0.2, 0.3, 0.4, 0.5])
    assert many["p90"] == pytest.approx(0.46) and many["median"] == 0.3


def _run(system: str, n: int, kill: float, ok: bool = True) -> dict[str, Any]:
    events = [
        {"kind": "kill", "recover_s": kill},
        {"kind": "join", "recover_s": 2.0, "pause_s": 0.1},
        {"kind": "leave", "recover_s": 0.5},
    ]
    return {
        "system": system,
        "nodes": n,
        "ok": True,
        "correct": {"ok": ok},
        "figures": {
            "kill_s": kill,
            "leave_s": 0.5,
            "join_pause_s": 0.1,
            "join_first_step_s": 2.0,
        },
        "events": events,
    }


def test_figures_of_a_run(scale: ModuleType) -> None:
    got = scale.figures_of(_run("x", 3, 0.25)["events"])
    assert got == {"kill_s": 0.25, "leave_s": 0.5, "join_pause_s": 0.1, "join_first_step_s": 2.0}
    assert scale.figures_of([])["kill_s"] is None


def test_summary_per_size_and_system(scale: ModuleType) -> None:
    runs = [
        _run("mlp-inplace", 3, 0.2),
        _run("torchft", 3, 1.0),
        _run("mlp-inplace", 3, 0.4, ok=False),
        _run("torchft", 3, 1.2),
        _run("mlp-inplace", 8, 0.3),
    ]
    summary = scale.summarize(runs)
    assert sorted(summary) == ["3", "8"]
    cell = summary["3"]["mlp-inplace"]
    assert cell["runs"] == 2 and cell["correct"] == 1 and cell["complete"] == 2
    assert cell["kill_s"]["median"] == pytest.approx(0.3)
    assert "elastic.Run" in cell["path"]
    assert list(summary["8"]) == ["mlp-inplace"]
    ratios = scale.versus(summary)
    assert ratios["3"]["kill_s_elastic_over_torchft"] == pytest.approx(0.27)
    assert "8" not in ratios


def test_runs_are_interleaved(scale: ModuleType) -> None:
    assert scale.interleaved([3, 8], 2) == [
        (3, "mlp-inplace"),
        (3, "torchft"),
        (3, "mlp-inplace"),
        (3, "torchft"),
        (8, "mlp-inplace"),
        (8, "torchft"),
        (8, "mlp-inplace"),
        (8, "torchft"),
    ]


def test_a_stale_attempt_in_a_later_quorum_does_not_replace_the_committed_one(
    scale: ModuleType,
) -> None:
    # torchft: step 0 committed in quorum 1 (one replica); in quorum 3 two replicas not yet
    # healed tried step 0 again, did not commit, and were healed to a later step
    records = _records(2, 1, 6, 24)
    records += [{"step": s, "round": 1, "rank": 0, "committed": True} for s in (0, 1)]
    records += [{**r, "round": 3} for r in _records(1, 2, 6, 24)]
    assert scale.kept(records)[0] == {0: list(range(6))}
    assert scale.correctness(records, [1, 2], 6, 24)["ok"]
