"""``elastic chaos``: a seeded random schedule of faults against a local elastic job, then
the checks that no state was lost or corrupted.

A job of 3-4 ``elastic-agent`` nodes trains our CNN worker (``configs/tiny.yaml`` at a small
learning rate, fenced and signed checkpoints every few steps) on a 3-member etcd cluster
(one embedded etcd when a cluster cannot start). While it trains, :func:`run_chaos` injects
faults drawn from :data:`KINDS` by a seeded generator, waits for each to recover, and keeps
two observers running: one polls the checkpoint storage and etcd's commit records (every
committed step seen, and whether the newest complete step still exists), the other is the
event log. After the job ends it checks the invariants (see :func:`check_invariants`) and
writes ``report.json`` into the run directory.

Faults that need a moment to be hit (a kill during a save, between the fence and the
marker, during a purge) are aimed by observation: the injector watches the storage or etcd
and kills rank 0's worker the moment the state is seen. When that moment does not come
within the fault's deadline the kill still happens and the fault counts as ``attempted``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic import env, events
from elastic.checkpoint.layout import COMMIT_MARKER, inspect_step, marker_digest
from elastic.configs import config_path
from elastic.errors import ElasticError
from elastic.etcd.server import EtcdServer, start_cluster, start_etcd
from elastic.harness.cluster import (
    AgentOptions,
    LocalCluster,
    Node,
    agent_env,
    provenance,
    pythonpath,
)
from elastic.harness.faults import Net
from elastic.procs import WORKER_NAME, alive, descendants, kill
from elastic.procs import name as proc_name

logger = logging.getLogger(__name__)

TINY = config_path("tiny")  # shipped as package data: found from a wheel install too
PREFIX = "/elastic"
# A small learning rate keeps float-summation differences between world sizes from growing
# chaotically (measured: 1.2e-7 after 100 steps at lr 0.005, 9e-3 at tiny.yaml's 0.05).
LR = 0.005
# Largest relative L2 difference allowed between any tensor of a faulted job's final model
# and the fault-free world-1 run's. Measured: the reordered float sums of world sizes 1-3
# leave 3e-5..1.1e-4 after 60-100 steps at LR; one step more or less at mid-training changes
# some tensor by 5e-2. The threshold sits a decade from both.
MODEL_RTOL = 1e-3

# Largest relative difference between a kept step's loss and the fault-free run's. Measured:
# the float drift between world sizes reaches 5e-5 after 240 steps; redoing or skipping one
# step mid-training moves the loss by ~1e-2.
LOSS_RTOL = 1e-3

KINDS: Mapping[str, str] = {
    "kill_agent": "kill -9 of a whole node (agent and worker)",
    "kill_worker": "kill -9 of one node's worker (its agent restarts it)",
    "kill_in_save": "kill -9 of rank 0 while a save-<nonce> directory has no marker yet",
    "kill_after_fence": "kill -9 of rank 0 once a commit record is in etcd, before its marker",
    "kill_in_purge": "kill -9 of rank 0 while it deletes an old step",
    "leave": "SIGTERM of an agent (a planned leave)",
    "join": "a new agent joins",
    "stop_cont": "SIGSTOP of an agent for a few seconds, then SIGCONT",
    "etcd_restart": "every etcd member killed with kill -9, restarted a few seconds later",
    "etcd_member": "one member of the 3-member etcd cluster killed, restarted later",
    "storage_ro": "the checkpoint directory read-only for a few seconds",
    "stale_writer": "a process holding an old round's fence tries to commit and purge",
    "cut_link": "a node's network link cut (needs network namespaces)",
}
REMOVES = {"kill_agent", "leave"}
AIMED = {"kill_in_save", "kill_after_fence", "kill_in_purge"}


# -- results shared with the tests ----------------------------------------------------------


def model_differences(final: Mapping[str, Any], reference: Mapping[str, Any]) -> dict[str, float]:
    """The relative L2 difference of every floating tensor (``inf`` for a mismatch of keys or
    of an integer tensor)."""
    if final.keys() != reference.keys():
        return {"<parameter names>": math.inf}
    out: dict[str, float] = {}
    for key, ref in reference.items():
        if not ref.is_floating_point():
            out[key] = 0.0 if bool((final[key] == ref).all()) else math.inf
            continue
        out[key] = float((final[key] - ref).norm() / ref.norm().clamp_min(1e-12))
    return out


def kept_samples(samples: Iterable[Mapping[str, Any]]) -> dict[int, list[int]]:
    """Step -> the sample indices of the trajectory that survived (``train.samples`` events).

    A redone step replaces the old attempt: for each step the newest event's world size
    wins and, per rank, the newest event of that world size.
    """
    per_step: dict[int, list[Mapping[str, Any]]] = {}
    for e in samples:
        per_step.setdefault(int(e["step"]), []).append(e)
    kept: dict[int, list[int]] = {}
    for step, found in per_step.items():
        world = found[-1]["world_size"]
        ranks: dict[int, list[int]] = {}
        for e in reversed(found):
            if e["world_size"] == world and e["rank"] not in ranks:
                ranks[e["rank"]] = list(e["indices"])
        kept[step] = [i for r in sorted(ranks) for i in ranks[r]]
    return kept


def sample_problems(kept: Mapping[int, list[int]], steps_per_epoch: int, batch: int) -> list[str]:
    """What is wrong with the kept samples: a sample used twice within an epoch, a step
    without its full batch, or a complete epoch that missed samples."""
    problems = []
    epochs: dict[int, list[int]] = {}
    for step, indices in sorted(kept.items()):
        if len(indices) != batch:
            problems.append(f"step {step} trained on {len(indices)} samples, not {batch}")
        epochs.setdefault((step - 1) // steps_per_epoch, []).extend(indices)
    for epoch, used in sorted(epochs.items()):
        if len(used) != len(set(used)):
            problems.append(f"epoch {epoch} used {len(used) - len(set(used))} samples twice")
        full = sum(1 for s in kept if (s - 1) // steps_per_epoch == epoch) == steps_per_epoch
        if full and len(set(used)) != steps_per_epoch * batch:
            problems.append(f"epoch {epoch} used {len(set(used))} distinct samples")
    return problems


# -- the event log, read incrementally -------------------------------------------------------


class EventTail:
    """The event log by kind, read from where the last read stopped (the log grows to
    megabytes) through :class:`elastic.events.Tail`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tail = events.Tail(path)
        self._lock = threading.Lock()
        self.by_kind: dict[str, list[dict[str, Any]]] = {}

    def poll(self) -> None:
        with self._lock:
            new = self._tail.read()
            if self._tail.restarted:
                self.by_kind = {}
            for event in new:
                self.by_kind.setdefault(event.get("kind", ""), []).append(event)

    def of(self, kind: str) -> list[dict[str, Any]]:
        self.poll()
        return self.by_kind.get(kind, [])


