"""The project's one etcd v3 client: endpoints, fail-over, TLS, auth, timeouts.

Everything that talks to etcd goes through :class:`EtcdClient`. It speaks the
v3 gRPC API through the generated stubs that ship with the ``etcd3`` package
(we use its protobuf messages, not its client class: that one has no
fail-over, no re-authentication and no response headers).

etcd3's generated code predates protobuf 4, which refuses it unless the
pure-Python protobuf implementation is selected *before protobuf is first
imported*. This module selects it on import; if another library loaded
protobuf earlier, the import fails with a sentence that says what to do.

Retry policy. Until a client has reached etcd once, a request fails after
``connect_timeout`` (a wrong address is reported quickly). Once connected, a
request rides out an outage (an etcd restart, a member going down) for up to
``request_timeout``, trying every endpoint in turn with a short backoff.
All requests are safe to retry: writes are either idempotent puts or
compare-and-set transactions.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

from elastic import env
from elastic.errors import ConfigError, EtcdConnectionError

if "google.protobuf" not in sys.modules:
    os.environ.setdefault(env.PROTOBUF_IMPL, "python")

import grpc

try:
    from etcd3 import etcdrpc
except TypeError as exc:  # "Descriptors cannot be created directly."
    raise ImportError(
        "etcd3's protobuf code cannot load because protobuf was imported first with its C "
        f"implementation; set {env.PROTOBUF_IMPL}=python in the environment before starting Python."
    ) from exc

logger = logging.getLogger(__name__)

DEFAULT_PORT = 2379
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
_BACKOFF_S = (0.05, 0.1, 0.2, 0.4, 0.5)
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]

T = TypeVar("T")


@dataclass(frozen=True)
class Endpoint:
    """One etcd member's client address."""

    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_endpoints(spec: str, default_port: int = DEFAULT_PORT) -> tuple[list[Endpoint], bool]:
    """Parse ``host:port[,host:port...]`` or URLs (``https://host:port``).

    Returns:
        The endpoints and whether any URL asked for TLS (``https://``).

    Raises:
        ConfigError: the spec is empty or an item is malformed.
    """
    items = [item.strip() for item in spec.split(",") if item.strip()]
    if not items:
        raise ConfigError("The etcd endpoint list is empty; pass host:port[,host:port...].")
    endpoints, secure = [], False
    for item in items:
        url = urlsplit(item if "://" in item else f"//{item}")
        if url.scheme not in ("", "http", "https") or not url.hostname:
            raise ConfigError(
                f"The etcd endpoint '{item}' is malformed; write it as host:port or "
                "http(s)://host:port."
            )
        try:
            port = url.port or default_port
        except ValueError as exc:
            raise ConfigError(f"The etcd endpoint '{item}' has an invalid port.") from exc
        secure = secure or url.scheme == "https"
        endpoints.append(Endpoint(url.hostname, port))
    return endpoints, secure


@dataclass(frozen=True)
class EtcdOptions:
    """How to reach and log into etcd.

    Args:
        endpoints: client addresses of the cluster members, tried in order.
        tls: use TLS even without a CA file (system roots).
        ca_cert: PEM file of the CA that signed the server certificates.
        cert: PEM client certificate (mutual TLS); needs ``key``.
        key: PEM private key of ``cert``.
        user: etcd user name; needs ``password``.
        password: etcd password.
        connect_timeout: seconds to reach etcd the first time.
        request_timeout: seconds one request may spend riding out an outage.
    """

    endpoints: Sequence[Endpoint]
    tls: bool = False
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    connect_timeout: float = 5.0
    request_timeout: float = 30.0

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ConfigError("At least one etcd endpoint is required.")
        if bool(self.cert) != bool(self.key):
            raise ConfigError("A client certificate and its key must be given together.")
        if bool(self.user) != bool(self.password):
            raise ConfigError("An etcd user and its password must be given together.")
        if self.connect_timeout <= 0 or self.request_timeout <= 0:
            raise ConfigError("The etcd connect and request timeouts must be positive.")
        for path in (self.ca_cert, self.cert, self.key):
            if path and not os.path.isfile(path):
                raise ConfigError(f"The TLS file '{path}' does not exist or is not a file.")

    @property
    def secure(self) -> bool:
        return self.tls or bool(self.ca_cert or self.cert)


