"""The recovery bench's user job on torchft: ``tests/scripts/inplace_user.py``'s job, one
replica group per process (``bench/recovery.py --backends torchft``).

The same model and optimiser as ``tests/scripts/inplace_user.py``: a 16-32-2 MLP in float64,
AdamW (lr 0.01, weight decay 0.01), a cosine LR schedule over the whole run, a constant
global batch (``--global-batch``, 12) out of ``--samples`` (1200) samples drawn in a seeded
per-epoch order, each step paced by ``--step-delay`` seconds. Written the way torchft's own
``train_ddp.py`` example is: a :class:`torchft.Manager` on a ``ProcessGroupGloo``,
torchft's ``DistributedDataParallel`` and its ``OptimizerWrapper`` (``zero_grad()`` starts
the quorum, ``step()`` commits only when every participant's all-reduce succeeded), the
model, optimiser and schedule handed to a healing peer through the manager's state dict.

The quorum is synchronous (``use_async_quorum=False``): each step's data split needs the
step's participants, and a healing replica then loads its state before its first forward
and takes part in that step. Each of the step's participants trains its share of the global
batch (12 / n samples); torchft's all-reduce averages, so a step's update is the same at
any n.

A replica group is one process: it hosts its group's ``TCPStore`` (torchft's manager needs
one) and runs the group's manager server. ``REPLICA_GROUP_ID`` names it; the Lighthouse is
``TORCHFT_LIGHTHOUSE``. SIGTERM is a planned leave: the replica ends after its current step
and shuts its manager down (torchft has no leave call; the Lighthouse drops it when its
heartbeats stop).

With ``--out``, each step attempt is appended to ``OUT/steps.jsonl`` before the step's
collectives (step, round: the quorum id, rank, world: the participants, pid, idx: the sample
indices), and once the step committed a line ``{step, round, rank, committed: true}``
(``bench/scale.py`` checks from them that each sample was used once).

Events, one JSON line each, appended to ``$ELASTIC_EVENT_LOG`` (the bench's shared event
log; the same fields as elastic's): ``train.step`` (written by the step's participating rank
0 after a committed step and its pace, where ``Run`` records a step: step, world_size, loss,
lr), and ``tft.phase`` (phase:
``started`` (torch imported), ``ready`` (torchft imported, manager up), ``quorum`` (a new
quorum: quorum_id, world_size, healed, seconds the quorum call took), ``left``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from datetime import timedelta
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import TCPStore

STEPS_PER_EPOCH_MIN = 1


def emit(kind: str, **fields: Any) -> None:
    """Append one event to ``$ELASTIC_EVENT_LOG`` (nothing when unset)."""
    path = os.environ.get("ELASTIC_EVENT_LOG")
    if not path:
        return
    line = json.dumps({"ts": round(time.time(), 6), "kind": kind, "pid": os.getpid(), **fields})
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=1000)
    p.add_argument("--samples", type=int, default=1200)
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--step-delay", type=float, default=0.0, help="seconds each step sleeps")
    p.add_argument(
        "--pg-timeout", type=float, default=5.0, help="gloo collective timeout, s (example: 5)"
    )
    p.add_argument("--timeout", type=float, default=30.0, help="manager timeout, s (example: 30)")
    p.add_argument("--async-quorum", action="store_true", help="torchft's default quorum mode")
    p.add_argument(
        "--out",
        default=None,
        help="append each step attempt (step, quorum, rank, participants, samples) and each "
        "commit as a JSON line to OUT/steps.jsonl",
    )
    return p.parse_args()


def batch_indices(step: int, samples: int, global_batch: int, rank: int, n: int) -> torch.Tensor:
    """The sample indices participant ``rank`` of ``n`` trains on at (0-based) ``step``: its
    share of the step's global batch, in a seeded per-epoch order."""
    per_epoch = max(STEPS_PER_EPOCH_MIN, samples // global_batch)
    epoch, pos = divmod(step, per_epoch)
    order = torch.randperm(samples, generator=torch.Generator().manual_seed(epoch))
    batch = order[pos * global_batch : (pos + 1) * global_batch]
    return torch.tensor_split(batch, n)[rank]


def main() -> None:
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    args = _parse()
    emit("tft.phase", phase="started")
    group = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    leaving = False

    def leave(signum: int, frame: object) -> None:
        nonlocal leaving
        leaving = True

    signal.signal(signal.SIGTERM, leave)

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, 16, generator=gen, dtype=torch.float64)
    y = (x[:, :4].sum(1) > 0).long()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 2)).double()
    inner = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.01)
    total = args.epochs * (args.samples // args.global_batch)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(inner, T_max=total)

    def state_dict() -> dict[str, Any]:
        return {
            "model": net.state_dict(),
            "optim": inner.state_dict(),
            "sched": scheduler.state_dict(),
        }

    def load_state_dict(state: dict[str, Any]) -> None:
        net.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])
        scheduler.load_state_dict(state["sched"])

    # One process is the whole replica group: it hosts the group's store.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout)),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"bench_{group}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        use_async_quorum=args.async_quorum,
        timeout=timedelta(seconds=args.timeout),
    )
    model = DistributedDataParallel(manager, net)
    optimizer = Optimizer(manager, inner)
    emit("tft.phase", phase="ready")
    quorum_id = None
    attempts = None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        attempts = open(os.path.join(args.out, "steps.jsonl"), "a", buffering=1)  # noqa: SIM115
    while manager.current_step() < total and not leaving:
        began, before = time.time(), manager.current_step()
        optimizer.zero_grad()  # the quorum (healing a new replica first)
        took = time.time() - began
        n = manager.num_participants()
        rank = manager.participating_rank()
        if manager._quorum_id != quorum_id:
            quorum_id = manager._quorum_id
            emit(
                "tft.phase",
                phase="quorum",
                quorum_id=quorum_id,
                world_size=n,
                step=manager.current_step(),
                healed=manager.current_step() != before,
                seconds=round(took, 4),
            )
        step = manager.current_step()
        idx = batch_indices(step, args.samples, args.global_batch, rank or 0, max(n, 1))
        if attempts is not None:  # before the step's collectives, as tests/scripts/inplace_user.py
            record = {"step": step, "round": quorum_id, "rank": rank or 0, "world": n}
            attempts.write(json.dumps({**record, "pid": os.getpid(), "idx": idx.tolist()}) + "\n")
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        optimizer.step()  # commits (applies AdamW) only if every participant succeeded
        if attempts is not None and manager.current_step() > step:
            record = {"step": step, "round": quorum_id, "rank": rank or 0, "committed": True}
            attempts.write(json.dumps(record) + "\n")
        # The step's pace is part of the step: it counts once its whole body is done, as a
        # step on elastic.Run does (Run records it at the next boundary, after the pace).
        time.sleep(args.step_delay)
        if manager.current_step() > step:
            scheduler.step()
            if rank == 0:
                emit(
                    "train.step",
                    step=manager.current_step(),
                    world_size=n,
                    loss=round(loss.item(), 6),
                    lr=scheduler.get_last_lr()[0],
                )
    emit("tft.phase", phase="left", step=manager.current_step())
    manager.shutdown(wait=False)
    del store


if __name__ == "__main__":
    main()
