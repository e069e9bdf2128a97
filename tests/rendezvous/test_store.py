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
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent, Worker, WorkerSpec

from elastic.errors import StoreError
from elastic.etcd.client import EtcdClient, EtcdOptions, parse_endpoints
from elastic.etcd.server import EtcdServer
from elastic.rendezvous.keys import RunKeys
from elastic.rendezvous.lease import RunLease
from elastic.rendezvous.store import MAX_TXN_OPS, EtcdStore
from tests.helpers import wait_until


def make_store(client: EtcdClient, run_id: str, timeout: float = 5.0) -> EtcdStore:
    return EtcdStore(
        client, RunKeys("/elastic-test", run_id), RunLease(client, 60), timedelta(seconds=timeout)
    )


def granted_store(client: EtcdClient, run_id: str, timeout: float = 5.0) -> EtcdStore:
    """A store whose lease is granted already, for tests that count requests."""
    lease = RunLease(client, 60)
    lease.id()
    return EtcdStore(client, RunKeys("/elastic-test", run_id), lease, timedelta(seconds=timeout))


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


def test_multi_set_and_multi_get_keep_order_and_bytes(client: EtcdClient, run_id: str) -> None:
    store = granted_store(client, run_id)
    before = client.requests
    store.multi_set(["a", "b", "c"], ["1", b"\x00\xff", ""])
    assert store.multi_get(["c", "a", "b", "a"]) == [b"", b"1", b"\x00\xff", b"1"]
    assert client.requests - before == 2, "one transaction each"
    assert store.multi_get([]) == []
    with pytest.raises(StoreError, match="multi_set got 2 keys and 1 values"):
        store.multi_set(["x", "y"], ["1"])


def test_multi_get_through_prefix_store_is_ours_in_one_request(
    client: EtcdClient, run_id: str
) -> None:
    """C++ (``PrefixStore``) calls our multi_get/multi_set through the trampoline, not its
    per-key fallback: one request each, whatever the number of keys."""
    store = granted_store(client, run_id)
    prefixed: Any = dist.PrefixStore("round/", store)  # torch's stub lacks multi_set
    keys = [f"k{i}" for i in range(20)]
    before = client.requests
    prefixed.multi_set(keys, [str(i) for i in range(20)])
    assert prefixed.multi_get(keys) == [str(i).encode() for i in range(20)]
    assert client.requests - before == 2
    assert store.get("round//k7") == b"7"  # PrefixStore puts a "/" after its prefix


def test_multi_get_waits_for_every_key_and_times_out_naming_the_missing(
    client: EtcdClient, run_id: str
) -> None:
    store = make_store(client, run_id, timeout=5)
    store.set("here", "0")
    timer = threading.Timer(0.3, lambda: store.multi_set(["late1", "late2"], ["1", "2"]))
    timer.start()
    started = time.monotonic()
    assert store.multi_get(["here", "late1", "late2"]) == [b"0", b"1", b"2"]
    assert time.monotonic() - started < 3.0
    timer.join()
    store.set_timeout(timedelta(seconds=0.3))
    with pytest.raises(
        dist.DistStoreError, match=r"timeout after 0\.3 s: the keys 'm1', 'm2' did not appear"
    ):
        store.multi_get(["here", "m1", "m2"])
    with pytest.raises(dist.DistStoreError, match=r"the keys 'm1', 'm2', 'm3' and 2 more did"):
        store.wait(["m1", "m2", "m3", "m4", "m5", "here"])


def test_many_keys_take_one_transaction_per_max_txn_ops(client: EtcdClient, run_id: str) -> None:
    store = granted_store(client, run_id)
    n = 2 * MAX_TXN_OPS + 44  # etcd refuses a transaction of more than 128 operations
    keys = [f"k{i}" for i in range(n)]
    before = client.requests
    store.multi_set(keys, [str(i) for i in range(n)])
    assert client.requests - before == 3
    assert store.multi_get(keys) == [str(i).encode() for i in range(n)]
    assert client.requests - before == 6
    store.wait(keys)
    assert client.requests - before == 9
    assert store.num_keys() == n