class _Connection:
    """A channel to one endpoint, its stubs and its auth token."""

    def __init__(self, endpoint: Endpoint, options: EtcdOptions) -> None:
        self.endpoint = endpoint
        if options.secure:
            creds = grpc.ssl_channel_credentials(
                _read(options.ca_cert), _read(options.key), _read(options.cert)
            )
            self.channel = grpc.secure_channel(str(endpoint), creds, options=_CHANNEL_OPTIONS)
        else:
            self.channel = grpc.insecure_channel(str(endpoint), options=_CHANNEL_OPTIONS)
        self.kv = etcdrpc.KVStub(self.channel)
        self.lease = etcdrpc.LeaseStub(self.channel)
        self.watch = etcdrpc.WatchStub(self.channel)
        self.auth = etcdrpc.AuthStub(self.channel)
        self.metadata: tuple[tuple[str, str], ...] | None = None

    def authenticate(self, user: str, password: str, timeout: float) -> None:
        request = etcdrpc.AuthenticateRequest(name=user, password=password)
        try:
            response = self.auth.Authenticate(request, timeout=timeout)
        except grpc.RpcError as exc:
            if exc.code() in _RETRYABLE:
                raise
            raise EtcdConnectionError(
                f"etcd at {self.endpoint} refused the login of user '{user}' "
                f"({exc.details()}); check the user name and password."
            ) from exc
        self.metadata = (("token", response.token),)

    def close(self) -> None:
        self.channel.close()


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


