"""Time and count one rendezvous round: our ``etcd-v3`` handlers vs torch's ``c10d``, one run.

Default (multi-process): ``single-key``, ``announce`` and ``c10d`` at each N, the nodes spread
over ``--procs`` worker processes; see bench/README-rendezvous.md. ``--single-process`` runs
the earlier bench described below (single-key vs c10d, every node a thread of this process).
``--join K``: a running announce round of N members (``--nodes``) that K nodes join at once;
rounds taken, time to JOINERS and to the new round, and the worst member's and joiner's etcd
requests (see bench/README-rendezvous.md, "Joins at scale").

Method. For each node count N (``--nodes``, default 8,32,128) and each repeat,
both backends run one fresh rendezvous (a new run id) with the same settings:
``min_nodes = max_nodes = N`` (the round completes as soon as the N-th node
joins), the same join/close/heartbeat timeouts and keep-alive settings, and
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` for both (no agent-hosted TCPStore).
Each simulated node is a thread with its *own* handler and its own client,
as separate agent processes would have: an ``EtcdClient`` (gRPC channel) per
node for etcd-v3, a ``TCPStore`` client per node for c10d (the store server
is hosted in-process on an OS-assigned port). Before the clock starts every
node has reached its backend once (as ``create_rdzv_handler`` does); then a
barrier releases all ``next_rendezvous()`` calls together and the round's
time runs until the last one returns. That includes torch's deliberate waits:
a 0-0.3 s random jitter before the first join and a fixed 1 s ``_delay``
before each poll of a node that must wait (a SYNC action), as well as the
bootstrap ``MASTER_ADDR``/``MASTER_PORT`` exchange through the store.

Counting. ``EtcdClient.requests`` counts every etcd round trip (backend reads,
compare-and-set transactions, lease grants, store reads/writes and watches).
``dynamic_rendezvous._delay`` is wrapped to count, per node, the SYNC waits;
each is followed by one deliberate poll, so a node's *excess* is its requests
minus its SYNC waits. Goal "no retry storm": every node's excess is at most
N + 10 (a node may lose a compare-and-set race to each of the others once).
Goal "speed": etcd-v3's median round time is at most 1.2x c10d's. For c10d the
backend's TCPStore calls are counted (the store bootstrap ops are not: two
gets per node plus two sets on rank 0). Backend ``set_state`` calls that lost
the compare-and-set race are reported as ``cas_conflicts``; ``complete_at_s``
is when the state was first written complete (the rest of the round is the
waiting nodes' 1 s polls); ``process_cpu_s`` / ``etcd_server_cpu_s`` are the CPU
seconds this process and the etcd server spent during the round.

Evidence beside the rounds: ``request_latency_ms`` (one thread, no contention:
a get and a compare-and-set on each backend), ``etcd_disk`` (WAL fsync and
commit counts and mean durations from etcd's ``/metrics``), and two optional
etcd-v3 variants that are not goals: ``--etcd-no-fsync`` (an etcd started with
``--unsafe-no-fsync``) and ``--pregrant-lease`` (each node's lease granted
before the round instead of inside its first compare-and-set).

Caveat: the nodes share one Python interpreter (GIL) on whatever cores the
machine has, so client-side CPU (gRPC and protobuf calls, pickling the state)
is serialized across all N nodes; separate processes would overlap it. The
worst such cost is torch's own: every state sync records an event whose name
comes from ``get_method_name()``, two ``inspect.stack()`` calls (~1-3 ms),
paid even with events off. With it, 128 threads on 2 cores livelock for both
backends (heartbeat writes outpace the successful compare-and-sets and live
nodes are dropped as dead). The bench therefore replaces it, for both
backends, with a frame lookup; ``--torch-method-names`` keeps torch's.

Usage: ``python bench/rendezvous.py [--single-process] [--nodes 8,32,128] [--repeats K]``
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Set before torch can start a shared TCPStore; our handler sets it too.
os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"

import torch
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
    create_backend as create_c10d_backend,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

from elastic.etcd.client import EtcdClient
from elastic.etcd.server import EtcdServer, find_etcd, start_etcd
from elastic.rendezvous.handler import build_handler
from elastic.rendezvous.options import RendezvousOptions
from elastic.rendezvous.registry import create_backend as create_etcd_backend

RDZV_CONF: dict[str, Any] = {  # --join-timeout and --keep-alive-interval change it
    "join_timeout": 120,
    "last_call_timeout": 1,
    "close_timeout": 30,
    "heartbeat_timeout": 30,
    "keep_alive_interval": 5,
    "keep_alive_max_attempt": 3,
}
SLOW_ROUND_S = 30.0


# -- deliberate waits --------------------------------------------------------


@dataclass
class Waits:
    """Deliberate waits of one thread: SYNC polls (1 s) and the first-join jitter."""

    sync_calls: int = 0
    sync_s: float = 0.0
    jitter_s: float = 0.0


class DelayCounter:
    """Wraps ``dynamic_rendezvous._delay`` and records each call per thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_thread: dict[int, Waits] = {}
        self._original: Callable[..., None] = dyn._delay

    def reset(self) -> None:
        with self._lock:
            self._by_thread.clear()

    def of(self, ident: int) -> Waits:
        with self._lock:
            return self._by_thread.setdefault(ident, Waits())

    def _delay(self, seconds: float | tuple[float, float]) -> None:
        started = time.monotonic()
        self._original(seconds)
        slept = time.monotonic() - started
        waits = self.of(threading.get_ident())
        if isinstance(seconds, tuple):
            waits.jitter_s += slept
        else:
            waits.sync_calls += 1
            waits.sync_s += slept

    @contextmanager
    def installed(self) -> Iterator[DelayCounter]:
        dyn._delay = self._delay
        try:
            yield self
        finally:
            dyn._delay = self._original


