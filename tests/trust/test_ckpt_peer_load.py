"""No peer picks what another rank loads, and a signed checkpoint runs no code.

Issue 26, items 1 and 2, one process each (a rank's side of the protocol; the two-rank
wire is tested in tests/trust/test_no_unpickling_paths.py):

* rank 0's choice carries only a step and its marker's digest: a message that carries a
  URL (a ``data:`` URL with a pickle in it, a directory outside the run) is refused in
  one sentence, and nothing it names is read;
* a ``.metadata`` that a member holding the job secret signed (so its marker verifies)
  is unpickled through DCP's class allowlist: a pickle that would run code is one error;
* a signed ``.metadata`` whose items lie outside the step's own files (an absolute path,
  ``../``, a file the marker does not name, bytes past its recorded size) is refused
  before a byte is read;
* at save, rank 0 refuses write results and file claims outside a rank's own files, so
  such a ``.metadata`` is never signed.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo

from elastic import secret as signing
from elastic.checkpoint import manager as manager_module
from elastic.checkpoint.digest import SHA256, bytes_digest
from elastic.checkpoint.layout import COMMIT_MARKER
from elastic.checkpoint.storage import HashingWriter
from elastic.errors import CheckpointError
from tests.checkpoint.conftest import RUN, small_manager, small_state


@pytest.fixture
def url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    secret_file = tmp_path / "secret"
    secret_file.write_text("s3cr3t-shared-by-every-node")
    monkeypatch.setenv("ELASTIC_SECRET_FILE", str(secret_file))
    return str(tmp_path / "ckpt")


class _Touch:
    """A pickle that creates ``path`` when it is loaded."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.path,))


def _commit(url: str, step: int = 1) -> Path:
    manager = small_manager(url)
    outcome = manager.save(step, small_state(float(step)), block=True)
    manager.close()
    assert outcome is not None and outcome.ok, outcome
    return Path(url) / RUN / f"step-{step}"


def _resign(step_dir: Path, name: str, data: bytes) -> None:
    """Replace ``name`` in the committed attempt with ``data`` and re-sign the marker for
    it, as a member that holds the job secret can."""
    marker_path = step_dir / COMMIT_MARKER
    marker = json.loads(marker_path.read_text())
    (step_dir / marker["attempt"] / name).write_bytes(data)
    record = marker["files"][name]
    for kind in [k for k in record if k != "size"]:
        record[kind] = (
            hashlib.sha256(data).hexdigest() if kind == SHA256 else bytes_digest(data, kind)
        )
    record["size"] = len(data)
    del marker["hmac"]
    secret = signing.job_secret()
    assert secret is not None
    body = json.dumps(marker, sort_keys=True, separators=(",", ":")).encode()
    marker["hmac"] = signing.sign(secret, body)
    marker_path.write_text(json.dumps(marker, sort_keys=True))


def _load(url: str) -> Any:
    return small_manager(url).load_latest(lambda: small_state(0.0))


# -- rank 0's message -----------------------------------------------------------------------


def _hostile_choices(tmp_path: Path, target: Path) -> dict[str, dict[str, Any]]:
    evil = base64.b64encode(pickle.dumps(_Touch(target))).decode()
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / ".metadata").write_bytes(pickle.dumps(_Touch(target)))
    return {
        "data-url": {
            "step": 1,
            "url": f"data:application/octet-stream;base64,{evil}",
            "step_dir": "x",
            "metadata": None,
        },
        "outside-the-step": {
            "step": 1,
            "url": str(outside),
            "step_dir": str(outside),
            "metadata": None,
        },
    }


