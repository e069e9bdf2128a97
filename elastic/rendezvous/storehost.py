"""The round's bootstrap store in a process of its own: torch's TCPStore server, capped.

torch's TCPStore server has no authentication and no bound on what a client stores or
asks for (one 1 MiB value named 2,000 times in one ``multi_get`` builds a 2 GB answer).
Hosted in the agent, a stranger on the network could kill the agent; hosted here, in a
child process whose data segment may grow by at most :data:`MEMORY_CAP_MIB` past what
importing torch takes (``RLIMIT_DATA``), the worst it can do is end this process: the
round's workers lose their store, the round fails and the next one forms with a fresh
host. The agent lives.

Start latency. A fresh Python importing torch takes 1-2 s of CPU, so the agent keeps one
host *standing by* (:class:`Standby`): started ahead, torch imported, waiting on a Unix
socket. When the agent becomes rank 0 it hands the held listening socket over
(``SCM_RIGHTS``) and the host answers with ``ready`` as soon as torch's server (libuv)
listens on it: a few milliseconds. When the round ends the agent says ``end``: the host
drops that round's server (its keys and clients) and stands by again for the agent's next
round, so a round costs no new import. A host started at every round imported torch
beside the joiner's own start on a 2-core machine and made a join's first step 0.5 s
later. Only a host that ended (a stranger's flood past its cap) is replaced: the next one
starts when the agent next needs one.

The host dies with the agent (``PR_SET_PDEATHSIG``) and when the agent closes its end of
the socket (the node is done).

Run as ``python -m elastic.rendezvous.storehost FD`` (FD: its end of the socket pair).
"""

from __future__ import annotations

import logging
import resource
import signal
import socket
import subprocess
import sys
import threading
from datetime import timedelta

logger = logging.getLogger(__name__)

# What the host's data segment may grow by past what importing torch takes. A round's
# workers keep a few small keys each in it (addresses, ready marks: under 1 KiB per rank;
# gloo's full mesh of 1,000 ranks stays under 10 MiB); 256 MiB is room for that many times
# over, and small next to an agent's container (768 MiB in the red team's test).
MEMORY_CAP_MIB = 256
START_TIMEOUT_S = 60.0  # a host importing torch on a loaded machine
SERVE_TIMEOUT_S = 10.0  # from handing the socket over to torch's server listening on it
_MSG = 64
_FRAME = 8  # an agent's message: "serve" (with the socket) or "end"


class HostError(OSError):
    """The store's host could not start or serve (the caller's worker then hosts the store)."""


