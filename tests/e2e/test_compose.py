"""docker-compose.yml for real: etcd + agents in containers, nodes added, killed and stopped.

Scenario: up with 2 agents and the ``monitoring`` profile (Prometheus); scale to 3; ``docker
kill`` one (SIGKILL: a crash); ``docker stop`` another (SIGTERM: a planned leave with a
checkpoint); the last one finishes the job. From the events and checkpoints on the shared
(bind-mounted) volume: the job finished, every step ran, and every checkpoint a worker loaded
was a complete one. From Prometheus: the agents' world-size metric followed 2 -> 3 -> 2 -> 1.
No secret shows in `docker inspect` of the agents or in their logs.

The same with checkpoints on S3 (profile ``s3``, a moto server), and the lock-down while agents
train: etcd refuses requests without a login (and plain http), the agents run as a non-root
user, and no secret leaks (``test_locked_down``).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import urllib.request

import pytest

from elastic import events
from elastic.checkpoint import find_latest_complete
from elastic.checkpoint.layout import inspect_step
from elastic.etcd.server import free_port
from tests.e2e.conftest import AGENT_UID, ETCD_USER, Cluster, run, wait_until
from tests.helpers import REPO

pytestmark = [pytest.mark.compose, pytest.mark.slow]

# Paced at MIN_STEP_S, so that the job outlasts the scenario however fast recoveries and
# this host are (unpaced, a quiet host ran 1,200 steps before the planned leave).
MAX_STEPS = int(os.environ.get("ELASTIC_E2E_MAX_STEPS", "3000"))
# A small CNN, so the scenario takes a few minutes on 2 shared CPU cores. Batch 48 splits
# evenly over 1, 2 and 3 nodes of micro-batch 8.
TINY = {
    "ELASTIC_MODEL__NAME": "tiny_cnn",
    "ELASTIC_DATA__IMAGE_SIZE": 16,
    "ELASTIC_DATA__NUM_SAMPLES": 4800,
    "ELASTIC_DATA__GLOBAL_BATCH_SIZE": 48,
    "ELASTIC_DATA__MICRO_BATCH_SIZE": 8,
    "ELASTIC_OPTIMIZER__WARMUP_STEPS": 10,
    "ELASTIC_JOB__MAX_STEPS": MAX_STEPS,
    "ELASTIC_JOB__LOG_EVERY": 25,
    "ELASTIC_JOB__PROGRESS_BAR": "false",
    "ELASTIC_JOB__MIN_STEP_S": 0.05,  # configs/compose.yaml paces steps slower, for humans
    "ELASTIC_CHECKPOINT__INTERVAL": 20,
    # Keep every step so that the test can inspect each checkpoint a worker loaded.
    "ELASTIC_CHECKPOINT__KEEP_LAST": 1000,
}


def assert_locked_down(cluster: Cluster, agents: list[str], service: str = "agent") -> None:
    """etcd refuses whoever has not logged in, the agents run as a non-root user, and no
    secret shows in `docker inspect` or the logs of the agents (nor of etcd-init)."""
    import grpc

    from elastic.errors import EtcdConnectionError

    # etcdctl in the etcd container, with a valid client certificate but no user: refused.
    anonymous = cluster.compose(
        "exec",
        "-T",
        "etcd",
        "/usr/local/bin/etcdctl",
        "--endpoints=https://127.0.0.1:2379",
        "--cacert=/run/secrets/etcd-ca",
        "--cert=/run/secrets/etcd-server-cert",
        "--key=/run/secrets/etcd-server-key",
        "get",
        "--prefix",
        "/elastic/",
        check=False,
        timeout=60,
    )
    assert anonymous.returncode != 0 and "permission denied" in anonymous.stderr, anonymous
    assert "/elastic/" not in anonymous.stdout
    # etcdctl without TLS (plain http to the TLS port): no answer at all.
    plain = cluster.compose(
        "exec",
        "-T",
        "etcd",
        "/usr/local/bin/etcdctl",
        "--endpoints=http://127.0.0.1:2379",
        "--command-timeout=3s",
        "get",
        "/",
        check=False,
        timeout=60,
    )
    assert plain.returncode != 0, plain
    # From the host: no login, a wrong password, and another user's key space are refused;
    # the agents' user reads its run's keys.
    with cluster.etcd_client() as anonymous_client:
        with pytest.raises(grpc.RpcError) as refused:
            anonymous_client.range(b"/elastic/", prefix=True)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value
    with (
        cluster.etcd_client(ETCD_USER, "not-the-password") as wrong,
        pytest.raises(EtcdConnectionError, match="refused the login"),
    ):
        wrong.range(b"/elastic/", prefix=True)
    with cluster.etcd_client(ETCD_USER, cluster.secret("etcd-password")) as agent_user:
        assert agent_user.range(b"/elastic/", prefix=True).count > 0
        with pytest.raises(grpc.RpcError) as outside:
            agent_user.put(b"/not-elastic", b"x")
        assert outside.value.code() == grpc.StatusCode.PERMISSION_DENIED, outside.value

    # The agents run as the image's unprivileged user: the exec'd shell and PID 1 (the agent).
    uids = cluster.compose(
        "exec", "-T", service, "sh", "-c", "id -u; awk '/^Uid:/ {print $2}' /proc/1/status"
    ).stdout.split()
    assert uids == [str(AGENT_UID)] * 2, uids
    for container in agents:
        assert cluster.inspect(container)["Config"]["User"] == f"{AGENT_UID}:{AGENT_UID}"
        assert cluster.inspect(container)["HostConfig"]["ShmSize"] >= 1 << 30
        cluster.assert_no_secret_in(container)
    for container in cluster.compose("ps", "-a", "-q", "etcd-init").stdout.split():
        cluster.assert_no_secret_in(container)


def step_at_world(cluster: Cluster, after: float, world: int, timeout: float = 180) -> dict:
    """The first train.step after ``after`` at world size ``world``."""
    return wait_until(
        lambda: next(
            (e for e in cluster.steps() if e["ts"] > after and e["world_size"] == world), None
        ),
        timeout,
        f"a step at world size {world} (last step {cluster.last_step()})",
    )


AGENTS = '{job="elastic-agent"}'
WORLD_SIZE = f"max(elastic_world_size{AGENTS})"


def prometheus_sees_world(cluster: Cluster, world: int, timeout: float = 60) -> float:
    """Wait until Prometheus has scraped world size ``world`` from the agents; return when."""
    wait_until(
        lambda: cluster.prometheus_value(WORLD_SIZE) == world,
        timeout,
        f"Prometheus to see world size {world} (it has {cluster.prometheus_value(WORLD_SIZE)})",
    )
    return time.time()


def dashboard_sees_world(cluster: Cluster, world: int, step: int, timeout: float = 60) -> None:
    """The ``dashboard`` service (published on the host) shows the run at world size ``world``
    (from etcd) with a training step at or past ``step`` (from the shared event log), and
    serves its page."""

    def shows() -> dict | None:
        status = cluster.dashboard()
        if not status or not status["rendezvous"] or not status["step"]:
            return None
        seen = status["rendezvous"].get("world_size") == world and status["step"]["step"] >= step
        return status if seen else None

    status = wait_until(
        shows, timeout, f"the dashboard to show world size {world} at step {step} or later"
    )
    assert status["run_id"] == cluster.run_id and status["errors"] == [], status
    ranked = [m for m in status["rendezvous"]["members"] if m["state"].startswith("rank ")]
    assert len(ranked) == world, status["rendezvous"]
    page = cluster.dashboard("")
    assert page and f'<span id="run-id">{cluster.run_id}</span>' in page
    url = f"http://127.0.0.1:{cluster.dashboard_port}/timeline.png"
    with urllib.request.urlopen(url, timeout=60) as reply:  # the image has matplotlib
        assert reply.read(8) == b"\x89PNG\r\n\x1a\n"


def agent_figures_reach(cluster: Cluster, step: int) -> bool:
    """Prometheus has the agents' recoveries (two at least: the kill and the leave, which the
    last agent saw both), a complete checkpoint, and training step ``step``."""
    recoveries = cluster.prometheus_value(f"sum(elastic_recovery_seconds_count{AGENTS})")
    checkpoint = cluster.prometheus_value(f"max(elastic_checkpoint_step{AGENTS})")
    newest = cluster.prometheus_value(f"max(elastic_train_step{AGENTS})")
    return (recoveries or 0) >= 2 and (checkpoint or 0) > 0 and (newest or 0) >= step


def collapse(values: list[float]) -> list[int]:
    """The values without consecutive repeats: [2, 2, 3, 3, 2] -> [2, 3, 2]."""
    out: list[int] = []
    for v in values:
        if not out or out[-1] != int(v):
            out.append(int(v))
    return out


def storage_loads(loads: list[dict]) -> list[dict]:
    """The loads from checkpoint storage; the others resumed from memory (url "")."""
    return [e for e in loads if e.get("url")]


def assert_loaded_complete(url: str, run_id: str, loads: list[dict]) -> None:
    """Every checkpoint a worker loaded is complete: commit marker present, every file's size and
    CRC as the marker records. (A ``ckpt.save`` event alone cannot tell: a writer killed right
    after committing never reports it.) Needs ``checkpoint.keep_last`` large enough to keep them.
    """
    for step in sorted({e["step"] for e in loads}):
        info = inspect_step(url, run_id, step, "full")
        assert info.complete, f"a worker loaded step {step}, which is not complete: {info.reason}"


def loads_after(cluster: Cluster, ts: float) -> list[dict]:
    """Where each group went on after ``ts``: loads and in-place re-forms (live state)."""
    return list(events.resumptions(cluster.events(), ts))


@pytest.mark.timeout(1800)
def test_scale_kill_stop_and_finish(cluster_factory, images) -> None:
    cluster = cluster_factory(**TINY)
    cluster.enable_monitoring(images["ELASTIC_PROMETHEUS_IMAGE"])
    t0 = time.monotonic()
    cluster.compose("up", "-d", "--no-build", "--scale", "agent=2", timeout=300)
    assert len(cluster.agents()) == 2
    first = step_at_world(cluster, 0, 2, timeout=240)
    print(f"world 2 trains after {time.monotonic() - t0:.1f} s (step {first['step']})")
    seen_from = prometheus_sees_world(cluster, 2)

    # `elastic status` from the host, through the published (127.0.0.1-only) etcd port: TLS
    # with the client certificate, the agents' etcd user, the job secret to check signatures.
    status = run(
        [
            sys.executable,
            "-m",
            "elastic_tools.cli",
            "status",
            *cluster.etcd_args(),
            "--run-id",
            cluster.run_id,
            "--checkpoint-url",
            str(cluster.dir),
            "--json",
        ],
        timeout=180,  # a CLI that imports torch, on 2 busy cores
        env={**os.environ, "ELASTIC_SECRET_FILE": str(cluster.secrets / "job-secret")},
    )
    assert json.loads(status.stdout), status.stdout

    # Add a node.
    wait_until(lambda: cluster.last_step() >= first["step"] + 10, 120, "10 steps at world 2")
    before, joined_at = cluster.last_step(), time.time()
    cluster.compose("up", "-d", "--no-build", "--no-recreate", "--scale", "agent=3", timeout=300)
    assert len(cluster.running_agents()) == 3
    after_join = step_at_world(cluster, joined_at, 3)
    prometheus_sees_world(cluster, 3)
    dashboard_sees_world(cluster, 3, after_join["step"])
    assert after_join["step"] > before
    assert min(e["step"] for e in loads_after(cluster, joined_at)) >= before - 20
    print(f"world 3 at step {after_join['step']}, {time.time() - joined_at:.1f} s after scaling")

    # Crash a node: SIGKILL of the whole container.
    wait_until(lambda: cluster.last_step() >= after_join["step"] + 10, 120, "10 steps at world 3")
    victim = cluster.running_agents()[0]
    killed_at = time.time()
    run(["docker", "kill", "--signal=KILL", victim])
    after_kill = step_at_world(cluster, killed_at, 2)
    prometheus_sees_world(cluster, 2)
    print(f"world 2 at step {after_kill['step']}, {time.time() - killed_at:.1f} s after the kill")

    # A planned leave: `docker stop` = SIGTERM to elastic-agent (PID 1), grace period 120 s.
    wait_until(lambda: cluster.last_step() >= after_kill["step"] + 10, 120, "10 steps at world 2")
    leaver = cluster.running_agents()[0]
    before, left_at = cluster.last_step(), time.time()
    run(["docker", "stop", "--time=120", leaver], timeout=180)
    assert cluster.inspect(leaver)["State"]["ExitCode"] == 0, cluster.logs()
    leaves = [e for e in cluster.events("node.leave") if e["ts"] > left_at]
    assert leaves, "the stopped node must leave the rendezvous itself"
    after_leave = step_at_world(cluster, left_at, 1)
    seen_to = prometheus_sees_world(cluster, 1)
    assert min(e["step"] for e in loads_after(cluster, left_at)) >= before, (
        "a planned leave checkpoints first: nothing may be redone"
    )
    print(f"world 1 at step {after_leave['step']}, {time.time() - left_at:.1f} s after the stop")

    # What Prometheus recorded while it happened: evaluated every second from seen_from on,
    # ending exactly at seen_to (query_range stops at the last whole step before `end`).
    end_ms = int(seen_to * 1000)
    start_ms = end_ms - (end_ms - int(seen_from * 1000)) // 1000 * 1000
    series = cluster.prometheus(
        "/api/v1/query_range",
        query=WORLD_SIZE,
        start=f"{start_ms / 1000:.3f}",
        end=f"{end_ms / 1000:.3f}",
        step=1,
    )["result"]
    assert len(series) == 1, series
    values = [float(v) for _, v in series[0]["values"]]
    assert collapse(values) == [2, 3, 2, 1], f"Prometheus saw world sizes {values}"
    wait_until(
        lambda: agent_figures_reach(cluster, after_leave["step"]),
        60,
        "the last agent's recoveries, checkpoint and step in Prometheus",
    )

    # The last node finishes the job.
    (last,) = cluster.running_agents()
    assert after_leave["step"] < MAX_STEPS, "the job finished before the scenario did"
    exit_code = int(run(["docker", "wait", last], timeout=1200).stdout.strip())
    assert exit_code == 0, cluster.logs()
    print(f"finished {time.monotonic() - t0:.1f} s after `up`")

    # What the shared volume says.
    steps = cluster.steps()
    assert sorted(events.completed_steps(cluster.events())) == list(range(1, MAX_STEPS + 1)), (
        "every step from 1 to max_steps must have run"
    )
    # A step whose agreement failed (a peer was lost right after it) has no loss to report.
    assert all(math.isfinite(e["loss"]) for e in steps if "loss" in e)
    assert sum("loss" in e for e in steps) >= len(steps) - 5, "most steps report their loss"
    assert {e["world_size"] for e in steps} == {1, 2, 3}
    assert events.resumptions(cluster.events(), 0), "joins and leaves must go on from a state"
    loads = cluster.events("ckpt.load")
    # Resumes from a node's memory or a peer's (elastic.worker: url "") need no stored step.
    assert_loaded_complete(str(cluster.dir), cluster.run_id, storage_loads(loads))
    latest = find_latest_complete(str(cluster.dir), cluster.run_id, warn=False)
    assert latest is not None and latest.step == MAX_STEPS, latest
    assert all(cluster.inspect(c)["State"]["Status"] == "exited" for c in cluster.agents())
    assert (REPO / "docker-compose.yml").exists()
    for container in cluster.agents():  # the whole run's logs, kill and leave included
        cluster.assert_no_secret_in(container)
    for container in cluster.compose("ps", "-q", "dashboard").stdout.split():
        cluster.assert_no_secret_in(container)

    # The timeline of the whole run, drawn on the host from the shared volume's event log.
    picture = cluster.dir.parent / f"{cluster.run_id}-timeline.png"
    drawn = run(
        [
            sys.executable,
            "-m",
            "elastic_tools.cli",
            "timeline",
            str(cluster.event_log),
            "-o",
            str(picture),
        ],
        timeout=180,
    )
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", drawn.stdout + drawn.stderr
    assert str(picture) in drawn.stdout and picture.stat().st_size > 20_000, drawn.stdout


S3_MAX_STEPS = int(os.environ.get("ELASTIC_E2E_S3_MAX_STEPS", "200"))


@pytest.mark.timeout(1200)
def test_s3_profile_on_a_moto_server(cluster_factory, images) -> None:
    """Profile ``s3`` with moto standing in for MinIO: checkpoints on s3://, a planned leave."""
    import s3fs

    cluster = cluster_factory(**{**TINY, "ELASTIC_JOB__MAX_STEPS": S3_MAX_STEPS})
    s3_port = free_port()
    cluster.env.update(
        {
            "S3_IMAGE": images["ELASTIC_MOTO_IMAGE"],
            "S3_COMMAND": "-H 0.0.0.0 -p 9000",
            "S3_PORT": str(s3_port),
            "ELASTIC_RUN_ID_S3": cluster.run_id,
        }
    )
    cluster.event_log = cluster.dir / "events-s3.jsonl"
    cluster.compose(
        "--profile",
        "s3",
        "up",
        "-d",
        "--no-build",
        "--scale",
        "agent-s3=2",
        "agent-s3",
        timeout=300,
    )
    agents = cluster.compose("--profile", "s3", "ps", "-q", "agent-s3").stdout.split()
    assert len(agents) == 2
    assert not cluster.agents(), "naming agent-s3 must not start the volume-backed agents"
    first = step_at_world(cluster, 0, 2, timeout=240)
    wait_until(lambda: cluster.last_step() >= first["step"] + 25, 180, "a checkpoint at world 2")

    before, left_at = cluster.last_step(), time.time()
    run(["docker", "stop", "--time=120", agents[0]], timeout=180)
    assert cluster.inspect(agents[0])["State"]["ExitCode"] == 0, cluster.logs()
    after_leave = step_at_world(cluster, left_at, 1)
    assert min(e["step"] for e in loads_after(cluster, left_at)) >= before
    assert after_leave["step"] < S3_MAX_STEPS, "the job finished before the scenario did"
    exit_code = int(run(["docker", "wait", agents[1]], timeout=900).stdout.strip())
    assert exit_code == 0, cluster.logs()

    assert sorted(events.completed_steps(cluster.events())) == list(range(1, S3_MAX_STEPS + 1))
    saves = [e for e in cluster.events("ckpt.save") if e.get("ok")]
    assert saves and all(e["url"].startswith("s3://") for e in saves)
    assert events.resumptions(cluster.events(), left_at), (
        "the other node must go on after the leave"
    )
    loads = storage_loads(cluster.events("ckpt.load"))  # not those from memory (url "")
    assert all(e["url"].startswith("s3://") for e in loads), loads
    fs = s3fs.S3FileSystem(
        endpoint_url=f"http://127.0.0.1:{s3_port}",
        key=cluster.secret("s3-access-key"),
        secret=cluster.secret("s3-secret-key"),
    )
    root = f"elastic/checkpoints/{cluster.run_id}"
    final = f"{root}/step-{S3_MAX_STEPS}/COMMIT.json"
    assert fs.exists(final), fs.find(root)
    for step in {e["step"] for e in loads}:
        assert fs.exists(f"{root}/step-{step}/COMMIT.json"), f"loaded step {step} is not committed"
    for container in agents:  # the S3 keys included
        cluster.assert_no_secret_in(container)