# -- nodes -------------------------------------------------------------------


@dataclass
class NodeStats:
    """What one node's backend did during the round."""

    gets: int = 0
    sets: int = 0
    cas_conflicts: int = 0
    backend_s: float = 0.0
    backend_requests: int = 0
    c10d_store_calls: int = 0


@dataclass
class Node:
    """One simulated agent: a handler, its backend, and how to read its request count."""

    handler: RendezvousHandler
    backend: RendezvousBackend
    requests: Callable[[], int]
    close: Callable[[], None]
    stats: NodeStats = field(default_factory=NodeStats)


@dataclass
class RoundClock:
    """The instant the shared state was first written as complete."""

    completed_at: float | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def mark(self) -> None:
        now = time.monotonic()
        with self.lock:
            if self.completed_at is None or now < self.completed_at:
                self.completed_at = now


def instrument(node: Node, clock: RoundClock) -> None:
    """Wrap the backend's get/set_state to count calls, lost races and time spent."""
    backend, stats = node.backend, node.stats
    get_state, set_state = backend.get_state, backend.set_state

    def account(started: float, requests: int) -> None:
        stats.backend_s += time.monotonic() - started
        stats.backend_requests += node.requests() - requests

    def timed_get() -> Any:
        started, requests = time.monotonic(), node.requests()
        try:
            return get_state()
        finally:
            stats.gets += 1
            account(started, requests)

    def timed_set(state: bytes, token: Any = None) -> Any:
        started, requests = time.monotonic(), node.requests()
        try:
            result = set_state(state, token)
        finally:
            stats.sets += 1
            account(started, requests)
        if result is not None and not result[2]:
            stats.cas_conflicts += 1
        elif result is not None and pickle.loads(state).complete:
            clock.mark()
        return result

    backend.get_state = timed_get  # type: ignore[method-assign]
    backend.set_state = timed_set  # type: ignore[method-assign]


def params_for(
    backend: str, endpoint: str, run_id: str, n: int, max_n: int | None = None, **extra: Any
) -> Any:
    """The same rendezvous settings for both backends (``max_nodes`` is N unless given)."""
    return RendezvousParameters(
        backend=backend,
        endpoint=endpoint,
        run_id=run_id,
        min_nodes=n,
        max_nodes=max_n or n,
        local_addr="127.0.0.1",
        **RDZV_CONF,
        **extra,
    )


def etcd_node(endpoint: str, run_id: str, n: int, pregrant: bool = False) -> Node:
    """A node with its own EtcdClient; reaches etcd once, as create_rdzv_handler does.

    ``pregrant`` (an experiment, not our code's behaviour) also grants the node's
    lease before the round, so the first compare-and-set is not preceded by a grant.
    """
    params = params_for("etcd-v3", endpoint, run_id, n, store_timeout=RDZV_CONF["join_timeout"])
    backend, store = create_etcd_backend(params)
    client: EtcdClient = backend._client
    backend.get_state()
    if pregrant:
        backend._lease.id()
    return Node(
        handler=build_handler(store, backend, params, RendezvousOptions.from_params(params)),
        backend=backend,
        requests=lambda: client.requests,
        close=client.close,
    )


def c10d_host(run_id: str) -> tuple[dist.Store, int]:
    """Host the TCPStore in-process on an OS-assigned port; return it and the port."""
    params = params_for("c10d", "127.0.0.1:0", run_id, 1, is_host=True)
    _, store = create_c10d_backend(params)
    return store, store.port  # type: ignore[attr-defined]


def c10d_node(port: int, run_id: str, n: int) -> Node:
    """A node with its own TCPStore client; counts the backend's store calls."""
    params = params_for(
        "c10d",
        f"127.0.0.1:{port}",
        run_id,
        n,
        is_host=False,
        read_timeout=RDZV_CONF["join_timeout"],
    )
    backend, store = create_c10d_backend(params)
    stats = NodeStats()
    call_store = backend._call_store

    def counted(op: str, *args: Any, **kwargs: Any) -> Any:
        stats.c10d_store_calls += 1
        return call_store(op, *args, **kwargs)

    backend._call_store = counted  # type: ignore[method-assign,assignment]
    return Node(
        handler=dyn.create_handler(store, backend, params),
        backend=backend,
        requests=lambda: stats.c10d_store_calls,
        close=lambda: None,
        stats=stats,
    )


# -- one round ---------------------------------------------------------------


@dataclass
class NodeResult:
    """What one node's ``next_rendezvous`` returned and cost."""

    started: float = 0.0
    finished: float = 0.0
    rank: int = -1
    world_size: int = -1
    requests: int = 0
    waits: Waits = field(default_factory=Waits)
    error: str | None = None


def run_node(node: Node, barrier: threading.Barrier, delays: DelayCounter) -> NodeResult:
    """Join the round when the barrier opens; stop this node's heartbeats afterwards."""
    result = NodeResult()
    before = node.requests()
    barrier.wait()
    result.started = time.monotonic()
    try:
        info = node.handler.next_rendezvous()
        result.rank, result.world_size = info.rank, info.world_size
    except Exception as exc:  # reported in the JSON, not raised
        result.error = f"{type(exc).__name__}: {exc}"
    result.finished = time.monotonic()
    node.handler._stop_heartbeats()  # type: ignore[attr-defined]
    result.requests = node.requests() - before
    result.waits = delays.of(threading.get_ident())
    return result


