"""The closer's rules, and the agent's question, as pure functions of a frozen view.

Nothing here does I/O or reads a clock: each function takes the closer's :class:`View` (the
newest round and every member it knows), explicit :class:`Timers` and ``now``, and returns
what to do. :func:`decide` answers with a :class:`Decision` (an action, a reason for the log,
when to look again, and the timers to keep), as torch's rendezvous ops return an action and
torchft's ``quorum_compute`` a quorum and a reason. The closer
(:mod:`elastic.rendezvous.announce.closer`) executes it.

The rules (the package docstring, :mod:`elastic.rendezvous.announce`, says why):

* **Ready, running, stale.** A member is *ready* when it announced after the newest round
  (or is no member of it and not stale), *running* while it still runs the newest round.
  A *stale* member was left out of the newest round while it ran the one before and has not
  announced since; it is neither.
* **Close.** Once ``min_nodes`` are candidates: at once with ``max_nodes`` ready or on an
  early close (the round only re-forms the previous one and every live member of it, and
  every newcomer ``joining`` named, is back); otherwise once the last call passed since the
  last change, and, while members still run the old round, ``close_timeout`` since
  ``min_nodes`` were first ready. While members run a round nobody asked to leave, the
  ready nodes are candidates only once the running round is to hear of them.
* **Tell the running round.** ``lost`` (members whose key vanished), ``asked`` (members
  that asked for a new round: the others' collectives may wait on them) and whether anyone
  waits: members that asked for a new round, named newcomers, and newcomers whose last
  call passed (at once when the round must re-form anyway or re-forms in place; never into
  a full round that lost nobody).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import Enum

from elastic.rendezvous.announce.records import Member, Round
from elastic.rendezvous.contract import ChangeKind, MembershipChange

IDLE_WATCH_S = 60.0  # with nothing to wait for, the closer looks again this often
PROBES_PER_TICK = 8  # the closer probes at most this many nodes each time


class Action(str, Enum):
    """What the closer does next."""

    PUBLISH = "publish"  # write a new round
    UPDATE = "update"  # tell the running round who waits and who was lost, then watch
    WAIT = "wait"  # watch until ``wake_at`` or a change


@dataclass(frozen=True)
class Limits:
    """The rendezvous options the rules read."""

    min_nodes: int
    max_nodes: int
    last_call: float  # seconds: last_call_timeout
    close_timeout: float  # seconds


@dataclass(frozen=True)
class Timers:
    """The closer's clocks (monotonic seconds), kept between decisions."""

    last_change: float  # when the closer last saw the members change (the last call)
    first_ready: float | None = None  # when min_nodes first were candidates (close_timeout)
    held_since: float | None = None  # when the first newcomer not yet published arrived


@dataclass(frozen=True)
class View:
    """What the closer knows: the newest round, every member key by node name, and whether
    its own workers run the newest round in place (its agent's word: then a newcomer costs
    the round one short re-form at a step boundary, never a restart, and the running ranks
    train on until the newcomer's workers are ready)."""

    round: Round
    members: Mapping[str, Member]
    limits: Limits
    in_place: bool = False


@dataclass(frozen=True)
class Decision:
    """:func:`decide`'s answer."""

    action: Action
    reason: str
    wake_at: float  # decide again by then at the latest
    timers: Timers  # to pass to the next decision


def is_stale(round_: Round, member: Member) -> bool:
    """Whether ``member`` was left out of ``round_`` while it still ran the round before, and
    has not announced since (its key is unchanged): dead without proof, or too slow to see
    the new round. It is no joiner (the next round would wait for a dead node); once it
    announces again it is ready as any node."""
    return round_.stale.get(member.name) == member.mod_revision


def split(view: View) -> tuple[list[Member], list[Member]]:
    """(ready, running): live nodes that want a new round, and members of the newest round
    that still run it. A stale node is neither."""
    round_ = view.round
    ready, running = [], []
    for member in view.members.values():
        if member.after >= round_.round or (
            member.name not in round_.members and not is_stale(round_, member)
        ):
            ready.append(member)
        elif member.name in round_.members:
            running.append(member)
    return ready, running


