"""Early close: a round that only re-forms the previous one closes once every live member
is back, without the last call; a round with a new node still gets the last call.

First the pure logic on torch's state objects (no etcd, no sleeping: torch's poll is
replaced by one that fails the test), then real handlers on a real etcd with a real
``kill -9`` of a node process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters, dynamic_rendezvous
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    RendezvousTimeout,
    _NodeDesc,
    _RendezvousJoinOp,
    _RendezvousState,
)

from elastic.etcd.server import EtcdServer
from elastic.rendezvous.handler import EtcdRendezvousHandler
from elastic.rendezvous.options import FAST_FAILOVER
from elastic.rendezvous.registry import create_rdzv_handler
from elastic.rendezvous.rounds import (
    MEMBERS_ATTR,
    LeaveOp,
    ProbingStateHolder,
    WaitListExecutor,
    completed_members,
    may_close_early,
    previous_members,
    record_members,
)
from tests.helpers import REPO, kill_pid, wait_until
from tests.rendezvous.fakes import FakeHolder

A, B, C, D = (_NodeDesc(f"10.0.0.{i}", 100 + i, 0) for i in range(1, 5))


class WaitedForTheLastCall(Exception):
    pass


@pytest.fixture
def no_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's join loop polls (sleeps) only while it waits: make that wait fail at once."""

    def refuse(seconds: object) -> None:
        raise WaitedForTheLastCall

    monkeypatch.setattr(dynamic_rendezvous, "_delay", refuse)


def settings(min_nodes: int = 1, max_nodes: int = 4) -> RendezvousSettings:
    timeout = RendezvousTimeout(last_call=timedelta(seconds=30))
    return RendezvousSettings("job", min_nodes, max_nodes, timeout, timedelta(seconds=1), 3)


def reforming(members: set[_NodeDesc], back: set[_NodeDesc]) -> _RendezvousState:
    """Round 3 is open after round 2 (``members``) completed; ``back`` are participants of
    round 3 already, the last call 30 s away."""
    now = datetime.now(timezone.utc)
    state = _RendezvousState()
    state.round = 2
    state.participants = dict.fromkeys(members, 0)
    record_members(state)
    state.round = 3
    state.participants = dict.fromkeys(back, 0)
    state.last_heartbeats = dict.fromkeys(members | back, now)
    state.deadline = now + timedelta(seconds=30)
    return state


def join(node: _NodeDesc, state: _RendezvousState, min_nodes: int = 1) -> None:
    executor = WaitListExecutor(node, FakeHolder(state), settings(min_nodes))
    executor.run(_RendezvousJoinOp(), time.monotonic() + 60)


def test_a_round_of_every_previous_member_may_close() -> None:
    state = reforming({A, B}, {A, B})
    assert may_close_early(state, settings())


@pytest.mark.parametrize(
    "why",
    ["member missing", "new node", "someone waits", "below min_nodes", "no record", "old record"],
)
def test_otherwise_the_last_call_applies(why: str) -> None:
    state = reforming({A, B}, {A, B})
    min_nodes = 1
    if why == "member missing":
        state.participants = {A: 0}
    elif why == "new node":
        state.participants[D] = 0
    elif why == "someone waits":
        state.wait_list = {D}
    elif why == "below min_nodes":
        min_nodes = 3
    elif why == "no record":
        delattr(state, MEMBERS_ATTR)
    else:  # the record is of round 1, not of the round just before this one
        state.round = 4
    assert not may_close_early(state, settings(min_nodes))


@pytest.mark.usefixtures("no_waiting")
def test_the_last_survivor_to_join_closes_the_round_in_its_own_write() -> None:
    state = reforming({A, B}, {A})  # C was killed and removed; B comes back
    join(B, state)
    assert state.complete and state.deadline is None
    assert sorted(state.participants.values()) == [0, 1], "every node gets a rank"
    assert previous_members(_next_round(state)) == {A, B}, "this round is the record now"


@pytest.mark.usefixtures("no_waiting")
def test_a_waiting_participant_closes_once_the_rest_are_back() -> None:
    state = reforming({A, B}, {A, B})  # both back, A's last call still 30 s away
    join(A, state)
    assert state.complete


@pytest.mark.usefixtures("no_waiting")
def test_a_survivor_waits_for_a_member_that_is_not_back_yet() -> None:
    state = reforming({A, B, C}, {A})
    with pytest.raises(WaitedForTheLastCall):
        join(A, state)
    assert not state.complete


@pytest.mark.usefixtures("no_waiting")
def test_a_new_node_gets_the_last_call_so_more_joiners_can_land_in_the_round() -> None:
    state = reforming({A, B}, {A, B})
    state.participants.pop(B)
    state.wait_list = {B, D}  # B (a member) and D (a newcomer) were waiting
    for node in (D, B):  # D goes first: the round has a newcomer
        with pytest.raises(WaitedForTheLastCall):
            join(node, state)
    assert not state.complete and set(state.participants) == {A, B, D}


def test_a_leave_is_forgotten_so_the_next_round_does_not_wait_for_it() -> None:
    state = reforming({A, B}, set())
    state.round, state.complete = 2, True  # back in the completed round {A, B}
    state.participants = {A: 0, B: 1}
    WaitListExecutor(B, FakeHolder(state), settings()).run(LeaveOp(), time.monotonic() + 5)
    state.participants.pop(A)  # A re-forms: it leaves the completed round the usual way
    state.round, state.complete = 3, False
    assert previous_members(state) == {A}
    state.participants = {A: 0}
    assert may_close_early(state, settings())


