"""A signed checkpoint vouches for its files by a keyed MAC: a storage writer cannot alter it."""

from __future__ import annotations

import json
import logging
import shutil
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic import secret as signing
from elastic.checkpoint import CheckpointManager, inspect_step, layout
from elastic.checkpoint.config import CheckpointConfig
from elastic.checkpoint.digest import (
    GMAC,
    SHA256_TREE,
    FileKeys,
    bytes_digest,
    digest_of,
    matches,
)
from elastic.checkpoint.layout import COMMIT_MARKER, _signed_content, make_marker
from elastic.checkpoint.storage import METADATA, filesystem

from .conftest import RUN, assert_same_bytes, make_state, save_with_project, zeros_like
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


def _load(url: str) -> tuple[int, dict[str, Any]]:
    manager = CheckpointManager(CheckpointConfig(url=url, interval=1), RUN)
    loaded = manager.load_latest(lambda: zeros_like(make_state()))
    assert loaded is not None
    return loaded


def _rewrite_marker(step_dir: str, marker: dict[str, Any], secret: bytes) -> None:
    """Replace a step's marker with ``marker``, signed with the job secret (as a writer
    holding the secret could)."""
    marker = {k: v for k, v in marker.items() if k != "hmac"}
    marker["hmac"] = signing.sign(secret, _signed_content(marker))
    (Path(step_dir) / COMMIT_MARKER).write_text(json.dumps(marker, sort_keys=True))


def test_a_signed_step_with_altered_weights_and_its_crc_restored_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = str(tmp_path / "ckpt")
    save_with_project(url, 1, make_state(1))
    info = save_with_project(url, 2, make_state(2))
    assert info.marker is not None and info.marker["version"] == 4
    assert set(info.marker["files"][SHARD]) == {"size", GMAC, "crc32"}
    assert set(info.marker["files"][METADATA]) == {"size", "crc32", "sha256"}
    _tamper(Path(info.data_url))
    with caplog.at_level(logging.WARNING):
        step, state = _load(url)
    assert step == 1
    assert torch.equal(state["model"]["conv.weight"], make_state(1)["model"]["conv.weight"])
    assert f"Skipping checkpoint {info.step_dir}: {SHARD}: checksum mismatch (corrupt)." in (
        caplog.text
    )


def test_a_tag_of_another_step_attempt_or_file_does_not_match(tmp_path: Path) -> None:
    """A file's key is derived from (run, step, attempt, name): its tag is worthless for any
    other file write, even in a marker signed with the job secret."""
    url = str(tmp_path / "ckpt")
    one = save_with_project(url, 1, make_state(1))
    two = save_with_project(url, 2, make_state(2))
    secret = signing.job_secret()
    assert secret is not None and one.marker is not None and two.marker is not None
    fs, shard = filesystem(f"{one.data_url}/{SHARD}")
    tag = one.marker["files"][SHARD][GMAC]
    attempt = one.marker["attempt"]
    assert matches(fs, shard, GMAC, tag, FileKeys(secret, RUN, 1, attempt).key(SHARD))
    for keys, name in [
        (FileKeys(secret, RUN, 2, attempt), SHARD),  # another step
        (FileKeys(secret, RUN, 1, two.marker["attempt"]), SHARD),  # another attempt
        (FileKeys(secret, RUN, 1, attempt), "__1_0.distcp"),  # another file
        (FileKeys(secret, "other-run", 1, attempt), SHARD),  # another run
        (FileKeys(b"another secret", RUN, 1, attempt), SHARD),  # another job
    ]:
        assert not matches(fs, shard, GMAC, tag, keys.key(name)), (keys, name)

    # Step 1's shard and its tag put into step 2 (its marker re-signed): refused.
    shutil.copyfile(Path(one.data_url) / SHARD, Path(two.data_url) / SHARD)
    files = dict(two.marker["files"])
    files[SHARD] = one.marker["files"][SHARD]
    _rewrite_marker(two.step_dir, {**two.marker, "files": files}, secret)
    assert inspect_step(url, RUN, 2, "size", secret).complete  # the sizes agree
    reason = inspect_step(url, RUN, 2, "full", secret).reason
    assert reason == f"{SHARD}: checksum mismatch (corrupt)"


