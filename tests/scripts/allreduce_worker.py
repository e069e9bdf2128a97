"""A tiny gloo worker for rendezvous tests: forms a group, all-reduces until told to stop.

argv: <records.jsonl> <stop-file>. Each formed group appends one JSON record
(rank, world size, restart count, pids); every iteration all-reduces a stop flag
so that all ranks leave together.
"""

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def record(path: str, **fields: object) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(fields) + "\n")


def main() -> None:
    out, stop = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", timeout=timedelta(seconds=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.ones(1)
    dist.all_reduce(total)
    record(
        out,
        event="formed",
        rank=rank,
        world=world,
        sum=int(total.item()),
        restart=int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
        group_rank=int(os.environ["GROUP_RANK"]),
        pid=os.getpid(),
        # warm, the parent is the fork server: the agent is the snapshot owner
        agent_pid=int(os.environ.get("ELASTIC_SNAPSHOT_OWNER") or os.getppid()),
        node=os.environ.get("TEST_NODE", "?"),
        master=f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
    )
    while True:
        flag = torch.tensor([1.0 if os.path.exists(stop) else 0.0])
        dist.all_reduce(flag)
        if flag.item() > 0:
            break
        time.sleep(0.1)
    record(out, event="done", rank=rank, world=world, pid=os.getpid())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
