"""Drive local elastic agents: the one driver of ``elastic demo``, the recovery bench and tests.

:class:`LocalCluster` starts an embedded etcd (or uses a given endpoint), starts named
nodes (one ``elastic-agent`` process each, or plain ``torchrun`` for a baseline), each
with its own log and all writing one shared event log, stops them with SIGTERM or kills
them with ``kill -9``, reads the events, waits for steps and rounds with deadlines, and
on :meth:`LocalCluster.close` kills every process it started, by PID, the agents'
descendants included.

:func:`membership_scenario` is the join / SIGTERM / kill -9 scenario that ``elastic demo``
shows and ``bench/recovery.py`` measures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from elastic import env, events
from elastic.errors import ElasticError
from elastic.etcd.server import EtcdServer, free_port, start_etcd
from elastic.node.procs import WORKER_NAME, alive, descendants, kill, started_at
from elastic.node.procs import name as proc_name

logger = logging.getLogger(__name__)

T = TypeVar("T")
ETCD_V3 = "etcd-v3"
C10D = "c10d"
SCENARIO = "n1+n2 train; n3 joins (->3); n2 SIGTERM (->2); n3 kill -9 (->1)"


def _source_checkout() -> Path | None:
    """The source checkout these packages run from (the directory holding ``elastic/`` has
    ``pyproject.toml``: the tests, the bench scripts, an editable install); None when they
    run from an installed wheel."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() else None


# The one definition of the checkout root, which the bench scripts import too.
REPO: Path | None = _source_checkout()


def pythonpath(environ: Mapping[str, str] | None = None) -> str:
    """``PYTHONPATH`` for a child process that must import the packages this process runs:
    :data:`REPO` first when they run from a source checkout (whatever the child's working
    directory), then ``environ``'s own (default: this process's)."""
    inherited = (os.environ if environ is None else environ).get("PYTHONPATH", "")
    return os.pathsep.join(filter(None, [str(REPO) if REPO else "", inherited]))


class WaitTimeout(ElasticError):
    """Represents a state a driver waited for that never came: the deadline passed, or
    every agent exited first."""


def poll(
    predicate: Callable[[], T | None],
    timeout: float,
    every: float,
    timed_out: Callable[[], Exception],
    stopped: Callable[[], Exception | None] = lambda: None,
) -> T:
    """Call ``predicate`` every ``every`` s until it returns something truthy and return
    that; raise ``timed_out()`` once ``timeout`` s passed, or what ``stopped()`` returns as
    soon as it returns an exception (the state can no longer come)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise timed_out()
        error = stopped()
        if error is not None:
            raise error
        time.sleep(every)


def fast_conf(join_timeout: float, backend: str = ETCD_V3) -> str:
    """The tuned ``--rdzv-conf`` with ``join_timeout``: our ``fast-failover`` profile for
    ``etcd-v3``, the same settings spelled out for torch's own backends."""
    from elastic.rendezvous.options import FAST_FAILOVER, FAST_FAILOVER_CONF

    tuned = f"profile={FAST_FAILOVER}" if backend == ETCD_V3 else FAST_FAILOVER_CONF
    return f"{tuned},join_timeout={join_timeout:g}"


def agent_env(**extra: str) -> dict[str, str]:
    """This process's environment for an agent: unbuffered, one thread, INFO logs."""
    environ = dict(os.environ)
    environ.update(
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        LOGLEVEL=environ.get("LOGLEVEL", "INFO"),
    )
    environ.update(extra)
    return environ


