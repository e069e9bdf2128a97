"""No rank but rank 0 names the persisted step (issue 26, item 7).

Only group rank 0 reads the newest committed checkpoint's step; every offer carries one. A
member that claimed a persisted step beyond every held snapshot made every rank reload
from storage (the job rolled back to its last checkpoint); another rank's claim is now
ignored (pure tests of ``exchange.newest``).
"""

from __future__ import annotations

from elastic.worker.exchange import Offer, newest


def test_another_ranks_persisted_claim_does_not_force_a_storage_resume() -> None:
    plan = newest([Offer(None, (12, 3), persisted=10), Offer(None, (12, 3), persisted=10**9)])
    assert (plan.source, plan.step) == ("memory", 12)


def test_rank_0s_persisted_step_still_decides() -> None:
    plan = newest([Offer(None, (8, 3), persisted=10), Offer(None, (8, 3))])
    assert (plan.source, plan.step) == ("storage", 10)
