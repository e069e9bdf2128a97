"""A rank of the exchange test (spawned by tests/recovery/test_exchange.py).

Each rank plays one node: its snapshots live in ``<tmp>/node<rank>``. Phase 1 trains
6 steps (persisted at step 4). Phase 2 hides every node's snapshots but rank 1's and
resumes: rank 1 from memory, the others from it over gloo. Phase 3 hides all of them:
the newest persisted checkpoint (step 4) is read from storage.
"""

from __future__ import annotations

import os
import shutil
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elastic.worker.session import Run


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU())
    model = DistributedDataParallel(torch.nn.Sequential(net, torch.nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def start(seed: int, ckpt: str, snapshot_dir: Path) -> Run:
    """A Run of :func:`build`'s model (``seed``), its snapshots in ``snapshot_dir``."""
    model, opt, sched = build(seed)
    return Run(
        model,
        opt,
        sched,
        checkpoint_url=ckpt,
        checkpoint_every=4,
        run_id="xr",
        snapshot_dir=str(snapshot_dir),
    )


def dump(run: Run, path: Path) -> None:
    state = run.state()
    torch.save(
        {
            "model": state["model"],
            "optim": state["optim"]["state"],
            "step": run.step,
            "source": run.resumed_from,
            "lr": run.optimizer.param_groups[0]["lr"],
        },
        path,
    )


def main(rank: int, world: int, tmp: Path) -> None:
    store = dist.FileStore(str(tmp / "store"), world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    ckpt = str(tmp / "ckpt")
    node = tmp / f"node{rank}"
    node.mkdir(exist_ok=True)

    run = start(0, ckpt, node)
    model, opt, sched = run.model, run.optimizer, run.scheduler
    gen = torch.Generator().manual_seed(rank)
    for step in run.steps(100):
        if step == 4:
            dump(run, tmp / f"r{rank}-step4.pt")
        if step == 6:
            break
        opt.zero_grad()
        model(torch.randn(16, 8, generator=gen)).square().mean().backward()
        opt.step()
        sched.step()
    dump(run, tmp / f"r{rank}-step6.pt")
    run.close()

    dist.barrier()
    if rank != 1:  # a new node: nothing in its memory
        shutil.move(node, tmp / f"node{rank}-hidden")
        node.mkdir()
    dist.barrier()
    run = start(1, ckpt, node)  # other weights: a load that did nothing would show
    dump(run, tmp / f"r{rank}-peer.pt")
    run.close()

    dist.barrier()
    empty = tmp / f"empty{rank}"
    empty.mkdir()
    run = start(2, ckpt, empty)
    dump(run, tmp / f"r{rank}-storage.pt")
    run.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ["ELASTIC_SNAPSHOT_OWNER"] = "1"
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
