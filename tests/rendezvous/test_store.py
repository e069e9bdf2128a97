"""c10d Store semantics on a real etcd, through torch's own PrefixStore where torch uses it."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from datetime import timedelta
from typing import Any

import grpc
import pytest
import torch.distributed as dist

from elastic.errors import StoreError
from elastic.etcd.client import EtcdClient, EtcdOptions, parse_endpoints
from elastic.etcd.server import EtcdServer
from elastic.rendezvous.keys import RunKeys
from elastic.rendezvous.lease import RunLease
from elastic.rendezvous.store import EtcdStore


def make_store(client: EtcdClient, run_id: str, timeout: float = 5.0) -> EtcdStore:
    return EtcdStore(
        client, RunKeys("/elastic-test", run_id), RunLease(client, 60), timedelta(seconds=timeout)
    )


@pytest.fixture
def store(client: EtcdClient, run_id: str) -> EtcdStore:
    return make_store(client, run_id)


def test_set_get_str_and_bytes(store: EtcdStore) -> None:
    store.set("a", "1")
    store.set("b", b"\x00\xff")
    assert store.get("a") == b"1"
    assert store.get("b") == b"\x00\xff"


def test_blocking_get_times_out_with_torch_error(client: EtcdClient, run_id: str) -> None:
    store = make_store(client, run_id, timeout=0.5)
    started = time.monotonic()
    with pytest.raises(
        dist.DistStoreError,
        match=r"^Store wait timeout after 0\.5 s: the key 'p//never' did not appear in the etcd",
    ):
        dist.PrefixStore("p/", store).get("never")
    assert 0.45 < time.monotonic() - started < 3


def test_blocking_get_wakes_on_set_from_another_thread(store: EtcdStore) -> None:
    timer = threading.Timer(0.3, lambda: store.set("late", "v"))
    timer.start()
    started = time.monotonic()
    assert store.get("late") == b"v"
    assert time.monotonic() - started < 2.0
    timer.join()


def test_wait_on_several_keys(store: EtcdStore) -> None:
    def publish() -> None:
        for key in ("k1", "k2", "k3"):
            time.sleep(0.1)
            store.set(key, "x")

    t = threading.Thread(target=publish)
    t.start()
    store.wait(["k1", "k2", "k3"])
    t.join()
    assert store.check(["k1", "k2", "k3"])
    with pytest.raises(dist.DistStoreError):
        store.wait(["k1", "missing"], timedelta(seconds=0.3))


def test_check_add_compare_set(store: EtcdStore) -> None:
    assert not store.check(["c"])
    assert store.add("c", 5) == 5
    assert store.add("c", -2) == 3
    assert store.check(["c"])
    assert store.compare_set("cs", "", "first") == b"first"  # absent + empty expected: set
    assert store.compare_set("cs", "wrong", "x") == b"first"
    assert store.compare_set("cs", "first", "second") == b"second"
    assert store.compare_set("absent", "nonempty", "x") == b"nonempty"
    assert not store.check(["absent"])


def test_delete_and_num_keys_through_prefix_store(store: EtcdStore) -> None:
    prefixed = dist.PrefixStore("round1/", store)
    for key in ("a", "b", "c"):
        prefixed.set(key, "1")
    assert store.num_keys() == 3
    assert prefixed.delete_key("b") is True
    assert prefixed.delete_key("b") is False
    assert prefixed.num_keys() == 2


def test_two_run_ids_never_mix(client: EtcdClient) -> None:
    one, two = make_store(client, "run-one-x"), make_store(client, "run-one")
    one.set("k", "1")
    two.set("k", "2")
    assert one.get("k") == b"1" and two.get("k") == b"2"
    assert one.num_keys() == 1 and two.num_keys() == 1


def _adder(endpoint: str, run_id: str, n: int, out: mp.Queue) -> None:
    with EtcdClient(EtcdOptions(parse_endpoints(endpoint)[0])) as client:
        store = make_store(client, run_id)
        results = [store.add("counter", 1) for _ in range(n)]
        out.put((results, client.requests))


def test_add_from_8_processes_is_exact(etcd: EtcdServer, run_id: str) -> None:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_adder, args=(etcd.endpoint, run_id, 100, out)) for _ in range(8)]
    for p in procs:
        p.start()
    seen = []
    for _ in procs:
        results, _requests = out.get(timeout=120)
        seen.extend(results)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert sorted(seen) == list(range(1, 801)), "every add must return a distinct running total"
    with EtcdClient(EtcdOptions(parse_endpoints(etcd.endpoint)[0])) as client:
        assert make_store(client, run_id).get("counter") == b"800"


class _ReplyLost(grpc.RpcError):
    """What the client sees when etcd applied a request but the reply never arrived."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "the reply was lost (test)"


class _LoseFirstTxnReply:
    """A KV stub whose first Txn reaches etcd and is applied, and whose reply is then lost."""

    def __init__(self, kv: Any) -> None:
        self._kv = kv
        self.lost = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kv, name)

    def Txn(self, request: Any, **kwargs: Any) -> Any:
        response = self._kv.Txn(request, **kwargs)
        if self.lost == 0:
            self.lost += 1
            raise _ReplyLost()
        return response


def test_add_is_applied_once_when_the_reply_is_lost_and_the_client_retries(
    client: EtcdClient, run_id: str
) -> None:
    store = make_store(client, run_id)
    conn = client._conn(0)
    lossy = _LoseFirstTxnReply(conn.kv)
    conn.kv = lossy
    before = client.requests
    assert store.add("barrier", 1) == 1
    assert lossy.lost == 1 and client.requests - before >= 3, "the txn must have been re-sent"
    assert store.get("barrier") == b"1"
    assert store.add("barrier", 1) == 2  # later adds still count
    assert store.num_keys() == 1, "add tokens must not show up as store keys"
    for name in ("other", "keys", "too"):
        store.add(name, 1)
    tokens = client.range(f"/elastic-test/{run_id}/store-adds/".encode(), prefix=True)
    assert tokens.count == 1, "one token key per store and thread, whatever the keys"


def test_add_retry_after_a_peer_added_returns_the_first_result(
    client: EtcdClient, etcd: EtcdServer, run_id: str
) -> None:
    store = make_store(client, run_id)
    store.add("n", 10)
    conn = client._conn(0)
    peer_added = False

    class PeerAddsBeforeRetry(_LoseFirstTxnReply):
        def Txn(self, request: Any, **kwargs: Any) -> Any:
            nonlocal peer_added
            response = self._kv.Txn(request, **kwargs)
            if self.lost == 0:
                self.lost += 1
                with EtcdClient(EtcdOptions(parse_endpoints(etcd.endpoint)[0])) as other:
                    make_store(other, run_id).add("n", 100)
                peer_added = True
                raise _ReplyLost()
            return response

    conn.kv = PeerAddsBeforeRetry(conn.kv)
    assert store.add("n", 1) == 11
    assert peer_added
    assert store.get("n") == b"111"


@pytest.mark.parametrize("size", [int(1.6 * 2**20), 3 * 2**20])
def test_oversized_value_raises_store_error_naming_key_size_and_limit(
    store: EtcdStore, size: int
) -> None:
    value = b"x" * size
    with pytest.raises(StoreError, match=rf"{size:,}-byte value of key 'big'.*--max-request-bytes"):
        store.set("big", value)
    with pytest.raises(StoreError, match=r"key 'cas'"):
        store.compare_set("cas", "", value)
    assert not store.check(["big", "cas"])
    store.set("big", b"x" * 2**20)  # 1 MiB fits
    assert len(store.get("big")) == 2**20
