"""A worker stopped (SIGSTOP) while its agent runs is told apart from a running one, and ended."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from elastic.agent.frozen import FrozenWatch
from elastic.node import procs
from tests.helpers import wait_until


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def worker() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.01)"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.mark.integration
def test_a_stopped_worker_is_frozen_only_after_the_limit(worker: subprocess.Popen[bytes]) -> None:
    clock = Clock()
    watch = FrozenWatch(3.0, clock)
    pids = {0: worker.pid}
    assert watch.frozen(pids) == []  # running
    worker.send_signal(signal.SIGSTOP)
    wait_until(lambda: procs.state(worker.pid) == "T", 5, "the worker to stop")
    assert watch.frozen(pids) == []  # first seen stopped now
    clock.now += 2.9
    assert watch.frozen(pids) == []
    clock.now += 0.2
    assert watch.frozen(pids) == [worker.pid]


@pytest.mark.integration
def test_a_worker_continued_in_time_starts_its_count_again(
    worker: subprocess.Popen[bytes],
) -> None:
    clock = Clock()
    watch, pids = FrozenWatch(3.0, clock), {0: worker.pid}
    worker.send_signal(signal.SIGSTOP)
    wait_until(lambda: procs.state(worker.pid) == "T", 5, "the worker to stop")
    watch.frozen(pids)
    clock.now += 2.0
    worker.send_signal(signal.SIGCONT)
    wait_until(lambda: procs.state(worker.pid) != "T", 5, "the worker to run")
    assert watch.frozen(pids) == []
    worker.send_signal(signal.SIGSTOP)
    wait_until(lambda: procs.state(worker.pid) == "T", 5, "the worker to stop")
    clock.now += 2.0
    assert watch.frozen(pids) == []  # 2 s stopped this time, not 4


@pytest.mark.integration
def test_end_kills_the_frozen_worker(worker: subprocess.Popen[bytes]) -> None:
    clock = Clock()
    watch = FrozenWatch(1.0, clock)
    worker.send_signal(signal.SIGSTOP)
    wait_until(lambda: procs.state(worker.pid) == "T", 5, "the worker to stop")
    watch.end({0: worker.pid})
    clock.now += 1.0
    assert watch.end({0: worker.pid}) == [worker.pid]
    assert worker.wait(timeout=10) == -signal.SIGKILL
    assert procs.state(worker.pid) == ""