def run_round(nodes: list[Node], delays: DelayCounter) -> list[NodeResult]:
    """Release every node's ``next_rendezvous`` together; wait for all of them."""
    delays.reset()
    barrier = threading.Barrier(len(nodes))
    results: list[NodeResult] = [NodeResult() for _ in nodes]

    def target(i: int) -> None:
        results[i] = run_node(nodes[i], barrier, delays)

    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(len(nodes))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(RDZV_CONF["join_timeout"] + 60)
    return results


def close_round(nodes: list[Node]) -> None:
    """Close the rendezvous once (heartbeats are already stopped), then the clients."""
    if nodes:
        nodes[0].handler.shutdown()
    for node in nodes:
        node.close()


def summarize(
    backend: str, nodes: list[Node], results: list[NodeResult], clock: RoundClock
) -> dict[str, Any]:
    """One JSON row for one backend, node count and repeat."""
    n = len(nodes)
    start = min(r.started for r in results)
    seconds = max(r.finished for r in results) - start
    excess = [r.requests - r.waits.sync_calls for r in results]
    stats = [node.stats for node in nodes]
    calls = sum(s.gets + s.sets for s in stats)
    errors = sorted({r.error for r in results if r.error})
    completed = clock.completed_at
    ranks_ok = sorted(r.rank for r in results) == list(range(n)) and all(
        r.world_size == n for r in results
    )
    return {
        "nodes": n,
        "backend": backend,
        "seconds": round(seconds, 3),
        "complete_at_s": None if completed is None else round(completed - start, 3),
        "first_return_s": round(min(r.finished for r in results) - start, 3),
        "requests": sum(r.requests for r in results),
        "requests_per_node": round(sum(r.requests for r in results) / n, 2),
        "max_node_requests": max(r.requests for r in results),
        "delay_calls": sum(r.waits.sync_calls for r in results),
        "max_node_delay_calls": max(r.waits.sync_calls for r in results),
        "mean_jitter_s": round(statistics.fmean(r.waits.jitter_s for r in results), 3),
        "requests_beyond_waits": sum(excess),
        "max_node_requests_beyond_waits": max(excess),
        "backend_requests": sum(s.backend_requests for s in stats),
        "store_requests": sum(r.requests for r in results) - sum(s.backend_requests for s in stats),
        "backend_gets": sum(s.gets for s in stats),
        "backend_sets": sum(s.sets for s in stats),
        "cas_conflicts": sum(s.cas_conflicts for s in stats),
        "mean_backend_call_ms": round(1000 * sum(s.backend_s for s in stats) / max(calls, 1), 2),
        "ok": ranks_ok and not errors,
        "errors": errors,
        **(
            {"slow": "over 30 s: 2 cores and one GIL for all threads"}
            if seconds > SLOW_ROUND_S
            else {}
        ),
    }


