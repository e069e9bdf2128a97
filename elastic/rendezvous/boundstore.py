"""A TCPStore server with bounds, for the round's bootstrap store.

torch's TCPStore server (2.x) stores any number of keys of any size from any client that
reaches its port: 60 values of 8 MB grew an agent by more than 300 MB. Its clients (every
worker's ``torch.distributed.TCPStore``, unchanged) speak only its wire protocol, so this
module speaks that protocol, as torch 2.14's libuv backend does (``TCPStoreLibUvBackend.cpp``;
the request types are ``QueryType`` in ``TCPStoreBackend.hpp``), with bounds:

* a key at most ``max_key`` bytes (8 KiB, torch's own limit), a value at most ``max_value``
  (1 MiB), one request at most ``max_request`` (4 MiB);
* at most ``max_keys`` keys (100,000) and ``max_bytes`` (64 MiB) stored, counting each key,
  its value and ``ENTRY_OVERHEAD`` bytes for the entry;
* at most ``max_buffered`` (64 MiB) held for requests being received and answers not yet
  sent, over all connections; a client that does not read its answers is not read from;
* at most ``max_connections`` connections (4,096, and never more than a quarter of the
  process's descriptor limit, whose soft limit the store raises towards 16,384 as far as the
  hard limit allows); one that has not sent torch's validation request within
  ``validate_timeout_s`` is closed.

A request over a bound closes its connection (torch's own server does the same for a
malformed request) with one warning, at most one per second with the number left unsaid;
the store keeps serving everyone else. What group formation needs is far below the bounds:
c10d keeps a few short keys per rank and group (a counter, an address, a 128-byte NCCL id);
a gloo group of 3 ranks formed through this store left 5 keys and 874 bytes, the largest
value 178 bytes (``tests/rendezvous/test_boundstore.py``). gloo's value per rank grows with
the group (an address per peer), so a very large gloo group may need the bounds off
(``ELASTIC_BOUNDED_STORE=0``: torch's own server, unbounded).

The server runs in one thread of the agent (``selectors``, non-blocking sockets) on a
listening socket the caller bound (:mod:`elastic.rendezvous.bootstrap` binds it to the
node's address).
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import selectors
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

logger = logging.getLogger(__name__)

VALIDATION_MAGIC = 0x3C85F7CE  # c10d::detail::validationMagicNumber
ENTRY_OVERHEAD = 64  # bytes charged per stored key or queued value, beyond its own bytes
_STOP_WAITING = b"\x00"  # WaitResponseType::STOP_WAITING
_WAIT_CANCELED = b"\x01"  # WaitResponseType::WAIT_CANCELED
_READY, _NOT_READY = b"\x00", b"\x01"  # CheckResponseType
_RECV = 256 * 1024
_INT64 = (-(2**63), 2**63 - 1)


class Query(IntEnum):
    """torch's ``c10d::detail::QueryType`` (torch 2.14), one byte on the wire."""

    VALIDATE = 0
    SET = 1
    COMPARE_SET = 2
    GET = 3
    ADD = 4
    CHECK = 5
    WAIT = 6
    GETNUMKEYS = 7
    DELETE_KEY = 8
    APPEND = 9
    MULTI_GET = 10
    MULTI_SET = 11
    CANCEL_WAIT = 12
    PING = 13
    QUEUE_PUSH = 14
    QUEUE_POP = 15
    QUEUE_LEN = 16
    LIST_KEYS = 17
    BARRIER = 18


@dataclass(frozen=True)
class StoreLimits:
    """The bounds of one store (see the module's docstring for why these numbers)."""

    max_key: int = 8 * 1024
    max_value: int = 1024 * 1024
    max_request: int = 4 * 1024 * 1024
    max_keys: int = 100_000
    max_bytes: int = 64 * 1024 * 1024
    max_buffered: int = 64 * 1024 * 1024
    max_connections: int = 4096
    validate_timeout_s: float = 10.0


class Refused(Exception):
    """A request over a bound, or malformed: its connection is closed."""


class _Incomplete(Exception):
    def __init__(self, need: int) -> None:
        self.need = need


@dataclass(eq=False)
class Conn:
    """One client connection's state (used only on the server's thread)."""

    sock: socket.socket
    peer: str
    opened: float
    inbuf: bytearray = field(default_factory=bytearray)
    out: bytearray = field(default_factory=bytearray)
    need: int = 1
    validated: bool = False
    closed: bool = False
    awaiting: set[bytes] = field(default_factory=set)


