"""Fixtures shared by every test level: a real etcd on free ports, unique run ids."""

from __future__ import annotations

import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic.etcd.client import EtcdClient, EtcdOptions, parse_endpoints
from elastic.etcd.server import EtcdServer, start_etcd


@pytest.fixture(scope="session", autouse=True)
def _private_config_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Local runs keep a generated signing secret under $XDG_CONFIG_HOME (elastic.secret):
    the tests' own, never the user's ~/.config; every process a test starts inherits it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("config-home")))
        yield


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One etcd server for the whole session (tests separate themselves by run id)."""
    server = start_etcd(tmp_path_factory.mktemp("etcd") / "data")
    yield server
    server.stop(signal.SIGKILL)


@pytest.fixture
def run_id() -> str:
    return f"run-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def client(etcd: EtcdServer) -> Iterator[EtcdClient]:
    with EtcdClient(EtcdOptions(parse_endpoints(etcd.endpoint)[0])) as c:
        yield c


@pytest.fixture
def own_etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """A private etcd a test may stop, kill and restart."""
    server = start_etcd(tmp_path / "etcd-data")
    yield server
    server.stop(signal.SIGKILL)
