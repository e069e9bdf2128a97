"""What a node of the announce rendezvous concludes about its own key and its role
(elastic.rendezvous.announce.state.NodeState), table-style; no etcd.

An etcd outage that expires every lease deletes every member key at once; the watches see
the deletions late, possibly after the node announced again on a fresh lease. A node
without a key is no closer, and a deletion of a key the node no longer holds changes
nothing (tests/rendezvous/test_etcd_freeze.py is the outage itself)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from elastic.rendezvous.announce.state import NodeState
from tests.rendezvous.test_policy import member


@dataclass(frozen=True)
class Deletion:
    create_rev: int  # the key this node holds (0: an announcement on a fresh lease runs)
    mine_rev: int  # the revision of its last write
    deleted_at: int  # the revision of the deletion a watch reports
    expired: bool  # whether the node must announce again
    mine_after: int  # mine_rev afterwards (a watch from there on does not replay it)


DELETIONS = {
    "our key expired": Deletion(10, 12, 20, True, 20),
    "a deletion before our last write: the old key's": Deletion(30, 31, 20, False, 31),
    "seen again (a watch replays it)": Deletion(10, 20, 20, False, 20),
    "an announcement on a fresh lease is under way": Deletion(0, 12, 20, False, 12),
}


@pytest.mark.parametrize("row", DELETIONS.values(), ids=DELETIONS.keys())
def test_a_deleted_own_key(row: Deletion) -> None:
    state = NodeState("me", "run")
    state.create_rev, state.mine_rev, state.closer = row.create_rev, row.mine_rev, True
    with state.cond:
        state.key_deleted(row.deleted_at)
    assert state.expired is row.expired
    assert state.closer is not row.expired  # a node without a key is no closer
    assert state.mine_rev == row.mine_after


@dataclass(frozen=True)
class Role:
    closer: bool  # before
    expired: bool
    has_pred: bool  # an older member was found
    closer_after: bool


ROLES = {
    "no older member: the closer": Role(False, False, False, True),
    "no older member, but our key is gone: announce first": Role(False, True, False, False),
    "an older member is back: follow it": Role(True, False, True, False),
    "still the closer": Role(True, False, False, True),
}


@pytest.mark.parametrize("row", ROLES.values(), ids=ROLES.keys())
def test_the_role_from_the_predecessor(row: Role) -> None:
    state = NodeState("me", "run")
    state.closer, state.expired = row.closer, row.expired
    state.set_pred(member("older", 1) if row.has_pred else None, 5)
    assert state.closer is row.closer_after


def test_expiring_drops_the_closer_role() -> None:
    state = NodeState("me", "run")
    state.closer = True
    with state.cond:
        state.expire()
    assert state.expired and not state.closer


@pytest.mark.parametrize(
    ("newest", "in_place_round", "in_place"),
    [
        (3, 3, True),  # the closer's workers run the newest round in place
        (4, 3, False),  # a newer round formed: they have not switched to it yet
        (3, None, False),  # not in place (a restart, or workers not on Run)
        (-1, -1, False),  # no round yet
    ],
)
def test_the_view_says_in_place_only_for_the_newest_round(
    newest: int, in_place_round: int | None, in_place: bool
) -> None:
    from elastic.rendezvous.announce.policy import Limits
    from elastic.rendezvous.announce.records import Round

    state = NodeState("me", "run")
    state.round = Round(newest, {"me": 0} if newest >= 0 else {})
    state.in_place_round = in_place_round
    assert state.view(Limits(1, 2, 1.0, 30.0)).in_place is in_place