class _Reader:
    """Reads one request from the start of a connection's buffer, checking each length
    prefix against the bounds before its bytes are waited for."""

    def __init__(self, buf: bytearray, limits: StoreLimits) -> None:
        self._buf = buf
        self._limits = limits
        self.pos = 0

    def _take(self, n: int) -> bytes:
        end = self.pos + n
        if end > self._limits.max_request:
            raise Refused(f"a request of more than {self._limits.max_request} bytes")
        if end > len(self._buf):
            raise _Incomplete(end)
        data = bytes(self._buf[self.pos : end])
        self.pos = end
        return data

    def u8(self) -> int:
        return self._take(1)[0]

    def u32(self) -> int:
        return int(struct.unpack("<I", self._take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack("<Q", self._take(8))[0])

    def i64(self) -> int:
        return int(struct.unpack("<q", self._take(8))[0])

    def key(self) -> bytes:
        n = self.u64()
        if n > self._limits.max_key:
            raise Refused(f"a key of {n} bytes (at most {self._limits.max_key})")
        return self._take(n)

    def value(self) -> bytes:
        n = self.u64()
        if n > self._limits.max_value:
            raise Refused(f"a value of {n} bytes (at most {self._limits.max_value})")
        return self._take(n)

    def count(self) -> int:
        n = self.u64()
        if n > self._limits.max_keys:
            raise Refused(f"a request naming {n} keys (at most {self._limits.max_keys})")
        return n

    def keys(self) -> list[bytes]:
        return [self.key() for _ in range(self.count())]


def parse(r: _Reader) -> tuple[Query, tuple[object, ...]]:
    """One request: its type and arguments, as torch's client sends them."""
    code = r.u8()
    try:
        q = Query(code)
    except ValueError:
        raise Refused(f"an unknown request type {code}") from None
    if q in (Query.VALIDATE, Query.PING):
        return q, (r.u32(),)
    if q in (Query.SET, Query.APPEND, Query.QUEUE_PUSH):
        return q, (r.key(), r.value())
    if q == Query.COMPARE_SET:
        return q, (r.key(), r.value(), r.value())
    if q in (Query.GET, Query.DELETE_KEY, Query.QUEUE_POP, Query.QUEUE_LEN):
        return q, (r.key(),)
    if q in (Query.ADD, Query.BARRIER):
        return q, (r.key(), r.i64())
    if q in (Query.CHECK, Query.WAIT, Query.MULTI_GET):
        return q, (r.keys(),)
    if q == Query.MULTI_SET:
        return q, ([(r.key(), r.value()) for _ in range(r.count())],)
    return q, ()  # GETNUMKEYS, CANCEL_WAIT, LIST_KEYS


def vec(data: bytes) -> bytes:
    """torch's ``sendVector``/``sendString``: a 64-bit length, then the bytes."""
    return struct.pack("<Q", len(data)) + data


def i64(value: int) -> bytes:
    return struct.pack("<q", value)


def stoll(key: bytes, value: bytes) -> int:
    """The integer a value holds, read as torch's ``std::stoll`` reads it."""
    digits = value.lstrip(b" \t\n\r\f\v")
    sign = digits[:1] if digits[:1] in (b"+", b"-") else b""
    end = len(sign)
    while end < len(digits) and end < 24 and digits[end : end + 1].isdigit():
        end += 1
    if end == len(sign):
        raise Refused(f"an add to key {key[:64]!r}, whose value is not an integer")
    number = int(digits[:end])
    if not _INT64[0] <= number <= _INT64[1]:
        raise Refused(f"an add to key {key[:64]!r}, whose value is out of range")
    return number


class Data:
    """The stored keys, queues and waiting clients, with the byte and key bounds."""

    def __init__(self, limits: StoreLimits, notify: Callable[[Conn, bytes], None]) -> None:
        self._limits = limits
        self._notify = notify
        self.kv: dict[bytes, bytes] = {}
        self.queues: dict[bytes, deque[bytes]] = {}
        self.waiters: dict[bytes, list[Conn]] = {}
        self.nbytes = 0
        self.nkeys = 0  # stored keys plus queued values

    def _charge(self, delta_bytes: int, delta_keys: int) -> None:
        if self.nkeys + delta_keys > self._limits.max_keys:
            raise Refused(f"a write over the store's {self._limits.max_keys} keys")
        if self.nbytes + delta_bytes > self._limits.max_bytes:
            raise Refused(f"a write over the store's {self._limits.max_bytes} bytes")
        self.nbytes += delta_bytes
        self.nkeys += delta_keys

    def _put(self, key: bytes, value: bytes) -> None:
        old = self.kv.get(key)
        if old is None:
            self._charge(len(key) + len(value) + ENTRY_OVERHEAD, 1)
        else:
            self._charge(len(value) - len(old), 0)
        self.kv[key] = value

    def present(self, key: bytes) -> bool:
        return key in self.kv or bool(self.queues.get(key))

    def set(self, key: bytes, value: bytes) -> None:
        self._put(key, value)
        self.wake_all(key)

    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        current = self.kv.get(key)
        if current is None and expected:
            result = expected  # torch "lies" to the caller here too
        elif current is None or current == expected:
            self._put(key, desired)
            result = desired
        else:
            result = current
        self.wake_all(key)
        return result

    def add(self, key: bytes, delta: int) -> int:
        old = self.kv.get(key)
        total = delta + (stoll(key, old) if old is not None else 0)
        if not _INT64[0] <= total <= _INT64[1]:
            raise Refused(f"an add to key {key[:64]!r} past a 64-bit integer")
        self._put(key, str(total).encode())
        self.wake_all(key)
        return total

    def append(self, key: bytes, value: bytes) -> None:
        new = self.kv.get(key, b"") + value
        if len(new) > self._limits.max_value:
            raise Refused(f"an append making key {key[:64]!r} over {self._limits.max_value} bytes")
        self._put(key, new)
        self.wake_all(key)

    def delete(self, key: bytes) -> int:
        old = self.kv.pop(key, None)
        if old is None:
            return 0
        self.nbytes -= len(key) + len(old) + ENTRY_OVERHEAD
        self.nkeys -= 1
        return 1

    def queue_push(self, key: bytes, value: bytes) -> None:
        self._charge(len(key) + len(value) + ENTRY_OVERHEAD, 1)
        self.queues.setdefault(key, deque()).append(value)
        self.wake_one(key)

    def queue_pop(self, key: bytes) -> bytes:
        queue = self.queues.get(key)
        if not queue:
            return i64(0)
        answer = i64(len(queue))
        value = queue.popleft()
        self.nbytes -= len(key) + len(value) + ENTRY_OVERHEAD
        self.nkeys -= 1
        if not queue:
            del self.queues[key]
        return answer + vec(value)

    def barrier(self, conn: Conn, key: bytes, world_size: int) -> bool:
        old = self.kv.get(key)
        count = (stoll(key, old) if old is not None else 0) + 1
        self._put(key, str(count).encode())
        if count >= world_size:
            self.wake_all(key)
            return True
        self.cancel(conn)
        conn.awaiting = {key}
        self.waiters.setdefault(key, []).append(conn)
        return False

    def wait(self, conn: Conn, keys: list[bytes]) -> bool:
        """Whether every key is there now; else ``conn`` waits for the missing ones."""
        if all(self.present(k) for k in keys):
            return True
        self.cancel(conn)
        conn.awaiting = {k for k in keys if k not in self.kv}
        for k in conn.awaiting:
            self.waiters.setdefault(k, []).append(conn)
        return False

    def cancel(self, conn: Conn) -> None:
        for k in conn.awaiting:
            waiting = self.waiters.get(k)
            if waiting is not None and conn in waiting:
                waiting.remove(conn)
                if not waiting:
                    del self.waiters[k]
        conn.awaiting = set()

    def wake_all(self, key: bytes) -> None:
        for conn in self.waiters.pop(key, []):
            conn.awaiting.discard(key)
            if not conn.awaiting:
                self._notify(conn, _STOP_WAITING)

    def wake_one(self, key: bytes) -> None:
        waiting = self.waiters.get(key, [])
        while waiting:
            conn = waiting.pop(0)
            conn.awaiting.discard(key)
            if not conn.awaiting:
                self._notify(conn, _STOP_WAITING)
                break
        if not waiting:
            self.waiters.pop(key, None)


def answer(data: Data, conn: Conn, q: Query, args: tuple[object, ...]) -> bytes:
    """Carry out one request; the bytes to send back (possibly none)."""
    a: tuple[Any, ...] = args  # parse() gives each request type its arguments
    if q == Query.PING:
        return struct.pack("<I", a[0])
    if q == Query.SET:
        data.set(a[0], a[1])
    elif q == Query.COMPARE_SET:
        return vec(data.compare_set(a[0], a[1], a[2]))
    elif q == Query.GET:
        return vec(data.kv.get(a[0], b""))
    elif q == Query.ADD:
        return i64(data.add(a[0], a[1]))
    elif q == Query.CHECK:
        return _READY if all(data.present(k) for k in a[0]) else _NOT_READY
    elif q == Query.WAIT:
        return _STOP_WAITING if data.wait(conn, a[0]) else b""
    elif q == Query.GETNUMKEYS:
        return i64(len(data.kv))
    elif q == Query.DELETE_KEY:
        return i64(data.delete(a[0]))
    elif q == Query.APPEND:
        data.append(a[0], a[1])
    elif q == Query.MULTI_GET:
        return b"".join(vec(data.kv.get(k, b"")) for k in a[0])
    elif q == Query.MULTI_SET:
        for key, value in a[0]:
            data.set(key, value)
    elif q == Query.CANCEL_WAIT:
        data.cancel(conn)
        return _WAIT_CANCELED
    elif q == Query.QUEUE_PUSH:
        data.queue_push(a[0], a[1])
    elif q == Query.QUEUE_POP:
        return data.queue_pop(a[0])
    elif q == Query.QUEUE_LEN:
        return i64(len(data.queues.get(a[0], ())))
    elif q == Query.LIST_KEYS:
        return i64(len(data.kv)) + b"".join(vec(k) for k in data.kv)
    elif q == Query.BARRIER:
        return _STOP_WAITING if data.barrier(conn, a[0], a[1]) else b""
    return b""


def connection_cap(requested: int) -> int:
    """``requested``, but at most a quarter of this process's descriptor limit, whose soft
    limit is first raised towards four times ``requested`` as far as the hard limit allows
    (a common soft limit of 1,024 would otherwise cap the store at 256 connections, one per
    worker, where torch's server takes about 1,000)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return requested
    want = 4 * requested if hard == resource.RLIM_INFINITY else min(hard, 4 * requested)
    if want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as exc:
            logger.debug("Could not raise the descriptor limit to %d: %s", want, exc)
    return max(16, min(requested, soft // 4))


class BoundedStore:
    """A TCPStore server with bounds on ``sock`` (a listening socket it now owns), serving
    from a thread of its own until :meth:`close`."""

    def __init__(self, sock: socket.socket, limits: StoreLimits | None = None) -> None:
        self.limits = limits or StoreLimits()
        self._max_connections = connection_cap(self.limits.max_connections)
        self._listener = sock
        self._listener.setblocking(False)
        self.port = int(sock.getsockname()[1])
        self.data = Data(self.limits, self._send)
        self.buffered = 0
        self._conns: dict[int, Conn] = {}
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._stopping = False
        self._last_warning = 0.0
        self._unsaid = 0
        self._thread = threading.Thread(
            target=self._run, name="elastic-bootstrap-store", daemon=True
        )
        self._thread.start()

    @property
    def connections(self) -> int:
        return len(self._conns)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        """Stop serving and close every connection and the listening socket."""
        if self._stopping:
            return
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(10)
        for conn in list(self._conns.values()):
            self._drop(conn)
        self._selector.close()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()

    # -- the loop (the server's thread only) --

    def _run(self) -> None:
        while not self._stopping:
            try:
                events = self._selector.select(timeout=1.0)
                for key, mask in events:
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        continue
                    else:
                        self._serve(key.data, mask)
                self._expire()
            except Exception:  # one bad event must not end the store for everyone
                logger.exception("The bootstrap store hit an unexpected error; it keeps serving.")

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. out of descriptors: the backlog waits
                self._warn("could not accept a connection (%s)", exc)
                return
            peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
            if len(self._conns) >= self._max_connections:
                sock.close()
                self._warn(
                    "refused a connection from %s: %d connections are open already",
                    peer,
                    len(self._conns),
                )
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = Conn(sock, peer, time.monotonic())
            self._conns[sock.fileno()] = conn
            self._selector.register(sock, selectors.EVENT_READ, conn)

    def _serve(self, conn: Conn, mask: int) -> None:
        try:
            if mask & selectors.EVENT_WRITE:
                self._flush(conn)
                self._process(conn)  # requests held back while the answers were unread
            if mask & selectors.EVENT_READ and not conn.closed:
                self._read(conn)
        except Refused as exc:
            self._warn("closed the connection from %s: %s", conn.peer, exc)
            self._drop(conn)
        except OSError:
            self._drop(conn)

    def _read(self, conn: Conn) -> None:
        chunk = conn.sock.recv(_RECV)
        if not chunk:
            self._drop(conn)
            return
        if self.buffered + len(chunk) > self.limits.max_buffered:
            raise Refused(f"over the {self.limits.max_buffered} bytes held for all connections")
        conn.inbuf += chunk
        self.buffered += len(chunk)
        self._process(conn)

    def _process(self, conn: Conn) -> None:
        """Carry out every whole request buffered, while the client reads its answers."""
        while (
            not conn.closed
            and len(conn.inbuf) >= conn.need
            and len(conn.out) < self.limits.max_value
        ):
            reader = _Reader(conn.inbuf, self.limits)
            try:
                q, args = parse(reader)
            except _Incomplete as inc:
                conn.need = inc.need
                break
            del conn.inbuf[: reader.pos]
            self.buffered -= reader.pos
            conn.need = 1
            if not conn.validated:
                if q != Query.VALIDATE or args[0] != VALIDATION_MAGIC:
                    raise Refused("its first request is not torch's validation")
                conn.validated = True
                continue
            if q == Query.VALIDATE:
                continue
            out = answer(self.data, conn, q, args)
            if out:
                self._send(conn, out)
        self._update(conn)

    def _send(self, conn: Conn, data: bytes) -> None:
        if conn.closed:
            return
        if self.buffered + len(data) > self.limits.max_buffered:
            self._warn(
                "closed the connection from %s: its answer would hold over %d bytes",
                conn.peer,
                self.limits.max_buffered,
            )
            self._drop(conn)
            return
        conn.out += data
        self.buffered += len(data)
        self._flush(conn)
        self._update(conn)

    def _flush(self, conn: Conn) -> None:
        if conn.out and not conn.closed:
            try:
                sent = conn.sock.send(conn.out[:_RECV])
            except (BlockingIOError, InterruptedError):
                sent = 0
            del conn.out[:sent]
            self.buffered -= sent

    def _update(self, conn: Conn) -> None:
        if conn.closed:
            return
        events = selectors.EVENT_WRITE if conn.out else 0
        if len(conn.out) < self.limits.max_value:
            events |= selectors.EVENT_READ
        self._selector.modify(conn.sock, events or selectors.EVENT_WRITE, conn)

    def _expire(self) -> None:
        deadline = time.monotonic() - self.limits.validate_timeout_s
        for conn in [c for c in self._conns.values() if not c.validated and c.opened < deadline]:
            self._drop(conn)

    def _drop(self, conn: Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        self.data.cancel(conn)
        self.buffered -= len(conn.inbuf) + len(conn.out)
        conn.inbuf = bytearray()
        conn.out = bytearray()
        self._conns.pop(conn.sock.fileno(), None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        conn.sock.close()

    def _warn(self, msg: str, *args: object) -> None:
        """One warning, at most one a second; how many were left unsaid goes with the next."""
        now = time.monotonic()
        if now - self._last_warning < 1.0:
            self._unsaid += 1
            return
        self._last_warning = now
        unsaid, self._unsaid = self._unsaid, 0
        logger.warning(
            "The bootstrap store " + msg + " (%d similar warnings in the last second unsaid).",
            *args,
            unsaid,
        )


__all__ = [
    "ENTRY_OVERHEAD",
    "VALIDATION_MAGIC",
    "BoundedStore",
    "Conn",
    "Data",
    "Query",
    "Refused",
    "StoreLimits",
    "answer",
    "connection_cap",
    "parse",
]


def main(argv: list[str] | None = None) -> None:
    """``python boundstore.py FD [LIMIT=VALUE ...]``: serve on the
    inherited listening socket FD (with :class:`StoreLimits` fields overridden) until this
    process's parent ends. The tests run the store this way, as a process of its own, so
    that torch's clients in the test process cannot hold the GIL it needs: some of their
    calls, ``list_keys`` among them, do not release it."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    overrides = {k: float(v) if "." in v else int(v) for k, v in (a.split("=") for a in args[1:])}
    parent = os.getppid()
    store = BoundedStore(socket.socket(fileno=int(args[0])), StoreLimits(**overrides))  # type: ignore[arg-type]
    while os.getppid() == parent and store.running:
        time.sleep(0.1)
    store.close()


if __name__ == "__main__":
    main()
