"""Hostile clients cannot starve the agent's metrics port nor the dashboard (issue 26, item 2;
issue 37, item 4: the standard library's threading server now serves both).

A network peer (the metrics port listens on the node address) or a local user opens
hundreds of connections and sends nothing, drips a request a byte at a time, or sends a
head of many megabytes. Before issue 26, each idle connection cost the server one thread
for as long as it stayed open: under a container's pids limit, 80 of them made an agent's
etcd keep-alive fail. Now at most ``MAX_CONNECTIONS`` connections are open (a thread each),
more are refused, a request head must arrive whole within the read timeout and within
``MAX_REQUEST`` bytes, and the server answers again once the hostile ones are gone.
"""

from __future__ import annotations

import contextlib
import os
import socket
import textwrap
import threading
import time
import tracemalloc
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from elastic import env
from elastic.agent import metrics
from elastic.agent.metrics import BoundedHTTPServer
from elastic.etcd.server import EtcdServer
from elastic_tools.dashboard import Dashboard, serve
from elastic_tools.status import etcd_options
from tests.helpers import FAST_CONF, local_cluster, node_env, wait_until

IDLE = 300  # connections that send nothing
pytestmark = pytest.mark.integration  # real sockets / another uid


def _threads(pid: int | None = None) -> int:
    return len(os.listdir(f"/proc/{pid or os.getpid()}/task"))


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                children = Path(f"/proc/{p}/task/{task}/children").read_text().split()
                todo += [int(c) for c in children]
    return out


@contextlib.contextmanager
def tasks_limit(pid: int, headroom: int) -> Iterator[Path | None]:
    """Put ``pid`` and its descendants in a new pids cgroup (v1 or v2) that allows
    ``headroom`` tasks more than they have now, as a container's pids limit does; None
    where this host does not let us make one."""
    parents = [Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup")]
    parent = next((p for p in parents if (p / "cgroup.procs").exists()), None)
    group = None if parent is None else parent / f"elastic-test-{os.getpid()}"
    try:
        assert group is not None
        group.mkdir()
        procs = _tree(pid)
        tasks = sum(_threads(p) for p in procs)
        (group / "pids.max").write_text(str(tasks + headroom))
        for p in procs:
            (group / "cgroup.procs").write_text(str(p))
    except (AssertionError, OSError):
        if group is not None and group.exists():
            with contextlib.suppress(OSError):
                group.rmdir()
        yield None
        return
    try:
        yield group
    finally:
        for p in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (group.parent / "cgroup.procs").write_text(p)
        with contextlib.suppress(OSError):
            group.rmdir()


@contextlib.contextmanager
def idle_connections(port: int, n: int = IDLE) -> Iterator[list[socket.socket]]:
    """``n`` connections to 127.0.0.1:``port`` that send nothing (refused ones included)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            socks.append(s)
        yield socks
    finally:
        for s in socks:
            s.close()


def _closed_by_server(s: socket.socket) -> bool:
    s.settimeout(0.05)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:  # reset
        return True


class _Hello(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "5")
        self.end_headers()
        self.wfile.write(b"hello")

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def hello_server(**bounds: Any) -> Iterator[BoundedHTTPServer]:
    server = BoundedHTTPServer(("127.0.0.1", 0), _Hello, **bounds)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _hello(server: BoundedHTTPServer) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/", timeout=5) as reply:
        return bytes(reply.read())


def test_idle_connections_take_at_most_the_cap_of_threads_and_expire() -> None:
    """300 idle connections: 8 are kept (a thread each), the rest refused; the kept ones
    are closed at their read timeout, and then the server answers again."""
    with hello_server(max_connections=8, read_timeout=2.0) as server:
        assert _hello(server) == b"hello"
        before = _threads()
        with idle_connections(server.server_port) as socks:
            wait_until(lambda: server.refused >= IDLE - 8, 10, "the server to accept them all")
            assert server.open_connections <= 8
            assert _threads() <= before + 8, "idle connections took threads past the cap"
            wait_until(lambda: server.open_connections == 0, 10, "idle connections to expire")
            assert all(_closed_by_server(s) for s in socks)
            assert _hello(server) == b"hello"
        wait_until(lambda: _threads() <= before, 10, "the connections' threads to end")


def test_a_dripping_client_stops_no_one_and_is_closed_at_its_deadline() -> None:
    """A client that drips its request head a byte at a time, faster than the read
    timeout, holds one connection: others are answered meanwhile, and it is closed when
    the head has not arrived whole within the read timeout from its connection."""
    with hello_server(max_connections=4, read_timeout=1.0) as server:
        drip = socket.create_connection(("127.0.0.1", server.server_port))
        started = time.monotonic()
        drip.sendall(b"GET / HT")
        assert _hello(server) == b"hello"

        def dripped_out() -> bool:
            try:
                drip.sendall(b"T")  # a byte every poll (about 0.15 s): never a whole head
            except OSError:
                return True
            return _closed_by_server(drip)

        wait_until(dripped_out, 10, "the dripping client to be closed")
        held = time.monotonic() - started
        drip.close()
        assert held < 3.0, f"a dripping client held its connection {held:.1f} s"
        assert _hello(server) == b"hello"


def test_a_huge_request_head_is_read_no_further_than_the_bound() -> None:
    """A head of 6 MB (100 header lines of 60 KB: under the standard library's limits of
    64 KiB a line and 100 lines) is cut at ``max_request``: the server never holds it."""
    line = b"X-Filler: " + b"a" * 60_000 + b"\r\n"
    with hello_server(max_request=16 << 10) as server:
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            with socket.create_connection(("127.0.0.1", server.server_port)) as s:
                s.settimeout(5)
                with contextlib.suppress(OSError):  # the server closes it part way
                    s.sendall(b"GET / HTTP/1.0\r\n")
                    for _ in range(100):
                        s.sendall(line)
                    s.sendall(b"\r\n")
                with contextlib.suppress(OSError):
                    assert s.recv(100) == b"", "a cut head must not be answered"
            wait_until(lambda: server.open_connections == 0, 10, "the connection to close")
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20, f"the server held {peak / 2**20:.1f} MiB for one request"
        assert _hello(server) == b"hello"


def test_closing_the_server_waits_for_no_client() -> None:
    """The agent stops its exporter at once, whatever its clients are doing."""
    with hello_server(max_connections=4, read_timeout=30.0) as server:
        socks = [socket.create_connection(("127.0.0.1", server.server_port)) for _ in range(4)]
        socks[0].sendall(b"GET / HT")
        wait_until(lambda: server.open_connections == 4, 10, "the four to be open")
        started = time.monotonic()
        server.shutdown()
        server.server_close()
        took = time.monotonic() - started
        for s in socks:
            s.close()
    assert took < 2.0, f"closing the server waited {took:.1f} s for its clients"


def test_the_dashboard_keeps_its_threads_under_idle_connections(
    etcd: EtcdServer, run_id: str, tmp_path: Path
) -> None:
    dashboard = Dashboard(etcd_options(etcd.endpoint), run_id, event_log=tmp_path / "e.jsonl")
    with serve(dashboard, port=0) as served:
        url = f"{served.url}api/status"
        with urllib.request.urlopen(url, timeout=10) as reply:
            assert reply.status == 200
        before = _threads()
        with idle_connections(served.port):
            wait_until(lambda: served.server.refused >= IDLE - 8, 10, "every one accepted")
            assert _threads() <= before + metrics.MAX_CONNECTIONS, "idle ones took threads"
        wait_until(lambda: served.server.open_connections == 0, 10, "the idle ones to go")
        with urllib.request.urlopen(url, timeout=10) as reply:
            assert reply.status == 200


def test_metrics_bind_the_node_address_else_loopback() -> None:
    assert metrics.bind_address(None) == "127.0.0.1"
    assert metrics.bind_address("") == "127.0.0.1"
    assert metrics.bind_address("10.1.2.3") == "10.1.2.3"
    assert metrics.DEFAULT_ADDR == "127.0.0.1"


SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from elastic import events
    out = sys.argv[1]
    step = 0
    while not os.path.exists(os.path.join(out, "stop")):
        step += 1
        events.emit("train.step", step=step, loss=1.0 / step, samples_per_s=10.0, world_size=1)
        with open(os.path.join(out, "step"), "w") as f:
            f.write(str(step))
        time.sleep(0.1)
    """
)


