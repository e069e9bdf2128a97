"""The local job a chaos run faults: its etcd (a 3-member cluster when one starts, else one
member; on a bridge when the nodes live in network namespaces), its agents and their
settings, the job's secret, and the observers that watch it."""

from __future__ import annotations

import logging
import os
import secrets
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic import env
from elastic.etcd.server import EtcdServer, start_cluster, start_etcd
from elastic.node.procs import WORKER_NAME, alive
from elastic.node.procs import name as proc_name
from elastic_tools.chaos.observers import PREFIX, EventTail, StorageObserver, pause
from elastic_tools.chaos.plan import ChaosOptions, choose_kinds, planned_steps
from elastic_tools.harness.cluster import AgentOptions, LocalCluster, Node, agent_env, pythonpath
from elastic_tools.harness.faults import Net

if TYPE_CHECKING:
    from elastic.etcd.client import EtcdClient
    from elastic.rendezvous.options import RendezvousOptions

logger = logging.getLogger(__name__)

# A small learning rate keeps float-summation differences between world sizes from growing
# chaotically (measured: 1.2e-7 after 100 steps at lr 0.005, 9e-3 at tiny.yaml's 0.05).
LR = 0.005


def overrides(opts: ChaosOptions) -> dict[str, Any]:
    """The worker's settings for a chaos job (beside its config file)."""
    return {
        "job.log_every": 10,
        "job.min_step_s": opts.step_s,
        "job.sample_ledger": True,
        "job.seed": opts.seed,
        "optimizer.lr": LR,
        "checkpoint.interval": opts.interval,
        "checkpoint.keep_last": 2,
        "checkpoint.max_failures": 10,
    }


def etcd_client(endpoint: str, request_timeout: float) -> EtcdClient:
    """A client of the job's etcd members (``endpoint``: their comma-separated list)."""
    from elastic.etcd.client import EtcdClient, EtcdOptions, parse_endpoints

    return EtcdClient(EtcdOptions(parse_endpoints(endpoint)[0], request_timeout=request_timeout))


