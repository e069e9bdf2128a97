"""A user's own script on elastic.Run (tests/scripts/inplace_user.py: AdamW, a cosine LR
schedule, a constant global batch) under real agents: a join, a kill -9, another join and a
planned leave re-form the group in place (and, apart, a node frozen for 20 s and thawed).
The survivors keep their processes (4 nodes, 4 worker processes), no completed step is
redone, each sample is used once per epoch, and the final model equals a fault-free run's at
world size 1 (float64: fault-free runs at world 1 and 3 agree to 3.6e-16)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic.node.procs import descendants
from elastic_tools.harness.cluster import LocalCluster
from tests.helpers import REPO, node_env, pid_alive, wait_until

pytestmark = pytest.mark.slow
SCRIPT = REPO / "tests" / "scripts" / "inplace_user.py"
SAMPLES, BATCH, EPOCHS = 240, 12, 40
STEPS_PER_EPOCH = SAMPLES // BATCH
BOUND = 1e-12  # relative L2; fault-free runs at world 1 and 3 agree to 3.6e-16
FREEZE_S = 20


def _args(out: Path) -> list[str]:
    return [f"--epochs={EPOCHS}", f"--samples={SAMPLES}", f"--global-batch={BATCH}", f"--out={out}"]


def _records(out: Path) -> list[dict[str, Any]]:
    lines = (out / "steps.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _kept(records: list[dict[str, Any]]) -> dict[int, list[int]]:
    """Each step's samples, from its attempt in the newest round (a failed attempt was
    redone in a later round)."""
    newest: dict[int, int] = {}
    for r in records:
        newest[r["step"]] = max(newest.get(r["step"], -1), r["round"])
    kept: dict[int, list[int]] = defaultdict(list)
    for r in records:
        if r["round"] == newest[r["step"]]:
            kept[r["step"]].extend(r["idx"])
    return kept


def _signal_node(cluster: LocalCluster, name: str, sig: int) -> None:
    """Send ``sig`` to node ``name``'s agent and every process below it."""
    node = cluster.nodes[name]
    for pid in [node.pid, *descendants(node.pid)]:
        os.kill(pid, sig)