def test_a_node_removed_as_dead_is_forgotten() -> None:
    state = reforming({A, B, C}, set())
    state.last_heartbeats[C] -= timedelta(seconds=10)  # expired (1 s x 3)
    holder = ProbingStateHolder(None, settings())  # type: ignore[arg-type]
    holder._state = state
    holder._sanitize()
    assert previous_members(state) == {A, B}


def test_the_record_survives_pickling() -> None:
    state = reforming({A, B}, {A})
    state = _next_round(state, advance=False)
    assert previous_members(state) == {A, B}


def _next_round(state: _RendezvousState, advance: bool = True) -> _RendezvousState:
    import pickle

    copy: _RendezvousState = pickle.loads(pickle.dumps(state))
    if advance:
        copy.round += 1
        copy.complete = False
    return copy


# Real etcd, real processes.

LAST_CALL_S = 30  # far longer than any early close; a round that waits for it fails the test


def handler(
    etcd: EtcdServer, run_id: str, last_call_s: float = LAST_CALL_S, max_nodes: int = 3
) -> EtcdRendezvousHandler:
    params = RendezvousParameters(
        "etcd-v3",
        etcd.endpoint,
        run_id,
        1,
        max_nodes,
        local_addr="127.0.0.1",
        profile=FAST_FAILOVER,
        join_timeout="60",
        last_call_timeout=str(last_call_s),
        algorithm="single-key",
    )
    made = create_rdzv_handler(params)
    assert isinstance(made, EtcdRendezvousHandler)
    return made


def form(handlers: list[EtcdRendezvousHandler]) -> float:
    """Run every handler's next round at once; the seconds it took."""
    started = time.monotonic()
    threads = [threading.Thread(target=h.next_rendezvous, daemon=True) for h in handlers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "the round did not form"
    return time.monotonic() - started


VICTIM = """
import sys, time
from torch.distributed.elastic.rendezvous import RendezvousParameters
from elastic.rendezvous.options import FAST_FAILOVER
from elastic.rendezvous.registry import create_rdzv_handler
params = RendezvousParameters(
    "etcd-v3", sys.argv[1], sys.argv[2], 1, 3, local_addr="127.0.0.1",
    profile=FAST_FAILOVER, join_timeout="60", last_call_timeout=sys.argv[3],
    algorithm="single-key",
)
info = create_rdzv_handler(params).next_rendezvous()
print("formed", info.world_size, flush=True)
time.sleep(600)
"""


@pytest.fixture
def victim(etcd: EtcdServer, run_id: str, tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """A third node in its own process, joining ``run_id``; killed by PID afterwards."""
    script = tmp_path / "victim.py"
    script.write_text(textwrap.dedent(VICTIM))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, str(script), etcd.endpoint, run_id, str(LAST_CALL_S)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    yield proc
    kill_pid(proc.pid)
    proc.wait(10)


@pytest.fixture
def survivors(etcd: EtcdServer, run_id: str) -> Iterator[list[EtcdRendezvousHandler]]:
    made = [handler(etcd, run_id), handler(etcd, run_id)]
    yield made
    for h in made:
        h.shutdown()


def test_after_a_kill_the_survivors_close_their_round_without_the_last_call(
    survivors: list[EtcdRendezvousHandler], victim: subprocess.Popen[str]
) -> None:
    form(survivors)  # three nodes (max_nodes): the round completes as the third joins
    assert victim.stdout is not None and victim.stdout.readline().split() == ["formed", "3"]
    a, b = survivors
    name = next(str(n) for n in a._peers if n.pid == victim.pid)
    wait_until(lambda: any(v[0] == name for v in a._detector._verified), 10, "a probe")  # type: ignore[union-attr]
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(10)
    seconds = form(survivors)
    state = a._state_holder.state
    assert state.complete and set(state.participants) == {a._this_node, b._this_node}
    assert seconds < LAST_CALL_S / 3, f"re-formed in {seconds:.1f} s: it waited for the last call"


def test_after_a_leave_the_rest_close_without_the_last_call(
    survivors: list[EtcdRendezvousHandler], etcd: EtcdServer, run_id: str
) -> None:
    third = handler(etcd, run_id)
    try:
        form([*survivors, third])
        third.leave()
        seconds = form(survivors)
    finally:
        third.close()
    assert seconds < LAST_CALL_S / 3, f"re-formed in {seconds:.1f} s: it waited for the last call"
    assert len(survivors[0]._state_holder.state.participants) == 2


def test_a_join_still_gets_the_last_call(etcd: EtcdServer, run_id: str) -> None:
    last_call_s = 2.0
    a, b, c = (handler(etcd, run_id, last_call_s, max_nodes=4) for _ in range(3))
    try:
        form([a, b])
        joiner = threading.Thread(target=c.next_rendezvous, daemon=True)
        joiner.start()  # as in a run: the group re-forms because a node waits
        wait_until(a.membership_change, 30, "the joiner on the wait list")
        seconds = form([a, b])
        joiner.join(30)
    finally:
        for h in (a, b, c):
            h.shutdown()
    assert seconds >= last_call_s, f"closed in {seconds:.1f} s: a newcomer must get the last call"
    assert len(a._state_holder.state.participants) == 3


def test_only_a_member_that_left_its_completed_round_waits_on_the_rest() -> None:
    state = reforming({A, B, C}, set())
    state.round, state.complete = 2, True
    state.participants = {B: 1, C: 2}  # A left round 2 to re-form it
    assert completed_members(state) - set(state.participants) == {A}
    state.complete = False
    assert completed_members(state) == frozenset(), "an open round has no members yet"
