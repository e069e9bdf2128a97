"""Fixtures shared by every test level (a real etcd on free ports, unique run ids) and the
rule that gives every test its level.

Levels (``pytest -m unit|integration|system``; ``make test-unit``):

- ``system``: agents, kills, containers: marked ``slow``, ``compose`` or ``system``, or uses a
  fixture that starts agents (:data:`SYSTEM_FIXTURES`);
- ``integration``: a real etcd (:data:`ETCD_FIXTURES`), or marked ``integration`` (real
  processes or sockets without agents: two gloo ranks, a torchrun);
- ``unit``: everything else. A unit test runs in milliseconds in this process: one that starts
  a process fails with a sentence saying how to mark it.
"""

from __future__ import annotations

import multiprocessing.process
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

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


LEVELS = ("unit", "integration", "system")
ETCD_FIXTURES = frozenset({"etcd", "own_etcd", "client", "secure_etcd", "bridge_etcd"})
SYSTEM_FIXTURES = frozenset({"cluster", "job"})
UNIT_TIMEOUT_S = 60


def level_of(markers: set[str], fixtures: set[str]) -> str:
    """A test's level from its markers and the fixtures it uses (transitively)."""
    if markers & {"system", "slow", "compose"} or fixtures & SYSTEM_FIXTURES:
        return "system"
    if "integration" in markers or fixtures & ETCD_FIXTURES:
        return "integration"
    return "unit"


def pytest_configure(config: pytest.Config) -> None:
    for name, what in (
        ("unit", "no etcd, no process: milliseconds (assigned by tests/conftest.py)"),
        ("integration", "a real etcd, or real processes/sockets without agents"),
        ("system", "agents, kills, containers"),
    ):
        config.addinivalue_line("markers", f"{name}: {what}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        markers = {m.name for m in item.iter_markers()}
        level = level_of(markers, set(getattr(item, "fixturenames", ())))
        if level not in markers:
            item.add_marker(getattr(pytest.mark, level))
        if level == "unit" and "timeout" not in markers:
            item.add_marker(pytest.mark.timeout(UNIT_TIMEOUT_S))


def _no_process(*_args: Any, **_kwargs: Any) -> NoReturn:
    raise RuntimeError(
        "This unit test starts a process, which a unit test may not do: mark it "
        "pytest.mark.integration (real processes or sockets) or pytest.mark.system "
        "(agents, kills)."
    )


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request: pytest.FixtureRequest) -> Iterator[None]:
    """Hold unit tests to their level: no subprocess, fork or multiprocessing."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess.Popen, "__init__", _no_process)
        mp.setattr(multiprocessing.process.BaseProcess, "start", _no_process)
        mp.setattr(os, "fork", _no_process)
        mp.setattr(os, "posix_spawn", _no_process)
        yield
