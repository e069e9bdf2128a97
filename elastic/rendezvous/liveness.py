"""Certain evidence that a node is dead: its agent's probe port refuses connections.

torch judges a node dead when its heartbeats in the shared state stop for
``keep_alive_interval * keep_alive_max_attempt`` (3 s with our tuned settings):
most of the time from a ``kill -9`` to the next round. That wait is right when
the evidence is uncertain (a cut link, a paused machine: the node may be alive),
but a crashed agent leaves certain evidence: the operating system closes its
sockets. So every agent listens on a small TCP "probe" port on its node address
and publishes the port in etcd. While a node waits in the rendezvous, it
connects to each peer whose heartbeat is late:

* connection refused: nothing listens there any more, the agent process is gone,
  so the node is removed from the state at once;
* accepted: alive, wait as torch does;
* no answer (timeout, unreachable host): unknown, wait for heartbeat expiry.

Only a refusal acts, so a partition can never be mistaken for a death.

The same evidence guards the other way: a node whose heartbeats are late only
because its machine is overloaded (or etcd's disk is slow) still accepts on its
probe port, so it is kept for up to :data:`SPARE_FACTOR` heartbeat windows
instead of being dropped from a healthy job (seen with 1 s x 3 on a loaded
2-core machine). A node that is hung but still listening (SIGSTOP) is dropped
when that longer window ends.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 0.25
SPARE_FACTOR = 3  # a late node that still accepts is kept for this many heartbeat windows
_RETRY_UNKNOWN_S = 1.0  # a node that did not answer is probed again after this long
_REMEMBER_ALIVE_S = 0.5  # an accepted probe stands for this long


def probe(host: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> bool | None:
    """True if something accepts on ``host:port``, False if refused, None if no answer."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except ConnectionRefusedError:
        return False
    except OSError:
        return None


class ProbeListener:
    """A listening socket that proves, by existing, that this agent is alive."""

    def __init__(self, host: str | None) -> None:
        self._sock = _bind(host)
        self._sock.listen(64)
        self._thread = threading.Thread(target=self._serve, name="probe-listener", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept; close alone does not
        with contextlib.suppress(OSError):
            self._sock.close()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            conn.close()


def _bind(host: str | None) -> socket.socket:
    """Bind port 0 on the node address; on every interface if that address is not local."""
    for candidate in ([host] if host else []) + [""]:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((candidate, 0))
            return sock
        except OSError:
            sock.close()
    raise OSError("could not bind a probe port")


class DeathDetector:
    """Probes peers; answers which are certainly dead and which are certainly listening.

    Args:
        ports: returns the published probe port of every node (by node name),
            read from etcd when a node's port is not yet known.
    """

    def __init__(self, ports: Callable[[], dict[str, int]]) -> None:
        self._ports = ports
        self._known: dict[str, int] = {}
        self._unknown_until: dict[str, float] = {}
        self._alive_until: dict[str, float] = {}

    def dead(self, nodes: list[tuple[str, str]]) -> list[str]:
        """Of ``(name, host)`` pairs, the names whose probe port refused a connection."""
        return [name for name, answer in self._answers(nodes).items() if answer is False]

    def alive(self, nodes: list[tuple[str, str]]) -> list[str]:
        """Of ``(name, host)`` pairs, the names whose probe port accepted a connection."""
        return [name for name, answer in self._answers(nodes).items() if answer is True]

    def _answers(self, nodes: list[tuple[str, str]]) -> dict[str, bool | None]:
        now = time.monotonic()
        out: dict[str, bool | None] = {}
        todo = []
        for name, host in nodes:
            if self._alive_until.get(name, 0.0) > now:
                out[name] = True  # answered a moment ago
            elif self._unknown_until.get(name, 0.0) > now:
                out[name] = None  # did not answer a moment ago: do not block on it again
            else:
                todo.append((name, host))
        if any(n not in self._known for n, _ in todo):
            self._known.update(self._ports())
        for name, host in todo:
            port = self._known.get(name)
            out[name] = answer = None if port is None else probe(host, port)
            if answer is None:
                self._unknown_until[name] = now + _RETRY_UNKNOWN_S
            elif answer:
                self._alive_until[name] = now + _REMEMBER_ALIVE_S
        return out


__all__ = ["PROBE_TIMEOUT_S", "SPARE_FACTOR", "DeathDetector", "ProbeListener", "probe"]
