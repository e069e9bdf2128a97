"""Signed saves hash the SHA-256 tree's leaves while staging: the same digest, still checked."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic.checkpoint import CheckpointManager, find_latest_complete
from elastic.checkpoint.config import CheckpointConfig
from elastic.checkpoint.digest import SHA256_TREE, TREE_CHUNK, LeafPlan, digest_of
from elastic.checkpoint.storage import filesystem

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


def _manager(url: str) -> CheckpointManager:
    return CheckpointManager(CheckpointConfig(url=url, interval=1, keep_last=5), RUN)


def test_signed_saves_use_leaves_hashed_while_staging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken = _taken(monkeypatch)
    url = str(tmp_path / "ckpt")
    manager = _manager(url)
    for step in (1, 2, 3):
        outcome = manager.save(step, _state(step), block=True)
        assert outcome is not None and outcome.ok, outcome
    assert manager.secret is not None  # signed: the SHA-256 tree
    manager.close()
    # The first save plans the leaves; the next two find most of them hashed ahead (the
    # leaf with the pickled plain values is always hashed by the writer).
    leaves = -(-(3 * BIG * 4) // TREE_CHUNK)
    assert len(taken) == 2
    assert all(hashed is not None and len(hashed) >= leaves - 1 for hashed in taken), taken
    info = find_latest_complete(url, RUN, verify="full", secret=manager.secret)
    assert info is not None and info.step == 3 and info.marker is not None
    entry = info.marker["files"][SHARD]
    fs, path = filesystem(f"{info.data_url}/{SHARD}")
    assert digest_of(fs, path, SHA256_TREE) == entry[SHA256_TREE]
    loaded = _manager(url).load_latest(lambda: zeros_like(_state(0)))
    assert loaded is not None
    step, state = loaded
    assert step == 3
    assert_same_bytes(state, _state(3))


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


def test_a_changed_byte_in_a_leaf_hashed_ahead_is_refused(
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
