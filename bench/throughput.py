"""Worker throughput with a checkpoint every 10 steps vs checkpointing off, in one run;
with ``--snapshot``: the cost of per-step shared-memory snapshots (elastic.Run).

Runs the real worker loop (:class:`elastic.training.worker.Worker`, world of one, gloo)
in alternating blocks, ``--rounds`` times: ``--steps`` steps with checkpointing
off, then ``--steps`` steps with an async checkpoint every ``--interval`` steps
(the block waits for its last save to be durable, so no write cost escapes
it). Prints JSON with samples/s of both and the relative overhead.

With ``--snapshot`` it trains ResNet-18 through :class:`elastic.Run` in ``--pairs``
pairs of ``--steps``-step blocks, one with a snapshot after every step and one without,
interleaved in one process (alternating which goes first), and reports the median of
the paired time ratios with its 10th/90th percentiles, the snapshot's own time per step
(on the training thread, in the background copy, and blocking the next optimizer step),
then the peer transfer of that state between two gloo processes against plain loopback
TCP measured in the same run.

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
from typing import Any

import torch
import torch.distributed as dist

from elastic.training.config import load_config
from elastic.training.worker import Worker, _setup_torch, init_distributed


def _block(worker: Worker, steps: int, interval: int | None) -> float:
    """Run ``steps`` steps; return samples/s (including the wait for the last save)."""
    started = time.perf_counter()
    for _ in range(steps):
        result = worker.trainer.step(worker.cursor)
        worker.step += 1
        worker.cursor = result.cursor
        if interval and worker.step % interval == 0:
            worker.save(block=False)
    worker.checkpoints.wait()
    seconds = time.perf_counter() - started
    return steps * worker.sampler.global_batch_size / seconds


# -- snapshot overhead (``--snapshot``) ------------------------------------------------------


def _snapshot_block(run: Any, model: Any, opt: Any, batch: Any, steps: int) -> float:
    """``steps`` training steps through ``run.steps``; return seconds per step."""
    import torch.nn.functional as F

    x, y = batch
    started = time.perf_counter()
    for _ in run.steps(run.step + steps):
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

    from elastic.recovery import exchange
    from elastic.recovery.snapshot import SnapshotStore, Snapshotter

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


def snapshot_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Paired short runs with and without per-step snapshots, and the peer transfer."""
    import os

    import torch.multiprocessing as mp
    import torchvision

    from elastic.recovery.session import Run

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
    on = Run(model, opt, snapshot_every=1, run_id=f"{tag}-on")
    off = Run(model, opt, snapshot_every=0, run_id=f"{tag}-off")
    _snapshot_block(on, model, opt, batch, 3)  # warm-up: allocations, the files' growth
    _snapshot_block(off, model, opt, batch, 3)
    on._snapshots.stats.update(count=0, sync_s=0.0, copy_s=0.0, wait_s=0.0)
    ratios, t_on, t_off = [], [], []
    for pair in range(args.pairs):
        blocks = [(on, t_on), (off, t_off)]
        for run, into in blocks if pair % 2 else blocks[::-1]:
            into.append(_snapshot_block(run, model, opt, batch, args.steps))
        ratios.append(t_on[-1] / t_off[-1])
    stats = on.snapshot_stats
    on._store.remove()
    on.close()
    off.close()

    with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
        out = os.path.join(tmp, "peer.json")
        mp.spawn(_peer_rank, args=(tmp, out), nprocs=2)
        with open(out) as f:
            peer = json.load(f)
    loopback = _loopback_mb_s(peer["bytes"])
    quantiles = statistics.quantiles(ratios, n=10) if len(ratios) > 1 else ratios * 9
    count = max(int(stats["count"]), 1)
    return {
        "bench": "snapshot_overhead",
        "model": "resnet18",
        "batch": args.batch,
        "image_size": args.image_size,
        "threads": torch.get_num_threads(),
        "pairs": args.pairs,
        "steps_per_block": args.steps,
        "state_mb": round(stats["bytes"] / 1e6, 1),
        "step_ms_off": round(1e3 * statistics.median(t_off), 2),
        "step_ms_on": round(1e3 * statistics.median(t_on), 2),
        "overhead_pct_median": round(100 * (statistics.median(ratios) - 1), 2),
        "overhead_pct_p10": round(100 * (quantiles[0] - 1), 2),
        "overhead_pct_p90": round(100 * (quantiles[-1] - 1), 2),
        "snapshot_background": on._snapshots.background,
        "snapshot_sync_ms_per_step": round(1e3 * stats["sync_s"] / count, 3),
        "snapshot_copy_ms_per_step": round(1e3 * stats["copy_s"] / count, 3),
        "snapshot_wait_ms_per_step": round(1e3 * stats["wait_s"] / count, 3),
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
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.snapshot:
        if args.steps == 30:
            args.steps = 5
        print(json.dumps(snapshot_bench(args), indent=2))
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
        ctx = init_distributed(cfg.distributed)
        worker = Worker(cfg, ctx)
        _block(worker, args.interval, args.interval)  # warm-up: allocations, first save
        off, on = [], []
        for _ in range(args.rounds):
            off.append(_block(worker, args.steps, None))
            on.append(_block(worker, args.steps, args.interval))
        worker.checkpoints.close()
        dist.destroy_process_group()
    result: dict[str, Any] = {
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
