"""The rendezvous state in etcd is untrusted input: nothing is unpickled unauthenticated."""

from __future__ import annotations

import os
import pickle
from datetime import datetime, timezone
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from elastic.errors import EtcdStateError
from elastic.etcd.client import EtcdClient
from elastic.rendezvous.backend import EtcdRendezvousBackend, encode_state
from elastic.rendezvous.keys import RunKeys
from elastic.rendezvous.lease import RunLease
from elastic_tools.status import rendezvous_status

SECRET = b"a-job-secret-of-enough-length-000"


class _Payload:
    """Unpickling this runs a command: what a forged state would carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def backend(client: EtcdClient, run_id: str, secret: bytes | None) -> EtcdRendezvousBackend:
    keys = RunKeys("/elastic", run_id)
    return EtcdRendezvousBackend(client, keys, RunLease(client, 60), secret)


def test_a_signed_state_round_trips_and_an_unsigned_or_forged_one_is_refused(
    client: EtcdClient, run_id: str, tmp_path: Path
) -> None:
    signed = backend(client, run_id, SECRET)
    signed.set_state(pickle.dumps(_RendezvousState()))
    state, _ = signed.get_state()  # type: ignore[misc]
    assert isinstance(pickle.loads(state), _RendezvousState)

    marker = tmp_path / "pwned"
    forged = pickle.dumps(_Payload(marker))
    key = RunKeys("/elastic", run_id).state
    for blob in (encode_state(forged), encode_state(forged, b"another-secret")):
        client.put(key, blob)
        with pytest.raises(EtcdStateError, match="not signed with this job's secret"):
            signed.get_state()
    with pytest.raises(EtcdStateError, match="is signed, but this process has no secret"):
        backend(client, run_id, None).get_state()
    assert not marker.exists()


def test_status_never_runs_code_from_etcd(client: EtcdClient, run_id: str, tmp_path: Path) -> None:
    keys = RunKeys("/elastic", run_id)
    state = _RendezvousState()
    node = _NodeDesc("host", 7, 0)
    state.participants[node] = 0
    state.last_heartbeats[node] = datetime.now(timezone.utc)
    state.complete = True
    client.put(keys.state, encode_state(pickle.dumps(state), SECRET))
    shown = rendezvous_status(client, keys, SECRET)
    assert shown["world_size"] == 1 and shown["members"][0]["node"] == str(node)
    assert rendezvous_status(client, keys)["decoded"] is False, "decoded without the secret"

    marker = tmp_path / "pwned"
    client.put(keys.state, encode_state(pickle.dumps(_Payload(marker))))  # a valid CRC
    assert rendezvous_status(client, keys)["decoded"] is False
    with pytest.raises(EtcdStateError, match="not signed with this job's secret"):
        rendezvous_status(client, keys, SECRET)
    client.put(keys.state, encode_state(pickle.dumps(_Payload(marker)), SECRET))
    with pytest.raises(EtcdStateError, match="cannot be decoded"):
        rendezvous_status(client, keys, SECRET)
    assert not marker.exists(), "status unpickled a forged state"
