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
_RETRY_UNKNOWN_S = 1.0  # a node that did not answer is probed again after this long


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
    """Probes late peers; answers which of them are certainly dead.

    Args:
        ports: returns the published probe port of every node (by node name),
            read from etcd when a node's port is not yet known.
    """

    def __init__(self, ports: Callable[[], dict[str, int]]) -> None:
        self._ports = ports
        self._known: dict[str, int] = {}
        self._unknown_until: dict[str, float] = {}

    def dead(self, nodes: list[tuple[str, str]]) -> list[str]:
        """Of ``(name, host)`` pairs, the names whose probe port refused a connection."""
        now = time.monotonic()
        candidates = [(n, h) for n, h in nodes if self._unknown_until.get(n, 0.0) <= now]
        if any(n not in self._known for n, _ in candidates):
            self._known.update(self._ports())
        dead = []
        for name, host in candidates:
            port = self._known.get(name)
            answer = None if port is None else probe(host, port)
            if answer is False:
                dead.append(name)
            elif answer is None:
                self._unknown_until[name] = now + _RETRY_UNKNOWN_S
        return dead


__all__ = ["PROBE_TIMEOUT_S", "DeathDetector", "ProbeListener", "probe"]
