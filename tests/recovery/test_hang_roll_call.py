"""The waiting ranks name the ones that never reached a step's collectives (``worker.hang.peers``):
a roll call in the round's store, written only past the hang bound (elastic.worker.hang)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from elastic import events
from elastic.worker.hang import HangWatch, absent, roll_call, verdict_key


class _Guard:
    def __init__(self, since: float | None) -> None:
        self.since = since

    def in_flight_since(self) -> float | None:
        return self.since


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)


@pytest.mark.parametrize(
    ("world", "present", "missing"),
    [(4, [0, 1, 3], [2]), (3, [], [0, 1, 2]), (2, [0, 1], []), (3, [2, 2, 0], [1])],
)
def test_absent_is_every_rank_without_a_mark(world: int, present: list[int], missing: list[int]):
    assert absent(world, present) == missing


def test_the_lowest_waiting_rank_names_the_missing_one(store: dist.TCPStore) -> None:
    """Ranks 1 and 3 wait in step 17 of round 5 of a world of 4; rank 0 is stuck, rank 2
    marks itself late but within the grace: rank 1 names rank 0 alone."""
    found: dict[int, tuple[list[int], bool]] = {}

    def wait(rank: int) -> None:
        found[rank] = roll_call(store, 5, 17, rank, 4, grace_s=0.4)

    threads = [threading.Thread(target=wait, args=(r,)) for r in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert found[1] == ([0], True)
    assert found[2] == ([0], False) and found[3] == ([0], False)
    assert not store.check(["elastic/arrived/5/17/0"])  # nothing written for the stuck rank


def test_a_waiting_watch_names_its_stuck_peer_once_per_step(
    store: dist.TCPStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the bound with a collective in flight this rank waits for a peer: it is not
    stuck, and the roll call names the peer (once per step)."""
    monkeypatch.setenv("ELASTIC_HANG", "2,5")
    monkeypatch.setenv("ELASTIC_EVENT_LOG", str(tmp_path / "events.jsonl"))
    exits: list[int] = []
    watch = HangWatch(
        _Guard(since=100.2),
        lambda: (0.1, 0.1),
        lambda: (0, 9),
        exit=exits.append,
        round_store=lambda: (store, 3, 2),
    )
    watch._step_began, watch._in_step = 100.0, True
    assert watch.waiting_for(101.0) is None  # inside the bound
    seconds = watch.waiting_for(103.0)
    assert seconds == 3.0 and watch.stuck_for(103.0) is None
    watch.name_absent(seconds)
    watch.name_absent(seconds)  # the same step: no second roll call
    named = events.read(tmp_path / "events.jsonl", "worker.hang.peers")
    # Inside step 10 (9 completed).
    assert [(e["rank"], e["step"], e["ranks"], e["round"]) for e in named] == [(0, 10, [1], 3)]
    assert exits == []
    watch.pause()
    assert watch.waiting_for(104.0) is None  # a save or a re-form is no such wait
    watch.agreeing = True  # the boundary's agreement waits for a peer still in its step
    assert watch.waiting_for(104.0) == 4.0 and watch.step_in_question() == (0, 9)


def test_off_the_in_place_path_nobody_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ELASTIC_HANG", "2,5")
    monkeypatch.setenv("ELASTIC_EVENT_LOG", str(tmp_path / "events.jsonl"))
    watch = HangWatch(_Guard(since=100.2), lambda: (), lambda: (0, 9), round_store=lambda: None)
    watch._step_began, watch._in_step = 100.0, True
    watch.name_absent(3.0)
    assert events.read(tmp_path / "events.jsonl", "worker.hang.peers") == []


class _Closing:
    """A store that closes after the first full read (a new round replaced the old one)."""

    def __init__(self, store: dist.TCPStore, reads: int) -> None:
        self.store, self.reads = store, reads

    def set(self, key: str, value: str) -> None:
        self.store.set(key, value)

    def check(self, keys: list[str]) -> bool:
        self.reads -= 1
        if self.reads < 0:
            raise RuntimeError("Failed to recv, got 0 bytes.")
        return bool(self.store.check(keys))


def test_a_store_that_closes_mid_roll_call_ends_it_with_what_was_seen(
    store: dist.TCPStore,
) -> None:
    store.set("elastic/arrived/2/4/1", "1")
    missing, lowest = roll_call(_Closing(store, reads=3), 2, 4, 0, 3, grace_s=5.0)
    assert (missing, lowest) == ([2], True)


def test_the_waiting_ranks_leave_a_verdict_for_the_stuck_rank_alone(
    store: dist.TCPStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 waits in step 10 of round 3 (world 4): rank 2 marks itself late (after the
    verdict, within the grace), ranks 1 and 3 never. The verdict named 1, 2 and 3 first
    (``worker.hang.suspects``), and at the roll call's end it names 1 and 3 alone: rank 2's
    verdict is cleared (its agent would not act on it anyway: it is not stopped)."""
    monkeypatch.setenv("ELASTIC_HANG", "2,5")
    monkeypatch.setenv("ELASTIC_EVENT_LOG", str(tmp_path / "events.jsonl"))
    watch = HangWatch(
        _Guard(since=100.2), lambda: (0.1,), lambda: (0, 9), round_store=lambda: (store, 3, 4)
    )
    watch._step_began, watch._in_step = 100.0, True

    def late() -> None:
        deadline = time.monotonic() + 5
        while not store.check([verdict_key(3, 2)]) and time.monotonic() < deadline:
            time.sleep(0.01)
        store.set("elastic/arrived/3/10/2", "1")

    marker = threading.Thread(target=late)
    marker.start()
    watch.name_absent(3.0)
    marker.join(5)
    suspects = events.read(tmp_path / "events.jsonl", "worker.hang.suspects")
    assert [(e["step"], e["ranks"], e["round"]) for e in suspects] == [(10, [1, 2, 3], 3)]
    assert suspects[0]["bound_s"] == 2.0 and suspects[0]["seconds"] > 2.0, suspects
    named = events.read(tmp_path / "events.jsonl", "worker.hang.peers")
    assert [e["ranks"] for e in named] == [[1, 3]]
    assert [store.check([verdict_key(3, r)]) for r in range(4)] == [False, True, False, True]
    assert store.get(verdict_key(3, 1)) == b"10"


def test_a_rank_that_is_not_the_lowest_leaves_no_verdict(store: dist.TCPStore) -> None:
    store.set("elastic/arrived/6/2/0", "1")
    seen: list[list[int]] = []
    assert roll_call(store, 6, 2, 1, 3, grace_s=0.2, suspect=seen.append) == ([2], False)
    assert seen == []
