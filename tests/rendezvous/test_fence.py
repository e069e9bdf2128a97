"""Fenced commits against a real etcd: only the current round may publish a checkpoint."""

from __future__ import annotations

import json

import pytest

from elastic import env
from elastic.errors import CheckpointError
from elastic.etcd.client import EtcdClient
from elastic.etcd.server import EtcdServer
from elastic.rendezvous.fence import FenceSpec, RoundFence, publish_round
from elastic.rendezvous.keys import RunKeys


def spec(etcd: EtcdServer, run_id: str, round_: int) -> FenceSpec:
    return FenceSpec(endpoints=etcd.endpoint, prefix="/fence-test", run_id=run_id, round=round_)


def test_the_fence_only_moves_forward(client: EtcdClient, run_id: str) -> None:
    keys = RunKeys("/fence-test", run_id)
    for round_ in (3, 11, 7, 2):
        publish_round(client, keys, round_)
    assert client.range(keys.fence).kvs[0].value == b"000000000011"


def test_current_round_commits_and_a_stale_round_is_refused(
    etcd: EtcdServer, client: EtcdClient, run_id: str
) -> None:
    keys = RunKeys("/fence-test", run_id)
    publish_round(client, keys, 4)
    fence = RoundFence(spec(etcd, run_id, 4))
    fence(10)
    assert json.loads(client.range(keys.root + b"commits/step-10").kvs[0].value)["round"] == 4
    publish_round(client, keys, 5)  # the job re-formed without this group
    with pytest.raises(CheckpointError, match=r"round 4, but the current round in etcd is 5"):
        fence(15)
    assert not client.range(keys.root + b"commits/step-15").kvs


def test_spec_travels_through_the_environment(etcd: EtcdServer, run_id: str) -> None:
    s = spec(etcd, run_id, 9)
    assert FenceSpec.from_env({env.FENCE: s.to_env()}) == s
    assert FenceSpec.from_env({}) is None
