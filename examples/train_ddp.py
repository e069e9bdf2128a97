"""A plain DDP training script (the classic PyTorch DDP tutorial's shape) on elastic.Run.

Run it under ``elastic-agent`` (or ``torchrun``)::

    elastic-agent --nnodes=1:3 --nproc-per-node=1 --rdzv-backend=etcd-v3 \\
        --rdzv-endpoint=127.0.0.1:2379 --rdzv-id=demo examples/train_ddp.py --epochs 3

Changed lines against the plain DDP version: 4 (marked ``# elastic``): two added (the
import, the ``elastic.Run(...)`` line) and two loop headers (``run.epochs(n)`` instead of
``range(n)``, ``run.batches(loader)`` instead of ``loader``). torch's DistributedSampler
stays; the Run gives it an exact mid-epoch resume point. With ``--in-place`` a fifth line,
``elastic.init_process_group()`` instead of ``dist.init_process_group("gloo")``, makes
membership changes re-form the group inside the running processes (docs/inplace.md). The
Run resumes from this node's memory, a peer's memory or the checkpoints, snapshots every
step and checkpoints
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import elastic  # elastic


class Net(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 8 * 8, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--ckpt", default="runs/train_ddp", help="checkpoint URL")
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds (demos, tests)")
    parser.add_argument(
        "--in-place", action="store_true", help="re-form in place: survivors keep their process"
    )
    args = parser.parse_args()

    if args.in_place:
        elastic.init_process_group()  # elastic (in place): instead of dist.init_process_group
    else:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(args.samples, 3, 32, 32, generator=gen)
    labels = torch.randint(0, 10, (args.samples,), generator=gen)
    dataset = TensorDataset(images, labels)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    model = DDP(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100, gamma=0.5)
    run = elastic.Run(model, optimizer, scheduler, sampler, checkpoint_url=args.ckpt)  # elastic

    for epoch in run.epochs(args.epochs):  # elastic: was range(args.epochs)
        sampler.set_epoch(epoch)
        for x, y in run.batches(loader):  # elastic: was `for x, y in loader:`
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            scheduler.step()
            time.sleep(args.step_delay)
        if run.rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f} pid {os.getpid()}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