# -- observing storage and etcd ---------------------------------------------------------------


@dataclass
class Observations:
    """What the storage observer saw."""

    markers: dict[int, set[str]] = field(default_factory=dict)  # step -> complete digests seen
    first_seen: dict[int, float] = field(default_factory=dict)  # step -> first seen complete
    records: dict[int, dict[str, dict[str, Any]]] = field(default_factory=dict)  # step->digest->
    newest_checks: int = 0
    violations: list[str] = field(default_factory=list)
    polls: int = 0


class StorageObserver(threading.Thread):
    """Polls the run's checkpoint directory and etcd commit records until stopped.

    Records every complete marker (by digest) and every commit record seen, and checks at
    every poll that the newest complete step seen so far still exists, complete, unless a
    newer complete step has replaced it as the newest.
    """

    def __init__(
        self, ckpt: Path, run_id: str, endpoint: str, secret: bytes, every: float = 0.1
    ) -> None:
        super().__init__(name="chaos-storage-observer", daemon=True)
        self.ckpt, self.run_id, self.secret, self.every = ckpt, run_id, secret, every
        self.endpoint = endpoint
        self.seen = Observations()
        self._stop_event = threading.Event()
        self._newest: int | None = None
        self._marker_stat: dict[int, tuple[int, int]] = {}

    def stop(self) -> None:
        self._stop_event.set()
        self.join(30)

    def run(self) -> None:
        from elastic.etcd.client import EtcdClient, EtcdOptions, parse_endpoints

        options = EtcdOptions(
            parse_endpoints(self.endpoint)[0], connect_timeout=1.0, request_timeout=1.0
        )
        client = EtcdClient(options)
        try:
            while not self._stop_event.wait(self.every):
                self.poll(client)
        finally:
            with contextlib.suppress(Exception):
                client.close()

    def _complete(self, step: int) -> str | None:
        """The digest of ``step``'s marker when the step is complete now, else None."""
        for _ in range(2):  # a marker replaced between reading it and its files: look again
            info = inspect_step(str(self.ckpt), self.run_id, step, "size", self.secret)
            if info.complete:
                return info.digest
        return None

    def poll(self, client: Any) -> None:
        self.seen.polls += 1
        root = self.ckpt / self.run_id
        try:
            names = os.listdir(root)
        except FileNotFoundError:
            names = []
        for name in names:
            if not name.startswith("step-"):
                continue
            step = int(name[5:])
            try:
                st = os.stat(root / name / COMMIT_MARKER)
            except OSError:
                continue
            stamp = (st.st_ino, st.st_mtime_ns)
            if self._marker_stat.get(step) == stamp:
                continue
            digest = self._complete(step)
            if digest is None:
                continue
            self._marker_stat[step] = stamp
            self.seen.markers.setdefault(step, set()).add(digest)
            self.seen.first_seen.setdefault(step, time.time())
            if self._newest is None or step > self._newest:
                self._newest = step
        if self._newest is not None:
            self.seen.newest_checks += 1
            if self._complete(self._newest) is None:
                newer = [s for s in self._marker_stat if s > self._newest]
                if not any(self._complete(s) for s in newer):
                    self.seen.violations.append(
                        f"the newest complete step {self._newest} vanished at {time.time():.3f}"
                        " with no newer complete step"
                    )
                self._marker_stat.pop(self._newest, None)
                self._newest = max(self._marker_stat, default=None)
        self._records(client)

    def _records(self, client: Any) -> None:
        prefix = f"{PREFIX}/{self.run_id}/commits/step-".encode()
        try:
            kvs = client.range(prefix, prefix=True).kvs
        except Exception:  # etcd down (a fault of the schedule): look again next poll
            return
        for kv in kvs:
            try:
                step, record = int(kv.key[len(prefix) :]), json.loads(kv.value)
            except ValueError:
                continue
            digests = self.seen.records.setdefault(step, {})
            digests.setdefault(str(record.get("digest")), {**record, "seen": time.time()})


# -- the stale writer (runs as its own process) ------------------------------------------------


def stale_writer(spec_json: str, url: str, run_id: str, step: int) -> dict[str, Any]:
    """With an old round's fence: save ``step``, commit it directly, purge, forget records.

    Returns what happened: ``refused`` per attempt, ``passed_checks`` (fence checks that let
    a deletion go ahead: must be 0) and ``removed`` (steps it deleted: must be empty).
    """
    import torch

    from elastic import secret as signing
    from elastic.checkpoint import layout
    from elastic.checkpoint.manager import CheckpointManager
    from elastic.errors import CheckpointError
    from elastic.rendezvous.fence import FenceSpec, RoundFence
    from elastic.training.config import CheckpointConfig

    spec = FenceSpec(**json.loads(spec_json))
    fence = RoundFence(spec)
    out: dict[str, Any] = {"round": spec.round, "refused": {}, "passed_checks": 0, "removed": []}
    removed: list[str] = out["removed"]
    real_remove = layout.remove_step

    def counting_remove(target: str) -> None:
        removed.append(target)
        real_remove(target)

    layout.remove_step = counting_remove  # type: ignore[assignment]

    def counted_check() -> None:
        fence.check()
        out["passed_checks"] += 1

    cfg = CheckpointConfig(url=url, keep_last=1, async_save=False, max_failures=10)
    manager = CheckpointManager(cfg, run_id, commit_fence=fence, secret=signing.job_secret())
    result = manager.save(step, {"model": {"w": torch.zeros(4)}}, block=True)
    out["refused"]["save"] = bool(result is not None and not result.ok)
    out["save_error"] = result.error if result is not None else "no outcome"
    for what, attempt in (
        ("commit", lambda: fence.commit(step, {"run": run_id, "digest": "stale"})),
        ("purge", lambda: layout.purge(url, run_id, 1, check=counted_check)),
        ("forget", lambda: fence.forget([step])),
    ):
        try:
            done = attempt()
        except CheckpointError as exc:
            out["refused"][what] = True
            out[f"{what}_error"] = str(exc)
            continue
        except Exception as exc:  # etcd down (another fault): it wrote nothing either
            out["refused"][what] = True
            out[f"{what}_error"] = f"failed before writing: {type(exc).__name__}: {exc}"
            continue
        # A purge that found nothing to delete never reaches the fence: nothing to refuse.
        nothing = what == "purge" and done == [] and not out["passed_checks"]
        out["refused"][what] = nothing
        if nothing:
            out["purge_error"] = "nothing to purge"
    fence.close()
    return out


