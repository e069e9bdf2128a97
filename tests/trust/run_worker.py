"""A worker on elastic.Run for the trust tests (spawned by them).

``python run_worker.py DIR TOTAL``: one process (no group) with snapshots every step in
``DIR``; it prints ``resumed STEP SOURCE`` once, then ``step N`` before each step, up to
``TOTAL``, and at the end ``kept N in FOLDER``: the snapshot files in its agent's directory.
The test sets ``$ELASTIC_SNAPSHOT_OWNER`` (an agent's files outlive the process), or runs it
under plain torchrun.
"""

from __future__ import annotations

import logging
import sys

import torch

from elastic.node import nodelocal
from elastic.worker.session import Run
from elastic.worker.snapshot import owner_pid


def main(directory: str, total: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    run = Run(model, opt, run_id="trust", snapshot_dir=directory, snapshot_every=1)
    print(f"resumed {run.step} {run.resumed_from}", flush=True)
    for step in run.steps(total):
        print(f"step {step}", flush=True)
        opt.zero_grad()
        model(torch.randn(8, 32)).square().mean().backward()
        opt.step()
    folder = nodelocal.find(owner_pid(), directory)
    kept = sorted(p.name for p in folder.iterdir()) if folder is not None else []
    print(f"kept {len(kept)} in {folder}", flush=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    main(sys.argv[1], int(sys.argv[2]))