@pytest.mark.slow
def test_an_agent_under_hundreds_of_idle_metrics_connections_keeps_its_threads_and_job(
    tmp_path: Path, etcd: EtcdServer, run_id: str
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    environ = node_env(**{env.METRICS_PORT: "0"})
    options = {"nnodes": "1", "rdzv_conf": FAST_CONF, "max_restarts": 0}
    with local_cluster(tmp_path / "run", etcd.endpoint, run_id, environ, **options) as cluster:
        agent = cluster.start("a", worker=[str(script), str(tmp_path)], event_log=False)

        def port_line() -> str | None:
            return next((x for x in agent.output().splitlines() if "metrics on port" in x), None)

        def step() -> int:
            with contextlib.suppress(OSError, ValueError):
                return int((tmp_path / "step").read_text())
            return 0

        try:  # the agent's lease: its node stays in the round (it runs on, exits 0)
            line = wait_until(port_line, 120, "the agent to print its metrics port")
            port = int(line.split("port")[1].split()[0])
            wait_until(lambda: step() >= 3, 120, "three steps")
            before = _threads(agent.pid)
            # A pids limit 40 tasks above what the agent and its worker have (80 idle
            # connections once cost an agent its etcd keep-alive under such a limit).
            with tasks_limit(agent.pid, 40) as group, idle_connections(port):
                time.sleep(0.5)  # let the agent accept them all (a bare wait: nothing to poll)
                during = _threads(agent.pid)
                reached = step()
                wait_until(lambda: step() >= reached + 10, 60, "the job to run on")
                if group is not None:  # the limit was never reached
                    assert "max 0" in (group / "pids.events").read_text()
            extra = during - before
            assert extra <= metrics.MAX_CONNECTIONS, f"{extra} agent threads for idle connections"
            assert agent.running(), agent.output()[-3000:]
            # The agent answers scrapes again once the idle ones are gone.
            url = f"http://127.0.0.1:{port}/metrics"
            body = wait_until(
                lambda: _scrape(url), 30, "a scrape to be answered after the idle connections"
            )
            assert b"elastic_world_size" in body
        finally:
            (tmp_path / "stop").touch()
            code = agent.wait(timeout=120)
        assert code == 0, agent.output()[-3000:]


def _scrape(url: str) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return bytes(reply.read())
    except OSError:
        return None
