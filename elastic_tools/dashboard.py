"""``elastic dashboard``: a small read-only web page of a running job.

The standard library's ``http.server``, no framework, with the metrics port's bounds
(:class:`elastic.agent.metrics.BoundedHTTPServer`: at most 8 connections, a thread each, a
request head within 5 s and 16 KiB: idle or dripping clients cannot starve it). Three paths:

* ``/``: the page; its vanilla JavaScript polls ``/api/status`` every second and reloads
  the timeline image every few seconds;
* ``/api/status``: strict JSON (:func:`elastic_tools.status.strict_json`: a NaN loss is
  the string ``"NaN"``): the rendezvous (members, round, world size; from etcd through
  :func:`elastic_tools.status.rendezvous_status`), the newest step (step, loss, samples/s),
  the newest checkpoint (saved, from the event log; complete, from storage when a
  checkpoint URL is given) and how many events were read;
* ``/timeline.png``: :func:`elastic_tools.timeline.render_png` of the event log, drawn
  again at most every :data:`TIMELINE_EVERY_S` seconds.

Nothing on the page writes anywhere: etcd is only read, and the event log only tailed.
Requests must name the server in their ``Host`` header (the loopback names, the bound
address, or a name given with ``--allow-host``): others are answered 421, so a page that
rebinds its DNS name to 127.0.0.1 cannot read ``/api/status``. What is kept of the event
log is bounded (:class:`EventTail`), however long the run.
"""

from __future__ import annotations

import heapq
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from elastic.agent.metrics import BoundedHTTPServer
from elastic.errors import ElasticError
from elastic.etcd.client import EtcdClient, EtcdOptions
from elastic.events import Tail
from elastic.rendezvous.keys import RunKeys
from elastic_tools.status import checkpoint_status, rendezvous_status, strict_json

logger = logging.getLogger(__name__)

TIMELINE_EVERY_S = 3.0  # the timeline PNG is drawn again at most this often
CHECKPOINT_EVERY_S = 10.0  # storage is listed for the newest complete checkpoint this often
# Not kept in memory: every rank's sample indices of every step (job.sample_ledger).
SKIPPED_KINDS = frozenset({"train.samples"})
MAX_STEPS = 2000  # train.step points kept for the timeline (downsampled beyond)
MAX_OTHER = 5000  # the newest events of other kinds kept (membership, checkpoints...)
MAX_LINE = 1 << 20  # bytes: a longer line without its newline is dropped
BACKLOG = 4 << 20  # bytes parsed at once at most: older unread bytes are skimmed (see EventTail)
SKIM_CHUNK = 1 << 20  # bytes a skim reads at a time
STATUS_EVERY_S = 0.5  # requests closer together share one etcd read
TIMELINE_SIZE = (11.0, 6.0)  # inches at 100 dpi: below the cards in a 900-pixel-high window


@dataclass(frozen=True)
class Summary:
    """What ``/api/status`` shows of the event log: how many events were read, the newest
    ``train.step`` and the newest successful ``ckpt.save`` (None: none yet)."""

    count: int
    step: dict[str, Any] | None
    saved: dict[str, Any] | None


