"""The user script of ``bench/inplace_overhead.py``: a small MLP under DDP on ``elastic.Run``.

``--in-place`` forms the group with ``elastic.init_process_group()`` (re-forms in place,
every collective of a step through the step guard); without it, with the script's own
``dist.init_process_group("gloo")`` (the restart path). Each step is paced by compute:
``--work`` lists matrix products (128x128, one thread) per step, one entry per block of
``--block`` steps, cycled, so one run measures each step length on the same processes.
Rank 0 writes each block's step times (seconds, from one step's start to the next's) to
``--out`` as JSON and every rank exits 0 after ``--steps`` steps.
"""

import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import elastic


def spin(products: int, a: torch.Tensor) -> None:
    for _ in range(products):
        torch.mm(a, a)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--in-place", action="store_true")
    p.add_argument("--work", default="0", help="products a step, per block: 40,200")
    p.add_argument("--block", type=int, default=50)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--steps", type=int, default=220)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.in_place:
        elastic.init_process_group()
    else:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    x = torch.randn(4096, 64)
    y = torch.randint(0, 10, (4096,))
    sampler = DistributedSampler(TensorDataset(x, y), shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, sampler=sampler, drop_last=True)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU())
    model = DDP(nn.Sequential(net, nn.Linear(256, 10)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10_000)
    run = elastic.Run(model, optimizer, scheduler, sampler, checkpoint_url=None)
    work = [int(w) for w in args.work.split(",")]
    a = torch.randn(128, 128)
    times: dict[str, list[float]] = {str(w): [] for w in work}
    steps, last, last_work = 0, None, None
    for _ in run.epochs(10_000):
        for xb, yb in run.batches(loader):
            now = time.perf_counter()
            if last is not None and steps > args.warmup:
                times[str(last_work)].append(now - last)
            if steps >= args.steps:
                break
            current = work[(steps // args.block) % len(work)]
            last, last_work = now, current
            spin(current, a)
            optimizer.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            optimizer.step()
            scheduler.step()
            steps += 1
        if steps >= args.steps:
            break
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(times, f)


if __name__ == "__main__":
    main()