def _relative_l2(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    num = sum(float((a[k] - b[k]).norm() ** 2) for k in a)
    den = sum(float(b[k].norm() ** 2) for k in b)
    return (num / den) ** 0.5


@pytest.mark.timeout(600)  # four membership changes, two reference runs, on 2 cores
def test_user_script_reforms_in_place(cluster: LocalCluster, tmp_path: Path) -> None:
    out, ref = tmp_path / "out", tmp_path / "ref"
    reference = subprocess.run(
        [sys.executable, str(SCRIPT), *_args(ref)], env=node_env(), capture_output=True, timeout=300
    )
    assert reference.returncode == 0, reference.stderr[-2000:]
    worker = [str(SCRIPT), *_args(out), "--step-delay=0.05", f"--ckpt={tmp_path / 'ckpt'}"]

    a = cluster.start("a", worker=worker)
    cluster.start("b", worker=worker)
    cluster.wait_for(lambda: [e for e in cluster.steps() if e["world_size"] == 2], "world 2", 240)
    first = {r["pid"] for r in _records(out)}
    assert len(first) == 2, first

    t = time.time()
    cluster.start("c", worker=worker)  # a join
    cluster.wait_for(lambda: cluster.first_step_after(t, 3), "a step at world 3", 240)
    cluster.train_more(5, 120)
    t = time.time()
    cluster.kill_node("c")  # kill -9 of the joiner's agent and worker
    cluster.wait_for(lambda: cluster.first_step_after(t, 2), "a step at world 2", 240)
    t = time.time()
    cluster.start("d", worker=worker)  # a second join
    cluster.wait_for(lambda: cluster.first_step_after(t, 3), "d's first step at world 3", 240)
    cluster.train_more(5, 120)
    t = time.time()
    cluster.leave("b")  # a planned leave
    cluster.wait_for(lambda: cluster.first_step_after(t, 2), "a step after b left", 240)
    assert a.wait(600) == 0, cluster.logs()
    records = _records(out)
    pids = {r["pid"] for r in records}
    assert len(pids) == 4, f"4 nodes started {len(pids)} worker processes: a survivor restarted"

    reforms = cluster.events("recovery.inplace")
    assert {e["world_size"] for e in reforms} >= {2, 3}, reforms
    assert not cluster.events("recovery.fallback"), cluster.events("recovery.fallback")
    steps = [e["step"] for e in cluster.steps()]
    assert steps == sorted(set(steps)), "a completed step was redone"
    kept = _kept(records)
    assert sorted(kept) == list(range(EPOCHS * STEPS_PER_EPOCH))
    for epoch in range(EPOCHS):
        used = [
            i
            for s in range(epoch * STEPS_PER_EPOCH, (epoch + 1) * STEPS_PER_EPOCH)
            for i in kept[s]
        ]
        assert sorted(used) == list(range(SAMPLES)), f"epoch {epoch} did not use each sample once"
    final = torch.load(out / "final.pt")
    expected = torch.load(ref / "final.pt")
    assert _relative_l2(final, expected) < BOUND


def test_a_frozen_node_rejoins_in_place(cluster: LocalCluster, tmp_path: Path) -> None:
    """A node frozen (SIGSTOP) for 20 s and thawed: the others go on without it at heartbeat
    expiry, it rejoins in place, receives the state instead of serving its stale one and
    writes no checkpoint for its stale round; nothing is lost."""
    epochs = 30
    out, ref = tmp_path / "out", tmp_path / "ref"
    _reference(ref, epochs)
    worker = [str(SCRIPT), *_args(out), f"--epochs={epochs}", "--step-delay=0.05"]
    worker.append(f"--ckpt={tmp_path / 'ckpt'}")
    nodes = [cluster.start(name, worker=worker) for name in "abc"]
    cluster.wait_for(lambda: [e for e in cluster.steps() if e["world_size"] == 3], "world 3", 240)
    first = {r["pid"] for r in _records(out)}
    frozen = time.time()
    _signal_node(cluster, "c", signal.SIGSTOP)  # a hung node: no error, no answer
    cluster.wait_for(lambda: cluster.first_step_after(frozen, 2), "a step without c", 240)
    cluster.wait_for(lambda: time.time() - frozen >= FREEZE_S, "the freeze", FREEZE_S + 5)
    thawed = time.time()
    _signal_node(cluster, "c", signal.SIGCONT)
    cluster.wait_for(lambda: cluster.first_step_after(thawed, 3), "c back at world 3", 240)
    assert all(n.wait(600) == 0 for n in nodes), cluster.logs()
    assert {r["pid"] for r in _records(out)} == first, "a worker restarted"
    back = [e for e in cluster.events("recovery.inplace") if e["ts"] > thawed]
    assert back and all(e["state"] in ("memory", "peer") for e in back), back
    stale = [e for e in cluster.events("ckpt.save") if e["ok"] and frozen < e["ts"] < back[0]["ts"]]
    assert not [e for e in stale if e["rank"] == 2], f"a stale checkpoint: {stale}"
    _check_result(cluster, out, ref, epochs)


def _check_result(cluster: LocalCluster, out: Path, ref: Path, epochs: int) -> None:
    """No completed step redone, each sample once per epoch, the fault-free final model."""
    steps = [e["step"] for e in cluster.steps()]
    assert steps == sorted(set(steps)), "a completed step was redone"
    kept = _kept(_records(out))
    assert sorted(kept) == list(range(epochs * STEPS_PER_EPOCH))
    for epoch in range(epochs):
        window = range(epoch * STEPS_PER_EPOCH, (epoch + 1) * STEPS_PER_EPOCH)
        assert sorted(i for s in window for i in kept[s]) == list(range(SAMPLES)), epoch
    final, expected = torch.load(out / "final.pt"), torch.load(ref / "final.pt")
    assert _relative_l2(final, expected) < BOUND


def _reference(ref: Path, epochs: int) -> None:
    argv = [sys.executable, str(SCRIPT), *_args(ref), f"--epochs={epochs}"]
    done = subprocess.run(argv, env=node_env(), capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_failure_inside_optimizer_step_restarts_that_rank(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """Rank 1 fails inside optimizer.step() after changing a parameter: its state is
    torn, so it never serves it; its agent restarts it, the others stay in place and
    stream it their state. 0 completed steps lost."""
    epochs = 10
    out, ref = tmp_path / "out", tmp_path / "ref"
    _reference(ref, epochs)
    worker = [str(SCRIPT), *_args(out), f"--epochs={epochs}", "--step-delay=0.05"]
    worker.append("--fail-in-step=1:40")
    nodes = [cluster.start(name, worker=worker) for name in "ab"]
    assert all(n.wait(600) == 0 for n in nodes), cluster.logs()
    assert (out / "failed-in-step").exists(), "the constructed failure did not happen"
    assert [e for e in cluster.events("worker.restart") if e["reason"] == "failure"]
    pids = {r["pid"] for r in _records(out)}
    assert len(pids) == 3, f"expected one restarted worker, got pids {pids}"
    resumed = [e for e in cluster.events("recovery.resume") if e["step"] >= 40]
    assert resumed and all(e["source"] in ("memory", "peer") for e in resumed), resumed
    _check_result(cluster, out, ref, epochs)


def test_failed_reform_falls_back_to_a_restart(cluster: LocalCluster, tmp_path: Path) -> None:
    """Rank 0 cannot reach the new round's store when a third node joins: it snapshots,
    exits 75 and restarts; the others take the next round in place. 0 steps lost."""
    epochs = 12
    out, ref = tmp_path / "out", tmp_path / "ref"
    _reference(ref, epochs)
    worker = [str(SCRIPT), *_args(out), f"--epochs={epochs}", "--step-delay=0.05"]
    a = cluster.start("a", worker=[*worker, "--break-store=0"])
    b = cluster.start("b", worker=worker)
    cluster.wait_for(lambda: [e for e in cluster.steps() if e["world_size"] == 2], "world 2", 240)
    c = cluster.start("c", worker=worker)
    assert all(n.wait(600) == 0 for n in (a, b, c)), cluster.logs()
    fallbacks = cluster.events("recovery.fallback")
    assert fallbacks, "the constructed re-form failure did not happen"
    assert not [e for e in cluster.events("worker.restart") if e["reason"] == "failure"]
    pids = {r["pid"] for r in _records(out)}
    assert len(pids) == 4, f"expected one restarted worker, got pids {pids}"
    _check_result(cluster, out, ref, epochs)


def test_a_user_script_dies_with_its_agent(cluster: LocalCluster, tmp_path: Path) -> None:
    """kill -9 of the agent alone (not its worker): a script on Run does not train on without
    it (it holds the node's snapshots and a rank in a group no agent speaks for)."""
    out = tmp_path / "out"
    worker = [str(SCRIPT), *_args(out), "--epochs=1000", "--step-delay=0.05"]
    agent = cluster.start("a", worker=worker)
    cluster.wait_for(lambda: [e for e in cluster.steps() if e["step"] >= 3], "3 steps", 240)
    below = descendants(agent.pid)
    assert below, "the agent must have a worker"
    os.kill(agent.pid, signal.SIGKILL)
    wait_until(lambda: not any(pid_alive(p) for p in below), 10, "the worker to die with it")


def _fork_server(agent: int) -> int:
    """The agent's fork server: its child whose own child is a worker (on Run, a script's
    worker is a fork of the server)."""
    from elastic.node.procs import children

    found = [c for c in children(agent) if children(c)]
    assert len(found) == 1, f"expected one fork server below agent {agent}, found {found}"
    return found[0]


def test_a_killed_fork_server_restarts_its_worker(cluster: LocalCluster, tmp_path: Path) -> None:
    """kill -9 of node a's fork server: its worker dies with it (the server is its parent),
    and a's agent must start a new worker (a cold or newly served one) instead of taking the
    next round in place with none: the job finishes, every step once, the fault-free model.
    (Seen: a re-form in place with no worker, the job standing still until a node joined.)"""
    epochs = 10
    out, ref = tmp_path / "out", tmp_path / "ref"
    _reference(ref, epochs)
    worker = [str(SCRIPT), *_args(out), f"--epochs={epochs}", "--step-delay=0.05"]
    a = cluster.start("a", worker=worker)
    b = cluster.start("b", worker=worker)
    cluster.wait_for(
        lambda: [e for e in cluster.steps() if e["world_size"] == 2 and e["step"] >= 20],
        "20 steps at world 2",
        240,
    )
    server = _fork_server(a.pid)
    os.kill(server, signal.SIGKILL)
    assert all(n.wait(300) == 0 for n in (a, b)), cluster.logs()
    assert not pid_alive(server)
    pids = {r["pid"] for r in _records(out)}
    assert len(pids) == 3, f"expected one new worker on a, got pids {pids}"
    _check_result(cluster, out, ref, epochs)