# -- faults --------------------------------------------------------------------------------------


@dataclass
class Fault:
    """One injected fault and how the job came back."""

    kind: str
    t: float
    step_before: int
    node: str = ""
    t_end: float = 0.0
    hit: bool = True  # False: an aimed fault whose moment was not observed ("attempted")
    detail: str = ""
    world: int = 0  # the world size expected after it
    recover_s: float | None = None
    resumed_at: int | None = None
    steps_lost: int | None = None
    error: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v not in ("", None)}


@dataclass
class ChaosOptions:
    """One chaos run. ``every_s``: mean seconds from one fault to the next."""

    minutes: float = 10.0
    seed: int = 0
    runs_dir: Path = Path("runs")
    every_s: float = 120.0
    agents: int = 3
    min_agents: int = 2
    max_agents: int = 4
    step_s: float = 0.5  # the worker's job.min_step_s: the pace of a step
    max_steps: int | None = None  # default: what minutes allow at step_s
    interval: int = 5  # checkpoint.interval
    kinds: Sequence[str] | None = None  # default: every kind this machine can inject
    etcd_members: int = 3
    config: Path = TINY
    recover_timeout: float = 240.0
    netns: bool | None = None  # nodes in network namespaces; None: when cut_link can run
    faults: int | None = None  # inject this many (however long they take); default: by time
    say: Callable[[str], None] = field(default=lambda line: None)


def available_kinds(etcd_members: int) -> tuple[list[str], dict[str, str]]:
    """The kinds this machine can inject, and why each other kind is skipped."""
    from elastic.harness.faults import netns_usable

    skipped: dict[str, str] = {}
    why = netns_usable()
    if why:
        skipped["cut_link"] = f"network namespaces are unusable here: {why}"
    if etcd_members < 3:
        skipped["etcd_member"] = "etcd runs as one member: a member loss is a full outage"
    return [k for k in KINDS if k not in skipped], skipped


def plan(
    rng: random.Random, kinds: Sequence[str], count: int, agents: int, lo: int, hi: int
) -> list[str]:
    """``count`` fault kinds: shuffled rounds of ``kinds`` (every kind early), with a join put
    before a removal at ``lo`` agents and a removal before a join at ``hi``."""
    out: list[str] = []
    pool: list[str] = []
    while len(out) < count:
        if not pool:
            pool = list(kinds)
            rng.shuffle(pool)
        kind = pool.pop()
        if kind in REMOVES and agents <= lo:
            if "join" not in kinds:
                continue
            out.append("join")
            agents += 1
        elif kind == "join" and agents >= hi:
            removes = [k for k in kinds if k in REMOVES]
            if not removes:
                continue
            out.append(rng.choice(removes))
            agents -= 1
        out.append(kind)
        agents += 1 if kind == "join" else -1 if kind in REMOVES else 0
    return out[:count]


