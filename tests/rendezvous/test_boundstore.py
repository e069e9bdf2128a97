"""The bounded TCPStore server (``elastic.rendezvous.boundstore``) with torch's own client.

The first cases are torch's TCPStore cases, ported from pytorch/pytorch
``test/distributed/test_store.py`` (``StoreTestBase``, ``TCPStoreTest``, ``PrefixTCPStoreTest``,
``TestMultiThreadedWait``, ``RendezvousTCPTest``; read, not vendored), each run on torch's own
TCPStore server and on ours, bare and under ``dist.PrefixStore``: both must answer alike. Our
server runs as a process of its own (``python .../boundstore.py FD``: stdlib only, no torch), as the
agent's is to its workers. Then the bounds, a real gloo group through it, and the flood.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from elastic.rendezvous import boundstore
from elastic.rendezvous.boundstore import VALIDATION_MAGIC, Query

pytestmark = pytest.mark.integration

MiB = 1024 * 1024


class Server:
    """Our store in a child process, on a socket bound here; its stderr kept for the test."""

    def __init__(self, tmp: Path, **limits: float) -> None:
        listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(listener.getsockname()[1])
        self.log = tmp / f"store-{self.port}.log"
        args = [f"{k}={v}" for k, v in limits.items()]
        with self.log.open("wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, boundstore.__file__, str(listener.fileno()), *args],
                pass_fds=[listener.fileno()],
                stderr=err,
            )
        listener.close()
        self.client()  # its ping is answered once the child serves (it waits in the backlog)

    def client(self, timeout: float = 5.0) -> Any:  # torch's stub types values as str
        return dist.TCPStore(
            "127.0.0.1", self.port, is_master=False, timeout=timedelta(seconds=timeout)
        )

    def rss(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def warnings(self) -> list[str]:
        return [ln for ln in self.log.read_text().splitlines() if "WARNING" in ln]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    srv = Server(tmp_path)
    yield srv
    srv.stop()


@pytest.fixture(params=["torch", "bounded", "bounded-prefix"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """A client of torch's server (the reference) or of ours, bare or under a PrefixStore."""
    if request.param == "torch":
        master = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
        yield dist.TCPStore(
            "127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=60)
        )
        del master
        return
    srv = Server(tmp_path)
    client = srv.client(60)
    yield client if request.param == "bounded" else dist.PrefixStore("test_prefix", client)
    srv.stop()


def test_set_get_check(store: Any) -> None:
    """``StoreTestBase.test_set_get_check`` (5 keys: no ``init/`` key without a world size)."""
    store.add("key", 1)
    store.add("key", 2)
    store.add("key", 3)
    store.set("key0", "value0")
    store.add("key3", 1)
    store.set("key1", "value1")
    store.add("key3", 2)
    store.set("key2", "value2")
    store.add("key3", 3)
    store.add("key3", 4)
    store.add("key3", 5)
    store.add("key3", 6)
    assert store.num_keys() == 5
    assert store.get("key") == b"6"
    assert store.get("key0") == b"value0"
    assert store.get("key1") == b"value1"
    assert store.get("key2") == b"value2"
    assert store.get("key3") == b"21"
    assert store.check(["key3"])
    assert not store.check(["Randomkey3"])
    store.set("-key3", "7")
    assert store.get("-key3") == b"7"
    store.delete_key("-key3")
    assert store.num_keys() == 5


def test_compare_set(store: Any) -> None:
    """``StoreTestBase.test_compare_set``."""
    assert store.compare_set("cs_key0", "wrong_old_value", "new_value0") == b"wrong_old_value"
    store.set("cs_key0", "value0")
    assert store.get("cs_key0") == b"value0"
    assert store.compare_set("cs_key0", "wrong_old_value", "new_value0") == b"value0"
    assert store.get("cs_key0") == b"value0"
    assert store.compare_set("cs_key0", "value0", "new_value0") == b"new_value0"
    assert store.get("cs_key0") == b"new_value0"
    assert store.compare_set("cs_key1", "", "new_value1") == b"new_value1"
    assert store.get("cs_key1") == b"new_value1"


def test_simple_wait(store: Any) -> None:
    """``StoreTestBase.test_simple_wait``."""
    with pytest.raises(RuntimeError, match=r"[t -i]imeout"):
        store.wait(["bad_key"], timedelta(seconds=0.25))
    store.add("good_key", 1)
    store.wait(["good_key"])