class EventTail:
    """What the page needs of a JSON-lines log, kept up to date by
    :class:`elastic.events.Tail` (only what was appended since the last call is read; a
    torn last line waits for its end; a truncated or replaced file is read again).

    Memory stays bounded however long the run: it keeps how many events were read, the
    newest step and the newest successful save, the first event (the timeline's zero), at
    most ``max_steps`` steps (every step until then; beyond, every other one kept is
    dropped and from then on every ``2**k``-th step is kept) and the newest ``max_other``
    events of other kinds. The kinds in ``skip`` are not kept at all.

    Time and memory stay bounded however long the log it starts on: at most ``backlog``
    bytes are parsed at once, the newest ones. The older unread bytes are skimmed a chunk at
    a time: their lines are counted, their first line is the timeline's zero, and only
    their successful ``ckpt.save`` lines are parsed (the newest save); their other events
    are not on the timeline. (A 65 MiB log of 400,000 events: its first summary took
    4.2 s and 425 MiB; now well under a second and a few MiB.)
    """

    def __init__(
        self,
        path: Path | None,
        skip: frozenset[str] = SKIPPED_KINDS,
        *,
        max_steps: int = MAX_STEPS,
        max_other: int = MAX_OTHER,
        backlog: int = BACKLOG,
    ) -> None:
        self.path = path
        self.skip = skip
        self.max_steps = max_steps
        self.backlog = backlog
        self._tail = (
            Tail(path, skip=skip, max_partial=MAX_LINE, max_backlog=backlog)
            if path is not None
            else None
        )
        self._inode: int | None = None
        self._offset = 0  # where the tail's next read starts (as it computes it)
        self._lock = threading.Lock()
        self._other: deque[tuple[int, dict[str, Any]]] = deque(maxlen=max_other)
        self._clear()

    def _clear(self) -> None:
        self.count = 0  # events read (less the skipped kinds)
        self.newest_step: dict[str, Any] | None = None
        self.newest_save: dict[str, Any] | None = None  # the newest ckpt.save that succeeded
        self._first: tuple[int, dict[str, Any]] | None = None
        self._newest_step: tuple[int, dict[str, Any]] | None = None
        self._steps: list[tuple[int, dict[str, Any]]] = []
        self._stride, self._step_count = 1, 0
        self._other.clear()

    def _add(self, event: dict[str, Any]) -> None:
        seq, self.count = self.count, self.count + 1
        if self._first is None:
            self._first = (seq, event)
        kind = event.get("kind")
        if kind != "train.step":
            if kind == "ckpt.save" and event.get("ok"):
                self.newest_save = event
            self._other.append((seq, event))
            return
        self.newest_step, self._newest_step = event, (seq, event)
        if self._step_count % self._stride == 0:
            self._steps.append((seq, event))
            if len(self._steps) > self.max_steps:
                self._steps, self._stride = self._steps[::2], self._stride * 2
        self._step_count += 1

    def poll(self) -> list[dict[str, Any]]:
        """Read what is new; return the events kept, in the log's order (a new list)."""
        with self._lock:
            self._read()
            return self._kept()

    def summary(self) -> Summary:
        """Read what is new; return the count and the newest step and save, of one read."""
        with self._lock:
            self._read()
            return Summary(self.count, self.newest_step, self.newest_save)

    def _read(self) -> None:
        if self._tail is None or self.path is None:
            return
        try:
            st = os.stat(self.path)
            restarted = self._inode is not None and (
                st.st_ino != self._inode or st.st_size < self._offset
            )
            if restarted or self._inode is None:
                self._inode, self._offset = st.st_ino, 0
            if restarted:
                self._clear()
            if st.st_size - self._offset > self.backlog:
                self._skim(self._offset, st.st_size - self.backlog)
            new = self._tail.read()
            self._offset = st.st_size
        except OSError as exc:
            logger.debug("Cannot read the event log %s: %s", self.path, exc)
            return
        if self._tail.restarted and not restarted:  # replaced between our looks: rare
            self._clear()
        for event in new:
            self._add(event)

    def _skim(self, start: int, jump: int) -> None:
        """Count the lines from ``start`` through the one the tail drops at ``jump`` (it
        starts reading there), keep the first as the timeline's zero, and parse only the
        successful saves among them (one chunk in memory at a time)."""
        assert self.path is not None
        skipped = [b'"' + kind.encode() + b'"' for kind in self.skip]
        carry = b""
        with open(self.path, "rb") as f:
            f.seek(start)
            pos = start
            while True:
                chunk = f.read(SKIM_CHUNK)
                if not chunk:
                    break
                if pos + len(chunk) > jump:  # the tail drops the line that holds byte ``jump``
                    end = chunk.find(b"\n", max(0, jump - pos))
                    chunk = chunk if end < 0 else chunk[: end + 1]
                pos += len(chunk)
                data = carry + chunk
                cut = data.rfind(b"\n") + 1
                lines, carry = data[:cut], data[cut:][-MAX_LINE:]
                self._skim_lines(lines, skipped)
                if pos > jump and lines.endswith(b"\n") and not carry:
                    break

    def _skim_lines(self, lines: bytes, skipped: list[bytes]) -> None:
        count = lines.count(b"\n") - sum(lines.count(k) for k in skipped)
        if self._first is None and count > 0:
            self._add_first(lines)
        self.count += max(0, count)
        at = lines.rfind(b'"ckpt.save"')  # the newest successful save: from the end back
        while at >= 0:
            begin = lines.rfind(b"\n", 0, at) + 1
            end = lines.find(b"\n", at)
            try:
                event = json.loads(lines[begin:end])
            except ValueError:
                event = None
            if isinstance(event, dict) and event.get("kind") == "ckpt.save" and event.get("ok"):
                self.newest_save = event
                return
            at = lines.rfind(b'"ckpt.save"', 0, begin)

    def _add_first(self, lines: bytes) -> None:
        for line in lines.split(b"\n", 8)[:8]:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and event.get("kind") not in self.skip:
                self._first = (-1, event)
                return

    def _kept(self) -> list[dict[str, Any]]:
        ends = [e for e in (self._first, self._newest_step) if e is not None]
        merged = heapq.merge(self._steps, self._other, sorted(ends), key=lambda e: e[0])
        out: dict[int, dict[str, Any]] = {}
        for seq, event in merged:
            out.setdefault(seq, event)
        return list(out.values())


