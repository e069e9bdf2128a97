"""The ``announce`` rendezvous (elastic.rendezvous.announce) on a real etcd, with in-process
handlers in threads: forming rounds, joiners, deaths, bursts, and its etcd cost."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousInfo,
    RendezvousParameters,
)

from elastic.etcd.server import EtcdServer
from elastic.rendezvous.announce import (
    AnnounceRendezvousHandler,
    announce_status,
    build_announce_handler,
)
from elastic.rendezvous.contract import ChangeKind, MembershipChange
from elastic.rendezvous.options import RendezvousOptions
from tests.helpers import wait_until

# last call 0.5 s: a round closes half a second after the last node announced.
CONF = {
    "algorithm": "announce",
    "last_call_timeout": "0.5",
    "keep_alive_interval": "1",
    "keep_alive_max_attempt": "3",
    "join_timeout": "60",
}
# Requests a node may make in one round beyond its deliberate waits (one watch each).
MAX_REQUESTS_PER_ROUND = 5


class Nodes:
    """In-process handlers of one run, each on its own etcd client, closed at the end."""

    def __init__(self, etcd: EtcdServer, run_id: str, nnodes: str, **conf: str) -> None:
        self.etcd, self.run_id = etcd, run_id
        self.conf = {**CONF, **conf}
        self.min, self.max = (int(n) for n in (nnodes.split(":") * 2)[:2])
        self.handlers: list[AnnounceRendezvousHandler] = []

    def add(self, n: int = 1) -> list[AnnounceRendezvousHandler]:
        new = []
        for _ in range(n):
            params = RendezvousParameters(
                "etcd-v3",
                self.etcd.endpoint,
                self.run_id,
                self.min,
                self.max,
                local_addr="127.0.0.1",
                **self.conf,
            )
            new.append(build_announce_handler(params, RendezvousOptions.from_params(params)))
        self.handlers += new
        return new

    def close(self) -> None:
        for h in self.handlers:
            h.close()


@pytest.fixture
def nodes(etcd: EtcdServer, run_id: str) -> Iterator[Callable[..., Nodes]]:
    """``nodes("min:max", option=value, ...)``: a run; options override :data:`CONF`."""
    made: list[Nodes] = []

    def make(nnodes: str, **conf: str) -> Nodes:
        made.append(Nodes(etcd, run_id, nnodes, **conf))
        return made[-1]

    yield make
    for n in made:
        n.close()


def join_all(handlers: list[AnnounceRendezvousHandler]) -> dict[str, RendezvousInfo]:
    """next_rendezvous on every handler at once (threads); their infos by node name."""
    infos: dict[str, RendezvousInfo] = {}
    errors: list[BaseException] = []

    def join(h: AnnounceRendezvousHandler) -> None:
        try:
            infos[h.name] = h.next_rendezvous()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(h,)) for h in handlers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors, errors
    assert len(infos) == len(handlers)
    return infos


def start_joining(
    h: AnnounceRendezvousHandler, joined: dict[str, RendezvousInfo]
) -> threading.Thread:
    """next_rendezvous of a newcomer in a thread; its info lands in ``joined``."""
    thread = threading.Thread(target=lambda: joined.update({h.name: h.next_rendezvous()}))
    thread.start()
    return thread


def changes_seen(
    handlers: list[AnnounceRendezvousHandler], timeout: float, what: str
) -> list[MembershipChange]:
    """Once every one of ``handlers`` reports a membership change: their changes."""
    return wait_until(
        lambda: (
            all(h.membership_change() for h in handlers)
            and [h.membership_change() for h in handlers]
        ),
        timeout,
        what,
    )


def kill(h: AnnounceRendezvousHandler) -> None:
    """As kill -9 of the node's agent: its threads stop and its probe port closes, while its
    lease lives on until it expires (or the reaper deletes its key)."""
    h._stop_threads()
    assert h._keeper.listener is not None
    h._keeper.close()
    h._lease.id = 0


def pause(seconds: float) -> None:
    """Let the background threads act for ``seconds`` (a deadline, not a bare sleep)."""
    until = time.monotonic() + seconds
    wait_until(lambda: time.monotonic() > until, seconds + 5, f"{seconds} s to pass")


def round_of(h: AnnounceRendezvousHandler) -> int:
    return int(h._joined_round)  # type: ignore[arg-type]


def assert_one_round(infos: dict[str, RendezvousInfo], handlers: list[Any]) -> None:
    world = len(handlers)
    assert sorted(i.rank for i in infos.values()) == list(range(world))
    assert {i.world_size for i in infos.values()} == {world}
    assert len({round_of(h) for h in handlers}) == 1
    masters = {
        (i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port)
        for i in infos.values()
    }
    assert len(masters) == 1


@pytest.mark.parametrize("n", [8, 32])
def test_a_round_of_n_nodes_forms(nodes: Callable[..., Nodes], n: int) -> None:
    run = nodes(f"{n}:{n}")
    handlers = run.add(n)
    infos = join_all(handlers)
    assert_one_round(infos, handlers)
    assert all(h.membership_change() is None for h in handlers)
    # The round's store works for every node (a prefix per round).
    infos[handlers[0].name].store.set("k", b"v")
    assert infos[handlers[-1].name].store.get("k") == b"v"


def test_a_joiner_is_seen_as_joiners_and_taken_in_at_the_next_round(
    nodes: Callable[..., Nodes],
) -> None:
    run = nodes("2:8")
    first = run.add(3)
    join_all(first)
    start = round_of(first[0])
    [late] = run.add(1)
    joined: dict[str, RendezvousInfo] = {}
    thread = start_joining(late, joined)
    changes = changes_seen(first, 30, "the running nodes to see the joiner")
    assert {c.kind for c in changes} == {ChangeKind.JOINERS}, changes
    assert all(c.waiting >= 1 for c in changes)
    infos = join_all(first)
    thread.join(30)
    assert late.name in joined
    everyone = [*first, late]
    infos[late.name] = joined[late.name]
    assert_one_round(infos, everyone)
    assert round_of(late) == start + 1, "taken in with at most one extra round"


def test_a_killed_member_is_removed(nodes: Callable[..., Nodes]) -> None:
    """A member whose agent is gone (probe port refused) is reaped long before its lease
    would expire; one whose lease is revoked vanishes at once."""
    run = nodes("1:4")
    handlers = run.add(4)
    join_all(handlers)
    victim, revoked = handlers[1], handlers[2]
    kill(victim)  # its lease lives on (TTL 3 s) but must not be waited for
    revoked._stop_threads()
    revoked._lease.revoke()
    survivors = [handlers[0], handlers[3]]
    changes = changes_seen(survivors, 30, "the survivors to see the lost peers")
    assert {c.kind for c in changes} == {ChangeKind.PEERS_LOST}
    infos = join_all(survivors)
    assert_one_round(infos, survivors)


def test_ten_joiners_at_once_take_at_most_one_extra_round(nodes: Callable[..., Nodes]) -> None:
    run = nodes("2:16")
    first = run.add(4)
    join_all(first)
    start = round_of(first[0])
    burst = run.add(10)
    joined: dict[str, RendezvousInfo] = {}
    threads = [start_joining(h, joined) for h in burst]
    wait_until(lambda: all(h.membership_change() for h in first), 30, "JOINERS")
    infos = join_all(first)
    for t in threads:
        t.join(30)
    infos.update(joined)
    everyone = [*first, *burst]
    assert_one_round(infos, everyone)
    assert round_of(first[0]) == start + 1


def test_a_round_run_in_place_hears_of_a_newcomer_without_its_last_call(
    nodes: Callable[..., Nodes],
) -> None:
    """The closer's agent says its workers run the newest round in place: a newcomer is
    named at once (the running ranks train on until its workers are ready), not after a
    last call far longer than the whole exchange (the rule's other rows: test_policy)."""
    last_call = 6.0
    run = nodes("2:4", last_call_timeout=str(last_call))
    first = run.add(2)
    join_all(first)  # the first round: after the last call
    for h in first:
        h.running_in_place(round_of(h))
    began = time.monotonic()
    [newcomer] = run.add(1)
    joined: dict[str, RendezvousInfo] = {}
    thread = start_joining(newcomer, joined)
    changes = changes_seen(first, 30, "JOINERS")
    assert time.monotonic() - began < last_call / 2
    assert {c.kind for c in changes} == {ChangeKind.JOINERS}
    infos = join_all(first)
    thread.join(30)
    infos.update(joined)
    assert_one_round(infos, [*first, newcomer])


@pytest.mark.parametrize("n", [8, 32])
def test_etcd_requests_per_node_per_round(nodes: Callable[..., Nodes], n: int) -> None:
    """Worst node's etcd requests for one round (keep-alives apart: one per second each)."""
    run = nodes(f"{n}:{n}")
    handlers = run.add(n)
    join_all(handlers)  # the first round: leases, connections, the closer's one full read
    for h in handlers:
        h.request_reform()
    before = {h.name: h._client.requests - h.keepalives for h in handlers}
    join_all(handlers)
    after = {h.name: h._client.requests - h.keepalives for h in handlers}
    spent = {name: after[name] - before[name] for name in before}
    worst = max(spent.values())
    assert worst <= MAX_REQUESTS_PER_ROUND, spent


def test_nodes_beyond_max_nodes_wait_without_breaking_up_a_full_round(
    nodes: Callable[..., Nodes],
) -> None:
    """A full round (max_nodes) is not re-formed for a node that could not join it (torch's
    redundancy list); once a member is lost, the waiting node takes its place."""
    run = nodes("1:2")
    first = run.add(2)
    join_all(first)
    [extra] = run.add(1)
    joined: dict[str, RendezvousInfo] = {}

    def join() -> None:
        with contextlib.suppress(RendezvousClosedError):
            joined["x"] = extra.next_rendezvous()

    threading.Thread(target=join, daemon=True).start()
    closer = next(h for h in first if h.is_closer)
    wait_until(lambda: extra.name in closer._state.members, 30, "the closer to see the extra node")
    settled = time.monotonic() + 1.5
    wait_until(lambda: time.monotonic() > settled, 5, "the closer to act on it")
    assert all(h.membership_change() is None for h in first)
    leaver = next(h for h in first if h is not closer)
    leaver.leave()
    change = wait_until(closer.membership_change, 30, "the closer to see the loss")
    assert change.kind is ChangeKind.PEERS_LOST
    infos = join_all([closer])
    wait_until(lambda: "x" in joined, 30, "the waiting node to join")
    infos[extra.name] = joined["x"]
    assert_one_round(infos, [closer, extra])


# Leases of 60 s (20 s x 3): a test that passes re-formed through a probe, not an expiry.
LONG_LEASE = {"keep_alive_interval": "20", "keep_alive_max_attempt": "3"}


def test_a_member_killed_just_after_its_round_formed_is_reaped_not_waited_for(
    nodes: Callable[..., Nodes],
) -> None:
    """Issue 12: a node killed before its watcher's first periodic probe had never been seen
    accepting, so its refused port proved nothing; the survivors waited for close_timeout,
    then took the dead node (its key alive until its lease expired) into the next round.
    Peers are now probed as soon as a round forms, so the kill is proven at once."""
    run = nodes("1:3", **LONG_LEASE)
    handlers = run.add(3)
    join_all(handlers)
    pause(0.5)  # less than any worker takes to start, and than the 2 s probe period
    killed_at = time.monotonic()
    kill(handlers[1])
    survivors = [handlers[0], handlers[2]]
    wait_until(lambda: all(h.membership_change() for h in survivors), 20, "PEERS_LOST")
    infos = join_all(survivors)
    assert_one_round(infos, survivors)
    took = time.monotonic() - killed_at
    assert took < 10, f"re-formed {took:.1f} s after the kill (lease 60 s, close_timeout 30 s)"


def test_a_round_that_only_re_forms_the_previous_one_closes_without_the_last_call(
    nodes: Callable[..., Nodes],
) -> None:
    """Early close: once every live member of the previous round is back and nobody else
    waits, the round closes at once; a new node still gets the last call, while the round
    trains on (the running members hear of it only once its last call has passed)."""
    last_call = 5.0
    run = nodes("2:4", last_call_timeout=str(last_call))
    handlers = run.add(4)
    join_all(handlers)  # max_nodes: no last call either
    for victim in handlers[1:3]:
        kill(victim)
    survivors = [handlers[0], handlers[3]]
    wait_until(lambda: all(h.membership_change() for h in survivors), 20, "PEERS_LOST")
    started = time.monotonic()
    infos = join_all(survivors)
    early = time.monotonic() - started
    assert_one_round(infos, survivors)
    assert early < last_call / 2, f"{early:.1f} s: the survivors waited for the last call"

    [newcomer] = run.add(1)
    joined: dict[str, RendezvousInfo] = {}
    thread = threading.Thread(target=lambda: joined.update(x=newcomer.next_rendezvous()))
    arrived = time.monotonic()
    thread.start()
    wait_until(lambda: all(h.membership_change() for h in survivors), 20, "JOINERS")
    late = time.monotonic() - arrived
    started = time.monotonic()
    infos = join_all(survivors)
    early = time.monotonic() - started
    thread.join(30)
    infos[newcomer.name] = joined["x"]
    assert_one_round(infos, [*survivors, newcomer])
    assert late > last_call - 0.05, f"{late:.1f} s: a new node must get the last call"
    assert early < last_call / 2, f"{early:.1f} s: a second last call after the join"


def first_change_at(handlers: list[AnnounceRendezvousHandler], what: str) -> float:
    """When every one of ``handlers`` reported a membership change (polled every 10 ms)."""
    wait_until(lambda: all(h.membership_change() for h in handlers), 30, what, every=0.01)
    return time.monotonic()


@pytest.mark.parametrize("nnodes", ["2:8", "2:4"])
def test_the_running_round_trains_on_through_a_newcomers_last_call(
    nodes: Callable[..., Nodes], nnodes: str
) -> None:
    """Issue 11: a newcomer gets its last call while the round runs (also one that fills
    the round to max_nodes, 2:4: it gets ready meanwhile). The running members see no
    change until it has passed, then stop and re-form at once (no second last call):
    training stands still only for the re-form."""
    last_call = 2.0
    run = nodes(nnodes, last_call_timeout=str(last_call))
    first = run.add(3)
    join_all(first)
    start = round_of(first[0])
    closer = next(h for h in first if h.is_closer)
    [newcomer] = run.add(1)
    joined: dict[str, RendezvousInfo] = {}
    arrived = time.monotonic()
    thread = start_joining(newcomer, joined)
    wait_until(lambda: newcomer.name in closer._state.members, 10, "the closer to see the newcomer")
    assert all(h.membership_change() is None for h in first), "stopped during the last call"
    heard = first_change_at(first, "JOINERS") - arrived
    changes = [h.membership_change() for h in first]
    assert {c.kind for c in changes if c} == {ChangeKind.JOINERS}, changes
    assert last_call - 0.05 < heard < last_call + 3, f"JOINERS {heard:.2f} s after the join"
    started = time.monotonic()
    infos = join_all(first)
    reform = time.monotonic() - started
    thread.join(30)
    infos.update(joined)
    assert_one_round(infos, [*first, newcomer])
    assert round_of(newcomer) == start + 1
    assert reform < last_call / 2, f"re-formed in {reform:.2f} s: a second last call"


def test_two_newcomers_within_one_last_call_land_in_one_round(
    nodes: Callable[..., Nodes],
) -> None:
    """A newcomer that arrives during another's last call shares it: one publication
    (``waiting`` 2), one round for both."""
    last_call = 2.0
    run = nodes("2:8", last_call_timeout=str(last_call))
    first = run.add(2)
    join_all(first)
    start = round_of(first[0])
    closer = next(h for h in first if h.is_closer)
    one, two = run.add(2)
    joined: dict[str, RendezvousInfo] = {}
    arrived = time.monotonic()
    threads = [start_joining(one, joined)]
    wait_until(lambda: one.name in closer._state.members, 10, "the closer to see the first one")
    threads.append(start_joining(two, joined))
    wait_until(lambda: two.name in closer._state.members, 10, "the closer to see the second one")
    assert all(h.membership_change() is None for h in first), "stopped during the last call"
    heard = first_change_at(first, "JOINERS") - arrived
    changes = [h.membership_change() for h in first]
    assert all(c is not None and c.waiting == 2 for c in changes), changes
    assert last_call - 0.05 < heard < last_call + 3, f"JOINERS {heard:.2f} s after the first"
    infos = join_all(first)
    for t in threads:
        t.join(30)
    infos.update(joined)
    everyone = [*first, one, two]
    assert_one_round(infos, everyone)
    assert round_of(one) == start + 1


def test_a_member_that_asks_for_a_new_round_is_no_joiner_to_the_others(
    nodes: Callable[..., Nodes],
) -> None:
    """A member whose step failed (it saw a lost peer before the closer did) asks for a new
    round. The others hear that it asked (PEERS_ASKED: their collectives may wait on it, so
    an in-place agent releases them), not that a node waits to join (JOINERS: the round
    trains on; seen in the bench: a survivor's worker stuck 2 s in the old group)."""
    run = nodes("1:3")
    handlers = run.add(3)
    join_all(handlers)
    asker = next(h for h in handlers if not h.is_closer)
    others = [h for h in handlers if h is not asker]
    asker.request_reform()
    joined: dict[str, RendezvousInfo] = {}
    thread = start_joining(asker, joined)
    changes = changes_seen(others, 20, "the others hear of the request")
    assert [(c.kind, c.nodes) for c in changes] == [(ChangeKind.PEERS_ASKED, (asker.name,))] * 2
    infos = join_all(others)
    thread.join(30)
    infos[asker.name] = joined[asker.name]
    assert_one_round(infos, handlers)


def test_a_member_left_behind_by_close_timeout_is_no_joiner_until_it_announces(
    nodes: Callable[..., Nodes],
) -> None:
    """A member that neither asks for a new round nor dies provably (a hung agent, or a dead
    one whose port was never seen accepting) is left behind after close_timeout. Until it
    announces again it is no joiner: the new round must not re-form for it at once."""
    run = nodes("1:3", close_timeout="2")
    handlers = run.add(3)
    join_all(handlers)
    slow = next(h for h in handlers if not h.is_closer)
    others = [h for h in handlers if h is not slow]
    for h in others:
        h.request_reform()
    infos = join_all(others)  # close_timeout: without the slow member
    assert_one_round(infos, others)
    pause(2.0)  # the closer has seen the slow member's key all along
    assert all(h.membership_change() is None for h in others)
    dropped = slow.membership_change()
    assert dropped is not None and dropped.kind is ChangeKind.DROPPED

    joined: dict[str, RendezvousInfo] = {}
    thread = start_joining(slow, joined)
    changes = changes_seen(others, 20, "JOINERS")
    assert {c.kind for c in changes} == {ChangeKind.JOINERS}
    infos = join_all(others)
    thread.join(30)
    infos[slow.name] = joined[slow.name]
    assert_one_round(infos, handlers)


def test_status_reports_the_round_and_each_members_rank_and_heartbeat(
    nodes: Callable[..., Nodes],
) -> None:
    run = nodes("2:3")
    handlers = run.add(2)
    client, keys = handlers[0]._client, handlers[0]._keys
    assert announce_status(client, keys) == {"exists": False}
    infos = join_all(handlers)
    status = announce_status(client, keys)
    assert status["exists"] and status["complete"] and not status["closed"]
    assert (status["round"], status["world_size"]) == (round_of(handlers[0]), 2)
    by_node = {m["node"]: m for m in status["members"]}
    assert {n: m["state"] for n, m in by_node.items()} == {
        n: f"rank {i.rank}" for n, i in infos.items()
    }
    assert all(0 <= m["last_heartbeat_s_ago"] <= 3 for m in by_node.values())
