"""Never lose or corrupt the state: checkpoint failure modes, one test per reproduced bug.

In one process (DCP's single-process mode), against real local files; a
world of one stands for rank 0. Fences here are in-memory stand-ins; the
etcd-backed fence has its own tests in tests/rendezvous/test_fence_safety.py.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import stat
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from fsspec.implementations.local import LocalFileSystem

from elastic import secret as signing
from elastic.checkpoint import (
    COMMIT_MARKER,
    CheckpointManager,
    find_latest_complete,
    inspect_step,
    list_steps,
    step_url,
)
from elastic.checkpoint.layout import purge
from elastic.errors import CheckpointError, ConfigError
from elastic_tools.training.config import checkpoint_run_id, load_config

from .conftest import RUN, load_small, small_manager, small_state
from .flaky_fs import FAIL_ENV, register

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def url(tmp_path: Path) -> str:
    return str(tmp_path / "ckpt")


def _commit(manager: CheckpointManager, *steps: int) -> None:
    for step in steps:
        outcome = manager.save(step, small_state(float(step)), block=True)
        assert outcome is not None and outcome.ok, outcome


class RecordingFence:
    """An in-memory commit fence with records, like RoundFence without etcd."""

    def __init__(self, round_: int = 1) -> None:
        self.round = round_
        self.job = "job"
        self.current = round_
        self.store: dict[int, dict[str, Any]] = {}
        self.refuse_checks = False

    def _ensure(self) -> None:
        if self.current != self.round or self.refuse_checks:
            raise CheckpointError(f"round {self.round} is no longer current")

    def commit(self, step: int, record: dict[str, Any]) -> None:
        self._ensure()
        self.store[step] = {**record, "round": self.round}

    def check(self) -> None:
        self._ensure()

    def records(self) -> dict[int, dict[str, Any]]:
        return dict(self.store)

    def forget(self, steps: list[int]) -> None:
        self._ensure()
        for step in steps:
            self.store.pop(step, None)


# 1. two jobs must not share a checkpoint directory by accident


def test_checkpoint_run_id_defaults_to_the_rendezvous_id() -> None:
    defaults = load_config(None, environ={})
    assert checkpoint_run_id(defaults, {"TORCHELASTIC_RUN_ID": "job-a"}) == "job-a"
    assert checkpoint_run_id(defaults, {"TORCHELASTIC_RUN_ID": "job-b"}) == "job-b"
    assert checkpoint_run_id(defaults, {}) == "default"
    mine = load_config(None, ["job.run_id=mine"], environ={})
    assert checkpoint_run_id(mine, {"TORCHELASTIC_RUN_ID": "job-a"}) == "mine"
    standalone = {"TORCHELASTIC_RUN_ID": "0f8fad5b-d9cb-469f-a165-70867728950e"}
    assert checkpoint_run_id(defaults, standalone) == "default"  # torchrun --standalone


def test_another_runs_marker_is_never_loaded_as_ours(url: str, tmp_path: Path) -> None:
    _commit(small_manager(url), 1)
    _commit(small_manager(url, run="other"), 5)
    shutil.copytree(tmp_path / "ckpt" / "other" / "step-5", tmp_path / "ckpt" / RUN / "step-5")
    info = inspect_step(url, RUN, 5)
    assert not info.complete and "belongs to run 'other'" in info.reason
    assert load_small(small_manager(url))[0] == 1


# 2. a fenced-out writer must not delete the newest complete checkpoint


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_refused_writer_never_touches_a_committed_step(url: str, tmp_path: Path) -> None:
    _commit(small_manager(url), 40, 50)
    before = _snapshot(tmp_path / "ckpt")

    class RefusesAtCommit(RecordingFence):  # refuses only at commit, after writing
        def commit(self, step: int, record: dict[str, Any]) -> None:
            raise CheckpointError("rendezvous round 7 is no longer current")

    stale = small_manager(url, commit_fence=RefusesAtCommit(round_=7))
    outcome = stale.save(50, small_state(99.0), block=True)
    assert outcome is not None and not outcome.ok
    assert find_latest_complete(url, RUN).step == 50
    step, state = load_small(small_manager(url))
    assert step == 50 and state["train"]["step"] == 50
    torch.testing.assert_close(state["model"]["w"], torch.full((64, 8), 50.0))
    after = _snapshot(tmp_path / "ckpt")
    assert {k: after.get(k) for k in before} == before  # nothing deleted or overwritten


def test_a_fence_that_refuses_up_front_writes_nothing(url: str, tmp_path: Path) -> None:
    _commit(small_manager(url), 40, 50)
    before = _snapshot(tmp_path / "ckpt")
    fence = RecordingFence(round_=7)
    fence.current = 8  # the job re-formed without this group
    outcome = small_manager(url, commit_fence=fence).save(50, small_state(99.0), block=True)
    assert outcome is not None and not outcome.ok and "no longer current" in outcome.error
    assert _snapshot(tmp_path / "ckpt") == before


def test_saves_a_moved_on_round_refuses_up_front_are_skipped_not_failures(
    url: str, tmp_path: Path
) -> None:
    """While a join forms, the others train on in place in the older round: their saves are
    refused up front, and that must never add up to max_failures and stop the job."""
    _commit(small_manager(url), 40)
    fence = RecordingFence(round_=7)
    fence.current = 8  # a joiner's round formed; this group switches at its next step
    manager = small_manager(url, max_failures=2, commit_fence=fence)
    for step in (41, 42, 43):
        outcome = manager.save(step, small_state(float(step)), block=True)
        assert outcome is not None and outcome.skipped and "no longer current" in outcome.error
    manager.wait()  # would raise after max_failures failures in a row
    assert manager.failures == 0 and find_latest_complete(url, RUN).step == 40


# 3. the commit record is the truth; purge is fenced and never deletes newer steps


def test_purge_never_deletes_steps_newer_than_its_own_commit(url: str) -> None:
    _commit(small_manager(url), 60, 70)
    _commit(small_manager(url, keep_last=1), 50)  # a stale writer that slipped past its fence
    assert list_steps(url, RUN) == [70, 60, 50]


def test_purge_checks_the_fence_right_before_deleting(url: str) -> None:
    fence = RecordingFence()
    _commit(small_manager(url, commit_fence=fence), 1, 2)
    assert purge(url, RUN, keep_last=1, protect=2, check=fence.check) == [1]
    _commit(small_manager(url, commit_fence=fence), 3)

    def refuse() -> None:
        raise CheckpointError("round 1 is no longer current")

    with pytest.raises(CheckpointError, match="no longer current"):
        purge(url, RUN, keep_last=1, protect=3, check=refuse)
    assert list_steps(url, RUN) == [3, 2]


def test_loading_prefers_steps_that_match_their_commit_record(
    url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fence = RecordingFence()
    _commit(small_manager(url, commit_fence=fence), 10, 20)
    _commit(small_manager(url), 30)  # no fence: no record; not what the job committed
    assert load_small(small_manager(url, commit_fence=fence))[0] == 20
    # a late marker from a stale writer replaces step 20's: it no longer matches its record
    marker = tmp_path / "ckpt" / RUN / "step-20" / COMMIT_MARKER
    forged = json.loads(marker.read_text())
    forged["time"] += 1
    del forged["hmac"]
    secret = signing.job_secret()
    assert secret is not None
    content = json.dumps(forged, sort_keys=True, separators=(",", ":")).encode()
    forged["hmac"] = signing.sign(secret, content)
    marker.write_text(json.dumps(forged, sort_keys=True))
    with caplog.at_level(logging.WARNING):
        assert load_small(small_manager(url, commit_fence=fence))[0] == 10
    assert "does not match the commit record" in caplog.text


def test_purged_steps_lose_their_commit_records(url: str) -> None:
    fence = RecordingFence()
    _commit(small_manager(url, keep_last=2, commit_fence=fence), 1, 2, 3, 4)
    assert sorted(fence.store) == [3, 4]


# 5. a malformed marker is one invalid step, not a blocked resume


@pytest.mark.parametrize(
    "marker",
    [
        {".metadata": {}},
        {"files": {".metadata": {}}},
        {"files": {".metadata": {"size": "x", "crc32": 1}}},
        {"files": {"../../etc/passwd": {"size": 1, "crc32": "0"}}},
        [1, 2],
    ],
)
def test_malformed_marker_falls_back_to_the_older_step(
    url: str, tmp_path: Path, marker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    _commit(small_manager(url), 1, 2)
    (tmp_path / "ckpt" / RUN / "step-2" / COMMIT_MARKER).write_text(json.dumps(marker))
    with caplog.at_level(logging.WARNING):
        assert load_small(small_manager(url))[0] == 1
    skipped = [
        r for r in caplog.records if r.levelno >= logging.WARNING and "step-2" in r.getMessage()
    ]
    assert len(skipped) == 1 and "Skipping checkpoint" in skipped[0].getMessage()


# 6. a step that vanishes while it is being read: fall back to an older one


def test_step_purged_mid_load_falls_back_to_an_older_one(url: str, tmp_path: Path) -> None:
    _commit(small_manager(url), 1, 2)
    calls = []

    def make_state() -> dict[str, Any]:
        if not calls:  # the purge of a concurrent writer strikes between choice and read
            shutil.rmtree(tmp_path / "ckpt" / RUN / "step-2")
        calls.append(1)
        return small_state(0.0)

    step, state = load_small(small_manager(url), make_state)
    assert step == 1 and state["train"]["step"] == 1 and len(calls) == 2


def test_no_readable_step_is_an_error_not_a_fresh_start(url: str, tmp_path: Path) -> None:
    _commit(small_manager(url), 1)

    def make_state() -> dict[str, Any]:
        raise RuntimeError("template does not fit")

    with pytest.raises(CheckpointError, match=r"could be read.*template does not fit"):
        load_small(small_manager(url), make_state)


# 7. run ids that do not name one directory


@pytest.mark.parametrize("bad", [".", "..", "a/b", "a\0b", ""])
def test_run_ids_that_escape_their_directory_are_refused(url: str, bad: str) -> None:
    with pytest.raises(ConfigError, match="run id"):
        small_manager(url, run=bad)
    with pytest.raises(ConfigError, match="run id"):
        step_url(url, bad, 1)
    with pytest.raises(ConfigError, match="run_id"):
        load_config(None, [f"job.run_id={bad}"], environ={}) if bad else load_config(
            None, ["job.run_id=''"], environ={}
        )


def test_a_dot_run_never_deletes_another_runs_steps(url: str) -> None:
    _commit(small_manager(url, run="real"), 1, 2)
    with pytest.raises(ConfigError):
        _commit(small_manager(url, run=".", keep_last=1), 3)
    assert list_steps(url, "real") == [2, 1]


# 8. the marker is replaced atomically and made durable


class TornFileSystem(LocalFileSystem):
    """Local files under ``torn://``; while ``tear`` is set, writes of the commit marker's
    bytes stop half way with an error (a crash mid-write)."""

    protocol = ("torn",)
    tear = False

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, str) and path.startswith("torn://"):
            path = path[len("torn://") :]
        return super()._strip_protocol(path)

    def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        raw = super()._open(path, mode, *args, **kwargs)
        if not (TornFileSystem.tear and "w" in mode and COMMIT_MARKER in path):
            return raw
        return _Torn(raw)


class _Torn:
    def __init__(self, raw: Any) -> None:
        self._raw = raw

    def write(self, data: bytes) -> int:
        self._raw.write(data[: len(data) // 2])
        self._raw.close()
        raise OSError("crashed half way through the write")

    def __enter__(self) -> _Torn:
        return self

    def __exit__(self, *exc: object) -> None:
        self._raw.close()


def test_a_torn_marker_write_keeps_the_committed_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fsspec

    fsspec.register_implementation("torn", TornFileSystem, clobber=True)
    url = f"torn://{tmp_path}/ckpt"
    manager = small_manager(url)
    _commit(manager, 1, 2)
    monkeypatch.setattr(TornFileSystem, "tear", True)
    outcome = manager.save(2, small_state(22.0), block=True)
    assert outcome is not None and not outcome.ok and "half way" in outcome.error
    monkeypatch.setattr(TornFileSystem, "tear", False)
    assert find_latest_complete(url, RUN).step == 2
    assert load_small(small_manager(url))[1]["train"]["step"] == 2
    leftovers = [p.name for p in (tmp_path / "ckpt" / RUN / "step-2").iterdir()]
    assert not [n for n in leftovers if n.endswith(".tmp")]


def test_marker_rename_is_made_durable_with_a_directory_fsync(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced_dirs: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            synced_dirs.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    _commit(small_manager(url), 1)
    assert step_url(url, RUN, 1) in synced_dirs


# 9. per-save attempts: a foreign step is never mistaken for one of ours


def test_purge_keeps_our_steps_over_a_foreign_complete_one(url: str, tmp_path: Path) -> None:
    _commit(small_manager(url, keep_last=2), 1, 2)
    _commit(small_manager(url, run="other"), 3)
    shutil.copytree(tmp_path / "ckpt" / "other" / "step-3", tmp_path / "ckpt" / RUN / "step-3")
    _commit(small_manager(url, keep_last=2), 4)
    assert list_steps(url, RUN) == [4, 3, 2]  # ours kept; the foreign step is left alone
    assert not inspect_step(url, RUN, 3, "size").complete


def test_a_same_size_file_from_another_save_is_caught(url: str, tmp_path: Path) -> None:
    _commit(small_manager(url), 1, 2)
    shards = {s: next((tmp_path / "ckpt" / RUN / f"step-{s}").rglob("*.distcp")) for s in (1, 2)}
    assert shards[1].parent != shards[2].parent and shards[1].name == shards[2].name
    shutil.copyfile(shards[1], shards[2])  # same size, another save's bytes
    assert "checksum mismatch" in inspect_step(url, RUN, 2, "full").reason
    assert load_small(small_manager(url))[0] == 1


# 10. whoever can write the storage must not run code in the workers


class _Payload:
    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.target),))


def _forge_step(run_dir: Path, source: Path, step: int, target: Path, attempt: bool) -> None:
    """Copy a committed step's files, swap in a malicious .metadata, recompute the CRCs."""
    step_dir = run_dir / f"step-{step}"
    data_dir = step_dir / "save-00000000deadbeef" if attempt else step_dir
    shutil.copytree(source, data_dir, ignore=shutil.ignore_patterns(COMMIT_MARKER))
    (data_dir / ".metadata").write_bytes(pickle.dumps(_Payload(target)))
    files = {
        p.name: {"size": p.stat().st_size, "crc32": f"{zlib.crc32(p.read_bytes()):08x}"}
        for p in data_dir.iterdir()
    }
    marker: dict[str, Any] = {"step": step, "world_size": 1, "time": 0.0, "files": files}
    if attempt:
        marker.update(version=2, run=RUN, attempt=data_dir.name, hmac="0" * 64)
    (step_dir / COMMIT_MARKER).write_text(json.dumps(marker))