def lost(view: View) -> tuple[str, ...]:
    """Members of the newest round whose key is gone (expired, reaped or left), sorted."""
    return tuple(sorted(set(view.round.members) - set(view.members)))


def unready(view: View) -> list[Member]:
    """Members still running the old round while others wait for a new one."""
    ready, running = split(view)
    return running if ready else []


def renewed(member: Member) -> bool:
    """Whether ``member``'s key was created by its last write: a key created anew (its lease
    expired, or it was reaped), not the one it announced earlier rounds with."""
    return member.mod_revision == member.create_revision


def early(view: View, ready: list[Member], running: list[Member]) -> list[Member] | None:
    """The early close: the open round only re-forms the newest one (with the newcomers its
    ``joining`` named), and every one of them still alive has announced again: its
    participants. None for a run's first round, or while someone is missing. A newcomer
    not named waits for the next round (the wait list), where it gets its last call.

    A member without a key is dead, unless no member that is back kept its key: an etcd
    outage longer than the leases expired every key at once, and one not back yet may only
    be slower to announce again; then every member and named newcomer must be back (else
    the last call decides)."""
    previous = view.round.members
    if not previous or running or not ready:
        return None
    expected = set(previous) | set(view.round.joining)
    if any(m.name in previous and not renewed(m) for m in ready):
        expected &= set(view.members)
    chosen = [m for m in ready if m.name in expected]
    if len(chosen) != len(expected) or len(chosen) < view.limits.min_nodes:
        return None
    return chosen


def newcomers(view: View, ready: list[Member]) -> list[Member]:
    """Ready nodes outside the newest round that its ``joining`` does not name yet."""
    round_ = view.round
    return [m for m in ready if m.name not in round_.members and m.name not in round_.joining]


def askers(view: View, ready: list[Member]) -> list[Member]:
    """Ready members of the newest round: each announced again, asking for a new round."""
    return [m for m in ready if m.name in view.round.members]


def hold(view: View, ready: list[Member], timers: Timers, now: float) -> Timers:
    """The newcomers' last call runs from the first newcomer not yet published (later ones
    share it); with no newcomer there is none."""
    if not newcomers(view, ready):
        return replace(timers, held_since=None)
    if timers.held_since is None:
        return replace(timers, held_since=now)
    return timers


def released(
    view: View, ready: list[Member], lost_: tuple[str, ...], timers: Timers, now: float
) -> list[Member]:
    """The newcomers the running round hears of now: none while their last call runs and
    the round is healthy (training goes on while the newcomer gets ready), all of them once
    it passed, and at once when the round must re-form anyway (a member lost or asking for
    a new round) or re-forms in place (``view.in_place``: its ranks train on in their group
    until the newcomer's workers are ready, so the last call would only delay the join; in
    the bench's join the newcomer's imports were done 0.4 s before its last call ended).
    One that would fill the round to ``max_nodes`` is held too, unless in place: on a
    restart the round stops at once and waits for the newcomer's worker (the bench's join
    paused 1.38 s median released at once, 0.6-0.8 s held)."""
    waiting = newcomers(view, ready)
    current = view.round.members
    if not waiting or (len(current) >= view.limits.max_nodes and not lost_):
        return []  # nobody, or a full round goes on: they wait, as torch's redundancy list
    asked = bool(askers(view, ready))
    since = timers.held_since if timers.held_since is not None else now
    if lost_ or asked or view.in_place or now - since >= view.limits.last_call:
        return waiting
    return []


def waiting(
    view: View, ready: list[Member], lost_: tuple[str, ...], timers: Timers, now: float
) -> int:
    """Ready nodes a new round could take: members that asked for one, the newcomers
    ``joining`` names, and those :func:`released` now."""
    round_ = view.round
    asked = len(askers(view, ready))
    joining = sum(1 for m in ready if m.name in round_.joining)
    return asked + joining + len(released(view, ready, lost_, timers, now))


