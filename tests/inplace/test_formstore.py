"""elastic.inplace.formstore.FormingStore: a formation's store waits give up when told to.

Over torch's in-memory HashStore, and once through a real gloo formation in this process
(a TCPStore on loopback, a world of 2 whose second rank never comes): the exception raised
by ``interrupt`` reaches the caller of ``init_process_group`` unchanged, within a poll."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from elastic.inplace import formstore, groups
from elastic.inplace.formstore import FormingStore


class NewerRound(Exception):
    pass


class After:
    """An ``interrupt`` that raises after ``calls`` calls (or never, when None)."""

    def __init__(self, calls: int | None) -> None:
        self.limit, self.calls = calls, 0

    def __call__(self) -> None:
        self.calls += 1
        if self.limit is not None and self.calls > self.limit:
            raise NewerRound("round 5 formed")


def test_a_set_key_is_read_without_asking() -> None:
    ask = After(0)
    store = FormingStore(dist.HashStore(), ask)
    store.set("a", b"1")
    assert store.get("a") == b"1" and store.add("n", 2) == 2 and store.check(["a", "n"])
    store.wait(["a"])
    assert ask.calls == 0


def test_a_wait_for_a_key_that_never_comes_ends_when_interrupt_raises() -> None:
    ask = After(3)
    store = FormingStore(dist.HashStore(), ask)
    with pytest.raises(NewerRound):
        store.get("never")
    assert ask.calls == 4


def test_a_wait_past_its_timeout_is_a_store_timeout() -> None:
    store = FormingStore(dist.HashStore(), After(None))
    with pytest.raises(dist.DistStoreError, match="were not set within"):
        store.wait(["never"], timedelta(seconds=2 * formstore.FAST_POLL_S))


def test_a_gloo_formation_whose_peer_never_comes_gives_up_with_the_interrupts_error() -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, use_libuv=True)
    asked_at = time.monotonic() + 0.2

    def interrupt() -> None:
        if time.monotonic() > asked_at:
            raise NewerRound("round 5 formed")

    forming = FormingStore(client, interrupt)  # kept: C++ holds it by pointer only
    store = dist.PrefixStore("r4/", forming)
    with pytest.raises(NewerRound):
        dist.init_process_group(
            "gloo", store=store, rank=0, world_size=2, timeout=timedelta(minutes=5)
        )
    assert time.monotonic() - asked_at < 1.0
    assert not dist.is_initialized()


def test_a_formation_cut_short_leaves_the_next_group_named_as_its_peers_name_theirs() -> None:
    """c10d counts the group of a formation cut short: the next round's default group must
    still be ``"0"`` (its store keys' prefix) on this rank, as on its peers (seen: a joiner
    whose formation of round 5 was cut short formed round 6 as ``"1"``, and every rank of
    round 6 waited 300 s for keys the others had written under the other name)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, use_libuv=True)
    forming = FormingStore(client, After(3))
    with pytest.raises(NewerRound):
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore("r5/", forming),
            rank=0,
            world_size=2,
            timeout=timedelta(minutes=5),
        )
    groups.drop_world()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert c10d._get_process_group_name(dist.group.WORLD) == "0"
    finally:
        dist.destroy_process_group()


class GoneStore(dist.HashStore):
    """A store whose host went away: every check fails."""

    def check(self, keys: list[str]) -> bool:
        raise dist.DistNetworkError("Failed to recv, got 0 bytes.")


def test_a_store_that_went_away_waits_for_the_newer_round(monkeypatch: pytest.MonkeyPatch) -> None:
    ask = After(5)
    with pytest.raises(NewerRound):
        FormingStore(GoneStore(), ask).wait(["k"])
    assert ask.calls == 6
    monkeypatch.setattr(formstore, "GONE_WAIT_S", 0.01)
    with pytest.raises(dist.DistNetworkError, match="got 0 bytes"):
        FormingStore(GoneStore(), After(None)).wait(["k"])
