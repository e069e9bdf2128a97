"""torch's own generic c10d Store cases, run against ``EtcdStore`` on a real etcd.

Ported from pytorch/pytorch ``test/distributed/test_store.py`` (read, not vendored): every case
of the ``StoreTestBase`` mixin, ``PythonStoreTest.test_set_get`` (``dist._test_python_store``,
which drives the store from C++ through the pybind trampoline), ``TestMultiThreadedWait``'s
wait, ``TCPStoreTest._test_numkeys_delkeys`` and ``RendezvousTCPTest.
test_tcp_store_timeout_doest_break_client``. Each runs twice, as upstream runs its stores:
on the store itself (like ``HashStoreTest``) and under ``dist.PrefixStore`` (like
``PrefixTCPStoreTest``). Where a case had to change, its docstring says how and why.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from elastic.etcd.client import EtcdClient
from elastic.rendezvous.keys import RunKeys
from elastic.rendezvous.lease import RunLease
from elastic.rendezvous.store import EtcdStore

PREFIX = "test_prefix"

# Upstream's num_keys_total: the 5 keys of test_set_get_check. Its Prefix{File,TCP}Store cases
# say 6 because FileStore and TCPStore hold one key of their own; an EtcdStore holds none.
NUM_KEYS_TOTAL = 5


@pytest.fixture(params=["etcd", "prefix"])
def store(request: pytest.FixtureRequest, client: EtcdClient, run_id: str) -> Iterator[dist.Store]:
    """An EtcdStore with upstream's 300 s timeout, bare or under PrefixStore("test_prefix").

    The fixture keeps the EtcdStore referenced: PrefixStore holds only its C++ half.
    """
    etcd_store = EtcdStore(
        client, RunKeys("/elastic-test", run_id), RunLease(client, 60), timedelta(seconds=300)
    )
    yield etcd_store if request.param == "etcd" else dist.PrefixStore(PREFIX, etcd_store)
    del etcd_store


def test_set_get_check(store: dist.Store) -> None:
    """``StoreTestBase.test_set_get_check``."""
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
    assert store.num_keys() == NUM_KEYS_TOTAL
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
    assert store.num_keys() == NUM_KEYS_TOTAL


def test_compare_set(store: dist.Store) -> None:
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


def test_simple_wait(store: dist.Store) -> None:
    """``StoreTestBase.test_simple_wait``: upstream's regex ``[t -i]imeout`` unchanged."""
    with pytest.raises(RuntimeError, match=r"[t -i]imeout"):
        store.wait(["bad_key"], timedelta(seconds=0.25))
    store.add("good_key", 1)
    store.wait(["good_key"])


def test_append(store: Any) -> None:  # torch's stub Store lacks these
    """``StoreTestBase.test_append``.

    Upstream skips it for a store without the extended API; an EtcdStore has it
    (``has_extended_api()`` is True, checked here, also through ``PrefixStore``), its
    ``append`` being torch's C++ ``compare_set`` loop.
    """
    assert store.has_extended_api() is True
    store.set("foo", "po")
    store.append("foo", "tato")
    store.append("bar", "po")
    store.append("bar", "tato")
    assert store.get("foo") == b"potato"
    assert store.get("bar") == b"potato"


def test_multi_set(store: Any) -> None:  # torch's stub Store lacks these
    """``StoreTestBase.test_multi_set``; through PrefixStore it is C++ calling ours."""
    assert store.has_extended_api() is True
    store.multi_set(["foo", "bar"], ["po", "tato"])
    assert store.get("foo") == b"po"
    assert store.get("bar") == b"tato"


def test_multi_get(store: Any) -> None:  # torch's stub Store lacks these
    """``StoreTestBase.test_multi_get``; through PrefixStore it is C++ calling ours."""
    assert store.has_extended_api() is True
    store.set("foo", "po")
    store.set("bar", "tato")
    v0, v1 = store.multi_get(["foo", "bar"])
    assert v0 == b"po"
    assert v1 == b"tato"


def test_queues_are_not_supported(store: dist.Store) -> None:
    """``StoreTestBase.test_queues*``: upstream skips them when ``queue_push`` raises
    ``NotImplementedError`` (``_create_store_or_skip_if_no_queues``); it does here."""
    with pytest.raises(NotImplementedError):
        store.queue_push("test_queue_support", "1")


def test_clone(store: dist.Store) -> None:
    """``StoreTestBase.test_clone``."""
    b = store.clone()
    assert isinstance(b, dist.Store)
    store.set("foo", "bar")
    assert b.get("foo") == b"bar"


def test_python_store_from_cpp(store: dist.Store) -> None:
    """``PythonStoreTest.test_set_get``: ``dist._test_python_store`` runs set/get/add (and, in
    torch 2.14, clone) from C++ through the trampoline, raising on any wrong answer."""
    dist._test_python_store(store)
    assert store.get("key") == b"6"  # what the C++ side added up, seen from Python


def test_wait_from_two_threads(store: dist.Store) -> None:
    """``TestMultiThreadedWait._test_wait``: rank 0 waits for a key rank 1 sets.

    Upstream runs both ranks as threads of a ``MultiThreadedTestCase`` on one shared store;
    here two threads, each on its own ``clone()`` (torch's advice for a store used from
    several threads).
    """
    store.set_timeout(timedelta(seconds=2))
    errors: list[BaseException] = []
    got: list[bytes] = []

    def rank(r: int) -> None:
        local = store.clone()
        try:
            if r == 0:
                local.wait(["key1"])
                got.append(local.get("key1"))
            else:
                local.set("key1", "value1")
        except BaseException as exc:  # reported below, on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert got == [b"value1"]


def test_numkeys_delkeys(store: dist.Store) -> None:
    """``TCPStoreTest._test_numkeys_delkeys``, every count one lower: a TCPStore starts with
    one key of its own, an EtcdStore with none."""
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
    store.set_timeout(timedelta(seconds=2))
    with pytest.raises(RuntimeError):
        store.get("key")
    store.delete_key("key0")
    store.delete_key("key3")
    assert store.num_keys() == 1
    store.set("key4", "value2")
    assert store.num_keys() == 2
    assert store.get("key1") == b"value1"
    assert store.get("key4") == b"value2"


def test_store_timeout_doesnt_break_client(store: dist.Store) -> None:
    """``RendezvousTCPTest.test_tcp_store_timeout_doest_break_client``: a get that timed out
    leaves the store usable. Upstream matches TCPStore's own wording ("wait timeout after
    100ms, keys: /the_key"); ours names the timeout and the key in its own words."""
    store.set_timeout(timedelta(seconds=0.1))
    with pytest.raises(dist.DistStoreError, match=r"timeout after 0\.1 s: the key '.*the_key'"):
        store.get("the_key")
    store.set("the_key", "x")
    assert store.get("the_key") == b"x"
