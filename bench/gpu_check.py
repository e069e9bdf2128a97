"""The NCCL path on a CUDA machine: snapshot stall, restarts, in-place re-forms; JSON out.

Three check sets (``--checks``, all by default), each on the real code paths:

``snapshot``: ResNet-18 (CIFAR-sized input, batch 128) trains in this process on ``cuda:0``;
short runs with and without per-step snapshots (pinned staging on a side stream,
:class:`elastic.worker.snapshot.Snapshotter`) interleave. Reports the step time of each
(medians), the median paired ratio, and the stall the training thread saw per snapshot.

``restart``: one node (``elastic-agent``, one worker per GPU, up to two) trains our CNN
worker; one worker gets ``kill -9`` and its agent restarts the group from the node's
shared-memory snapshot (``worker_kill``). With two GPUs or more, two nodes (one GPU each)
train and one whole node gets ``kill -9`` (``node_kill``).

``inplace``: the in-place re-form scenarios. ``--ranks`` agents (2 to 4, one worker each)
run on this machine, agent *i* on GPU ``i % gpus`` (``CUDA_VISIBLE_DEVICES``; one GPU is
shared by all), on one embedded etcd, on NCCL when there is a GPU per rank (NCCL refuses
two ranks of a communicator on one GPU: with fewer GPUs they run on gloo, see
:data:`SHARED_GPU`, unless ``--inplace-backend`` says otherwise). Each of two workloads:

* ``user``: a user's script on :class:`elastic.Run` (this file with ``--worker``: a small
  CNN under DDP on ``cuda``, ``elastic.init_process_group(backend)``);
* ``cnn``: our worker (``elastic_tools.training.worker``, ``configs/default.yaml``);

meets each fault, always on the last agent's node: ``worker_kill`` (``kill -9`` of its
worker), ``node_kill`` (``kill -9`` of the agent and its worker) and ``worker_freeze``
(SIGSTOP of its worker for up to ``--event-timeout`` s, SIGCONT after). Each scenario
reports ``recover_s`` (the fault to the first step completed after a re-form or restart
event), ``steps_lost``, the workers' pids before and after (``in_place``: every survivor
kept its process), the backend asked for and the one the workers reported (user script),
``fallbacks`` (``recovery.fallback`` events: an in-place re-form that gave up and
restarted) and ``restarts`` (``worker.restart`` events). A scenario that does not recover
within ``--event-timeout`` reports ``recovered: false`` and the reason.

On CUDA the result also holds ``torch_nccl``: whether this torch registers the ``nccl2``
backend (ProcessGroupNCCL2) and whether it supports ``_reconfigure`` and shrinking.

Usage: ``bash bench/gpu_check.sh [--checks inplace] [--ranks 3] [--only user:node_kill]
[--repeats K] [--json-out PATH]``; ``--dry-run`` prints the plan (what would run, on which
devices) and exits 0 anywhere; ``--cpu`` runs the same checks on gloo to test the script
where there is no GPU. Run for real without CUDA and without ``--cpu``, it says so in one
sentence on stderr and exits :data:`NO_GPU_EXIT`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages first

import torch

from elastic_tools.harness import benchjson
from elastic_tools.harness.cluster import (
    REPO,
    AgentOptions,
    LocalCluster,
    WaitTimeout,
    agent_env,
    provenance,
    pythonpath,
)

if REPO is None:  # not expected: sys.path starts with this checkout
    raise SystemExit("bench/gpu_check.py runs from a source checkout of elastic.")
CONFIG = REPO / "configs" / "default.yaml"
TINY = REPO / "configs" / "tiny.yaml"  # our worker on the CPU (gloo): the small CNN
SCRIPT = Path(__file__).resolve()

NO_GPU_EXIT = 3  # run for real on a machine without CUDA (and without --cpu)
CHECKS = ("snapshot", "restart", "inplace")
WORKLOADS = ("user", "cnn")
FAULTS = ("worker_kill", "node_kill", "worker_freeze")
STEP_S = 0.1  # pacing of the in-place scenarios' steps (job.min_step_s, --step-delay)
WARM_STEPS = 10  # steps at full world size before each fault
# Events that mark a re-form or a restart: the first step after the earliest of them, once
# a fault happened, is the recovered job's (a step in flight at the fault may still end).
REFORM_KINDS = ("rdzv.round", "rdzv.inplace", "recovery.inplace", "recovery.resume")
WORKER_LINE = re.compile(r"gpu_check worker pid=(\d+) backend=(\S+) device=(\S+) in_place=(\S+)")


# -- the plan ------------------------------------------------------------------------------


def _scenario_name(text: str) -> tuple[str, str]:
    workload, _, fault = text.partition(":")
    if workload not in WORKLOADS or fault not in FAULTS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a scenario; name one as WORKLOAD:FAULT with WORKLOAD one of "
            f"{', '.join(WORKLOADS)} and FAULT one of {', '.join(FAULTS)}."
        )
    return workload, fault


def _ranks(text: str) -> int:
    value = int(text)
    if not 2 <= value <= 4:
        raise argparse.ArgumentTypeError(f"--ranks is {value}; give 2, 3 or 4 local ranks.")
    return value


def _checks(text: str) -> list[str]:
    names = [c for c in text.split(",") if c]
    unknown = sorted(set(names) - set(CHECKS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"--checks {text!r} names no known check set; give a comma list of {', '.join(CHECKS)}."
        )
    return names


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="run on gloo/CPU (tests the script)")
    p.add_argument("--dry-run", action="store_true", help="print the plan as JSON and exit 0")
    p.add_argument("--checks", type=_checks, default=list(CHECKS), help="comma list of sets")
    p.add_argument("--ranks", type=_ranks, default=3, help="in-place: agents, one rank each")
    p.add_argument(
        "--only", type=_scenario_name, action="append", help="in-place: WORKLOAD:FAULT (repeat)"
    )
    p.add_argument("--repeats", type=int, default=1, help="in-place: runs of each scenario")
    p.add_argument(
        "--inplace-backend",
        choices=("nccl", "gloo"),
        help="in-place: the workers' backend (default nccl on CUDA, gloo with --cpu; gloo on "
        "CUDA: the user script's tensors stay on the GPU, our worker then trains on the CPU)",
    )
    p.add_argument("--event-timeout", type=float, default=120.0, help="seconds to recover")
    p.add_argument(
        "--group-timeout",
        type=float,
        default=60.0,
        help="in-place: the workers' process-group timeout, seconds (NCCL's watchdog ends a "
        "hung collective after it)",
    )
    p.add_argument("--rounds", type=int, default=7, help="snapshot: interleaved rounds")
    p.add_argument("--steps", type=int, default=20, help="snapshot: steps per run")
    p.add_argument("--json-out", type=Path)
    p.add_argument(
        "--work-dir",
        type=Path,
        help="keep the runs' logs and event logs here (default: a temp dir)",
    )
    # The user's script on elastic.Run, as the in-place scenarios' agents run it.
    w = p.add_argument_group("worker (run by the agents, not by hand)")
    w.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    w.add_argument("--backend", default="nccl", help=argparse.SUPPRESS)
    w.add_argument("--ckpt", default="", help=argparse.SUPPRESS)
    w.add_argument("--step-delay", type=float, default=STEP_S, help=argparse.SUPPRESS)
    w.add_argument("--timeout", type=float, default=60.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be 1 or more.")
    return args


def backend_for(cuda: bool) -> str:
    return "nccl" if cuda else "gloo"


SHARED_GPU = (
    "NCCL refuses two ranks of one communicator on one GPU (ncclInvalidUsage: Duplicate GPU "
    "detected), so with fewer GPUs than --ranks the in-place scenarios run on gloo (CUDA "
    "tensors for the user script); pass --inplace-backend nccl to see NCCL's own answer"
)


def inplace_backend(args: argparse.Namespace, cuda: bool, gpus: int) -> tuple[str, str | None]:
    """The in-place scenarios' backend and, when it is not the one asked for, why."""
    if args.inplace_backend:
        return args.inplace_backend, None
    if cuda and gpus < args.ranks:
        return "gloo", SHARED_GPU
    return backend_for(cuda), None


