"""Failure-time snapshots: a survivor of a kill -9 loses no completed step; a torn
state is never written; the "auto" interval."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic.errors import ConfigError
from elastic.worker.jit import AUTO, PROBE_SNAPSHOTS, PROBE_STEPS, AutoInterval, parse_every
from elastic.worker.snapshot import SnapshotStore
from tests.helpers import REPO

SCRIPT = str(Path(__file__).with_name("jit_worker.py"))
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
TOTAL = 12
KILL_AT = 7  # rank 1 dies inside step index 7: steps 0..6 (7 steps) completed


def _spawn(*args: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, SCRIPT, *map(str, args)],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(procs: list[subprocess.Popen[str]], timeout: float = 180) -> list[tuple[int, str]]:
    done = []
    for proc in procs:
        try:
            out = proc.communicate(timeout=timeout)[0]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        done.append((proc.returncode, out))
    return done


def _pair(root: Path, phase: str, kill_at: int = -1) -> list[tuple[int, str]]:
    out = root / phase
    out.mkdir(parents=True)
    return _finish([_spawn("pair", r, 2, out, TOTAL, kill_at) for r in range(2)])


def _result(out: Path, rank: int) -> dict[str, Any]:
    return json.loads((out / f"result-{rank}.json").read_text())


def _newest(directory: Path) -> int | None:
    store = SnapshotStore("jit", 0, owner=1, directory=str(directory))
    found = store.newest()
    store.close()
    return found[1].step if found else None


@pytest.mark.slow
def test_survivor_of_a_kill_9_loses_no_completed_step(tmp_path: Path) -> None:
    ref = _pair(tmp_path / "ref", "run")
    assert [code for code, _ in ref] == [0, 0], "\n".join(o[-2000:] for _, o in ref)

    crashed = _pair(tmp_path / "jit", "first", KILL_AT)
    logs = "\n".join(o[-3000:] for _, o in crashed)
    assert crashed[1][0] == -signal.SIGKILL, logs
    assert crashed[0][0] not in (0, None), logs  # the survivor's collective failed
    assert f"Wrote the state of step {KILL_AT}" in crashed[0][1], logs
    assert _newest(tmp_path / "jit" / "node0") == KILL_AT, "the survivor holds the last step"
    assert _newest(tmp_path / "jit" / "node1") is None, "periodic snapshots were off"

    resumed = _pair(tmp_path / "jit", "second")
    logs = "\n".join(o[-3000:] for _, o in resumed)
    assert [code for code, _ in resumed] == [0, 0], logs
    starts = [_result(tmp_path / "jit" / "second", r) for r in range(2)]
    assert [s["step"] for s in starts] == [KILL_AT, KILL_AT], starts  # 0 steps lost
    assert sorted(s["source"] for s in starts) == ["memory", "peer"], starts
    for rank in range(2):  # each rank's BatchNorm buffers hold its own last batch
        want = torch.load(tmp_path / "ref" / "run" / f"final-{rank}.pt")
        got = torch.load(tmp_path / "jit" / "second" / f"final-{rank}.pt")
        for key, value in want.items():
            assert torch.equal(got[key], value), f"rank {rank}: {key} differs from the reference"


@pytest.mark.integration
@pytest.mark.parametrize(
    ("every", "how", "newest"),
    [(1, "torn", 3), (10**6, "torn", None), (10**6, "after", 4)],
    ids=["torn-keeps-previous", "torn-writes-nothing", "after-step-advances"],
)
def test_a_failure_writes_only_whole_states(
    tmp_path: Path, every: int, how: str, newest: int | None
) -> None:
    ((code, out),) = _finish([_spawn("single", tmp_path, every, 3, how)], timeout=120)
    assert code == 1, out[-3000:]
    assert "RuntimeError" in out, out[-3000:]
    assert _newest(tmp_path) == newest, out[-3000:]
    if how == "torn":
        assert "the state is torn" in out, out[-3000:]


def test_parse_every() -> None:
    assert parse_every("auto") == parse_every(None) == AUTO
    assert parse_every("0") == 0 and parse_every(7) == 7
    for bad in ("-1", "often"):
        with pytest.raises(ConfigError, match="is not 'auto' or a step count"):
            parse_every(bad)


@pytest.mark.parametrize(("cost", "step", "interval"), [(0.001, 0.1, 1), (0.04, 0.1, 16)])
def test_auto_interval_keeps_the_cost_in_budget(cost: float, step: float, interval: int) -> None:
    auto = AutoInterval(budget=0.025)
    for n in range(1, 100):
        if auto.interval is not None:
            break
        if auto.due(n):
            auto.observe(0.0, cost)
        else:
            auto.observe(step, None)
    assert auto.interval == interval
    assert len(auto.costs) == PROBE_SNAPSHOTS and len(auto.steps) == PROBE_STEPS
