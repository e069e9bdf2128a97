"""What the bounded bootstrap store costs against torch's own TCPStore server.

Each server is hosted as the agent hosts it (``elastic.rendezvous.bootstrap.BootstrapStore``
in a process of its own: torch's server on the held socket, or ``BoundedStore``, a thread of that
process), with ``ELASTIC_BOUNDED_STORE`` set to 0 or 1. The clients are torch's
``TCPStore`` clients, as in every worker. Measured, per server:

* ``set_get_us``: one client, ``--ops`` set+get round trips (mean microseconds per pair;
  ``set_get_best_us``: the fastest twentieth of them, the least disturbed by other load);
* ``parallel_set_get_us``: ``--clients`` processes doing the same at once (mean per pair
  over all of them: the server's throughput under contention);
* ``gloo_form_s``: ``--world`` processes forming a gloo group through the store and
  running one barrier, from the last rank's connect to the last rank's barrier (median of
  ``--forms`` rounds, each on a fresh store, as each round gets its own).

``python bench/boundstore.py [--ops 2000] [--clients 4] [--world 4] [--forms 5] [--json F]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

_HOST = textwrap.dedent(
    """
    import sys, time
    from datetime import timedelta
    from elastic.rendezvous.bootstrap import BootstrapStore
    boot = BootstrapStore()
    port = boot.reserve("127.0.0.1")
    boot.start_round(0, "127.0.0.1", port)
    assert boot.hosting
    print(port, flush=True)
    sys.stdin.read()  # serve until the bench closes our stdin
    """
)

_CLIENT = textwrap.dedent(
    """
    import sys, time
    from datetime import timedelta
    import torch.distributed as dist
    port, ops, tag = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    value = b"x" * 128
    store.set("warm" + tag, value)
    store.get("warm" + tag)
    batch, best, total = max(1, ops // 20), float("inf"), 0.0
    for b in range(0, ops, batch):
        t0 = time.perf_counter()
        for i in range(b, min(ops, b + batch)):
            key = "k%s-%d" % (tag, i % 64)
            store.set(key, value)
            store.get(key)
        took = time.perf_counter() - t0
        total += took
        best = min(best, took / (min(ops, b + batch) - b))
    print(total, best, flush=True)
    """
)

_WORKER = textwrap.dedent(
    """
    import sys, time
    from datetime import timedelta
    import torch.distributed as dist
    port, rank, world = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    t0 = time.time()
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    dist.barrier()
    print(t0, time.time(), flush=True)
    dist.destroy_process_group()
    """
)


def _env(bounded: bool) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))
    return {
        **os.environ,
        "PYTHONPATH": path,
        "ELASTIC_BOUNDED_STORE": "1" if bounded else "0",
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
    }


class Host:
    """One store, hosted as the agent hosts it, in a process of its own."""

    def __init__(self, bounded: bool) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _HOST],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=_env(bounded),
        )
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


def _run_all(argvs: list[list[str]], bounded: bool) -> list[list[float]]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", *a], stdout=subprocess.PIPE, text=True, env=_env(bounded)
        )
        for a in argvs
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a bench process failed: {[p.returncode for p in procs]}")
    return [[float(x) for x in o.strip().splitlines()[-1].split()] for o in outs]


def measure(bounded: bool, ops: int, clients: int, world: int, forms: int) -> dict[str, Any]:
    host = Host(bounded)
    try:
        ((one, one_best),) = _run_all([[_CLIENT, str(host.port), str(ops), "a"]], bounded)
        many = [
            t
            for (t, _) in _run_all(
                [[_CLIENT, str(host.port), str(ops), f"c{i}"] for i in range(clients)], bounded
            )
        ]
    finally:
        host.close()
    form_s = []
    for _ in range(forms):
        host = Host(bounded)
        try:
            times = _run_all(
                [[_WORKER, str(host.port), str(r), str(world)] for r in range(world)], bounded
            )
        finally:
            host.close()
        # from the last rank's first request to the last rank's barrier: what the store
        # and gloo take once every rank is there, without the ranks' start-up skew
        form_s.append(max(end for _, end in times) - max(start for start, _ in times))
    return {
        "set_get_us": round(one / ops * 1e6, 1),
        "set_get_best_us": round(one_best * 1e6, 1),
        "parallel_set_get_us": round(statistics.mean(many) / ops * 1e6, 1),
        "gloo_form_s": round(statistics.median(form_s), 3),
        "gloo_form_all_s": [round(t, 3) for t in form_s],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--forms", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results: dict[str, Any] = {
        "ops": args.ops,
        "clients": args.clients,
        "world": args.world,
        "forms": args.forms,
        "cpus": os.cpu_count(),
    }
    for name, bounded in (("torch", False), ("bounded", True)):
        results[name] = measure(bounded, args.ops, args.clients, args.world, args.forms)
        print(name, results[name], flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
