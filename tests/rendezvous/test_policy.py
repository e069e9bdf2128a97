"""The announce closer's rules (elastic.rendezvous.announce.policy), table-style with a fake
clock: each row is a view, timers and ``now``, and the action, reason and wake-up expected.
No etcd: the rules are pure functions, as torch's rendezvous ops."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from elastic.rendezvous.announce import policy
from elastic.rendezvous.announce.policy import Action, Limits, Timers, View
from elastic.rendezvous.announce.records import Member, Round
from elastic.rendezvous.contract import ChangeKind

LAST_CALL = 2.0
CLOSE_TIMEOUT = 30.0


def member(name: str, created: int, after: int = -1, mod: int | None = None) -> Member:
    """A member key ``name`` created at revision ``created`` that left round ``after``."""
    return Member(
        name=name,
        create_revision=created,
        mod_revision=created if mod is None else mod,
        addr=f"10.0.0.{created}",
        pid=100 + created,
        local_id=0,
        probe=9000 + created,
        port=29500 + created,
        after=after,
    )


def round_of(number: int, *names: str, **fields: object) -> Round:
    return Round(number, {n: rank for rank, n in enumerate(names)}, **fields)  # type: ignore[arg-type]


def view(
    round_: Round, *members: Member, min_nodes: int = 2, max_nodes: int = 4, in_place: bool = False
) -> View:
    limits = Limits(min_nodes, max_nodes, LAST_CALL, CLOSE_TIMEOUT)
    return View(round_, {m.name: m for m in members}, limits, in_place)


NEW = Round()  # a run's first round: no round key yet
A, B, C, D = member("a", 1), member("b", 2), member("c", 3), member("d", 4)


def back(m: Member, after: int) -> Member:
    """``m`` announced again after leaving round ``after`` (a new mod_revision)."""
    return Member(**{**m.__dict__, "after": after, "mod_revision": m.mod_revision + 100})


def anew(m: Member, after: int) -> Member:
    """``m`` announced again after leaving round ``after`` with its key created anew (its
    lease expired: created by that write)."""
    revision = m.create_revision + 100
    return Member(
        **{**m.__dict__, "after": after, "create_revision": revision, "mod_revision": revision}
    )


@dataclass(frozen=True)
class Row:
    view: View
    now: float
    action: Action
    reason: str  # a part of the decision's reason
    wake_at: float
    timers: Timers = field(default_factory=lambda: Timers(last_change=0.0))


ROWS = {
    "first round, the last call runs": Row(
        view(NEW, A, B), 1.0, Action.WAIT, "2 ready, the last call runs", 2.0
    ),
    "first round, the last call passed": Row(
        view(NEW, A, B), 2.5, Action.PUBLISH, "2 ready and the last call passed", 2.5
    ),
    "max_nodes ready closes at once": Row(
        view(NEW, A, B, max_nodes=2), 0.1, Action.PUBLISH, "max_nodes=2 are ready", 0.1
    ),
    "fewer than min_nodes: wait for news": Row(
        view(NEW, A), 5.0, Action.WAIT, "1 ready of min_nodes=2", 5.0 + policy.IDLE_WATCH_S
    ),
    "early close: every live member of the round is back": Row(
        view(round_of(3, "a", "b", "c"), back(A, 3), back(B, 3)),  # c was reaped
        0.1,
        Action.PUBLISH,
        "every live member of round 3 is back (early close)",
        0.1,
    ),
    "early close with the newcomer joining named": Row(
        view(round_of(3, "a", "b", joining=("d",)), back(A, 3), back(B, 3), D),
        0.1,
        Action.PUBLISH,
        "early close",
        0.1,
    ),
    "every key expired (an etcd outage), every member back: early close": Row(
        view(round_of(3, "a", "b", "c"), anew(A, 3), anew(B, 3), anew(C, 3)),
        0.1,
        Action.PUBLISH,
        "every live member of round 3 is back (early close)",
        0.1,
    ),
    "every key expired, one member not back yet: the last call runs": Row(
        view(round_of(3, "a", "b", "c"), anew(A, 3), anew(B, 3)),
        0.1,
        Action.UPDATE,  # tells the round that c's key is gone
        "2 ready, the last call runs",
        2.0,
    ),
    "every key expired, the last call passed without one member": Row(
        view(round_of(3, "a", "b", "c", lost=("c",)), anew(A, 3), anew(B, 3)),
        2.5,
        Action.PUBLISH,
        "2 ready and the last call passed",
        2.5,
    ),
    "a member back kept its key: the one without a key is dead, early close": Row(
        view(round_of(3, "a", "b", "c"), back(A, 3), anew(B, 3)),
        0.1,
        Action.PUBLISH,
        "early close",
        0.1,
    ),
    "a member asks while another runs: the running round must hear": Row(
        view(round_of(1, "a", "b"), back(A, 1), B, min_nodes=1),
        1.0,
        Action.UPDATE,
        "1 ready, the last call runs",
        2.0,
    ),
    "the running round heard already: wait": Row(
        view(round_of(1, "a", "b", waiting=1), back(A, 1), B, min_nodes=1),
        1.0,
        Action.WAIT,
        "1 ready, the last call runs",
        2.0,
    ),
    "the last call passed, waiting for the running member until close_timeout": Row(
        view(round_of(1, "a", "b", waiting=1), back(A, 1), B, min_nodes=1),
        3.0,
        Action.WAIT,
        "waiting for 1 running members",
        0.5 + CLOSE_TIMEOUT,
        Timers(last_change=0.0, first_ready=0.5),
    ),
    "close_timeout passed: publish without the running member": Row(
        view(round_of(1, "a", "b", waiting=1), back(A, 1), B, min_nodes=1),
        31.0,
        Action.PUBLISH,
        "close_timeout passed with 1 members still in the old round",
        31.0,
        Timers(last_change=0.0, first_ready=0.5),
    ),
    "a full round trains on; the newcomer waits for room": Row(
        view(round_of(1, "a", "b"), A, B, C, max_nodes=2),
        10.0,
        Action.WAIT,
        "round 1 trains on; 1 wait",
        10.0 + LAST_CALL,  # the newcomer's last call starts now
    ),
    "a newcomer's last call runs: the running round trains on": Row(
        view(round_of(1, "a", "b"), A, B, C),
        1.0,
        Action.WAIT,
        "round 1 trains on; 1 wait",
        2.0,
        Timers(last_change=0.0, held_since=0.0),
    ),
    "a newcomer's last call passed: the running round must hear": Row(
        view(round_of(1, "a", "b"), A, B, C),
        2.5,
        Action.UPDATE,
        "round 1 trains on; 1 wait",
        2.5 + policy.IDLE_WATCH_S,
        Timers(last_change=0.0, held_since=0.0),
    ),
    "in place, a newcomer is heard at once (no last call)": Row(
        view(round_of(1, "a", "b"), A, B, C, in_place=True),
        0.5,
        Action.UPDATE,
        "round 1 trains on; 1 wait",
        0.5 + LAST_CALL,
    ),
    "in place, a newcomer that fills the round is heard at once too": Row(
        view(round_of(1, "a", "b"), A, B, C, max_nodes=3, in_place=True),
        0.5,
        Action.UPDATE,
        "round 1 trains on; 1 wait",
        0.5 + LAST_CALL,
    ),
    "in place, the running round heard already: wait": Row(
        view(round_of(1, "a", "b", waiting=1, joining=("c",)), A, B, C, in_place=True),
        0.6,
        Action.WAIT,
        "round 1 trains on; 1 wait",
        0.6 + policy.IDLE_WATCH_S,
    ),
    "in place, a full round still trains on": Row(
        view(round_of(1, "a", "b"), A, B, C, max_nodes=2, in_place=True),
        0.5,
        Action.WAIT,
        "round 1 trains on; 1 wait",
        0.5 + LAST_CALL,
    ),
    "a member lost: the running round must hear": Row(
        view(round_of(1, "a", "b"), A),
        1.0,
        Action.UPDATE,
        "0 ready of min_nodes=2",
        1.0 + policy.IDLE_WATCH_S,
    ),
    "the lost member was told already": Row(
        view(round_of(1, "a", "b", lost=("b",)), A),
        1.0,
        Action.WAIT,
        "0 ready of min_nodes=2",
        1.0 + policy.IDLE_WATCH_S,
    ),
    "a closed rendezvous publishes nothing": Row(
        view(round_of(1, "a", "b", closed=True), back(A, 1), back(B, 1)),
        9.0,
        Action.WAIT,
        "the rendezvous is closed",
        9.0 + policy.IDLE_WATCH_S,
    ),
    "a stale member is no joiner": Row(
        view(round_of(2, "a", stale={"b": 2}), A, B, min_nodes=1),
        5.0,
        Action.WAIT,
        "0 ready of min_nodes=1",
        5.0 + policy.IDLE_WATCH_S,
    ),
    "a stale member that announced again is a newcomer": Row(
        view(round_of(2, "a", stale={"b": 2}), A, back(B, 1), min_nodes=1),
        5.0,
        Action.WAIT,
        "round 2 trains on; 1 wait",
        5.0 + LAST_CALL,
    ),
}


@pytest.mark.parametrize("row", ROWS.values(), ids=ROWS.keys())
def test_decide(row: Row) -> None:
    decision = policy.decide(row.view, row.timers, row.now)
    assert decision.action is row.action, decision
    assert row.reason in decision.reason, decision
    assert decision.wake_at == pytest.approx(row.wake_at), decision


@pytest.mark.parametrize(
    ("timers", "now", "first_ready"),
    [
        (Timers(0.0), 1.0, 1.0),  # min_nodes candidates: close_timeout starts
        (Timers(0.0, first_ready=0.5), 1.0, 0.5),  # and keeps running
    ],
)
def test_decide_starts_close_timeout_once(timers: Timers, now: float, first_ready: float) -> None:
    decision = policy.decide(view(NEW, A, B), timers, now)
    assert decision.timers.first_ready == first_ready


def test_decide_clears_close_timeout_when_nobody_is_ready() -> None:
    decision = policy.decide(view(round_of(1, "a", "b"), A, B), Timers(0.0, first_ready=3.0), 4.0)
    assert decision.timers.first_ready is None


@pytest.mark.parametrize(
    ("held_since", "now", "expected"),
    [(None, 7.0, 7.0), (5.0, 7.0, 5.0)],  # the first newcomer starts it, later ones share
)
def test_a_newcomers_last_call_starts_with_the_first(
    held_since: float | None, now: float, expected: float
) -> None:
    timers = Timers(0.0, held_since=held_since)
    decision = policy.decide(view(round_of(1, "a", "b"), A, B, C), timers, now)
    assert decision.timers.held_since == expected


def test_the_last_call_ends_with_no_newcomer_left() -> None:
    timers = Timers(0.0, held_since=1.0)
    decision = policy.decide(view(round_of(1, "a", "b"), A, B), timers, 2.0)
    assert decision.timers.held_since is None


@pytest.mark.parametrize(
    ("v", "ready", "running"),
    [
        (view(NEW, A, B), ["a", "b"], []),
        (view(round_of(1, "a", "b"), back(A, 1), B), ["a"], ["b"]),
        (view(round_of(1, "a"), A, C), ["c"], ["a"]),  # c: a newcomer
        (view(round_of(1, "a", stale={"c": 3}), A, C), [], ["a"]),  # c: stale
    ],
)
def test_split(v: View, ready: list[str], running: list[str]) -> None:
    got = policy.split(v)
    assert ([m.name for m in got[0]], [m.name for m in got[1]]) == (ready, running)


def test_compose_ranks_by_address_and_names_the_stale() -> None:
    v = view(round_of(1, "a", "b", "c"), back(C, 1), back(A, 1), B, min_nodes=1, max_nodes=8)
    round_ = policy.compose(v, 2, "a")
    assert round_.round == 2 and round_.closer == "a"
    assert dict(round_.members) == {"a": 0, "c": 1}  # torch's order: address, pid, local id
    assert (round_.master_addr, round_.master_port) == (A.addr, A.port)
    assert dict(round_.stale) == {"b": B.mod_revision}  # left behind while it ran round 1
    assert (round_.waiting, round_.joining, round_.lost) == (0, (), ())


def test_compose_takes_the_oldest_up_to_max_nodes() -> None:
    round_ = policy.compose(view(NEW, D, C, B, A, max_nodes=2), 0, "a")
    assert set(round_.members) == {"a", "b"}


@pytest.mark.parametrize(("number", "high", "expected"), [(3, None, 4), (3, 7, 8), (3, 1, 4)])
def test_next_round_passes_the_fences_high_mark(
    number: int, high: int | None, expected: int
) -> None:
    assert policy.next_round(view(round_of(number, "a"), A), high) == expected


def test_tell_running_names_the_lost_the_waiting_and_the_released() -> None:
    v = view(round_of(1, "a", "b"), A, C)  # b lost: c is released at once
    round_ = policy.tell_running(v, Timers(0.0, held_since=0.5), 1.0)
    assert (round_.lost, round_.waiting, round_.joining) == (("b",), 1, ("c",))
    assert round_.members == v.round.members


def test_tell_running_names_the_members_that_asked_for_a_new_round() -> None:
    # b announced again after round 1 (its step failed); c is a newcomer still held
    v = view(round_of(1, "a", "b"), A, back(B, 1), C)
    round_ = policy.tell_running(v, Timers(0.0, held_since=0.5), 1.0)
    assert (round_.asked, round_.waiting, round_.lost) == (("b",), 2, ())
    assert policy.tell_running(view(round_of(1, "a", "b"), A, B), Timers(0.0), 1.0).asked == ()


@pytest.mark.parametrize(
    ("turn", "targets"),
    [(0, ["d", "b", "c"]), (1, ["d", "c", "b"]), (2, ["d", "b", "c"])],
)
def test_the_closer_probes_the_newest_and_the_unready_in_turn(
    turn: int, targets: list[str]
) -> None:
    v = view(round_of(1, "a", "b", "c"), back(A, 1), B, C, D)
    got, suspects = policy.probe_targets(v, "a", turn)
    assert [m.name for m in got] == targets
    assert suspects == ["b", "c"]  # re-probed even if they answered a moment ago


def test_the_closer_probes_only_the_newest_while_nobody_waits() -> None:
    got, suspects = policy.probe_targets(view(round_of(1, "a", "b"), A, B), "a", 0)
    assert ([m.name for m in got], suspects) == (["b"], [])


MINE = round_of(4, "me", "peer", waiting=0)
CHANGES = {
    "none while the round is the job": (MINE, {}, None),
    "requested": (MINE, {"requested": True}, ChangeKind.REQUESTED),
    "not joined yet": (MINE, {"joined": None}, None),
    "expired lease": (MINE, {"expired": True}, ChangeKind.DROPPED),
    "a newer round": (round_of(5, "me", "peer"), {}, ChangeKind.DROPPED),
    "left out": (round_of(4, "peer"), {}, ChangeKind.DROPPED),
    "a peer lost": (round_of(4, "me", "peer", lost=("peer",)), {}, ChangeKind.PEERS_LOST),
    "joiners": (round_of(4, "me", "peer", waiting=2), {}, ChangeKind.JOINERS),
    # the peer's step failed first (it saw the lost node before the closer did): no joiner,
    # our workers' collectives may wait on it (bench: kill -9, 2.1 s until the stuck check)
    "a peer asked": (
        round_of(4, "me", "peer", waiting=1, asked=("peer",)),
        {},
        ChangeKind.PEERS_ASKED,
    ),
    "a peer asked, and newcomers wait": (
        round_of(4, "me", "peer", waiting=2, asked=("peer",), joining=("new",)),
        {},
        ChangeKind.PEERS_ASKED,
    ),
    "only we asked: our own request": (
        round_of(4, "me", "peer", waiting=1, asked=("me",)),
        {},
        ChangeKind.JOINERS,
    ),
    "a peer lost outranks one that asked": (
        round_of(4, "me", "peer", "third", waiting=1, asked=("peer",), lost=("third",)),
        {"peers": frozenset({"me", "peer", "third"})},
        ChangeKind.PEERS_LOST,
    ),
}


@pytest.mark.parametrize(("round_", "overrides", "kind"), CHANGES.values(), ids=CHANGES.keys())
def test_membership_change(
    round_: Round, overrides: dict[str, object], kind: ChangeKind | None
) -> None:
    args: dict[str, object] = {
        "me": "me",
        "joined": 4,
        "peers": frozenset({"me", "peer"}),
        "expired": False,
        "requested": False,
        **overrides,
    }
    change = policy.membership_change(round_, **args)  # type: ignore[arg-type]
    assert (change.kind if change else None) is kind
