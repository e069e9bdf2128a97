"""A real Slurm cluster on this machine for the tests: munged, slurmctld, one slurmd per node.

Each node is a network namespace on a bridge (:class:`elastic_tools.harness.faults.Net`) with its
own address; its slurmd runs inside it under its own node name (``slurmd -N``), with
``NodeAddr`` = that address in a ``slurm.conf`` generated in a temporary directory (the
ports picked free at start; ``SLURM_CONF`` points the clients at it). munged runs with a
fresh key and its own socket, so nothing of the machine's own Slurm or munge is used or
touched. Every daemon is stopped by PID; a node's processes (its slurmd, the slurmstepd of
its steps and what they run) are the processes of its namespace (``ip netns pids``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from elastic.etcd.server import free_port
from elastic.node.procs import alive, kill
from elastic_tools.harness.faults import Net, ip
from tests.helpers import wait_until

DAEMONS = (
    "munged",
    "slurmctld",
    "slurmd",
    "sbatch",
    "srun",
    "scontrol",
    "scancel",
    "squeue",
    "sinfo",
)
KILL_WAIT_S = 30  # Slurm's KillWait: SIGTERM, then SIGKILL this much later
SLURMD_TIMEOUT_S = 10  # a node that does not answer for this long is DOWN
# A step credential's lifetime, which is also how long a requeued job waits (default 120 s).
CRED_EXPIRE_S = 10


def missing_commands() -> list[str]:
    """The Slurm and munge programs that are not installed."""
    found = {name: shutil.which(name) or shutil.which(name, path="/usr/sbin") for name in DAEMONS}
    return [name for name, path in found.items() if path is None]


def _sbin(name: str) -> str:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin") or name


@dataclass
class SlurmNode:
    name: str
    netns: str
    addr: str
    slurmd: subprocess.Popen[bytes] | None = None


@dataclass
class SlurmCluster:
    """munged + slurmctld in the root namespace (on the bridge's address) + N slurmd."""

    root: Path
    net: Net
    size: int
    partition: str = "elastic"
    nodes: list[SlurmNode] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def hosts(self) -> Path:
        return self.root / "hosts"

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of a Slurm client (and of the jobs it submits)."""
        return {**os.environ, "SLURM_CONF": str(self.conf), **(extra or {})}

    # -- life cycle ------------------------------------------------------------------------

    def start(self) -> SlurmCluster:
        self.root.mkdir(parents=True, exist_ok=True)
        for i in range(self.size):
            ns, addr = self.net.add_node()
            self.nodes.append(SlurmNode(f"sn{i}", ns, addr))
        self._start_munged()
        self._write_conf()
        self._write_hosts()
        log = open(self.root / "slurmctld.out", "wb")  # noqa: SIM115 - the daemon keeps it
        self.procs.append(
            subprocess.Popen(
                self._private_hosts(f"exec {_sbin('slurmctld')} -D -i -f {self.conf}"),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env(),
                start_new_session=True,
            )
        )
        for node in self.nodes:
            self.start_slurmd(node)
        try:
            wait_until(
                lambda: all(s.startswith("idle") for s in self.node_states().values()),
                60,
                "every slurmd registered with slurmctld (idle)",
            )
        except AssertionError as exc:
            logs = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in self.logs())
            raise AssertionError(f"{exc}; node states {self.node_states()}\n{logs}") from exc
        return self

    def logs(self) -> list[Path]:
        """The daemons' log files (slurmctld's, each slurmd's, munged's)."""
        return sorted(
            [*self.root.glob("*.log"), *self.root.glob("*.out"), *self.root.glob("munge/*.log")]
        )

    def _start_munged(self) -> None:
        d = self.root / "munge"
        d.mkdir(mode=0o700, exist_ok=True)
        key = d / "munge.key"
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(1024))
        self.munge_socket = d / "munge.socket"
        proc = subprocess.Popen(
            [
                _sbin("munged"),
                "--foreground",
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--pid-file={d / 'munged.pid'}",
                f"--log-file={d / 'munged.log'}",
                f"--seed-file={d / 'munged.seed'}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(d / "munged.err", "wb"),  # noqa: SIM115
            start_new_session=True,
        )
        self.procs.append(proc)
        wait_until(lambda: self.munge_socket.exists() or proc.poll() is not None, 30, "munged")
        if proc.poll() is not None:
            raise RuntimeError(
                f"munged exited with {proc.returncode}: {(d / 'munged.err').read_text()}"
            )

    def _write_conf(self) -> None:
        gw = self.net.gateway
        (self.root / "state").mkdir(exist_ok=True)
        (self.root / "spool").mkdir(exist_ok=True)
        ctl_port = free_port(gw)
        slurmd_port = free_port("")
        lines = [
            "ClusterName=elastictest",
            f"SlurmctldHost={socket.gethostname()}({gw})",
            f"SlurmctldPort={ctl_port}",
            f"SlurmdPort={slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket},cred_expire={CRED_EXPIRE_S}",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool'}/%n",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={self.root / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'slurmd-%n.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SelectType=select/linear",
            "SchedulerType=sched/builtin",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "ReturnToService=2",
            f"SlurmdTimeout={SLURMD_TIMEOUT_S}",
            f"KillWait={KILL_WAIT_S}",
            "JobRequeue=1",
            "MinJobAge=600",
            "InactiveLimit=0",
            "MessageTimeout=10",
        ]
        cpus = os.cpu_count() or 1
        for node in self.nodes:
            lines.append(f"NodeName={node.name} NodeAddr={node.addr} CPUs={cpus} State=UNKNOWN")
        names = ",".join(n.name for n in self.nodes)
        lines.append(
            f"PartitionName={self.partition} Nodes={names} Default=YES MaxTime=INFINITE State=UP"
        )
        self.conf.write_text("\n".join(lines) + "\n")

    def _write_hosts(self) -> None:
        """This machine's /etc/hosts plus every node's name, for the daemons' own view."""
        lines = [Path("/etc/hosts").read_text().rstrip("\n")]
        lines += [f"{node.addr} {node.name}" for node in self.nodes]
        self.hosts.write_text("\n".join(lines) + "\n")

    def _private_hosts(self, script: str, uts: bool = False) -> list[str]:
        """``sh -c script`` in a private mount namespace (and UTS namespace: its own
        hostname) where /etc/hosts names the nodes; exec keeps the daemon's pid."""
        return [
            "unshare",
            "--mount",
            "--propagation=private",
            *(["--uts"] if uts else []),
            "sh",
            "-c",
            f"mount --bind {self.hosts} /etc/hosts && {script}",
        ]

    def start_slurmd(self, node: SlurmNode) -> None:
        (self.root / "spool" / node.name).mkdir(parents=True, exist_ok=True)
        log = open(self.root / f"slurmd-{node.name}.out", "ab")  # noqa: SIM115
        node.slurmd = subprocess.Popen(
            [
                "nsenter",
                f"--net=/run/netns/{node.netns}",
                *self._private_hosts(
                    f"hostname {node.name} && exec {_sbin('slurmd')} -D -N {node.name}", uts=True
                ),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env(),
            start_new_session=True,
        )

    def node_pids(self, node: SlurmNode) -> list[int]:
        """Every process in the node's network namespace: its slurmd, slurmstepds, tasks."""
        out = ip("netns", "pids", node.netns, check=False).stdout
        return [int(p) for p in out.split()]

    def crash(self, node: SlurmNode) -> list[int]:
        """A node failure: kill -9 of every process on it (slurmd, its steps, their tasks)."""
        pids = self.node_pids(node)
        for pid in pids:
            kill(pid, signal.SIGKILL)
        if node.slurmd is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.slurmd.wait(10)
        return pids

    def stop(self) -> list[int]:
        """Kill every process of every node (by PID), then the daemons; return the pids
        still alive in a node's namespace (none, unless a kill failed)."""
        for node in self.nodes:
            self.crash(node)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
        left = [pid for node in self.nodes for pid in self.node_pids(node)]
        wait_gone(left, 10)
        return [pid for pid in left if alive(pid)]

    # -- clients ---------------------------------------------------------------------------

    def run(self, *argv: str, check: bool = True, timeout: float = 30) -> str:
        out = subprocess.run(
            list(argv), capture_output=True, text=True, env=self.env(), timeout=timeout
        )
        if check and out.returncode:
            raise RuntimeError(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr}")
        return out.stdout

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False)
        states = {}
        for line in out.splitlines():
            name, _, state = line.partition(" ")
            states[name] = state.strip()
        return states

    def job_field(self, job: str, key: str) -> str:
        out = self.run("scontrol", "-o", "show", "job", job, check=False)
        for word in out.split():
            k, _, v = word.partition("=")
            if k == key:
                return v
        return ""

    def steps(self, job: str) -> dict[str, str]:
        """Running steps of ``job``: step id (JOB.STEP) -> node list."""
        out = self.run("squeue", "-h", "-s", "-j", job, "-o", "%i %N", check=False)
        return dict(line.split(" ", 1) for line in out.splitlines() if " " in line)


def wait_gone(pids: list[int], timeout: float) -> None:
    """Poll until none of ``pids`` runs, for at most ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