def provenance(repo: Path | None = None) -> dict[str, Any]:
    """What a results file records about its run: the git commit of ``repo`` (default:
    :data:`REPO`; ``dirty`` when tracked files had changes) and the UTC time. The commit
    is ``unknown`` outside a git checkout (an installed wheel)."""
    where = repo or REPO

    def git(*args: str) -> str:
        if where is None:
            return ""
        try:
            out = subprocess.run(
                ["git", *args], cwd=where, capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return out.stdout.strip() if out.returncode == 0 else ""

    return {
        "commit": git("rev-parse", "HEAD") or "unknown",
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


@dataclass(frozen=True)
class AgentOptions:
    """One node's launcher command line (torchrun's options); see :meth:`argv`."""

    nnodes: str = "1:3"
    nproc: int = 1
    backend: str = ETCD_V3
    torchrun: bool = False  # plain ``torchrun`` (a baseline) instead of ``elastic-agent``
    rdzv_conf: str | None = None  # None: fast_conf(join_timeout, backend); "": torch's defaults
    join_timeout: float = 120.0
    max_restarts: int = 3
    monitor_interval: float = 0.3
    addr: str = "127.0.0.1"
    netns: str | None = None  # run inside this network namespace (``ip netns exec``)
    # The launcher's own command (e.g. the ``elastic-agent`` console script); None:
    # ``python -m elastic.agent.launch`` (``python -m torch.distributed.run`` with ``torchrun``).
    command: tuple[str, ...] | None = None

    def conf(self, host: bool | None = None) -> str:
        """``--rdzv-conf``; under c10d ``host`` says whether this node hosts the store."""
        conf = self.rdzv_conf
        if conf is None:
            conf = fast_conf(self.join_timeout, self.backend)
        if host is not None and self.backend == C10D:
            conf = ",".join(filter(None, [conf, f"is_host={str(host).lower()}"]))
        return conf

    def argv(
        self, endpoint: str, run_id: str, worker: Sequence[str], host: bool | None = None
    ) -> list[str]:
        launcher = "torch.distributed.run" if self.torchrun else "elastic.agent.launch"
        command = self.command or (sys.executable, "-m", launcher)
        conf = self.conf(host)
        argv = [
            *command,
            f"--nnodes={self.nnodes}",
            f"--nproc-per-node={self.nproc}",
            f"--rdzv-backend={self.backend}",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_id}",
            *([f"--rdzv-conf={conf}"] if conf else []),
            f"--max-restarts={self.max_restarts}",
            f"--monitor-interval={self.monitor_interval:g}",
            f"--local-addr={self.addr}",
            *worker,
        ]
        if self.netns:
            argv = ["ip", "netns", "exec", self.netns, *argv]
        return argv


class Node:
    """One node: an agent process in its own session, and its log file."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log: Path,
        environ: Mapping[str, str],
        cwd: Path | None = None,
    ) -> None:
        self.name, self.log, self.argv = name, log, argv
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=dict(environ),
                cwd=cwd,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the agent alone, if it still runs."""
        if self.running():
            self.proc.send_signal(sig)


class LocalCluster:
    """The nodes of one local run, its etcd and event log; every process it started dies
    with :meth:`close` (or the end of a ``with`` block).

    Args:
        run_dir: holds the nodes' logs (``NAME.log``), ``events.jsonl``, an embedded
            etcd's data and, by default, the checkpoints (``ckpt``).
        run_id: the rendezvous id (and the worker's ``job.run_id``); a fresh one if None.
        endpoint: a running rendezvous endpoint; when empty :meth:`open` starts an etcd
            (for ``backend="c10d"``: picks a free port for the store the first node hosts).
        options: the agents' command line; :meth:`start` may override fields per node.
        config: the config of ``elastic_tools.training.worker``, the default worker.
        max_steps: the worker's ``job.max_steps``.
        overrides: more ``section.key=value`` arguments of the worker.
        env: the agents' environment (default :func:`agent_env`); the event log is added.
        cwd: the agents' working directory.
        say: where progress lines go (``print`` for a person; nothing by default).
        script: a user's script and its arguments, run instead of our worker.
    """

    def __init__(
        self,
        run_dir: Path,
        run_id: str | None = None,
        endpoint: str = "",
        *,
        options: AgentOptions | None = None,
        config: Path | None = None,
        max_steps: int = 100,
        overrides: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        say: Callable[[str], None] | None = None,
        script: Sequence[str] | None = None,
    ) -> None:
        self.script = list(script) if script is not None else None
        self.run_dir = run_dir
        self.run_id = run_id or f"run-{uuid.uuid4().hex[:10]}"
        self.endpoint = endpoint
        self.options = options or AgentOptions()
        self.config, self.max_steps = config, max_steps
        self.overrides = dict(overrides or {})
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.say = say or (lambda line: None)
        self.event_log = run_dir / "events.jsonl"
        self.etcd: EtcdServer | None = None
        self.nodes: dict[str, Node] = {}

    # -- life cycle -------------------------------------------------------------------------

    def open(self) -> LocalCluster:
        """Make the run dir; start an etcd unless an endpoint was given."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.endpoint:
            return self
        if self.options.backend == C10D:
            self.endpoint = f"127.0.0.1:{free_port()}"
        else:
            self.etcd = start_etcd(self.run_dir / "etcd")
            self.endpoint = self.etcd.endpoint
        return self

    def __enter__(self) -> LocalCluster:
        return self.open()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> list[int]:
        """Kill every agent (SIGKILL, by PID), then whatever they left; stop our etcd.

        Returns the workers (pids of the event log's writers) that outlived their agent.
        """
        # Only a running (unreaped) agent's pid is surely still ours.
        below = [pid for node in self.running() for pid in descendants(node.pid)]
        for node in self.nodes.values():
            node.kill(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.wait(10)
        agents = {node.pid for node in self.nodes.values()}
        firsts = self._first_event_ts()  # one read: writers may still be appending
        orphans = sorted(
            p for p, ts in firsts.items() if p not in agents and self._still_ours(p, ts)
        )
        for pid in [*orphans, *below]:
            kill(pid, signal.SIGKILL)
        if self.etcd is not None:
            self.etcd.stop()
        return orphans

    # -- nodes ----------------------------------------------------------------------------

    def worker_argv(self, overrides: Mapping[str, Any] | None = None) -> list[str]:
        """``-m elastic_tools.training.worker --config CONFIG`` with this run's overrides (or the
        user's ``script``, when the cluster has one)."""
        if self.script is not None:
            return list(self.script)
        if self.config is None:
            raise ValueError("This cluster has no worker config; pass worker= to start().")
        values = {
            "job.run_id": self.run_id,
            "job.max_steps": self.max_steps,
            "checkpoint.url": self.run_dir / "ckpt",
            **self.overrides,
            **(overrides or {}),
        }
        return [
            "-m",
            "elastic_tools.training.worker",
            "--config",
            str(self.config),
            *(f"{k}={v}" for k, v in values.items()),
        ]

    def start(
        self,
        name: str,
        *,
        worker: Sequence[str] | None = None,
        overrides: Mapping[str, Any] | None = None,
        endpoint: str | None = None,
        run_id: str | None = None,
        host: bool | None = None,
        extra_env: Mapping[str, str] | None = None,
        event_log: bool = True,
        **options: Any,
    ) -> Node:
        """Start node ``name``: an agent running ``worker`` (default: the training worker
        with ``overrides``). ``options`` replace fields of :class:`AgentOptions`; ``host``
        says under c10d whether this node hosts the store; ``event_log`` False leaves
        ``ELASTIC_EVENT_LOG`` out of the agent's environment (it then keeps its workers'
        events in a private log of its own, which :meth:`events` does not see)."""
        opts = dataclasses.replace(self.options, **options) if options else self.options
        if endpoint is None:
            endpoint = self.endpoint or self.open().endpoint
        self.run_dir.mkdir(parents=True, exist_ok=True)
        argv = opts.argv(
            endpoint,
            run_id or self.run_id,
            self.worker_argv(overrides) if worker is None else worker,
            host,
        )
        environ = {
            **(self.env if self.env is not None else agent_env()),
            env.EVENT_LOG: str(self.event_log),
            **(extra_env or {}),
        }
        if not event_log:
            environ.pop(env.EVENT_LOG)
        if opts.netns:
            environ["GLOO_SOCKET_IFNAME"] = "eth0"
        node = Node(name, argv, self.run_dir / f"{name}.log", environ, self.cwd)
        self.nodes[name] = node
        logger.info("Started node %s (pid %d).", name, node.pid)
        self.say(f"  started {name} (pid {node.pid})")
        return node

    def leave(self, name: str) -> None:
        """SIGTERM to node ``name``'s agent: a planned leave."""
        self.nodes[name].kill(signal.SIGTERM)

    def kill_node(self, name: str) -> None:
        """kill -9 of a whole node: its agent and every process below it (workers run in
        their own sessions, so a process group would miss them)."""
        node = self.nodes[name]
        if not node.running():  # reaped: its pid may be another process's by now
            return
        for pid in [node.pid, *descendants(node.pid)]:
            kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            node.wait(30)

    def running(self) -> list[Node]:
        return [node for node in self.nodes.values() if node.running()]

    def workers_of(self, name: str) -> list[int]:
        """The live worker pids under node ``name``'s agent (however deep they sit)."""
        return [p for p in descendants(self.nodes[name].pid) if proc_name(p) == WORKER_NAME]

    def worker_pids(self) -> set[int]:
        """Every pid that wrote to the event log, the agents' own excepted."""
        agents = {node.pid for node in self.nodes.values()}
        return {e["pid"] for e in self.events() if "pid" in e} - agents

    def _first_event_ts(self) -> dict[int, float]:
        """Each writer's first event time, by pid (one read of the event log)."""
        firsts: dict[int, float] = {}
        for e in self.events():
            if "pid" in e:
                firsts[e["pid"]] = min(e["ts"], firsts.get(e["pid"], e["ts"]))
        return firsts

    @staticmethod
    def _still_ours(pid: int, first_ts: float) -> bool:
        """Whether ``pid`` still runs the process that wrote events under it from
        ``first_ts`` on: a process started after that got the pid by reuse (pids wrap around
        on a busy machine) and is someone else's."""
        if not alive(pid):
            return False
        started = started_at(pid)
        return started is None or started <= first_ts + 0.05

    def logs(self, tail: int = 4000) -> str:
        return "\n".join(f"--- {n}\n{node.output()[-tail:]}" for n, node in self.nodes.items())

    # -- events ---------------------------------------------------------------------------

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        return events.read(self.event_log, kind)

    def steps(self) -> list[dict[str, Any]]:
        return self.events("train.step")

    def last_step(self) -> int:
        steps = self.steps()  # the newest step, not the highest: a rollback goes back
        return steps[-1]["step"] if steps else 0

    def worlds_after(self, ts: float) -> list[int]:
        return [e["world_size"] for e in self.steps() if e["ts"] > ts]

    def first_step_after(self, ts: float, world: int) -> dict[str, Any] | None:
        later = (e for e in self.steps() if e["ts"] > ts and e["world_size"] == world)
        return next(later, None)

    def first_round_after(self, ts: float, world: int) -> dict[str, Any] | None:
        rounds = self.events("rdzv.round")
        return next((e for e in rounds if e["ts"] > ts and e["world_size"] == world), None)

    # -- waiting --------------------------------------------------------------------------

    def wait_for(
        self,
        predicate: Callable[[], T | None],
        what: str,
        timeout: float,
        every: float = 0.2,
        while_running: bool = True,
    ) -> T:
        """Poll ``predicate`` until it returns something truthy and return that; raise
        :class:`WaitTimeout` after ``timeout`` s or, with ``while_running``, once every
        agent has exited."""

        def exited() -> Exception | None:
            if while_running and self.nodes and not self.running():
                return WaitTimeout(
                    f"every agent exited while waiting for {what} (logs in {self.run_dir})"
                )
            return None

        return poll(
            predicate,
            timeout,
            every,
            timed_out=lambda: WaitTimeout(
                f"timed out after {timeout:.0f} s waiting for {what} (logs in {self.run_dir})"
            ),
            stopped=exited,
        )

    def wait_for_step(self, step: int, timeout: float) -> int:
        """Wait until the newest step is ``step`` or later; return it."""
        self.wait_for(lambda: self.last_step() >= step, f"step {step}", timeout)
        return self.last_step()

    def train_more(self, steps: int, timeout: float) -> int:
        """Wait for ``steps`` more steps than the newest one now."""
        return self.wait_for_step(self.last_step() + steps, timeout)

    def wait_for_world(self, world: int, after: float, timeout: float) -> dict[str, Any]:
        """The first step at world size ``world`` completed after time ``after``."""
        return self.wait_for(
            lambda: self.first_step_after(after, world), f"a step at world size {world}", timeout
        )

    def wait_for_round(self, world: int, after: float, timeout: float) -> dict[str, Any]:
        """The first rendezvous round of ``world`` nodes completed after time ``after``."""
        return self.wait_for(
            lambda: self.first_round_after(after, world), f"a round of {world} nodes", timeout
        )

    def wait_for_store(self, timeout: float = 120.0) -> None:
        """Wait until the c10d store (hosted by the first node) accepts connections."""
        host, port = self.endpoint.rsplit(":", 1)

        def listens() -> bool:
            with socket.socket() as s:
                s.settimeout(0.5)
                return s.connect_ex((host, int(port))) == 0

        self.wait_for(listens, "the c10d store", timeout, every=0.1)


def measure(
    cluster: LocalCluster,
    kind: str,
    node: str,
    world: int,
    act: Callable[[], object],
    timeout: float,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Do one membership change (``act``) and wait for the first step at ``world``.

    Returns the figures and that first step (None when it never came). The figures:
    ``kind``, ``node``, ``world``, ``t`` (unix time just before ``act``), ``step_before``
    (the newest step then) and ``recover_s`` (from ``t`` to the first step), ``first_step``,
    ``steps_lost`` (steps redone after resuming from an older checkpoint) and ``pause_s``
    (how long training stood still before that step); ``recover_s`` None and ``error``
    when the step did not come within ``timeout`` s.
    """
    before = cluster.last_step()
    t0 = time.time()
    cluster.say(f"  {kind} {node} at step {before}")
    act()
    entry: dict[str, Any] = {
        "kind": kind,
        "node": node,
        "world": world,
        "t": round(t0, 3),
        "step_before": before,
    }
    try:
        first = cluster.wait_for_world(world, t0, timeout)
    except WaitTimeout as exc:
        entry.update(recover_s=None, steps_lost=None, error=str(exc))
        return entry, None
    earlier = [e["ts"] for e in cluster.steps() if e["ts"] < first["ts"]]
    entry.update(
        recover_s=round(first["ts"] - t0, 2),
        first_step=first["step"],
        steps_lost=max(0, before - (first["step"] - 1)),
    )
    if earlier:
        entry["pause_s"] = round(first["ts"] - max(earlier), 2)
    return entry, first


def start_pair(
    cluster: LocalCluster, names: Sequence[str] = ("n1", "n2"), steps: int = 8, timeout: float = 120
) -> None:
    """Start two nodes, the first alone first (under c10d it hosts the store and the second
    starts once the store listens); wait until they train at world size 2, then ``steps``
    steps more."""
    first, second = names
    cluster.start(first, host=True)
    if cluster.options.backend == C10D:
        cluster.wait_for_store(timeout)
    cluster.start(second, host=False)
    cluster.wait_for_world(2, 0.0, max(timeout, 300))
    cluster.train_more(steps, timeout)


def membership_scenario(
    cluster: LocalCluster,
    names: Sequence[str] = ("n1", "n2", "n3"),
    steps_between: int = 8,
    steps_after: int | None = None,
    timeout: float = 120.0,
    annotate: Callable[[dict[str, Any], dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Two nodes train; the third joins (world 3); the second leaves by SIGTERM (2); the
    third is killed with ``kill -9`` (1). The first is never touched: under c10d it hosts
    the store.

    Between changes the job trains ``steps_between`` steps (``steps_after`` after the last,
    the same by default). Returns :func:`measure`'s figures of each change, ``annotate``d
    with the first step at the new size; stops at the first change that does not recover
    within ``timeout`` s.
    """
    first, second, third = names
    start_pair(cluster, (first, second), steps_between, timeout)
    plan: list[tuple[str, str, int, Callable[[], object]]] = [
        ("join", third, 3, lambda: cluster.start(third, host=False)),
        ("leave", second, 2, lambda: cluster.leave(second)),
        ("kill", third, 1, lambda: cluster.kill_node(third)),
    ]
    done: list[dict[str, Any]] = []
    for i, (kind, node, world, act) in enumerate(plan):
        entry, first_step = measure(cluster, kind, node, world, act, timeout)
        if first_step is not None and annotate is not None:
            annotate(entry, first_step)
        done.append(entry)
        if first_step is None:
            break
        last = i == len(plan) - 1
        more = steps_between if not last or steps_after is None else steps_after
        if more:
            cluster.train_more(more, timeout)
    return done


__all__ = [
    "C10D",
    "ETCD_V3",
    "REPO",
    "SCENARIO",
    "AgentOptions",
    "LocalCluster",
    "Node",
    "WaitTimeout",
    "agent_env",
    "fast_conf",
    "measure",
    "membership_scenario",
    "provenance",
    "pythonpath",
    "start_pair",
]