def devices_for(ranks: int, gpus: int) -> list[str | None]:
    """Each agent's ``CUDA_VISIBLE_DEVICES``: GPU ``i % gpus``; None without GPUs."""
    return [str(i % gpus) if gpus else None for i in range(ranks)]


def scenarios(args: argparse.Namespace) -> list[tuple[str, str]]:
    if args.only:
        return list(dict.fromkeys(args.only))
    return [(w, f) for w in WORKLOADS for f in FAULTS]


def plan(args: argparse.Namespace, cuda: bool, gpus: int) -> dict[str, Any]:
    """What a run with ``args`` does on a machine with ``gpus`` CUDA devices."""
    backend = backend_for(cuda)
    chosen, why = inplace_backend(args, cuda, gpus)
    out: dict[str, Any] = {
        "cuda": cuda,
        "gpus": gpus,
        "backend": backend,
        "checks": args.checks,
    }
    if "restart" in args.checks:
        out["restart"] = ["worker_kill", *(["node_kill"] if gpus >= 2 or not cuda else [])]
    if "inplace" in args.checks:
        devices = devices_for(args.ranks, gpus if cuda else 0)
        if why:
            out["inplace_backend_why"] = why
        out["inplace"] = [
            {
                "workload": workload,
                "fault": fault,
                "ranks": args.ranks,
                "backend": chosen,
                "group_timeout_s": args.group_timeout,
                "devices": devices,
                "victim": f"n{args.ranks}",
                "repeats": args.repeats,
            }
            for workload, fault in scenarios(args)
        ]
    return out


