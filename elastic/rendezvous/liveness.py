"""Certain evidence that a node is dead: its agent's probe port refuses connections.

A rendezvous judges a node dead when its heartbeats (keep-alives) stop for
``keep_alive_interval * keep_alive_max_attempt`` (3 s with our tuned settings):
most of the time from a ``kill -9`` to the next round. That wait is right when
the evidence is uncertain (a cut link, a paused machine: the node may be alive),
but a crashed agent leaves certain evidence: the operating system closes its
sockets. So every agent listens on a small TCP "probe" port on its node address
and publishes the port in etcd. While a node waits in the rendezvous, it
connects to each peer whose heartbeat is late:

* connection refused, on a port that accepted before: nothing listens there any
  more, the agent process is gone, so the node is removed from the state at once;
* accepted: alive, wait as torch does;
* no answer (timeout, unreachable host): unknown, wait for heartbeat expiry.

Only a refusal acts, so a silent partition is never mistaken for a death (a
firewall that actively rejects the port after it once accepted would be).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Collection

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 0.25
_RETRY_UNKNOWN_S = 1.0  # a node that did not answer is probed again after this long
_REMEMBER_ALIVE_S = 0.5  # an accepted probe stands for this long
_MAX_PROBES = 8  # probes per call at most: a sync must not block on many silent peers
_ACCEPT_RETRY_S = 0.05  # after a failed accept (out of file descriptors, say)


def probe(host: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> bool | None:
    """True if something accepts on ``host:port``, False if refused, None if no answer."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except ConnectionRefusedError:
        return False
    except (OSError, UnicodeError, ValueError):  # timeout, unreachable, a bad host name
        return None


class ProbeListener:
    """A listening socket that proves, by existing, that this agent is alive.

    It listens on every interface (IPv6 and IPv4 where the host has both): the node
    address peers use may resolve differently here (a hostname mapped to 127.0.1.1
    in /etc/hosts, several interfaces).
    """

    def __init__(self) -> None:
        self._closed = threading.Event()
        self._sock = _bind_everywhere()
        self._sock.listen(64)
        self._port = int(self._sock.getsockname()[1])
        self._thread = threading.Thread(target=self._serve, name="probe-listener", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self._port

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept; close alone does not
        with contextlib.suppress(OSError):
            self._sock.close()

    def _serve(self) -> None:
        warned = False
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError as exc:
                if self._closed.is_set():
                    return
                # e.g. out of file descriptors: a listener that stopped accepting would
                # make this live node look hung to its peers; keep serving.
                if not warned:
                    logger.warning(
                        "The probe port %d failed to accept (%s); retrying.", self.port, exc
                    )
                    warned = True
                self._closed.wait(_ACCEPT_RETRY_S)
                continue
            conn.close()


def _bind_everywhere() -> socket.socket:
    """A socket bound to port 0 on every interface: dual-stack if possible, else IPv4."""
    with contextlib.suppress(OSError):
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind(("::", 0))
            return sock
        except OSError:
            sock.close()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("", 0))
    return sock


class DeathDetector:
    """Probes peers; answers which are certainly dead.

    A refusal counts as death only from a port this detector has seen accept before
    (:meth:`verify` after each round) and that is still the one the node publishes:
    a port that never answered may be a wrong address or a firewall, not a death,
    and a node restarted under the same name publishes a new port.

    Args:
        ports: returns the published probe port of every node (by node name),
            read from etcd when a node's port is not yet known or was refused.
    """

    def __init__(self, ports: Callable[[], dict[str, int]]) -> None:
        self._ports = ports
        self._known: dict[str, int] = {}
        self._verified: set[tuple[str, int]] = set()  # (node, port) seen accepting
        self._unknown_until: dict[str, float] = {}
        self._alive_until: dict[str, float] = {}

    def verify(self, nodes: list[tuple[str, str]]) -> None:
        """Probe ``(name, host)`` peers once (live ones: a round just formed with them)."""
        if any(name not in self._known for name, _ in nodes):
            self._refresh()
        for name, host in nodes:
            if (name, self._known.get(name)) not in self._verified:
                self._ask(name, host)

    def dead(self, nodes: list[tuple[str, str]], recheck: Collection[str] = ()) -> list[str]:
        """Of ``(name, host)`` pairs, the names whose probe port refused a connection.

        A node named in ``recheck`` is probed again even if it accepted a moment ago: a
        killed agent's port can still accept for some milliseconds (the kernel closes
        its sockets last), just when a waiting peer probes it first.
        """
        answers = self._answers(nodes, recheck)
        return [name for name, answer in answers.items() if answer is False]

    def _answers(
        self, nodes: list[tuple[str, str]], recheck: Collection[str] = ()
    ) -> dict[str, bool | None]:
        now = time.monotonic()
        out: dict[str, bool | None] = {}
        todo = []
        for name, host in nodes:
            if name not in recheck and self._alive_until.get(name, 0.0) > now:
                out[name] = True  # answered a moment ago
            elif self._unknown_until.get(name, 0.0) > now:
                out[name] = None  # did not answer a moment ago: do not block on it again
            else:
                todo.append((name, host))
        if any(n not in self._known for n, _ in todo):
            self._refresh()
        for name, host in todo[:_MAX_PROBES]:
            out[name] = answer = self._ask(name, host)
            if answer is None:
                self._unknown_until[name] = now + _RETRY_UNKNOWN_S
            elif answer:
                self._alive_until[name] = now + _REMEMBER_ALIVE_S
        return out

    def _ask(self, name: str, host: str) -> bool | None:
        port = self._known.get(name)
        answer = None if port is None else probe(host, port)
        if answer is False:  # certain only for the port the node still publishes
            self._refresh()
            if self._known.get(name) != port:
                port = self._known.get(name)
                answer = None if port is None else probe(host, port)
        if answer is True:
            self._verified.add((name, port))  # type: ignore[arg-type]
        elif answer is False and (name, port) not in self._verified:
            answer = None  # never seen accepting: maybe not reachable, not dead
        return answer

    def _refresh(self) -> None:
        try:
            self._known.update(self._ports())
        except Exception as exc:  # etcd unreachable: probe with what is known
            logger.debug("Could not read the probe ports: %s", exc)


__all__ = ["PROBE_TIMEOUT_S", "DeathDetector", "ProbeListener", "probe"]
