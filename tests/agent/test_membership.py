"""Nodes join, leave on purpose and crash while the CNN worker trains; nothing is lost."""

from __future__ import annotations

import signal
import time

import pytest

from elastic import events
from elastic.node.procs import children, descendants, kill
from tests.agent.jobs import Job, assert_models_match
from tests.helpers import pid_alive, wait_until

pytestmark = pytest.mark.slow


def assert_continuous(job: Job) -> None:
    """Every step from 1 to the end completed (see ``events.completed_steps``)."""
    steps = sorted(events.completed_steps(job.events()))
    assert steps == list(range(1, job.max_steps + 1)), steps


def assert_same_as_fault_free(job: Job) -> None:
    """Each sample used once, and the final model equals a fault-free world-1 run's."""
    used = job.ledger()
    assert len(used) == len(set(used)) == job.max_steps * 48, "a sample was skipped or repeated"
    assert_models_match(job.final_model(), job.reference_model())


def first_step_after(job: Job, ts: float, world: int) -> dict:
    return wait_until(
        lambda: next((e for e in job.steps() if e["ts"] > ts and e["world_size"] == world), None),
        120,
        f"a step at world size {world}",
    )


def test_join_then_planned_leave_lose_no_steps(job: Job) -> None:
    a, b = job.start("a", max_restarts=0), job.start("b", max_restarts=0)
    wait_until(lambda: job.last_step() >= 8, 120, "step 8 at world 2")
    before = job.last_step()
    joined_at = time.time()
    c = job.start("c", max_restarts=0)
    after_join = first_step_after(job, joined_at, 3)
    assert after_join["step"] >= before + 1
    loads = events.resumptions(job.events(), joined_at)
    assert loads and min(e["step"] for e in loads) >= before, "a join must not roll back"

    wait_until(lambda: job.last_step() >= after_join["step"] + 5, 120, "5 steps at world 3")
    before = job.last_step()
    left_at = time.time()
    b.kill(signal.SIGTERM)
    assert b.wait(60) == 0, job.logs()
    after_leave = first_step_after(job, left_at, 2)
    loads = events.resumptions(job.events(), left_at)
    assert loads and min(e["step"] for e in loads) >= before, "a planned leave must not roll back"
    assert job.events("node.leave"), "the leaving node must leave the rendezvous itself"

    for node in (a, c):
        assert node.wait(180) == 0, job.logs()
    assert_continuous(job)
    assert_same_as_fault_free(job)
    assert after_leave["world_size"] == 2
    assert job.cleanup() == [], "no worker may outlive its agent"


def test_kill_9_of_a_lone_agent_leaves_nothing_behind(job: Job) -> None:
    """World 1: no collective fails to stop the worker; only the parent-death chain
    (agent -> fork server -> worker) can. Before it, the worker trained on for good."""
    agent = job.start("a", nnodes="1:1")
    wait_until(lambda: job.workers_of("a") and job.last_step() >= 2, 120, "a training worker")
    below = descendants(agent.pid)
    kill(agent.pid)
    wait_until(lambda: not any(pid_alive(p) for p in below), 5, "everything under the agent to die")


def test_kill_9_of_an_agent_then_of_a_worker(job: Job) -> None:
    nodes = [job.start(n) for n in "abc"]
    wait_until(lambda: job.last_step() >= 8 and job.worlds_after(0)[-1] == 3, 150, "world 3")
    victim = nodes[1]
    orphans = descendants(victim.pid)
    assert job.workers_of("b"), "the agent must have a worker"
    killed_at = time.time()
    kill(victim.pid)  # kill -9 of an agent: its worker must not outlive it
    # Killed by the kernel (parent-death signals), not by a collective failing later.
    wait_until(lambda: not any(pid_alive(p) for p in orphans), 5, "the worker to die too")
    first_step_after(job, killed_at, 2)

    worker = job.workers_of("a")[0]
    assert worker not in children(nodes[0].pid), "our worker forks from the warm fork server"
    killed_at = time.time()
    kill(worker)  # kill -9 of a worker: its agent restarts it and the group re-forms
    first_step_after(job, killed_at, 2)
    for node in (nodes[0], nodes[2]):
        assert node.wait(240) == 0, job.logs()
    assert_continuous(job)
    assert_same_as_fault_free(job)
    assert job.cleanup() == [], "no worker may outlive its agent"


def test_restart_budget_is_kept_for_the_whole_job_in_etcd(job: Job) -> None:
    from elastic.etcd.client import EtcdClient, EtcdOptions, parse_endpoints
    from elastic.rendezvous.keys import RunKeys

    nodes = [job.start(n, max_restarts=1) for n in "ab"]
    wait_until(lambda: job.last_step() >= 6, 120, "step 6")
    kill(job.workers_of("a")[0])  # failure 1 of a budget of 1: restart
    killed_at = time.time()
    first_step_after(job, killed_at, 2)
    with EtcdClient(EtcdOptions(parse_endpoints(job.endpoint)[0])) as client:
        ledger = client.range(RunKeys("/elastic", job.run_id).restarts, prefix=True).kvs
    assert len(ledger) == 1, "both agents saw one failure: it must count once"
    kill(job.workers_of("b")[0])  # failure 2: over the budget, the job stops
    codes = [node.wait(120) for node in nodes]
    assert all(code != 0 for code in codes), job.logs()
    used = [
        e["job_restarts_used"] for e in job.events("worker.restart") if "job_restarts_used" in e
    ]
    assert max(used) == 2