@dataclass(frozen=True)
class _Scene:
    """One decision's inputs: the view, split once (ready, running, lost), the timers to
    keep, and now."""

    view: View
    ready: list[Member]
    running: list[Member]
    lost: tuple[str, ...]
    timers: Timers
    now: float

    def decision(self, action: Action, reason: str, wake_in: float = 0.0) -> Decision:
        """``action`` for ``reason``, deciding again ``wake_in`` s from now at the latest."""
        return Decision(action, reason, self.now + wake_in, self.timers)

    def tell_or_wait(self) -> Action:
        """UPDATE when the running round must hear of waiting nodes or lost members (only
        a change of "anyone waiting?" counts, so a burst of joiners is one write), else
        WAIT."""
        view, ready, lost_ = self.view, self.ready, self.lost
        if lost_ != view.round.lost:
            return Action.UPDATE
        now_waiting = waiting(view, ready, lost_, self.timers, self.now)
        if self.running and bool(view.round.waiting) != bool(now_waiting):
            return Action.UPDATE
        return Action.WAIT


def decide(view: View, timers: Timers, now: float) -> Decision:
    """What the closer does now, why, and when to decide again at the latest."""
    ready, running = split(view)
    lost_ = lost(view)
    timers = hold(view, ready, timers, now)
    # A full round that nobody asked to leave goes on; newcomers wait for room, and train
    # on through their last call (the hold) before the running round hears of them.
    asked = not running or waiting(view, ready, lost_, timers, now)
    candidates = ready if asked else []
    if not view.round.closed and len(candidates) >= view.limits.min_nodes:
        if timers.first_ready is None:
            timers = replace(timers, first_ready=now)
        return _open(_Scene(view, ready, running, lost_, timers, now))
    if not candidates:
        timers = replace(timers, first_ready=None)
    return _idle(_Scene(view, ready, running, lost_, timers, now))


def _open(scene: _Scene) -> Decision:
    """``min_nodes`` are candidates: publish, or wait for the last call or close_timeout."""
    view, ready, running, timers = scene.view, scene.ready, scene.running, scene.timers
    limits, now = view.limits, scene.now
    if len(ready) >= limits.max_nodes:
        return scene.decision(Action.PUBLISH, f"max_nodes={limits.max_nodes} are ready")
    if early(view, ready, running) is not None:
        why = f"every live member of round {view.round.round} is back (early close)"
        return scene.decision(Action.PUBLISH, why)
    first_ready = now if timers.first_ready is None else timers.first_ready
    quiet = timers.last_change + limits.last_call - now
    patience = first_ready + limits.close_timeout - now
    if quiet <= 0 and not running:
        return scene.decision(Action.PUBLISH, f"{len(ready)} ready and the last call passed")
    if quiet <= 0 and patience <= 0:
        why = f"close_timeout passed with {len(running)} members still in the old round"
        return scene.decision(Action.PUBLISH, why)
    left = quiet if quiet > 0 else patience
    why = "the last call runs" if quiet > 0 else f"waiting for {len(running)} running members"
    return scene.decision(scene.tell_or_wait(), f"{len(ready)} ready, {why}", left)


def _idle(scene: _Scene) -> Decision:
    """No round to close: keep the running round told, and wake when a last call ends."""
    view, ready, running, since = scene.view, scene.ready, scene.running, scene.timers.held_since
    held = None if since is None else since + view.limits.last_call - scene.now
    # Wake when the newcomers' last call ends (the running round must hear of them).
    wait_s = held if running and held is not None and held > 0 else IDLE_WATCH_S
    if view.round.closed:
        why = "the rendezvous is closed"
    elif running and ready:
        why = f"round {view.round.round} trains on; {len(ready)} wait"
    else:
        why = f"{len(ready)} ready of min_nodes={view.limits.min_nodes}"
    return scene.decision(scene.tell_or_wait(), why, wait_s)


def next_round(view: View, high: int | None) -> int:
    """The number of the round to publish: after the newest, and after the fence's high
    mark (``high``: the newest round ever published, None if none)."""
    number = view.round.round + 1
    return number if high is None else max(number, high + 1)


def newest(high: int | None, floor: int) -> int | None:
    """The newest round ever published as the closer knows it: the fence's high mark, or
    the newest round it knew before etcd lost its data (``floor``, -1: it never did)."""
    if floor < 0:
        return high
    return floor if high is None else max(high, floor)


