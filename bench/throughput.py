"""Worker throughput with a checkpoint every 10 steps vs checkpointing off, in one run;
with ``--snapshot``: the cost of per-step shared-memory snapshots (elastic.Run).

Runs the real worker loop (:class:`elastic_tools.training.worker.Worker`, world of one, gloo)
in alternating blocks, ``--rounds`` times: ``--steps`` steps with checkpointing
off, then ``--steps`` steps with an async checkpoint every ``--interval`` steps
(the block waits for its last save to be durable, so no write cost escapes
it). Prints JSON with samples/s of both and the relative overhead.

With ``--snapshot`` it trains ResNet-18 through :class:`elastic.Run` in ``--pairs``
rounds of ``--steps``-step blocks, one per mode: snapshots off, after every step, and
``"auto"`` (the adaptive interval, decided during the warm-up), interleaved in one
process (the order rotates each round). It reports, for "every" and "auto", the median
of the per-round time ratios against "off" with their 10th/90th percentiles, the
snapshot's own time per step (on the training thread, in the background copy, and
blocking the next optimizer step), the interval "auto" chose, the time of one
failure-time snapshot, then (unless ``--skip-peer``) the peer transfer of that state
between two gloo processes against plain loopback TCP measured in the same run.

Usage: ``python bench/throughput.py [--config configs/default.yaml] [k=v ...]`` or
``python bench/throughput.py --snapshot [--pairs 20 --steps 5]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from elastic_tools.harness.cluster import provenance
from elastic_tools.training.config import load_config
from elastic_tools.training.worker import Worker, _setup_torch, init_distributed


def _block(worker: Worker, steps: int, interval: int | None) -> float:
    """Run ``steps`` steps; return samples/s (including the wait for the last save)."""
    run = worker.run
    assert run is not None
    started = time.perf_counter()
    for _ in range(steps):
        result = worker.trainer.step(worker.position.cursor)
        worker.position.cursor = result.cursor
        run.train.advance()
        if interval and run.step % interval == 0:
            run.save(block=False)
    run.wait()
    seconds = time.perf_counter() - started
    return steps * worker.sampler.global_batch_size / seconds


# -- snapshot overhead (``--snapshot``) ------------------------------------------------------


def _snapshot_block(
    run: Any, loop: Iterator[int], model: Any, opt: Any, batch: Any, steps: int
) -> float:
    """``steps`` training steps from ``loop`` (one long-lived ``run.steps``); seconds per step.

    A block ends after the last step's body: that step's boundary (its snapshot, if due)
    runs at the start of the mode's next block, so every block holds ``steps`` boundaries.
    """
    import torch.nn.functional as F

    x, y = batch
    run._jit.restart_clock()  # the pause between blocks is no step (the "auto" timing)
    started = time.perf_counter()
    for _ in range(steps):
        next(loop)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return (time.perf_counter() - started) / steps


def _loopback_mb_s(nbytes: int) -> float:
    """Plain TCP over 127.0.0.1 between two threads of this process (MB/s)."""
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    payload = memoryview(bytearray(1 << 22))

    def send() -> None:
        with socket.create_connection(("127.0.0.1", port)) as s:
            sent = 0
            while sent < nbytes:
                s.sendall(payload[: min(len(payload), nbytes - sent)])
                sent += min(len(payload), nbytes - sent)

    thread = threading.Thread(target=send)
    started = time.perf_counter()
    thread.start()
    conn, _ = server.accept()
    buf = bytearray(1 << 22)
    got = 0
    while got < nbytes:
        n = conn.recv_into(buf)
        if not n:
            break
        got += n
    seconds = time.perf_counter() - started
    thread.join()
    conn.close()
    server.close()
    return got / 1e6 / seconds


def _peer_rank(rank: int, tmp: str, out: str) -> None:
    """One of two gloo ranks: rank 0 holds a ResNet-18 snapshot, rank 1 receives it."""
    import os

    import torchvision

    from elastic.worker import exchange
    from elastic.worker.snapshot import SnapshotStore, Snapshotter

    dist.init_process_group(
        "gloo", store=dist.FileStore(os.path.join(tmp, "store"), 2), rank=rank, world_size=2
    )
    store = SnapshotStore("bench", rank, owner=os.getpid(), directory=tmp)
    meta, data = None, None
    if rank == 0:
        model = torchvision.models.resnet18(num_classes=10)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for p in model.parameters():
            opt.state[p]["momentum_buffer"] = torch.randn_like(p)
        snaps = Snapshotter(store)
        snaps.take(1, 0, {"model": model.state_dict(), "optim": opt.state_dict()}, set())
        snaps.wait()
        _, meta, data = store.read()  # type: ignore[misc]
    times = []
    for _ in range(3):
        dist.barrier()
        started = time.perf_counter()
        got = exchange.stream(meta, data, 0, receive=rank == 1)
        times.append(time.perf_counter() - started)
    if rank == 1:
        assert got is not None
        with open(out, "w") as f:
            json.dump({"bytes": got[1].numel(), "seconds": min(times)}, f)
    store.remove()
    dist.destroy_process_group()


MODES = {"off": 0, "every": 1, "auto": "auto"}


def _per_step(stats: dict[str, float], steps: int) -> dict[str, float]:
    """The snapshot's own milliseconds per training step."""
    return {
        f"{k}_ms_per_step": round(1e3 * stats[k] / max(steps, 1), 3)
        for k in ("sync_s", "copy_s", "wait_s")
    }