class ChaosJob:
    """The job under test: etcd, the agents (``cluster``), the observers (``tail``,
    ``observer``), and which nodes were killed or must exit 0."""

    endpoint: str
    cluster: LocalCluster
    tail: EventTail
    observer: StorageObserver

    def __init__(self, opts: ChaosOptions) -> None:
        self.opts = opts
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.run_id = f"chaos-{opts.seed}-{stamp}"
        self.run_dir = (opts.runs_dir / self.run_id).resolve()
        self.secret_file = self.run_dir / "secret"
        self.ckpt = self.run_dir / "ckpt"
        self.max_steps = planned_steps(opts)
        self.kinds, self.skipped = choose_kinds(opts)
        self.members: list[EtcdServer] = []
        self.net: Net | None = None
        self.netns_of: dict[str, str] = {}
        self.killed: set[str] = set()
        self.left: set[str] = set()  # sent SIGTERM (a planned leave)
        self.exited_ok_required: set[str] = set()
        self.exits: dict[str, dict[str, Any]] = {}  # node -> when it exited, at which step
        self._names = 0
        self._watching = threading.Event()

    # -- set-up ------------------------------------------------------------------------------

    def write_secret(self) -> None:
        """The run directory, and the job's secret in it (mode 600) unless the run has none
        (``opts.secret`` False)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if not self.opts.secret:
            return
        fd = os.open(self.secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, secrets.token_hex(32).encode())
        os.close(fd)

    def secret(self) -> bytes:
        """The job's secret (empty when the run has none)."""
        from elastic import secret as signing

        if not self.opts.secret:
            return b""
        return signing.job_secret({env.SECRET_FILE: str(self.secret_file)}) or b""

    def start_etcd(self) -> str:
        """Start the job's etcd members; their endpoints (kept as :attr:`endpoint`)."""
        use_netns = self.opts.netns if self.opts.netns is not None else "cut_link" in self.kinds
        if use_netns:
            self.net = Net().up()
        if self.net is not None:
            self._start_bridged(self.net)
        elif self.opts.etcd_members >= 3:
            self._start_cluster()
        if not self.members:
            self.members = [start_etcd(self.run_dir / "etcd" / "single")]
        self.endpoint = ",".join(m.endpoint for m in self.members)
        return self.endpoint

    def _start_bridged(self, net: Net) -> None:
        size = max(1, self.opts.etcd_members)
        try:
            self.members = start_cluster(self.run_dir / "etcd", size, host=net.gateway)
        except BaseException:
            net.close()
            raise

    def _start_cluster(self) -> None:
        """A cluster of ``etcd_members``; none (and no ``etcd_member`` faults) when it fails."""
        try:
            self.members = start_cluster(self.run_dir / "etcd", self.opts.etcd_members)
        except Exception as exc:
            logger.warning(
                "Cannot start a %d-member etcd cluster (%s); using one member.",
                self.opts.etcd_members,
                exc,
            )
            self.kinds = [k for k in self.kinds if k != "etcd_member"]
            self.skipped["etcd_member"] = f"the etcd cluster did not start ({exc})"

    def environ(self) -> dict[str, str]:
        secret = {env.SECRET_FILE: str(self.secret_file)} if self.opts.secret else {}
        return agent_env(PYTHONPATH=pythonpath(), **secret)

    def agent_options(self) -> AgentOptions:
        """Every agent's launcher options."""
        return AgentOptions(nnodes=f"1:{self.opts.max_agents}", join_timeout=120, max_restarts=1000)

    def rendezvous_options(self) -> RendezvousOptions:
        """The agents' rendezvous options (their ``--rdzv-conf`` parsed): the timeouts
        within which they ride out an unreachable or hung etcd."""
        from elastic.rendezvous.options import RendezvousOptions

        conf = dict(item.split("=", 1) for item in self.agent_options().conf().split(",") if item)
        return RendezvousOptions.parse(conf)

    def start_cluster(self) -> None:
        """The agents' driver (no agent yet) and the observers of its event log and storage."""
        opts = self.opts
        self.cluster = LocalCluster(
            self.run_dir,
            self.run_id,
            self.endpoint,
            options=self.agent_options(),
            config=opts.config,
            max_steps=self.max_steps,
            overrides={**overrides(opts), "checkpoint.url": self.ckpt},
            env=self.environ(),
            say=opts.say,
            script=None if opts.script is None else opts.script.command(self.ckpt),
        )
        self.tail = EventTail(self.cluster.event_log)
        self.observer = StorageObserver(self.ckpt, self.run_id, self.endpoint, self.secret())
        threading.Thread(target=self._watch_exits, name="chaos-exits", daemon=True).start()

    def _watch_exits(self) -> None:
        """Record when each agent exited, with its code and the highest step reported by
        then (a rank redoing steps later does not make an earlier exit look early)."""
        while not self._watching.wait(0.1):
            for name, node in list(self.cluster.nodes.items()):
                code = node.proc.poll()
                if code is not None and name not in self.exits:
                    steps = self.tail.of("train.step")
                    self.exits[name] = {
                        "code": code,
                        "ts": time.time(),
                        "step": max((e["step"] for e in steps), default=0),
                    }

    def start_node(self) -> str:
        """Start one more agent (in a namespace of its own under ``netns``); its name."""
        self._names += 1
        name = f"n{self._names}"
        if self.net is None:
            self.cluster.start(name)
        else:
            ns, addr = self.net.add_node()
            self.netns_of[name] = ns
            self.cluster.start(name, netns=ns, addr=addr)
        self.exited_ok_required.add(name)
        return name

    # -- what the job is doing ---------------------------------------------------------------

    def live(self) -> list[Node]:
        """The nodes that run and were neither killed nor told to leave."""
        gone = self.killed | self.left
        return [n for n in self.cluster.running() if n.name not in gone]

    def world(self) -> int | None:
        """The world size expected now (the live agents); None once every agent exited."""
        return len(self.live()) if self.cluster.running() else None

    def steps_root(self) -> Path:
        """Where the job's steps are stored."""
        return self.ckpt / self.run_id

    def workers_of(self, name: str) -> list[int]:
        """The live worker pids of node ``name`` (our worker's, or the user's script's)."""
        if self.opts.script is None:
            return self.cluster.workers_of(name)
        from elastic_tools.chaos.script import script_workers

        return script_workers(self.cluster.nodes[name].pid, self.opts.script.path)

    def rank0_worker(self) -> int | None:
        workers = {p for n in self.live() for p in self.workers_of(n.name)}
        for e in reversed(self.tail.of("train.step")[-5:]):
            pid = int(e["pid"])
            if alive(pid) and (proc_name(pid) == WORKER_NAME or pid in workers):
                return pid
        for node in self.live():
            found = self.workers_of(node.name)
            if found:
                return found[0]
        return None

    def current_round(self) -> int:
        """The fence: the round that may commit now."""
        with etcd_client(self.endpoint, request_timeout=10.0) as client:
            kvs = client.range(f"{PREFIX}/{self.run_id}/fence".encode()).kvs
        return int(kvs[0].value) if kvs else 1

    # -- the end -----------------------------------------------------------------------------

    def wait_end(self) -> dict[str, int | None]:
        """Wait (up to 10 minutes) for every agent to exit; each node's exit code."""
        deadline = time.monotonic() + 600
        while self.cluster.running() and time.monotonic() < deadline:
            pause(0.5)
        return {n.name: n.proc.poll() for n in self.cluster.nodes.values()}

    def close(self) -> list[int]:
        """Stop the observer, every process of the job and etcd, remove the namespaces; the
        workers that outlived their agents."""
        self.observer.stop()
        self._watching.set()
        orphans = self.cluster.close()
        for m in self.members:
            m.stop(signal.SIGKILL)
        if self.net is not None:
            self.net.close()
        return orphans


__all__ = ["LR", "ChaosJob", "etcd_client", "overrides"]
