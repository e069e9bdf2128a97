"""examples/slurm/train.sbatch on a real Slurm cluster: a node failure, a drain, a requeue.

Three Slurm nodes, each a network namespace with its own address and its own slurmd
(:mod:`tests.deploy.slurm_cluster`), slurmctld and an etcd on the bridge. The job runs one
``elastic-agent`` per node, each in its own step, training the tiny CNN; then:

(a) a node fails: every process on it (slurmd, slurmstepd, agent, worker) gets kill -9;
    the others go on at world 2 with no completed step lost, and Slurm marks the node DOWN
    while the job (``--no-kill``) runs on;
(b) a node is drained and its step cancelled with SIGTERM: a planned leave, done within
    Slurm's KillWait, with no completed step lost (world 1);
(c) both nodes come back and ``scontrol requeue`` restarts the whole job: it resumes from
    the newest complete checkpoint (the one the SIGTERMed agents saved) and finishes.

The steps come from the agents' and workers' JSON-lines event log.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastic import env, events
from elastic.checkpoint import find_latest_complete
from elastic.etcd.server import EtcdServer, start_etcd
from elastic_tools.harness.faults import Net, netns_usable
from tests.deploy.slurm_cluster import KILL_WAIT_S, SlurmCluster, missing_commands
from tests.helpers import PYTHON, REPO, node_env, wait_until

pytestmark = pytest.mark.slow

SBATCH = REPO / "examples" / "slurm" / "train.sbatch"
SETUP = REPO / ".ci" / "slurm-setup.sh"
MAX_STEPS = 100
RUN = "slurm-tiny"  # the worker's job.run_id: its checkpoints' prefix


def _prerequisites() -> None:
    """Skip only when Slurm cannot be installed here at all; fail on anything else missing."""
    missing = missing_commands()
    if missing:
        installable = (
            shutil.which("apt-cache")
            and subprocess.run(
                ["apt-cache", "show", "slurm-wlm"], capture_output=True, check=False
            ).returncode
            == 0
        )
        if not installable:
            pytest.skip(f"Slurm cannot be installed here (no slurm-wlm package): {missing}")
        pytest.fail(f"{', '.join(missing)} missing: run `sudo bash {SETUP}` (make slurm).")
    tools = [t for t in ("ip", "nsenter", "unshare", "mount") if shutil.which(t) is None]
    if tools:
        pytest.fail(f"The Slurm test needs {', '.join(tools)} (util-linux, iproute2).")
    if os.geteuid() != 0:
        pytest.fail("The Slurm test starts slurmctld and slurmd, which needs root.")
    why = netns_usable()
    if why:
        pytest.fail(f"The Slurm test needs network namespaces: {why}.")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[SlurmCluster, EtcdServer]]:
    _prerequisites()
    net = Net().up()
    slurm = SlurmCluster(tmp_path / "slurm", net, size=3)
    server: EtcdServer | None = None
    try:
        server = start_etcd(tmp_path / "etcd", host=net.gateway)
        slurm.start()
        yield slurm, server
    finally:
        left = slurm.stop()
        if server is not None:
            server.stop(signal.SIGKILL)
        net.close()
    assert left == [], f"processes of the Slurm nodes outlived the test: {left}"


def _steps(log: Path) -> list[dict[str, Any]]:
    return events.read(log, "train.step")


def _last_step(log: Path) -> int:
    steps = _steps(log)
    return int(steps[-1]["step"]) if steps else 0


def _at_world(log: Path, world: int) -> int:
    """How many of the newest steps in a row ran at world size ``world``."""
    count = 0
    for e in reversed(_steps(log)):
        if e["world_size"] != world:
            break
        count += 1
    return count


def _first_step_after(log: Path, ts: float, world: int, timeout: float) -> dict[str, Any]:
    def found() -> dict[str, Any] | None:
        return next((e for e in _steps(log) if e["ts"] > ts and e["world_size"] == world), None)

    step = wait_until(found, timeout, f"a step at world size {world}")
    assert step is not None
    return step


@pytest.mark.timeout(420)
def test_sbatch_survives_node_failure_drain_and_requeue(
    cluster: tuple[SlurmCluster, EtcdServer], tmp_path: Path
) -> None:
    slurm, server = cluster
    log, ckpt = tmp_path / "events.jsonl", tmp_path / "ckpt"
    worker = [
        "-m elastic_tools.training.worker",
        f"--config {REPO / 'configs' / 'tiny.yaml'}",
        f"job.run_id={RUN} job.max_steps={MAX_STEPS} job.log_every=1 job.min_step_s=0.4",
        f"checkpoint.url={ckpt} checkpoint.interval=5",
    ]
    environ = {
        **node_env(),
        "SLURM_CONF": str(slurm.conf),
        "PATH": f"{Path(PYTHON).parent}:{os.environ.get('PATH', '')}",
        env.EVENT_LOG: str(log),
        "ELASTIC_ETCD": server.endpoint,
        "ELASTIC_SCRIPT": " ".join(worker),
        "ELASTIC_RDZV_CONF": "profile=fast-failover,join_timeout=90",
        "ELASTIC_AGENT_ARGS": "--monitor-interval=0.3",
        "ELASTIC_NPROC": "1",
    }
    out = tmp_path / "job.out"
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--nodes=3", f"--chdir={REPO}", f"--output={out}", str(SBATCH)],
        capture_output=True,
        text=True,
        env=environ,
        timeout=30,
        check=True,
    )
    job = submitted.stdout.strip().split(";")[0]
    diag = lambda: f"job output:\n{out.read_text() if out.exists() else ''}"  # noqa: E731
    record: list[dict[str, Any]] = []

    def step_of(node: str) -> str:
        """The id (JOB.STEP) of the step running on ``node``."""
        steps = wait_until(lambda: slurm.steps(job), 30, "the job's steps")
        return next(s for s, n in steps.items() if n == node)

    # The agents' steps start one after the other (srun); with --nnodes 1:3 the first may
    # train alone until the others arrive and are taken in. Three steps at world 3 count.
    wait_until(lambda: _last_step(log) >= 6 and _at_world(log, 3) >= 3, 150, "step 6, 3 at world 3")
    assert _steps(log)[-1]["world_size"] == 3, diag()
    batch = slurm.job_field(job, "BatchHost")
    crashed, drained = [n for n in slurm.nodes if n.name != batch][:2]

    # (a) a node failure: kill -9 of everything on it, slurmd included
    before, t = _last_step(log), time.time()
    assert slurm.crash(crashed), "the crashed node ran no process"
    first = _first_step_after(log, t, 2, 90)
    record.append(_entry("node failure (kill -9 of slurmd + step)", crashed.name, before, t, first))

    # (b) a planned leave: drain the node, SIGTERM its step; it must end within KillWait
    wait_until(lambda: _last_step(log) >= first["step"] + 3, 60, "3 steps at world 2")
    before, t = _last_step(log), time.time()
    drained_step = step_of(drained.name)
    slurm.run("scontrol", "update", f"nodename={drained.name}", "state=drain", "reason=upgrade")
    # scancel may report an error here though the signal was delivered: the step ended
    # while its RPC was in flight (Slurm 22.05); the step's end and the events tell.
    slurm.run("scancel", "--signal=TERM", drained_step, check=False)
    wait_until(
        lambda: drained_step not in slurm.steps(job), KILL_WAIT_S, "the drained node's step to end"
    )
    step_ended_s = round(time.time() - t, 1)
    first = _first_step_after(log, t, 1, 90)
    record.append(_entry("drain + SIGTERM of the step", drained.name, before, t, first))
    record[-1]["step_ended_s"] = step_ended_s  # within KillWait: Slurm never had to SIGKILL
    assert events.read(log, "node.leave"), "the SIGTERMed agent must leave the rendezvous"

    # Slurm marks the failed node DOWN; --no-kill keeps the job running without it.
    wait_until(
        lambda: slurm.node_states().get(crashed.name, "").startswith("down"),
        90,
        "slurmctld to mark the failed node DOWN",
    )
    wait_until(lambda: f"Node failure on {crashed.name}" in out.read_text(), 30, "srun told of it")
    assert slurm.job_field(job, "JobState") == "RUNNING", diag()
    # Both nodes come back: slurmd restarts (ReturnToService=2), the drain is lifted.
    slurm.start_slurmd(crashed)
    slurm.run("scontrol", "update", f"nodename={drained.name}", "state=resume")
    wait_until(
        lambda: not any(s.startswith(("down", "drain")) for s in slurm.node_states().values()),
        60,
        "both nodes back in service",
    )

    # (c) requeue the whole job: every agent gets SIGTERM, the job restarts under its id
    t = time.time()
    assert _last_step(log) < MAX_STEPS - 10, f"too few steps left to requeue: {_last_step(log)}"
    slurm.run("scontrol", "requeue", job)
    wait_until(
        lambda: (
            slurm.job_field(job, "Restarts") == "1"
            and slurm.job_field(job, "JobState") == "RUNNING"
        ),
        90,
        "the requeued job to run again",
    )
    restarted = time.time()  # the old steps all ended before Slurm allocated the job again
    newest = find_latest_complete(str(ckpt), RUN)
    assert newest is not None, "the requeued job left no complete checkpoint"
    done_before = max(e["step"] for e in _steps(log) if e["ts"] < restarted)
    first = _first_step_after(log, restarted, 3, 150)
    loads = [e for e in events.resumptions(events.read(log), restarted) if e["kind"] == "ckpt.load"]
    assert loads, "the restarted job must load a checkpoint"
    assert loads[0]["step"] == newest.step, (loads[0], newest)
    entry = _entry("scontrol requeue", "all", done_before, t, first, newest.step)
    entry["steps_lost"] = done_before - newest.step  # redone from the checkpoint
    record.append(entry)

    wait_until(lambda: slurm.job_field(job, "JobState") == "COMPLETED", 180, "job completed")
    assert "restart 1) on " in out.read_text(), diag()
    assert sorted(events.completed_steps(events.read(log))) == list(range(1, MAX_STEPS + 1))
    print("\nslurm events:\n" + "\n".join(json.dumps(r) for r in record))
    # What the README promises for a kill -9 and a planned leave with peers alive: 0 lost.
    assert [r["steps_lost"] for r in record[:2]] == [0, 0], record
    # The whole job stopped: the README promises at most the checkpoint interval.
    assert record[2]["steps_lost"] <= 5, record


def _entry(
    event: str,
    node: str,
    before: int,
    t: float,
    first: dict[str, Any],
    resumed_from: int | None = None,
) -> dict[str, Any]:
    """Steps lost: completed steps (the newest before the event) that were run again."""
    entry = {
        "event": event,
        "node": node,
        "step_before": before,
        "first_step_after": first["step"],
        "world_after": first["world_size"],
        "recover_s": round(first["ts"] - t, 2),
        "steps_lost": max(0, before - (first["step"] - 1)),
    }
    if resumed_from is not None:
        entry["resumed_from_checkpoint"] = resumed_from
    return entry
