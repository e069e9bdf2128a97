"""Checkpoint cost for ResNet-18/50 state (+ SGD momentum), all in one run; prints JSON.

Measured per model, in rounds (median of ``--repeats``), every path once per round
so that a change in the machine's load hits them all alike:

* ``fsync_mb_s``: the disk's write+fsync bandwidth (a new file of the state's size);
* ``copy_prealloc_ms``: copying the state into preallocated CPU buffers (the floor);
* ``torch_save_ms``: ``torch.save`` of the state to a new local file, fsynced;
* ``dcp_sync_ms``: ``dcp.save`` through torch's own fsspec writer (fsynced);
* ``dcp_async_blocking_ms``: how long ``dcp.async_save`` blocks with its default stager;
* ``ours``: our :class:`CheckpointManager` in a worker process, one async save per
  round: ``blocking_ms`` (the caller is blocked), ``durable_ms`` (from the save call
  until the commit marker is durable), ``wait_ms`` (until the save is done, old
  steps purged), ``persist_mb_s`` (state bytes / (durable - blocking)), ``cpu_ms``
  (the worker's CPU time, all threads, from the save call until it is done: what a save
  costs where the CPUs are busy anyway, less sensitive to the machine's load);
* ``baseline`` (with ``--baseline REV``): the same for the ``elastic`` package of git
  revision ``REV``, in a second worker process whose saves alternate with ours;
* ``--signed``: both managers sign their markers with a (fixed) job secret, so files are
  vouched for by the signed runs' digest (AES-GMAC and a CRC-32 since marker version 4, a
  SHA-256 tree in version 3, CRC-32 before); without it they are unsigned (CRC-32); each
  worker reports the digests its markers record (``digests``);
* ``--variants unsigned signed``: one worker per variant (and per baseline), all in the
  same rounds, so signed and unsigned saves and ``torch.save`` see the same machine state;
  their results are keyed ``ours-unsigned``, ``ours-signed`` (``baseline-...``).

Ratios: ``durable_vs_torch_save``, ``blocking_vs_copy``, ``persist_vs_fsync``. Each
figure is the median over the rounds (``*_range``: the min and max of the per-round
ratios, each against that round's own ``torch.save``, copy and fsync figures); the JSON
records the git commit, the load average and the ``elastic`` package each worker imported.

Usage: ``python bench/checkpoint.py [--models resnet18 resnet50] [--repeats 5]
[--baseline REV | --baseline-path DIR] [--signed | --variants unsigned signed]
[--dir /tmp/x] [--json-out PATH]``
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torchvision
from torch.distributed.checkpoint import FileSystemWriter


@functools.cache
def _repo() -> Path:
    """This checkout (:data:`elastic_tools.harness.cluster.REPO`). Imported on first use, by the
    parent only: a worker (``--worker``) must import the ``elastic`` package its
    ``PYTHONPATH`` names, which may be a baseline's."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout first
    from elastic_tools.harness.cluster import REPO

    if REPO is None:  # not expected: sys.path starts with this checkout
        raise SystemExit("bench/checkpoint.py runs from a source checkout of elastic.")
    return REPO


def _state(name: str) -> dict[str, Any]:
    torch.manual_seed(0)
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


