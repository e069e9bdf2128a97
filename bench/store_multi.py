"""torch's worker-rank assignment on the etcd store: per-key requests vs multi_get/multi_set.

torch's elastic agent assigns ranks in ``SimpleElasticAgent._assign_worker_ranks``: every
agent sets its role, agent 0 reads every role (``multi_get``) and writes every agent's ranks
(``multi_set``), every agent reads its own. ``per-key`` is :class:`EtcdStore` as it was
before it had ``multi_get``/``multi_set`` (torch's C++ fallback then loops over ``get`` and
``set``, one etcd request per key); ``multi`` is the store now (one transaction per 128
keys). N simulated agents are threads of this process, each with its own etcd client and
lease, all on one local etcd (``elastic.etcd.server.start_etcd``), calling torch's own
method through ``PrefixStore`` as the rendezvous handler gives it. Each trial starts the N
agents together and times the rank assignment from the start until the last agent has its
ranks; it also counts agent 0's requests. The two paths alternate trial by trial (A, B, B,
A, ...) so drift in machine load hits both alike.

    .venv/bin/python bench/store_multi.py --nodes 3,8,16 --repeats 15

prints one JSON object: per node count and path the median, 10th and 90th percentiles of the
assignment time in milliseconds, and agent 0's requests.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent, WorkerSpec

from elastic.etcd.client import EtcdClient, EtcdOptions, parse_endpoints
from elastic.etcd.server import start_etcd
from elastic.rendezvous.keys import RunKeys
from elastic.rendezvous.lease import RunLease
from elastic.rendezvous.store import EtcdStore
from elastic_tools.harness.cluster import provenance

PATHS = ("per-key", "multi")


class PerKeyStore(EtcdStore):
    """The store without multi_get/multi_set: torch's C++ per-key loops run instead."""

    multi_get = dist.Store.multi_get
    multi_set = dist.Store.multi_set  # type: ignore[attr-defined]


def trial(stores: list[EtcdStore], clients: list[EtcdClient], prefix: str) -> tuple[float, int]:
    """One rank assignment of ``len(stores)`` agents: (seconds, agent 0's requests)."""
    nodes = len(stores)
    spec = WorkerSpec(role="trainer", local_world_size=8, rdzv_handler=None, entrypoint="x")  # type: ignore[arg-type]
    agent: Any = None  # torch's method reads only its arguments
    errors: list[BaseException] = []
    go = threading.Barrier(nodes + 1)

    def run(rank: int) -> None:
        try:
            go.wait()
            SimpleElasticAgent._assign_worker_ranks(
                agent, dist.PrefixStore(prefix, stores[rank]), rank, nodes, spec
            )
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(nodes)]
    for t in threads:
        t.start()
    before = clients[0].requests
    go.wait()
    started = time.perf_counter()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - started
    if errors:
        raise errors[0]
    return seconds, clients[0].requests - before


def summarize(values: list[float]) -> dict[str, float]:
    deciles = statistics.quantiles(values, n=10) if len(values) > 1 else [values[0]] * 9
    return {
        "median": round(statistics.median(values), 2),
        "p10": round(deciles[0], 2),
        "p90": round(deciles[-1], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="3,8,16", help="comma-separated agent counts")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    counts = [int(n) for n in args.nodes.split(",")]

    result: dict[str, Any] = {"provenance": provenance(), "repeats": args.repeats, "nodes": {}}
    with tempfile.TemporaryDirectory(prefix="bench-store-multi-") as tmp:
        server = start_etcd(Path(tmp) / "data")
        try:
            options = EtcdOptions(parse_endpoints(server.endpoint)[0])
            clients = [EtcdClient(options) for _ in range(max(counts))]
            keys = RunKeys("/bench-store-multi", "run")
            leases = [RunLease(c, 60) for c in clients]
            limit = timedelta(seconds=60)
            pairs = list(zip(clients, leases, strict=True))
            made = {
                kind: [kind(c, keys, ls, limit) for c, ls in pairs]
                for kind in (PerKeyStore, EtcdStore)
            }
            for n in counts:
                trial(made[EtcdStore][:n], clients[:n], f"warmup.{n}")
                times: dict[str, list[float]] = {p: [] for p in PATHS}
                requests: dict[str, list[int]] = {p: [] for p in PATHS}
                for repeat in range(args.repeats):
                    order = PATHS if repeat % 2 == 0 else PATHS[::-1]
                    for path in order:
                        stores = made[PerKeyStore if path == "per-key" else EtcdStore][:n]
                        seconds, sent = trial(stores, clients[:n], f"{path}.{n}.{repeat}")
                        times[path].append(seconds * 1000)
                        requests[path].append(sent)
                result["nodes"][n] = {
                    path: {
                        "assign_ms": summarize(times[path]),
                        "agent0_requests": statistics.median(requests[path]),
                    }
                    for path in PATHS
                }
                per_key, multi = (result["nodes"][n][p]["assign_ms"]["median"] for p in PATHS)
                result["nodes"][n]["speedup"] = round(per_key / multi, 2)
            for client in clients:
                client.close()
        finally:
            server.stop(signal.SIGKILL)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
