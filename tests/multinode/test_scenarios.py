"""Faults on nodes that each live in their own network namespace, with their own address.

One agent per namespace, etcd on the bridge. Each scenario injects one fault while the
CNN worker trains (a planned leave, kill -9 of an agent, kill -9 of a worker, an etcd
restart) and then checks that the job finished with every step, every sample once per
epoch, the fault-free model, and no process left behind.

The job crosses an epoch boundary (40 steps an epoch, 60 steps), so "once per epoch" is
checked on a full epoch and on a partial one.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastic import env, events
from elastic.etcd.server import EtcdServer
from elastic.node.procs import descendants, kill
from elastic_tools.harness.faults import Net
from tests.agent.jobs import LR, Job, assert_models_match
from tests.agent.test_membership import assert_continuous, first_step_after
from tests.helpers import PYTHON, REPO, Node, node_env, pid_alive, wait_until

pytestmark = pytest.mark.slow

STEPS = 60
BATCH = 48  # configs/tiny.yaml's global batch
STEPS_PER_EPOCH = 40
# Overrides of configs/tiny.yaml shared by the agents' workers and the reference run.
DATA = {"data.num_samples": STEPS_PER_EPOCH * BATCH}
PACED = {"job.min_step_s": 0.3, "distributed.timeout_s": 10}
# An etcd outage longer than the heartbeat window (keep_alive 1 s x 3 in jobs.FAST_CONF):
# every node's heartbeat looks stale when etcd comes back (the nodes still answer their
# probe ports, so they are kept; a longer outage drops them and they rejoin).
ETCD_OUTAGE_S = 5


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The fault-free model: the same job trained in one process (world 1), once per module.

    The model depends on the seed, the schedule (max_steps), the learning rate and the
    data, not on the run id, which only names the checkpoint folder.
    """
    tmp = tmp_path_factory.mktemp("reference")
    url = tmp / "ckpt"
    argv = [
        PYTHON,
        "-m",
        "elastic_tools.training.worker",
        "--config",
        str(REPO / "configs" / "tiny.yaml"),
        "job.run_id=reference",
        f"job.max_steps={STEPS}",
        f"checkpoint.url={url}",
        "checkpoint.interval=1000",
        f"optimizer.lr={LR}",
        *(f"{k}={v}" for k, v in DATA.items()),
    ]
    environ = {k: v for k, v in node_env().items() if k != env.EVENT_LOG}
    subprocess.run(argv, env=environ, cwd=REPO, check=True, capture_output=True, timeout=300)
    return Job(tmp, "", "reference", max_steps=STEPS).final_model(url)


@pytest.fixture
def job(tmp_path: Path, bridge_etcd: EtcdServer, run_id: str) -> Iterator[Job]:
    """A job whose agents talk to the etcd on the bridge; every process is killed after."""
    j = Job(tmp_path, bridge_etcd.endpoint, run_id, max_steps=STEPS)
    yield j
    j.cleanup()


def start_nodes(job: Job, net: Net, names: str) -> list[Node]:
    """Start one agent per name, each in a new namespace with its own address."""
    nodes = []
    for name in names:
        ns, addr = net.add_node()
        nodes.append(job.start(name, netns=ns, addr=addr, **DATA, **PACED))
    return nodes


def wait_for_world(job: Job, world: int, step: int) -> None:
    """Wait until the job trains at ``world`` nodes and has reached ``step``."""
    wait_until(
        lambda: job.last_step() >= step and job.worlds_after(0)[-1:] == [world],
        180,
        f"step {step} at world size {world}",
    )


def node_of_rank(job: Job, rank: int) -> str:
    """The name of the node whose agent holds ``rank`` in the newest rendezvous round."""
    rounds = job.events("rdzv.round")
    newest = max(r["round"] for r in rounds)
    pids = {r["pid"] for r in rounds if r["round"] == newest and r["rank"] == rank}
    names = [name for name, node in job.nodes.items() if node.pid in pids]
    assert len(names) == 1, f"Round {newest} must have exactly one rank {rank}: {rounds}."
    return names[0]


Proc = tuple[int, str]  # a pid and its start time: a reused pid is another process


