"""Checkpoint cost for ResNet-18/50 state (+ SGD momentum), all in one run; prints JSON.

Measured per model (median of ``--repeats``):

* ``copy_prealloc_ms``: copying the state into preallocated CPU buffers (the floor);
* ``torch_save_ms``: ``torch.save`` to a local file, fsynced;
* ``dcp_sync_ms``: ``dcp.save`` through torch's fsspec writer;
* ``dcp_async_blocking_ms``: how long ``dcp.async_save`` blocks with its default stager;
* ``ours_blocking_ms``: how long our :class:`CheckpointManager` save blocks the caller;
* ``ours_durable_ms``: from our save call until the commit marker is durable;

plus ``fsync_mb_s`` (the disk's write+fsync bandwidth, measured in the same run)
and ``ours_persist_mb_s`` (state bytes / (durable - blocking)).

Usage: ``python bench/checkpoint.py [--models resnet18 resnet50] [--dir /tmp/x]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torchvision

from elastic.checkpoint import CheckpointManager
from elastic.checkpoint.storage import HashingWriter
from elastic.training.config import CheckpointConfig


def _state(name: str) -> dict[str, Any]:
    model = torchvision.models.get_model(name, weights=None)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3, 64, 64)).sum().backward()
    optim.step()
    momentum = {f"{i}": optim.state[p]["momentum_buffer"] for i, p in enumerate(model.parameters())}
    return {"model": model.state_dict(), "momentum": momentum}


def _nbytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_nbytes(v) for v in state.values())
    return 0


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return round(statistics.median(times) * 1e3, 2)


def _fsync_mb_s(root: Path, nbytes: int) -> float:
    data = os.urandom(min(nbytes, 64 << 20))
    path = root / "fsync.bin"
    started = time.perf_counter()
    with path.open("wb") as f:
        written = 0
        while written < nbytes:
            f.write(data)
            written += len(data)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - started
    path.unlink()
    return round(written / seconds / 1e6, 1)


def _flat(state: dict[str, Any]) -> list[torch.Tensor]:
    return [t for part in state.values() for t in part.values()]


def bench_model(name: str, root: Path, repeats: int) -> dict[str, Any]:
    """Measure every save path for one model's state."""
    state = _state(name)
    nbytes = _nbytes(state)
    src = _flat(state)
    buffers = [torch.empty_like(t) for t in src]

    def copy() -> None:
        for dst, s in zip(buffers, src, strict=True):
            dst.copy_(s)

    def torch_save() -> None:
        with (root / "torch.pt").open("wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    def dcp_sync() -> None:
        dcp.save(state, storage_writer=HashingWriter(str(root / f"sync-{uuid.uuid4().hex}")))

    futures = []

    def dcp_async() -> None:
        futures.append(
            dcp.async_save(
                state, storage_writer=HashingWriter(str(root / f"async-{uuid.uuid4().hex}"))
            )
        )

    result: dict[str, Any] = {"model": name, "state_mb": round(nbytes / 1e6, 1)}
    result["copy_prealloc_ms"] = _median_ms(copy, repeats * 3)
    result["torch_save_ms"] = _median_ms(torch_save, repeats)
    result["dcp_sync_ms"] = _median_ms(dcp_sync, repeats)
    times = []
    for _ in range(repeats):
        times.append(_median_ms(dcp_async, 1))
        futures.pop().result()
    result["dcp_async_blocking_ms"] = statistics.median(times)
    result.update(_ours(state, root, repeats, nbytes))
    result["fsync_mb_s"] = statistics.median(_fsync_mb_s(root, nbytes) for _ in range(3))
    result["blocking_vs_copy"] = round(result["ours_blocking_ms"] / result["copy_prealloc_ms"], 2)
    result["persist_vs_fsync"] = round(result["ours_persist_mb_s"] / result["fsync_mb_s"], 2)
    return result


def _ours(state: dict[str, Any], root: Path, repeats: int, nbytes: int) -> dict[str, Any]:
    cfg = CheckpointConfig(url=str(root / f"ours-{uuid.uuid4().hex}"), keep_last=1, verify="size")
    manager = CheckpointManager(cfg, run_id="bench")
    manager.save(0, state, block=True)  # first save allocates the staging buffers
    blocking, durable = [], []
    for step in range(1, repeats + 1):
        manager.save(step, state)
        outcome = manager.wait()
        assert outcome is not None and outcome.ok, outcome
        blocking.append(outcome.blocking_s)
        durable.append(outcome.durable_s)
    manager.close()
    b, d = statistics.median(blocking), statistics.median(durable)
    return {
        "ours_blocking_ms": round(b * 1e3, 2),
        "ours_durable_ms": round(d * 1e3, 1),
        "ours_persist_mb_s": round(nbytes / max(d - b, 1e-9) / 1e6, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet18", "resnet50"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: tmp)")
    args = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        results = [bench_model(name, Path(tmp), args.repeats) for name in args.models]
    dist.destroy_process_group()
    print(
        json.dumps(
            {
                "bench": "checkpoint",
                "torch": torch.__version__,
                "cuda": torch.cuda.is_available(),
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
