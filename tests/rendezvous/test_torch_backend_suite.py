"""torch's ``RendezvousBackendTestMixin`` against ``EtcdRendezvousBackend`` on a real etcd.

Ported from pytorch/pytorch ``test/distributed/elastic/rendezvous/rendezvous_backend_test.py``
(read, not vendored): each ``test_*`` of the mixin, in its order and with its assertions, as a
pytest function. ``_corrupt_state`` follows that file's etcd sibling
(``etcd_rendezvous_backend_test.py`` writes a value its backend cannot decode): here a value
without our frame. Every case runs on the plain backend (CRC-32 frame) and on one that signs
the state with a job secret (HMAC), the two ways the agents run it.
"""

from __future__ import annotations

from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import Token

from elastic.etcd.client import EtcdClient
from elastic.rendezvous.backend import EtcdRendezvousBackend
from elastic.rendezvous.keys import RunKeys
from elastic.rendezvous.lease import RunLease


@pytest.fixture
def keys(run_id: str) -> RunKeys:
    return RunKeys("/elastic-test", run_id)


@pytest.fixture(params=[None, b"job-secret-for-the-suite"], ids=["crc", "signed"])
def backend(
    request: pytest.FixtureRequest, client: EtcdClient, keys: RunKeys
) -> EtcdRendezvousBackend:
    return EtcdRendezvousBackend(client, keys, RunLease(client, ttl=60), secret=request.param)


def _corrupt_state(client: EtcdClient, keys: RunKeys) -> None:
    """Upstream's abstract ``_corrupt_state``: a state value the backend cannot decode."""
    client.put(keys.state, b"non_base64")


def _set_state(
    backend: EtcdRendezvousBackend, state: bytes, token: Any | None = None
) -> tuple[bytes, Token, bool]:
    """Upstream's ``_set_state``: ``set_state`` must not return None here."""
    result = backend.set_state(state, token)
    assert result is not None
    return result


def test_get_state_returns_backend_state(backend: EtcdRendezvousBackend) -> None:
    backend.set_state(b"x")
    result = backend.get_state()
    assert result is not None
    state, token = result
    assert state == b"x"
    assert token is not None


def test_get_state_returns_none_if_backend_state_does_not_exist(
    backend: EtcdRendezvousBackend,
) -> None:
    assert backend.get_state() is None


def test_get_state_raises_error_if_backend_state_is_corrupt(
    backend: EtcdRendezvousBackend, client: EtcdClient, keys: RunKeys
) -> None:
    _corrupt_state(client, keys)
    with pytest.raises(RendezvousStateError):
        backend.get_state()


def test_set_state_sets_backend_state_if_it_does_not_exist(
    backend: EtcdRendezvousBackend,
) -> None:
    state, token, has_set = _set_state(backend, b"x")
    assert state == b"x"
    assert token is not None
    assert has_set


def test_set_state_sets_backend_state_if_token_is_current(
    backend: EtcdRendezvousBackend,
) -> None:
    _, token1, has_set1 = _set_state(backend, b"x")
    state2, token2, has_set2 = _set_state(backend, b"y", token1)
    assert state2 == b"y"
    assert token1 != token2
    assert has_set1
    assert has_set2


def test_set_state_returns_current_backend_state_if_token_is_old(
    backend: EtcdRendezvousBackend,
) -> None:
    _, token1, _ = _set_state(backend, b"x")
    state2, token2, _ = _set_state(backend, b"y", token1)
    state3, token3, has_set = _set_state(backend, b"z", token1)
    assert state2 == state3
    assert token2 == token3
    assert not has_set


def test_set_state_returns_current_backend_state_if_token_is_none(
    backend: EtcdRendezvousBackend,
) -> None:
    state1, token1, _ = _set_state(backend, b"x")
    state2, token2, has_set = _set_state(backend, b"y")
    assert state1 == state2
    assert token1 == token2
    assert not has_set


def test_set_state_returns_current_backend_state_if_token_is_invalid(
    backend: EtcdRendezvousBackend,
) -> None:
    state1, token1, _ = _set_state(backend, b"x")
    state2, token2, has_set = _set_state(backend, b"y", token="invalid")
    assert state1 == state2
    assert token1 == token2
    assert not has_set
