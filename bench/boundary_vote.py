"""The step boundary's collective at N ranks: today's summed vector vs per-rank records.

Before (issue 38): one all-reduce of a float64 vector of ``8 + N * 4`` (the votes, the loss
sums, every rank's four straggler slots at its own offset). After: one all-gather of each
rank's record (``[N, 13]`` float64: its six votes, its loss sums, its own four slots and
its hang mark's commitment), checked on receipt (:meth:`Layout.parse`). N gloo
processes on this host (``torch.multiprocessing``), interleaved in rounds (A, B, A, B, ...),
each timed on every rank and the slowest rank's time taken (the boundary waits for it).

    .venv/bin/python bench/boundary_vote.py --ranks 16 --rounds 40 --reps 25

prints one JSON object: per variant the median and the 10th/90th percentiles of a
collective's time in microseconds, and the ratio after / before.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elastic.worker.boundary import Layout, Vote
from elastic.worker.straggler import LIMITS, SLOTS


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, port: int, rounds: int, reps: int, queue: mp.Queue) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    # the record as elastic.worker.agreement builds it: the straggler slots and the hang mark's
    # commitment (13 float64 per rank)
    layout = Layout(world, (*SLOTS, "hang_commit"), {**LIMITS, "hang_commit": (0.0, 2.0**48)})
    slots = {"compute_s": 0.01, "wait_s": 0.001, "node": 123.0, "since_drop_s": 0.0}
    slots["hang_commit"] = 2.0**47
    n = len(SLOTS)
    head = layout.head

    def summed() -> None:  # the old layout: votes, sums, world * slots
        vec = torch.zeros(head + world * n, dtype=torch.float64)
        vec[:head] = layout.row(Vote(), (1.0, 1.0), slots)[:head]
        vec[head + rank * n : head + (rank + 1) * n] = torch.tensor([slots[k] for k in SLOTS])
        dist.all_reduce(vec)
        vec.tolist()

    def gathered() -> None:  # the new one: each rank's record, gathered and checked
        row = layout.row(Vote(), (1.0, 1.0), slots)
        out = torch.empty(world * layout.fields, dtype=torch.float64)  # gloo: flat
        dist.all_gather_single(out, row)
        layout.parse(out)

    times: dict[str, list[float]] = {"all_reduce": [], "all_gather": []}
    for fn in (summed, gathered):  # warm up both
        for _ in range(5):
            fn()
    for _ in range(rounds):
        for name, fn in (("all_reduce", summed), ("all_gather", gathered)):
            dist.barrier()
            began = time.perf_counter()
            for _ in range(reps):
                fn()
            took = torch.tensor([(time.perf_counter() - began) / reps], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank's
            times[name].append(took.item() * 1e6)
    if rank == 0:
        queue.put(times)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--reps", type=int, default=25)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue: mp.Queue = ctx.Queue()
    port = _port()
    procs = [
        ctx.Process(target=_worker, args=(r, args.ranks, port, args.rounds, args.reps, queue))
        for r in range(args.ranks)
    ]
    for p in procs:
        p.start()
    times = queue.get(timeout=600)
    for p in procs:
        p.join(timeout=60)

    def figures(xs: list[float]) -> dict[str, float]:
        q = statistics.quantiles(xs, n=10)
        return {
            "median_us": round(statistics.median(xs), 1),
            "p10_us": round(q[0], 1),
            "p90_us": round(q[-1], 1),
        }

    before, after = figures(times["all_reduce"]), figures(times["all_gather"])
    print(
        json.dumps(
            {
                "ranks": args.ranks,
                "rounds": args.rounds,
                "reps": args.reps,
                "all_reduce_summed_vector": before,
                "all_gather_records": after,
                "ratio_median": round(after["median_us"] / before["median_us"], 3),
                "cpu_count": os.cpu_count(),
                "torch": torch.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
