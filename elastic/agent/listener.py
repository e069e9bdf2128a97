"""An HTTP listener that no client can starve: the metrics port and the dashboard.

The standard library's ``ThreadingHTTPServer`` spends a thread per connection for as long
as the client keeps it open, with no cap: a few hundred idle connections cost an agent a
few hundred threads, and under a container's pids limit its etcd keep-alive then fails.
:class:`BoundedHTTPServer` spends a fixed number of threads however many clients connect:

* one thread runs a selector over the listening socket and every open connection, and
  reads each request's head (up to ``max_request`` bytes, up to ``read_timeout`` seconds
  from the connection's start) without blocking; a connection that is silent or slow past
  its deadline, or that sends more, is closed;
* ``workers`` threads answer the requests whose head arrived whole (a GET has no body),
  writing with the same timeout;
* at most ``max_connections`` connections are open at once; one more is accepted and
  closed at once (refused), and counted in :attr:`BoundedHTTPServer.refused`.
"""

from __future__ import annotations

import contextlib
import io
import logging
import selectors
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

logger = logging.getLogger(__name__)

MAX_CONNECTIONS = 64  # open connections at once; more are refused
WORKERS = 2  # threads that answer whole requests
READ_TIMEOUT = 5.0  # seconds for a request's head to arrive whole, and per write
MAX_REQUEST = 16 << 10  # bytes of a request's head (a GET: no body)


@dataclass
class _Pending:
    sock: socket.socket
    addr: Any
    deadline: float
    data: bytearray = field(default_factory=bytearray)


def _prebuffered(handler: type[BaseHTTPRequestHandler]) -> type[BaseHTTPRequestHandler]:
    """``handler``, reading the request from bytes already received instead of the socket."""

    class Prebuffered(handler):  # type: ignore[valid-type,misc]
        def __init__(self, request: socket.socket, addr: Any, server: Any, head: bytes) -> None:
            self._head = head
            super().__init__(request, addr, server)

        def setup(self) -> None:
            super().setup()
            self.rfile = io.BytesIO(self._head)

    Prebuffered.__name__ = Prebuffered.__qualname__ = f"Prebuffered{handler.__name__}"
    return Prebuffered


class BoundedHTTPServer(socketserver.BaseServer):
    """Serve ``handler`` (a :class:`BaseHTTPRequestHandler`, one request per connection) on
    ``address`` with a bounded number of threads and connections (see the module).

    ``server_address`` is the bound address and port; :meth:`serve_forever` runs the loop
    (in a thread of the caller's), :meth:`shutdown` stops it, :meth:`server_close` closes
    every socket. The handler's ``self.server`` is this object.
    """

    server_address: tuple[Any, ...]  # (host, port, ...) as bound

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        *,
        max_connections: int = MAX_CONNECTIONS,
        workers: int = WORKERS,
        read_timeout: float = READ_TIMEOUT,
        max_request: int = MAX_REQUEST,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # a host name (--local-addr may be one) binds the first address it resolves to
        family, _, _, _, sockaddr = socket.getaddrinfo(
            address[0] or None, address[1], type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind(sockaddr)
            self.socket.listen(128)
            self.socket.setblocking(False)
        except BaseException:
            self.socket.close()
            raise
        super().__init__(address, handler)
        self.server_address = self.socket.getsockname()
        self.server_port = int(self.server_address[1])
        self.max_connections = max_connections
        self.read_timeout = read_timeout
        self.max_request = max_request
        self.refused = 0  # connections closed at once: over the cap
        self._handler = _prebuffered(handler)
        self._clock = clock
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="elastic-http")
        self._lock = threading.Lock()
        self._open = 0  # connections pending or being answered
        self._pending: dict[int, _Pending] = {}
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._stopped.set()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)

    @property
    def open_connections(self) -> int:
        with self._lock:
            return self._open

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """Accept, read and dispatch until :meth:`shutdown`."""
        self._stopped.clear()
        sel = selectors.DefaultSelector()
        sel.register(self.socket, selectors.EVENT_READ, None)
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        try:
            while not self._stop.is_set():
                for key, _ in sel.select(timeout=min(poll_interval, self.read_timeout)):
                    if key.fileobj is self.socket:
                        self._accept(sel)
                    elif key.fileobj is self._wake_r:
                        self._drain_wake()
                    else:
                        self._receive(sel, key.data)
                self._expire(sel)
        finally:
            for pending in list(self._pending.values()):
                self._drop(sel, pending)
            sel.close()
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop :meth:`serve_forever` and wait for it (answers in progress finish)."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._stopped.wait()
        self._pool.shutdown(wait=True)

    def server_close(self) -> None:
        for sock in (self.socket, self._wake_r, self._wake_w):
            sock.close()

    # -- the selector thread ----------------------------------------------------------------

    def _drain_wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_r.recv(64)

    def _accept(self, sel: selectors.BaseSelector) -> None:
        for _ in range(self.max_connections + 1):  # what is waiting, without starving the rest
            try:
                sock, addr = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and the like: try again at the next event
                logger.warning("Cannot accept a connection (%s).", exc)
                return
            with self._lock:
                full = self._open >= self.max_connections
                if not full:
                    self._open += 1
            if full:
                self.refused += 1
                if self.refused in (1, 100) or self.refused % 10000 == 0:
                    logger.warning(
                        "Refused a connection from %s: %d are open already, the most this "
                        "server keeps (%d refused so far).",
                        addr,
                        self.max_connections,
                        self.refused,
                    )
                _close(sock)
                continue
            sock.setblocking(False)
            pending = _Pending(sock, addr, self._clock() + self.read_timeout)
            self._pending[sock.fileno()] = pending
            sel.register(sock, selectors.EVENT_READ, pending)

    def _receive(self, sel: selectors.BaseSelector, pending: _Pending) -> None:
        try:
            chunk = pending.sock.recv(self.max_request + 1 - len(pending.data))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:  # closed before a whole request
            self._drop(sel, pending)
            return
        pending.data += chunk
        if b"\r\n\r\n" in pending.data or b"\n\n" in pending.data:
            sel.unregister(pending.sock)
            del self._pending[pending.sock.fileno()]
            self._pool.submit(self._answer, pending)
        elif len(pending.data) > self.max_request:
            self._drop(sel, pending)

    def _expire(self, sel: selectors.BaseSelector) -> None:
        now = self._clock()
        for pending in [p for p in self._pending.values() if p.deadline <= now]:
            self._drop(sel, pending)

    def _drop(self, sel: selectors.BaseSelector, pending: _Pending) -> None:
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(pending.sock)
        self._pending.pop(pending.sock.fileno(), None)
        _close(pending.sock)
        self._closed()

    def _closed(self) -> None:
        with self._lock:
            self._open -= 1

    # -- the workers -----------------------------------------------------------------------

    def _answer(self, pending: _Pending) -> None:
        try:
            pending.sock.setblocking(True)
            pending.sock.settimeout(self.read_timeout)
            self._handler(pending.sock, pending.addr, self, bytes(pending.data))  # type: ignore[call-arg]
        except Exception as exc:  # a client gone mid-answer, a timeout writing
            logger.debug("Answering %s failed: %s", pending.addr, exc)
        finally:
            with contextlib.suppress(OSError):
                pending.sock.shutdown(socket.SHUT_WR)
            _close(pending.sock)
            self._closed()


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()


__all__ = ["MAX_CONNECTIONS", "READ_TIMEOUT", "WORKERS", "BoundedHTTPServer"]
