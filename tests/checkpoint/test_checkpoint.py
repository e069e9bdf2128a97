"""Checkpoint layout and manager in one process: commit markers, corruption, purge, fences.

These run without a process group (DCP's single-process mode), against real
local files and fsspec's memory:// filesystem.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic.checkpoint import (
    COMMIT_MARKER,
    find_latest_complete,
    inspect_step,
    list_steps,
    step_url,
)
from elastic.checkpoint.manager import FENCE_TIMEOUT_S
from elastic.errors import CheckpointError
from elastic.etcd.client import EtcdClient, EtcdOptions, parse_endpoints
from elastic.etcd.server import EtcdServer
from elastic.rendezvous.fence import FenceSpec, RoundFence, publish_round
from elastic.rendezvous.keys import RunKeys

from .conftest import RUN, load_small, small_manager, small_state
from .flaky_fs import FAIL_ENV, register

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(params=["file", "memory"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "memory":
        return f"memory://ckpt-{uuid.uuid4().hex[:8]}"
    return str(tmp_path / "ckpt")


def test_save_then_load_roundtrip(url: str) -> None:
    manager = small_manager(url)
    for step in (1, 2):
        manager.save(step, small_state(float(step)))
    manager.close()
    step, state = load_small(small_manager(url))
    assert step == 2
    torch.testing.assert_close(state["model"]["w"], torch.full((64, 8), 2.0))
    assert state["train"] == {"step": 2, "epoch": 0, "consumed": 48}
    assert find_latest_complete(url, RUN).step == 2


def test_step_without_marker_is_never_loaded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = str(tmp_path / "ckpt")
    manager = small_manager(url)
    manager.save(1, small_state(1.0), block=True)
    manager.save(2, small_state(2.0), block=True)
    (tmp_path / "ckpt" / RUN / "step-2" / COMMIT_MARKER).unlink()
    with caplog.at_level(logging.WARNING):
        step, state = load_small(small_manager(url))
    assert step == 1 and state["train"]["step"] == 1
    assert "step-2: no commit marker" in caplog.text


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_shard_is_never_loaded(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    url = str(tmp_path / "ckpt")
    manager = small_manager(url)
    manager.save(1, small_state(1.0), block=True)
    manager.save(2, small_state(2.0), block=True)
    shard = next((tmp_path / "ckpt" / RUN / "step-2").rglob("*.distcp"))
    data = bytearray(shard.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        assert load_small(small_manager(url))[0] == 1
    expected = "truncated" if damage == "truncate" else "checksum mismatch"
    assert expected in caplog.text and "step-2" in caplog.text
    assert not inspect_step(url, RUN, 2).complete


def test_purge_keeps_last_and_never_the_newest_complete(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    partial = tmp_path / "ckpt" / RUN / "step-9"
    partial.mkdir(parents=True)  # an in-flight or crashed newer save
    manager = small_manager(url, keep_last=2)
    for step in range(1, 6):
        manager.save(step, small_state(float(step)))
    manager.close()
    assert list_steps(url, RUN) == [9, 5, 4]
    assert find_latest_complete(url, RUN, warn=False).step == 5


def test_refusing_fence_blocks_the_commit(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    manager = small_manager(url)
    manager.save(1, small_state(1.0), block=True)
    refuse = {"on": True}

    class Fence:  # a CommitFence that refuses commits while refuse["on"]
        round, job = 3, RUN
        kept: dict[int, dict[str, Any]] = {}

        def commit(self, step: int, record: dict[str, Any]) -> None:
            if refuse["on"]:
                raise RuntimeError("rendezvous round 3 is no longer current")
            self.kept[step] = record

        def check(self) -> None:
            pass

        def records(self) -> dict[int, dict[str, Any]]:
            return dict(self.kept)

        def forget(self, steps: Iterable[int]) -> None:
            for step in steps:
                self.kept.pop(step, None)

    manager.commit_fence = Fence()
    outcome = manager.save(2, small_state(2.0), block=True)
    assert not outcome.ok and "no longer current" in outcome.error
    assert find_latest_complete(url, RUN, warn=False).step == 1
    refuse["on"] = False
    assert manager.save(3, small_state(3.0), block=True).ok
    assert find_latest_complete(url, RUN).step == 3


def test_failing_storage_keeps_previous_and_stops_after_max(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    register()
    url = f"flaky://{tmp_path}/ckpt"
    manager = small_manager(url, max_failures=2)
    manager.save(1, small_state(1.0), block=True)
    monkeypatch.setenv(FAIL_ENV, "step-2,step-3")
    outcome = manager.save(2, small_state(2.0), block=True)
    assert not outcome.ok and "injected storage failure" in outcome.error
    assert manager.failures == 1
    assert find_latest_complete(url, RUN, warn=False).step == 1
    with pytest.raises(CheckpointError, match="2 checkpoint saves in a row failed"):
        manager.save(3, small_state(3.0), block=True)
    marker = json.loads((tmp_path / "ckpt" / RUN / "step-1" / COMMIT_MARKER).read_text())
    assert marker["step"] == 1 and step_url(url, RUN, 1).endswith("/r/step-1")


def test_leftovers_of_a_failed_attempt_are_replaced(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    leftover = tmp_path / "ckpt" / RUN / "step-2"
    leftover.mkdir(parents=True)
    (leftover / "__7_0.distcp").write_bytes(b"from a crashed 8-rank attempt")
    assert small_manager(url).save(2, small_state(2.0), block=True).ok
    assert not (leftover / "__7_0.distcp").exists()
    assert find_latest_complete(url, RUN).step == 2


def test_unreachable_storage_on_resume_is_a_checkpoint_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    manager = small_manager(str(blocker / "ckpt"))
    with pytest.raises(CheckpointError, match="Cannot list checkpoints under"):
        load_small(manager)


def test_an_etcd_outage_skips_saves_without_stalling_training(
    tmp_path: Path, own_etcd: EtcdServer, run_id: str
) -> None:
    keys = RunKeys("/elastic", run_id)
    with EtcdClient(EtcdOptions(parse_endpoints(own_etcd.endpoint)[0])) as client:
        publish_round(client, keys, 1)
    spec = FenceSpec(endpoints=own_etcd.endpoint, prefix="/elastic", run_id=run_id, round=1)
    url = str(tmp_path / "ckpt")
    manager = small_manager(url, max_failures=2)
    manager.commit_fence = RoundFence(spec)
    assert manager.save(1, small_state(1.0), block=True).ok
    assert own_etcd.proc is not None
    os.kill(own_etcd.proc.pid, signal.SIGSTOP)  # etcd hangs: requests get no answer
    try:
        stalls = []
        for step in (2, 3, 4, 5):
            started = time.perf_counter()
            manager.save(step, small_state(float(step)))  # async: waits for the previous save
            stalls.append(time.perf_counter() - started)
        outcome = manager.wait()
    finally:
        os.kill(own_etcd.proc.pid, signal.SIGCONT)
    assert outcome is not None and outcome.skipped and manager.failures == 0
    assert "etcd has not answered an earlier commit-fence call yet" in outcome.error
    assert stalls[1] < FENCE_TIMEOUT_S + 2.0  # save 2's one bounded wait for etcd
    assert max(stalls[2:]) < 1.0, stalls  # later saves skip at once
    assert find_latest_complete(url, RUN, warn=False).step == 1
    deadline = time.monotonic() + 60.0
    while not (done := manager.save(6, small_state(6.0), block=True)).ok:  # etcd answers again
        assert done.skipped and time.monotonic() < deadline, done.error
        threading.Event().wait(0.2)
    assert find_latest_complete(url, RUN, warn=False).step == 6
