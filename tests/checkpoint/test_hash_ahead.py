"""Signed saves hash the SHA-256 tree's leaves once staged: the same digest, still checked."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from elastic.checkpoint import CheckpointManager, find_latest_complete
from elastic.checkpoint.config import CheckpointConfig
from elastic.checkpoint.digest import SHA256_TREE, TREE_CHUNK, LeafPlan, digest_of
from elastic.checkpoint.stager import Stager
from elastic.checkpoint.storage import FastSavePlanner, HashingWriter, filesystem
from tests.helpers import wait_until

from .conftest import RUN, assert_same_bytes, make_state, zeros_like
from .tamper import tensor_offset

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
SHARD = "__0_0.distcp"
BIG = TREE_CHUNK // 4 + 1000  # floats: a tensor a little over one tree leaf


def _state(seed: int, big: int = BIG) -> dict[str, Any]:
    state = make_state(seed)
    g = torch.Generator().manual_seed(seed)
    state["model"]["big"] = torch.randn(big, generator=g)
    state["optim"]["state"]["big"] = {"momentum_buffer": torch.randn(2 * big, generator=g)}
    return state


def _taken(monkeypatch: pytest.MonkeyPatch) -> list[dict[int, Future[bytes]] | None]:
    """Record what each writer took from its stager's leaf plan (a spy: the real method runs)."""
    taken: list[dict[int, Future[bytes]] | None] = []
    take = LeafPlan.take

    def spy(self: LeafPlan, keys: tuple[Any, ...]) -> dict[int, Future[bytes]] | None:
        hashed = take(self, keys)
        taken.append(None if hashed is None else dict(hashed))
        return hashed

    monkeypatch.setattr(LeafPlan, "take", spy)
    return taken


def _queued(plan: LeafPlan, leaves: int) -> bool:
    return plan.queued >= leaves


def _manager(url: str) -> CheckpointManager:
    return CheckpointManager(CheckpointConfig(url=url, interval=1, keep_last=5), RUN)


def test_signed_writes_use_leaves_hashed_once_staged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken = _taken(monkeypatch)
    stager = Stager(pin_memory=False)
    leaves = -(-(3 * BIG * 4) // TREE_CHUNK)  # the big tensors' leaves
    for step in (1, 2, 3):
        state = _state(step)
        staged = stager.stage(state)
        if step > 1:  # the first write laid the leaves out; later stages queue them
            plan = stager.leaf_plan
            assert plan is not None
            wait_until(partial(_queued, plan, leaves - 1), 30, "the leaves to be queued")
        writer = HashingWriter(str(tmp_path / f"s{step}"), SHA256_TREE)
        dcp.save(staged, storage_writer=writer, planner=FastSavePlanner())
        entry = writer.written[SHARD]
        fs, path = filesystem(str(tmp_path / f"s{step}" / SHARD))
        assert digest_of(fs, path, SHA256_TREE) == entry[SHA256_TREE]
        loaded = zeros_like(_state(0))
        dcp.load(loaded, storage_reader=FileSystemReader(str(tmp_path / f"s{step}")))
        assert_same_bytes(loaded, state)
    # The leaf with the pickled plain values is always hashed by the writer.
    assert len(taken) == 2
    assert all(hashed is not None and len(hashed) >= leaves - 1 for hashed in taken), taken


def test_a_changed_layout_is_hashed_afresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    taken = _taken(monkeypatch)
    url = str(tmp_path / "ckpt")
    manager = _manager(url)
    for step, big in ((1, BIG), (2, BIG + 8)):  # another shape: new buffers, new offsets
        outcome = manager.save(step, _state(step, big), block=True)
        assert outcome is not None and outcome.ok, outcome
    manager.close()
    assert taken[-1] is None  # the plan did not fit: every leaf hashed by the writer
    info = find_latest_complete(url, RUN, verify="full", secret=manager.secret)
    assert info is not None and info.step == 2
    loaded = _manager(url).load_latest(lambda: zeros_like(_state(0, BIG + 8)))
    assert loaded is not None
    step, state = loaded
    assert step == 2
    assert_same_bytes(state, _state(2, BIG + 8))


def test_a_changed_byte_after_saves_that_hash_ahead_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = str(tmp_path / "ckpt")
    manager = _manager(url)
    for step in (1, 2):
        outcome = manager.save(step, _state(step), block=True)
        assert outcome is not None and outcome.ok, outcome
    manager.close()
    info = find_latest_complete(url, RUN, verify="full", secret=manager.secret)
    assert info is not None and info.step == 2
    shard = Path(info.data_url) / SHARD
    data = bytearray(shard.read_bytes())
    at = tensor_offset(Path(info.data_url), "optim.state.big.momentum_buffer") + 12345
    data[at] ^= 0x01
    shard.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        loaded = _manager(url).load_latest(lambda: zeros_like(_state(0)))
    assert loaded is not None
    step, state = loaded
    assert step == 1
    assert_same_bytes(state, _state(1))
    assert f"{SHARD}: checksum mismatch (corrupt)" in caplog.text
