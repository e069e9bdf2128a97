"""The agent's in-place host: assignments written, registrations read (in tmp_path; no etcd,
no worker process, no agent)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from torch.distributed.elastic.agent.server.api import Worker, WorkerGroup, WorkerSpec
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

from elastic.agent.inplace_host import InPlaceHost, offered
from elastic.node import channel
from elastic.node.channel import Assignment, Registration
from elastic.rendezvous.contract import ChangeKind, MembershipChange, MembershipHandler
from elastic.rendezvous.fence import FenceSpec

OWNER = 4242  # the agent's pid names its directory only


class Handler:
    """The rendezvous as the host sees it: the round joined (its fence), leave, closed."""

    hosts_round_store = True

    def __init__(self, round_: int) -> None:
        self.round = round_
        self.closed = False
        self.asked = 0
        self.left = 0
        self.leave_fails = False
        self.in_place: list[int | None] = []  # what the host said, in order

    def fence(self) -> str:
        return FenceSpec("127.0.0.1:2379", "/elastic", "job", self.round).to_env()

    def request_reform(self) -> None:
        self.asked += 1

    def is_closed(self) -> bool:
        return self.closed

    def keep_open(self) -> None: ...

    def leave(self, timeout: float = 10.0) -> None:
        if self.leave_fails:
            raise OSError("etcd is gone")
        self.left += 1

    def membership_change(self) -> MembershipChange | None:
        return None

    def record_failed_round(self) -> int | None:
        return None

    def get_run_id(self) -> str:
        return "job"

    def round_view(self) -> tuple[int, int, int]:
        raise AssertionError("the host takes its round from the round joined, not the view")

    def running_in_place(self, round_: int | None) -> None:
        self.in_place.append(round_)


def group(handler: Handler, ranks: list[int], world_size: int, pids: list[int]) -> WorkerGroup:
    spec = WorkerSpec(
        role="default",
        local_world_size=max(len(ranks), 1),
        rdzv_handler=handler,  # type: ignore[arg-type]
        entrypoint="train.py",
    )
    wg = WorkerGroup(spec)
    wg.workers = [Worker(i, rank, rank, world_size, world_size) for i, rank in enumerate(ranks)]
    for w, pid in zip(wg.workers, pids, strict=True):
        w.id = pid
    wg.master_addr, wg.master_port = "10.0.0.1", 29500  # type: ignore[assignment]
    return wg


@pytest.fixture
def handler() -> Handler:
    return Handler(round_=4)


@pytest.fixture
def host(handler: Handler, tmp_path: Path) -> InPlaceHost:
    assert isinstance(handler, MembershipHandler)
    return InPlaceHost(handler, owner=OWNER, directory=str(tmp_path))


def assignment(host: InPlaceHost, local_rank: int) -> Assignment | None:
    return channel.read_assignment(host.channel_of(local_rank))


def register(host: InPlaceHost, local_rank: int, reg: Registration) -> None:
    channel.register(host.channel_of(local_rank), reg)


def test_offered_needs_the_flag_and_a_handler_that_keeps_the_round_store(
    handler: Handler, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert offered(handler)
    assert not offered(object())
    monkeypatch.setenv("ELASTIC_IN_PLACE", "0")
    assert not offered(handler)


def test_each_worker_is_assigned_its_rank_in_the_round_joined(
    host: InPlaceHost, handler: Handler
) -> None:
    host.write_assignments(group(handler, [2, 3], 4, [101, 102]))
    for local_rank, rank in ((0, 2), (1, 3)):
        got = assignment(host, local_rank)
        assert got is not None and got.issued > 0
        assert (got.round, got.rank, got.world_size) == (4, rank, 4)
        assert (got.master_addr, got.master_port, got.fence) == ("10.0.0.1", 29500, handler.fence())
        assert not (got.pending or got.abort or got.leave)


def test_the_next_round_is_announced_as_pending_with_abort(
    host: InPlaceHost, handler: Handler
) -> None:
    wg = group(handler, [0, 1], 2, [101, 102])
    host.announce_next_round(wg)
    assert assignment(host, 1) == Assignment(5, pending=True, abort=True)
    host.announce_next_round(wg, leave=True)
    assert assignment(host, 0) == Assignment(5, pending=True, abort=True, leave=True)


def test_a_start_clears_what_earlier_workers_left(host: InPlaceHost, handler: Handler) -> None:
    wg = group(handler, [0], 1, [101])
    register(host, 0, Registration(99, 3, want_round=True))
    host.prepare_start(wg)
    assert channel.read_registration(host.channel_of(0)) is None
    got = assignment(host, 0)
    assert got is not None and (got.round, got.rank) == (4, 0)


def test_ready_only_when_every_worker_registered_with_its_own_live_pid(
    host: InPlaceHost, handler: Handler
) -> None:
    me = os.getpid()
    wg = group(handler, [0, 1], 2, [me, me])
    assert not host.ready(wg)  # nobody registered
    register(host, 0, Registration(me, 4))
    assert not host.ready(wg)  # one of two
    register(host, 1, Registration(me + 10**6, 4))
    assert not host.ready(wg)  # a pid that is not this worker's
    register(host, 1, Registration(me, 4))
    assert host.ready(wg)
    assert not host.ready(group(handler, [], 0, []))  # no workers: torch's restart


def test_the_round_run_in_place_is_reported_once_every_worker_runs_it(
    host: InPlaceHost, handler: Handler
) -> None:
    me = os.getpid()
    wg = group(handler, [0, 1], 2, [me, me])
    register(host, 0, Registration(me, 4))
    register(host, 1, Registration(me, 3))  # still in the round before: a switch under way
    host.report_round(wg)
    assert handler.in_place == []  # None, as before: nothing to say
    register(host, 1, Registration(me, 4))
    host.report_round(wg)
    host.report_round(wg)
    assert handler.in_place == [4]  # said once
    register(host, 0, Registration(me, 4, waiting=True))  # its step failed on a lost peer
    host.report_round(wg)
    assert handler.in_place == [4, None]
    register(host, 0, Registration(me, 4))
    host.report_round(wg)
    host.prepare_start(wg)  # a restart: the new workers run nothing yet
    assert handler.in_place == [4, None, 4, None]


def test_registrations_of_an_older_round_are_not_read(host: InPlaceHost, handler: Handler) -> None:
    wg = group(handler, [0, 1], 2, [101, 102])
    register(host, 0, Registration(101, 3, waiting=True))  # the round before ours
    register(host, 1, Registration(102, 4))
    assert host.registrations(wg) == [Registration(102, 4)]
    assert not host.any_waiting(wg)
    register(host, 1, Registration(102, 4, waiting=True))
    assert host.any_waiting(wg)


def test_a_worker_asking_for_a_round_is_heard_once_per_round(
    host: InPlaceHost, handler: Handler
) -> None:
    wg = group(handler, [0], 1, [101])
    assert not host.ask_for_round_if_wanted(wg)
    register(host, 0, Registration(101, 4, want_round=True))
    assert host.ask_for_round_if_wanted(wg)
    assert not host.ask_for_round_if_wanted(wg)
    assert handler.asked == 1
    handler.round = 5
    register(host, 0, Registration(101, 5, want_round=True))
    handler.closed = True  # no round will form: end as torch's restart would
    with pytest.raises(RendezvousClosedError, match="closed"):
        host.ask_for_round_if_wanted(wg)


@pytest.mark.parametrize(
    ("change", "aborted_first"),
    [
        (MembershipChange(ChangeKind.PEERS_LOST, 4, ("n2",)), True),
        (None, True),  # a worker asked
        (MembershipChange(ChangeKind.PEERS_ASKED, 4, ("n2",), waiting=1), True),  # a peer's did
        (MembershipChange(ChangeKind.JOINERS, 4, waiting=1), False),
    ],
)
def test_a_reform_in_place_keeps_the_processes_and_assigns_the_new_round(
    host: InPlaceHost, handler: Handler, change: MembershipChange | None, aborted_first: bool
) -> None:
    wg = group(handler, [0, 1], 2, [101, 102])
    host.write_assignments(wg)
    seen: list[Assignment | None] = []

    def rendezvous(worker_group: WorkerGroup) -> None:  # torch's: new Worker objects
        seen.append(assignment(host, 0))
        handler.round = 7
        worker_group.workers = [Worker(i, 3 + i, 3 + i, 5, 5) for i in range(2)]

    host.reform_in_place(wg, change, rendezvous)
    assert [w.id for w in wg.workers] == [101, 102]
    before = seen[0]
    assert before is not None and (before.pending and before.abort) is aborted_first
    for local_rank in (0, 1):
        got = assignment(host, local_rank)
        assert got is not None and not got.pending
        assert (got.round, got.rank, got.world_size) == (7, 3 + local_rank, 5)


def test_leave_in_place_leaves_the_rendezvous_then_tells_the_workers(
    host: InPlaceHost, handler: Handler
) -> None:
    me = os.getpid()
    wg = group(handler, [0], 1, [me])
    host.leave(wg)  # not in place: nothing to do
    assert (handler.left, host.left, assignment(host, 0)) == (0, False, None)
    register(host, 0, Registration(me, 4))
    handler.leave_fails = True
    host.leave(wg)  # the others will notice by heartbeat expiry; ours still stop
    assert not host.left and assignment(host, 0) == Assignment(
        5, pending=True, abort=True, leave=True
    )
    handler.leave_fails = False
    host.leave(wg)
    assert handler.left == 1 and host.left
