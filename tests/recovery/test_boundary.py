"""The step-boundary rule (elastic.worker.boundary): a table of every flag combination that
matters, each row naming its outcome and reason, and a property over all of them: only
"every rank stops" ends the job's loop; a rank leaves only when it was asked to. Pure: no
process, no group."""

from __future__ import annotations

import itertools

import pytest
import torch

from elastic.worker.boundary import VOTES as VOTE_NAMES
from elastic.worker.boundary import Action, Layout, Tally, Vote, decide, ends_the_job
from elastic.worker.straggler import LIMITS, SLOTS

A = Action


def _tally(votes: list[Vote], loss: float = 0.0, weight: float = 0.0) -> Tally:
    """What the all-gather gives every rank: row ``r`` is rank ``r``'s record."""
    layout = Layout(len(votes))
    return layout.parse(torch.stack([layout.row(v, (loss, weight)) for v in votes]))


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
    """The tally the records would give, without tensors (the property runs thousands)."""
    return Tally(
        stops=sum(v.stop for v in votes),
        regroups=sum(v.regroup for v in votes),
        persists=sum(v.persist for v in votes),
        broken=sum(v.broken for v in votes),
        ready=sum(v.ready for v in votes),
        loss=0.0,
        weight=0.0,
    )


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
    rows = [
        layout.row(NONE, (2.0 * r, 1.0), {"compute_s": r + 0.5, "wait_s": 0.1 * r})
        for r in range(3)
    ]
    tally = layout.parse(torch.stack(rows))
    assert tally.mean_loss == pytest.approx(2.0)
    flat = [v for rank in tally.slots for v in rank]
    assert flat == pytest.approx([0.5, 0.0, 1.5, 0.1, 2.5, 0.2])
    assert (tally.stops, tally.weight, tally.refused) == (0, 3.0, ())
    assert Layout(2).parse(torch.stack([Layout(2).row(NONE)] * 2)).mean_loss is None


FIELDS = {name: i for i, name in enumerate((*VOTE_NAMES, "loss", "weight", *SLOTS))}
HONEST = {"compute_s": 0.5, "wait_s": 0.01, "node": 7.0, "since_drop_s": 0.0}
NAN, INF = float("nan"), float("inf")

# (what rank 1 of 4 writes where, rank 1's refused reason contains): the red team's
# tampering with the summed vector, and its neighbours; rank 1 is refused and counts as
# voting nothing, with no loss and no figures; the other three are counted as they wrote.
TAMPERED = [
    ("stop = world size", {"stop": 4.0}, "stop vote is 4.0"),
    ("stop = NaN", {"stop": NAN}, "stop vote is nan"),
    ("stop = inf", {"stop": INF}, "stop vote is inf"),
    ("stop = -1", {"stop": -1.0}, "stop vote is -1.0"),
    ("stop = 0.5", {"stop": 0.5}, "stop vote is 0.5"),
    ("ready = world size", {"ready": 4.0}, "ready vote is 4.0"),
    ("newer = -3", {"newer": -3.0}, "newer vote is -3.0"),
    ("loss = NaN", {"loss": NAN}, "loss is nan"),
    ("weight = -inf", {"weight": -INF}, "weight is -inf"),
    ("weight < 0", {"weight": -2.0}, "weight is -2.0"),
    ("compute = NaN", {"compute_s": NAN}, "compute_s is nan"),
    ("compute = inf", {"compute_s": INF}, "compute_s is inf"),
    ("compute < 0", {"compute_s": -5.0}, "compute_s is -5.0"),
    ("compute = 1e9 s", {"compute_s": 1e9}, "outside"),
    ("node = 2**40", {"node": 2.0**40}, "node is"),
    ("since drop < 0", {"since_drop_s": -1.0}, "since_drop_s is -1.0"),
]


def _gathered(layout: Layout, rows: list[dict[str, float]]) -> torch.Tensor:
    out = torch.stack([layout.row(Vote(stop=True), (1.0, 1.0), HONEST) for _ in rows])
    for r, writes in enumerate(rows):
        for name, value in writes.items():
            out[r, FIELDS[name]] = value
    return out


