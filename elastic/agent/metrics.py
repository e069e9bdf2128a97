"""Prometheus metrics of one node agent: ``elastic-agent --metrics-port N``.

The agent serves ``/metrics`` over HTTP on port ``N`` (0: one the OS picks; the agent
prints it) of its node address (``--local-addr``), or of 127.0.0.1 without one:
prometheus_client's handler in the standard library's threading HTTP server, bounded
(:class:`BoundedHTTPServer`: at most :data:`MAX_CONNECTIONS` connections, a thread each).
What the agent knows itself (its rendezvous round, the job's restart budget,
its etcd requests) comes from small hooks in :mod:`elastic.agent.node` and
:meth:`elastic.etcd.client.EtcdClient.call`. What its workers know (step, loss,
checkpoints) comes from the event log they write (:mod:`elastic.events`): the exporter
reads the bytes appended since its last look, at every scrape and every agent hook (one
``stat`` and one ``read``), and parses only the lines of the kinds it uses. Only rank 0
writes ``train.step``: with one event log per node, the step figures come from the agent
whose node runs rank 0 (docker-compose.yml shares one log, so every agent has them).

Metrics (gauges unless said otherwise; a gauge appears once its value is known):

=========================================  ===============================================
``elastic_world_size``                     worker processes in this agent's current round
``elastic_nodes``                          nodes (agents) in this agent's current round
``elastic_rendezvous_round``               the rendezvous round this agent's workers run in
``elastic_rendezvous_members{state}``      nodes in the rendezvous state this agent last read:
                                           ``participant`` or ``waiting`` (to join)
``elastic_job_restart_budget``             ``--max-restarts``: failed rounds the job may have
``elastic_job_restarts_used``              failed rounds of the whole job (kept in etcd)
``elastic_job_restarts_left``              budget minus used, at least 0
``elastic_train_step``                     the newest training step (``train.step``)
``elastic_train_loss``                     its loss
``elastic_train_samples_per_second``       its throughput, over all workers
``elastic_train_step_timestamp_seconds``   when it ended (unix time)
``elastic_checkpoint_step``                the newest complete (committed) checkpoint's step
``elastic_checkpoint_age_seconds``         seconds since that checkpoint was committed
``elastic_checkpoint_last_stall_seconds``  how long the newest save stopped training (the
                                           longest ``blocking_s`` of its ranks)
``elastic_checkpoint_stall_seconds_total`` counter: training time lost to checkpoint saves
``elastic_recovery_seconds{kind}``         histogram: from this agent noticing a change or
                                           failure to the first step of the next round; kind
                                           ``joiners``, ``peers_lost``, ``dropped``,
                                           ``requested``, ``reform`` (a peer's planned leave)
                                           or ``failure`` (a worker failed)
``elastic_etcd_request_seconds{op}``       histogram: etcd requests, retries included (watches,
                                           which wait on purpose, are left out)
``elastic_etcd_request_errors_total``      counter: etcd requests that failed, by ``op`` and
                                           ``error``
``elastic_rank_compute_seconds{rank}``     each rank's compute time in the newest step (its
                                           step less its collectives' wait; ``train.step``
                                           lists every rank in worlds up to 64 ranks)
``elastic_rank_wait_seconds{rank}``        each rank's wait in that step's collectives
``elastic_rank_slowness_ratio{rank}``      each rank's compute time over the ranks' median
                                           (beyond 64 ranks: the 3 slowest only)
``elastic_stragglers_detected_total``      counter: nodes named slow (``straggler.detected``)
``elastic_workers_hung_total``             counter: workers that named themselves stuck
                                           (``worker.hang``)
=========================================  ===============================================

Observability never stops training: an error anywhere in here is logged once (per place)
and ignored; the metric concerned is then left out or stale.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import socket
import socketserver
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from elastic import env
from elastic.events import Tail

logger = logging.getLogger(__name__)

DEFAULT_ADDR = "127.0.0.1"  # without a node address (--local-addr): this host only
MAX_BACKLOG = 16 << 20  # more unread bytes than this: skip to the newest ones
MAX_PARTIAL = 1 << 20  # a "line" longer than this without a newline is dropped
MAX_NOTES = 1000  # the agent's notes kept for the next scrape (the oldest go first)
RECOVERY_BUCKETS = (1, 2, 3, 5, 7.5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 300, 600)
ETCD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_KINDS = ("train.step", "ckpt.save", "worker.restart", "straggler.detected", "worker.hang")
_WATCH_OPS = {"wait_for_event"}
_ROUND = "round"  # the agent's note of a completed round (other notes name a change)
MAX_CONNECTIONS = 8  # open connections at once, a thread each; more are refused
READ_TIMEOUT = 5.0  # seconds from a connection's start for its request head to arrive whole
MAX_REQUEST = 16 << 10  # bytes of a request head read at most (a GET has no body)

_warned: set[str] = set()
_warned_lock = threading.Lock()


def _warn_once(where: str, exc: BaseException) -> None:
    """Log a failure of the exporter once per place; training goes on regardless."""
    with _warned_lock:
        if where in _warned:
            return
        _warned.add(where)
    logger.warning(
        "Metrics: %s failed (%s: %s); the agent goes on without it, and this is not logged again.",
        where,
        type(exc).__name__,
        exc,
    )


class EventTailer:
    """The new events of the kinds this exporter uses (:data:`_KINDS`), from one ``stat``
    and one ``read`` per poll (:class:`elastic.events.Tail`).

    Starts at the beginning of the file (the newest checkpoint may be in its history),
    follows it when it is replaced or truncated, and when more than ``max_backlog``
    bytes are unread skips to the newest ones.
    """

    def __init__(self, path: str | os.PathLike[str], max_backlog: int = MAX_BACKLOG) -> None:
        self.path = os.fspath(path)
        self._tail = Tail(path, kinds=_KINDS, max_backlog=max_backlog, max_partial=MAX_PARTIAL)

    def poll(self) -> list[dict[str, Any]]:
        return self._tail.read()


@dataclass
class _Recovery:
    """A change or failure this agent noticed, until the first step after the next round."""

    kind: str
    noticed: float
    round_done: float | None = None


class AgentMetrics:
    """One agent's metrics in their own registry.

    Args:
        event_log: the event log its workers write; None: no worker figures.
        restart_budget: ``--max-restarts``.
        run_id: the rendezvous id (``worker.restart`` events of other runs are ignored).
        clock: unix time, for tests.
    """

    def __init__(
        self,
        event_log: str | os.PathLike[str] | None = None,
        restart_budget: int | None = None,
        run_id: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.registry = CollectorRegistry()
        self._lock = threading.RLock()  # the event log and what is derived from it
        # The agent's notes, and the gauges it sets: the hooks only take this lock, which is
        # never held over I/O, so they cannot slow the agent down.
        self._notes_lock = threading.Lock()
        self._notes: deque[tuple[float, str]] = deque(maxlen=MAX_NOTES)  # (time, change kind)
        self._clock = clock
        self._run_id = run_id
        self._tailer = EventTailer(event_log) if event_log else None
        self._handler: Any = None
        self._gauges: dict[str, float] = {}
        self._restart_budget = restart_budget
        self._restarts_used = 0
        self._recovery: _Recovery | None = None
        self._checkpoint: tuple[int, float] | None = None  # newest committed step, its time
        self._stall: tuple[int, float] | None = None  # newest saved step, its longest stall
        # First: its collect reads the new events, which the histograms and counters below
        # then show in the same scrape.
        self.registry.register(_StateCollector(self))
        self.recovery_seconds = Histogram(
            "elastic_recovery_seconds",
            "Seconds from this agent noticing a membership change or a failure to the first "
            "training step of the next round.",
            ["kind"],
            buckets=RECOVERY_BUCKETS,
            registry=self.registry,
        )
        self.etcd_seconds = Histogram(
            "elastic_etcd_request_seconds",
            "Seconds per etcd request of this agent, retries and fail-over included.",
            ["op"],
            buckets=ETCD_BUCKETS,
            registry=self.registry,
        )
        self.etcd_errors = Counter(
            "elastic_etcd_request_errors",
            "etcd requests of this agent that failed, by operation and error.",
            ["op", "error"],
            registry=self.registry,
        )
        self.stragglers = Counter(
            "elastic_stragglers_detected",
            "Nodes named slower than the threshold times the median for K consecutive steps.",
            registry=self.registry,
        )
        self.hung = Counter(
            "elastic_workers_hung",
            "Workers that stayed inside a step past the hang bound and exited.",
            registry=self.registry,
        )
        self.stall_total = Counter(
            "elastic_checkpoint_stall_seconds",
            "Seconds training stood still for checkpoint saves (the slowest rank of each).",
            registry=self.registry,
        )

    # -- hooks (the agent's thread): no I/O, one short lock --------------------------------

    def round_completed(self, handler: Any, nodes: int, world_size: int) -> None:
        """This agent's rendezvous completed a round of ``nodes`` nodes, ``world_size`` workers."""
        try:
            state = _rendezvous_state(handler)
        except Exception as exc:  # the sizes still count
            _warn_once("reading the rendezvous state", exc)
            state = None
        with self._notes_lock:
            self._handler = handler
            self._gauges["elastic_nodes"] = nodes
            self._gauges["elastic_world_size"] = world_size
            if state is not None:
                self._gauges["elastic_rendezvous_round"] = state[0]
            self._notes.append((self._clock(), _ROUND))

    def change_noticed(self, kind: str) -> None:
        """This agent saw a reason to re-form the group (a recovery starts, unless one runs)."""
        with self._notes_lock:
            self._notes.append((self._clock(), kind))

    def restarts(self, used: int, budget: int) -> None:
        """The job has failed ``used`` rounds of its budget of ``budget``."""
        with self._notes_lock:
            self._restart_budget = budget
            self._restarts_used = max(self._restarts_used, used)

    def etcd_request(
        self, fn: Callable[..., Any], seconds: float, error: BaseException | None
    ) -> None:
        """One :meth:`EtcdClient.call` ended (``error``: what it raised, None if it succeeded)."""
        try:
            op = _op_name(fn)
            if error is not None:
                self.etcd_errors.labels(op, _error_name(error)).inc()
            if op not in _WATCH_OPS:
                self.etcd_seconds.labels(op).observe(seconds)
        except Exception as exc:
            _warn_once("recording an etcd request", exc)

    # -- the event log ------------------------------------------------------------------

    def poll(self) -> None:
        """Read the events appended since the last look (each scrape does it too)."""
        with self._lock:
            self._poll()

    def _poll(self) -> None:
        """Replay the agent's notes and the new events in time order (under ``_lock``)."""
        with self._notes_lock:
            notes = list(self._notes)
            self._notes.clear()
        events: list[dict[str, Any]] = []
        if self._tailer is not None:
            try:
                events = self._tailer.poll()
            except Exception as exc:
                _warn_once(f"reading the event log {self._tailer.path}", exc)
        timeline: list[tuple[float, int, Any]] = [(ts, 0, note) for ts, note in notes]
        for event in events:
            try:
                timeline.append((float(event.get("ts", 0.0)), 1, event))
            except (TypeError, ValueError) as exc:
                _warn_once(f"reading a {event.get('kind')} event", exc)
        timeline.sort(key=lambda item: item[:2])
        for ts, source, item in timeline:
            try:
                if source == 0:
                    self._on_note(ts, item)
                else:
                    self._on_event(ts, item)
            except Exception as exc:  # a malformed event of a known kind
                what = f"a {item.get('kind')} event" if source else f"the note {item!r}"
                _warn_once(f"reading {what}", exc)

    def _on_note(self, ts: float, note: str) -> None:
        if note == _ROUND:
            if self._recovery is not None:
                self._recovery.round_done = ts
        elif self._recovery is None:  # a change while one is being recovered from is part of it
            self._recovery = _Recovery(note, ts)

    def _on_event(self, ts: float, event: dict[str, Any]) -> None:
        kind = event["kind"]
        if kind == "train.step":
            rec = self._recovery
            if rec is not None and rec.round_done is not None and ts >= rec.round_done:
                self.recovery_seconds.labels(rec.kind).observe(max(0.0, ts - rec.noticed))
                self._recovery = None
            figures = {
                "elastic_train_step": int(event["step"]),
                "elastic_train_step_timestamp_seconds": ts,
            }
            if "loss" in event:
                figures["elastic_train_loss"] = float(event["loss"])
            if "samples_per_s" in event:
                figures["elastic_train_samples_per_second"] = float(event["samples_per_s"])
            ranks = _rank_figures(event)
            with self._notes_lock:
                if ranks:  # the newest step's ranks replace the previous step's
                    for name in [n for n in self._gauges if n.startswith("elastic_rank_")]:
                        del self._gauges[name]
                self._gauges.update(figures)
                self._gauges.update(ranks)
        elif kind == "straggler.detected":
            self.stragglers.inc()
        elif kind == "worker.hang":
            self.hung.inc()
        elif kind == "ckpt.save":
            self._on_save(event, ts)
        elif kind == "worker.restart" and "job_restarts_used" in event:
            if self._run_id is not None and event.get("run_id") not in (None, self._run_id):
                return
            with self._notes_lock:
                self._restarts_used = max(self._restarts_used, int(event["job_restarts_used"]))
                if self._restart_budget is None and "job_restart_budget" in event:
                    self._restart_budget = int(event["job_restart_budget"])

    def _on_save(self, event: dict[str, Any], ts: float) -> None:
        step = int(event["step"])
        if event.get("ok") and (self._checkpoint is None or step > self._checkpoint[0]):
            self._checkpoint = (step, ts)
        blocking = float(event.get("blocking_s") or 0.0)
        if self._stall is None or step > self._stall[0]:
            self._stall = (step, blocking)
            self.stall_total.inc(blocking)
        elif step == self._stall[0] and blocking > self._stall[1]:
            self.stall_total.inc(blocking - self._stall[1])
            self._stall = (step, blocking)

    # -- scrape -------------------------------------------------------------------------

    def gauges(self) -> dict[str, float]:
        """Every gauge known now, by name (``{state}`` members as ``name{state="..."}``)."""
        with self._lock:
            self._poll()
            with self._notes_lock:
                out = dict(self._gauges)
                budget, used, handler = self._restart_budget, self._restarts_used, self._handler
            if budget is not None:
                out["elastic_job_restart_budget"] = budget
                out["elastic_job_restarts_used"] = used
                out["elastic_job_restarts_left"] = max(0, budget - used)
            if self._checkpoint is not None:
                out["elastic_checkpoint_step"] = self._checkpoint[0]
                out["elastic_checkpoint_age_seconds"] = max(
                    0.0, self._clock() - self._checkpoint[1]
                )
            if self._stall is not None:
                out["elastic_checkpoint_last_stall_seconds"] = self._stall[1]
        if handler is not None:
            try:
                state = _rendezvous_state(handler)
            except Exception as exc:
                _warn_once("reading the rendezvous state", exc)
                state = None
            if state is not None:
                out['elastic_rendezvous_members{state="participant"}'] = state[1]
                out['elastic_rendezvous_members{state="waiting"}'] = state[2]
        return out


