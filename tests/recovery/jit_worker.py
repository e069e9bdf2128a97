"""A rank of the failure-time snapshot tests (spawned by test_jit.py).

``python jit_worker.py pair RANK WORLD DIR TOTAL KILL_AT``: a DDP pair on gloo with
periodic snapshots off in effect; with ``KILL_AT >= 0`` rank 1 kills itself with
SIGKILL in the middle of step ``KILL_AT`` (after its forward, before its backward).

``python jit_worker.py single DIR EVERY FAIL_AT HOW``: one process that fails in step
``FAIL_AT``: ``torn`` raises inside ``optimizer.step()`` (from a step pre-hook),
``after`` raises after ``optimizer.step()`` returned.

Each writes ``DIR/result-<rank>.json``: where the Run resumed and, at the end, the
final parameters (``DIR/final-<rank>.pt``).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elastic import env
from elastic.worker.session import Run

NEVER = 10**6  # a periodic snapshot interval no test reaches


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 2)
    )


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 8, generator=gen), torch.randn(16, 2, generator=gen)


def _report(out: Path, rank: int, run: Run, **fields: Any) -> None:
    record = {"step": run.step, "source": run.resumed_from, **fields}
    (out / f"result-{rank}.json").write_text(json.dumps(record))


def pair(rank: int, world: int, out: Path, total: int, kill_at: int) -> None:
    store = dist.FileStore(str(out / "store"), world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    model = DistributedDataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    node = out.parent / f"node{rank}"
    node.mkdir(exist_ok=True)
    run = Run(model, opt, run_id="jit", snapshot_dir=str(node), snapshot_every=NEVER)
    _report(out, rank, run)
    for step in run.steps(total):
        x, y = _batch(step, rank)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if step == kill_at and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # kill -9 in the middle of a step
        loss.backward()
        opt.step()
    torch.save(model.module.state_dict(), out / f"final-{rank}.pt")


def single(out: Path, every: int, fail_at: int, how: str) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    run = Run(model, opt, run_id="jit", snapshot_dir=str(out), snapshot_every=every)

    def torn(*_: Any) -> None:
        raise RuntimeError("A failure inside optimizer.step() (test).")

    for step in run.steps(1000):
        x, y = _batch(step, 0)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if step == fail_at and how == "torn":
            opt.register_step_pre_hook(torn)
        opt.step()
        if step == fail_at and how == "after":
            raise RuntimeError("A failure after optimizer.step() (test).")


if __name__ == "__main__":
    os.environ[env.SNAPSHOT_OWNER] = "1"  # an agent's files: they outlive the process
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if sys.argv[1] == "pair":
        r, w, d, t, k = sys.argv[2:7]
        pair(int(r), int(w), Path(d), int(t), int(k))
    else:
        d, e, f, how = sys.argv[2:6]
        single(Path(d), int(e), int(f), how)
