"""Fixtures for multi-node tests: namespaces on a bridge, and an etcd on the bridge."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic.etcd.server import EtcdServer, start_etcd
from elastic_tools.harness.faults import Net


@pytest.fixture
def net() -> Iterator[Net]:
    n = Net().up()
    yield n
    n.close()


@pytest.fixture
def bridge_etcd(net: Net, tmp_path: Path) -> Iterator[EtcdServer]:
    server = start_etcd(tmp_path / "etcd-data", host=net.gateway)
    yield server
    server.stop(signal.SIGKILL)
