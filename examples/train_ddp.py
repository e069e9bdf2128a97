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
step and checkpoints every ``--checkpoint-every`` steps.

The options below ``--in-place`` serve tests and ``elastic chaos`` (docs/chaos.md):
``--global-batch-size`` keeps the global batch constant across world sizes (the Run sets
each rank's share), ``--norm group`` and ``--double`` make a step's math independent of
the world size up to float summation order (BatchNorm normalizes per rank's batch), so a
fault-free single-process run is a reference for any world-size trajectory;
``--ballast-mb`` adds a frozen parameter that makes every checkpoint save, snapshot and
state transfer that much larger (slower); ``--ledger`` records each rank's sample indices
of every step (``train.samples`` events) and the loss (``train.step``).
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

import elastic  # elastic
from elastic import events


class Net(nn.Module):
    def __init__(self, num_classes=10, norm="batch", ballast_mb=0.0):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8) if norm == "batch" else nn.GroupNorm(4, 8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 8 * 8, num_classes)
        if ballast_mb > 0:  # saved, snapshotted and transferred; never trained
            self.ballast = nn.Parameter(
                torch.zeros(int(ballast_mb * 2**20) // 4), requires_grad=False
            )

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


class Ledger(Dataset):
    """A dataset that remembers the indices read since the last :meth:`take`."""

    def __init__(self, data):
        self.data, self.read = data, []

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        self.read.append(int(i))
        return self.data[i]

    def take(self):
        read, self.read = self.read, []
        return read


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
    parser.add_argument("--global-batch-size", type=int, default=None)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--norm", choices=("batch", "group"), default="batch")
    parser.add_argument("--double", action="store_true", help="train in float64")
    parser.add_argument("--ballast-mb", type=float, default=0.0, help="a frozen parameter")
    parser.add_argument("--ledger", action="store_true", help="train.samples events, losses")
    args = parser.parse_args()

    if args.in_place:
        elastic.init_process_group()  # elastic (in place): instead of dist.init_process_group
    else:
        dist.init_process_group("gloo")
    dtype = torch.float64 if args.double else torch.float32
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(args.samples, 3, 32, 32, generator=gen).to(dtype)
    labels = torch.randint(0, 10, (args.samples,), generator=gen)
    dataset = TensorDataset(images, labels)
    if args.ledger:
        dataset = Ledger(dataset)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    model = DDP(Net(norm=args.norm, ballast_mb=args.ballast_mb).to(dtype))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100, gamma=0.5)
    run = elastic.Run(  # elastic
        model,
        optimizer,
        scheduler,
        sampler,
        checkpoint_url=args.ckpt,
        checkpoint_every=args.checkpoint_every,
        global_batch_size=args.global_batch_size,
    )

    loss = None
    for epoch in run.epochs(args.epochs):  # elastic: was range(args.epochs)
        sampler.set_epoch(epoch)
        for x, y in run.batches(loader):  # elastic: was `for x, y in loader:`
            if args.ledger:  # before the step runs: a rank that dies in it still recorded it
                events.emit(
                    "train.samples",
                    step=run.step + 1,
                    rank=run.rank,
                    world_size=run.world_size,
                    epoch=epoch,
                    indices=dataset.take(),
                )
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if args.ledger:
                run.log_loss(loss.item())
            time.sleep(args.step_delay)
        if run.rank == 0 and loss is not None:
            print(f"epoch {epoch} loss {loss.item():.4f} pid {os.getpid()}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