@pytest.mark.parametrize("kind", ["data-url", "outside-the-step"])
def test_a_rank_takes_no_url_from_rank_0(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Rank 0's message names a place to read: refused, nothing there is read."""
    _commit(url)
    target = tmp_path / "pwned"
    choice = _hostile_choices(tmp_path, target)[kind]
    sent: list[dict[str, Any]] = []

    def hostile(self: Any) -> Any:
        sent.append(choice)
        return choice if len(sent) == 1 else None

    monkeypatch.setattr(manager_module._Candidates, "next", hostile)
    try:
        with pytest.raises(CheckpointError, match="is not a checkpoint step and its marker's"):
            _load(url)
    finally:
        assert not target.exists(), "a pickle that rank 0 named was loaded"


def test_a_rank_verifies_the_marker_rank_0_names_itself(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 names a step with another marker's digest: this rank reads the marker itself
    and refuses the step (then there is none left: one error naming why)."""
    _commit(url)
    calls: list[int] = []

    def lying(self: Any) -> Any:
        calls.append(1)
        self.current = None  # as on a rank other than 0: it verifies by itself
        return {"step": 1, "digest": "0" * 64} if len(calls) == 1 else None

    monkeypatch.setattr(manager_module._Candidates, "next", lying)
    with pytest.raises(CheckpointError, match="rank 0 named step 1 with the commit marker 0000"):
        _load(url)


# -- a signed .metadata ----------------------------------------------------------------------


def test_a_signed_metadata_pickle_runs_no_code(url: str, tmp_path: Path) -> None:
    """A member with the secret signs a .metadata that would run code: one error, no code."""
    step_dir = _commit(url)
    target = tmp_path / "pwned"
    _resign(step_dir, ".metadata", pickle.dumps(_Touch(target)))
    with pytest.raises(CheckpointError) as caught:
        _load(url)
    assert not target.exists(), "the signed .metadata ran code"
    assert "pathlib.Path.touch is not a DCP metadata class" in str(caught.value)


def _metadata_pointing_at(step_dir: Path, relative_path: str, length: int) -> bytes:
    marker = json.loads((step_dir / COMMIT_MARKER).read_text())
    # the test reads its own file: ours, not a peer's
    metadata = pickle.loads((step_dir / marker["attempt"] / ".metadata").read_bytes())
    for index in list(metadata.storage_data):
        if index.fqn == "model.w":
            metadata.storage_data[index] = StorageInfo(
                relative_path, 0, length, transform_descriptors=["elastic-raw/1"]
            )
    return pickle.dumps(metadata)


@pytest.mark.parametrize("where", ["absolute", "dotdot", "unnamed", "past-the-end"])
def test_a_signed_metadata_reads_only_the_markers_files(
    url: str, tmp_path: Path, where: str
) -> None:
    """A signed .metadata points a tensor at a local credential: refused before reading."""
    step_dir = _commit(url)
    credential = tmp_path / "credential"
    credential.write_bytes(bytes(range(256)) * 8)  # model.w: 64 x 8 float32, 2048 bytes
    attempt = json.loads((step_dir / COMMIT_MARKER).read_text())["attempt"]
    relative = {
        "absolute": str(credential),
        "dotdot": f"../../../../{credential.name}",
        "unnamed": "__7_0.distcp",
        "past-the-end": "__0_0.distcp",
    }[where]
    if where == "unnamed":
        (step_dir / attempt / relative).write_bytes(credential.read_bytes())
    length = 2048 if where != "past-the-end" else 1 << 30
    _resign(step_dir, ".metadata", _metadata_pointing_at(step_dir, relative, length))
    loaded = None
    with pytest.raises(CheckpointError, match="Refusing the checkpoint metadata") as caught:
        loaded = _load(url)
    assert loaded is None
    assert "nothing was read" in str(caught.value)


# -- at save: rank 0 signs only a rank's own files ---------------------------------------------


@pytest.mark.parametrize("where", ["absolute", "dotdot", "another-rank"])
def test_write_results_outside_a_ranks_files_are_not_committed(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    credential = tmp_path / "credential"
    credential.write_bytes(b"k" * 256)
    relative = {
        "absolute": str(credential),
        "dotdot": "../../../credential",
        "another-rank": "__1_0.distcp",
    }[where]
    write_data = HashingWriter.write_data

    def hostile(self: HashingWriter, plan: Any, planner: Any) -> Any:
        future = write_data(self, plan, planner)
        results = future.value()
        results[0] = dataclasses.replace(results[0], storage_data=StorageInfo(relative, 0, 256))
        return future

    monkeypatch.setattr(HashingWriter, "write_data", hostile)
    manager = small_manager(url)
    outcome = manager.save(1, small_state(1.0), block=True)
    manager.close()
    assert outcome is not None and not outcome.ok
    assert "not to a file of its own" in outcome.error, outcome.error
    assert not list(Path(url).rglob(COMMIT_MARKER)), "a checkpoint naming that file was signed"


def test_a_file_claim_outside_a_ranks_own_is_not_committed(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_data = HashingWriter.write_data

    def claiming(self: HashingWriter, plan: Any, planner: Any) -> Any:
        future = write_data(self, plan, planner)
        self.written["../../stolen"] = {"size": 1, "crc32": "00000000"}
        return future

    monkeypatch.setattr(HashingWriter, "write_data", claiming)
    manager = small_manager(url)
    outcome = manager.save(1, small_state(1.0), block=True)
    manager.close()
    assert outcome is not None and not outcome.ok
    assert "which is not a file of its own" in outcome.error, outcome.error
    assert not list(Path(url).rglob(COMMIT_MARKER))


def test_a_clean_save_still_loads(url: str) -> None:
    _commit(url, 3)
    loaded = _load(url)
    assert loaded is not None and loaded[0] == 3
    assert torch.equal(loaded[1]["model"]["w"], small_state(3.0)["model"]["w"])