_HELP = {
    "elastic_world_size": "Worker processes in this agent's current rendezvous round.",
    "elastic_nodes": "Nodes (agents) in this agent's current rendezvous round.",
    "elastic_rendezvous_round": "The rendezvous round this agent's workers run in.",
    "elastic_rendezvous_members": "Nodes in the rendezvous state this agent last read, by "
    "state: participant or waiting (to join).",
    "elastic_job_restart_budget": "Failed rounds the job may have (--max-restarts).",
    "elastic_job_restarts_used": "Failed rounds of the whole job so far (kept in etcd).",
    "elastic_job_restarts_left": "Failed rounds the job may still have.",
    "elastic_train_step": "The newest training step.",
    "elastic_train_loss": "The loss of the newest training step.",
    "elastic_train_samples_per_second": "Samples per second of the newest step, all workers.",
    "elastic_train_step_timestamp_seconds": "Unix time when the newest training step ended.",
    "elastic_checkpoint_step": "The step of the newest complete (committed) checkpoint.",
    "elastic_checkpoint_age_seconds": "Seconds since the newest complete checkpoint was committed.",
    "elastic_checkpoint_last_stall_seconds": "Seconds the newest checkpoint save stopped "
    "training (its slowest rank).",
    "elastic_rank_compute_seconds": "Each rank's compute time in the newest step (its step "
    "less the time its collectives were in flight).",
    "elastic_rank_wait_seconds": "Each rank's wait in the newest step's collectives.",
    "elastic_rank_slowness_ratio": "Each rank's compute time over the median of the ranks'.",
}


