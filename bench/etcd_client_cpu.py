"""Client CPU per etcd request: protobuf's C (upb) implementation vs its pure-Python one.

Method. One etcd (``elastic.etcd.server.start_etcd``) serves every run. Each run is a
fresh child process that imports :mod:`elastic.etcd.client` (timed), opens one
``EtcdClient``, makes ``--warmup`` requests, then measures ``time.process_time()``
(user + system CPU of the whole process: gRPC, protobuf, our client code) and wall
time over ``--requests`` requests that alternate a ``range`` and a ``put`` of a
``--value-bytes`` value on one key. The two implementations differ only in the
child's environment: ``PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION`` unset (the default,
upb) or ``=python`` (what the old ``etcd3`` 0.12 stubs forced on every process). The
child checks that protobuf really runs the implementation asked for. Runs interleave
(upb, python, python, upb, ...) so drift in machine load hits both alike; the
report gives per-implementation medians with min/max and the spread of the middle
half (IQR), and the ratio of the medians.

Usage: ``python bench/etcd_client_cpu.py [--requests 2000] [--repeats 7] [--value-bytes 256]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

IMPL_VAR = "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"
IMPLS = ("upb", "python")


def child(endpoint: str, impl: str, requests: int, warmup: int, value_bytes: int) -> None:
    """Measure one run in this process and print its numbers as one JSON line."""
    started = time.perf_counter()
    from elastic.etcd.client import EtcdClient, EtcdOptions, parse_endpoints

    import_s = time.perf_counter() - started
    from google.protobuf.internal import api_implementation

    if api_implementation.Type() != impl:
        raise SystemExit(f"protobuf runs '{api_implementation.Type()}', not '{impl}'.")
    key, value = f"/bench/cpu/{os.getpid()}".encode(), b"v" * value_bytes
    with EtcdClient(EtcdOptions(parse_endpoints(endpoint)[0])) as client:
        for i in range(warmup):
            client.range(key) if i % 2 else client.put(key, value)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for i in range(requests):
            client.range(key) if i % 2 else client.put(key, value)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        client.delete(key)
    print(
        json.dumps(
            {
                "impl": impl,
                "cpu_us_per_request": cpu / requests * 1e6,
                "wall_us_per_request": wall / requests * 1e6,
                "import_client_s": import_s,
            }
        )
    )


def run_child(endpoint: str, impl: str, args: argparse.Namespace) -> dict[str, Any]:
    from elastic_tools.harness.cluster import pythonpath

    environ = dict(os.environ)
    environ.pop(IMPL_VAR, None)
    if impl == "python":
        environ[IMPL_VAR] = "python"
    environ["PYTHONPATH"] = pythonpath(environ)
    argv = [sys.executable, __file__, "--child", endpoint, "--impl", impl]
    argv += ["--requests", str(args.requests), "--warmup", str(args.warmup)]
    argv += ["--value-bytes", str(args.value_bytes)]
    out = subprocess.run(argv, env=environ, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"The {impl} run failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(values: list[float]) -> dict[str, float]:
    quartiles = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {
        "median": round(statistics.median(values), 2),
        "min": round(min(values), 2),
        "max": round(max(values), 2),
        "iqr": round(quartiles[2] - quartiles[0], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--value-bytes", type=int, default=256)
    parser.add_argument("--child", metavar="ENDPOINT", help=argparse.SUPPRESS)
    parser.add_argument("--impl", choices=IMPLS, default="upb", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.impl, args.requests, args.warmup, args.value_bytes)
        return

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages first
    from elastic.etcd.server import start_etcd

    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-etcd-cpu-") as tmp:
        server = start_etcd(Path(tmp) / "data")
        try:
            for repeat in range(args.repeats):
                order = IMPLS if repeat % 2 == 0 else IMPLS[::-1]
                for impl in order:
                    runs.append({"repeat": repeat, **run_child(server.endpoint, impl, args)})
        finally:
            server.stop(signal.SIGKILL)

    from google.protobuf import __version__ as protobuf_version

    from elastic_tools.harness.cluster import provenance

    result: dict[str, Any] = {
        "provenance": provenance(),
        "requests_per_run": args.requests,
        "value_bytes": args.value_bytes,
        "repeats": args.repeats,
        "python_version": platform.python_version(),
        "protobuf": protobuf_version,
        "cpus": os.cpu_count(),
    }
    for impl in IMPLS:
        mine = [r for r in runs if r["impl"] == impl]
        result[impl] = {
            metric: summarize([r[metric] for r in mine])
            for metric in ("cpu_us_per_request", "wall_us_per_request", "import_client_s")
        }
    result["cpu_ratio_python_over_upb"] = round(
        result["python"]["cpu_us_per_request"]["median"]
        / result["upb"]["cpu_us_per_request"]["median"],
        2,
    )
    result["runs"] = runs
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
