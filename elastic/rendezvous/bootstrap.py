"""The round's bootstrap store: the TCPStore that a round's workers form their process
group through, hosted by rank 0's agent.

Without it, rank 0's *worker* hosts that store, and a worker of another rank that asks
before it listens is refused and backs off (about half a second in torch 2.14), added to
every re-form in which a non-zero rank's worker starts first. Here rank 0's agent starts
the store as soon as it learns its rank, before any worker starts, and the other agents
wait (briefly) until it accepts connections before starting theirs; the workers of every
rank are then its clients (torch elastic's ``TORCHELASTIC_USE_AGENT_STORE``). A new round
gets a new store, so no key of an earlier round's process group is ever read again.

The port is bound when the node announces it (:meth:`BootstrapStore.reserve`: a socket on
port 0, kept listening) and that same socket is handed to the store if the node becomes rank
0, so no other process can take the port between the announcement and the round (a port
merely found free and closed again was lost that way once in torch's agent tests). If rank
0's agent still cannot host it, its worker hosts the store as before; the other ranks are
clients either way.

Who can reach it. The agent binds the listening socket itself, to the address the node
announced (``--local-addr``, else its FQDN): the store is reachable only through that
address, not through the node's other interfaces. torch's TCPStore server has no
authentication and no bound on what a client stores or asks for, so the agent does not host
it in its own process: :mod:`elastic.rendezvous.storehost` runs torch's server (libuv) in a
child process whose memory is capped, handed the held socket. Anyone who can reach that
address can read and write keys while the round runs, and at worst end that process (the
round fails and the next one forms); the agent lives. Keep the nodes' network to the job (a
firewall or network policy), as for torch's own stores.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import time

from elastic.rendezvous.storehost import Hosts, Standby

logger = logging.getLogger(__name__)

WAIT_S = 2.0  # how long a non-zero rank's agent waits for rank 0's store to listen
_POLL_S = 0.005


class BootstrapStore:
    """One agent's part in the bootstrap store of its current round."""

    def __init__(self) -> None:
        self._hosts = Hosts()
        self._server: Standby | None = None
        self._reserved: socket.socket | None = None

    @property
    def hosting(self) -> bool:
        """Whether this agent hosts the current round's store."""
        return self._server is not None

    @property
    def host_pid(self) -> int | None:
        """The pid of the process serving the current round's store, if this agent hosts it."""
        return None if self._server is None else self._server.pid

    def reserve(self, addr: str) -> int:
        """Bind a port for the store on ``addr`` now and hold it: the port to announce.

        The socket listens from now on (a client that connects early waits in its backlog)
        and becomes the store's if this node is rank 0 of its round (:meth:`start_round`).
        If ``addr`` cannot be bound, a port found free on every interface, not held.
        """
        self._release()
        self._hosts.prepare()  # a host imports torch ahead, in case this node is rank 0
        try:
            self._reserved = listen_on(addr, 0)
        except OSError as exc:
            logger.warning(
                "Could not bind a bootstrap store port on %s (%s); announcing a free port "
                "without holding it.",
                addr,
                exc,
            )
            with _everywhere(0) as sock:
                return int(sock.getsockname()[1])
        return int(self._reserved.getsockname()[1])

    def start_round(self, rank: int, addr: str, port: int) -> None:
        """Host the store at ``port`` (rank 0), or wait until rank 0's agent does."""
        reserved, self._reserved = self._reserved, None
        self._end_round(wait=False)  # the last round's host ends while this one starts
        if reserved is not None and (rank != 0 or reserved.getsockname()[1] != port):
            reserved.close()
            reserved = None
        if rank == 0:
            self._server = _host(self._hosts, addr, port, reserved)
        else:
            wait_listening(addr, port, WAIT_S)

    def close(self) -> None:
        """Stop hosting, release a held port and end the host standing by (the node is done)."""
        self._end_round()
        self._hosts.close()

    def _end_round(self, wait: bool = True) -> None:
        """Stop hosting (the round's workers are gone) and release a held port."""
        server, self._server = self._server, None
        if server is not None:
            self._hosts.give_back(server, wait)
        self._release()

    def _release(self) -> None:
        if self._reserved is not None:
            self._reserved.close()
            self._reserved = None


def listen_on(addr: str, port: int) -> socket.socket:
    """A socket listening on ``addr:port`` only (the first address ``addr`` resolves to).

    A host name that resolves to loopback here but is no loopback name (Debian maps the
    host's own name to 127.0.1.1 in /etc/hosts, while the other nodes reach it through
    DNS) would shut them out: then every interface, with a warning to set --local-addr.

    Raises:
        OSError: ``addr`` does not resolve, or the port is taken.
    """
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    if ipaddress.ip_address(sockaddr[0]).is_loopback and not _loopback_name(addr):
        logger.warning(
            "The node's address %s resolves to %s here; the bootstrap store listens on every "
            "interface. Start the agent with --local-addr set to an address the other nodes "
            "reach to keep it off the others.",
            addr,
            sockaddr[0],
        )
        return _everywhere(port)
    return socket.create_server(sockaddr, family=family, backlog=socket.SOMAXCONN)


def _everywhere(port: int) -> socket.socket:
    """A socket listening on ``port`` of every interface (dual-stack where possible)."""
    if socket.has_dualstack_ipv6():
        return socket.create_server(
            ("::", port), family=socket.AF_INET6, backlog=socket.SOMAXCONN, dualstack_ipv6=True
        )
    return socket.create_server(("", port), backlog=socket.SOMAXCONN)


def _loopback_name(addr: str) -> bool:
    """Whether ``addr`` is itself a loopback address or ``localhost``."""
    if addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def _host(hosts: Hosts, addr: str, port: int, sock: socket.socket | None = None) -> Standby | None:
    """torch's server in a host process (:mod:`elastic.rendezvous.storehost`), serving on
    ``sock`` (the held port), else on a socket bound to ``addr:port`` now."""
    try:
        sock = sock or listen_on(addr, port)
    except OSError as exc:
        logger.warning(
            "Could not listen on %s:%d for the bootstrap store (%s); rank 0's worker hosts it.",
            addr,
            port,
            exc,
        )
        return None
    started = time.monotonic()
    try:
        with sock:  # the host has its own copy once it serves; the agent's closes here
            host = hosts.take()
            host.serve(sock)
    except OSError as exc:  # HostError too
        logger.warning(
            "Could not host the bootstrap store on port %d (%s); rank 0's worker hosts it.",
            port,
            exc,
        )
        return None
    logger.debug(
        "Hosting the bootstrap store on port %d (pid %d, %.3f s).",
        port,
        host.pid,
        time.monotonic() - started,
    )
    return host


def wait_listening(addr: str, port: int, timeout: float) -> bool:
    """Wait until ``addr:port`` accepts a connection; False if it did not in ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((addr, port), timeout=0.2):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                logger.info("Rank 0's bootstrap store %s:%d is not listening yet.", addr, port)
                return False
            time.sleep(_POLL_S)


__all__ = ["WAIT_S", "BootstrapStore", "listen_on", "wait_listening"]
