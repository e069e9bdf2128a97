"""examples/tutorial/train.py on ``elastic.Run`` with ``elastic.init_process_group()``: a
node that joins or dies no longer restarts the survivors (in place, gloo; NCCL restarts),
and they resume from memory at the step, not from the last epoch's snapshot.

Against train.py: ``elastic.init_process_group(backend)`` instead of
``dist.init_process_group(backend)``; the ``elastic.Run(...)`` line instead of the snapshot
code; ``run.epochs(...)`` and ``run.batches(loader)`` in the loop headers; ranks from
``run.rank`` (they change when the world does). docs/from-the-tutorial.md has the diff.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import elastic


def train(args):
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    elastic.init_process_group(backend)  # in place with gloo
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if torch.cuda.is_available():
        torch.cuda.set_device(device)

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(2048, 20), torch.randint(0, 4, (2048,)))
    sampler = DistributedSampler(data, shuffle=True)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)

    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4)).to(device)
    ddp_model = DDP(model, device_ids=[local_rank] if torch.cuda.is_available() else None)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.05)
    run = elastic.Run(ddp_model, optimizer, sampler=sampler, checkpoint_url=args.checkpoints)

    for epoch in run.epochs(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in run.batches(loader):
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(ddp_model(x), y)
            loss.backward()
            optimizer.step()
        if run.rank == 0:  # (a resumed epoch may have no batch left: no loss here)
            print(f"epoch {epoch} world {run.world_size} step {run.step}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoints", default="checkpoints", help="a path or s3://...")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    train(parser.parse_args())