def proc_cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of a process (this one when ``pid`` is None)."""
    if pid is None:
        return time.process_time()
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(
    backend: str, n: int, make: Callable[[str], list[Node]], server_pid: int | None = None
) -> dict[str, Any]:
    """Build N nodes on a fresh run id, run one round, summarize, clean up.

    Also reports the CPU seconds this process (all nodes' client work, and the
    TCPStore server for c10d) and the etcd server spent during the round.
    """
    run_id = f"bench-{backend}-{n}-{uuid.uuid4().hex[:8]}"
    nodes = make(run_id)
    clock = RoundClock()
    for node in nodes:
        instrument(node, clock)
    cpu = proc_cpu_s(None), proc_cpu_s(server_pid) if server_pid else 0.0
    with DelayCounter().installed() as delays:
        results = run_round(nodes, delays)
    row = summarize(backend, nodes, results, clock)
    row["process_cpu_s"] = round(proc_cpu_s(None) - cpu[0], 3)
    if server_pid:
        row["etcd_server_cpu_s"] = round(proc_cpu_s(server_pid) - cpu[1], 3)
    close_round(nodes)
    return row


def measure_c10d(n: int) -> dict[str, Any]:
    """One c10d round, with a store host that outlives the clients."""
    host, port = c10d_host(f"host-{uuid.uuid4().hex[:8]}")
    row = measure("c10d", n, lambda run_id: [c10d_node(port, run_id, n) for _ in range(n)])
    del host  # the server goes only after every client is done
    return row


def measure_etcd(
    n: int, server: EtcdServer, label: str = "etcd-v3", pregrant: bool = False
) -> dict[str, Any]:
    endpoint, pid = server.endpoint, server.proc.pid if server.proc else None
    return measure(
        label, n, lambda run_id: [etcd_node(endpoint, run_id, n, pregrant) for _ in range(n)], pid
    )


# -- many processes: single-key, announce and c10d at up to 1,024 nodes ------

ALGOS = ("single-key", "announce", "c10d")


def announce_node(
    endpoint: str, run_id: str, n: int, max_n: int | None = None
) -> tuple[Any, Callable[[], int]]:
    """An ``announce`` handler with its own client; its requests exclude keep-alives."""
    from elastic.rendezvous.announce import build_announce_handler

    params = params_for(
        "etcd-v3",
        endpoint,
        run_id,
        n,
        max_n,
        store_timeout=RDZV_CONF["join_timeout"],
        algorithm="announce",
    )
    handler = build_announce_handler(params, RendezvousOptions.from_params(params))
    return handler, lambda: handler._client.requests - handler.keepalives


class WorkerNodes:
    """The nodes one worker process hosts for one measurement."""

    def __init__(self, cmd: dict[str, Any]) -> None:
        algo, n, count, run_id = cmd["algo"], cmd["n"], cmd["count"], cmd["run_id"]
        self.algo = algo
        self.handlers: list[Any] = []
        self.requests: list[Callable[[], int]] = []
        self.closers: list[Callable[[], None]] = []
        for _ in range(count):
            if algo == "announce":
                handler, requests = announce_node(cmd["endpoint"], run_id, n, cmd.get("max_n"))
                self.closers.append(handler.close)
            elif algo == "single-key":
                node = etcd_node(cmd["endpoint"], run_id, n)
                handler, requests = node.handler, node.requests
                self.closers.append(node.close)
            else:
                node = c10d_node(cmd["port"], run_id, n)
                handler, requests = node.handler, node.requests
            self.handlers.append(handler)
            self.requests.append(requests)

    def run(self, delays: DelayCounter) -> dict[str, Any]:
        """All nodes' next_rendezvous at once; per-node times, requests, process CPU."""
        before = [r() for r in self.requests]
        rows: list[dict[str, Any]] = [{} for _ in self.handlers]
        delays.reset()

        def join(i: int) -> None:
            row = rows[i]
            row["started"] = time.monotonic()
            try:
                info = self.handlers[i].next_rendezvous()
                row["rank"], row["world"] = info.rank, info.world_size
            except Exception as exc:  # reported in the JSON
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            row["finished"] = time.monotonic()
            if self.algo != "announce":
                self.handlers[i]._stop_heartbeats()
            row["requests"] = self.requests[i]() - before[i]
            row["sync_waits"] = delays.of(threading.get_ident()).sync_calls

        cpu = time.process_time()
        threads = [threading.Thread(target=join, args=(i,), daemon=True) for i in range(len(rows))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(RDZV_CONF["join_timeout"] + 60)
        return {"nodes": rows, "cpu_s": time.process_time() - cpu}

    def close(self) -> None:
        for close in self.closers:
            try:
                close()
            except Exception as exc:  # a bench node that cannot close is not a result
                print(f"close failed: {exc}", file=sys.stderr)


class JoinPhase:
    """``--join``, in one worker: its members train on (``membership_change()`` polled every
    ``--monitor-interval`` s, as the agent's monitor loop does) and re-join on a change; its
    joiners call ``next_rendezvous()`` at once. Each node is a thread."""

    def __init__(self, members: WorkerNodes, interval: float) -> None:
        self.members, self.interval = members, interval
        self.deadline = time.monotonic() + RDZV_CONF["join_timeout"] + 60
        self.member_rows: list[dict[str, Any]] = [{} for _ in members.handlers]
        self.joiner_rows: list[dict[str, Any]] = []
        self.threads: list[threading.Thread] = []
        self._spawn(self._monitor, len(self.member_rows))

    def _spawn(self, target: Callable[[int], None], count: int) -> None:
        threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(count)]
        for thread in threads:
            thread.start()
        self.threads.extend(threads)

    def _monitor(self, i: int) -> None:
        handler, requests = self.members.handlers[i], self.members.requests[i]
        row: dict[str, Any] = {}
        self.member_rows[i] = row
        before, polls = requests(), 0
        row["round_before"] = handler._joined_round
        while time.monotonic() < self.deadline:
            change = handler.membership_change()
            polls += 1
            if change is not None:
                row["seen"] = time.monotonic()
                row["kind"] = getattr(change.kind, "value", str(change.kind))
                row["requests_while_running"] = requests() - before
                _rejoin(handler, row)
                break
            time.sleep(self.interval)
        row["polls"] = polls
        row["requests"] = requests() - before

    def join(self, joiners: WorkerNodes) -> None:
        """Start every joiner's ``next_rendezvous`` now; answer without waiting for them."""
        self.joiner_rows = [{} for _ in joiners.handlers]

        def run(i: int) -> None:
            row, requests = self.joiner_rows[i], joiners.requests[i]
            before = requests()
            row["started"] = time.monotonic()
            _rejoin(joiners.handlers[i], row)
            row["requests"] = requests() - before

        self._spawn(run, len(self.joiner_rows))

    def collect(self) -> dict[str, Any]:
        for thread in self.threads:
            thread.join(max(1.0, self.deadline - time.monotonic()))
        return {"members": self.member_rows, "joiners": self.joiner_rows}


def _rejoin(handler: Any, row: dict[str, Any]) -> None:
    """``next_rendezvous()`` into ``row``: when it returned, rank, world and round."""
    try:
        info = handler.next_rendezvous()
        row["rank"], row["world"] = info.rank, info.world_size
        row["round"] = handler._joined_round
    except Exception as exc:  # reported in the JSON
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
    row["finished"] = time.monotonic()


def worker_main(args: argparse.Namespace) -> None:
    """A bench worker: build nodes, run rounds, close them, as the parent commands (JSON
    lines on stdin; answers on stdout). ``--join``: ``build`` with ``role: joiners`` builds
    a second set of nodes; ``monitor``, ``join`` and ``collect`` run a :class:`JoinPhase`."""
    nodes: WorkerNodes | None = None
    joiners: WorkerNodes | None = None
    phase: JoinPhase | None = None
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "build" and cmd.get("role") == "joiners":
            joiners = WorkerNodes(cmd)
            answer: dict[str, Any] = {"ready": True}
        elif cmd["cmd"] == "build":
            nodes = WorkerNodes(cmd)
            answer = {"ready": True}
        elif cmd["cmd"] == "go" and nodes is not None:
            # Wraps the join loop's wait as the handlers left it (our watch hook).
            with DelayCounter().installed() as delays:
                answer = nodes.run(delays)
        elif cmd["cmd"] == "monitor" and nodes is not None:
            phase = JoinPhase(nodes, args.monitor_interval)
            answer = {"monitoring": True}
        elif cmd["cmd"] == "join" and phase is not None and joiners is not None:
            phase.join(joiners)
            answer = {"joining": True}
        elif cmd["cmd"] == "collect" and phase is not None:
            cpu = time.process_time()
            answer = {**phase.collect(), "cpu_s": time.process_time() - cpu}
        elif cmd["cmd"] == "close" and nodes is not None:
            for group in (nodes, joiners):
                if group is not None:
                    group.close()
            nodes, joiners, phase, answer = None, None, None, {"closed": True}
        else:
            return
        print(json.dumps(answer), flush=True)