def _ms(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1e3


def _median(values: list[float], digits: int = 1) -> float:
    return round(statistics.median(values), digits)


def _fsync_mb_s(root: Path, data: bytes, nbytes: int) -> float:
    path = root / f"fsync-{uuid.uuid4().hex}.bin"
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
    return written / seconds / 1e6


def _flat(state: dict[str, Any]) -> list[torch.Tensor]:
    return [t for part in state.values() for t in part.values()]


class _Worker:
    """A process that saves through one ``elastic`` package's manager, one save a line."""

    def __init__(
        self, name: str, model: str, root: Path, pythonpath: str | None, signed: bool
    ) -> None:
        env = dict(os.environ)
        if pythonpath is not None:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
        url = root / f"{name}-{uuid.uuid4().hex}"
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", model, "--dir", str(url)]
            + (["--signed"] if signed else []),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.package = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"The bench worker exited with {self.proc.wait()}.")
        return dict(json.loads(line))

    def save(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("save\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=120)


_BENCH_SECRET = b"bench-secret-only-for-bench-checkpoints"


def _worker_main(model: str, url: Path, out: IO[str], signed: bool) -> None:
    """Serve ``save`` lines: one async save of ``model``'s state each, timings as JSON."""
    import elastic
    from elastic.checkpoint import CheckpointManager
    from elastic.checkpoint.config import CheckpointConfig

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    state = _state(model)
    cfg = CheckpointConfig(url=str(url), keep_last=1, verify="size")
    manager = CheckpointManager(cfg, run_id="bench", secret=_BENCH_SECRET if signed else None)
    first = manager.save(0, state, block=True)  # the first save allocates the staging buffers
    from elastic.checkpoint import storage

    files = getattr(first, "files", None) or {}
    package = {
        "package": str(Path(elastic.__file__).parent),
        "crc32": getattr(storage, "CRC32_IMPLEMENTATION", "zlib"),
        "digests": sorted({k for entry in files.values() for k in entry if k != "size"}),
    }
    print(json.dumps(package), file=out, flush=True)
    for step, _ in enumerate(sys.stdin, start=1):
        started, cpu = time.perf_counter(), time.process_time()
        manager.save(step, state)
        outcome = manager.wait()
        waited, cpu = time.perf_counter() - started, time.process_time() - cpu
        assert outcome is not None and outcome.ok, outcome
        print(
            json.dumps(
                {
                    "blocking_s": outcome.blocking_s,
                    "durable_s": outcome.durable_s,
                    "wait_s": waited,
                    "cpu_s": cpu,
                }
            ),
            file=out,
            flush=True,
        )
    manager.close()
    dist.destroy_process_group()


def _summary(saves: list[dict[str, Any]], nbytes: int, package: dict[str, Any]) -> dict[str, Any]:
    blocking = [s["blocking_s"] * 1e3 for s in saves]
    durable = [s["durable_s"] * 1e3 for s in saves]
    persist = [nbytes / max(s["durable_s"] - s["blocking_s"], 1e-9) / 1e6 for s in saves]
    return {
        "blocking_ms": _median(blocking, 2),
        "durable_ms": _median(durable),
        "wait_ms": _median([s["wait_s"] * 1e3 for s in saves]),
        "cpu_ms": _median([s.get("cpu_s", 0.0) * 1e3 for s in saves]),
        "persist_mb_s": _median(persist),
        "durable_ms_all": [round(d, 1) for d in durable],
        **package,
    }


def _range(values: list[float]) -> list[float]:
    return [round(min(values), 2), round(max(values), 2)]


def bench_model(
    name: str,
    root: Path,
    repeats: int,
    baseline: str | None,
    dcp_paths: bool,
    variants: list[str],
) -> dict[str, Any]:
    """Measure every save path for one model's state, interleaved in rounds."""
    state = _state(name)
    nbytes = _nbytes(state)
    src = _flat(state)
    buffers = [torch.empty_like(t) for t in src]
    random = os.urandom(min(nbytes, 64 << 20))

    def copy() -> None:
        for dst, s in zip(buffers, src, strict=True):
            dst.copy_(s)

    def torch_save() -> float:
        path = root / f"torch-{uuid.uuid4().hex}.pt"

        def save() -> None:
            with path.open("wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())

        ms = _ms(save)
        path.unlink()
        return ms

    def dcp_sync() -> None:
        dcp.save(state, storage_writer=FileSystemWriter(str(root / f"sync-{uuid.uuid4().hex}")))

    def dcp_async_blocking() -> float:
        path = str(root / f"async-{uuid.uuid4().hex}")
        responses: list[Any] = []
        ms = _ms(
            lambda: responses.append(dcp.async_save(state, storage_writer=FileSystemWriter(path)))
        )
        response = responses[0]
        getattr(response, "upload_completion", response).result()
        return ms

    packages = {"ours": str(_repo())}
    if baseline is not None:
        packages["baseline"] = baseline
    workers: dict[str, _Worker] = {}
    for who, pythonpath in packages.items():
        for variant in variants:
            key = who if len(variants) == 1 else f"{who}-{variant}"
            workers[key] = _Worker(key, name, root, pythonpath, variant == "signed")
    times: dict[str, list[float]] = {
        "fsync_mb_s": [],
        "copy_prealloc_ms": [],
        "torch_save_ms": [],
        "dcp_sync_ms": [],
        "dcp_async_blocking_ms": [],
    }
    saves: dict[str, list[dict[str, Any]]] = {k: [] for k in workers}
    for round_ in range(repeats):
        order = list(workers)[round_ % len(workers) :] + list(workers)[: round_ % len(workers)]
        times["fsync_mb_s"].append(_fsync_mb_s(root, random, nbytes))
        times["copy_prealloc_ms"].append(statistics.median(_ms(copy) for _ in range(3)))
        times["torch_save_ms"].append(torch_save())
        for key in order:
            saves[key].append(workers[key].save())
        if dcp_paths:
            times["dcp_sync_ms"].append(_ms(dcp_sync))
            times["dcp_async_blocking_ms"].append(dcp_async_blocking())
    for worker in workers.values():
        worker.close()
    result: dict[str, Any] = {"model": name, "state_mb": round(nbytes / 1e6, 1)}
    for key, values in times.items():
        if values:
            result[key] = _median(values, 2 if key == "copy_prealloc_ms" else 1)
    result["torch_save_ms_all"] = [round(t, 1) for t in times["torch_save_ms"]]
    result["fsync_mb_s_all"] = [round(t, 1) for t in times["fsync_mb_s"]]
    for key, worker in workers.items():
        summary = _summary(saves[key], nbytes, worker.package)
        summary["durable_vs_torch_save"] = round(summary["durable_ms"] / result["torch_save_ms"], 2)
        summary["blocking_vs_copy"] = round(summary["blocking_ms"] / result["copy_prealloc_ms"], 2)
        summary["persist_vs_fsync"] = round(summary["persist_mb_s"] / result["fsync_mb_s"], 2)
        per_round = list(zip(saves[key], times["torch_save_ms"], times["fsync_mb_s"], strict=True))
        summary["durable_vs_torch_save_range"] = _range(
            [s["durable_s"] * 1e3 / t for s, t, _ in per_round]
        )
        summary["persist_vs_fsync_range"] = _range(
            [
                nbytes / max(s["durable_s"] - s["blocking_s"], 1e-9) / 1e6 / f
                for s, _, f in per_round
            ]
        )
        summary["blocking_vs_copy_range"] = _range(
            [
                s["blocking_s"] * 1e3 / c
                for s, c in zip(saves[key], times["copy_prealloc_ms"], strict=True)
            ]
        )
        result[key] = summary
    return result


def _export(rev: str, into: Path) -> str:
    """Unpack the ``elastic`` package of git revision ``rev`` under ``into``."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", rev, "elastic"],
        cwd=_repo(),
        capture_output=True,
        check=True,
    ).stdout
    target = into / "baseline"
    target.mkdir()
    with tempfile.TemporaryFile() as f:
        f.write(archive)
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            tar.extractall(target, filter="data")
    return str(target)


def _git(*args: str) -> str:
    out = subprocess.run(["git", *args], cwd=_repo(), capture_output=True, text=True, check=False)
    return out.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet18", "resnet50"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: tmp)")
    parser.add_argument("--baseline", help="git revision whose elastic package to compare")
    parser.add_argument(
        "--baseline-path",
        type=Path,
        help="a directory holding the elastic package to compare (instead of --baseline)",
    )
    parser.add_argument("--no-dcp", action="store_true", help="skip torch's own DCP paths")
    parser.add_argument("--json-out", type=Path, help="also write the JSON here")
    parser.add_argument("--signed", action="store_true", help="sign the markers (a job secret)")
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=["unsigned", "signed"],
        help="one worker per variant, interleaved in the same rounds (overrides --signed)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    if args.worker:
        _worker_main(args.worker, args.dir, sys.stdout, args.signed)
        return
    variants = args.variants or (["signed"] if args.signed else ["unsigned"])
    load_before = os.getloadavg()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        baseline = _export(args.baseline, Path(tmp)) if args.baseline else None
        if args.baseline_path is not None:
            baseline = str(args.baseline_path.resolve())
        results = [
            bench_model(name, Path(tmp), args.repeats, baseline, not args.no_dcp, variants)
            for name in args.models
        ]
    dist.destroy_process_group()
    report = {
        "bench": "checkpoint",
        "commit": _git("rev-parse", "HEAD"),
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no", "--", "elastic")),
        "baseline": _git("rev-parse", args.baseline) if args.baseline else None,
        "baseline_path": str(args.baseline_path) if args.baseline_path else None,
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "cpus": os.cpu_count(),
        "loadavg_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "repeats": args.repeats,
        "variants": variants,
        "results": results,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json_out:
        args.json_out.write_text(text + "\n")


if __name__ == "__main__":
    main()
