"""Trust only what is signed: with a job secret, whoever writes etcd without it gets no rank,
cannot forge a round or its ``closed`` flag; the bootstrap store listens on the node's
address only; a hung etcd does not count as reachable.

On a real etcd with in-process announce handlers (tests/rendezvous/test_announce.py); the
attacker writes straight into etcd with the etcd client.
"""

from __future__ import annotations

import json
import os
import signal
import socket
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from elastic import env
from elastic.etcd.client import EtcdClient, EtcdOptions, parse_endpoints
from elastic.etcd.server import EtcdServer, free_port
from elastic.rendezvous.announce import follower, policy
from elastic.rendezvous.announce.handler import AnnounceRendezvousHandler
from elastic.rendezvous.announce.records import Announcement, Round, Trust
from elastic.rendezvous.bootstrap import BootstrapStore
from elastic.rendezvous.keys import RunKeys
from tests.helpers import wait_until
from tests.rendezvous.test_announce import Nodes, join_all, pause


@pytest.fixture
def secret(job_secret: Path) -> bytes:
    """The job's secret, as every node of the job would share it."""
    return job_secret.read_bytes().strip()


@pytest.fixture
def run(etcd: EtcdServer, run_id: str, secret: bytes) -> Iterator[Nodes]:
    nodes = Nodes(etcd, run_id, "2:4")
    yield nodes
    nodes.close()


def keys_of(h: AnnounceRendezvousHandler) -> RunKeys:
    return h._keys


def plant_rogues(client: EtcdClient, keys: RunKeys, pid: int) -> list[str]:
    """Two member keys: one unsigned, one signed with another secret (on no lease)."""
    rogue = Announcement("127.0.0.1", pid, 0, free_port(), free_port(), after=-1)
    unsigned, foreign = (keys.members + f"127.0.0.1_{pid}_{i}".encode() for i in (0, 1))
    client.put(unsigned, rogue.encode())
    client.put(foreign, Trust(b"another-secret", keys.round).seal(foreign, rogue))
    return [k[len(keys.members) :].decode() for k in (unsigned, foreign)]


def test_a_rogue_member_gets_no_rank_while_signed_members_form_rounds(
    run: Nodes, client: EtcdClient, tmp_path: Path
) -> None:
    handlers = run.add(2)
    rogues = plant_rogues(client, keys_of(handlers[0]), 1)  # older than every signed member
    infos = join_all(handlers)
    assert {i.world_size for i in infos.values()} == {2}
    assert set(handlers[0]._state.round.members) == {h.name for h in handlers}
    # Rogues written while the round runs are no joiners either.
    later = plant_rogues(client, keys_of(handlers[0]), 2)
    pause(2.0)
    assert all(h.membership_change() is None for h in handlers)
    assert not set(rogues + later) & set(handlers[0]._state.round.members)
    kinds = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    untrusted = {e["node"] for e in kinds if e["kind"] == "rdzv.untrusted"}
    assert untrusted == {*rogues, *later}, untrusted


def test_a_forged_round_is_refused(run: Nodes, client: EtcdClient) -> None:
    handlers = run.add(2)
    keys = keys_of(handlers[0])
    members = {h.name: rank for rank, h in enumerate(handlers)}
    forged = Round(7, members, "10.6.6.6", 6666, "rogue")
    client.put(keys.round, forged.encode())  # unsigned, before anyone joins
    infos = join_all(handlers)
    masters = {
        i.bootstrap_store_info and i.bootstrap_store_info.master_addr for i in infos.values()
    }
    assert masters == {"127.0.0.1"}, masters
    signed = json.loads(client.range(keys.round).kvs[0].value)
    assert "sig" in signed and signed["master_addr"] == "127.0.0.1"
    resigned = Trust(b"another-secret", keys.round).seal(keys.round, forged)
    client.put(keys.round, resigned)
    wait_until(
        lambda: all(h._state.round.round != 7 and h._state.round_rev for h in handlers),
        10,
        "the nodes to refuse the round signed with another secret",
    )


