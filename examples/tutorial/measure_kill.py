"""Measures each step of docs/from-the-tutorial.md: kill -9 of a node -> the survivor's next step.

Two nodes (agents) on this machine, each with one worker, train the tutorial model with one
step per epoch (``--batch-size 2048``: an ``epoch N`` line is a step); a few seconds in,
one node is killed (its agent and workers, SIGKILL), and the time from the kill to the
survivor's first step at world size 1 is taken. Variants: ``train.py`` (restart, resume
from its epoch snapshot), ``train_run.py`` with ``ELASTIC_IN_PLACE=0`` (restart, resume from
memory), ``train_run.py`` (in place)::

    python examples/tutorial/measure_kill.py --repeat 3
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from elastic_tools.harness.cluster import AgentOptions, LocalCluster
from elastic.node.procs import descendants

HERE = Path(__file__).resolve().parent
EPOCH = re.compile(r"^epoch (\d+) world (\d+)", re.M)
VARIANTS = {
    "torchrun-style (train.py)": ("train.py", "--snapshot", {}),
    "Run, restart (train_run.py, ELASTIC_IN_PLACE=0)": (
        "train_run.py",
        "--checkpoints",
        {"ELASTIC_IN_PLACE": "0"},
    ),
    "Run, in place (train_run.py)": ("train_run.py", "--checkpoints", {}),
}


def epochs(text: str) -> int:
    return len(EPOCH.findall(text))


def worlds(text: str) -> list[str]:
    """The world size of each ``epoch`` line, in order."""
    return [world for _, world in EPOCH.findall(text)]


def once(variant: str, tmp: Path, settle_s: float) -> float:
    """One run of ``variant``: seconds from the kill -9 to the survivor's next step."""
    script, store_arg, extra = VARIANTS[variant]
    args = [str(HERE / script), store_arg, str(tmp / "state"), "--epochs", "100000"]
    args += ["--batch-size", "2048"]
    environ = {**os.environ, **extra}
    options = AgentOptions(nnodes="1:2", nproc=1, join_timeout=60, max_restarts=3)
    with LocalCluster(tmp / "run", options=options, env=environ, script=args) as cluster:
        a, b = cluster.start("a"), cluster.start("b")
        deadline = time.monotonic() + 180
        while epochs(a.output() + b.output()) < 20:  # both trained together for a while
            if time.monotonic() > deadline or not (a.running() and b.running()):
                raise RuntimeError(f"no training:\n{a.output()[-2000:]}\n{b.output()[-2000:]}")
            time.sleep(0.05)
        time.sleep(settle_s)
        seen = len(worlds(a.output()))
        tree = [b.pid, *descendants(b.pid)]
        killed = time.monotonic()
        for pid in tree:  # the whole node at once
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        while "1" not in worlds(a.output())[seen:]:
            if time.monotonic() - killed > 120 or not a.running():
                raise RuntimeError(f"the survivor did not train on:\n{a.output()[-3000:]}")
            time.sleep(0.002)
        return time.monotonic() - killed


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--settle", type=float, default=1.0, help="seconds before the kill")
    parser.add_argument("--only", default="", help="a substring of one variant's name")
    args = parser.parse_args()
    print(f"load: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    for variant in VARIANTS:
        if args.only not in variant:
            continue
        seconds = []
        for i in range(args.repeat):
            with tempfile.TemporaryDirectory() as tmp:
                seconds.append(once(variant, Path(tmp), args.settle))
            print(f"  {variant} #{i + 1}: {seconds[-1]:.2f} s", flush=True)
        print(f"{variant}: median {statistics.median(seconds):.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
