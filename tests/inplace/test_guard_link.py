"""The guard's link to gloo: two gloo ranks of one process (two ProcessGroupGloo objects on
one in-memory store), so a collective can be left pending by simply not posting a rank."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elastic.worker.guard import StepGuard

TIMEOUT = timedelta(seconds=30)


def _post(pg: Any, tensor: torch.Tensor) -> None:
    pg.allreduce([tensor]).wait()


@pytest.fixture
def pair() -> Iterator[tuple[Any, Any]]:
    store = dist.HashStore()
    made: list[Any] = []

    def make(rank: int) -> None:
        made.append(dist.ProcessGroupGloo(dist.PrefixStore("g", store), rank, 2, TIMEOUT))

    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    pgs = sorted(made, key=lambda pg: pg.rank())
    yield pgs[0], pgs[1]


def test_a_collective_that_succeeds_completes_without_a_thread_of_the_guards(
    pair: tuple[Any, Any],
) -> None:
    pg0, pg1 = pair
    guard = StepGuard()
    before = threading.active_count()
    for _ in range(20):
        mine, theirs = torch.ones(4), torch.ones(4)
        peer = threading.Thread(target=_post, args=(pg1, theirs))
        peer.start()
        assert guard.run(functools.partial(pg0.allreduce, [mine]))
        peer.join(10)
        assert torch.equal(mine, torch.full((4,), 2.0))
        assert guard.in_flight_since() is None
    assert threading.active_count() == before  # no waiter thread: gloo's completes it
    assert guard.failure is None


def test_an_abort_releases_a_pending_collective_and_its_late_completion_runs_nothing(
    pair: tuple[Any, Any],
) -> None:
    pg0, pg1 = pair
    guard = StepGuard()
    mine = torch.ones(4)
    threading.Timer(0.05, guard.abort, ("a peer is gone",)).start()
    started = time.monotonic()
    assert not guard.run(lambda: pg0.allreduce([mine]))  # rank 1 never posted: released
    assert time.monotonic() - started < 5
    assert guard.failure == "a peer is gone" and guard.in_flight_since() is None
    guard.reset()
    # The peer posts now: the released collective completes in gloo's thread; the released
    # link is complete already, so no guard callback runs and the new step stays fine.
    pg1.allreduce([torch.ones(4)]).wait()
    assert guard.failure is None
    theirs = torch.ones(1)
    peer = threading.Thread(target=_post, args=(pg1, theirs))
    peer.start()
    assert guard.run(lambda: pg0.allreduce([torch.ones(1)]))
    peer.join(10)
