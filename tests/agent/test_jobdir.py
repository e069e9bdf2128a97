"""$ELASTIC_JOB_DIR: the job's directory a worker gets, the same on every restart."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic.agent.jobdir import ensure, job_dir


def test_the_root_and_run_id_make_the_directory(tmp_path: Path) -> None:
    environ = {"ELASTIC_JOB_ROOT": str(tmp_path / "jobs")}
    path = ensure("job-42", environ)
    assert path == tmp_path / "jobs" / "job-42" and path.is_dir()
    assert ensure("job-42", environ) == path  # a restart finds the same one


def test_the_default_root_is_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert job_dir("job-42", {}) == tmp_path / "elastic-jobs" / "job-42"


def test_a_given_job_dir_is_used_as_it_is(tmp_path: Path) -> None:
    environ = {"ELASTIC_JOB_DIR": str(tmp_path / "mine"), "ELASTIC_JOB_ROOT": "/elsewhere"}
    assert job_dir("job-42", environ) == tmp_path / "mine"


@pytest.mark.parametrize(("run_id", "name"), [("a/../b", "a_.._b"), ("..", "job"), ("x y", "x_y")])
def test_a_run_id_never_leaves_the_root(tmp_path: Path, run_id: str, name: str) -> None:
    path = job_dir(run_id, {"ELASTIC_JOB_ROOT": str(tmp_path)})
    assert path == tmp_path / name and path.parent == tmp_path


def test_a_directory_it_cannot_create_is_only_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "file").write_text("")
    path = ensure("job-42", {"ELASTIC_JOB_ROOT": str(tmp_path / "file")})
    assert path == tmp_path / "file" / "job-42" and not path.exists()
    assert "Cannot create the job directory" in caplog.text
