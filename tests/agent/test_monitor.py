"""The agent's wait between worker checks ends as soon as a worker process ends.

Real processes, real ``kill -9``; the agent is built bare (only the wait is under test).
"""

from __future__ import annotations

import multiprocessing
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from elastic.agent.node import NodeAgent
from elastic.rendezvous.contract import ChangeKind, MembershipChange
from tests.helpers import kill_pid

LONG_S = 30.0  # the monitor interval under test: a wait that ran it out failed


def bare_agent(pcontext: object) -> NodeAgent:
    agent = NodeAgent.__new__(NodeAgent)
    agent._pcontext = pcontext  # type: ignore[assignment]
    return agent


def timed_wait(agent: NodeAgent, timeout: float = LONG_S) -> float:
    started = time.monotonic()
    agent._wait_for_worker_exit(timeout)
    return time.monotonic() - started


@pytest.fixture
def command_worker() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc
    kill_pid(proc.pid)
    proc.wait(10)


def _sleep_forever() -> None:
    time.sleep(600)


@pytest.fixture
def function_worker() -> Iterator[multiprocessing.process.BaseProcess]:
    proc = multiprocessing.get_context("spawn").Process(target=_sleep_forever, daemon=True)
    proc.start()
    yield proc
    kill_pid(proc.pid)  # type: ignore[arg-type]
    proc.join(10)


@pytest.mark.integration
def test_a_killed_command_worker_ends_the_wait(command_worker: subprocess.Popen[bytes]) -> None:
    handlers = {0: SimpleNamespace(proc=command_worker)}
    agent = bare_agent(SimpleNamespace(subprocess_handlers=handlers))
    command_worker.send_signal(signal.SIGKILL)
    assert timed_wait(agent) < LONG_S / 3


@pytest.mark.integration
def test_a_killed_function_worker_ends_the_wait(
    function_worker: multiprocessing.process.BaseProcess,
) -> None:
    context = SimpleNamespace(sentinels={function_worker.sentinel: 0})
    agent = bare_agent(SimpleNamespace(_pc=context))
    function_worker.kill()
    assert timed_wait(agent) < LONG_S / 3


@pytest.mark.integration
def test_running_workers_keep_the_interval(command_worker: subprocess.Popen[bytes]) -> None:
    agent = bare_agent(
        SimpleNamespace(subprocess_handlers={0: SimpleNamespace(proc=command_worker)})
    )
    assert timed_wait(agent, 0.3) >= 0.3


def test_without_workers_the_wait_is_torchs_sleep() -> None:
    assert timed_wait(bare_agent(None), 0.2) >= 0.2


class _Handler:
    """A MembershipHandler whose membership change the test sets (in place, no etcd)."""

    hosts_round_store = True

    def __init__(self) -> None:
        self.change: MembershipChange | None = None
        self.left, self.kept_open, self.closed_job = 0, False, False

    def membership_change(self) -> MembershipChange | None:
        return self.change

    def request_reform(self) -> None: ...
    def leave(self, timeout: float = 10.0) -> None:
        self.left += 1

    def keep_open(self) -> None:
        self.kept_open = True

    def shutdown(self) -> bool:
        self.closed_job = not self.kept_open
        return True

    def record_failed_round(self) -> int | None:
        return None

    def get_run_id(self) -> str:
        return "monitor"

    def is_closed(self) -> bool:
        return False

    def round_view(self) -> tuple[int, int, int]:
        return (1, 0, 0)

    def running_in_place(self, round_: int | None) -> None: ...

    def fence(self) -> str:
        return ""


def in_place_agent(handler: _Handler) -> NodeAgent:
    agent = bare_agent(None)
    spec = SimpleNamespace(rdzv_handler=handler)
    agent._worker_group = SimpleNamespace(spec=spec, workers=[])  # type: ignore[assignment]
    return agent


def test_in_place_a_new_membership_change_ends_the_wait() -> None:
    # A planned leave: the peer's key is gone, the workers will wait on it in their next
    # collective; the agent must not sleep out its interval first.
    handler = _Handler()
    agent = in_place_agent(handler)
    lost = MembershipChange(ChangeKind.PEERS_LOST, 1, ("n2",))
    timer = threading.Timer(0.2, lambda: setattr(handler, "change", lost))
    timer.start()
    try:
        took = timed_wait(agent)
    finally:
        timer.cancel()
    assert 0.2 <= took < LONG_S / 3


def test_in_place_a_change_already_seen_keeps_the_interval() -> None:
    handler = _Handler()
    handler.change = MembershipChange(ChangeKind.JOINERS, 1, waiting=1)  # torch acts on it
    assert timed_wait(in_place_agent(handler), 0.3) >= 0.3


class _TorchHandler:
    """torch's own handler as the agent sees it: no MembershipHandler; shutdown() closes."""

    def __init__(self) -> None:
        self.closed_job = False

    def shutdown(self) -> bool:
        self.closed_job = True
        return True

    def get_run_id(self) -> str:
        return "torch"


def _leaving(agent: NodeAgent, *, left: bool) -> object:
    agent._stop_workers = lambda group: None  # type: ignore[method-assign]
    agent._host = None
    result = agent._leave_job(agent._worker_group, "dropped as a straggler", left=left)
    # torch's launcher then shuts the handler down, whatever the run's result
    agent._worker_group.spec.rdzv_handler.shutdown()
    return result


def test_leaving_the_job_is_a_result_and_keeps_the_rendezvous_open() -> None:
    """Leaving the job on its own (a straggler drop without probation) ends the run with a
    result, not a signal: the node leaves its rendezvous once, and the launcher's shutdown
    leaves the job open for the others; no exit barrier waits for them."""
    handler = _Handler()
    agent = in_place_agent(handler)
    result = _leaving(agent, left=False)
    assert result.state.name == "SUCCEEDED"  # type: ignore[attr-defined]
    assert handler.left == 1 and handler.kept_open and not handler.closed_job
    agent._exit_barrier()  # returns at once: the others go on (torch's would wait 300 s)


def test_a_node_that_left_sitting_out_does_not_leave_again() -> None:
    handler = _Handler()
    _leaving(in_place_agent(handler), left=True)
    assert handler.left == 0 and handler.kept_open and not handler.closed_job


def test_with_torchs_own_handler_leaving_does_not_close_the_job() -> None:
    torch_handler = _TorchHandler()
    agent = in_place_agent(torch_handler)  # type: ignore[arg-type]
    _leaving(agent, left=False)
    assert not torch_handler.closed_job
    assert agent._worker_group.spec.rdzv_handler.get_run_id() == "torch"
