"""The step-boundary rule (elastic.worker.boundary): a table of every flag combination that
matters, each row naming its outcome and reason, and a property over all of them: only
"every rank stops" ends the job's loop; a rank leaves only when it was asked to. Pure: no
process, no group."""

from __future__ import annotations

import itertools

import pytest
import torch

from elastic.worker.boundary import Action, Layout, Tally, Vote, decide, ends_the_job

A = Action


def _tally(votes: list[Vote], loss: float = 0.0, weight: float = 0.0) -> Tally:
    layout = Layout(len(votes))
    summed = sum(
        (layout.build(v, (loss, weight), r) for r, v in enumerate(votes)), torch.zeros(layout.size)
    )
    return layout.parse(summed)


STOP, REGROUP, BROKEN, READY = (
    Vote(stop=True, persist=True),
    Vote(stop=True, regroup=True),
    Vote(broken=True),
    Vote(ready=True),
)
NONE = Vote()

# (path, votes of the group, this rank's index, outcome, reason contains)
TABLE = [
    ("restart", [NONE, NONE], 0, A.GO_ON, "no rank stops"),
    ("restart", [STOP, STOP], 0, A.STOP_ALL, "every rank"),
    ("restart", [STOP, NONE], 0, A.LEAVE, "this rank was asked"),
    ("restart", [STOP, NONE], 1, A.RESTART, "a peer stopped"),
    ("restart", [REGROUP, REGROUP], 0, A.LEAVE, "this rank was asked"),
    ("restart", [REGROUP, STOP], 0, A.LEAVE, "this rank was asked"),
    ("restart", [NONE], 0, A.GO_ON, "no rank stops"),
    ("restart", [STOP], 0, A.STOP_ALL, "every rank"),
    ("in place", [NONE, NONE, NONE], 0, A.GO_ON, "no newer round"),
    ("in place", [STOP, STOP, STOP], 1, A.STOP_ALL, "every rank"),
    ("in place", [STOP, NONE, NONE], 0, A.LEAVE, "this rank was asked"),
    ("in place", [STOP, NONE, NONE], 1, A.REFORM, "a peer leaves"),
    ("in place", [STOP, STOP, NONE], 2, A.REFORM, "a peer leaves"),
    ("in place", [BROKEN, NONE, NONE], 0, A.RESTART, "cannot reach"),
    ("in place", [BROKEN, NONE, NONE], 1, A.REFORM, "a peer cannot reach"),
    ("in place", [BROKEN, STOP, NONE], 0, A.RESTART, "cannot reach"),
    ("in place", [READY, READY, READY], 0, A.REFORM, "every rank is ready"),
    ("in place", [READY, READY, NONE], 0, A.GO_ON, "no newer round"),
    ("in place", [READY, STOP, READY], 0, A.REFORM, "a peer leaves"),
    ("in place", [REGROUP, REGROUP, REGROUP], 0, A.LEAVE, "this rank was asked"),
]


@pytest.mark.parametrize(("path", "votes", "me", "action", "reason"), TABLE)
def test_table(path: str, votes: list[Vote], me: int, action: Action, reason: str) -> None:
    got = decide(_tally(votes), len(votes), votes[me], in_place=path == "in place")
    assert (got.action, reason in got.reason) == (action, True), got


def test_a_failed_agreement_reforms_or_leaves() -> None:
    assert decide(None, 3, NONE, in_place=True).action is A.REFORM
    assert decide(None, 3, STOP, in_place=True).action is A.LEAVE


def test_a_stop_persists_when_any_rank_votes_so() -> None:
    assert decide(_tally([STOP, NONE]), 2, NONE, in_place=False).persist
    assert not decide(_tally([REGROUP, NONE]), 2, NONE, in_place=False).persist


def _sum(votes: tuple[Vote, ...]) -> Tally:
    """The tally the all-reduce would give, without tensors (the property runs thousands)."""
    counts = [sum(getattr(v, f) for v in votes) for f in ("stop", "regroup", "persist")]
    return Tally(*counts, sum(v.broken for v in votes), sum(v.ready for v in votes), 0.0, 0.0)


# stop, regroup, broken, ready (persist changes only Outcome.persist: see the test above)
VOTES = [Vote(s, g, s and not g, b, r) for s, g, b, r in itertools.product([False, True], repeat=4)]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("in_place", [False, True])
def test_only_every_rank_stopping_ends_the_loop(world: int, in_place: bool) -> None:
    """Every combination of the ranks' flags (16 per rank): the loop ends for the job only
    when every rank stops (and none for its agent's re-form); a rank leaves only when asked."""
    for votes in itertools.combinations_with_replacement(VOTES, world):  # sums: order-free
        tally = _sum(votes)
        for vote in votes:
            got = decide(tally, world, vote, in_place)
            everyone = all(v.stop for v in votes) and not any(v.regroup for v in votes)
            assert ends_the_job(got) == everyone, (votes, got)
            if got.action is A.LEAVE:
                assert vote.stop, (votes, got)
            if not in_place:
                assert got.action is not A.REFORM


def test_the_layout_carries_the_loss_and_per_rank_slots() -> None:
    layout = Layout(3, per_rank=("compute_s", "wait_s"))
    parts = [
        layout.build(NONE, (2.0 * r, 1.0), r, {"compute_s": r + 0.5, "wait_s": 0.1 * r})
        for r in range(3)
    ]
    tally = layout.parse(sum(parts, torch.zeros(layout.size)))
    assert tally.mean_loss == pytest.approx(2.0)
    flat = [v for rank in tally.slots for v in rank]
    assert flat == pytest.approx([0.5, 0.0, 1.5, 0.1, 2.5, 0.2])
    assert (tally.stops, tally.weight) == (0, 3.0)
    assert Layout(2).parse(Layout(2).build(NONE)).mean_loss is None