def start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot ("" if it is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def processes_under(job: Job) -> set[Proc]:
    """Every process now below any agent of the job (fork servers, workers)."""
    found = {(p, start_time(p)) for node in job.nodes.values() for p in descendants(node.pid)}
    return {proc for proc in found if proc[1]}


def assert_all_gone(procs: set[Proc]) -> None:
    """Every process in ``procs`` exits (zombies count as gone)."""

    def none_left() -> bool:
        return not [p for p, t in procs if pid_alive(p) and start_time(p) == t]

    wait_until(none_left, 30, "every process the agents started to exit")


def assert_each_sample_once_per_epoch(job: Job) -> None:
    """The surviving trajectory used every sample of each epoch exactly once."""
    used = job.ledger()
    assert len(used) == STEPS * BATCH, f"The ledger has {len(used)} samples, not {STEPS * BATCH}."
    per_epoch = STEPS_PER_EPOCH * BATCH
    for start in range(0, len(used), per_epoch):
        epoch = used[start : start + per_epoch]
        assert len(set(epoch)) == len(epoch), f"A sample repeats in epoch {start // per_epoch}."
    assert sorted(used[:per_epoch]) == list(range(per_epoch)), "The first epoch skipped samples."


def assert_same_model(job: Job, reference: dict[str, Any]) -> None:
    """The final model equals the fault-free world-1 run's up to float summation order."""
    assert_models_match(job.final_model(), reference)


def assert_job_done(
    job: Job, survivors: list[Node], reference: dict[str, Any], seen: set[Proc]
) -> None:
    """Survivors exit 0 leaving no process of ``seen`` behind; steps, samples and model
    are those of a fault-free run."""
    for node in survivors:
        assert node.wait(240) == 0, f"Node {node.name} did not finish cleanly.\n{job.logs()}"
    assert_all_gone(seen)
    assert_continuous(job)
    assert_each_sample_once_per_epoch(job)
    assert_same_model(job, reference)


def test_planned_leave(job: Job, net: Net, reference: dict[str, Any]) -> None:
    """SIGTERM to one agent: it leaves with a checkpoint, the rest go on without a rollback."""
    a, b, c = start_nodes(job, net, "abc")
    wait_for_world(job, 3, 8)
    seen = processes_under(job)
    before = job.last_step()
    left_at = time.time()
    b.kill(signal.SIGTERM)
    assert b.wait(90) == 0, f"The leaving node must exit 0.\n{job.logs()}"
    first_step_after(job, left_at, 2)
    seen |= processes_under(job)
    assert job.events("node.leave"), "The leaving node must leave the rendezvous itself."
    loads = events.resumptions(job.events(), left_at)
    assert loads and min(e["step"] for e in loads) >= before, "A planned leave rolled back."
    assert_job_done(job, [a, c], reference, seen)
    assert job.cleanup() == [], "No worker may outlive its agent."


def test_kill_9_of_an_agent(job: Job, net: Net, reference: dict[str, Any]) -> None:
    """kill -9 of the agent holding rank 0: its worker dies too, the others re-form."""
    start_nodes(job, net, "abc")
    wait_for_world(job, 3, 8)
    seen = processes_under(job)
    victim = job.nodes[node_of_rank(job, 0)]
    wait_until(lambda: job.workers_of(victim.name), 30, "a worker under the victim's agent")
    below = {(p, start_time(p)) for p in descendants(victim.pid)}
    killed_at = time.time()
    kill(victim.pid)
    assert victim.wait(30) == -signal.SIGKILL, "The victim's agent must die of the kill -9."
    assert_all_gone(below)  # its fork server and worker do not outlive it
    first_step_after(job, killed_at, 2)
    seen |= processes_under(job)
    survivors = [node for node in job.nodes.values() if node is not victim]
    assert_job_done(job, survivors, reference, seen)
    assert job.cleanup() == [], "No worker may outlive its agent."


def test_kill_9_of_a_worker(job: Job, net: Net, reference: dict[str, Any]) -> None:
    """kill -9 of one worker: its agent restarts it and the group re-forms at full size."""
    a, b = start_nodes(job, net, "ab")
    wait_for_world(job, 2, 8)
    seen = processes_under(job)
    worker = wait_until(lambda: job.workers_of("b"), 30, "a worker under node b's agent")[0]
    killed_at = time.time()
    kill(worker)
    wait_until(lambda: not pid_alive(worker), 30, "the killed worker to be gone")
    wait_until(lambda: set(job.workers_of("b")) - {worker}, 60, "a new worker on node b")
    first_step_after(job, killed_at, 2)
    seen |= processes_under(job)
    restarts = [e for e in job.events("worker.restart") if e["ts"] > killed_at]
    assert any(e["reason"] == "failure" for e in restarts), "The failure must be counted."
    assert_job_done(job, [a, b], reference, seen)
    assert job.cleanup() == [], "No worker may outlive its agent."


def test_etcd_restart(
    job: Job, net: Net, bridge_etcd: EtcdServer, reference: dict[str, Any]
) -> None:
    """etcd killed mid-training and started again on the same address, port and data.

    The last checkpoint's commit goes through the fence in etcd, so a final model at the
    last step also shows that the workers used the restarted etcd.
    """
    a, b = start_nodes(job, net, "ab")
    wait_for_world(job, 2, 8)
    seen = processes_under(job)
    endpoint = bridge_etcd.endpoint
    bridge_etcd.stop(signal.SIGKILL)
    assert not bridge_etcd.alive(), "etcd must be down for the outage."
    down_until = time.monotonic() + ETCD_OUTAGE_S
    wait_until(lambda: time.monotonic() > down_until, ETCD_OUTAGE_S + 5, "the outage to last")
    bridge_etcd.start().wait_ready()
    assert bridge_etcd.endpoint == endpoint, "etcd must come back on the same address."
    restarted_at = time.time()
    first_step_after(job, restarted_at, 2)
    seen |= processes_under(job)
    assert_job_done(job, [a, b], reference, seen)
    assert job.cleanup() == [], "No worker may outlive its agent."