@pytest.mark.parametrize(("case", "writes", "why"), TAMPERED, ids=[c[0] for c in TAMPERED])
def test_a_tampered_record_is_refused_and_counts_as_voting_nothing(
    case: str, writes: dict[str, float], why: str
) -> None:
    """Every rank votes stop; rank 1 tampers with its own record. The job never stops
    (rank 1 counts as not stopping), nothing raises, rank 1 is named once."""
    layout = Layout(4, SLOTS, LIMITS)
    tally = layout.parse(_gathered(layout, [{}, writes, {}, {}]))
    assert [r for r, _ in tally.refused] == [1], tally.refused
    assert why in tally.refused[0][1]
    assert (tally.stops, tally.ready, tally.newer, tally.loss, tally.weight) == (3, 0, 0, 3.0, 3.0)
    assert tally.slots[1] == (0.0, 0.0, 0.0, 0.0)  # no figures: not measured
    assert tally.slots[0] == tuple(HONEST[n] for n in SLOTS)
    for me in range(4):
        got = decide(tally, 4, Vote(stop=True), in_place=me % 2 == 0)
        assert not ends_the_job(got), got


def test_a_rank_claiming_the_whole_world_stops_nobody_but_itself() -> None:
    """The red team's first finding: one rank writes world_size into its stop vote while
    nobody else stops. On the summed vector that read as every rank stopping (both agents
    exited 0); per-rank records refuse it, and the others go on."""
    layout = Layout(2, SLOTS, LIMITS)
    rows = torch.stack([layout.row(NONE, (1.0, 1.0), HONEST)] * 2)
    rows[1, FIELDS["stop"]] = 2.0
    tally = layout.parse(rows)
    assert tally.stops == 0 and [r for r, _ in tally.refused] == [1]
    assert decide(tally, 2, NONE, in_place=False).action is A.GO_ON
    assert decide(tally, 2, NONE, in_place=True).action is A.GO_ON


def test_no_rank_can_pad_another_ranks_compute_time() -> None:
    """The red team's third finding: rank 2 added 5 s to rank 0's compute slot of the summed
    vector. A record holds its writer's figures only: whatever rank 2 writes, rank 0's
    figures are rank 0's row, and rank 2's own (huge but finite) time is its own."""
    layout = Layout(3, SLOTS, LIMITS)
    rows = torch.stack([layout.row(NONE, (1.0, 1.0), HONEST)] * 3)
    rows[2, FIELDS["compute_s"]] = 5.0 + HONEST["compute_s"]  # all it can reach: its own row
    tally = layout.parse(rows)
    assert [s[0] for s in tally.slots] == [0.5, 0.5, 5.5] and tally.refused == ()
    with pytest.raises(RuntimeError):  # a longer record does not fit the gather's row
        layout.parse(torch.zeros(3, layout.fields + 1))


def test_every_rank_stopping_still_ends_the_job_with_records() -> None:
    layout = Layout(3, SLOTS, LIMITS)
    tally = layout.parse(torch.stack([layout.row(STOP, (1.0, 1.0), HONEST)] * 3))
    assert tally.refused == () and tally.persists == 3
    assert ends_the_job(decide(tally, 3, STOP, in_place=True))


def test_a_straggler_drop_re_forms_at_the_boundary_in_place_only() -> None:
    """The straggler rule's drop takes effect where it is decided: in place every rank
    (the dropped node's too) re-forms at this boundary, so no step is redone; a stop or a
    failed agreement comes first; the restart path goes on (its agents re-form)."""
    tally = _tally([NONE, NONE, NONE])
    assert decide(tally, 3, NONE, in_place=True, drop=True).action is A.REFORM
    assert decide(tally, 3, NONE, in_place=True, drop=False).action is A.GO_ON
    assert decide(tally, 3, NONE, in_place=False, drop=True).action is A.GO_ON
    assert decide(_tally([STOP, NONE, NONE]), 3, STOP, in_place=True, drop=True).action is A.LEAVE
    assert decide(_tally([STOP] * 3), 3, STOP, in_place=True, drop=True).action is A.STOP_ALL
