"""The tutorial script (spawn_tutorial.py) changed to run under ``elastic-agent`` on any
number of nodes: the agent starts one process per ``--nproc-per-node`` and sets RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, so ``mp.spawn``, the hard-coded
address and the explicit rank and world size go; the rank comes from the environment, the
GPU from LOCAL_RANK. A node that joins or dies restarts every worker (torchrun's way), so
the script saves a snapshot each epoch and resumes from it. On each node::

    elastic-agent --nnodes 1:3 --nproc-per-node 1 --rdzv-endpoint HOST:2379 \\
        --rdzv-id job-42 --rdzv-conf profile=fast-failover \\
        examples/tutorial/train.py --snapshot /shared/snapshot.pt

The diff against spawn_tutorial.py, line by line: docs/from-the-tutorial.md.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def train(args):
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)  # the agent set MASTER_ADDR, RANK, WORLD_SIZE ...
    rank, local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if torch.cuda.is_available():
        torch.cuda.set_device(device)

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(2048, 20), torch.randint(0, 4, (2048,)))
    sampler = DistributedSampler(data, shuffle=True)  # rank and world size from the group
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)

    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4)).to(device)
    ddp_model = DDP(model, device_ids=[local_rank] if torch.cuda.is_available() else None)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.05)

    first_epoch = 0
    if os.path.exists(args.snapshot):  # a restart: a node joined or died
        snapshot = torch.load(args.snapshot, map_location=device)
        model.load_state_dict(snapshot["model"])
        optimizer.load_state_dict(snapshot["optimizer"])
        first_epoch = snapshot["epoch"] + 1

    for epoch in range(first_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(ddp_model(x), y)
            loss.backward()
            optimizer.step()
        if rank == 0:
            print(f"epoch {epoch} world {dist.get_world_size()} loss {loss.item():.4f}", flush=True)
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save({**state, "epoch": epoch}, args.snapshot + ".tmp")
            os.replace(args.snapshot + ".tmp", args.snapshot)  # never a torn snapshot

    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--snapshot", default="snapshot.pt", help="on shared storage")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    train(parser.parse_args())