@pytest.mark.timeout(900)
def test_locked_down(cluster_factory, images) -> None:
    """etcd needs a login (over TLS), the agents run as a non-root user, and no secret shows in
    `docker inspect` or the logs: checked while one `agent` and one `agent-s3` (profile s3, on
    moto) train, at a pace that leaves time for the checks."""
    cluster = cluster_factory(**{**TINY, "ELASTIC_JOB__MIN_STEP_S": 0.3})
    cluster.profiles.append("s3")
    cluster.env.update(
        {
            "S3_IMAGE": images["ELASTIC_MOTO_IMAGE"],
            "S3_COMMAND": "-H 0.0.0.0 -p 9000",
            "S3_PORT": str(free_port()),
            "ELASTIC_RUN_ID_S3": f"{cluster.run_id}-s3",
        }
    )
    cluster.compose(
        "up",
        "-d",
        "--no-build",
        "--scale",
        "agent=1",
        "--scale",
        "agent-s3=1",
        "agent",
        "agent-s3",
        timeout=300,
    )
    step_at_world(cluster, 0, 1, timeout=240)
    cluster.event_log = cluster.dir / "events-s3.jsonl"
    step_at_world(cluster, 0, 1, timeout=240)
    agents = cluster.agents()
    agents_s3 = cluster.compose("ps", "-q", "agent-s3").stdout.split()
    assert len(agents) == 1 and len(agents_s3) == 1
    assert_locked_down(cluster, agents)
    assert_locked_down(cluster, agents_s3, service="agent-s3")
    assert all(cluster.inspect(c)["State"]["Running"] for c in agents + agents_s3), (
        "the checks must run while the agents train: raise MIN_STEP_S"
    )
