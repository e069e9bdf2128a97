"""elastic.worker.formstore.FormingStore: a formation's store waits give up when told to.

Over torch's in-memory HashStore, and once through a real gloo formation in this process
(a TCPStore on loopback, a world of 2 whose second rank never comes): the exception raised
by ``interrupt`` reaches the caller of ``init_process_group`` unchanged, within a poll. A
peer that dies between publishing its address and connecting holds gloo's connect, which
no store wait covers: its bounded attempts end, and the newer round's error is raised."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from elastic.worker import formstore, groups
from elastic.worker.formstore import FormingStore


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


def test_a_formed_groups_collectives_wait_the_groups_timeout_not_the_connects() -> None:
    """Gloo connects with :data:`groups.FORM_TIMEOUT`; the group's collectives (and the
    checkpoints' side group's) then wait as long as before."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    try:
        groups.form(3, 0, 1, "127.0.0.1", server.port, interrupt=After(None))
        world = dist.group.WORLD
        assert world is not None
        cpu = torch.device("cpu")
        assert world._get_backend(cpu).options._timeout == groups.TIMEOUT
        side = groups.side_group()._get_backend(cpu).options._timeout
        assert side == max(groups.TIMEOUT, groups.SIDE_TIMEOUT)
        assert groups.FORM_TIMEOUT < groups.TIMEOUT
    finally:
        groups.drop_world()


# Rank 1 of round 4: it publishes its gloo address, then stops (SIGSTOP of itself) before
# it connects, as a node killed or frozen while a joiner's round formed (seen in CI: the
# survivors sat in gloo's connect 25 minutes, five attempts of the group's 5-minute
# timeout). Its device is on 127.0.0.2, above ours, so gloo makes it the side that
# connects and ours the side that waits; the address goes to a staging key, published by
# the test once the peer is stopped.
STOPS_AFTER_ITS_ADDRESS = r"""
import os, signal, sys
from datetime import timedelta
import torch.distributed as dist

class StopsAfterItsAddress(dist.Store):
    def __init__(self, inner):
        super().__init__()
        self._inner = inner
    def set(self, key, value):
        self._inner.set("staged-value", value)
        self._inner.set("staged-key", key)
        os.kill(os.getpid(), signal.SIGSTOP)
    def get(self, key):
        return self._inner.get(key)
    def add(self, key, amount):
        return self._inner.add(key, amount)
    def check(self, keys):
        return self._inner.check(keys)
    def compare_set(self, key, expected, desired):
        return self._inner.compare_set(key, expected, desired)
    def wait(self, keys, timeout=None):
        self._inner.wait(keys, timeout or timedelta(seconds=60))

stopping = StopsAfterItsAddress(  # referenced: C++ holds it by pointer only
    dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, use_libuv=True)
)
options = dist.ProcessGroupGloo._Options()
options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.2")]
options._timeout = timedelta(seconds=60)
dist.ProcessGroupGloo(dist.PrefixStore(sys.argv[2], stopping), 1, 2, options)
"""


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_a_peer_silent_mid_connect_ends_the_formation_with_the_newer_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(groups, "FORM_TIMEOUT", timedelta(seconds=1))
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    peer = subprocess.Popen(
        # the keys of round 4's default group ("0") on the cpu device
        [
            sys.executable,
            "-c",
            STOPS_AFTER_ITS_ADDRESS,
            str(server.port),
            f"{groups.KEY_PREFIX}/4//0//cpu/",
        ]
    )
    published: list[float] = []

    def publish_once_stopped() -> None:
        deadline = time.monotonic() + 60
        while not _stopped(peer.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        server.set(server.get("staged-key").decode(), server.get("staged-value"))
        published.append(time.monotonic())

    def interrupt() -> None:  # the agent forms round 5 soon after rank 1 went silent
        if published and time.monotonic() - published[0] > 0.5:  # past the address's wait
            raise NewerRound("round 5 formed")

    threading.Thread(target=publish_once_stopped, daemon=True).start()
    try:
        with pytest.raises(NewerRound) as raised:
            groups.form(4, 0, 2, "127.0.0.1", server.port, interrupt=interrupt)
        assert "Connect timeout" in str(raised.value.__context__)  # gloo's, replaced
        # gloo's 5 connect attempts of 1 s; with the group's own timeout: 25 minutes
        assert time.monotonic() - published[0] < 20
        assert _stopped(peer.pid) and not dist.is_initialized()
    finally:
        peer.kill()
        peer.wait()
        groups.drop_world()
