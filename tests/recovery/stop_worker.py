"""A rank of the stop test: rank 0 gets SIGTERM during step 4 (spawned by test_stop.py)."""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elastic.worker.session import Run


def main(rank: int, world: int, tmp: Path) -> None:
    store = dist.FileStore(str(tmp / "store"), world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = Run(
        model,
        opt,
        checkpoint_url=str(tmp / "ckpt"),
        run_id="stop",
        snapshot_dir=str(tmp / f"node{rank}"),
        checkpoint_every=100,
    )
    for step in run.steps(1000):
        if step == 3 and rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        opt.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
    sys.exit(3)  # never reached: the Run exits


if __name__ == "__main__":
    os.environ["ELASTIC_SNAPSHOT_OWNER"] = "1"
    (Path(sys.argv[3]) / f"node{sys.argv[1]}").mkdir()
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
