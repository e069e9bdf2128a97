"""The pure verdict "etcd lost its data" (elastic.etcd.reset), in a table."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from elastic.etcd.reset import NOTHING, Identity, Seen, Verdict, verdict

A, B = 0xA, 0xB  # cluster ids
M1, M2 = 0x1, 0x2  # member ids

ROWS = [
    # (last seen, now, verdict, words in the reason)
    (None, Seen(A, M1, 5), Verdict.SAME, "first"),
    (Seen(A, M1, 5), Seen(A, M1, 5), Verdict.SAME, "did not go backwards"),
    (Seen(A, M1, 5), Seen(A, M1, 9), Verdict.SAME, "did not go backwards"),
    (Seen(A, M1, 500), Seen(A, M1, 3), Verdict.RESET, "revision went backwards"),
    (Seen(A, M1, 500), Seen(B, M1, 900), Verdict.RESET, "cluster id changed"),
    (Seen(A, M1, 500), Seen(B, M2, 3), Verdict.RESET, "cluster id changed"),
    (Seen(A, M1, 500), Seen(A, M2, 498), Verdict.LAGGING, "lags"),
    (Seen(A, M1, 500), Seen(A, M2, 501), Verdict.SAME, "did not go backwards"),
    (Seen(0, 0, 500), Seen(A, M1, 3), Verdict.SAME, "first"),  # no ids (a fake): no verdict
    (Seen(A, M1, 500, 7), Seen(A, M1, 600, 2), Verdict.RESET, "term went backwards"),
    (Seen(A, M1, 500, 7), Seen(A, M1, 600, 8), Verdict.SAME, "did not go backwards"),
    (Seen(A, M1, 500, 7), Seen(A, M2, 600, 2), Verdict.SAME, "did not go backwards"),
    (Seen(A, M1, 500, 7), Seen(A, M1, 3, 7), Verdict.RESET, "revision went backwards"),
]


@pytest.mark.unit
@pytest.mark.parametrize(("last", "now", "expected", "words"), ROWS)
def test_verdict(last: Seen | None, now: Seen, expected: Verdict, words: str) -> None:
    kind, reason = verdict(last, now)
    assert kind is expected
    assert words in reason


def header(cluster: int, member: int, revision: int) -> SimpleNamespace:
    return SimpleNamespace(cluster_id=cluster, member_id=member, revision=revision, raft_term=2)


# (last seen, seen when the request went out, now, verdict, words): answers to requests in
# flight at once come back in any order; only one below what its request had seen is a loss
SENT_ROWS = [
    (Seen(A, M1, 1724, 2), Seen(A, M1, 1716, 2), Seen(A, M1, 1720, 2), Verdict.LAGGING, "overt"),
    (Seen(A, M1, 1724, 2), NOTHING, Seen(A, M1, 3, 2), Verdict.LAGGING, "overt"),
    (Seen(A, M1, 1724, 2), Seen(A, M1, 1716, 2), Seen(A, M1, 3, 2), Verdict.RESET, "backwards"),
    (Seen(A, M1, 1724, 3), Seen(A, M1, 1716, 2), Seen(A, M1, 1720, 2), Verdict.LAGGING, "overt"),
    (Seen(A, M1, 1724, 3), Seen(A, M1, 1716, 3), Seen(A, M1, 1800, 2), Verdict.RESET, "term"),
    (Seen(A, M1, 1724, 2), Seen(A, M1, 1716, 2), Seen(A, M1, 1730, 2), Verdict.SAME, "did not"),
]


@pytest.mark.unit
@pytest.mark.parametrize(("last", "sent", "now", "expected", "words"), SENT_ROWS)
def test_verdict_of_an_answer_overtaken_in_flight(
    last: Seen, sent: Seen, now: Seen, expected: Verdict, words: str
) -> None:
    kind, reason = verdict(last, now, sent)
    assert kind is expected
    assert words in reason


@pytest.mark.unit
def test_identity_counts_a_reset_once_and_follows_the_new_store() -> None:
    identity = Identity()
    assert identity.note(header(A, M1, 400)) is None
    assert identity.note(header(A, M1, 410)) is None
    reason = identity.note(header(A, M1, 2))
    assert reason is not None and "backwards" in reason and "revision 410" in reason
    assert identity.note(header(A, M1, 3)) is None  # the new store, going forward
    assert identity.note(header(A, M2, 1)) is None  # a lagging member: no verdict
    assert identity.resets == 1 and identity.last == Seen(A, M1, 3, 2)
