"""Fixtures of the recovery tests: a local cluster of real agents on the test's etcd."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic.etcd.server import EtcdServer
from elastic.node import nodelocal
from elastic_tools.harness.cluster import AgentOptions, LocalCluster
from tests.helpers import node_env


@pytest.fixture
def cluster(tmp_path: Path, etcd: EtcdServer, run_id: str) -> Iterator[LocalCluster]:
    """Agents with a 90 s join timeout, 3 restarts, a 0.3 s monitor interval; the node-local
    files of agents killed with -9 are removed afterwards (a clean stop removes its own)."""
    c = LocalCluster(
        tmp_path,
        run_id,
        etcd.endpoint,
        options=AgentOptions(join_timeout=90, max_restarts=3, monitor_interval=0.3),
        env=node_env(),
    )
    yield c
    c.close()
    for node in c.nodes.values():
        nodelocal.remove_owned(node.pid)