def test_multi_set_and_get_of_values_over_etcds_request_limit_together(
    client: EtcdClient, store: EtcdStore
) -> None:
    """Five 1 MiB values: too many for one 1.5 MiB request or one 4 MiB answer; split."""
    values = [bytes([i]) * 2**20 for i in range(5)]
    keys = [f"big{i}" for i in range(5)]
    store.multi_set(keys, values)
    assert store.multi_get(keys) == values
    with pytest.raises(StoreError, match=r"value of key 'huge'.*--max-request-bytes"):
        store.multi_set(["small", "huge"], [b"x", b"x" * 2 * 2**20])


def _spec() -> WorkerSpec:
    return WorkerSpec(role="trainer", local_world_size=2, rdzv_handler=None, entrypoint="x")  # type: ignore[arg-type]


def _assign(store: dist.Store, rank: int, nodes: int) -> list[Worker]:
    agent: Any = None  # torch's method reads only its arguments
    return SimpleElasticAgent._assign_worker_ranks(agent, store, rank, nodes, _spec())


class _PerKeyStore(EtcdStore):
    """The store before multi_get/multi_set: torch's C++ per-key loops run instead."""

    multi_get = dist.Store.multi_get
    multi_set = dist.Store.multi_set  # type: ignore[attr-defined]


def rank0_requests(
    client: EtcdClient, others: EtcdClient, run_id: str, nodes: int, per_key: bool = False
) -> int:
    """Requests agent 0 of ``nodes`` makes in torch's ``_assign_worker_ranks``, the other
    agents having published their roles (they run in threads on another client)."""
    kind = _PerKeyStore if per_key else EtcdStore
    keys = RunKeys("/elastic-test", run_id)
    prefix = f"torch.rendezvous.{run_id}.{nodes}"
    peers = [kind(others, keys, RunLease(others, 60), timedelta(seconds=30)) for _ in range(nodes)]
    results: dict[int, list[Worker]] = {}

    def agent(rank: int) -> None:
        results[rank] = _assign(dist.PrefixStore(prefix, peers[rank]), rank, nodes)

    threads = [threading.Thread(target=agent, args=(r,)) for r in range(1, nodes)]
    for t in threads:
        t.start()
    probe = dist.PrefixStore(prefix, peers[0])
    roles = [f"torchelastic/role_info/{r}" for r in range(1, nodes)]
    wait_until(lambda: probe.check(roles), 30, "the other agents' role keys")
    lease = RunLease(client, 60)
    lease.id()  # granted before counting
    store = kind(client, keys, lease, timedelta(seconds=30))
    before = client.requests
    results[0] = _assign(dist.PrefixStore(prefix, store), 0, nodes)
    spent = client.requests - before
    for t in threads:
        t.join(30)
    assert [results[r][1].global_rank for r in range(nodes)] == [2 * r + 1 for r in range(nodes)]
    assert {w.world_size for r in range(nodes) for w in results[r]} == {2 * nodes}
    return spent


def test_rank_assignment_costs_agent_0_four_requests_at_any_size(
    client: EtcdClient, etcd: EtcdServer, run_id: str
) -> None:
    """torch's rank 0 agent sets its role, multi_gets every role, multi_sets every rank and
    gets its own; with torch's per-key fallback that costs 2 requests more per node."""
    with EtcdClient(EtcdOptions(parse_endpoints(etcd.endpoint)[0])) as others:
        assert rank0_requests(client, others, run_id + "a", 3) == 4
        assert rank0_requests(client, others, run_id + "b", 8) == 4
        assert rank0_requests(client, others, run_id + "c", 3, per_key=True) == 2 * 3 + 2
        assert rank0_requests(client, others, run_id + "d", 8, per_key=True) == 2 * 8 + 2
