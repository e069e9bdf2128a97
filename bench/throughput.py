"""Worker throughput with a checkpoint every 10 steps vs checkpointing off, in one run.

Runs the real worker loop (:class:`elastic.training.worker.Worker`, world of one, gloo)
in alternating blocks, ``--rounds`` times: ``--steps`` steps with checkpointing
off, then ``--steps`` steps with an async checkpoint every ``--interval`` steps
(the block waits for its last save to be durable, so no write cost escapes
it). Prints JSON with samples/s of both and the relative overhead.

Usage: ``python bench/throughput.py [--config configs/default.yaml] [k=v ...]``
"""

from __future__ import annotations

import argparse
import json
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--interval", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
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
