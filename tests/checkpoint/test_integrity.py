"""A signed checkpoint vouches for its files by a SHA-256 tree: a storage writer cannot alter it."""

from __future__ import annotations

import logging
import zlib
from pathlib import Path

import pytest
import torch

from elastic.checkpoint import CheckpointManager
from elastic.checkpoint.config import CheckpointConfig

from .conftest import RUN, make_state, save_with_project, zeros_like
from .tamper import restore_crc, tensor_offset

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
SHARD = "__0_0.distcp"


def _tamper(data_dir: Path) -> None:
    """Set conv.weight's first 16 values to 1000 and restore the shard's CRC-32 with 4
    bytes of another tensor: same size, same CRC, and it still loads in torch."""
    shard = data_dir / SHARD
    data = bytearray(shard.read_bytes())
    crc, size = zlib.crc32(data), len(data)
    at = tensor_offset(data_dir, "model.conv.weight")
    data[at : at + 64] = torch.full((16,), 1000.0).numpy().tobytes()
    restore_crc(data, tensor_offset(data_dir, "model.half"), crc)
    assert (zlib.crc32(data), len(data)) == (crc, size)
    shard.write_bytes(bytes(data))


def test_a_signed_step_with_altered_weights_and_its_crc_restored_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = str(tmp_path / "ckpt")
    save_with_project(url, 1, make_state(1))
    info = save_with_project(url, 2, make_state(2))
    assert set(info.marker["files"][SHARD]) == {"size", "sha256_tree"}
    _tamper(Path(info.data_url))
    manager = CheckpointManager(CheckpointConfig(url=url, interval=1), RUN)
    with caplog.at_level(logging.WARNING):
        step, state = manager.load_latest(lambda: zeros_like(make_state()))
    assert step == 1
    assert torch.equal(state["model"]["conv.weight"], make_state(1)["model"]["conv.weight"])
    assert f"Skipping checkpoint {info.step_dir}: {SHARD}: checksum mismatch (corrupt)." in (
        caplog.text
    )


def test_an_unsigned_run_keeps_the_cheaper_crc(tmp_path: Path) -> None:
    info = save_with_project(str(tmp_path / "ckpt"), 1, make_state(), secret=None)
    assert "hmac" not in info.marker
    assert set(info.marker["files"][SHARD]) == {"size", "crc32"}
    assert {"crc32", "sha256"} <= set(info.marker["files"][".metadata"])