# -- what this torch offers for NCCL re-forms ----------------------------------------------


def nccl_probe() -> dict[str, Any]:
    """torch's NCCL fault-tolerance surface on this machine (CUDA only: constructing an NCCL
    backend without a GPU aborts the process): is ``nccl2`` registered, does it support
    ``_reconfigure`` and shrinking, and the watchdog's error handling mode."""
    import torch.distributed as dist

    out: dict[str, Any] = {
        "nccl2_registered": dist.is_backend_available("nccl2"),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"),
        "TORCH_DIST_USE_NCCL2": os.environ.get("TORCH_DIST_USE_NCCL2"),
    }
    try:
        from torch._C._distributed_c10d import ProcessGroupNCCL, ProcessGroupNCCL2

        options = ProcessGroupNCCL.Options()
        options.enable_reconfigure = True
        pg = ProcessGroupNCCL2(dist.HashStore(), 0, 1, options)
        out.update(
            nccl2_supports_reconfigure=pg.supports_reconfigure,
            nccl2_supports_shrinking=pg.supports_shrinking,
            nccl2_handle=pg.get_reconfigure_handle(),
        )
    except (ImportError, RuntimeError) as exc:
        out["nccl2_error"] = str(exc).splitlines()[0][:300]
    return out


# -- snapshot stall (in this process) ------------------------------------------------------


def snapshot_stall(device: torch.device, rounds: int, steps: int) -> dict[str, Any]:
    """Interleaved short runs with and without per-step snapshots, in this process."""
    import torchvision

    from elastic.worker.snapshot import SnapshotStore, Snapshotter

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


# -- restarts (one node, our worker) -------------------------------------------------------


def _cnn_overrides(backend: str, group_timeout: float | None = None) -> dict[str, Any]:
    """Our worker's settings: paced steps, a step event each; ResNet-18 at 32x32 on NCCL."""
    big = {"data.image_size": 32, "data.num_samples": 100000} if backend == "nccl" else {}
    return {
        **({"distributed.timeout_s": group_timeout} if group_timeout else {}),
        "distributed.backend": backend,
        **big,
        "job.min_step_s": STEP_S,
        "job.log_every": 1,
        "checkpoint.interval": 100,
    }


