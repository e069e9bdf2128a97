"""A user's own DDP script on elastic.Run (not our worker): AdamW, a cosine LR schedule and a
constant global batch, in float64 so that runs at different world sizes agree to ~1e-12.

Each rank appends one JSON line per step attempt to ``<out>/steps.jsonl``: step, round,
rank, world size, pid and the sample indices it trained on; rank 0 writes the final model
to ``<out>/final.pt``. Without ``WORLD_SIZE`` in the environment it runs alone (the
fault-free reference).

Constructed failures (each once per job, marked by a file in ``<out>``):
``--fail-in-step=R:S`` makes rank R fail inside ``optimizer.step()`` at step S, after it
changed a parameter (a half-applied step); ``--break-store=R`` cuts rank R off every
round's store from its first re-form on (its in-place re-form fails: it restarts);
``--leave-at=R:S`` makes rank R's node leave (SIGTERM to its agent) inside step S, before
the step's all-reduce: the others' step S fails and is redone without it.

Constructed timing: ``--step-work=N`` adds N 128x128 matrix products to each step (work a
CPU share slows, where ``--step-delay``'s sleep is not slowed); ``--hold-at=S:FILE`` holds
every rank before step S until FILE exists (the test lets the job go on once a join formed
its round); ``$INPLACE_USER_START_AFTER`` (a step) makes this worker wait, before it forms
its group, until a rank of the job recorded that step (a joiner whose worker starts late:
its round pends meanwhile); ``$INPLACE_USER_LINGER`` (seconds) keeps the process alive that
long after its loop ended (a join then forms a round with workers that have finished).
"""

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import elastic


class Indexed(Dataset):
    def __init__(self, n: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 16, generator=gen, dtype=torch.float64)
        self.y = (self.x[:, :4].sum(1) > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--samples", type=int, default=240)
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--step-delay", type=float, default=0.0)
    p.add_argument("--step-work", type=int, default=0, help="128x128 matrix products a step")
    p.add_argument("--out", required=True)
    p.add_argument("--ckpt", default=None)
    p.add_argument("--fail-in-step", default=None, metavar="RANK:STEP")
    p.add_argument("--break-store", type=int, default=None, metavar="RANK")
    p.add_argument("--leave-at", default=None, metavar="RANK:STEP")
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--hold-at", default=None, metavar="STEP:FILE")
    args = p.parse_args()
    spin = torch.randn(128, 128, generator=torch.Generator().manual_seed(1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    distributed = "WORLD_SIZE" in os.environ
    if os.environ.get("INPLACE_USER_START_AFTER"):
        _start_after(out, int(os.environ["INPLACE_USER_START_AFTER"]))
    if distributed:
        elastic.init_process_group()
    torch.manual_seed(0)
    dataset = Indexed(args.samples)
    alone = {} if distributed else {"num_replicas": 1, "rank": 0}
    sampler = DistributedSampler(dataset, shuffle=True, seed=0, drop_last=True, **alone)
    loader = DataLoader(dataset, batch_size=args.global_batch, sampler=sampler, shuffle=False)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 2)).double()
    model = DDP(net) if distributed else net
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    total = args.epochs * (args.samples // args.global_batch)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total)
    run = elastic.Run(
        model,
        optimizer,
        scheduler,
        sampler,
        checkpoint_url=args.ckpt,
        checkpoint_every=args.ckpt_every,
        global_batch_size=args.global_batch,
    )
    if args.fail_in_step:
        _fail_in_step(optimizer, net, run, out, *map(int, args.fail_in_step.split(":")))
    if args.break_store is not None and run.rank == args.break_store:
        _break_store(out)
    leave = tuple(map(int, args.leave_at.split(":"))) if args.leave_at else None
    hold_step, _, hold_file = (args.hold_at or "-1:").partition(":")
    with open(out / "steps.jsonl", "a", buffering=1) as log:
        for _epoch in run.epochs(args.epochs):
            for x, y, idx in run.batches(loader):
                record = {
                    "step": run.step,
                    "round": run.round,
                    "rank": run.rank,
                    "world": run.world_size,
                    "pid": os.getpid(),
                    "idx": idx.tolist(),
                }
                if run.step == int(hold_step):
                    _wait_for(lambda: Path(hold_file).exists(), 120)
                if leave is not None and (run.rank, run.step) == leave:
                    _leave_now(run, out)
                # Written before the step's collectives: a worker killed after its gradient
                # reached the all-reduce (the survivors commit the step) has used its samples.
                log.write(json.dumps(record) + "\n")
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                scheduler.step()
                time.sleep(args.step_delay)
                for _ in range(args.step_work):  # CPU work: a duty cycle or a quota slows it
                    torch.mm(spin, spin)
    if run.rank == 0:
        torch.save(net.state_dict(), out / "final.pt")
    if distributed:
        dist.destroy_process_group()
    linger = float(os.environ.get("INPLACE_USER_LINGER", "0"))
    _wait_for(lambda: (out / "go-home").exists(), linger)


def _wait_for(done, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        time.sleep(0.05)


def _start_after(out: Path, step: int) -> None:
    """Wait (at most 120 s) until a rank of the job recorded ``step``."""

    def recorded() -> bool:
        try:
            lines = (out / "steps.jsonl").read_text().splitlines()
        except OSError:
            return False
        return any(json.loads(line)["step"] >= step for line in lines if line.strip())

    _wait_for(recorded, 120)


def _fail_in_step(optimizer, net, run, out: Path, rank: int, step: int) -> None:
    marker = out / "failed-in-step"

    def pre_hook(*_):
        if run.rank == rank and run.step == step and not marker.exists():
            marker.touch()
            with torch.no_grad():
                next(net.parameters()).add_(1.0)  # half-applied
            raise RuntimeError("constructed failure inside optimizer.step()")

    optimizer.register_step_pre_hook(pre_hook)  # after Run's: its step counts as started


def _leave_now(run, out: Path) -> None:
    """SIGTERM to this node's agent, then hold the step until its word reached this worker
    (its step's all-reduce is then refused, and the others' fails): once per job."""
    marker = out / "left"
    if marker.exists():
        return
    marker.touch()
    os.kill(int(os.environ["ELASTIC_SNAPSHOT_OWNER"]), signal.SIGTERM)
    deadline = time.monotonic() + 30
    while not run.stopped_by_signal and not _told_to_leave(run) and time.monotonic() < deadline:
        time.sleep(0.01)


def _told_to_leave(run) -> bool:
    member = getattr(run, "_member", None)  # test-only peek: the agent's leave reached us
    return bool(member is not None and member.leaving)


def _break_store(out: Path) -> None:
    marker = out / "broke-store"
    if marker.exists():
        return
    marker.touch()
    from elastic.worker import groups

    def unreachable(host, port):
        raise ConnectionRefusedError(f"constructed: {host}:{port} is cut off")

    groups.client = unreachable


if __name__ == "__main__":
    main()
