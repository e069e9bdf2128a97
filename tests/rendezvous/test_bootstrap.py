"""The round's bootstrap store: hosted by rank 0's agent (in a host process of its own,
:mod:`elastic.rendezvous.storehost`) before any worker starts.

A worker that asks a TCPStore before it listens backs off for about half a second (the
last test shows it, so that a torch that changes this is noticed), which every re-form
paid when a non-zero rank's worker started before rank 0's.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from torch.distributed import DistError, TCPStore

from elastic.etcd.server import EtcdServer, free_port
from elastic.rendezvous.bootstrap import BootstrapStore, listen_on, wait_listening
from elastic.rendezvous.storehost import Hosts
from tests.helpers import wait_until
from tests.rendezvous.test_announce import Nodes, join_all

pytestmark = pytest.mark.integration  # the store's host is a process of its own


def refuses(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
    except OSError:
        return True
    return False


def client(port: int, seconds: float = 2.0) -> TCPStore:
    return TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=seconds))


def test_rank_0_hosts_a_store_that_clients_reach_and_close_stops_it() -> None:
    port = free_port()
    store = BootstrapStore()
    store.start_round(0, "127.0.0.1", port)
    assert store.hosting
    c = client(port)
    c.set("k", "v")
    assert c.get("k") == b"v"
    del c
    store.close()
    assert not store.hosting
    wait_until(lambda: refuses(port), 10, "the closed store to stop listening")


def test_another_rank_waits_until_rank_0_listens() -> None:
    port = free_port()
    rank0 = BootstrapStore()

    def host_later() -> None:
        time.sleep(0.3)  # rank 0's agent learns the round a little later
        rank0.start_round(0, "127.0.0.1", port)

    host = threading.Thread(target=host_later)
    host.start()
    started = time.monotonic()
    BootstrapStore().start_round(1, "127.0.0.1", port)
    waited = time.monotonic() - started
    listening = not refuses(port)  # before rank 0's start_round returned, possibly
    host.join(10)
    assert listening, "start_round returned before rank 0's store listened"
    assert 0.2 < waited < 5, waited  # it waited for rank 0, then returned (WAIT_S is 2 s)
    assert rank0.hosting
    rank0.close()


def test_nobody_listening_gives_up_after_the_deadline() -> None:
    started = time.monotonic()
    assert not wait_listening("127.0.0.1", free_port(), 0.3)
    assert time.monotonic() - started < 2


def test_a_taken_port_falls_back_to_rank_0s_worker(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        store = BootstrapStore()
        with caplog.at_level(logging.WARNING, logger="elastic.rendezvous.bootstrap"):
            store.start_round(0, "127.0.0.1", taken.getsockname()[1])
    assert not store.hosting
    assert "rank 0's worker hosts it" in caplog.text


@pytest.fixture
def pair(etcd: EtcdServer, run_id: str) -> Iterator[Nodes]:
    nodes = Nodes(etcd, run_id, "2:2")
    nodes.add(2)
    yield nodes
    nodes.close()


def test_each_round_gets_a_fresh_store_that_listens_when_the_round_returns(pair: Nodes) -> None:
    seen = []
    for round_ in range(2):
        infos = join_all(pair.handlers)
        by_rank = {infos[h.name].rank: h for h in pair.handlers}
        assert by_rank[0].use_agent_store and not by_rank[1].use_agent_store
        info = next(iter(infos.values())).bootstrap_store_info
        c = client(info.master_port, 1.0)  # listening already: no back-off
        if round_ == 1:
            assert not c.check(["written-in-round-0"]), "a new round reads no old key"
        c.set("written-in-round-0", "x")
        del c
        seen.append(info.master_port)
        for h in pair.handlers:
            h.request_reform()
    if seen[0] != seen[1]:
        wait_until(lambda: refuses(seen[0]), 10, "the first round's store to stop")


def test_a_client_before_its_server_backs_off() -> None:
    """Why the store is hosted early: torch's client backs off when refused."""
    port = free_port()
    servers: list[TCPStore] = []
    timer = threading.Timer(
        0.05,
        lambda: servers.append(TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)),
    )
    timer.start()
    started = time.monotonic()
    client(port, 10)
    waited = time.monotonic() - started
    timer.join()
    assert waited > 0.15, f"torch no longer backs off ({waited:.3f} s): hosting early matters less"


@pytest.mark.integration
def test_one_host_serves_round_after_round_with_nothing_carried_over() -> None:
    """A round's end drops its server (its port, keys and clients) and the same host, torch
    already imported, serves the next round at once: no new import per round (a host
    started at every round imported torch beside a joiner's start and made its first step
    0.5 s later on 2 cores)."""
    hosts = Hosts()
    try:
        first = hosts.take()
        one = listen_on("127.0.0.1", 0)
        port = one.getsockname()[1]
        with one:
            first.serve(one)
        old = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2))
        old.set("kept", "1")
        hosts.give_back(first)
        wait_until(lambda: _refused(port), 5, "the old round's port to close")
        second = hosts.take()
        assert second is first and second.alive(), "the host was not reused"
        two = listen_on("127.0.0.1", 0)
        port_two = two.getsockname()[1]
        started = time.monotonic()
        with two:
            second.serve(two)
        assert time.monotonic() - started < 1.0  # no import: the old way took 1-2 s here
        new = TCPStore("127.0.0.1", port_two, is_master=False, timeout=timedelta(seconds=2))
        assert not new.check(["kept"]), "a key of the last round was carried over"
        with pytest.raises(DistError):
            old.get("kept")  # the last round's clients are cut off
    finally:
        hosts.close()


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
    except ConnectionRefusedError:
        return True
    return False