class Chaos:
    """One run: the cluster, the observers, the faults and the checks."""

    def __init__(self, opts: ChaosOptions) -> None:
        self.opts = opts
        self.rng = random.Random(opts.seed)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.run_id = f"chaos-{opts.seed}-{stamp}"
        self.run_dir = (opts.runs_dir / self.run_id).resolve()
        fault_s = opts.minutes * 60 if opts.faults is None else opts.faults * (opts.every_s + 10)
        self.max_steps = opts.max_steps or max(2 * opts.interval, int(fault_s / opts.step_s) + 40)
        self.faults: list[Fault] = []
        self.members: list[EtcdServer] = []
        self.stopped: set[int] = set()
        self.exited_ok_required: set[str] = set()
        self.killed: set[str] = set()
        self.stale_results: list[dict[str, Any]] = []
        self.stale_procs: list[tuple[subprocess.Popen[str], int]] = []
        self.old_spec: str | None = None
        self.immutable: list[Path] = []
        self._names = 0
        self.net: Net | None = None
        self.netns_of: dict[str, str] = {}
        self.reference_losses: dict[int, float] = {}
        self.loss_drift: dict[str, float] = {}
        self.kinds, self.skipped = available_kinds(opts.etcd_members)
        if opts.kinds:
            unknown = [k for k in opts.kinds if k not in KINDS]
            if unknown:
                raise ValueError(f"Unknown fault kinds {unknown}; the kinds are {list(KINDS)}.")
            for k in opts.kinds:
                if k in self.skipped:
                    logger.warning("Skipping fault kind %s: %s.", k, self.skipped[k])
            self.kinds = [k for k in opts.kinds if k not in self.skipped]

    # -- set-up ------------------------------------------------------------------------------

    def overrides(self) -> dict[str, Any]:
        return {
            "job.log_every": 10,
            "job.min_step_s": self.opts.step_s,
            "job.sample_ledger": True,
            "job.seed": self.opts.seed,
            "optimizer.lr": LR,
            "checkpoint.interval": self.opts.interval,
            "checkpoint.keep_last": 2,
            "checkpoint.max_failures": 10,
        }

    def start_etcd(self) -> str:
        use_netns = self.opts.netns if self.opts.netns is not None else "cut_link" in self.kinds
        if use_netns:
            self.net = Net().up()
        if self.net is not None:
            size = max(1, self.opts.etcd_members)
            try:
                self.members = start_cluster(self.run_dir / "etcd", size, host=self.net.gateway)
            except BaseException:
                self.net.close()
                raise
        elif self.opts.etcd_members >= 3:
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
        if not self.members:
            self.members = [start_etcd(self.run_dir / "etcd" / "single")]
        return ",".join(m.endpoint for m in self.members)

    def environ(self) -> dict[str, str]:
        return agent_env(PYTHONPATH=pythonpath(), **{env.SECRET_FILE: str(self.secret_file)})

    def new_name(self) -> str:
        self._names += 1
        return f"n{self._names}"

    def start_node(self) -> str:
        """Start one more agent (in a namespace of its own under ``netns``); its name."""
        name = self.new_name()
        if self.net is None:
            self.cluster.start(name)
        else:
            ns, addr = self.net.add_node()
            self.netns_of[name] = ns
            self.cluster.start(name, netns=ns, addr=addr)
        self.exited_ok_required.add(name)
        return name

    # -- helpers --------------------------------------------------------------------------------

    def pause(self, seconds: float) -> None:
        threading.Event().wait(max(0.0, seconds))

    def last_step(self) -> int:
        steps = self.tail.of("train.step")
        return steps[-1]["step"] if steps else 0

    def live(self) -> list[Node]:
        return [n for n in self.cluster.running() if n.name not in self.killed]

    def rank0_worker(self) -> int | None:
        for e in reversed(self.tail.of("train.step")[-5:]):
            pid = int(e["pid"])
            if alive(pid) and proc_name(pid) == WORKER_NAME:
                return pid
        for node in self.live():
            workers = self.cluster.workers_of(node.name)
            if workers:
                return workers[0]
        return None

    def current_round(self) -> int:
        """The fence: the round that may commit now."""
        from elastic.etcd.client import EtcdClient, EtcdOptions, parse_endpoints

        options = EtcdOptions(parse_endpoints(self.endpoint)[0], request_timeout=10.0)
        with EtcdClient(options) as client:
            kvs = client.range(f"{PREFIX}/{self.run_id}/fence".encode()).kvs
        return int(kvs[0].value) if kvs else 1

    def capture_spec(self) -> None:
        """Keep the fence spec a worker holds now (the stale writer uses it later)."""
        pid = self.rank0_worker()
        if pid is None:
            return
        with contextlib.suppress(OSError):
            for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                if item.startswith(env.FENCE.encode() + b"="):
                    self.old_spec = item.split(b"=", 1)[1].decode()

    def wait_stable(self, fault: Fault, timeout: float | None = None) -> None:
        """Wait for the first step at the expected world after the fault's last round, with
        five more steps at that world and no newer round; fill in the recovery figures."""
        timeout = timeout or self.opts.recover_timeout
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.cluster.running():
                fault.error = "every agent exited"
                return
            fault.world = len(self.live())
            rounds = [e["ts"] for e in self.tail.of("rdzv.round") if e["ts"] > fault.t]
            since = max([fault.t, *rounds])
            after = [e for e in self.tail.of("train.step") if e["ts"] > since]
            if after and after[-1]["step"] >= self.max_steps:
                first = after[0] if after[0]["world_size"] == fault.world else None
                if first is not None or not any(e["world_size"] == fault.world for e in after):
                    self._recovered(fault, first or after[-1])
                    return
            good = [e for e in after if e["world_size"] == fault.world]
            settled = [e for e in good if e["ts"] > fault.t_end]
            if len(settled) >= 6 and good[0] is after[0]:
                self._recovered(fault, good[0])
                return
            self.pause(0.25)
        fault.error = f"no stable training at world {fault.world} within {timeout:.0f} s"

    def _recovered(self, fault: Fault, first: dict[str, Any]) -> None:
        fault.recover_s = round(first["ts"] - fault.t, 2)
        loads = [e for e in self.tail.of("ckpt.load") if fault.t < e["ts"] <= first["ts"]]
        fault.resumed_at = loads[-1]["step"] if loads else fault.step_before
        fault.steps_lost = max(0, fault.step_before - fault.resumed_at)

    # -- the faults ---------------------------------------------------------------------------

    def inject(self, kind: str) -> Fault:
        fault = Fault(kind, time.time(), self.last_step())
        getattr(self, f"_{kind}")(fault)
        fault.t_end = fault.t_end or time.time()
        return fault

    def _victim(self) -> Node:
        return self.rng.choice(sorted(self.live(), key=lambda n: n.name))

    def _kill_agent(self, fault: Fault) -> None:
        node = self._victim()
        fault.node = node.name
        self.killed.add(node.name)
        self.exited_ok_required.discard(node.name)
        self.cluster.kill_node(node.name)

    def _kill_worker(self, fault: Fault) -> None:
        for node in sorted(self.live(), key=lambda n: self.rng.random()):
            workers = self.cluster.workers_of(node.name)
            if workers:
                fault.node = node.name
                kill(workers[0])
                return
        fault.hit, fault.detail = False, "no worker was running"

    def _kill_rank0(self, fault: Fault, why: str) -> None:
        pid = self.rank0_worker()
        fault.detail = why
        if pid is None:
            fault.hit, fault.detail = False, f"{why}; no rank-0 worker to kill"
            return
        fault.node = next((n.name for n in self.live() if pid in descendants(n.pid)), "")
        fault.t, fault.step_before = time.time(), self.last_step()  # the fault is the kill
        kill(pid)

    def _steps_root(self) -> Path:
        return self.ckpt / self.run_id

    def _attempts(self) -> dict[str, tuple[int, bool]]:
        """save-<nonce> directories: name -> (step, whether its step's marker names it)."""
        out: dict[str, tuple[int, bool]] = {}
        root = self._steps_root()
        with contextlib.suppress(OSError):
            for name in os.listdir(root):
                if not name.startswith("step-"):
                    continue
                try:
                    entries = os.listdir(root / name)
                    marker = (
                        (root / name / COMMIT_MARKER).read_bytes()
                        if COMMIT_MARKER in entries
                        else b""
                    )
                except OSError:
                    continue
                committed = json.loads(marker).get("attempt") if marker else None
                for e in entries:
                    if e.startswith("save-"):
                        out[e] = (int(name[5:]), e == committed)
        return out

    def _kill_in_save(self, fault: Fault) -> None:
        known = set(self._attempts())
        deadline = time.monotonic() + max(30.0, 6 * self.opts.interval * self.opts.step_s)
        while time.monotonic() < deadline:
            fresh = {a: s for a, s in self._attempts().items() if a not in known and not s[1]}
            if fresh:
                attempt, (step, _) = next(iter(fresh.items()))
                self._kill_rank0(fault, f"step {step} {attempt} had no marker")
                return
            self.pause(0.005)
        fault.hit = False
        self._kill_rank0(fault, "no save in flight was seen; killed anyway")

    def _kill_after_fence(self, fault: Fault) -> None:
        from elastic.etcd.client import EtcdClient, EtcdOptions, parse_endpoints

        prefix = f"{PREFIX}/{self.run_id}/commits/".encode()
        options = EtcdOptions(parse_endpoints(self.endpoint)[0], request_timeout=2.0)
        deadline = time.monotonic() + max(40.0, 10 * self.opts.interval * self.opts.step_s)
        with EtcdClient(options) as client:
            revision = int(client.range(prefix, prefix=True).header.revision)
            while time.monotonic() < deadline:
                if not client.wait_for_event(prefix, revision + 1, 2.0, prefix=True):
                    continue
                response = client.range(prefix, prefix=True)
                for kv in response.kvs:
                    if kv.mod_revision <= revision:
                        continue
                    step = int(kv.key.rsplit(b"-", 1)[1])
                    expected = json.loads(kv.value).get("digest")
                    try:
                        marker = (self._steps_root() / f"step-{step}" / COMMIT_MARKER).read_bytes()
                    except OSError:
                        marker = b""
                    if not marker or marker_digest(marker) != expected:
                        self._kill_rank0(
                            fault,
                            f"the record of step {step} was in etcd, its marker not on storage",
                        )
                        return
                revision = int(response.header.revision)
        fault.hit = False
        self._kill_rank0(
            fault, "every marker was on storage before it could be seen; killed anyway"
        )

    def _kill_in_purge(self, fault: Fault) -> None:
        root = self._steps_root()

        def markers() -> dict[int, bool]:
            out = {}
            with contextlib.suppress(OSError):
                for name in os.listdir(root):
                    if name.startswith("step-"):
                        out[int(name[5:])] = (root / name / COMMIT_MARKER).exists()
            return out

        before = markers()
        deadline = time.monotonic() + max(30.0, 6 * self.opts.interval * self.opts.step_s)
        fallback = time.monotonic() + max(20.0, 4 * self.opts.interval * self.opts.step_s)
        while time.monotonic() < deadline:
            now = markers()
            newest = max((s for s, m in now.items() if m), default=0)
            going = [s for s, m in now.items() if not m and before.get(s) and s < newest]
            if going:
                self._kill_rank0(fault, f"step {going[0]} was half deleted (no marker, files left)")
                return
            if time.monotonic() > fallback and any(m and not before.get(s) for s, m in now.items()):
                fault.hit = False
                self._kill_rank0(
                    fault, f"killed right after step {newest} was committed, when its purge starts"
                )
                return
            before = {**before, **now}
            self.pause(0.002)
        fault.hit = False
        self._kill_rank0(fault, "no commit was seen; killed anyway")

    def _leave(self, fault: Fault) -> None:
        node = self._victim()
        fault.node = node.name
        self.exited_ok_required.add(node.name)
        self.cluster.leave(node.name)
        with contextlib.suppress(subprocess.TimeoutExpired):
            node.wait(120)
        fault.detail = f"exit code {node.proc.poll()}"

    def _join(self, fault: Fault) -> None:
        fault.node = self.start_node()

    def _cut_link(self, fault: Fault) -> None:
        assert self.net is not None, "cut_link runs only with the nodes in namespaces"
        node = self._victim()
        seconds = round(self.rng.uniform(3.0, 8.0), 1)
        fault.node, fault.detail = node.name, f"link down {seconds} s"
        ns = self.netns_of[node.name]
        self.net.link(ns, False)
        try:
            self.pause(seconds)
        finally:
            self.net.link(ns, True)

    def _stop_cont(self, fault: Fault) -> None:
        node = self._victim()
        fault.node = node.name
        seconds = round(self.rng.uniform(2.0, 5.0), 1)
        os.kill(node.pid, signal.SIGSTOP)
        self.stopped.add(node.pid)
        try:
            self.pause(seconds)
        finally:
            os.kill(node.pid, signal.SIGCONT)
            self.stopped.discard(node.pid)
        fault.detail = f"stopped {seconds} s"

    def _etcd_restart(self, fault: Fault) -> None:
        seconds = round(self.rng.uniform(2.0, 5.0), 1)
        for m in self.members:
            m.stop(signal.SIGKILL)
        self.pause(seconds)
        self._restart(self.members)
        fault.detail = f"all {len(self.members)} etcd members down {seconds} s"

    def _etcd_member(self, fault: Fault) -> None:
        member = self.rng.choice(self.members)
        seconds = round(self.rng.uniform(3.0, 8.0), 1)
        member.stop(signal.SIGKILL)
        self.pause(seconds)
        self._restart([member])
        fault.node, fault.detail = member.name, f"etcd member down {seconds} s"

    def _restart(self, members: Sequence[EtcdServer]) -> None:
        for m in members:
            m.start()
        for m in members:
            m.wait_ready(60)

    def _storage_ro(self, fault: Fault) -> None:
        seconds = round(self.rng.uniform(2.0, 4.0), 1)
        root = self._steps_root()
        targets = [root, *(p for p in root.glob("step-*") if p.is_dir())]
        for p in targets:
            self._immutable(p, True)
        try:
            self.pause(seconds)
        finally:
            for p in reversed(targets):
                self._immutable(p, False)
        fault.detail = (
            f"read-only {seconds} s ({'chattr +i' if os.geteuid() == 0 else 'chmod 555'})"
        )

    def _immutable(self, path: Path, on: bool) -> None:
        if os.geteuid() == 0:  # root writes through any mode bits
            flag = "+i" if on else "-i"
            subprocess.run(["chattr", flag, str(path)], capture_output=True, check=False)
        else:
            with contextlib.suppress(OSError):
                path.chmod(0o555 if on else 0o755)
        if on:
            self.immutable.append(path)
        elif path in self.immutable:
            self.immutable.remove(path)

    def _stale_writer(self, fault: Fault) -> None:
        from elastic.rendezvous.fence import FenceSpec

        spec = FenceSpec(**json.loads(self.old_spec)) if self.old_spec else None
        current = self.current_round()
        if spec is None or spec.round >= current:
            if current == 0:
                fault.hit, fault.detail = False, "no older round exists yet; no writer started"
                return
            spec = FenceSpec(self.endpoint, PREFIX, self.run_id, current - 1)
        step = max(self.observer.seen.markers, default=self.opts.interval)
        argv = [
            sys.executable,
            "-m",
            "elastic.chaos.run",
            "--stale-writer",
            spec.to_env(),
            str(self.ckpt),
            self.run_id,
            str(step),
        ]
        # Importing torch takes a minute on loaded cores: the writer runs beside the job
        # (as a stale process would) and its verdict is collected after the job ends.
        proc = subprocess.Popen(
            argv, env=self.environ(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.stale_procs.append((proc, step))
        fault.detail = f"round {spec.round} (current {current}) at step {step}, pid {proc.pid}"

    def collect_stale(self) -> None:
        """Wait for the stale writers and keep what each one reported."""
        for proc, step in self.stale_procs:
            try:
                out, err = proc.communicate(timeout=300)
                result = json.loads(out.strip().splitlines()[-1])
            except (ValueError, IndexError, subprocess.TimeoutExpired) as exc:
                kill(proc.pid)
                out, err = proc.communicate()
                result = {"error": f"{type(exc).__name__}, exit {proc.returncode}: {err[-2000:]}"}
            result["step"] = step
            self.stale_results.append(result)
        self.stale_procs.clear()

    # -- the run --------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        opts = self.opts
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.secret_file = self.run_dir / "secret"
        fd = os.open(self.secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, secrets.token_hex(32).encode())
        os.close(fd)
        self.ckpt = self.run_dir / "ckpt"
        self.endpoint = self.start_etcd()
        n_faults = opts.faults or max(1, int(opts.minutes * 60 / opts.every_s))
        schedule = plan(
            self.rng, self.kinds, n_faults, opts.agents, opts.min_agents, opts.max_agents
        )
        gaps = [opts.every_s * self.rng.uniform(0.7, 1.3) for _ in schedule]
        opts.say(f"run {self.run_id}: {self.max_steps} steps, faults {schedule}")
        self.cluster = LocalCluster(
            self.run_dir,
            self.run_id,
            self.endpoint,
            options=AgentOptions(
                nnodes=f"1:{opts.max_agents}", join_timeout=120, max_restarts=1000
            ),
            config=opts.config,
            max_steps=self.max_steps,
            overrides={**self.overrides(), "checkpoint.url": self.ckpt},
            env=self.environ(),
            say=opts.say,
        )
        self.tail = EventTail(self.cluster.event_log)
        self.observer = StorageObserver(self.ckpt, self.run_id, self.endpoint, self.secret())
        started = time.time()
        try:
            self.observer.start()
            for _ in range(opts.agents):
                self.start_node()
            begin = Fault("start", started, 0, t_end=started)
            self.wait_stable(begin, timeout=max(600.0, self.opts.recover_timeout))
            if begin.error:
                raise RuntimeError(f"The job did not start: {begin.error}. Logs: {self.run_dir}")
            self.capture_spec()
            window_end = time.time() + opts.minutes * 60 if opts.faults is None else math.inf
            next_at = time.time() + gaps[0]
            for kind, gap in zip(schedule, [*gaps[1:], 0.0], strict=True):
                while time.time() < next_at and self.cluster.running():
                    self.pause(0.2)
                if time.time() > window_end or self.last_step() > 0.9 * self.max_steps:
                    break
                if not self.cluster.running():
                    break
                opts.say(f"  t+{time.time() - started:5.0f}s step {self.last_step()}: {kind}")
                fault = self.inject(kind)
                self.faults.append(fault)
                self.wait_stable(fault)
                opts.say(
                    f"    recovered in {fault.recover_s} s, {fault.steps_lost} steps lost"
                    f"{' (' + fault.error + ')' if fault.error else ''}"
                )
                next_at = max(time.time() + 2 * opts.step_s, fault.t + gap)
            codes = self.wait_end()
            self.collect_stale()
        finally:
            for proc, _ in self.stale_procs:
                kill(proc.pid)
            for pid in list(self.stopped):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGCONT)
            for p in list(self.immutable):
                self._immutable(p, False)
            self.observer.stop()
            orphans = self.cluster.close()
            for m in self.members:
                m.stop(signal.SIGKILL)
            if self.net is not None:
                self.net.close()
        ended = time.time()
        seen = dataclasses.asdict(self.observer.seen)
        seen["markers"] = {k: sorted(v) for k, v in seen["markers"].items()}
        (self.run_dir / "observations.json").write_text(json.dumps(seen, indent=1) + "\n")
        report = self.report(started, ended, codes, orphans)
        (self.run_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        return report

    def secret(self) -> bytes:
        from elastic import secret as signing

        return signing.job_secret({env.SECRET_FILE: str(self.secret_file)}) or b""

    def wait_end(self) -> dict[str, int | None]:
        deadline = time.monotonic() + 600
        while self.cluster.running() and time.monotonic() < deadline:
            self.pause(0.5)
        return {n.name: n.proc.poll() for n in self.cluster.nodes.values()}

    # -- checks and the report ------------------------------------------------------------------

    def reference_model(self) -> dict[str, Any]:
        """The same job without faults: ``agents`` ranks throughout (``torchrun --standalone``).

        Not world 1: the order of float sums differs between world sizes, and for some seeds
        a fault-free world-3 run already differs from world 1 by 6e-3 after 240 steps (seed
        11), so only world-size changes that faults cause should show.
        """
        url = self.run_dir / "reference"
        values = {
            **self.overrides(),
            "job.run_id": self.run_id,
            "job.max_steps": self.max_steps,
            "job.min_step_s": 0,
            "job.sample_ledger": False,
            "checkpoint.url": url,
            "checkpoint.interval": 100000,
        }
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={self.opts.agents}",
            "-m",
            "elastic.training.worker",
            "--config",
            str(self.opts.config),
            *(f"{k}={v}" for k, v in values.items()),
        ]
        log = self.run_dir / "reference-events.jsonl"
        environ = {**self.environ(), env.EVENT_LOG: str(log)}
        subprocess.run(argv, env=environ, check=True, capture_output=True, timeout=1800)
        self.reference_losses = {e["step"]: e["loss"] for e in events.read(log, "train.step")}
        return self.final_model(url)

    def loss_problems(self) -> tuple[int, list[str]]:
        """Compare every kept step's loss with the fault-free run's; (checks, problems).

        Lost or corrupt state shows as a jump at one step (a step more or less mid-training
        changes the loss by ~1e-2); the float-summation drift between world sizes grows
        smoothly and stays far below :data:`LOSS_RTOL`.
        """
        kept: dict[int, float] = {}
        for e in self.tail.of("train.step"):
            kept[e["step"]] = e["loss"]
        worst, at = 0.0, 0
        problems = []
        for step, loss in sorted(kept.items()):
            ref = self.reference_losses.get(step)
            if ref is None:
                problems.append(f"the fault-free run has no step {step}")
                continue
            rel = abs(loss - ref) / max(abs(ref), 1e-12)
            if rel > worst:
                worst, at = rel, step
            if rel >= LOSS_RTOL:
                problems.append(f"step {step}: loss {loss} vs {ref} fault-free ({rel:.1e})")
        self.loss_drift = {"worst_rel": worst, "at_step": at}
        return len(kept), problems

    def final_model(self, url: Path) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp

        from elastic.checkpoint import find_latest_complete
        from elastic.checkpoint.storage import make_reader
        from elastic.training.config import load_config
        from elastic.training.model import build_model

        info = find_latest_complete(str(url), self.run_id, secret=self.secret())
        if info is None or info.step != self.max_steps:
            raise RuntimeError(
                f"The newest complete checkpoint under {url} is {info}, not step {self.max_steps}."
            )
        cfg = load_config(self.opts.config, [])
        state = {"model": build_model(cfg.model).state_dict()}
        dcp.load(state, storage_reader=make_reader(info.url))
        return state["model"]

    def check_invariants(
        self, codes: Mapping[str, int | None], orphans: list[int]
    ) -> list[dict[str, Any]]:
        """Every invariant: name, number of checks, failures (first few)."""
        from elastic.training.config import load_config

        checks: list[dict[str, Any]] = []

        def check(name: str, count: int, problems: list[str]) -> None:
            checks.append(
                {"invariant": name, "checks": count, "ok": not problems, "problems": problems[:5]}
            )

        steps = self.tail.of("train.step")
        must = {n: codes.get(n) for n in sorted(self.exited_ok_required)}
        finished = [f"agent {n} exited with {c}" for n, c in must.items() if c != 0]
        top = max((e["step"] for e in steps), default=0)
        if top != self.max_steps:
            finished.append(f"the job reached step {top}, not {self.max_steps}")
        finished += [f"worker {p} outlived its agent" for p in orphans]
        check(
            "job finished: every agent not killed exited 0, last step reached",
            len(must) + 1,
            finished,
        )

        seen = self.observer.seen
        all_loads = self.tail.of("ckpt.load")
        # A resume from a node's memory snapshot or a peer's (elastic.recovery) reads no
        # storage; it must not go behind a step that was already durable.
        snapshots = [e for e in all_loads if e.get("source") in ("memory", "peer")]
        loads = [e for e in all_loads if e not in snapshots]
        behind = []
        for e in snapshots:
            durable = [s for s, t in seen.first_seen.items() if t < e["ts"] - 2.0]
            newest = max(durable, default=0)
            if e["step"] < newest:
                behind.append(
                    f"rank {e.get('rank')} resumed from {e['source']} at step {e['step']} at "
                    f"{e['ts']:.3f}, behind step {newest} committed before"
                )
        bad = []
        for e in loads:
            step = e["step"]
            recs = seen.records.get(step, {})
            ok = [
                d
                for d, r in recs.items()
                if r.get("run") == self.run_id and d in seen.markers.get(step, set())
            ]
            if not ok:
                bad.append(
                    f"load of step {step} at {e['ts']:.3f} (rank {e.get('rank')}): no complete "
                    f"signed marker matching a commit record of run {self.run_id} was seen"
                )
        check("a memory or peer resume is never behind a durable step", len(snapshots), behind)
        check(
            "no torn or foreign step loaded: valid COMMIT and matching etcd record", len(loads), bad
        )
        check(
            "the newest complete step never deleted while newest",
            seen.newest_checks,
            seen.violations,
        )

        cfg = load_config(self.opts.config, [f"{k}={v}" for k, v in self.overrides().items()])
        batch = cfg.data.global_batch_size
        per_epoch = cfg.data.num_samples // batch
        kept = kept_samples(self.tail.of("train.samples"))
        problems = sample_problems(kept, per_epoch, batch)
        missing = sorted(set(range(1, self.max_steps + 1)) - set(kept))
        if missing:
            problems.append(f"steps without samples: {missing[:10]}")
        check("each sample used once per epoch (train.samples)", len(kept), problems)

        stale = []
        for r in self.stale_results:
            refused = r.get("refused", {})
            if "error" in r or not refused or not all(refused.values()):
                stale.append(f"stale writer of round {r.get('round')}: {r}")
            if r.get("passed_checks") or r.get("removed"):
                stale.append(f"stale writer of round {r.get('round')} deleted: {r.get('removed')}")
        check(
            "a stale writer is refused and deletes nothing",
            sum(len(r.get("refused", {})) + 1 for r in self.stale_results),
            stale,
        )

        unrecovered = [f"{f.kind} at {f.t:.0f}: {f.error}" for f in self.faults if f.error]
        check(
            "every fault recovered (stable training at the expected world size)",
            len(self.faults),
            unrecovered,
        )

        try:
            diffs = model_differences(self.final_model(self.ckpt), self.reference_model())
            worst = max(diffs.values(), default=0.0)
            model = [f"{k}: {v:.2e}" for k, v in diffs.items() if not v < MODEL_RTOL]
            self.worst_model_diff = worst
        except Exception as exc:  # a missing checkpoint is a failed check, not a crash
            diffs, model, self.worst_model_diff = {}, [f"{type(exc).__name__}: {exc}"], math.inf
        losses, loss_problems = self.loss_problems() if self.reference_losses else (0, [])
        if model and losses and not loss_problems:
            model.append(
                f"every step's loss agrees with the fault-free run within "
                f"{self.loss_drift['worst_rel']:.1e}: float-summation drift, no lost state"
            )
        check(
            f"final model equals the fault-free run (relative L2 < {MODEL_RTOL:g} per tensor)",
            len(diffs),
            model,
        )
        check(
            f"every kept step's loss equals the fault-free run's (relative < {LOSS_RTOL:g})",
            losses,
            loss_problems or ([] if losses else ["the fault-free run recorded no losses"]),
        )
        return checks

    def effective(self, wall_start: float) -> dict[str, float]:
        """Seconds spent on kept steps (each final attempt of a step), over the wall time."""
        steps = self.tail.of("train.step")
        if not steps:
            return {"effective": 0.0}
        final: dict[int, int] = {}
        for i, e in enumerate(steps):
            final[e["step"]] = i
        durations = []
        prev_by_pid: dict[int, dict[str, Any]] = {}
        cost: dict[int, float] = {}
        for i, e in enumerate(steps):
            prev = prev_by_pid.get(e["pid"])
            if prev is not None and prev["step"] == e["step"] - 1:
                cost[i] = e["ts"] - prev["ts"]
                durations.append(cost[i])
            prev_by_pid[e["pid"]] = e
        typical = statistics.median(durations) if durations else self.opts.step_s
        kept = sum(cost.get(i, typical) for i in final.values())
        first = steps[0]["ts"] - typical
        wall = steps[-1]["ts"] - first
        return {
            "effective": round(kept / wall, 4) if wall > 0 else 0.0,
            "kept_step_s": round(kept, 1),
            "training_wall_s": round(wall, 1),
            "typical_step_s": round(typical, 3),
            "startup_s": round(first - wall_start, 1),
        }

    def report(
        self, started: float, ended: float, codes: Mapping[str, int | None], orphans: list[int]
    ) -> dict[str, Any]:
        invariants = self.check_invariants(codes, orphans)
        by_kind: dict[str, dict[str, int]] = {}
        for f in self.faults:
            k = by_kind.setdefault(
                f.kind, {"injected": 0, "hit": 0, "attempted": 0, "recovered": 0}
            )
            k["injected"] += 1
            k["hit" if f.hit else "attempted"] += 1
            k["recovered"] += f.recover_s is not None and not f.error
        recs = [f.recover_s for f in self.faults if f.recover_s is not None]
        lost = [f.steps_lost for f in self.faults if f.steps_lost is not None]
        return {
            "run_id": self.run_id,
            "run_dir": str(self.run_dir),
            "seed": self.opts.seed,
            "minutes": self.opts.minutes,
            "every_s": self.opts.every_s,
            "max_steps": self.max_steps,
            "etcd_members": len(self.members),
            "wall_s": round(ended - started, 1),
            "faults": len(self.faults),
            "faults_by_kind": by_kind,
            "skipped_kinds": self.skipped,
            "recoveries": len(recs),
            "recover_s": {
                "mean": round(statistics.fmean(recs), 2) if recs else None,
                "worst": max(recs) if recs else None,
            },
            "steps_lost": {"total": sum(lost), "worst": max(lost, default=0)},
            "time": self.effective(started),
            "worst_model_rel_l2": getattr(self, "worst_model_diff", None),
            "loss_drift": self.loss_drift,
            "exit_codes": dict(codes),
            "invariants": invariants,
            "ok": all(c["ok"] for c in invariants),
            "fault_log": [f.as_dict() for f in self.faults],
            "stale_writers": self.stale_results,
            "provenance": provenance(),
        }


def run_chaos(opts: ChaosOptions) -> dict[str, Any]:
    """Run one seeded chaos schedule and return its report (also in ``report.json``)."""
    return Chaos(opts).run()


def table(report: Mapping[str, Any]) -> str:
    """A short human summary of a report."""
    t = report["time"]
    rec = report["recover_s"]
    lines = [
        f"chaos run {report['run_id']}  seed {report['seed']}  {report['wall_s']:.0f} s wall, "
        f"{report['max_steps']} steps, etcd members {report['etcd_members']}",
        f"{'kind':<18}{'injected':>9}{'hit':>5}{'attempted':>10}{'recovered':>10}",
    ]
    for kind, k in sorted(report["faults_by_kind"].items()):
        lines.append(
            f"{kind:<18}{k['injected']:>9}{k['hit']:>5}{k['attempted']:>10}{k['recovered']:>10}"
        )
    lines.append(
        f"recover: mean {rec['mean']} s, worst {rec['worst']} s; steps lost: "
        f"{report['steps_lost']['total']} (worst {report['steps_lost']['worst']}); "
        f"effective time {t.get('effective', 0):.1%}"
    )
    for c in report["invariants"]:
        mark = "ok  " if c["ok"] else "FAIL"
        lines.append(f"{mark} {c['invariant']} ({c['checks']} checks)")
        lines.extend(f"       {p}" for p in c["problems"])
    for kind, why in report["skipped_kinds"].items():
        lines.append(f"skipped {kind}: {why}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m elastic.chaos.run`` (the stale writer of a schedule, or a whole run)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--stale-writer"]:
        spec, url, run_id, step = args[1:5]
        print(json.dumps(stale_writer(spec, url, run_id, int(step))), flush=True)
        return 0
    from elastic.tools.cli import main as cli_main

    return cli_main(["chaos", *args])


def command(args: argparse.Namespace) -> int:
    """Run ``elastic chaos`` from parsed options; 0 when every invariant held."""
    opts = ChaosOptions(
        minutes=args.minutes,
        seed=args.seed,
        runs_dir=args.runs_dir,
        every_s=args.every,
        agents=args.agents,
        kinds=[k for k in args.kinds.split(",") if k] or None,
        say=(lambda line: None)
        if args.json_only
        else (lambda line: print(line, file=sys.stderr, flush=True)),
    )
    try:
        report = run_chaos(opts)
    except (RuntimeError, ElasticError) as exc:
        print(f"elastic chaos: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2))
    if not args.json_only:
        print(table(report))
    return 0 if report["ok"] else 1


__all__ = [
    "KINDS",
    "MODEL_RTOL",
    "ChaosOptions",
    "EventTail",
    "kept_samples",
    "model_differences",
    "run_chaos",
    "sample_problems",
    "table",
]

if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    raise SystemExit(main())