def _quantiles(ratios: list[float]) -> dict[str, float]:
    q = statistics.quantiles(ratios, n=10) if len(ratios) > 1 else ratios * 9
    return {
        "overhead_pct_median": round(100 * (statistics.median(ratios) - 1), 2),
        "overhead_pct_p10": round(100 * (q[0] - 1), 2),
        "overhead_pct_p90": round(100 * (q[-1] - 1), 2),
    }


def _failure_write_s(run: Any) -> float:
    """Seconds for a failure-time snapshot (synchronous) of the current state."""
    jit = run._jit
    jit.wait()
    jit.snapshotter.last_step = -1  # pretend the newest snapshot is older: force a write
    started = time.perf_counter()
    assert jit.failed("benchmark")
    return time.perf_counter() - started


def snapshot_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Interleaved short runs with snapshots off, every step and "auto", and the peer transfer."""
    import torch.multiprocessing as mp
    import torchvision

    from elastic.worker.session import Run

    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = torchvision.models.resnet18(num_classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batch = (
        torch.randn(args.batch, 3, args.image_size, args.image_size),
        torch.randint(0, 10, (args.batch,)),
    )
    tag = f"bench-{os.getpid()}"
    runs = {m: Run(model, opt, snapshot_every=e, run_id=f"{tag}-{m}") for m, e in MODES.items()}
    loops = {m: run.steps(10**9) for m, run in runs.items()}
    for mode, warm in (("off", 3), ("every", 3), ("auto", 20)):  # "auto" decides in warm-up
        _snapshot_block(runs[mode], loops[mode], model, opt, batch, warm)
    marks = {m: (dict(r.snapshot_stats), r.step) for m, r in runs.items()}
    warm_interval = runs["auto"]._jit.interval
    steps = min(max(args.steps, warm_interval or 1), args.max_block)  # "auto": ~1 snapshot
    times: dict[str, list[float]] = {m: [] for m in MODES}
    names = list(MODES)
    for pair in range(args.pairs):
        for mode in names[pair % 3 :] + names[: pair % 3]:  # rotate the order
            times[mode].append(_snapshot_block(runs[mode], loops[mode], model, opt, batch, steps))
    result: dict[str, Any] = {
        "bench": "snapshot_overhead",
        "model": "resnet18",
        "batch": args.batch,
        "image_size": args.image_size,
        "threads": torch.get_num_threads(),
        "pairs": args.pairs,
        "steps_per_block": steps,
        "state_mb": round(runs["every"].snapshot_stats["bytes"] / 1e6, 1),
        "snapshot_background": runs["every"]._snapshots.background,
        "auto_interval_warm": warm_interval,
        "auto_interval_end": runs["auto"]._jit.interval,
        "step_ms": {m: round(1e3 * statistics.median(t), 2) for m, t in times.items()},
    }
    for mode in ("every", "auto"):
        ratios = [a / b for a, b in zip(times[mode], times["off"], strict=True)]
        before, step0 = marks[mode]
        stats = {k: runs[mode].snapshot_stats[k] - before[k] for k in before}
        result[mode] = {
            **_quantiles(ratios),
            "overhead_pct_total": round(100 * (sum(times[mode]) / sum(times["off"]) - 1), 2),
            "snapshots": int(stats["count"]),
            **_per_step(stats, runs[mode].step - step0),
        }
    result["failure_write_ms"] = round(1e3 * _failure_write_s(runs["auto"]), 1)
    for mode, run in runs.items():
        run.close()
        loops[mode].close()
        run._store.remove()
    if not args.skip_peer:
        result.update(_peer(mp))
    return result


def _peer(mp: Any) -> dict[str, Any]:
    """The peer transfer of the snapshot between two gloo processes vs loopback TCP."""
    with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
        out = os.path.join(tmp, "peer.json")
        mp.spawn(_peer_rank, args=(tmp, out), nprocs=2)
        with open(out) as f:
            peer = json.load(f)
    loopback = _loopback_mb_s(peer["bytes"])
    return {
        "peer_mb": round(peer["bytes"] / 1e6, 1),
        "peer_seconds": round(peer["seconds"], 4),
        "peer_mb_s": round(peer["bytes"] / 1e6 / peer["seconds"], 1),
        "loopback_tcp_mb_s": round(loopback, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--interval", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--snapshot", action="store_true", help="measure snapshots instead")
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--max-block", type=int, default=24, help="--snapshot: steps a block")
    parser.add_argument("--skip-peer", action="store_true", help="--snapshot: no peer transfer")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.snapshot:
        if args.steps == 30:
            args.steps = 5
        print(json.dumps({"provenance": provenance(), **snapshot_bench(args)}, indent=2))
        return
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    os.environ.setdefault("ELASTIC_SNAPSHOT_EVERY", "0")  # checkpoints alone
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(
            args.config,
            [
                f"checkpoint.url={tmp}",
                "job.max_steps=100000",
                "job.progress_bar=false",
                "checkpoint.keep_last=1",
                *args.overrides,
            ],
        )
        _setup_torch(cfg.job)
        worker = Worker(cfg, init_distributed(cfg.distributed))
        _block(worker, args.interval, args.interval)  # warm-up: allocations, first save
        off, on = [], []
        for _ in range(args.rounds):
            off.append(_block(worker, args.steps, None))
            on.append(_block(worker, args.steps, args.interval))
        assert worker.run is not None
        worker.run.close()
        dist.destroy_process_group()
    result: dict[str, Any] = {
        "provenance": provenance(),
        "bench": "throughput",
        "model": cfg.model.name,
        "image_size": cfg.data.image_size,
        "global_batch": cfg.data.global_batch_size,
        "threads": torch.get_num_threads(),
        "steps_per_block": args.steps,
        "rounds": args.rounds,
        "interval": args.interval,
        "samples_per_s_off": round(statistics.median(off), 2),
        "samples_per_s_ckpt": round(statistics.median(on), 2),
        "per_round_off": [round(x, 2) for x in off],
        "per_round_ckpt": [round(x, 2) for x in on],
    }
    result["overhead_pct"] = round(
        100 * (1 - result["samples_per_s_ckpt"] / result["samples_per_s_off"]), 2
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
