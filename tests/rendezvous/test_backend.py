"""The RendezvousBackend contract against a real etcd (torch's contract tests, v3 edition)."""

from __future__ import annotations

import itertools
import threading
from collections import Counter

import pytest

from elastic.errors import EtcdStateError
from elastic.etcd.client import EtcdClient
from elastic.rendezvous.backend import EtcdRendezvousBackend
from elastic.rendezvous.keys import RunKeys
from elastic.rendezvous.lease import RunLease


@pytest.fixture
def keys(run_id: str) -> RunKeys:
    return RunKeys("/elastic-test", run_id)


@pytest.fixture
def backend(client: EtcdClient, keys: RunKeys) -> EtcdRendezvousBackend:
    return EtcdRendezvousBackend(client, keys, RunLease(client, ttl=60))


def test_name(backend: EtcdRendezvousBackend) -> None:
    assert backend.name == "etcd-v3"


def test_get_state_returns_none_when_absent(backend: EtcdRendezvousBackend) -> None:
    assert backend.get_state() is None


def test_none_token_creates_only_if_absent(backend: EtcdRendezvousBackend) -> None:
    state, token, ok = backend.set_state(b"a")  # type: ignore[misc]
    assert (state, ok) == (b"a", True)
    assert backend.get_state() == (b"a", token)
    lost = backend.set_state(b"b")
    assert lost == (b"a", token, False)


def test_matching_token_writes_and_advances(backend: EtcdRendezvousBackend) -> None:
    _, t1, _ = backend.set_state(b"a")  # type: ignore[misc]
    state, t2, ok = backend.set_state(b"b", t1)  # type: ignore[misc]
    assert (state, ok) == (b"b", True) and t2 > t1
    assert backend.get_state() == (b"b", t2)


def test_stale_token_returns_current_state(backend: EtcdRendezvousBackend) -> None:
    _, t1, _ = backend.set_state(b"a")  # type: ignore[misc]
    _, t2, _ = backend.set_state(b"b", t1)  # type: ignore[misc]
    assert backend.set_state(b"c", t1) == (b"b", t2, False)


@pytest.mark.parametrize("token", ["invalid", object(), 3.5j, True])
def test_invalid_token_returns_current_state(backend: EtcdRendezvousBackend, token: object) -> None:
    _, t1, _ = backend.set_state(b"a")  # type: ignore[misc]
    assert backend.set_state(b"x", token) == (b"a", t1, False)


def test_token_on_missing_state_returns_none(backend: EtcdRendezvousBackend) -> None:
    assert backend.set_state(b"x", 12345) is None
    assert backend.get_state() is None


def test_corrupt_state_raises_state_error(
    backend: EtcdRendezvousBackend, client: EtcdClient, keys: RunKeys
) -> None:
    client.put(keys.state, b"\x00not a framed state")
    with pytest.raises(EtcdStateError, match="is corrupt; stop the run's agents"):
        backend.get_state()
    from torch.distributed.elastic.rendezvous import RendezvousStateError

    with pytest.raises(RendezvousStateError):
        backend.set_state(b"x", 1)


def test_state_carries_a_lease_with_the_ttl(
    backend: EtcdRendezvousBackend, client: EtcdClient, keys: RunKeys
) -> None:
    backend.set_state(b"a")
    lease = client.range(keys.state).kvs[0].lease
    assert lease != 0
    from etcd3 import etcdrpc

    ttl = client.call(
        lambda c, t: c.lease.LeaseTimeToLive(etcdrpc.LeaseTimeToLiveRequest(ID=lease), timeout=t)
    )
    assert 50 < ttl.TTL <= 60


def test_abandoned_state_expires(client: EtcdClient, keys: RunKeys) -> None:
    import time

    backend = EtcdRendezvousBackend(client, keys, RunLease(client, ttl=1))
    backend.set_state(b"a")
    deadline = time.monotonic() + 10
    while backend.get_state() is not None:
        assert time.monotonic() < deadline, "state with a 1 s TTL did not expire"
        time.sleep(0.2)


def test_racing_threads_have_exactly_one_winner_per_token(
    client: EtcdClient, keys: RunKeys
) -> None:
    lease = RunLease(client, ttl=60)
    backends = [EtcdRendezvousBackend(client, keys, lease) for _ in range(8)]
    _, token, _ = backends[0].set_state(b"start")  # type: ignore[misc]
    wins: Counter[int] = Counter()
    chain: list[tuple[int, int]] = []
    rounds = 20
    lock = threading.Lock()
    barrier = threading.Barrier(len(backends))

    def race(i: int) -> None:
        for _ in range(rounds):
            barrier.wait()
            current = backends[i].get_state()
            assert current is not None
            result = backends[i].set_state(f"{i}".encode(), current[1])
            assert result is not None
            if result[2]:
                with lock:
                    wins[current[1]] += 1
                    chain.append((current[1], result[1]))
            barrier.wait()

    threads = [threading.Thread(target=race, args=(i,)) for i in range(len(backends))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(wins.values()) == {1}, f"a token had more than one winner: {wins}"
    assert len(wins) >= rounds, "every round must have a winner"
    # The wins form one linear history: each starts from the token the previous one made.
    chain.sort()
    assert chain[0][0] == token
    assert all(new == nxt for (_, new), (nxt, _) in itertools.pairwise(chain))
    assert backends[0].get_state()[1] == chain[-1][1]  # type: ignore[index]
