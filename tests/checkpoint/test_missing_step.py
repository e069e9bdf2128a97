"""A deleted newest step is not a silent rollback (issue 26, item 6).

When etcd's commit records name a newer step than the one a job resumes from (the newest
was deleted from the storage, or cannot be read), rank 0 says so: one warning naming the
missing step and a ``ckpt.missing`` event.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from elastic import env, events
from tests.checkpoint.conftest import RUN, load_small, small_manager, small_state
from tests.checkpoint.test_ckpt_safety import RecordingFence


def _committed(url: str, fence: RecordingFence, *steps: int) -> None:
    manager = small_manager(url, commit_fence=fence)
    for step in steps:
        outcome = manager.save(step, small_state(float(step)), block=True)
        assert outcome is not None and outcome.ok, outcome
    manager.close()


@pytest.mark.parametrize("left", [1, 0], ids=["an-older-step", "none"])
def test_resuming_behind_the_commit_records_is_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, left: int
) -> None:
    log = tmp_path / "events.jsonl"
    monkeypatch.setenv(env.EVENT_LOG, str(log))
    url = str(tmp_path / "ckpt")
    fence = RecordingFence()
    _committed(url, fence, 1, 2)
    shutil.rmtree(tmp_path / "ckpt" / RUN / "step-2")
    if not left:
        shutil.rmtree(tmp_path / "ckpt" / RUN / "step-1")
    with caplog.at_level(logging.WARNING):
        loaded = load_small(small_manager(url, commit_fence=fence))
    assert (loaded[0] if loaded else None) == (1 if left else None)
    assert "say step 2 was committed, but it is not in the checkpoint storage" in caplog.text
    missing = events.read(log, "ckpt.missing")
    assert [(e["step"], e["loaded"]) for e in missing] == [(2, 1 if left else None)]


def test_no_warning_when_the_newest_step_loads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = str(tmp_path / "ckpt")
    fence = RecordingFence()
    _committed(url, fence, 1, 2)
    with caplog.at_level(logging.WARNING):
        assert load_small(small_manager(url, commit_fence=fence))[0] == 2
    assert "was committed, but" not in caplog.text


@pytest.mark.parametrize("left", [1, 0], ids=["an-older-step", "none"])
def test_a_newest_step_whose_files_are_gone_is_named_with_the_step_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, left: int
) -> None:
    """No commit records (no fence, or etcd's data lost): step 2's marker is there, its
    files are not; the resume names both steps in one sentence and one event."""
    log = tmp_path / "events.jsonl"
    monkeypatch.setenv(env.EVENT_LOG, str(log))
    url = str(tmp_path / "ckpt")
    manager = small_manager(url)
    for step in (1, 2):
        outcome = manager.save(step, small_state(float(step)), block=True)
        assert outcome is not None and outcome.ok, outcome
    manager.close()
    run_dir = tmp_path / "ckpt" / RUN
    for attempt in (run_dir / "step-2").glob("save-*"):
        shutil.rmtree(attempt)  # the marker stays: step 2 is named, its files are gone
    if not left:
        shutil.rmtree(run_dir / "step-1")
    with caplog.at_level(logging.WARNING):
        loaded = load_small(small_manager(url))
    assert (loaded[0] if loaded else None) == (1 if left else None)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Step 2 is")]
    assert len(said) == 1, caplog.text
    taken = "resumes from step 1, the newest complete one" if left else "resumes from scratch"
    assert "Step 2 is the newest committed step in the checkpoint storage" in said[0]
    assert taken in said[0] and "\n" not in said[0]
    older = events.read(log, "ckpt.older")
    assert [(e["step"], e["loaded"]) for e in older] == [(2, 1 if left else None)]
    assert "missing" in older[0]["reason"] or "not" in older[0]["reason"], older


def test_a_newer_save_that_never_committed_is_no_such_sentence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A step directory without a commit marker (a save cut short) is routine: step 1
    loads, and no sentence or event claims a committed step is gone."""
    log = tmp_path / "events.jsonl"
    monkeypatch.setenv(env.EVENT_LOG, str(log))
    url = str(tmp_path / "ckpt")
    manager = small_manager(url)
    outcome = manager.save(1, small_state(1.0), block=True)
    assert outcome is not None and outcome.ok, outcome
    manager.close()
    (tmp_path / "ckpt" / RUN / "step-2" / "save-00000000deadbeef").mkdir(parents=True)
    with caplog.at_level(logging.WARNING):
        assert load_small(small_manager(url))[0] == 1
    assert "newest committed step" not in caplog.text
    assert events.read(log, "ckpt.older") == []
