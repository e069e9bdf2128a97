"""The commit fence against a real etcd: durable, forward-only, the source of truth.

One test per reproduced bug: the fence vanishing with its publisher's lease, an
older round taking it back, commit records piling up, loading ignoring the
records, and the etcd password travelling in the spec.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic import env
from elastic.checkpoint import CheckpointManager, list_steps
from elastic.errors import CheckpointError
from elastic.etcd.client import EtcdClient, EtcdOptions, parse_endpoints
from elastic.etcd.server import EtcdServer
from elastic.rendezvous.fence import FenceSpec, RoundFence, publish_round
from elastic.rendezvous.keys import RunKeys
from elastic_tools.training.config import CheckpointConfig

PREFIX = "/fence-safety"
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(autouse=True)
def _private_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    for name in ("ELASTIC_SECRET_FILE", "ELASTIC_FENCE", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def keys(run_id: str) -> RunKeys:
    """This run's keys under :data:`PREFIX`."""
    return RunKeys(PREFIX, run_id)


@pytest.fixture
def url(tmp_path: Path) -> str:
    """A checkpoint directory of this test's own."""
    return str(tmp_path / "ckpt")


def _fence(etcd: EtcdServer, run_id: str, round_: int) -> RoundFence:
    return RoundFence(
        FenceSpec(endpoints=etcd.endpoint, prefix=PREFIX, run_id=run_id, round=round_)
    )


def _state(value: float) -> dict[str, Any]:
    return {"model": {"w": torch.full((8, 8), value)}, "train": {"step": int(value)}}


def _manager(url: str, fence: Any = None, keep_last: int = 3) -> CheckpointManager:
    cfg = CheckpointConfig(url=url, interval=1, keep_last=keep_last)
    return CheckpointManager(cfg, "ckpt-run", commit_fence=fence)


def _commit(manager: CheckpointManager, *steps: int) -> None:
    for step in steps:
        outcome = manager.save(step, _state(float(step)), block=True)
        assert outcome is not None and outcome.ok, outcome


def test_the_fence_does_not_live_on_its_publishers_lease(
    etcd: EtcdServer, client: EtcdClient, run_id: str, keys: RunKeys
) -> None:
    lease = client.grant(60)
    publish_round(client, keys, 5, lease)
    assert client.range(keys.fence).kvs[0].lease == 0  # survives the agent's lease
    _fence(etcd, run_id, 5)(10)


def test_a_missing_fence_is_republished_by_the_current_round_only(
    etcd: EtcdServer, client: EtcdClient, run_id: str, keys: RunKeys
) -> None:
    publish_round(client, keys, 5)
    client.delete(keys.fence)  # e.g. it was on an expired lease, or deleted by hand
    with pytest.raises(CheckpointError, match=r"round 3, but the current round in etcd is None"):
        _fence(etcd, run_id, 3)(10)
    publish_round(client, keys, 3)  # a stale agent cannot take the fence back
    assert not client.range(keys.fence).kvs
    _fence(etcd, run_id, 5)(10)  # the current round puts it back and commits
    assert client.range(keys.fence).kvs[0].value == b"000000000005"
    assert json.loads(client.range(keys.root + b"commits/step-10").kvs[0].value)["round"] == 5


def test_commit_records_carry_the_marker_digest_and_purged_ones_go(
    etcd: EtcdServer, client: EtcdClient, run_id: str, keys: RunKeys, url: str
) -> None:
    publish_round(client, keys, 2)
    _commit(_manager(url, _fence(etcd, run_id, 2), keep_last=2), 1, 2, 3, 4)
    records = _fence(etcd, run_id, 2).records()
    assert sorted(records) == [3, 4]
    assert records[4]["round"] == 2 and records[4]["run"] == "ckpt-run"
    assert len(records[4]["digest"]) == 64


def test_a_stale_round_writes_nothing_and_purges_nothing(
    etcd: EtcdServer, client: EtcdClient, run_id: str, keys: RunKeys, url: str
) -> None:
    publish_round(client, keys, 7)
    stale = _manager(url, _fence(etcd, run_id, 7), keep_last=1)
    _commit(stale, 40)
    publish_round(client, keys, 8)
    _commit(_manager(url, _fence(etcd, run_id, 8), keep_last=3), 50, 60)
    outcome = stale.save(70, _state(70.0), block=True)
    assert outcome is not None and not outcome.ok and "no longer the job" in outcome.error
    assert list_steps(url, "ckpt-run") == [60, 50, 40]
    assert not (Path(url) / "ckpt-run" / "step-70").exists()


def test_loading_prefers_what_the_commit_records_vouch_for(
    etcd: EtcdServer, client: EtcdClient, run_id: str, keys: RunKeys, url: str
) -> None:
    publish_round(client, keys, 3)
    _commit(_manager(url, _fence(etcd, run_id, 3)), 10, 20)
    _commit(_manager(url), 30)  # an unfenced writer in the same directory
    loaded = _manager(url, _fence(etcd, run_id, 3)).load_latest(lambda: _state(0.0))
    assert loaded is not None and loaded[0] == 20


def test_the_spec_and_the_environment_never_hold_the_password(
    etcd: EtcdServer, run_id: str
) -> None:
    endpoints = parse_endpoints(etcd.endpoint)[0]
    options = EtcdOptions(endpoints, user="root", password="hunter2-secret")
    spec = FenceSpec.for_run(options, RunKeys(PREFIX, run_id), 4)
    assert "hunter2" not in repr(spec) and "hunter2" not in spec.to_env()
    assert spec.password_file is not None
    path = Path(spec.password_file)
    # A sealed memory file of this process (gone with it, even after a kill -9), 0600.
    assert str(path).startswith(f"/proc/{os.getpid()}/fd/"), path
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert path.read_text() == "hunter2-secret"
    assert FenceSpec.for_run(options, RunKeys(PREFIX, run_id), 5).password_file == str(path)
    back = FenceSpec.from_env({env.FENCE: spec.to_env()})
    assert back == spec
    fence = RoundFence(back)
    assert fence._client.options.password == "hunter2-secret"
    assert "hunter2" not in repr(fence.spec)
    legacy = FenceSpec(etcd.endpoint, PREFIX, run_id, 4, user="root", password="hunter2-secret")
    assert "hunter2" not in repr(legacy) and legacy.password_file == str(path)
    assert os.environ.get(env.FENCE) is None
