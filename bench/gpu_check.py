"""The NCCL path on a CUDA machine: snapshot stall, a killed worker, a killed node; JSON out.

Three checks, each on the real code paths:

1. ``snapshot``: ResNet-18 (CIFAR-sized input, batch 128) trains in this process on
   ``cuda:0``; short runs with and without per-step snapshots (pinned staging on a side
   stream, :class:`elastic.recovery.snapshot.Snapshotter`) interleave. Reports the step
   time of each (medians), the median paired ratio, and the stall the training thread
   saw per snapshot (``sync_s`` + ``wait_s``).
2. ``worker_kill``: one node (``elastic-agent``, one worker per GPU, NCCL) trains;
   one worker gets ``kill -9``; its agent restarts the group, which resumes from the
   node's shared-memory snapshot. Reports ``recover_s`` (kill to the next completed step)
   and ``steps_lost``.
3. ``node_kill`` (two GPUs or more): two nodes (one GPU each, ``CUDA_VISIBLE_DEVICES``)
   train on NCCL; one whole node gets ``kill -9``; the survivor re-forms at world 1.

Usage: ``bash bench/gpu_check.sh`` (or ``python bench/gpu_check.py [--cpu]``; ``--cpu``
runs the same checks on gloo, to test the script where there is no GPU). Without CUDA
and without ``--cpu`` it prints ``{"skipped": ...}`` and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages first

import torch

from elastic.harness.cluster import REPO, AgentOptions, LocalCluster, provenance

if REPO is None:  # not expected: sys.path starts with this checkout
    raise SystemExit("bench/gpu_check.py runs from a source checkout of elastic.")
CONFIG = REPO / "configs" / "default.yaml"


def snapshot_stall(device: torch.device, rounds: int, steps: int) -> dict[str, Any]:
    """Interleaved short runs with and without per-step snapshots, in this process."""
    import torchvision

    from elastic.recovery.snapshot import SnapshotStore, Snapshotter

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(128, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (128,), device=device)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        store = SnapshotStore("gpu-check", 0, directory=shm)
        snaps = Snapshotter(store)
        opt.register_step_pre_hook(lambda *_: snaps.wait())
        stable = {p.data_ptr() for p in model.parameters()}

        def run(snapshot: bool) -> float:
            _sync(device)
            started = time.perf_counter()
            for step in range(steps):
                opt.zero_grad(set_to_none=True)
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                if snapshot:
                    stable.update(
                        v.data_ptr()
                        for st in opt.state.values()
                        for v in st.values()
                        if isinstance(v, torch.Tensor)
                    )
                    snaps.take(
                        step, 0, {"model": model.state_dict(), "optim": opt.state_dict()}, stable
                    )
            snaps.wait()
            _sync(device)
            return (time.perf_counter() - started) / steps

        run(True)  # warm-up: cuDNN autotuning, pinned buffers, the shm file
        before = dict(snaps.stats)
        off, on = [], []
        for _ in range(rounds):
            off.append(run(False))
            on.append(run(True))
        count = snaps.stats["count"] - before["count"]
        stall = (snaps.stats["sync_s"] - before["sync_s"]) + (
            snaps.stats["wait_s"] - before["wait_s"]
        )
        snaps.wait()
        store.remove()
    ratios = [b / a for a, b in zip(off, on, strict=True)]
    return {
        "step_s_off": statistics.median(off),
        "step_s_on": statistics.median(on),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "stall_ms_per_snapshot": 1000 * stall / max(count, 1),
        "snapshot_mb": snaps.stats["bytes"] / 2**20,
        "rounds": rounds,
        "steps_per_run": steps,
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cluster(run_dir: Path, nproc: int, backend: str) -> LocalCluster:
    overrides = {
        "distributed.backend": backend,
        "data.image_size": 32,
        "data.num_samples": 100000,
        "job.min_step_s": 0.05,
        "job.log_every": 1,
        "checkpoint.interval": 100,
    }
    options = AgentOptions(nnodes="1:2", nproc=nproc, max_restarts=5)
    return LocalCluster(
        run_dir, options=options, config=CONFIG, max_steps=5000, overrides=overrides
    )


def _recovery(cluster: LocalCluster, killed_at: float, before: int, world: int) -> dict[str, Any]:
    first = cluster.wait_for_world(world, killed_at, timeout=240)
    return {
        "recover_s": round(first["ts"] - killed_at, 3),
        "steps_lost": max(0, before - (first["step"] - 1)),
        "last_step_before": before,
        "first_step_after": first["step"],
        "source": sorted(
            {str(e.get("source")) for e in cluster.events("ckpt.load") if e["ts"] > killed_at}
        ),
    }


def worker_kill(run_dir: Path, nproc: int, backend: str) -> dict[str, Any]:
    """kill -9 of one worker; the agent restarts the group from the node's snapshot."""
    with _cluster(run_dir, nproc, backend) as cluster:
        cluster.start("n1")
        cluster.wait_for_step(30, timeout=300)
        victim = cluster.workers_of("n1")[0]
        before = cluster.last_step()
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        return _recovery(cluster, killed_at, before, nproc)


def node_kill(run_dir: Path, backend: str) -> dict[str, Any]:
    """Two nodes with one GPU each; kill -9 of one whole node; the survivor goes on alone."""
    with _cluster(run_dir, 1, backend) as cluster:
        cluster.start("n1", extra_env={"CUDA_VISIBLE_DEVICES": "0"})
        cluster.start("n2", extra_env={"CUDA_VISIBLE_DEVICES": "1"})
        cluster.wait_for_world(2, 0.0, timeout=300)
        cluster.train_more(20, timeout=300)
        before = cluster.last_step()
        killed_at = time.time()
        cluster.kill_node("n2")
        return _recovery(cluster, killed_at, before, 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run on gloo/CPU (tests the script)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.cpu
    if not cuda and not args.cpu:
        print(json.dumps({"skipped": "No CUDA device here; run this on a GPU machine."}))
        return 0
    gpus = torch.cuda.device_count() if cuda else 2
    backend = "nccl" if cuda else "gloo"
    result: dict[str, Any] = {
        "provenance": provenance(),
        "backend": backend,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "gpus": gpus if cuda else 0,
    }
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    result["snapshot"] = snapshot_stall(device, args.rounds, args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        result["worker_kill"] = worker_kill(
            Path(tmp) / "worker", min(gpus, 2) if cuda else 1, backend
        )
        if gpus >= 2:
            result["node_kill"] = node_kill(Path(tmp) / "node", backend)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