def test_append_multi_set_multi_get(store: Any) -> None:
    """``StoreTestBase.test_append``, ``test_multi_set``, ``test_multi_get``."""
    assert store.has_extended_api()
    store.set("foo", "po")
    store.append("foo", "tato")
    store.append("bar", "po")
    store.append("bar", "tato")
    assert store.get("foo") == b"potato"
    assert store.get("bar") == b"potato"
    store.multi_set(["foo", "bar"], ["po", "tato"])
    assert store.multi_get(["foo", "bar"]) == [b"po", b"tato"]


def test_queues(store: Any) -> None:
    """``StoreTestBase.test_queues``, ``test_queue_len``, ``test_queue_timeout``."""
    if isinstance(store, dist.PrefixStore):
        pytest.skip("torch's PrefixStore has no queues")
    store.queue_push("q", "1")
    store.queue_push("q", "2")
    assert store.queue_len("q") == 2
    assert store.queue_pop("q") == b"1"
    assert store.queue_pop("q", block=False) == b"2"
    assert store.queue_len("q") == 0
    with pytest.raises(dist.QueueEmptyError):
        store.queue_pop("q", block=False)
    store.set_timeout(timedelta(seconds=0.2))
    with pytest.raises(dist.DistStoreError, match="timeout"):
        store.queue_pop("q")
    got: list[bytes] = []
    store.set_timeout(timedelta(seconds=10))
    waiter = threading.Thread(target=lambda: got.append(store.clone().queue_pop("q2")))
    waiter.start()
    store.queue_push("q2", "late")
    waiter.join(10)
    assert got == [b"late"]


def test_list_keys_and_barrier(store: Any) -> None:
    """``TCPStoreTest.test_list_keys`` and ``test_barrier`` (two threads, each a clone)."""
    if isinstance(store, dist.PrefixStore):
        pytest.skip("torch's PrefixStore lists no keys")
    store.set("a", "1")
    store.set("b", "2")
    assert sorted(store.list_keys()) == ["a", "b"]
    errors: list[BaseException] = []

    def arrive() -> None:
        try:
            store.clone().barrier("bar", 2, timedelta(seconds=10))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=arrive) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors
    with pytest.raises(dist.DistStoreError, match="barrier timeout"):
        store.barrier("lonely", 2, timedelta(seconds=0.2))
    assert store.get("a") == b"1"  # the connection survives the cancelled barrier


def test_clone_and_wait_from_two_threads(store: Any) -> None:
    """``StoreTestBase.test_clone``; ``TestMultiThreadedWait._test_wait``."""
    b = store.clone()
    store.set("foo", "bar")
    assert b.get("foo") == b"bar"
    got: list[bytes] = []

    def waiter() -> None:
        local = store.clone()
        local.wait(["key1"])
        got.append(local.get("key1"))

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.05)  # not a wait for a condition: gives the waiter time to register first
    store.clone().set("key1", "value1")
    t.join(10)
    assert got == [b"value1"]


def test_python_store_from_cpp(store: Any) -> None:
    """``PythonStoreTest.test_set_get`` through ``dist._test_python_store``."""
    dist._test_python_store(store)
    assert store.get("key") == b"6"


def test_numkeys_delkeys(store: Any) -> None:
    """``TCPStoreTest._test_numkeys_delkeys`` (counts one lower: no ``init/`` key)."""
    assert store.num_keys() == 0
    store.add("key", 1)
    store.add("key", 2)
    store.add("key", 3)
    store.set("key0", "value0")
    store.add("key3", 1)
    store.set("key1", "value1")
    assert store.num_keys() == 4
    store.delete_key("key")
    assert store.num_keys() == 3
    store.set_timeout(timedelta(seconds=0.3))
    with pytest.raises(RuntimeError):
        store.get("key")
    store.delete_key("key0")
    store.delete_key("key3")
    assert store.num_keys() == 1
    store.set("key4", "value2")
    assert store.num_keys() == 2
    assert store.get("key1") == b"value1"
    assert store.get("key4") == b"value2"


def test_store_timeout_doesnt_break_client(store: Any) -> None:
    """``RendezvousTCPTest.test_tcp_store_timeout_doest_break_client``, torch's wording."""
    store.set_timeout(timedelta(seconds=0.1))
    with pytest.raises(dist.DistStoreError, match=r"wait timeout after 100ms, keys: .*the_key"):
        store.get("the_key")
    store.set("the_key", "x")
    assert store.get("the_key") == b"x"