class EtcdClient:
    """A thread-safe etcd v3 client with fail-over across endpoints.

    Methods return the raw protobuf responses (they carry the header revision
    that compare-and-set and watches need). Transport failures that outlast the
    retry budget raise :class:`~elastic.errors.EtcdConnectionError`, a
    ``RendezvousConnectionError``, naming every endpoint tried.
    """

    def __init__(self, options: EtcdOptions) -> None:
        self.options = options
        self._lock = threading.Lock()
        self._index = 0
        self._conns: dict[int, _Connection] = {}
        self._ever_connected = False
        self.requests = 0  # round trips made, for benchmarks

    # -- plumbing -------------------------------------------------------------

    def _conn(self, index: int) -> _Connection:
        with self._lock:
            conn = self._conns.get(index)
            if conn is None:
                conn = _Connection(self.options.endpoints[index], self.options)
                self._conns[index] = conn
        if self.options.user and conn.metadata is None:
            conn.authenticate(self.options.user, self.options.password or "", self._attempt_s())
        return conn

    def _attempt_s(self) -> float:
        opts = self.options
        return opts.request_timeout if self._ever_connected else opts.connect_timeout

    def call(self, fn: Callable[[_Connection, float], T]) -> T:
        """Run ``fn(conn, timeout)`` against the current endpoint, failing over on outages."""
        budget = self._attempt_s()
        deadline = time.monotonic() + budget
        n = len(self.options.endpoints)
        errors: dict[str, str] = {}
        attempt = 0
        while True:
            index = self._index
            conn = self._conn_or_none(index, errors)
            if conn is not None:
                try:
                    self.requests += 1
                    result = fn(conn, max(0.05, min(budget, deadline - time.monotonic())))
                    self._ever_connected = True
                    return result
                except grpc.RpcError as exc:
                    if not self._recoverable(conn, exc, errors):
                        raise
            self._index = (index + 1) % n
            attempt += 1
            if time.monotonic() >= deadline:
                raise self._unreachable(errors, budget)
            if attempt % n == 0:
                time.sleep(_BACKOFF_S[min(attempt // n, len(_BACKOFF_S)) - 1])

    def _conn_or_none(self, index: int, errors: dict[str, str]) -> _Connection | None:
        try:
            return self._conn(index)
        except grpc.RpcError as exc:
            errors[str(self.options.endpoints[index])] = _describe(exc)
            return None

    def _recoverable(self, conn: _Connection, exc: grpc.RpcError, errors: dict[str, str]) -> bool:
        code = exc.code()
        if code in _RETRYABLE or _is_deadline(exc):
            errors[str(conn.endpoint)] = _describe(exc)
            logger.debug("etcd %s failed (%s); trying the next endpoint", conn.endpoint, code)
            return True
        if self.options.user and "auth token" in (exc.details() or ""):
            logger.info(
                "etcd %s: the auth token was rejected (expired?); logging in again.", conn.endpoint
            )
            conn.metadata = None
            return True
        return False

    def _unreachable(self, errors: dict[str, str], budget: float) -> EtcdConnectionError:
        tried = "; ".join(f"{ep}: {why}" for ep, why in errors.items()) or "no attempt finished"
        return EtcdConnectionError(
            f"Could not reach etcd at {_names(self.options.endpoints)} within {budget:g} s "
            f"({tried}); check that etcd is running and the endpoint list is right."
        )

    # -- KV -------------------------------------------------------------------

    def range(self, key: bytes, prefix: bool = False, count_only: bool = False) -> Any:
        """Read one key, or every key under ``key`` when ``prefix``."""
        request = etcdrpc.RangeRequest(
            key=key, range_end=_prefix_end(key) if prefix else b"", count_only=count_only
        )
        return self.call(lambda c, t: c.kv.Range(request, timeout=t, metadata=c.metadata))

    def put(self, key: bytes, value: bytes, lease: int = 0) -> Any:
        request = etcdrpc.PutRequest(key=key, value=value, lease=lease)
        return self.call(lambda c, t: c.kv.Put(request, timeout=t, metadata=c.metadata))

    def delete(self, key: bytes, prefix: bool = False) -> Any:
        request = etcdrpc.DeleteRangeRequest(key=key, range_end=_prefix_end(key) if prefix else b"")
        return self.call(lambda c, t: c.kv.DeleteRange(request, timeout=t, metadata=c.metadata))

    def txn(self, compare: list[Any], success: list[Any], failure: list[Any]) -> Any:
        """One atomic transaction; build its parts with the helpers below."""
        request = etcdrpc.TxnRequest(compare=compare, success=success, failure=failure)
        return self.call(lambda c, t: c.kv.Txn(request, timeout=t, metadata=c.metadata))

    # -- leases ---------------------------------------------------------------

    def grant(self, ttl: int) -> int:
        request = etcdrpc.LeaseGrantRequest(TTL=ttl)
        response = self.call(
            lambda c, t: c.lease.LeaseGrant(request, timeout=t, metadata=c.metadata)
        )
        return response.ID

    def keepalive(self, lease_id: int) -> int:
        """Refresh a lease once; returns its new TTL (0 when it has expired)."""

        def once(c: _Connection, t: float) -> int:
            stream = c.lease.LeaseKeepAlive(
                iter([etcdrpc.LeaseKeepAliveRequest(ID=lease_id)]), timeout=t, metadata=c.metadata
            )
            try:
                return next(stream).TTL
            finally:
                stream.cancel()

        return self.call(once)

    def revoke(self, lease_id: int) -> None:
        request = etcdrpc.LeaseRevokeRequest(ID=lease_id)
        try:
            self.call(lambda c, t: c.lease.LeaseRevoke(request, timeout=t, metadata=c.metadata))
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise

    # -- watches --------------------------------------------------------------

    def wait_for_event(
        self, key: bytes, start_revision: int, timeout: float, prefix: bool = False
    ) -> bool:
        """Block until ``key`` (or a key under it) changes at or after ``start_revision``.

        Returns:
            True when a change was seen (or the history was compacted, so the
            caller must re-read), False when ``timeout`` passed first.
        """
        deadline = time.monotonic() + timeout
        create = etcdrpc.WatchCreateRequest(
            key=key, range_end=_prefix_end(key) if prefix else b"", start_revision=start_revision
        )
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                return self.call(lambda c, _t, left=remaining: _watch_once(c, create, left))
            except EtcdConnectionError:
                if time.monotonic() >= deadline:
                    return False
                raise

    def close(self) -> None:
        with self._lock:
            for conn in self._conns.values():
                conn.close()
            self._conns.clear()

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _watch_once(conn: _Connection, create: Any, timeout: float) -> bool:
    done = threading.Event()

    def requests() -> Iterator[Any]:
        yield etcdrpc.WatchRequest(create_request=create)
        done.wait()

    stream = conn.watch.Watch(requests(), timeout=timeout, metadata=conn.metadata)
    try:
        for response in stream:
            if response.events or response.compact_revision or response.canceled:
                return True
        return False
    except grpc.RpcError as exc:
        if _is_deadline(exc):
            return False
        raise
    finally:
        done.set()
        stream.cancel()


def _is_deadline(exc: grpc.RpcError) -> bool:
    # etcd reports a propagated client deadline as UNKNOWN "context deadline exceeded".
    return exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED or (
        exc.code() == grpc.StatusCode.UNKNOWN and "deadline exceeded" in (exc.details() or "")
    )


def _prefix_end(key: bytes) -> bytes:
    """The range end that selects every key starting with ``key``."""
    end = bytearray(key)
    for i in reversed(range(len(end))):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"


def _describe(exc: grpc.RpcError) -> str:
    return f"{exc.code().name.lower()}: {exc.details()}"


def _names(endpoints: Sequence[Endpoint]) -> str:
    return ", ".join(str(ep) for ep in endpoints)


# -- transaction building blocks ----------------------------------------------


def compare_mod(key: bytes, revision: int) -> Any:
    """Compare: the key was last modified at ``revision``."""
    return etcdrpc.Compare(
        key=key,
        result=etcdrpc.Compare.EQUAL,
        target=etcdrpc.Compare.MOD,
        mod_revision=revision,
    )


def compare_absent(key: bytes) -> Any:
    """Compare: the key does not exist."""
    return etcdrpc.Compare(
        key=key,
        result=etcdrpc.Compare.EQUAL,
        target=etcdrpc.Compare.CREATE,
        create_revision=0,
    )


def compare_value(key: bytes, value: bytes) -> Any:
    """Compare: the key holds ``value`` (false when the key is absent)."""
    return etcdrpc.Compare(
        key=key, result=etcdrpc.Compare.EQUAL, target=etcdrpc.Compare.VALUE, value=value
    )


def op_put(key: bytes, value: bytes, lease: int = 0) -> Any:
    return etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=key, value=value, lease=lease))


def op_get(key: bytes) -> Any:
    return etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=key))


__all__ = [
    "DEFAULT_PORT",
    "Endpoint",
    "EtcdClient",
    "EtcdOptions",
    "compare_absent",
    "compare_mod",
    "compare_value",
    "op_get",
    "op_put",
    "parse_endpoints",
]
