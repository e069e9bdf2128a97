"""``RendezvousBackend`` on etcd v3: storage only, compare-and-set on a token.

Everything else a run keeps in etcd (fence, restart ledger, probe ports, the change
watch) is in :mod:`elastic.rendezvous.ledger`.

The token is the state key's ``mod_revision``. ``set_state`` is one etcd
transaction: *if* the key was last modified at ``token`` (or, for a ``None``
token, does not exist) *then* put the new state *else* read the current one.
A lost race therefore costs one round trip and returns what the winner wrote.
After a lost race the caller backs off for a short random time (growing with
consecutive losses, capped at 50 ms): every attempt is a raft write, and
without it a crowd of joining nodes feeds its own retries.
"""

from __future__ import annotations

import hashlib
import hmac
import random
import struct
import time
import zlib
from typing import Any

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from elastic import env
from elastic.errors import EtcdStateError
from elastic.etcd.client import EtcdClient, compare_absent, compare_mod, op_get, op_put
from elastic.rendezvous.keys import RunKeys
from elastic.rendezvous.lease import RunLease
from elastic.rendezvous.ledger import as_revision

_MAGIC = b"EV3\x01"  # CRC-32 framing: detects corruption, not tampering
_MAGIC_SIGNED = b"EV3\x02"  # HMAC-SHA256 under the job's secret
_HEADER = struct.Struct(">4sI")  # magic, crc32 of the payload
_MAC_BYTES = 32
_DOMAIN = b"elastic-rdzv-state-v1\0"
_BACKOFF_BASE_S = 0.002
_BACKOFF_CAP_S = 0.05


def _mac(secret: bytes, state: bytes) -> bytes:
    return hmac.new(secret, _DOMAIN + state, hashlib.sha256).digest()


def encode_state(state: bytes, secret: bytes | None = None) -> bytes:
    """Frame the state: signed (HMAC) with the job's secret, else with a CRC-32."""
    if secret:
        return _MAGIC_SIGNED + _mac(secret, state) + state
    return _HEADER.pack(_MAGIC, zlib.crc32(state)) + state


def decode_state(blob: bytes, key: bytes, secret: bytes | None = None) -> bytes:
    """Undo :func:`encode_state`; raise ``EtcdStateError`` naming the key on any mismatch.

    With a secret, only a state signed with it is returned (torch unpickles what this
    returns, so an unsigned or forged state never reaches pickle).
    """
    name = key.decode()
    magic = blob[:4]
    if secret:
        mac, payload = blob[4 : 4 + _MAC_BYTES], blob[4 + _MAC_BYTES :]
        if magic == _MAGIC_SIGNED and hmac.compare_digest(mac, _mac(secret, payload)):
            return payload
        raise EtcdStateError(
            f"The rendezvous state at etcd key '{name}' is not signed with this job's secret "
            f"(forged, or written by an agent with another ${env.SECRET_FILE}); give every "
            "agent the same secret file, or delete the key to start afresh."
        )
    if magic == _MAGIC_SIGNED:
        raise EtcdStateError(
            f"The rendezvous state at etcd key '{name}' is signed, but this process has no "
            f"secret; set ${env.SECRET_FILE} to the job's secret file."
        )
    if len(blob) >= _HEADER.size:
        magic, crc = _HEADER.unpack_from(blob)
        payload = blob[_HEADER.size :]
        if magic == _MAGIC and zlib.crc32(payload) == crc:
            return payload
    raise EtcdStateError(
        f"The rendezvous state at etcd key '{name}' is corrupt; stop the run's agents "
        f"and delete the key (etcdctl del {name}) to start the rendezvous afresh."
    )


class EtcdRendezvousBackend(RendezvousBackend):
    """Holds a run's rendezvous state in one etcd v3 key.

    Args:
        client: the etcd client.
        keys: the run's key layout.
        lease: the lease attached to every write (keys of an abandoned run expire).
        secret: the job's secret; the state is then signed and only a signed one is read.
    """

    def __init__(
        self, client: EtcdClient, keys: RunKeys, lease: RunLease, secret: bytes | None = None
    ) -> None:
        self._secret = secret
        self._client = client
        self._keys = keys
        self._key = keys.state
        self._lease = lease
        self._losses = 0

    @property
    def name(self) -> str:
        """See base class."""
        return "etcd-v3"

    def get_state(self) -> tuple[bytes, Token] | None:
        """See base class."""
        kvs = self._client.range(self._key).kvs
        if not kvs:
            return None
        return decode_state(kvs[0].value, self._key, self._secret), kvs[0].mod_revision

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        """See base class."""
        if token is None:
            compare = compare_absent(self._key)
        else:
            revision = as_revision(token)
            if revision is None:
                return self._current()
            compare = compare_mod(self._key, revision)
        put = op_put(self._key, encode_state(state, self._secret), self._lease.id())
        response = self._client.txn([compare], [put], [op_get(self._key)])
        if response.succeeded:
            self._losses = 0
            return state, response.header.revision, True
        self._losses += 1
        time.sleep(random.uniform(0, min(_BACKOFF_CAP_S, _BACKOFF_BASE_S * 2**self._losses)))
        return self._from_range(response.responses[0].response_range.kvs)

    def _current(self) -> tuple[bytes, Token, bool] | None:
        return self._from_range(self._client.range(self._key).kvs)

    def _from_range(self, kvs: Any) -> tuple[bytes, Token, bool] | None:
        if not kvs:
            return None
        return decode_state(kvs[0].value, self._key, self._secret), kvs[0].mod_revision, False


__all__ = ["EtcdRendezvousBackend", "decode_state", "encode_state"]