@pytest.mark.parametrize("attempt", [False, True], ids=["old-layout", "bad-signature"])
def test_a_forged_metadata_is_refused_before_it_is_unpickled(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, attempt: bool
) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_text("s3cr3t-shared-by-every-node")
    monkeypatch.setenv("ELASTIC_SECRET_FILE", str(secret_file))
    _commit(small_manager(url), 1)
    run_dir = tmp_path / "ckpt" / RUN
    source = next((run_dir / "step-1").rglob(".metadata")).parent
    target = tmp_path / "pwned"
    _forge_step(run_dir, source, 2, target, attempt)
    try:
        loaded = load_small(small_manager(url))
    finally:
        assert not target.exists(), "the forged .metadata was unpickled"
    assert loaded[0] == 1


def test_without_a_secret_there_is_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(signing, "_warned", False)
    multi_node = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    with caplog.at_level(logging.WARNING):
        assert signing.job_secret(multi_node) is None
        assert signing.job_secret(multi_node) is None
    warnings = [r for r in caplog.records if "ELASTIC_SECRET_FILE" in r.getMessage()]
    assert len(warnings) == 1


def test_the_generated_local_secret_is_private(tmp_path: Path) -> None:
    first = signing.job_secret()
    assert first and signing.job_secret() == first
    path = tmp_path / "config" / "elastic" / "secret"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_an_unreadable_secret_file_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ELASTIC_SECRET_FILE", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="Cannot read the checkpoint secret"):
        signing.job_secret()


# 11. unwritable storage is reported at start, in one sentence naming the URL


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_unwritable_storage_fails_at_worker_start(
    tmp_path: Path, tiny_config: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from elastic_tools.training.worker import train

    register()
    url = f"flaky://{tmp_path}/ro"
    monkeypatch.setenv(FAIL_ENV, "/ro/")
    config = tiny_config(checkpoint__url=url, checkpoint__interval=2)
    with pytest.raises(CheckpointError, match=r"^Cannot write checkpoints under flaky://") as err:
        train(load_config(config, ["job.stop_at=6"], environ={}))
    assert "step None" not in str(err.value) and len(str(err.value).splitlines()) == 1
