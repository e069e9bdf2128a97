"""Fixtures for agent tests: a job of real agents running the real worker."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic.etcd.server import EtcdServer
from tests.agent.jobs import Job


@pytest.fixture
def job(tmp_path: Path, etcd: EtcdServer, run_id: str) -> Iterator[Job]:
    j = Job(tmp_path, etcd.endpoint, run_id)
    yield j
    j.cleanup()
