"""A torchvision-shaped classification trainer (references/classification/train.py's
structure, cut to CPU and a tiny model), for tests/agent/test_plain_resume.py.

Like torchvision's: ``--data-path`` holds ``train/<class>/*.png`` (an ImageFolder),
``--output-dir`` gets ``checkpoint.pth`` after every epoch (rank 0, ``args`` inside, so
torch's default ``torch.load`` refuses it without ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``), and
``--resume PATH`` loads model, optimizer, scheduler and ``start_epoch``. The two lines of
the resume recipe (docs/from-the-tutorial.md) are marked. ``--record DIR`` writes what the
test reads: ``start-<pid>.json`` per start, one line per step to ``steps-<rank>.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torchvision
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.transforms import v2 as T


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="PyTorch Classification Training")
    parser.add_argument("--data-path", type=str)
    parser.add_argument("--epochs", default=4, type=int)
    parser.add_argument("-b", "--batch-size", default=4, type=int)
    parser.add_argument("--lr", default=0.1, type=float)
    parser.add_argument("--output-dir", default=".", type=str)
    parser.add_argument("--resume", default="", type=str)
    parser.add_argument("--start-epoch", default=0, type=int)
    parser.add_argument("--min-step-s", default=0.0, type=float)
    parser.add_argument("--record", default="", type=str)
    return parser


def main(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    transform = T.Compose([T.ToImage(), T.ToDtype(torch.float32, scale=True)])
    dataset = torchvision.datasets.ImageFolder(os.path.join(args.data_path, "train"), transform)
    sampler: DistributedSampler[Any] = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2))
    net(torch.zeros(1, *dataset[0][0].shape))
    model = nn.parallel.DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    if args.resume:
        checkpoint = torch.load(args.resume, map_location="cpu")
        net.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        lr_scheduler.load_state_dict(checkpoint["lr_scheduler"])
        args.start_epoch = checkpoint["epoch"] + 1
    if args.record:
        start = {
            "pid": os.getpid(),
            "rank": rank,
            "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
            "resume": args.resume,
            "start_epoch": args.start_epoch,
            "t": time.time(),
        }
        with open(os.path.join(args.record, f"start-{os.getpid()}.json"), "w") as out:
            json.dump(start, out)
    for epoch in range(args.start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for i, (image, target) in enumerate(loader):
            began = time.monotonic()
            loss = nn.functional.cross_entropy(model(image), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            time.sleep(max(0.0, args.min_step_s - (time.monotonic() - began)))
            if args.record:
                line = {"epoch": epoch, "i": i, "pid": os.getpid(), "t": time.time()}
                with open(os.path.join(args.record, f"steps-{rank}.jsonl"), "a") as out:
                    out.write(json.dumps(line) + "\n")
        lr_scheduler.step()
        if rank == 0:  # torchvision's utils.save_on_master
            checkpoint = {
                "model": net.state_dict(),
                "optimizer": optimizer.state_dict(),
                "lr_scheduler": lr_scheduler.state_dict(),
                "epoch": epoch,
                "args": args,
            }
            path = os.path.join(args.output_dir, "checkpoint.pth")
            torch.save(checkpoint, path + ".tmp")
            os.replace(path + ".tmp", path)
    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_args_parser().parse_args()
    # The resume recipe (docs/from-the-tutorial.md): the job's directory, the same on every
    # restart, holds the checkpoint; resume from it when it is there.
    args.output_dir = os.environ.get("ELASTIC_JOB_DIR", args.output_dir)
    if os.path.exists(ckpt := os.path.join(args.output_dir, "checkpoint.pth")):
        args.resume = ckpt
    main(args)
