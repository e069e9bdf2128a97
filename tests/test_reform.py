"""The re-form marker: an agent stopping its workers to re-form tells them not to persist."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from elastic import env
from elastic.node import reform


def test_the_marker_exists_only_while_the_agent_stops_its_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(env.SNAPSHOT_OWNER, str(os.getpid()))
    assert not reform.stopping_for_reform(str(tmp_path))
    with reform.marking(os.getpid(), str(tmp_path)):
        assert reform.stopping_for_reform(str(tmp_path))
    assert not reform.stopping_for_reform(str(tmp_path))
    assert list((tmp_path / f"elastic-{os.geteuid()}" / str(os.getpid())).iterdir()) == []


def test_another_agents_marker_or_no_agent_means_persist(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with reform.marking(os.getpid() + 1, str(tmp_path)):
        monkeypatch.setenv(env.SNAPSHOT_OWNER, str(os.getpid()))
        assert not reform.stopping_for_reform(str(tmp_path))
        monkeypatch.delenv(env.SNAPSHOT_OWNER)
        assert not reform.stopping_for_reform(str(tmp_path))


def test_an_unwritable_directory_means_persist(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing")
    with reform.marking(os.getpid(), missing):  # no error: the workers just persist
        assert reform.marker(os.getpid(), missing) is None