def _rank_figures(event: dict[str, Any]) -> dict[str, float]:
    """The per-rank gauges of a ``train.step`` event (elastic.worker.timing): every rank's
    compute, wait and ratio to the median when listed, else the slowest ranks' ratios."""
    out: dict[str, float] = {}
    compute, wait = event.get("compute_s"), event.get("wait_s")
    if isinstance(compute, list) and compute:
        times = [float(t) for t in compute]
        ordered = sorted(times)
        mid = len(ordered) // 2
        median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
        for rank, t in enumerate(times):
            out[f'elastic_rank_compute_seconds{{rank="{rank}"}}'] = t
            out[f'elastic_rank_slowness_ratio{{rank="{rank}"}}'] = t / median if median else 1.0
    if isinstance(wait, list):
        for rank, t in enumerate(wait):
            out[f'elastic_rank_wait_seconds{{rank="{rank}"}}'] = float(t)
    if not out:
        for rank, ratio in event.get("slowest") or ():
            out[f'elastic_rank_slowness_ratio{{rank="{int(rank)}"}}'] = float(ratio)
    return out


class _StateCollector(Collector):
    """The gauges, computed at each scrape (which also reads the new events)."""

    def __init__(self, metrics: AgentMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        try:
            values = self._metrics.gauges()
        except Exception as exc:
            _warn_once("collecting the gauges", exc)
            return
        labelled: dict[str, GaugeMetricFamily] = {}  # name{label="value"}: one family each
        for name, value in values.items():
            if "{" in name:
                base, _, rest = name.partition("{")
                label, _, text = rest.rstrip("}").partition("=")
                family = labelled.get(base)
                if family is None:
                    family = labelled[base] = GaugeMetricFamily(
                        base, _HELP.get(base, base), labels=[label]
                    )
                family.add_metric([text.strip('"')], value)
                continue
            yield GaugeMetricFamily(name, _HELP.get(name, name), value=value)
        yield from labelled.values()


def _rendezvous_state(handler: Any) -> tuple[int, int, int] | None:
    """(round, participants, waiting) from the state the handler last read; no etcd request
    (our handlers' ``round_view()``; None for any other handler)."""
    view = getattr(handler, "round_view", None)
    return view() if callable(view) else None


def _op_name(fn: Callable[..., Any]) -> str:
    """``EtcdClient.range.<locals>.<lambda>`` -> ``range``."""
    qualname = getattr(fn, "__qualname__", "") or ""
    head = qualname.split(".<locals>", 1)[0]
    return head.rsplit(".", 1)[-1] if "<locals>" in qualname else "other"


def _error_name(error: BaseException) -> str:
    """A gRPC error's status (``unavailable``), else the exception's class name (the
    client's own subclasses, such as ``EtcdUnansweredError``, by their public base)."""
    code = getattr(error, "code", None)
    if callable(code):
        try:
            return str(code().name).lower()
        except Exception:  # not a grpc.RpcError after all
            pass
    public = next(c for c in type(error).__mro__ if c.__module__ != "elastic.etcd.client")
    return public.__name__


# -- the HTTP server: the standard library's, bounded ------------------------------------


class _HeadTooLarge(OSError):
    pass


class _BoundedReader(io.RawIOBase):
    """A connection's bytes: at most ``limit`` of them, all before ``deadline``."""

    def __init__(self, sock: socket.socket, limit: int, deadline: float) -> None:
        self._sock, self._left, self._deadline = sock, limit, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._left <= 0:
            raise _HeadTooLarge("The request head is over the server's bound.")
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("The request head did not arrive in time.")
        self._sock.settimeout(remaining)
        n = self._sock.recv_into(memoryview(buffer)[: self._left])
        self._left -= n
        return n


class _BoundedHead(socketserver.StreamRequestHandler):
    """Put before a handler's class: its request head is read through a
    :class:`_BoundedReader` (``max_request`` bytes, ``read_timeout`` seconds)."""

    read_timeout: float = READ_TIMEOUT
    max_request: int = MAX_REQUEST

    def setup(self) -> None:
        super().setup()
        self.rfile.close()
        deadline = time.monotonic() + self.read_timeout
        self.rfile = io.BufferedReader(_BoundedReader(self.connection, self.max_request, deadline))


class BoundedHTTPServer(ThreadingHTTPServer):
    """The standard library's threading HTTP server (one daemon thread per connection,
    ``handler`` answering one request each), with bounds that hostile clients meet: at
    most ``max_connections`` connections at once (one more is closed at once and counted
    in :attr:`refused`), each request head read within ``read_timeout`` seconds of the
    connection's start and ``max_request`` bytes, else closed unanswered. Closing it
    waits for no client. ``address``'s host may be a name: it binds the first address
    it resolves to (no reverse lookup)."""

    block_on_close = False
    request_queue_size = 128

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        *,
        max_connections: int = MAX_CONNECTIONS,
        read_timeout: float = READ_TIMEOUT,
        max_request: int = MAX_REQUEST,
    ) -> None:
        family, _, _, _, sockaddr = socket.getaddrinfo(
            address[0] or None, address[1], type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        self.address_family = family
        self.max_connections = max_connections
        self.refused = 0  # connections closed at once: over the cap
        self._open = 0
        self._lock = threading.Lock()

        bounded = type(
            handler.__name__,
            (_BoundedHead, handler),
            {"read_timeout": read_timeout, "max_request": max_request},
        )
        super().__init__(sockaddr, bounded)  # type: ignore[arg-type]  # an inet address

    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)  # HTTPServer's adds a reverse DNS lookup
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]

    @property
    def open_connections(self) -> int:
        with self._lock:
            return self._open

    def verify_request(self, request: Any, client_address: Any) -> bool:
        with self._lock:
            if self._open < self.max_connections:
                self._open += 1
                return True
            self.refused += 1
            refused = self.refused
        if refused in (1, 100) or refused % 10000 == 0:
            logger.warning(
                "Refused a connection from %s: %d are open already, the most this server "
                "keeps (%d refused so far).",
                client_address,
                self.max_connections,
                refused,
            )
        return False

    def _release(self) -> None:
        with self._lock:
            self._open -= 1

    def process_request(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started (a pids limit): free its place
            self._release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.debug("A request from %s failed.", client_address, exc_info=True)


# -- the agent's exporter: one per process ---------------------------------------------


class Exporter:
    """A started exporter: its metrics, HTTP server and port; :meth:`close` stops it."""

    def __init__(
        self, metrics: AgentMetrics, server: BoundedHTTPServer, thread: threading.Thread
    ) -> None:
        self.metrics = metrics
        self._server = server
        self._thread = thread
        self.server_address: tuple[Any, ...] = tuple(server.server_address)
        self.port: int = server.server_port

    def close(self) -> None:
        global _active
        from elastic.etcd import client

        if _active is self.metrics:
            _active = None
        if client.request_observer == self.metrics.etcd_request:
            client.request_observer = None
        try:
            self._server.shutdown()
            self._server.server_close()
        except Exception as exc:
            _warn_once("stopping the metrics server", exc)


_active: AgentMetrics | None = None


def bind_address(node_addr: str | None) -> str:
    """Where the agent serves its metrics: the node's address (``--local-addr``, which the
    other nodes reach it by and Prometheus scrapes), else 127.0.0.1, never every interface."""
    return node_addr.strip() if node_addr and node_addr.strip() else DEFAULT_ADDR


def start(
    port: int,
    *,
    addr: str = DEFAULT_ADDR,
    event_log: str | os.PathLike[str] | None = None,
    restart_budget: int | None = None,
    run_id: str | None = None,
) -> Exporter | None:
    """Serve this process's agent metrics on ``addr:port`` (0: a free port); None if it failed.

    prometheus_client's handler answers, in a :class:`BoundedHTTPServer`: at most
    :data:`MAX_CONNECTIONS` connections (a thread each) for at most :data:`READ_TIMEOUT`
    seconds, so idle or dripping clients cannot take the agent's threads. Makes the hooks of
    :mod:`elastic.agent.node` and the etcd client record into it.
    """
    global _active
    from prometheus_client.exposition import MetricsHandler

    from elastic.etcd import client

    try:
        metrics = AgentMetrics(event_log, restart_budget, run_id)
        server = BoundedHTTPServer((addr, port), MetricsHandler.factory(metrics.registry))
    except Exception as exc:
        logger.error(
            "Could not serve metrics on %s:%d (%s); the agent runs without them.",
            addr,
            port,
            exc,
        )
        return None
    thread = threading.Thread(
        target=server.serve_forever, name="elastic-metrics", kwargs={"poll_interval": 0.2}
    )
    thread.daemon = True
    thread.start()
    _active = metrics
    client.request_observer = metrics.etcd_request
    exporter = Exporter(metrics, server, thread)
    logger.info("Serving metrics on http://%s:%d/metrics", addr, exporter.port)
    return exporter


def event_log_for_workers(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Make sure the workers write an event log the exporter can read.

    When ``$ELASTIC_EVENT_LOG`` is unset, sets it to a file in a new private (0700) temp
    directory and returns that directory (remove it with :func:`remove_private_log`); call
    this before any worker or fork server starts. Returns None when it was set already.
    """
    environ = os.environ if environ is None else environ
    if environ.get(env.EVENT_LOG):
        return None
    directory = tempfile.mkdtemp(prefix="elastic-agent-events-")
    environ[env.EVENT_LOG] = str(Path(directory) / "events.jsonl")
    return directory


def remove_private_log(directory: str | None) -> None:
    if directory:
        shutil.rmtree(directory, ignore_errors=True)


# -- the hooks of elastic.agent.node: no-ops unless the exporter runs; never raise ------------


def _record(where: str, fn: Callable[[AgentMetrics], None]) -> None:
    metrics = _active
    if metrics is None:
        return
    try:
        fn(metrics)
    except Exception as exc:
        _warn_once(where, exc)


def on_round(worker_group: Any) -> None:
    """The agent's rendezvous completed a round (call after torch's ``_rendezvous``)."""

    def record(m: AgentMetrics) -> None:
        workers = worker_group.workers
        nodes = int(worker_group.group_world_size)
        world = (
            int(workers[0].world_size) if workers else nodes * worker_group.spec.local_world_size
        )
        m.round_completed(worker_group.spec.rdzv_handler, nodes, world)

    _record("recording a rendezvous round", record)


def on_change(kind: str) -> None:
    """The agent noticed a reason to re-form the group: ``kind`` names it."""
    _record("recording a membership change", lambda m: m.change_noticed(kind))


def on_restarts(used: int, budget: int) -> None:
    """The job has failed ``used`` rounds of ``budget``."""
    _record("recording the restart budget", lambda m: m.restarts(used, budget))


__all__ = [
    "MAX_CONNECTIONS",
    "MAX_REQUEST",
    "READ_TIMEOUT",
    "AgentMetrics",
    "BoundedHTTPServer",
    "EventTailer",
    "Exporter",
    "bind_address",
    "event_log_for_workers",
    "on_change",
    "on_restarts",
    "on_round",
    "remove_private_log",
    "start",
]
