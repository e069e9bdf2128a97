"""What one node of the announce rendezvous knows, shared by its threads under one lock.

The handler (the agent's thread), the watch thread (:mod:`.follower` or, as the closer,
:mod:`.closer`) and the keeper's threads (:mod:`.keeper`) read and change one
:class:`NodeState`. Every field is read and written with ``cond`` held, except where a
method says otherwise; ``cond`` is notified whenever the round or ``expired`` changes, which
is what ``next_rendezvous`` waits for.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace

from elastic.etcd.client import KeyValue, WatchHandle
from elastic.rendezvous.announce.policy import Limits, Timers, View
from elastic.rendezvous.announce.records import (
    NO_ROUND,
    UNKNOWN,
    Member,
    Round,
    Trust,
    round_of,
    written_at,
)

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class NodeState:
    """One node's view of its rendezvous (see the module docstring for the locking)."""

    name: str
    run_id: str
    trust: Trust = field(default_factory=lambda: Trust(None, b""))  # immutable
    cond: threading.Condition = field(default_factory=threading.Condition)
    stopped: threading.Event = field(default_factory=threading.Event)
    probe_now: threading.Event = field(default_factory=threading.Event)  # wakes the prober
    watch: WatchHandle = field(default_factory=WatchHandle)  # the watch thread's stream
    # This node's announcement: its key's create_revision and the revision it was last
    # written at (the follower watches it from there on), and whether its lease expired.
    create_rev: int = 0
    mine_rev: int = 0
    expired: bool = False
    # The newest round, and the revisions each watched key was seen up to.
    round: Round = NO_ROUND
    round_rev: int = 0  # the round key's mod_revision (0: absent)
    round_at: tuple[int, int] = UNKNOWN  # its create_revision and version ((0, 0): absent)
    round_seen: int = 0
    pred: Member | None = None  # the next older member, which this node watches over
    pred_seen: int = 0
    # Only the closer: every member, the fence's high mark, its clocks.
    closer: bool = False
    members: dict[str, Member] = field(default_factory=dict)
    members_seen: int = 0  # 0: read them all (again)
    high: int | None = None  # the newest round ever published (None: none)
    timers: Timers = field(default_factory=lambda: Timers(last_change=time.monotonic()))
    ports: dict[str, int] = field(default_factory=dict)  # probe ports by node name
    # The round this node's workers run in place, as its agent last said (None: none).
    in_place_round: int | None = None
    # The newest round this node knew of when etcd lost its data (-1: it never did): the
    # next round is numbered after it, so round numbers and the fence never go backwards.
    floor: int = -1

    def view(self, limits: Limits) -> View:
        """The closer's frozen view for :mod:`.policy`."""
        in_place = self.round.round >= 0 and self.in_place_round == self.round.round
        return View(self.round, dict(self.members), limits, in_place)

    def touch(self, now: float) -> None:
        """The members changed at ``now`` (the last call starts again)."""
        self.timers = replace(self.timers, last_change=now)

    def set_round(
        self, round_: Round, mod_revision: int, seen: int = 0, at: tuple[int, int] = UNKNOWN
    ) -> None:
        """Take a round read at ``mod_revision`` (the key's ``at`` then: the compare-and-set
        of the next write signs the one after it), unless it is older than the one held (a
        read that raced with a newer event or with our own publication)."""
        self.round_seen = max(self.round_seen, seen)
        if mod_revision < self.round_rev or (not mod_revision and self.round_rev):
            return
        self.round = round_
        self.round_rev = mod_revision
        self.round_at = at
        self.probe_now.set()  # a new round: see its peers accept while they are alive
        self.cond.notify_all()

    def set_round_kv(self, kvs: list[KeyValue], seen: int = 0) -> None:
        """:meth:`set_round` of a read of the round key (no key: no round). A record not
        signed for the very write it is read at (one written back) is no round."""
        if kvs:
            kv = kvs[0]  # a deletion's event has no version: absent
            self.set_round(round_of(kv, self.trust), kv.mod_revision, seen, written_at(kv))
        else:
            self.set_round(NO_ROUND, 0, seen)

    def set_pred(self, pred: Member | None, revision: int) -> None:
        """A new predecessor seen at ``revision``; with none, this node is the closer (unless
        its own key is gone: it announces again first, :meth:`expire`)."""
        if pred != self.pred:
            self.probe_now.set()
        self.pred = pred
        self.pred_seen = revision
        if pred is not None:
            self.ports[pred.name] = pred.probe
            self.closer = False  # an older node is back (after an outage of ours)
        elif not self.closer and not self.expired:
            self.closer = True
            self.members_seen = 0  # read them all once
            logger.info("The node '%s' is the closer of '%s'.", self.name, self.run_id)

    def expire(self) -> None:
        """This node's key is gone (its lease expired, or it was reaped): announce again.
        A node without a key is no closer: whoever announces first afterwards is the
        oldest, and a node that took the role while its own key was gone would decide for
        a view it is no member of (and could never publish)."""
        self.expired = True
        self.closer = False
        self.cond.notify_all()

    def forget_store(self) -> None:
        """etcd lost its data (:mod:`elastic.etcd.reset`): every revision held is history and
        this node's key is gone. Keep the newest round number (:attr:`floor`), forget the
        rest, and announce afresh (:meth:`expire`); whoever announces first is the closer."""
        self.floor = max(self.floor, self.round.round, -1 if self.high is None else self.high)
        self.round_rev, self.round_at = 0, UNKNOWN
        self.round_seen = self.pred_seen = self.members_seen = 0
        self.create_rev = self.mine_rev = 0
        self.pred, self.high = None, None
        self.members = {}
        self.expire()
        self.probe_now.set()

    def key_deleted(self, revision: int) -> None:
        """A watch saw this node's key deleted at ``revision``: :meth:`expire`, unless the
        deletion is of a key this node no longer holds (an announcement is under way on a
        fresh lease, ``create_rev`` 0, or wrote the key again after it)."""
        if self.create_rev and revision > self.mine_rev:
            self.mine_rev = revision  # a watch from here on sees the next announcement
            self.expire()


__all__ = ["NodeState"]
