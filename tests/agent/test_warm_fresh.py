"""A warm-forked script is the fresh process torchrun would start (issue 26, item 3).

The same probe (tests/scripts/fresh_probe.py, 2 local ranks, one restart) runs under plain
torchrun (``python -m torch.distributed.run --standalone``) and under our agent, whose
workers fork from its fork server; each test compares one thing the script can observe.
No etcd: both use torch's c10d rendezvous (the warm start does not depend on it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO, node_env, wait_until

pytestmark = pytest.mark.system  # agents and torchrun, real processes
PROBE = str(REPO / "tests" / "scripts" / "fresh_probe.py")
COMMON = ["--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.1"]
LAUNCHERS = {
    "torchrun": ["-m", "torch.distributed.run", "--standalone"],
    "warm": [
        "-m",
        "elastic.agent.launch",
        "--nnodes=1",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:0",
    ],
}


def _starts(out: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]


@pytest.fixture(scope="module")
def seen(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, list[dict[str, Any]]]]:
    """Both launchers at once; what each of their 4 worker starts saw."""
    runs = {}
    for name, launcher in LAUNCHERS.items():
        out = tmp_path_factory.mktemp(name)
        log = (out / "agent.log").open("w")
        argv = [sys.executable, *launcher, *COMMON, PROBE, str(out)]
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=node_env(),
            cwd=REPO,
        )
        runs[name] = (proc, out, log)
    try:
        for name, (proc, out, _) in runs.items():
            wait_until(lambda p=proc: p.poll() is not None, 240, f"the {name} job to end")  # type: ignore[misc]
            assert proc.returncode == 0, (out / "agent.log").read_text()[-4000:]
        result = {name: _starts(out) for name, (_, out, _) in runs.items()}
        assert [len(v) for v in result.values()] == [4, 4], result
        assert [s["preloaded"] for s in result["warm"]] == [True] * 4, "not forked warm"
        assert [s["preloaded"] for s in result["torchrun"]] == [False] * 4
        yield result
    finally:
        for proc, _, log in runs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()


def test_multiprocessing_context_is_unset_as_under_torchrun(
    seen: dict[str, list[dict[str, Any]]],
) -> None:
    for starts in seen.values():
        assert [s["start_method"] for s in starts] == [None] * 4
        first, restart = starts[:2], starts[2:]  # files sort by restart first
        assert [s["set_spawn"] for s in first] == ["ok", "ok"]  # the script may choose spawn
        # a lambda in a dataset: the default start method forks, nothing is pickled
        assert [s["data_loader"] for s in restart] == ["ok", "ok"]


@pytest.mark.parametrize("generator", ["random", "numpy", "torch"])
def test_random_generators_are_seeded_per_process_as_under_torchrun(
    seen: dict[str, list[dict[str, Any]]], generator: str
) -> None:
    for name, starts in seen.items():
        draws = [s[generator] for s in starts]
        # 2 ranks x 2 starts: distinct per process and per restart (never the server's)
        assert len(set(draws)) == len(draws) == 4, (name, generator, draws)


def test_no_inherited_descriptors_beyond_torchruns(
    seen: dict[str, list[dict[str, Any]]],
) -> None:
    torchrun = {tuple(s["fds"]) for s in seen["torchrun"]}
    assert torchrun == {(0, 1, 2)}, seen["torchrun"]
    for s in seen["warm"]:
        assert tuple(s["fds"]) in torchrun, s["fd_targets"]