class Dashboard:
    """What the page shows, gathered on demand and cached briefly.

    Args:
        options: how to reach etcd (:func:`elastic_tools.status.etcd_options`).
        run_id: the rendezvous id.
        prefix: the rendezvous key prefix.
        event_log: the run's event log (None: etcd only, no steps nor timeline).
        checkpoint_url: where the run writes checkpoints (None: the event log's saves only).
        secret: the job's secret (authenticates the rendezvous state and commit markers).
    """

    def __init__(
        self,
        options: EtcdOptions,
        run_id: str,
        *,
        prefix: str = "/elastic",
        event_log: Path | None = None,
        checkpoint_url: str | None = None,
        secret: bytes | None = None,
    ) -> None:
        self.run_id = run_id
        self.keys = RunKeys(prefix, run_id)
        self.client = EtcdClient(options)
        self.tail = EventTail(event_log)
        self.checkpoint_url = checkpoint_url
        self.secret = secret
        self._lock = threading.Lock()
        self._status: tuple[float, dict[str, Any]] | None = None
        self._checkpoint: tuple[float, dict[str, Any] | None] | None = None
        self._timeline: tuple[float, int, bytes] | None = None
        self._timeline_lock = threading.Lock()

    def close(self) -> None:
        self.client.close()

    def status(self) -> dict[str, Any]:
        """The JSON of ``/api/status`` (etcd read at most every :data:`STATUS_EVERY_S`)."""
        with self._lock:
            now = time.monotonic()
            if self._status is None or now - self._status[0] >= STATUS_EVERY_S:
                self._status = (now, self._gather())
            return self._status[1]

    def _gather(self) -> dict[str, Any]:
        out: dict[str, Any] = {"run_id": self.run_id, "time": time.time(), "errors": []}
        try:
            out["rendezvous"] = rendezvous_status(self.client, self.keys, self.secret)
        except ElasticError as exc:
            out["rendezvous"] = None
            out["errors"].append(str(exc))
        seen = self.tail.summary()
        step, saved = seen.step, seen.saved
        out["events"] = seen.count
        out["event_log"] = str(self.tail.path) if self.tail.path else None
        out["step"] = (
            {k: step.get(k) for k in ("step", "loss", "samples_per_s", "world_size", "ts")}
            if step
            else None
        )
        if step and "slowest" in step:  # the slowest ranks (elastic.worker.timing)
            out["step"]["slowest"] = step["slowest"]
        out["checkpoint"] = {
            "saved_step": saved.get("step") if saved else None,
            "saved_url": saved.get("url") if saved else None,
            "saved_ts": saved.get("ts") if saved else None,
        }
        try:
            out["checkpoint"].update(self._complete_checkpoint() or {})
        except (ElasticError, OSError) as exc:
            out["errors"].append(f"Cannot list the checkpoints at {self.checkpoint_url}: {exc}")
        return out

    def _complete_checkpoint(self) -> dict[str, Any] | None:
        if not self.checkpoint_url:
            return None
        now = time.monotonic()
        if self._checkpoint is None or now - self._checkpoint[0] >= CHECKPOINT_EVERY_S:
            found = checkpoint_status(self.checkpoint_url, self.run_id, "size", self.secret)
            self._checkpoint = (now, found)
        return self._checkpoint[1]

    def timeline_png(self) -> bytes:
        """The timeline, drawn again when the log grew and :data:`TIMELINE_EVERY_S` passed."""
        from elastic_tools.timeline import render_png

        with self._timeline_lock:
            events = self.tail.poll()
            count = self.tail.count
            now = time.monotonic()
            cached = self._timeline
            fresh = cached is not None and (
                cached[1] == count or now - cached[0] < TIMELINE_EVERY_S
            )
            if not fresh:
                png = render_png(events, title=self.run_id, size=TIMELINE_SIZE)
                self._timeline = cached = (now, count, png)
            assert cached is not None
            return cached[2]


PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>elastic: __RUN_ID__</title>
<style>
 body { font: 14px system-ui, sans-serif; margin: 1.2em 2em; color: #222; }
 h1 { font-size: 1.3em; margin: 0 0 .6em; }
 .cards { display: flex; gap: 1em; flex-wrap: wrap; margin-bottom: 1em; }
 .card { border: 1px solid #ccc; border-radius: 6px; padding: .5em .9em; min-width: 7em; }
 .card .label { color: #666; font-size: .85em; }
 .card .value { font-size: 1.4em; font-variant-numeric: tabular-nums; }
 table { border-collapse: collapse; margin-bottom: 1em; }
 th, td { border-bottom: 1px solid #ddd; padding: .25em .9em .25em 0; text-align: left; }
 #errors { color: #b00; white-space: pre-wrap; }
 #timeline { max-width: 100%; border: 1px solid #eee; display: block; }
 .muted { color: #888; }
</style>
</head>
<body>
<h1>run <span id="run-id">__RUN_ID__</span>
 <span class="muted" id="updated">(connecting...)</span></h1>
<div id="errors"></div>
<div class="cards">
 <div class="card"><div class="label">round</div><div class="value" id="round">-</div></div>
 <div class="card"><div class="label">world size</div><div class="value" id="world">-</div></div>
 <div class="card"><div class="label">step</div><div class="value" id="step">-</div></div>
 <div class="card"><div class="label">loss</div><div class="value" id="loss">-</div></div>
 <div class="card"><div class="label">samples/s</div><div class="value" id="rate">-</div></div>
 <div class="card"><div class="label">slowest rank (to the median)</div>
  <div class="value" id="slowest">-</div></div>
 <div class="card"><div class="label">newest checkpoint</div>
  <div class="value" id="checkpoint">-</div></div>
</div>
<table id="members">
 <thead><tr><th>node</th><th>address</th><th>pid</th><th>state</th><th>heartbeat</th></tr></thead>
 <tbody></tbody>
</table>
<img id="timeline" alt="timeline of world size, loss and samples/s" src="timeline.png">
<script>
"use strict";
const $ = (id) => document.getElementById(id);
const fmt = (v, digits) => (v === null || v === undefined) ? "-" :
  (typeof v === "number" && digits !== undefined ? v.toFixed(digits) : String(v));

function render(s) {
  const r = s.rendezvous;
  $("round").textContent = r && r.exists ? fmt(r.round) + (r.complete ? "" : " (forming)") : "-";
  $("world").textContent = r && r.exists ? fmt(r.world_size) : "-";
  const st = s.step || {};
  $("step").textContent = fmt(st.step);
  $("loss").textContent = fmt(st.loss, 4);
  $("rate").textContent = fmt(st.samples_per_s, 1);
  const slow = (st.slowest || [])[0];
  $("slowest").textContent = slow ? "rank " + slow[0] + " " + fmt(slow[1], 2) + "x" : "-";
  const c = s.checkpoint || {};
  const steps = [c.newest_complete_step, c.saved_step].filter((v) => typeof v === "number");
  $("checkpoint").textContent = steps.length ? "step " + Math.max(...steps) : "none";
  const body = $("members").tBodies[0];
  body.replaceChildren();
  for (const m of (r && r.members) || []) {
    const row = body.insertRow();
    row.className = "member";
    row.dataset.node = m.node;
    for (const v of [m.node, m.addr, m.pid, m.state, m.last_heartbeat_s_ago + " s ago"]) {
      row.insertCell().textContent = String(v);
    }
  }
  if (r && !r.exists) {
    body.insertRow().insertCell().textContent = "no rendezvous state in etcd";
  }
  $("errors").textContent = (s.errors || []).join("\\n");
  $("updated").textContent = "(updated " + new Date(s.time * 1000).toLocaleTimeString() + ")";
}

async function poll() {
  try {
    const response = await fetch("api/status", {cache: "no-store"});
    render(await response.json());
  } catch (err) {
    $("errors").textContent = "The dashboard server does not answer: " + err;
  }
}

let timelineTick = 0;
function refreshTimeline() {
  timelineTick += 1;
  $("timeline").src = "timeline.png?t=" + timelineTick;
}

poll();
setInterval(poll, 1000);
setInterval(refreshTimeline, __TIMELINE_MS__);
</script>
</body>
</html>
"""


def page(run_id: str) -> str:
    """The HTML of ``/`` (the run id escaped)."""
    import html

    return PAGE.replace("__RUN_ID__", html.escape(run_id)).replace(
        "__TIMELINE_MS__", str(int(TIMELINE_EVERY_S * 1000))
    )


LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")


def _normal(name: str) -> str:
    name = name.strip().lower().rstrip(".")
    return f"[{name}]" if name.count(":") > 1 and not name.startswith("[") else name


def allowed_hosts(bound: str, names: Iterable[str] = ()) -> frozenset[str]:
    """The host names a dashboard bound to ``bound`` answers for: the loopback names, the
    bound address and ``names``, lower-case (a bare IPv6 address in brackets). Any port
    goes with them (a container's published port is not the one it listens on); other
    names, a DNS-rebinding page's own among them, are refused."""
    out = {_normal(n) for n in (*LOOPBACK_NAMES, bound, *names)}
    return frozenset(out - {"", "0.0.0.0", "[::]"})


def host_name(header: str) -> str:
    """The name in a ``Host`` header, without its port, as :func:`allowed_hosts` writes it."""
    value = header.strip().lower()
    if value.startswith("["):
        return value.partition("]")[0] + "]"
    return _normal(value.partition(":")[0])


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        dashboard = self.server.dashboard
        host = self.headers.get("Host") or ""
        if host_name(host) not in self.server.allowed:
            self._refuse(host.strip())
            return
        try:
            if path in ("/", "/index.html"):
                self._send(page(dashboard.run_id).encode(), "text/html; charset=utf-8")
            elif path == "/api/status":
                body = strict_json(dashboard.status(), default=str).encode()
                self._send(body, "application/json")
            elif path == "/timeline.png":
                self._send(dashboard.timeline_png(), "image/png")
            else:
                self.send_error(HTTPStatus.NOT_FOUND, "No such page on this dashboard.")
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as exc:  # a page must answer; the reason goes to the log and body
            logger.exception("The dashboard failed to answer %s.", path)
            self._send(
                f"The dashboard failed to answer {path}: {exc}".encode(),
                "text/plain; charset=utf-8",
                HTTPStatus.INTERNAL_SERVER_ERROR,
            )

    def _refuse(self, host: str) -> None:
        logger.warning("The dashboard refused a request for host %r (not one of its names).", host)
        body = (
            f"This dashboard does not answer for the host '{host}'; open it as "
            f"http://127.0.0.1:{self.server.port}/ or start it with --allow-host NAME."
        )
        self._send(body.encode(), "text/plain; charset=utf-8", HTTPStatus.MISDIRECTED_REQUEST)

    def _send(self, body: bytes, kind: str, status: HTTPStatus = HTTPStatus.OK) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s - " + format, self.address_string(), *args)


class _Server(BoundedHTTPServer):
    def __init__(
        self, address: tuple[str, int], dashboard: Dashboard, names: Iterable[str] = ()
    ) -> None:
        self.dashboard = dashboard
        self.names = tuple(names)
        self.allowed = allowed_hosts(address[0], self.names)
        super().__init__(address, _Handler)

    @property
    def port(self) -> int:
        return int(self.server_address[1])


@dataclass
class Served:
    """A dashboard serving in a thread: its ``url``; :meth:`close` stops it."""

    server: _Server
    thread: threading.Thread
    dashboard: Dashboard

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    @property
    def url(self) -> str:
        host = str(self.server.server_address[0])
        shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
        return f"http://{shown}:{self.port}/"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)
        self.dashboard.close()

    def __enter__(self) -> Served:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(
    dashboard: Dashboard, host: str = "127.0.0.1", port: int = 0, allow_hosts: Iterable[str] = ()
) -> Served:
    """Serve ``dashboard`` on ``host:port`` (0: a free port) in a daemon thread.

    Only requests whose ``Host`` header names this server are answered
    (:func:`allowed_hosts`: the loopback names, ``host``, and ``allow_hosts``, with any
    port); others get 421, so that a web page that rebinds its own DNS name to 127.0.0.1
    cannot read the status.
    """
    try:
        server = _Server((host, port), dashboard, allow_hosts)
    except OSError as exc:
        dashboard.close()
        raise ElasticError(
            f"Cannot serve the dashboard on {host}:{port} ({exc.strerror or exc}); pick "
            "another --port (0 for any free one)."
        ) from exc
    thread = threading.Thread(
        target=server.serve_forever, name="elastic-dashboard", kwargs={"poll_interval": 0.2}
    )
    thread.daemon = True
    thread.start()
    logger.info("Serving the dashboard of run %s on %s:%d.", dashboard.run_id, host, port)
    return Served(server, thread, dashboard)


__all__ = [
    "Dashboard",
    "EventTail",
    "Served",
    "Summary",
    "allowed_hosts",
    "host_name",
    "page",
    "serve",
]