# -- the bounds --


def _raw(port: int) -> socket.socket:
    """A raw client that has passed torch's validation."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(struct.pack("<BI", Query.VALIDATE, VALIDATION_MAGIC))
    return sock


def _set(key: bytes, size: int) -> bytes:
    return struct.pack("<BQ", Query.SET, len(key)) + key + struct.pack("<Q", size)


def _closed(sock: socket.socket, timeout: float = 5.0) -> bool:
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_value_up_to_the_bound_is_kept_one_over_closes_its_connection(server: Server) -> None:
    client = server.client()
    client.set("big", b"x" * MiB)
    assert client.get("big") == b"x" * MiB
    with pytest.raises(dist.DistError):
        client.set("bigger", b"x" * (MiB + 1))
        client.get("big")  # the refusal shows on the next request
    assert server.client().get("big") == b"x" * MiB  # everyone else is served


def test_a_flood_of_large_values_does_not_grow_the_store(server: Server) -> None:
    """The red team's flood: 60 values of 8 MB from a raw client. Each is refused at its
    length prefix, before its bytes are read, and the store's process keeps its size."""
    before = server.rss()
    payload = b"\0" * (8 * 1000 * 1000)
    for i in range(60):
        sock = _raw(server.port)
        # closed at the length prefix, while the rest is still being sent
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(_set(b"flood%d" % i, len(payload)) + payload)
        sock.close()
    after = server.rss()
    print(f"flood of 60 x 8 MB: store RSS {before / MiB:.1f} -> {after / MiB:.1f} MiB")
    assert after - before < 8 * MiB
    assert server.client().num_keys() == 0
    assert 1 <= len(server.warnings()) <= 2  # one line, at most one a second


def test_stored_bytes_stop_at_the_bound_and_memory_with_them(server: Server) -> None:
    """1 MiB values until the 64 MiB bound refuses one: the store's RSS grows by about the
    bound, no more."""
    before = server.rss()
    stored = 0
    with pytest.raises(dist.DistError):
        client = server.client()
        for i in range(100):
            client.set(f"v{i}", b"x" * MiB)
            client.check([f"v{i}"])  # a round trip: a refusal shows here
            stored += 1
    after = server.rss()
    print(f"64 MiB bound: {stored} values kept, RSS {before / MiB:.1f} -> {after / MiB:.1f} MiB")
    assert 60 <= stored < 64
    assert after - before < 80 * MiB  # 63 MiB kept: measured +67 MiB
    assert server.client().get("v0") == b"x" * MiB


def test_keys_connections_and_unvalidated_clients_are_bounded(tmp_path: Path) -> None:
    srv = Server(tmp_path, max_keys=10, max_connections=6, validate_timeout_s=0.5)
    try:
        client = srv.client()
        for i in range(10):
            client.set(f"k{i}", "v")
        with pytest.raises(dist.DistError):
            client.set("k10", "v")
            client.check(["k0"])
        idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(6)]
        extra = socket.create_connection(("127.0.0.1", srv.port))
        assert _closed(extra)  # over the cap: refused
        assert all(_closed(s) for s in idle)  # never validated: closed after 0.5 s
        assert srv.client().num_keys() == 10  # and the store serves again
    finally:
        srv.stop()


def test_a_wrong_first_request_and_oversized_key_close_the_connection(server: Server) -> None:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    sock.sendall(struct.pack("<BI", Query.PING, 7))
    assert _closed(sock)
    sock = _raw(server.port)
    sock.sendall(struct.pack("<BQ", Query.GET, 9000))
    assert _closed(sock)
    sock = _raw(server.port)
    sock.sendall(struct.pack("<BI", Query.PING, 7))
    assert sock.recv(4) == struct.pack("<I", 7)