class Pool:
    """Long-lived worker processes (torch imports once each)."""

    def __init__(self, size: int, args: argparse.Namespace) -> None:
        argv = [
            sys.executable,
            __file__,
            "--worker",
            f"--join-timeout={args.join_timeout}",
            f"--keep-alive-interval={args.keep_alive_interval}",
            f"--monitor-interval={args.monitor_interval}",
        ]
        self.procs = [
            subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            for _ in range(size)
        ]

    def ask(self, cmds: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Send each process its command, then read every answer."""
        for proc, cmd in zip(self.procs, cmds, strict=False):
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(cmd) + "\n")
            proc.stdin.flush()
        answers = []
        for proc, _ in zip(self.procs, cmds, strict=False):
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"bench worker {proc.pid} died (rc {proc.poll()})")
            answers.append(json.loads(line))
        return answers

    def close(self) -> None:
        for proc in self.procs:
            if proc.stdin:
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def measure_multi(algo: str, n: int, pool: Pool, server: EtcdServer) -> dict[str, Any]:
    """One round of ``algo`` with N nodes spread over the pool's processes."""
    procs = min(len(pool.procs), n)
    counts = [n // procs + (1 if i < n % procs else 0) for i in range(procs)]
    run_id = f"bench-{algo}-{n}-{uuid.uuid4().hex[:8]}"
    host = None
    base: dict[str, Any] = {"cmd": "build", "algo": algo, "n": n, "run_id": run_id}
    if algo == "c10d":
        host, port = c10d_host(run_id)
        base["port"] = port
    else:
        base["endpoint"] = server.endpoint
    pool.ask([{**base, "count": c} for c in counts])
    server_pid = server.proc.pid if server.proc else None
    etcd_cpu = proc_cpu_s(server_pid) if server_pid else 0.0
    parent_cpu = proc_cpu_s(None)
    answers = pool.ask([{"cmd": "go"}] * procs)
    etcd_cpu = (proc_cpu_s(server_pid) if server_pid else 0.0) - etcd_cpu
    parent_cpu = proc_cpu_s(None) - parent_cpu  # the c10d store server lives here
    rows = [row for answer in answers for row in answer["nodes"]]
    errors = sorted({r["error"] for r in rows if "error" in r})
    done = [r for r in rows if "finished" in r and "started" in r]
    start = min(r["started"] for r in done)
    seconds = max(r["finished"] for r in done) - start
    ranks_ok = sorted(r.get("rank", -1) for r in rows) == list(range(n)) and all(
        r.get("world") == n for r in rows
    )
    excess = [r["requests"] - r["sync_waits"] for r in rows]
    cpu = sum(a["cpu_s"] for a in answers)
    row = {
        "nodes": n,
        "backend": algo,
        "processes": procs,
        "seconds": round(seconds, 3),
        "first_return_s": round(min(r["finished"] for r in done) - start, 3),
        "requests_per_node": round(sum(r["requests"] for r in rows) / n, 2),
        "max_node_requests": max(r["requests"] for r in rows),
        "max_node_requests_beyond_waits": max(excess),
        "max_node_sync_waits": max(r["sync_waits"] for r in rows),
        "client_cpu_s": round(cpu, 3),
        "client_cpu_ms_per_node": round(1000 * cpu / n, 2),
        **({"etcd_server_cpu_s": round(etcd_cpu, 3)} if algo != "c10d" else {}),
        **({"store_server_cpu_s": round(parent_cpu, 3)} if algo == "c10d" else {}),
        "ok": ranks_ok and not errors,
        "errors": errors[:3],
    }
    try:
        pool.ask([{"cmd": "close"}] * procs)
    except RuntimeError as exc:  # a worker died while closing its nodes: keep the round
        row["close_error"] = str(exc)
    del host
    return row


def _spread(total: int, procs: int) -> list[int]:
    return [total // procs + (1 if i < total % procs else 0) for i in range(procs)]


def measure_join(n: int, k: int, pool: Pool, server: EtcdServer, settle_s: float) -> dict[str, Any]:
    """``--join``: N announce members form a round (``min_nodes`` N, ``max_nodes`` N + K) and
    train on, polling ``membership_change()``; then K joiners start at once. Until every
    node is in one completed round: how many rounds it took, how long the members took to
    see JOINERS and the new round to complete, and the worst member's and joiner's etcd
    requests (keep-alives left out)."""
    procs = min(len(pool.procs), n)
    run_id = f"bench-join-{n}-{k}-{uuid.uuid4().hex[:8]}"
    base: dict[str, Any] = {
        "cmd": "build",
        "algo": "announce",
        "n": n,
        "max_n": n + k,
        "run_id": run_id,
        "endpoint": server.endpoint,
    }
    pool.ask([{**base, "count": c} for c in _spread(n, procs)])
    first = [r for a in pool.ask([{"cmd": "go"}] * procs) for r in a["nodes"]]
    start = min(r["started"] for r in first)
    row: dict[str, Any] = {
        "mode": "join",
        "backend": "announce",
        "nodes": n,
        "joiners": k,
        "max_nodes": n + k,
        "processes": procs,
        "first_round_s": round(max(r["finished"] for r in first) - start, 3),
        "first_round_ok": sorted(r.get("rank", -1) for r in first) == list(range(n))
        and all(r.get("world") == n for r in first),
    }
    pool.ask([{"cmd": "monitor"}] * procs)
    time.sleep(settle_s)  # the round runs; the closer probes its members meanwhile
    pool.ask([{**base, "role": "joiners", "count": c} for c in _spread(k, procs)])
    server_pid = server.proc.pid if server.proc else None
    etcd_cpu = proc_cpu_s(server_pid) if server_pid else 0.0
    pool.ask([{"cmd": "join"}] * procs)
    answers = pool.ask([{"cmd": "collect"}] * procs)
    etcd_cpu = (proc_cpu_s(server_pid) if server_pid else 0.0) - etcd_cpu
    members = [r for a in answers for r in a["members"]]
    joiners = [r for a in answers for r in a["joiners"]]
    everyone = members + joiners
    errors = sorted({r["error"] for r in everyone if "error" in r})
    round_before = max((r.get("round_before") or 0) for r in members)
    rounds = sorted({r.get("round") for r in everyone}, key=lambda x: (x is None, x or 0))
    one_round = (
        len(rounds) == 1
        and rounds[0] is not None
        and sorted(r.get("rank", -1) for r in everyone) == list(range(n + k))
        and all(r.get("world") == n + k for r in everyone)
    )
    t0 = min(r["started"] for r in joiners)
    seen = [r["seen"] for r in members if "seen" in r]
    done = [r["finished"] for r in everyone if "finished" in r]
    last_seen = max(seen) if seen else None
    row.update(
        {
            "all_in_one_round": one_round,
            "round_before": round_before,
            "rounds_after": rounds,
            "extra_rounds": (rounds[-1] - round_before)
            if rounds and rounds[-1] is not None
            else None,
            "kinds_seen": sorted({r.get("kind", "none") for r in members}),
            "members_saw_joiners_first_s": round(min(seen) - t0, 3) if seen else None,
            "members_saw_joiners_s": round(last_seen - t0, 3) if last_seen else None,
            "new_round_after_seen_s": round(max(done) - last_seen, 3)
            if last_seen and done
            else None,
            "join_total_s": round(max(done) - t0, 3) if done else None,
            "max_member_requests_while_running": max(
                (r.get("requests_while_running", -1) for r in members), default=-1
            ),
            "members_with_requests_while_running": sum(
                1 for r in members if r.get("requests_while_running", 0) > 0
            ),
            "member_requests_while_running_hist": {
                str(c): sum(1 for r in members if r.get("requests_while_running", -1) == c)
                for c in sorted({r.get("requests_while_running", -1) for r in members})
            },
            "max_member_requests": max(r["requests"] for r in members),
            "member_requests_per_node": round(sum(r["requests"] for r in members) / n, 2),
            "max_joiner_requests": max(r.get("requests", -1) for r in joiners),
            "joiner_requests_per_node": round(sum(r.get("requests", 0) for r in joiners) / k, 2),
            "member_polls_max": max(r.get("polls", 0) for r in members),
            "client_cpu_s": round(sum(a["cpu_s"] for a in answers), 3),
            "etcd_server_cpu_s": round(etcd_cpu, 3),
        }
    )
    row["ok"] = bool(row["first_round_ok"] and one_round and not errors)
    row["goal_one_extra_round"] = row["extra_rounds"] == 1
    row["errors"] = errors[:3]
    try:
        pool.ask([{"cmd": "close"}] * procs)
    except RuntimeError as exc:
        row["close_error"] = str(exc)
    return row


def run_join(args: argparse.Namespace, counts: list[int], tmp: Path) -> dict[str, Any]:
    """``--join K``: for each N in ``--nodes``, a running round of N announce members that K
    joiners join at once (see :func:`measure_join`)."""
    server = start_etcd(tmp / "data")
    pool = Pool(min(args.procs, max(counts)), args)
    rows: list[dict[str, Any]] = []
    try:
        for n in counts:
            for k in range(args.repeats):
                load = os.getloadavg()[0]
                try:
                    row = measure_join(n, args.join, pool, server, args.join_settle_s)
                    row.update(repeat=k, load=load)
                except RuntimeError as exc:  # a worker died
                    row = {"mode": "join", "nodes": n, "joiners": args.join, "ok": False}
                    row["error"] = str(exc)
                    pool.close()
                    pool = Pool(min(args.procs, max(counts)), args)
                print(json.dumps(row), file=sys.stderr, flush=True)
                rows.append(row)
    finally:
        pool.close()
        server.stop()
    return {"results": rows, "processes": args.procs, "monitor_interval_s": args.monitor_interval}


def run_multi(args: argparse.Namespace, counts: list[int], tmp: Path) -> dict[str, Any]:
    """Every algorithm at every N in one run; an algorithm that failed or took longer than
    ``--max-round-s`` at some N is not run at larger N (reported as skipped)."""
    server = start_etcd(tmp / "data")
    pool = Pool(args.procs, args)
    rows: list[dict[str, Any]] = []
    given_up: dict[str, str] = {}
    algos = [a for a in ALGOS if a in args.algos.split(",")]
    try:
        for n in counts:
            for k in range(args.repeats):
                for algo in algos if k % 2 == 0 else algos[::-1]:
                    if algo in given_up:
                        rows.append({"nodes": n, "backend": algo, "skipped": given_up[algo]})
                        continue
                    load = os.getloadavg()[0]
                    try:
                        row = {**measure_multi(algo, n, pool, server), "repeat": k, "load": load}
                    except RuntimeError as exc:  # a worker died (the OOM killer, say)
                        rows.append({"nodes": n, "backend": algo, "ok": False, "error": str(exc)})
                        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
                        pool.close()
                        pool = Pool(args.procs, args)
                        continue
                    print(json.dumps(row), file=sys.stderr, flush=True)
                    rows.append(row)
                    if "close_error" in row:  # start afresh without the dead worker
                        pool.close()
                        pool = Pool(args.procs, args)
                    if not row["ok"] or row["seconds"] > args.max_round_s:
                        given_up[algo] = f"failed or over {args.max_round_s:g} s at N={n}"
    finally:
        pool.close()
        server.stop()
    return {"results": rows, "processes": args.procs}


# -- evidence: per-request latency and etcd's disk metrics -------------------


def time_ops(op: Callable[[], Any], count: int) -> float:
    """Mean milliseconds of ``op`` run ``count`` times in one thread."""
    op()
    started = time.perf_counter()
    for _ in range(count):
        op()
    return round(1000 * (time.perf_counter() - started) / count, 3)


def request_latency(endpoint: str, count: int) -> dict[str, float]:
    """One thread, no contention: what one get / compare-and-set costs on each backend."""
    state = os.urandom(4096)
    etcd, _ = create_etcd_backend(params_for("etcd-v3", endpoint, f"lat-{uuid.uuid4()}", 1))
    host, port = c10d_host(f"lat-{uuid.uuid4().hex[:8]}")
    c10d, _ = create_c10d_backend(
        params_for("c10d", f"127.0.0.1:{port}", f"lat-{uuid.uuid4()}", 1, is_host=False)
    )
    result = {
        "etcd_get_ms": time_ops(etcd.get_state, count),
        "etcd_cas_won_ms": time_ops(CasWinner(etcd, state), count),
        "etcd_cas_lost_ms": time_ops(lambda: etcd.set_state(state, 1), count),
        "c10d_get_ms": time_ops(c10d.get_state, count),
        "c10d_cas_won_ms": time_ops(CasWinner(c10d, state), count),
    }
    etcd._client.close()
    del host
    return result


class CasWinner:
    """Calls ``set_state`` with the token of its own last write, so every call wins."""

    def __init__(self, backend: RendezvousBackend, state: bytes) -> None:
        self._backend, self._state = backend, state
        self._token: Any = None

    def __call__(self) -> None:
        result = self._backend.set_state(self._state, self._token)
        if result is None or not result[2]:
            raise RuntimeError("a lone compare-and-set lost its race")
        self._token = result[1]


def etcd_disk_metrics(endpoint: str) -> dict[str, float]:
    """WAL fsync and backend commit counts and mean durations from etcd's /metrics."""
    text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith(("etcd_disk_wal_fsync", "etcd_disk_backend_commit")) and (
            name.endswith(("_sum", "_count"))
        ):
            values[name] = float(value)
    out: dict[str, float] = {}
    for metric in ("wal_fsync", "backend_commit"):
        count = values.get(f"etcd_disk_{metric}_duration_seconds_count", 0.0)
        total = values.get(f"etcd_disk_{metric}_duration_seconds_sum", 0.0)
        out[f"{metric}_count"] = count
        out[f"{metric}_mean_ms"] = round(1000 * total / count, 3) if count else 0.0
    return out


# -- driver ------------------------------------------------------------------


def median_rows(rows: list[dict[str, Any]]) -> dict[tuple[int, str], dict[str, Any]]:
    """Per (nodes, backend): median seconds and requests, worst per-node excess."""
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["nodes"], row["backend"]), []).append(row)
    return {
        key: {
            "seconds": statistics.median(r["seconds"] for r in group),
            "requests": statistics.median(r["requests"] for r in group),
            "max_node_requests_beyond_waits": max(
                r["max_node_requests_beyond_waits"] for r in group
            ),
            "ok": all(r["ok"] for r in group),
        }
        for key, group in groups.items()
    }


def goals(rows: list[dict[str, Any]], counts: list[int]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ratio etcd-v3/c10d per N and the pass/fail of both goals."""
    med = median_rows(rows)
    ratio: dict[str, Any] = {}
    verdict: dict[str, Any] = {}
    for n in counts:
        etcd, c10d = med[(n, "etcd-v3")], med[(n, "c10d")]
        ratio[str(n)] = round(etcd["seconds"] / c10d["seconds"], 3) if c10d["seconds"] else None
        verdict[str(n)] = {
            "rounds_ok": etcd["ok"] and c10d["ok"],
            "no_retry_storm": etcd["max_node_requests_beyond_waits"] <= n + 10,
            "requests_limit_per_node": n + 10,
            "time_within_1.2x_c10d": ratio[str(n)] is not None and ratio[str(n)] <= 1.2,
        }
    verdict["all"] = all(
        all(v for k, v in g.items() if k != "requests_limit_per_node") for g in verdict.values()
    )
    return ratio, verdict


def measure_repeat(
    n: int, k: int, args: argparse.Namespace, server: EtcdServer, fast: EtcdServer | None
) -> list[dict[str, Any]]:
    """Both backends (order alternating by repeat), then the optional etcd-v3 variants."""
    pair: list[Callable[[], dict[str, Any]]] = [
        lambda: measure_etcd(n, server),
        lambda: measure_c10d(n),
    ]
    rows = [fn() for fn in (pair if k % 2 == 0 else pair[::-1])]
    if fast is not None:
        rows.append(measure_etcd(n, fast, "etcd-v3-nofsync"))
    if args.pregrant_lease:
        rows.append(measure_etcd(n, server, "etcd-v3-pregrant-lease", pregrant=True))
    return rows


def run_all(args: argparse.Namespace, counts: list[int], tmp: Path) -> dict[str, Any]:
    server = start_etcd(tmp / "data")
    fast: EtcdServer | None = None
    try:
        if args.etcd_no_fsync:
            fast = start_etcd(tmp / "nofsync", extra=["--unsafe-no-fsync"])
        rows = [
            {**row, "repeat": k}
            for n in counts
            for k in range(args.repeats)
            for row in measure_repeat(n, k, args, server, fast)
        ]
        disk = etcd_disk_metrics(server.endpoint)
        latency = request_latency(server.endpoint, args.latency_ops)
    finally:
        server.stop()
        if fast is not None:
            fast.stop()
    ratio, verdict = goals(rows, counts)
    return {
        "results": rows,
        "ratio_etcd_over_c10d": ratio,
        "goals": verdict,
        "request_latency_ms": latency,
        "etcd_disk": disk,
    }


def run_stamp() -> dict[str, Any]:
    """The git commit (and whether the tree was dirty) and a UTC timestamp."""
    from elastic_tools.harness.cluster import provenance

    return provenance()


def etcd_version() -> str:
    out = subprocess.run([find_etcd(), "--version"], capture_output=True, text=True, check=False)
    return out.stdout.splitlines()[0].removeprefix("etcd Version: ") if out.stdout else "unknown"


def environment() -> dict[str, Any]:
    from google.protobuf.internal import api_implementation

    return {
        "etcd_version": etcd_version(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "protobuf_impl": api_implementation.Type(),
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg()[0],
        "settings": {"min_nodes": "N", "max_nodes": "N", **RDZV_CONF},
        "cheap_method_names": dyn.get_method_name.__module__ == __name__,
    }


def cheap_method_names() -> None:
    """Replace torch's ``get_method_name`` (two ``inspect.stack()`` per event, ~1-3 ms of
    CPU, paid on every state sync even with events off) by a frame lookup, for both."""
    import sys

    def get_method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name
        except ValueError:
            return "no_method_name"

    dyn.get_method_name = get_method_name


def configure(args: argparse.Namespace) -> None:
    """Apply the command line's settings, identical for both backends."""
    RDZV_CONF["join_timeout"] = args.join_timeout
    RDZV_CONF["keep_alive_interval"] = args.keep_alive_interval
    if not args.torch_method_names:
        cheap_method_names()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])

    def flag(name: str, what: str) -> None:
        parser.add_argument(name, action="store_true", help=what)

    parser.add_argument("--nodes", default="8,32,128", help="comma-separated node counts")
    parser.add_argument("--repeats", type=int, default=1, help="rounds per backend and N")
    parser.add_argument("--latency-ops", type=int, default=100, help="ops per latency probe")
    flag("--etcd-no-fsync", "also run etcd-v3 on an etcd with --unsafe-no-fsync (not a goal)")
    flag(
        "--pregrant-lease", "also run etcd-v3 with each lease granted before the round (not a goal)"
    )
    parser.add_argument("--join-timeout", type=int, default=120, help="seconds, both backends")
    parser.add_argument("--keep-alive-interval", type=int, default=5, help="seconds, both")
    flag(
        "--torch-method-names",
        "keep torch's inspect.stack()-based event names (128 threads then livelock)",
    )
    parser.add_argument("--json-out", type=Path, help="also write the JSON here")
    flag(
        "--single-process", "the old bench: single-key vs c10d, every node a thread of this process"
    )
    parser.add_argument("--procs", type=int, default=8, help="worker processes (multi-process)")
    parser.add_argument("--algos", default=",".join(ALGOS), help="which to run (multi-process)")
    parser.add_argument(
        "--max-round-s", type=float, default=60.0, help="slower: not run at larger N"
    )
    parser.add_argument(
        "--join",
        type=int,
        default=0,
        metavar="K",
        help="announce only: a running round of N (--nodes) members that K nodes join at once",
    )
    parser.add_argument(
        "--monitor-interval",
        type=float,
        default=0.3,
        help="seconds between a running member's membership_change() polls (--join)",
    )
    parser.add_argument(
        "--join-settle-s",
        type=float,
        default=2.0,
        help="seconds the first round runs before the joiners start (--join)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    configure(args)
    if args.worker:
        worker_main(args)
        return
    counts = [int(x) for x in args.nodes.split(",") if x.strip()]
    started = time.monotonic()
    report = {**run_stamp(), **environment()}
    with tempfile.TemporaryDirectory(prefix="rdzv-bench-") as tmp:
        if args.join:
            report.update(run_join(args, counts, Path(tmp)))
        elif args.single_process:
            report.update(run_all(args, counts, Path(tmp)))
        else:
            report.update(run_multi(args, counts, Path(tmp)))
    report["bench_seconds"] = round(time.monotonic() - started, 1)
    report["loadavg_end"] = os.getloadavg()[0]
    text = json.dumps(report, indent=1)
    print(text)
    out = args.json_out or Path(__file__).with_name("results-rendezvous.json")
    out.write_text(text + "\n")


if __name__ == "__main__":
    main()
