"""One rank of the peer-state trust test (spawned by tests/recovery/test_exchange.py).

``python stream_peer.py RANK STOREFILE CASE``; rank 0 is the sender (or the rogue), rank 1
the receiver, which prints ``OK``, or ``REFUSED: <message>`` for a refused state.
Each rank's job secret comes from its own ``$ELASTIC_SECRET_FILE``.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from elastic.errors import RecoveryError
from elastic.worker import exchange


def _sender(case: str) -> None:
    if case == "offer":  # a rogue's offer: a negative step
        offer = torch.tensor([0, 0, 0, 1, -5, 0, -1])  # no live state; held: step -5
        dist.all_gather([torch.zeros(7, dtype=torch.int64)] * 2, offer)
    elif case == "huge":  # a rogue's size claim, then nothing
        dist.broadcast(torch.tensor([1 << 40, 1 << 50], dtype=torch.int64), src=0)
        dist.broadcast(torch.zeros(exchange.TAG, dtype=torch.uint8), src=0)
    else:
        data = torch.arange(1000, dtype=torch.float32).view(torch.uint8)
        exchange.stream(b'{"k": 1}', data, 0, receive=False)


def _receiver(case: str) -> None:
    try:
        if case == "offer":
            exchange.agree((3, 1), -1)
        else:
            got = exchange.stream(None, None, 0, receive=True)
            assert got is not None and got[0] == b'{"k": 1}'
            assert torch.equal(got[1].view(torch.float32), torch.arange(1000.0))
    except RecoveryError as exc:
        print(f"REFUSED: {exc}")
        return
    print("OK")


def _abandoned(rank: int, store: dist.Store) -> None:
    """The source stays in the group but never sends (its node went on to a newer round):
    the receiver's stream must end when its step guard is aborted, not at the timeout."""
    if rank == 0:
        store.wait(["released"], timedelta(seconds=60))
        return
    import threading
    import time

    from elastic.worker.guard import StepGuard

    guard = StepGuard()
    threading.Timer(0.5, guard.abort, ("a newer round is formed",)).start()
    started = time.monotonic()
    try:
        exchange.stream(None, None, 0, receive=True, run=guard.run)
        print("RECEIVED")
    except exchange.Interrupted:
        print(f"INTERRUPTED {time.monotonic() - started:.2f}")
    store.set("released", "1")


def main(rank: int, path: str, case: str) -> None:
    store = dist.FileStore(path, 2)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=30)
    )
    if case == "abandoned":
        _abandoned(rank, store)
    else:
        (_sender if rank == 0 else _receiver)(case)
    sys.stdout.flush()
    # No teardown: a refused peer leaves the group mid-protocol, and gloo may abort in its
    # destructors at exit; what is tested has been printed.
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
