"""A plain torchrun-style DDP script (no elastic.Run): for warm-start tests and the bench.

argv: <out-dir> [--steps N] [--step-delay S] [--exit-code K] [--stop-file F] [--term-exit0]
Reads RANK/WORLD_SIZE, forms a gloo group, trains a tiny DDP model N steps (``--stop-file``:
until F exists, which every rank learns in the same step), then rank 0 exits K. Each start
writes ``<out-dir>/start-<rank>-<pid>.json``: what it saw (pid, parent, argv, cwd,
sys.path[0], __file__, the environment, the garbage collector's state) and whether torch
was imported before its first line ran. Rank 0 appends a ``train.step`` event per step to
``$ELASTIC_EVENT_LOG`` (when set), the line the bench measures. ``--term-exit0``: on
SIGTERM finish the step and exit 0 (a script that handles SIGTERM itself).
"""

import sys

PRELOADED = sorted(m for m in ("torch", "torchvision", "elastic") if m in sys.modules)

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

STOP = False


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--step-delay", type=float, default=0.0)
    p.add_argument("--exit-code", type=int, default=0)
    p.add_argument("--stop-file", default="")
    p.add_argument("--term-exit0", action="store_true")
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    evidence = {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "argv": sys.argv,
        "cwd": os.getcwd(),
        "path0": sys.path[0],
        "file": __file__,
        "env": dict(os.environ),
        "preloaded": PRELOADED,
        "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "signals": {
            s.name: repr(signal.getsignal(s))
            for s in (signal.SIGINT, signal.SIGHUP, signal.SIGCHLD, signal.SIGPIPE, signal.SIGQUIT)
        },
        "sid_is_pid": os.getsid(0) == os.getpid(),
        "gc_enabled": gc.isenabled(),
        "gc_frozen": gc.get_freeze_count(),
        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
    }
    with open(os.path.join(args.out, f"start-{rank}-{os.getpid()}.json"), "w") as f:
        json.dump(evidence, f)
    if args.term_exit0:

        def stop(signum: int, frame: object) -> None:
            global STOP
            STOP = True

        signal.signal(signal.SIGTERM, stop)
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    events = os.environ.get("ELASTIC_EVENT_LOG") if rank == 0 else None
    step = 0
    while (args.stop_file or step < args.steps) and not STOP:
        if args.stop_file:
            flag = torch.tensor([float(os.path.exists(args.stop_file))])
            dist.all_reduce(flag)
            if flag.item() > 0:
                break
        loss = model(torch.ones(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if events:
            line = {
                "ts": time.time(),
                "kind": "train.step",
                "pid": os.getpid(),
                "step": step,
                "world_size": world,
                "loss": float(loss.detach()),
            }
            with open(events, "a") as f:
                f.write(json.dumps(line) + "\n")
        print(f"rank {rank} step {step}", flush=True)
        if args.step_delay:
            time.sleep(args.step_delay)
    # every rank is done, then leave without gloo's teardown: a rank whose peer already
    # exited can abort (SIGABRT) in it, which hid rank 0's exit code in one CI run
    dist.barrier()
    return args.exit_code if rank == 0 else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