class Standby:
    """One host process: started now, serving when :meth:`serve` hands it a socket."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", __name__, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                close_fds=True,
            )
        finally:
            theirs.close()
        self._sock = ours
        self.pid = self._proc.pid
        self._loaded = False  # torch imported (its "loaded" came)

    def alive(self) -> bool:
        return self._proc.poll() is None

    def serve(self, listener: socket.socket, timeout: float = START_TIMEOUT_S) -> None:
        """Hand ``listener`` to the host and wait until torch's server listens on it.

        Raises:
            HostError: the host died, did not answer in time, or torch's server failed.
        """
        self._sock.settimeout(timeout)
        try:
            if not self._loaded:
                loaded = self._sock.recv(_MSG)  # the host sends this once torch is imported
                if loaded != b"loaded":
                    raise HostError(f"The store's host (pid {self.pid}) ended before it was ready.")
                self._loaded = True
            socket.send_fds(self._sock, [_frame(b"serve")], [listener.fileno()])
            self._sock.settimeout(SERVE_TIMEOUT_S)
            answer = self._sock.recv(_MSG)
        except OSError as exc:
            self.close()
            raise HostError(f"The store's host (pid {self.pid}) did not answer: {exc}") from exc
        if answer != b"ready":
            self.close()
            raise HostError(
                f"The store's host (pid {self.pid}) could not serve: "
                f"{answer.decode(errors='replace') or 'it ended'}."
            )
        self._sock.settimeout(None)

    def end(self) -> bool:
        """End the round this host serves (its server, keys and clients go); it stands by
        for the next. False when the host is gone (a flood past its cap ended it)."""
        if not self.alive():
            return False
        try:
            self._sock.sendall(_frame(b"end"))
        except OSError:
            return False
        return True

    def close(self, wait: bool = True) -> None:
        """End the host (and the store it serves); idempotent. ``wait=False`` reaps it in
        the background (a host of 300 MiB takes tens of milliseconds to end)."""
        self._sock.close()
        if self._proc.poll() is None:
            self._proc.kill()
        if wait:
            self._reap()
        else:
            threading.Thread(target=self._reap, name="elastic-storehost-reap", daemon=True).start()

    def _reap(self) -> None:
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            logger.warning("The store's host (pid %d) did not end within 10 s.", self.pid)


class Hosts:
    """An agent's store host: standing by, or serving its round (then given back)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._standby: Standby | None = None
        self._starting: threading.Thread | None = None
        self._serving: Standby | None = None

    def prepare(self) -> None:
        """Start a standby host in the background unless one is there, starting or
        serving (it stands by again when its round ends)."""
        with self._lock:
            if self._standby is not None or self._starting is not None or self._serving:
                return
            self._starting = threading.Thread(
                target=self._start, name="elastic-storehost", daemon=True
            )
            self._starting.start()

    def _start(self) -> None:
        try:
            standby: Standby | None = Standby()
        except OSError as exc:
            logger.warning("Could not start a host for the bootstrap store: %s", exc)
            standby = None
        with self._lock:
            self._standby, self._starting = standby, None

    def take(self) -> Standby:
        """The standby host (started now if none was); it serves until :meth:`give_back`."""
        self.prepare()
        with self._lock:
            starting = self._starting
        if starting is not None:
            starting.join()
        with self._lock:
            standby, self._standby = self._standby, None
        if standby is None or not standby.alive():
            if standby is not None:
                standby.close()
            standby = Standby()
        with self._lock:
            self._serving = standby
        return standby

    def give_back(self, host: Standby, wait: bool = True) -> None:
        """The round ``host`` served is over: it stands by for the next one, or, when it
        ended (a flood past its cap), is reaped (``wait=False``: in the background)."""
        with self._lock:
            if self._serving is host:
                self._serving = None
            keep = self._standby is None and host.end()
            if keep:
                self._standby = host
        if not keep:
            host.close(wait)

    def close(self) -> None:
        with self._lock:
            starting = self._starting
        if starting is not None:
            starting.join()
        with self._lock:
            standby, self._standby = self._standby, None
            serving, self._serving = self._serving, None
        for host in (standby, serving):
            if host is not None:
                host.close()


# -- the host process ------------------------------------------------------------------


def _vm_data() -> int:
    """This process's data segment (``VmData``) in bytes."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/self/status has no VmData line.")


def cap_memory(extra_mib: int = MEMORY_CAP_MIB) -> int:
    """Let this process's data segment grow by ``extra_mib`` MiB at most; the new limit."""
    limit = _vm_data() + extra_mib * 1024 * 1024
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    return limit


def _frame(word: bytes) -> bytes:
    """An agent's message to its host: one word in :data:`_FRAME` bytes, so that an
    ``end`` and the next ``serve`` never read as one."""
    return word.ljust(_FRAME, b"\0")


def main(fd: int) -> int:
    from elastic.node.procs import die_with_parent

    die_with_parent(signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C in the terminal is the agent's
    sock = socket.socket(fileno=fd)
    from torch.distributed import TCPStore

    cap_memory()
    sock.sendall(b"loaded")
    serving: list[TCPStore] = []  # the round's server (at most one)
    while True:  # one round at a time, until the agent closes its end (or dies)
        try:
            msg, fds, _, _ = socket.recv_fds(sock, _FRAME, 1)
        except OSError:
            return 0
        word = msg.rstrip(b"\0")
        if word == b"end":
            serving.clear()  # the round's server goes, with its keys and clients
            continue
        if word != b"serve" or len(fds) != 1:
            return 0  # the agent closed its end: the node is done
        listener = socket.socket(fileno=fds[0])
        host, port = listener.getsockname()[:2]
        serving.clear()
        try:
            server = TCPStore(
                host,
                port,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(minutes=5),
                master_listen_fd=listener.fileno(),
                use_libuv=True,
            )
        except (RuntimeError, OSError) as exc:
            sock.sendall(f"error: {exc}"[:_MSG].encode())
            return 1
        serving.append(server)
        del server  # the list holds the one reference: "end" drops the server
        listener.detach()  # torch's server owns it now
        sock.sendall(b"ready")


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
