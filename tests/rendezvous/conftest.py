"""Fixtures for multi-process rendezvous tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.rendezvous.nodes import Cluster


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """Nodes started by the test; every agent and worker is killed by PID afterwards."""
    c = Cluster(tmp_path)
    yield c
    c.cleanup()