def compose(view: View, number: int, closer: str) -> Round:
    """The round to publish: the early close's participants if it applies and there is
    room, else the oldest ready nodes up to ``max_nodes`` (the rest wait: the round is
    full). Members left behind while still running (close_timeout passed) are stale until
    they announce again, as are those already stale."""
    ready, running = split(view)
    chosen = early(view, ready, running)
    pool = chosen if chosen is not None and len(ready) < view.limits.max_nodes else ready
    taken = sorted(pool, key=lambda m: m.create_revision)[: view.limits.max_nodes]
    stale = {
        m.name: m.mod_revision
        for m in view.members.values()
        if m in running or is_stale(view.round, m)
    }
    ordered = sorted(taken, key=lambda m: m.order)
    ranks = {m.name: rank for rank, m in enumerate(ordered)}
    first = ordered[0]
    return Round(number, ranks, first.addr, first.port, closer, stale=stale)


def tell_running(view: View, timers: Timers, now: float) -> Round:
    """The newest round, now telling its members who waits, who asked for a new round
    and who was lost."""
    ready, _ = split(view)
    lost_ = lost(view)
    named = released(view, ready, lost_, timers, now)
    return replace(
        view.round,
        lost=lost_,
        asked=tuple(sorted(m.name for m in askers(view, ready))),
        waiting=waiting(view, ready, lost_, timers, now),
        joining=tuple(sorted({*view.round.joining, *(m.name for m in named)})),
    )


def probe_targets(view: View, me: str, turn: int) -> tuple[list[Member], list[str]]:
    """Whom the closer probes now: the newest member and, while a round waits for them, up
    to :data:`PROBES_PER_TICK` - 1 of the members not ready, from ``turn`` on (a probe
    blocks, so a few per tick, in turn); and those (suspects: probe them even if they
    answered a moment ago)."""
    others = [m for m in view.members.values() if m.name != me]
    newest = max(others, key=lambda m: m.create_revision, default=None)
    targets = [newest] if newest is not None else []
    behind = sorted(unready(view), key=lambda m: m.create_revision)
    if behind:
        start = turn % len(behind)
        targets += (behind[start:] + behind[:start])[: PROBES_PER_TICK - 1]
    unique = list({m.name: m for m in targets}.values())
    return unique, [m.name for m in behind]


def membership_change(
    round_: Round,
    *,
    me: str,
    joined: int | None,
    peers: frozenset[str],
    expired: bool,
    requested: bool,
) -> MembershipChange | None:
    """Why a node that joined round ``joined`` with ``peers`` must re-form, seeing
    ``round_``; None while its round is the job (the agent's question). A peer that asked
    for a new round is no joiner: its step failed (a lost peer it saw first) or it stops,
    so the group's collectives may wait on it, where a join lets the round train on."""
    if requested:
        return MembershipChange(ChangeKind.REQUESTED, joined, waiting=round_.waiting)
    if joined is None:
        return None
    if expired or round_.round != joined or me not in round_.members:
        return MembershipChange(ChangeKind.DROPPED, joined, (me,))
    gone = peers & set(round_.lost)
    if gone:
        return MembershipChange(ChangeKind.PEERS_LOST, round_.round, tuple(sorted(gone)))
    asked = (peers & set(round_.asked)) - {me}
    if asked:
        return MembershipChange(
            ChangeKind.PEERS_ASKED, round_.round, tuple(sorted(asked)), waiting=round_.waiting
        )
    if round_.waiting:
        return MembershipChange(ChangeKind.JOINERS, round_.round, waiting=round_.waiting)
    return None


__all__ = [
    "IDLE_WATCH_S",
    "PROBES_PER_TICK",
    "Action",
    "Decision",
    "Limits",
    "Timers",
    "View",
    "askers",
    "compose",
    "decide",
    "early",
    "is_stale",
    "lost",
    "membership_change",
    "next_round",
    "probe_targets",
    "renewed",
    "split",
    "tell_running",
    "unready",
]
