"""Pure logic of our rendezvous changes on torch's state objects (no etcd, frozen inputs)."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    RendezvousTimeout,
    _DistributedRendezvousOpExecutor,
    _NodeDesc,
    _RendezvousJoinOp,
    _RendezvousState,
)

from elastic.rendezvous.rounds import LeaveOp, ProbingStateHolder, WaitListExecutor
from tests.rendezvous.fakes import FakeHolder


def settings(max_nodes: int) -> RendezvousSettings:
    timeout = RendezvousTimeout(last_call=timedelta(seconds=1))
    return RendezvousSettings("job", 1, max_nodes, timeout, timedelta(seconds=1), 3)


def round_after_a_join(max_nodes: int) -> tuple[_RendezvousState, list[_NodeDesc]]:
    """n1 is back in the new round, its last call over; n2 (a member of the old round) and
    n3 (the joiner) are still on the wait list: they have not woken up in time."""
    n1, n2, n3 = (_NodeDesc(f"10.0.0.{i}", 100 + i, 0) for i in (1, 2, 3))
    now = datetime.now(timezone.utc)
    state = _RendezvousState()
    state.round = 2
    state.participants = {n1: 0}
    state.wait_list = {n2, n3}
    state.last_heartbeats = {n: now for n in (n1, n2, n3)}
    state.deadline = now - timedelta(seconds=0.1)
    return state, [n1, n2, n3]


def complete(executor_type: type, max_nodes: int) -> _RendezvousState:
    state, (n1, _, _) = round_after_a_join(max_nodes)
    executor = executor_type(n1, FakeHolder(state), settings(max_nodes))
    executor.run(_RendezvousJoinOp(), time.monotonic() + 5)
    assert state.complete
    return state


def test_torch_leaves_the_late_waiters_out_and_so_needs_another_round() -> None:
    state = complete(_DistributedRendezvousOpExecutor, 3)
    assert len(state.participants) == 1 and len(state.wait_list) == 2


def test_completing_a_round_takes_in_the_wait_list() -> None:
    state = complete(WaitListExecutor, 3)
    assert sorted(state.participants.values()) == [0, 1, 2], "every node gets a rank"
    assert not state.wait_list


def test_the_wait_list_is_taken_in_only_up_to_max_nodes() -> None:
    state = complete(WaitListExecutor, 2)
    assert len(state.participants) == 2 and len(state.wait_list) == 1


class FakeDetector:
    def __init__(self, listening: set[str]) -> None:
        self.listening = listening

    def alive(self, nodes: list[tuple[str, str]]) -> list[str]:
        return [name for name, _ in nodes if name in self.listening]


def sanitized(ages_s: dict[int, float], listening: set[int]) -> _RendezvousState:
    """Nodes 1..n with heartbeats ``ages_s`` old (window 1 s x 3), sanitized by our holder."""
    nodes = {i: _NodeDesc(f"10.0.0.{i}", 100 + i, 0) for i in ages_s}
    now = datetime.now(timezone.utc)
    state = _RendezvousState()
    state.participants = {n: 0 for n in nodes.values()}
    state.last_heartbeats = {n: now - timedelta(seconds=ages_s[i]) for i, n in nodes.items()}
    holder = ProbingStateHolder(None, settings(len(nodes)))  # type: ignore[arg-type]
    holder._state = state
    holder.detector = FakeDetector({str(nodes[i]) for i in listening})  # type: ignore[assignment]
    holder._sanitize()
    return state


def test_a_late_node_that_answers_its_probe_is_kept_with_its_real_heartbeat() -> None:
    state = sanitized({1: 0.5, 2: 4.0}, listening={1, 2})
    assert len(state.participants) == 2
    late = next(n for n in state.participants if n.pid == 102)
    age = datetime.now(timezone.utc) - state.last_heartbeats[late]
    assert age > timedelta(seconds=3.5), "the spared node's heartbeat must not be faked"


def test_a_late_node_without_an_answer_is_dropped_as_torch_would() -> None:
    state = sanitized({1: 0.5, 2: 4.0}, listening={1})
    assert [n.pid for n in state.participants] == [101]


def test_a_hung_node_that_still_listens_is_dropped_after_the_longer_window() -> None:
    state = sanitized({1: 0.5, 2: 10.0}, listening={1, 2})  # 3 windows of 3 s have passed
    assert [n.pid for n in state.participants] == [101]


def test_a_waiter_not_heard_from_lately_is_not_taken_in() -> None:
    state, (n1, n2, _) = round_after_a_join(3)
    state.last_heartbeats[n2] -= timedelta(seconds=2.5)  # within the expiry window, but quiet
    executor = WaitListExecutor(n1, FakeHolder(state), settings(3))
    executor.run(_RendezvousJoinOp(), time.monotonic() + 5)
    assert state.complete and n2 in state.wait_list and len(state.participants) == 2


def test_leaving_from_the_wait_list_removes_the_node() -> None:
    state, (_, n2, n3) = round_after_a_join(3)
    _DistributedRendezvousOpExecutor(n2, FakeHolder(state), settings(3)).run(
        LeaveOp(), time.monotonic() + 5
    )
    assert state.wait_list == {n3} and n2 not in state.last_heartbeats
