"""torchft as a baseline of ``bench/recovery.py``: a Lighthouse and one replica group per node.

:class:`TorchftCluster` is a :class:`~elastic_tools.harness.cluster.LocalCluster` whose "nodes" are
``bench/torchft_user.py`` processes (one replica group each, no agent) and whose rendezvous
is torchft's Lighthouse (the ``torchft_lighthouse`` console script) on a free loopback port.
Everything else (the shared event log, the waits, SIGTERM for a leave, ``kill -9`` of a
node, SIGSTOP for a frozen one, killing what it started on :meth:`close`) is the
LocalCluster's, so :func:`~elastic_tools.harness.cluster.membership_scenario` drives it unchanged.

torchft is not a dependency of elastic: :func:`missing` says in one sentence how to install
it when it is absent (:data:`INSTALL`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from elastic.etcd.server import free_port
from elastic.node.procs import kill
from elastic_tools.harness.cluster import LocalCluster, Node, WaitTimeout, poll

SCRIPT = Path(__file__).resolve().with_name("torchft_user.py")
INSTALL = (
    "pip install --no-deps torchft-nightly==2026.10.26 && "
    "pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http"
)
# The Lighthouse tuned like our fast-failover profile (a node is dead after 3 s without a
# heartbeat, 1 s for stragglers to join a round) with a 20 ms tick; and torchft's defaults.
LIGHTHOUSE_TUNED: Mapping[str, int] = {
    "heartbeat_timeout_ms": 3000,
    "join_timeout_ms": 1000,
    "quorum_tick_ms": 20,
}
LIGHTHOUSE_DEFAULTS: Mapping[str, int] = {
    "heartbeat_timeout_ms": 5000,
    "join_timeout_ms": 60000,
    "quorum_tick_ms": 100,
}


def lighthouse_command() -> Path:
    """The ``torchft_lighthouse`` console script beside this interpreter."""
    return Path(sys.executable).with_name("torchft_lighthouse")


def missing() -> str | None:
    """None when torchft and its Lighthouse are installed beside this interpreter; else the
    one sentence that says how to install them."""
    if importlib.util.find_spec("torchft") is not None and lighthouse_command().exists():
        return None
    return (
        "The torchft baseline needs torchft, which elastic does not install: run "
        f"`{INSTALL}` in this environment, then run the bench again."
    )


class TorchftCluster(LocalCluster):
    """A Lighthouse (``lighthouse`` settings, see :data:`LIGHTHOUSE_TUNED`) and named replica
    groups, each one ``bench/torchft_user.py`` process started with ``script_args``; the
    ``n``-th node started is replica group ``n - 1``."""

    def __init__(
        self,
        run_dir: Path,
        run_id: str,
        *,
        lighthouse: Mapping[str, int],
        script_args: Sequence[str],
        env: Mapping[str, str],
        cwd: Path | None = None,
    ) -> None:
        super().__init__(run_dir, run_id, env=env, cwd=cwd, script=[str(SCRIPT), *script_args])
        self.lighthouse_settings = dict(lighthouse)
        self.lighthouse: Node | None = None

    def open(self) -> TorchftCluster:
        """Start the Lighthouse and wait until it listens."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.lighthouse is not None:
            return self
        port = free_port()
        argv = [
            str(lighthouse_command()),
            "--min_replicas=1",
            f"--bind=127.0.0.1:{port}",
            *(f"--{k}={v}" for k, v in self.lighthouse_settings.items()),
        ]
        self.lighthouse = Node("lighthouse", argv, self.run_dir / "lighthouse.log", self._env())
        self.endpoint = f"http://127.0.0.1:{port}"

        def listens() -> bool:
            with socket.socket() as s:
                s.settimeout(0.5)
                return s.connect_ex(("127.0.0.1", port)) == 0

        def exited() -> Exception | None:
            if self.lighthouse is not None and not self.lighthouse.running():
                return WaitTimeout(f"the Lighthouse exited (log in {self.run_dir})")
            return None

        poll(
            listens,
            60,
            0.05,
            timed_out=lambda: WaitTimeout(f"the Lighthouse never listened ({self.run_dir})"),
            stopped=exited,
        )
        return self

    def _env(self) -> dict[str, str]:
        return dict(self.env or {})

    def start(self, name: str, **_: Any) -> Node:
        """Start replica group ``name`` (the LocalCluster's agent options do not apply)."""
        if self.lighthouse is None:
            self.open()
        environ = {
            **self._env(),
            "ELASTIC_EVENT_LOG": str(self.event_log),
            "REPLICA_GROUP_ID": str(len(self.nodes)),
            "TORCHFT_LIGHTHOUSE": self.endpoint,
        }
        argv = [sys.executable, *(self.script or [])]
        node = Node(name, argv, self.run_dir / f"{name}.log", environ, self.cwd)
        self.nodes[name] = node
        return node

    def close(self) -> list[int]:
        """Kill the replica groups (by PID), then the Lighthouse."""
        orphans = super().close()
        if self.lighthouse is not None:
            kill(self.lighthouse.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.lighthouse.wait(10)
        return orphans