def test_a_forged_closed_flag_does_not_end_the_job(run: Nodes, client: EtcdClient) -> None:
    handlers = run.add(2)
    join_all(handlers)
    keys = keys_of(handlers[0])
    doc = json.loads(client.range(keys.round).kvs[0].value)
    client.put(keys.round, json.dumps({**doc, "closed": True}).encode())  # signature broken
    wait_until(
        lambda: all(h.membership_change() is not None for h in handlers),
        10,
        "the nodes to see the refused round",
    )
    assert not any(h.is_closed() for h in handlers)
    infos = join_all(handlers)  # the next rendezvous goes on: no RendezvousClosedError
    assert sorted(i.rank for i in infos.values()) == [0, 1]
    handlers[0].set_closed()  # the job's own, signed close still ends it
    assert all(h.is_closed() for h in handlers)


@pytest.mark.integration  # the store's host is a process of its own
def test_the_bootstrap_store_listens_on_the_nodes_address_only() -> None:
    port, store = free_port("127.0.0.2"), BootstrapStore()
    store.start_round(0, "127.0.0.2", port)
    try:
        assert store.hosting
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        peer = TCPStore("127.0.0.2", port, is_master=False, timeout=timedelta(seconds=10))
        peer.set("k", "v")
        assert peer.get("k") == b"v"
    finally:
        store.close()
    wait_until(lambda: refused("127.0.0.2", port), 10, "the store to stop listening")


def refused(addr: str, port: int) -> bool:
    try:
        socket.create_connection((addr, port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


@pytest.fixture
def frozen_run(
    own_etcd: EtcdServer, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Nodes, Callable[[], None]]]:
    """Two nodes on a private etcd, watches of 1 s; ``freeze()`` SIGSTOPs the etcd."""
    monkeypatch.setattr(follower, "IDLE_WATCH_S", 1.0)
    monkeypatch.setattr(policy, "IDLE_WATCH_S", 1.0)
    assert own_etcd.proc is not None
    pid = own_etcd.proc.pid
    nodes = Nodes(own_etcd, run_id, "2:2", request_timeout="2", outage_timeout="600")
    yield nodes, lambda: os.kill(pid, signal.SIGSTOP)
    os.kill(pid, signal.SIGCONT)
    nodes.close()


def test_a_frozen_etcd_does_not_count_as_reachable(
    frozen_run: tuple[Nodes, Callable[[], None]], own_etcd: EtcdServer
) -> None:
    run, freeze = frozen_run
    handlers = run.add(2)
    join_all(handlers)
    freeze()
    wait_until(
        lambda: not any(h._outage.check() for h in handlers), 30, "the nodes to see the outage"
    )
    for _ in range(8):  # several 1 s watches run out meanwhile: still unreachable
        pause(0.5)
        assert not any(h._outage.check() for h in handlers)
    assert own_etcd.proc is not None
    os.kill(own_etcd.proc.pid, signal.SIGCONT)
    wait_until(lambda: all(h._outage.check() for h in handlers), 30, "etcd to answer again")


def test_without_a_secret_records_are_unsigned_and_rounds_form(
    etcd: EtcdServer, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(env.SECRET_FILE, raising=False)
    nodes = Nodes(etcd, run_id, "2:2")
    try:
        handlers = nodes.add(2)
        infos = join_all(handlers)
        assert sorted(i.rank for i in infos.values()) == [0, 1]
        with EtcdClient(EtcdOptions(parse_endpoints(etcd.endpoint)[0])) as c:
            assert "sig" not in json.loads(c.range(keys_of(handlers[0]).round).kvs[0].value)
    finally:
        nodes.close()


def test_elastic_status_shows_no_rogue_member(run: Nodes, client: EtcdClient) -> None:
    """``elastic status`` checks the records as the agents do: a rogue is counted, not shown."""
    from elastic.rendezvous.announce.status import announce_status

    handlers = run.add(2)
    join_all(handlers)
    rogues = plant_rogues(client, keys_of(handlers[0]), 3)
    status = announce_status(client, keys_of(handlers[0]))
    shown = {m["node"] for m in status["members"]}
    assert shown == {h.name for h in handlers} and not shown & set(rogues), status
    assert status["untrusted"] == 2 and status["world_size"] == 2, status
