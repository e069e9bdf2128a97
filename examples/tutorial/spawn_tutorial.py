"""The classic PyTorch DDP tutorial script, as users have it: it starts its own processes.

``python examples/tutorial/spawn_tutorial.py`` trains a small model on 2 processes of this
machine (CPU, gloo; with GPUs: one process per GPU, NCCL). Under ``elastic-agent`` this
script stops at ``mp.spawn`` with one sentence saying what to change:
``examples/tutorial/train.py`` is the changed script, ``docs/from-the-tutorial.md`` the road.
"""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EPOCHS = 4


def setup(rank, world_size):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = "12355"
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size)


def cleanup():
    dist.destroy_process_group()


def train(rank, world_size):
    setup(rank, world_size)
    device = torch.device(f"cuda:{rank}" if torch.cuda.is_available() else "cpu")
    if torch.cuda.is_available():
        torch.cuda.set_device(device)

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(2048, 20), torch.randint(0, 4, (2048,)))
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(data, batch_size=32, sampler=sampler)

    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4)).to(device)
    ddp_model = DDP(model, device_ids=[rank] if torch.cuda.is_available() else None)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.05)

    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(ddp_model(x), y)
            loss.backward()
            optimizer.step()
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f}", flush=True)

    cleanup()


if __name__ == "__main__":
    world_size = torch.cuda.device_count() if torch.cuda.is_available() else 2
    mp.spawn(train, args=(world_size,), nprocs=world_size, join=True)