_WORKER = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    from datetime import timedelta
    port, rank, world = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    store = dist.TCPStore("127.0.0.1", port, world, False, timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    sub = dist.new_group([0, 1])
    if rank in (0, 1):
        dist.all_reduce(t, group=sub)
    dist.barrier()
    if rank == 0:
        sizes = [len(store.get(k)) for k in store.list_keys()]
        print("RESULT", float(t), len(sizes), max(sizes), sum(sizes), flush=True)
    dist.destroy_process_group()
    """
)


def test_a_gloo_group_of_three_forms_through_it(server: Server, tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(server.port), str(r), "3"],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(3)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    result = next(ln for ln in outs[0].splitlines() if ln.startswith("RESULT")).split()
    print("gloo through the bounded store: keys, largest value, total bytes:", result[2:])
    assert float(result[1]) == 12.0  # (1+2+3), then ranks 0 and 1 summed again: 6 + 6
    assert not server.warnings()


def _own_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_the_agents_bootstrap_store_keeps_its_size_under_the_flood(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As the agent hosts it (``BootstrapStore``, a thread of this process): the same flood
    grows this process by less than 8 MiB (torch's server: more than 300 MB)."""
    from elastic.rendezvous.bootstrap import BootstrapStore

    monkeypatch.setenv("ELASTIC_BOUNDED_STORE", "1")
    boot = BootstrapStore()
    port = boot.reserve("127.0.0.1")
    boot.start_round(0, "127.0.0.1", port)
    try:
        before = _own_rss()
        payload = b"\0" * (8 * 1000 * 1000)
        for i in range(60):
            sock = _raw(port)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(_set(b"flood%d" % i, len(payload)) + payload)
            sock.close()
        del payload
        after = _own_rss()
        print(f"agent-hosted flood: RSS {before / MiB:.1f} -> {after / MiB:.1f} MiB")
        assert after - before < 8 * MiB
        sock = _raw(port)
        sock.sendall(struct.pack("<B", Query.GETNUMKEYS))
        assert struct.unpack("<q", sock.recv(8))[0] == 0
        sock.close()
    finally:
        boot.close()


def test_pipelined_requests_and_a_client_that_never_reads(server: Server) -> None:
    """20,000 pings in one send are answered in order; a client that asks for a 1 MiB value
    2,000 times and reads nothing is no longer read from (its answers wait in the kernel),
    so the store holds about one answer for it and serves everyone else."""
    server.client().set("k", b"x" * MiB)
    sock = _raw(server.port)
    sock.sendall(b"".join(struct.pack("<BI", Query.PING, i) for i in range(20000)))
    got = b""
    while len(got) < 80000:
        got += sock.recv(80000 - len(got))
    assert struct.unpack("<20000I", got) == tuple(range(20000))
    before = server.rss()
    slow = _raw(server.port)
    slow.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        for _ in range(2000):
            slow.send(struct.pack("<BQ", Query.GET, 1) + b"k")
    assert server.client().get("k") == b"x" * MiB  # answered after the slow client's asks
    assert server.rss() - before < 16 * MiB
    slow.close()


@pytest.mark.parametrize(("flag", "bounded"), [(None, True), ("1", True), ("0", False)])
def test_the_agent_hosts_the_bounded_store_unless_the_flag_is_off(
    monkeypatch: pytest.MonkeyPatch, flag: str | None, bounded: bool
) -> None:
    """By default the agent hosts the round's store with the bounded server;
    ``ELASTIC_BOUNDED_STORE=0`` hosts torch's own. torch's client works with either."""
    from elastic.rendezvous.bootstrap import BootstrapStore

    if flag is None:
        monkeypatch.delenv("ELASTIC_BOUNDED_STORE", raising=False)
    else:
        monkeypatch.setenv("ELASTIC_BOUNDED_STORE", flag)
    boot = BootstrapStore()
    port = boot.reserve("127.0.0.1")
    boot.start_round(0, "127.0.0.1", port)
    try:
        assert boot.hosting and boot.bounded == bounded
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        client.set("k", "v")
        assert client.get("k") == b"v" and client.add("n", 2) == 2
    finally:
        boot.close()


@pytest.mark.parametrize(("soft", "hard", "cap"), [(1024, 20000, 4096), (1024, 1024, 256)])
def test_the_connection_cap_raises_a_low_soft_descriptor_limit(
    soft: int, hard: int, cap: int
) -> None:
    """A soft limit of 1,024 under a higher hard one is raised, so the store still takes
    4,096 connections; under a hard limit of 1,024 it takes a quarter of it."""
    import resource

    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < hard:
        pytest.skip(f"this machine's hard descriptor limit is under {hard}")
    probe = (  # the module alone (stdlib only), as the tests' store process runs it
        "import resource, runpy, sys; cap = runpy.run_path(sys.argv[1])['connection_cap']; "
        "print(cap(4096), resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, boundstore.__file__],
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)),
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()
    assert [int(x) for x in out] == [cap, min(hard, 4 * 4096)]