def test_an_older_sha256_tree_checkpoint_still_loads(tmp_path: Path) -> None:
    """A signed marker of version 3 (every file by a SHA-256 tree, as that version wrote
    it) loads, and its tree is still checked."""
    url = str(tmp_path / "ckpt")
    state = make_state(3)
    info = save_with_project(url, 3, state)
    secret = signing.job_secret()
    assert secret is not None and info.marker is not None
    fs, root = filesystem(info.data_url)
    files = {}
    for name, entry in info.marker["files"].items():
        files[name] = {
            "size": entry["size"],
            SHA256_TREE: digest_of(fs, f"{root}/{name}", SHA256_TREE),
        }
    meta = (Path(info.data_url) / METADATA).read_bytes()
    files[METADATA]["sha256"] = bytes_digest(meta, "sha256")
    _rewrite_marker(info.step_dir, {**info.marker, "files": files, "version": 3}, secret)
    assert inspect_step(url, RUN, 3, "full", secret).complete
    step, loaded = _load(url)
    assert step == 3
    assert_same_bytes(loaded["model"], {k: v.contiguous() for k, v in state["model"].items()})
    _tamper(Path(info.data_url))
    reason = inspect_step(url, RUN, 3, "full", secret).reason
    assert reason == f"{SHARD}: checksum mismatch (corrupt)"


def test_a_reader_without_the_secret_checks_the_crc_beside_the_mac(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = str(tmp_path / "ckpt")
    info = save_with_project(url, 1, make_state(1))
    secret = signing.job_secret()
    assert secret is not None and info.marker is not None
    assert inspect_step(url, RUN, 1, "full", None).complete
    shard = Path(info.data_url) / SHARD
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert inspect_step(url, RUN, 1, "full", None).reason == f"{SHARD}: checksum mismatch (corrupt)"
    # A marker that vouches by the MAC alone: without the secret, only the size is checked.
    files = {**info.marker["files"], SHARD: {"size": len(data), GMAC: "00" * 28}}
    _rewrite_marker(info.step_dir, {**info.marker, "files": files}, secret)
    monkeypatch.setattr(layout, "_WARNED_KEYLESS", [])
    with caplog.at_level(logging.WARNING):
        assert inspect_step(url, RUN, 1, "full", None).complete
    assert "only the job secret can check: without it its size is checked" in caplog.text
    assert not inspect_step(url, RUN, 1, "full", secret).complete


def test_a_signed_save_without_cryptography_fails_in_one_sentence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.ciphers", None)
    cfg = CheckpointConfig(url=str(tmp_path / "ckpt"), interval=1, max_failures=5)
    manager = CheckpointManager(cfg, RUN)
    outcome = manager.save(1, make_state(), block=True)
    manager.close()
    assert outcome is not None and not outcome.ok
    assert outcome.error.endswith(
        "needs the cryptography package; install it (pip install 'cryptography>=46,<51')."
    )
    assert not list((tmp_path / "ckpt" / RUN / "step-1").glob(COMMIT_MARKER))


def test_an_unsigned_run_keeps_the_cheaper_crc(tmp_path: Path) -> None:
    info = save_with_project(str(tmp_path / "ckpt"), 1, make_state(), secret=None)
    assert info.marker is not None and "hmac" not in info.marker
    assert set(info.marker["files"][SHARD]) == {"size", "crc32"}
    assert {"crc32", "sha256"} <= set(info.marker["files"][METADATA])


def test_make_marker_signs_the_tags(tmp_path: Path) -> None:
    """The marker's HMAC covers each file's tag: a changed tag breaks the signature."""
    files = {SHARD: {"size": 4, GMAC: "00" * 28}, METADATA: {"size": 1, "sha256": "0" * 64}}
    data = json.loads(make_marker(1, 1, files, run=RUN, attempt="save-0123abcd", secret=b"s"))
    assert signing.verify(b"s", _signed_content(data), data["hmac"])
    data["files"][SHARD][GMAC] = "11" * 28
    assert not signing.verify(b"s", _signed_content(data), data["hmac"])
