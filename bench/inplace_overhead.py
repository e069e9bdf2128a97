"""What the in-place path costs a step when nothing fails (issue 27, item 1).

``system`` (the default): the same user script (``bench/overhead_user.py``: a small MLP under
DDP on ``elastic.Run``) runs under 2 ``elastic-agent`` nodes on an embedded etcd, once on the
restart path (the script's own ``dist.init_process_group``) and once in place
(``elastic.init_process_group()``: DDP's all-reduce and Run's agreement through the step
guard), interleaved, ``--runs`` times each. Each run measures every step length: the step
is paced by compute (a number of 128x128 matrix products, one thread, calibrated once here
to ``--step-ms`` and passed the same to every run), in blocks cycled within the run.

``micro``: in one pair of gloo processes (no agent, no ``Run``), blocks of steps of a plain
DDP model against the same model with the step guard installed (``--guard`` may name an
older guard.py to compare), interleaved; the quick loop for work on the guard.

Prints JSON: per path and step length the median and min-max of the per-run medians (ms),
the ratio in place / restart, the settings, the git commit and the load average.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from elastic_tools.harness.cluster import (
    REPO,
    AgentOptions,
    LocalCluster,
    agent_env,
    provenance,
    pythonpath,
)

SCRIPT = Path(__file__).resolve().parent / "overhead_user.py"
PATHS = ("restart", "inplace")


def calibrate(step_ms: float) -> int:
    """How many 128x128 products (one thread) take ``step_ms`` ms here, now."""
    torch.set_num_threads(1)
    a = torch.randn(128, 128)
    n, took = 50, 0.0
    while took < 0.2:
        n *= 2
        t = time.perf_counter()
        for _ in range(n):
            torch.mm(a, a)
        took = time.perf_counter() - t
    return max(1, round(step_ms / 1e3 * n / took))


def _stats(values: list[float]) -> dict[str, Any]:
    return {
        "median_ms": round(statistics.median(values) * 1e3, 3),
        "min_ms": round(min(values) * 1e3, 3),
        "max_ms": round(max(values) * 1e3, 3),
        "n": len(values),
    }


def one_run(path: str, work: list[int], args: argparse.Namespace, root: Path) -> dict[str, float]:
    run_dir = root / f"{path}-{uuid.uuid4().hex[:6]}"
    out = run_dir / "times.json"
    script = [
        str(SCRIPT),
        f"--work={','.join(map(str, work))}",
        f"--block={args.block}",
        f"--steps={args.steps}",
        f"--out={out}",
        *(["--in-place"] if path == "inplace" else []),
    ]
    options = AgentOptions(nnodes="2", max_restarts=0, monitor_interval=0.3, join_timeout=60)
    cluster = LocalCluster(
        run_dir,
        f"overhead-{uuid.uuid4().hex[:8]}",
        options=options,
        env=agent_env(LOGLEVEL="WARNING", PYTHONPATH=pythonpath()),
        cwd=REPO,
        script=script,
    )
    with cluster:
        nodes = [cluster.start(name) for name in ("n1", "n2")]
        codes = [node.wait(args.timeout) for node in nodes]
    if codes != [0, 0] or not out.is_file():
        raise SystemExit(f"A {path} run failed (agents exited {codes}): see {run_dir}.")
    times = json.loads(out.read_text())
    return {w: statistics.median(ts) for w, ts in times.items()}


def system(args: argparse.Namespace) -> dict[str, Any]:
    work = [calibrate(ms) for ms in args.step_ms]
    names = {str(w): f"{ms:g}ms" for w, ms in zip(work, args.step_ms, strict=True)}
    medians: dict[str, dict[str, list[float]]] = {p: {n: [] for n in names.values()} for p in PATHS}
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="overhead-") as tmp:
        for i in range(args.runs):
            for path in PATHS if i % 2 == 0 else PATHS[::-1]:
                got = one_run(path, work, args, Path(tmp))
                for w, median in got.items():
                    medians[path][names[w]].append(median)
                loads.append(os.getloadavg()[0])
                print(f"run {i} {path}: {got}", file=sys.stderr)
    result: dict[str, Any] = {"mode": "system", "steps": {}}
    for name in names.values():
        row = {p: _stats(medians[p][name]) for p in PATHS}
        row["ratio"] = round(row["inplace"]["median_ms"] / row["restart"]["median_ms"], 4)
        # Each run's pair (the two paths back to back, in alternating order): a drift of
        # the machine's speed over the whole run cancels within a pair.
        inplace, restart = medians["inplace"][name], medians["restart"][name]
        pairs = [a / b for a, b in zip(inplace, restart, strict=True)]
        row["ratio_paired"] = {
            "median": round(statistics.median(pairs), 4),
            "min": round(min(pairs), 4),
            "max": round(max(pairs), 4),
            "n": len(pairs),
        }
        result["steps"][name] = row
    result["settings"] = {
        "script": "bench/overhead_user.py (MLP 64-256-256-10, batch 16 a rank, AdamW, cosine)",
        "nodes": 2,
        "pacing": "compute: 128x128 matrix products, one thread, calibrated to each step length",
        "products_per_step": dict(zip(names.values(), work, strict=True)),
        "steps_per_run": args.steps,
        "block": args.block,
        "runs_per_path": args.runs,
        "figure": "each run's median step time (rank 0); median and min-max over runs; "
        "ratio_paired: in place / restart within each back-to-back pair, median and min-max",
    }
    result["load_1m"] = {"min": min(loads), "max": max(loads)}
    return result


# -- micro -----------------------------------------------------------------------------------


def _guard_class(path: str | None) -> Any:
    if path is None:
        from elastic.worker.guard import StepGuard

        return StepGuard
    spec = importlib.util.spec_from_file_location("guard_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.StepGuard


def _micro_rank(rank: int, port: int, args: argparse.Namespace, work: list[int], q: Any) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    modes = ["plain", "guard", *(["other"] if args.guard else [])]
    models, opts, guards = {}, {}, {}
    for mode in modes:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU())
        ddp = torch.nn.parallel.DistributedDataParallel
        models[mode] = ddp(nn.Sequential(net, nn.Linear(256, 10)))
        opts[mode] = torch.optim.AdamW(models[mode].parameters(), lr=1e-3)
    guards["guard"] = _guard_class(None)()
    if args.guard:
        guards["other"] = _guard_class(args.guard)()
    for mode, guard in guards.items():
        guard.install(models[mode], opts[mode], None)
    x, y, a = torch.randn(16, 64), torch.randint(0, 10, (16,)), torch.randn(128, 128)
    times: dict[str, list[float]] = {f"{m}/{w}": [] for m in modes for w in work}
    for block in range(args.blocks):
        for w in work:
            for mode in modes[block % len(modes) :] + modes[: block % len(modes)]:
                guard = guards.get(mode)
                for i in range(args.block):
                    t = time.perf_counter()
                    for _ in range(w):
                        torch.mm(a, a)
                    opts[mode].zero_grad()
                    F.cross_entropy(models[mode](x), y).backward()
                    opts[mode].step()
                    flags = torch.zeros(4, dtype=torch.float64)
                    if guard is None:
                        dist.all_reduce(flags)
                    else:
                        assert guard.run(lambda f=flags: dist.all_reduce(f, async_op=True))
                        guard.committed = False
                    if i >= 3:
                        times[f"{mode}/{w}"].append(time.perf_counter() - t)
    if rank == 0:
        q.put(times)
    dist.barrier()
    dist.destroy_process_group()
    for guard in guards.values():
        guard.close()


def micro(args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.multiprocessing as mp

    work = [calibrate(ms) for ms in args.step_ms]
    ctx = mp.get_context("spawn")
    master = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False
    )
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_micro_rank, args=(r, master.port, args, work, q)) for r in range(2)
    ]
    load0 = os.getloadavg()[0]
    for p in procs:
        p.start()
    times = q.get(timeout=args.timeout)
    for p in procs:
        p.join(60)
    steps: dict[str, Any] = {}
    for w, ms in zip(work, args.step_ms, strict=True):
        row = {m: _stats(v) for m in ("plain", "guard", "other") if (v := times.get(f"{m}/{w}"))}
        for m in ("guard", "other"):
            if m in row:
                row[f"ratio_{m}"] = round(row[m]["median_ms"] / row["plain"]["median_ms"], 4)
        steps[f"{ms:g}ms"] = row
    return {
        "mode": "micro",
        "guard": "elastic/worker/guard.py",
        "other": args.guard,
        "steps": steps,
        "settings": {"block": args.block, "blocks": args.blocks, "products": work},
        "load_1m": {"min": load0, "max": os.getloadavg()[0]},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", nargs="?", choices=("system", "micro"), default="system")
    p.add_argument("--step-ms", type=float, nargs="+", default=[20.0, 100.0])
    p.add_argument("--runs", type=int, default=5, help="system: runs per path")
    p.add_argument("--steps", type=int, default=220, help="system: steps a run")
    p.add_argument("--block", type=int, default=25, help="steps a block of one step length")
    p.add_argument("--blocks", type=int, default=6, help="micro: blocks per mode and length")
    p.add_argument("--guard", default=None, help="micro: a guard.py to use instead")
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args(argv)
    result = system(args) if args.mode == "system" else micro(args)
    result.update(provenance())
    result["cpus"] = os.cpu_count()
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
