"""The workers' keys in a round's store are out of a stranger's reach when the job has a
secret (issue 38 item 2, :func:`elastic.secret.key_space`): a client without the secret
cannot name, plant or delete them. Without a secret the names are torch's plain ones (the
threat model says so: keep the job network closed)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from elastic import env, secret
from elastic.etcd.server import EtcdServer
from elastic.node import nodelocal
from elastic.worker import groups
from elastic_tools.harness.cluster import AgentOptions, LocalCluster
from tests.helpers import REPO, node_env


def _secret(tmp_path: Path, name: str, data: bytes) -> dict[str, str]:
    path = tmp_path / name
    path.write_bytes(data)
    path.chmod(0o600)
    return {env.SECRET_FILE: str(path)}


def test_no_secret_no_key_space() -> None:
    assert secret.key_space("10.0.0.1:2000", {}) is None


def test_the_key_space_is_the_jobs_and_the_rounds(tmp_path: Path) -> None:
    job = _secret(tmp_path, "a", b"x" * 32)
    same = _secret(tmp_path, "b", b"x" * 32)
    other = _secret(tmp_path, "c", b"y" * 32)
    space = secret.key_space("10.0.0.1:2000", job)
    assert space is not None and space.startswith("elastic/") and space.endswith("/")
    assert space == secret.key_space("10.0.0.1:2000", same)  # every member computes it
    assert space != secret.key_space("10.0.0.1:2001", job)  # a new round: a new space
    assert space != secret.key_space("10.0.0.1:2000", other)  # another job's secret
    assert "x" not in space.removeprefix("elastic/")  # the secret itself is not in it


@pytest.mark.integration
def test_a_stranger_cannot_reach_the_workers_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real TCPStore: a worker's client writes under the key space; a stranger's plain
    client sees none of its keys and what it plants is not what the worker reads."""
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    for name, value in _secret(tmp_path, "s", b"z" * 32).items():
        monkeypatch.setenv(name, value)
    worker = groups.client("127.0.0.1", host.port)
    peer = groups.client("127.0.0.1", host.port)
    stranger = dist.TCPStore("127.0.0.1", host.port, is_master=False, use_libuv=True)
    worker.set("rank/0", "addr-of-rank-0")
    assert peer.get("rank/0") == b"addr-of-rank-0"  # members share the space
    assert not stranger.check(["rank/0"])  # the plain name holds nothing
    stranger.set("rank/1", "planted")
    assert not peer.check(["rank/1"])  # a plant under the plain name is not seen
    assert stranger.delete_key("rank/0") is False  # nor can it delete the real one
    assert peer.get("rank/0") == b"addr-of-rank-0"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_job_with_a_secret_reforms_in_place_in_its_key_space(
    tmp_path: Path, etcd: EtcdServer, run_id: str
) -> None:
    """A user's script on ``Run`` under 3 agents sharing a job secret: every round's group
    forms under the key space; a kill -9 re-forms in place (the survivors keep their
    processes) and the job runs every step."""
    script = REPO / "tests" / "scripts" / "inplace_user.py"
    out = tmp_path / "out"
    secret_file = tmp_path / "secret"
    secret_file.write_text("the-job-secret-0123456789abcdef")
    secret_file.chmod(0o600)
    epochs, samples, batch = 12, 120, 12
    worker = [
        str(script),
        f"--epochs={epochs}",
        f"--samples={samples}",
        f"--global-batch={batch}",
        f"--out={out}",
        "--step-delay=0.05",
    ]
    cluster = LocalCluster(
        tmp_path,
        run_id,
        etcd.endpoint,
        options=AgentOptions(join_timeout=90, max_restarts=3, monitor_interval=0.3),
        env=node_env(**{env.SECRET_FILE: str(secret_file)}),
    )
    try:
        a = cluster.start("a", worker=worker)
        for name in "bc":
            cluster.start(name, worker=worker)
        cluster.wait_for(lambda: [e for e in cluster.steps() if e["world_size"] == 3], "3", 240)
        killed = time.time()
        cluster.kill_node("c")
        cluster.wait_for(lambda: cluster.first_step_after(killed, 2), "a step at world 2", 240)
        assert a.wait(600) == 0, cluster.logs()
        assert cluster.events("recovery.inplace"), "no in-place re-form"
        assert not cluster.events("recovery.fallback"), cluster.events("recovery.fallback")
        records = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
        assert len({r["pid"] for r in records}) == 3, "a survivor's worker restarted"
        steps = sorted({r["step"] for r in records})
        assert steps == list(range(epochs * samples // batch)), "a step is missing"
    finally:
        cluster.close()
        for node in cluster.nodes.values():
            nodelocal.remove_owned(node.pid)