def _cluster(run_dir: Path, nproc: int, backend: str) -> LocalCluster:
    options = AgentOptions(nnodes="1:2", nproc=nproc, max_restarts=5)
    return LocalCluster(
        run_dir,
        options=options,
        config=CONFIG if backend == "nccl" else TINY,
        max_steps=5000,
        overrides=_cnn_overrides(backend),
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


def node_kill(run_dir: Path, backend: str, cuda: bool) -> dict[str, Any]:
    """Two nodes with one GPU each; kill -9 of one whole node; the survivor goes on alone."""
    with _cluster(run_dir, 1, backend) as cluster:
        for i, name in enumerate(("n1", "n2")):
            cluster.start(name, extra_env={"CUDA_VISIBLE_DEVICES": str(i)} if cuda else None)
        cluster.wait_for_world(2, 0.0, timeout=300)
        cluster.train_more(20, timeout=300)
        before = cluster.last_step()
        killed_at = time.time()
        cluster.kill_node("n2")
        return _recovery(cluster, killed_at, before, 1)


# -- in-place re-forms ---------------------------------------------------------------------


def inplace_cluster(
    run_dir: Path, workload: str, backend: str, ranks: int, group_timeout: float
) -> LocalCluster:
    """``ranks`` agents of one worker each, running ``workload``."""
    script = None
    if workload == "user":
        script = [
            str(SCRIPT),
            "--worker",
            f"--backend={backend}",
            f"--ckpt={run_dir / 'ckpt'}",
            f"--step-delay={STEP_S}",
            f"--timeout={group_timeout:g}",
        ]
    return LocalCluster(
        run_dir,
        options=AgentOptions(nnodes=f"1:{ranks}", nproc=1, max_restarts=10),
        config=CONFIG if backend == "nccl" else TINY,
        max_steps=100000,
        overrides=_cnn_overrides(backend, group_timeout),
        env=agent_env(PYTHONPATH=pythonpath()),
        cwd=REPO,
        script=script,
    )


def first_recovered_step(cluster: LocalCluster, fault_at: float) -> dict[str, Any] | None:
    """The first step completed after the first re-form or restart event since the fault."""
    marks = [e["ts"] for e in cluster.events() if e["kind"] in REFORM_KINDS]
    marks = [ts for ts in marks if ts > fault_at]
    if not marks:
        return None
    reformed = min(marks)
    return next((e for e in cluster.steps() if e["ts"] > reformed), None)


def reported_backends(cluster: LocalCluster, names: Sequence[str]) -> dict[str, list[str]]:
    """The backends the user script's workers reported, by node (one per worker start)."""
    found: dict[str, list[str]] = {}
    for name in names:
        lines = WORKER_LINE.findall(cluster.nodes[name].output())
        found[name] = [f"{backend}/{device}/in_place={flag}" for _, backend, device, flag in lines]
    return found


def _signal(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def inplace_scenario(
    run_dir: Path,
    workload: str,
    fault: str,
    backend: str,
    devices: Sequence[str | None],
    timeout: float,
    group_timeout: float,
) -> dict[str, Any]:
    """One fault on the last node of ``len(devices)`` nodes; the figures of its recovery."""
    ranks = len(devices)
    names = [f"n{i + 1}" for i in range(ranks)]
    victim, survivors = names[-1], names[:-1]
    entry: dict[str, Any] = {"workload": workload, "fault": fault, "ranks": ranks}
    entry["backend_requested"] = backend
    with inplace_cluster(run_dir, workload, backend, ranks, group_timeout) as cluster:
        for name, device in zip(names, devices, strict=True):
            cluster.start(name, extra_env={"CUDA_VISIBLE_DEVICES": device} if device else None)
        frozen: list[int] = []
        before: dict[str, list[int]] | None = None
        fault_at: float | None = None
        try:
            cluster.wait_for_world(ranks, 0.0, timeout=max(timeout, 300))
            cluster.train_more(WARM_STEPS, timeout)
            before = {n: cluster.workers_of(n) for n in names}
            step_before = cluster.last_step()
            fault_at = time.time()
            if fault == "worker_kill":
                _signal(before[victim], signal.SIGKILL)
            elif fault == "node_kill":
                cluster.kill_node(victim)
            else:
                frozen = before[victim]
                _signal(frozen, signal.SIGSTOP)
            start = fault_at
            first = cluster.wait_for(
                lambda: first_recovered_step(cluster, start), "a recovered step", timeout
            )
        except WaitTimeout as exc:
            entry.update(recovered=False, error=str(exc))
            return _finish(cluster, entry, frozen, names, survivors, before, fault_at)
        entry.update(
            recovered=True,
            recover_s=round(first["ts"] - fault_at, 3),
            steps_lost=max(0, step_before - (first["step"] - 1)),
            last_step_before=step_before,
            first_step_after=first["step"],
            world_after=first["world_size"],
        )
        return _finish(cluster, entry, frozen, names, survivors, before, fault_at)


def _finish(
    cluster: LocalCluster,
    entry: dict[str, Any],
    frozen: list[int],
    names: Sequence[str],
    survivors: Sequence[str],
    before: dict[str, list[int]] | None,
    fault_at: float | None,
) -> dict[str, Any]:
    """Pids after, the path taken, fallbacks and restarts; thaw a frozen worker."""
    after = {n: cluster.workers_of(n) for n in survivors if cluster.nodes[n].running()}
    _signal(frozen, signal.SIGCONT)
    since = fault_at or 0.0
    events = [e for e in cluster.events() if e["ts"] > since]
    inplace = [e for e in events if e["kind"] == "recovery.inplace"]
    entry["pids_before"] = before
    entry["pids_after"] = after
    if before is not None:
        kept = all(after.get(n) == before[n] for n in survivors)
        entry["in_place"] = kept and bool(inplace)
    entry["inplace_reforms"] = len(inplace)
    entry["fallbacks"] = sum(1 for e in events if e["kind"] == "recovery.fallback")
    entry["restarts"] = sum(1 for e in events if e["kind"] == "worker.restart")
    if entry["workload"] == "user":
        entry["backend_reported"] = reported_backends(cluster, names)
    if not entry.get("recovered"):
        entry["logs_tail"] = cluster.logs(tail=1500)[-3000:]
    return entry


def inplace_all(base: Path, args: argparse.Namespace, cuda: bool, gpus: int) -> dict[str, Any]:
    backend = inplace_backend(args, cuda, gpus)[0]
    devices = devices_for(args.ranks, gpus)
    runs: list[dict[str, Any]] = []
    for k in range(args.repeats):
        for workload, fault in scenarios(args):
            run_dir = base / f"{workload}-{fault}-{k}"
            runs.append(
                inplace_scenario(
                    run_dir,
                    workload,
                    fault,
                    backend,
                    devices,
                    args.event_timeout,
                    args.group_timeout,
                )
            )
    summary = {
        f"{w}:{f}": {
            "recover_s": benchjson.spread(
                [r.get("recover_s") for r in runs if (r["workload"], r["fault"]) == (w, f)]
            ),
            "steps_lost": benchjson.spread(
                [r.get("steps_lost") for r in runs if (r["workload"], r["fault"]) == (w, f)]
            ),
            "in_place": sum(
                1 for r in runs if (r["workload"], r["fault"]) == (w, f) and r.get("in_place")
            ),
            "fallbacks": sum(r["fallbacks"] for r in runs if (r["workload"], r["fault"]) == (w, f)),
        }
        for w, f in scenarios(args)
    }
    return {"devices": devices, "summary": summary, "runs": runs}


# -- the user's script (the agents run this file with --worker) ----------------------------


def user_worker(args: argparse.Namespace) -> int:
    """A small CNN under DDP on elastic.Run, on ``cuda`` when there is one; the group from
    ``elastic.init_process_group(backend)`` (in place where the agent and backend allow)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    import elastic
    from elastic.node.procs import WORKER_NAME, set_name

    set_name(WORKER_NAME)  # LocalCluster.workers_of finds workers by this name
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    backend = None if args.backend == "gloo" else args.backend
    elastic.init_process_group(backend, timeout=timedelta(seconds=args.timeout))

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(2048, 3, 32, 32, generator=gen)
    labels = torch.randint(0, 10, (2048,), generator=gen)
    dataset = TensorDataset(images, labels)
    sampler: DistributedSampler[int] = DistributedSampler(
        dataset, shuffle=True, seed=0, drop_last=True
    )
    loader = DataLoader(dataset, batch_size=32, sampler=sampler, drop_last=True)
    net = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 8 * 8, 10),
    ).to(device)
    model = DDP(net, device_ids=[device] if cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    run = elastic.Run(model, optimizer, None, sampler, checkpoint_url=args.ckpt)
    print(
        f"gpu_check worker pid={os.getpid()} backend={dist.get_backend()} device={device} "
        f"in_place={run._group.in_place}",
        flush=True,
    )
    for _ in run.epochs(100000):
        for x, y in run.batches(loader):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()
            time.sleep(args.step_delay)
    return 0


# -- main ----------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        return user_worker(args)
    cuda = torch.cuda.is_available() and not args.cpu
    gpus = torch.cuda.device_count() if cuda else 0
    if args.dry_run:
        return benchjson.output({"dry_run": True, **plan(args, cuda, gpus)})
    if not cuda and not args.cpu:
        print(
            "No CUDA device is present on this machine, so the NCCL checks cannot run: run "
            "this on a GPU machine, or pass --cpu to exercise the script on gloo.",
            file=sys.stderr,
        )
        return NO_GPU_EXIT
    backend = backend_for(cuda)
    result: dict[str, Any] = {
        "provenance": provenance(),
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        **plan(args, cuda, gpus),
    }
    if cuda:
        result["torch_nccl"] = nccl_probe()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    with contextlib.ExitStack() as stack:
        base = args.work_dir or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="gpu-check-"))
        )
        base.mkdir(parents=True, exist_ok=True)
        if "snapshot" in args.checks:
            result["snapshot"] = snapshot_stall(device, args.rounds, args.steps)
        if "restart" in args.checks:
            result["worker_kill"] = worker_kill(base / "worker", max(1, min(gpus, 2)), backend)
            if gpus >= 2 or not cuda:
                result["node_kill"] = node_kill(base / "node", backend, cuda)
        if "inplace" in args.checks:
            result["inplace"] = inplace_all(base / "inplace", args, cuda, gpus)
    return benchjson.output(result, args.json_out)


if __name__ == "__main__":
    raise SystemExit(main())
