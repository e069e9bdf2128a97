"""Fenced checkpoint commits: only the current rendezvous round may publish a checkpoint.

Each completed round is published at ``<prefix>/<run_id>/fence`` (zero-padded,
so etcd's byte-wise comparison is numeric, and it only moves forward). Before
rank 0 writes a checkpoint's commit marker it runs :class:`RoundFence`: one
transaction that *compares* the fence with the writers' round and, only if it
still matches, *records* the commit at ``<prefix>/<run_id>/commits/step-N``.
A group that split off (its round is no longer the current one) is refused and
never publishes a checkpoint. The agent hands the worker what it needs through
``$ELASTIC_FENCE`` (JSON).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from typing import Any

from elastic import env
from elastic.errors import CheckpointError
from elastic.etcd.client import (
    EtcdClient,
    EtcdOptions,
    compare_absent,
    compare_value,
    op_get,
    op_put,
    parse_endpoints,
)
from elastic.rendezvous.keys import RunKeys

logger = logging.getLogger(__name__)


def _round_bytes(round_: int) -> bytes:
    return f"{round_:012d}".encode()


def publish_round(client: EtcdClient, keys: RunKeys, round_: int, lease: int = 0) -> None:
    """Advance the fence to ``round_`` (never backwards)."""
    from etcd3 import etcdrpc

    value = _round_bytes(round_)
    put = op_put(keys.fence, value, lease)
    if client.txn([compare_absent(keys.fence)], [put], []).succeeded:
        return
    older = etcdrpc.Compare(
        key=keys.fence, result=etcdrpc.Compare.LESS, target=etcdrpc.Compare.VALUE, value=value
    )
    client.txn([older], [put], [])


@dataclass(frozen=True)
class FenceSpec:
    """What a worker needs to check the fence (passed as JSON in ``$ELASTIC_FENCE``)."""

    endpoints: str
    prefix: str
    run_id: str
    round: int
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = None
    tls: bool = False

    @classmethod
    def for_run(cls, options: EtcdOptions, keys: RunKeys, round_: int) -> FenceSpec:
        """The spec for the workers of ``round_`` of the run at ``keys``."""
        o = options
        return cls(
            endpoints=",".join(str(e) for e in o.endpoints),
            prefix=keys.prefix,
            run_id=keys.run_id,
            round=round_,
            cacert=o.ca_cert,
            cert=o.cert,
            key=o.key,
            user=o.user,
            password=o.password,
            tls=o.tls,
        )

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> FenceSpec | None:
        raw = (environ if environ is not None else os.environ).get(env.FENCE)
        return cls(**json.loads(raw)) if raw else None


class RoundFence:
    """The commit fence for one round: raises ``CheckpointError`` once the round is stale."""

    def __init__(self, spec: FenceSpec) -> None:
        self.spec = spec
        endpoints, https = parse_endpoints(spec.endpoints)
        self._client = EtcdClient(
            EtcdOptions(
                endpoints,
                tls=spec.tls or https,
                ca_cert=spec.cacert,
                cert=spec.cert,
                key=spec.key,
                user=spec.user,
                password=spec.password,
            )
        )
        self._keys = RunKeys(spec.prefix, spec.run_id)

    def __call__(self, step: int) -> None:
        record = op_put(
            self._keys.root + f"commits/step-{step}".encode(), str(self.spec.round).encode()
        )
        response = self._client.txn(
            [compare_value(self._keys.fence, _round_bytes(self.spec.round))],
            [record],
            [op_get(self._keys.fence)],
        )
        if response.succeeded:
            return
        kvs: Any = response.responses[0].response_range.kvs
        current = int(kvs[0].value) if kvs else None
        raise CheckpointError(
            f"Refusing to commit step {step}: it was written by rendezvous round "
            f"{self.spec.round}, but the current round in etcd is {current}; this group "
            "is no longer the job."
        )


__all__ = ["FenceSpec", "RoundFence", "publish_round"]
