"""What a worker process can observe of its own freshness: for tests/agent/test_warm_fresh.py.

argv: <out-dir>. Writes ``<out-dir>/<restart>-<rank>-<pid>.json`` with multiprocessing's
start method, whether ``set_start_method("spawn")`` is allowed (first start) or whether a
DataLoader worker, of the default start method, can run a lambda in its dataset (the
restart: either choice fixes the start method for the rest of the process), the first
draw of Python's ``random``, numpy's and torch's global generators, and the open file
descriptors. Rank 1 of the first start then exits 1, so that the agent restarts the workers
once.
"""

import sys

PRELOADED = "torch" in sys.modules  # a warm start: forked after the server imported torch

import contextlib  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402


class Mapped(Dataset):  # type: ignore[type-arg,unused-ignore]
    def __init__(self) -> None:
        self.f = lambda i: i * 2  # not picklable: a spawned or forkserver worker fails

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> int:
        return self.f(i)


def data_loader() -> str:
    try:
        return "ok" if [int(b) for b in DataLoader(Mapped(), num_workers=1)] == [0, 2] else "?"
    except Exception as exc:  # recorded for the test to compare
        return f"{type(exc).__name__}: {exc}"


def main() -> None:
    out = sys.argv[1]
    rank = int(os.environ["RANK"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
    targets: dict[str, str] = {}
    seen: dict[str, object] = {
        "pid": os.getpid(),
        "preloaded": PRELOADED,
        "fds": [fd for fd in fds if os.path.exists(f"/proc/self/fd/{fd}")],
        "fd_targets": targets,
        "start_method": multiprocessing.get_start_method(allow_none=True),
        "random": random.random(),
        "numpy": float(np.random.random()),
        "torch": float(torch.rand(1)),
    }
    for fd in fds:
        with contextlib.suppress(OSError):
            targets[str(fd)] = os.readlink(f"/proc/self/fd/{fd}")
    if restart == 0:
        try:
            multiprocessing.set_start_method("spawn")
            seen["set_spawn"] = "ok"
        except RuntimeError as exc:
            seen["set_spawn"] = str(exc)
    else:
        seen["data_loader"] = data_loader()
    with open(os.path.join(out, f"{restart}-{rank}-{os.getpid()}.json"), "w") as f:
        json.dump(seen, f)
    if restart == 0 and rank == 1:
        sys.exit(1)


if __name__ == "__main__":
    main()
