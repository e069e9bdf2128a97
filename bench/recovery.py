"""Recovery time after membership changes: our agent vs plain torchrun with ``c10d``, one run.

Method. The same scenario runs under each launcher with the same worker
(``elastic_tools.training.worker``, ``configs/tiny.yaml``, ``job.min_step_s=0.25`` pacing
(``--step-s``),
``checkpoint.interval=5``), ``--nnodes=1:3 --nproc-per-node=1``,
``--max-restarts=10`` and ``--monitor-interval=0.3``, each run in its own temp
dir with its own run id (and, for ours, its own etcd):

1. nodes n1 and n2 start (n1 first; under c10d it hosts the rendezvous TCPStore,
   and n2 starts once that store listens) and train 8 steps at world size 2;
2. n3 joins (``join``; world 2 -> 3);
3. n2 gets SIGTERM (``leave``, a planned leave; world 3 -> 2);
4. n3 is killed with ``kill -9`` together with its worker (``kill``; world 2 -> 1).
   Under c10d a non-host node is killed, so the job has a chance; killing the
   store host is measured apart (``first_node_kill``, below).

Between events the run trains 8 more steps. For each event, ``recover_s`` is
the time from the event (``time.time()`` just before the node is started or
signalled) to the ``ts`` of the first ``train.step`` event (written by rank 0
when a step completes) at the new world size; ``steps_lost`` is the last step
completed before the event minus (that first step - 1): steps that had to be
redone after resuming from an older checkpoint. ``pause_s`` is the gap between
the last step before the new world's first step and that step (training stood
still that long; for a join it is shorter than ``recover_s``, since the old
group trains while the new node starts). Phases, seconds from the event, read
from the agents' and workers' logs (glog / ``logging`` timestamps, local time)
and the event log: ``agent_up_s`` (a joining node's agent has imported torch and
starts), ``noticed_s`` (first agent deciding to restart its workers),
``worker_stopped_s`` (a stopping worker saved its checkpoint and returned),
``rdzv_begin_s`` / ``rdzv_s`` (last agent entering / completing the new
rendezvous round), ``workers_started_s`` (worker processes spawned),
``worker_ready_s`` (a worker imported torch, made its process group and
model), ``ckpt_loaded_s`` (last ``ckpt.load``; ``load_s`` is the load alone).
``launcher_s`` (= ``workers_started_s``) is the launcher's share and
``worker_start_s`` the rest; ``rounds`` is the most rendezvous rounds any one
node completed before the first step (more than 1: a spurious extra round).
An event that does not reach its world size within ``--event-timeout``
is "not recovered" and ends that run (``ok: false``).

Launchers. ``ours``: ``python -m elastic.agent.launch`` (etcd-v3 rendezvous) with
``profile=fast-failover,join_timeout=120`` (the profile: ``last_call_timeout=1,
keep_alive_interval=1,keep_alive_max_attempt=3``). ``c10d-tuned``: ``python -m
torch.distributed.run --rdzv-backend=c10d`` with the same keep-alive and last-call
settings (``FAST_FAILOVER_CONF``). ``c10d-default`` (``--with-defaults``):
torch's own timeouts (keep-alive 5 s x 3, last call 30 s). Both c10d variants
run with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (in torch 2.14.1 a join
otherwise hangs). Under torchrun a peer's exit 75 (stop for a re-form) counts as
a failure and spends a restart; ours re-forms without spending one.

``first_node_kill``: n1 and n2 train, n1 (under c10d the store host) is killed
with ``kill -9``, under c10d-tuned and, as a control, under ours; reports whether
n2 ever trains at world 1 (within ``--event-timeout``) and how its agent ended.

``plain-warm`` / ``plain-cold`` (``--backends``; the ``worker_kill`` scenario): a plain
torchrun-style DDP script (``tests/scripts/plain_ddp.py``: no ``elastic.Run``, no checkpoint,
gloo, ``--step-delay=0.25``) under our agent, n1 and n2 (one worker each) train, then the
worker of n2 and then that of n1 is killed with ``kill -9`` (``worker_kill``, world 2 -> 2):
the agents restart their workers (the fallback path of a script not on ``elastic.Run``),
forked from the warm fork server (``plain-warm``) or as fresh processes (``plain-cold``:
``ELASTIC_WARM_START=0``). ``recover_s``: the kill to the first step by a new worker
process (goal: <= 1.0 s warm). Both run in the same repeat loop, interleaved with the
others given.

``mlp-inplace`` / ``torchft`` / ``torchft-default`` (``--backends``): the torchft comparison.
The same job on both sides: ``tests/scripts/inplace_user.py`` (an MLP, AdamW, a cosine
schedule, a global batch of 12 out of 1200 samples, on ``elastic.Run`` in place) under our
agent, and ``bench/torchft_user.py`` (the same job on a ``torchft.Manager``, torchft's DDP
and ``OptimizerWrapper``, one replica group per node) under torchft's Lighthouse, tuned like
our fast-failover profile (``torchft``) or with torchft's defaults (``torchft-default``):
``bench/torchft_cluster.py``. torchft is not installed with elastic; the bench refuses a
torchft backend in one sentence naming the pip line. Run them with ``--step-s 0.08``;
``--kill-first`` kills the joiner (3 -> 2) before n2 leaves (2 -> 1), the order of issue 27.
``--trace-join`` samples the joiner's processes and every agent's channel files every 20 ms
(:class:`JoinTrace`, ``trace_*`` figures), for where a join's time goes. ``spread`` has the
median (min-max) of every figure in seconds (``*_s``) per path and event, the phases
included; ``versus_torchft`` the ratios of ``mlp-inplace`` over ``torchft``.

The nodes are started and driven by :class:`elastic_tools.harness.cluster.LocalCluster`, and the
scenario is :func:`elastic_tools.harness.cluster.membership_scenario` (``elastic demo`` runs it
too).
The JSON output records the git commit and the UTC time of the run (``provenance``).

Usage: ``python bench/recovery.py [--repeats K] [--with-defaults] [--backends LIST]
[--json-out PATH]`` (``--backends plain-warm,plain-cold --no-host-kill``: the plain-script
paths alone)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages first

from elastic.node import channel
from elastic.node.procs import WORKER_NAME, descendants, started_at
from elastic.node.procs import name as proc_name
from elastic.rendezvous.options import FAST_FAILOVER_CONF
from elastic_tools.harness import benchjson
from elastic_tools.harness.cluster import (
    C10D,
    REPO,
    SCENARIO,
    AgentOptions,
    LocalCluster,
    WaitTimeout,
    agent_env,
    measure,
    membership_scenario,
    provenance,
    pythonpath,
    start_pair,
)

if REPO is None:  # not expected: sys.path starts with this checkout
    raise SystemExit("bench/recovery.py runs from a source checkout of elastic.")
TINY = REPO / "configs" / "tiny.yaml"

MIN_STEP_S = 0.25
CKPT_INTERVAL = 5
MAX_STEPS = 2000  # never reached: the bench stops the job after the last event
STEPS_BETWEEN = 8
FREEZE_S = 10  # how long a frozen node stays frozen before SIGCONT
# A hang comes at any moment of a heartbeat's cycle: the freeze waits a random part of one
# (fast-failover's keep-alive interval, 1 s) after the pair trains, else it would come at
# the same phase run after run (a fixed number of steps after the agents start).
FREEZE_PHASE_S = 1.0
KINDS = ("join", "leave", "kill", "freeze", "thaw", "worker_kill")
PLAIN = ("plain-warm", "plain-cold")  # a plain torchrun-style script: the worker_kill scenario
KILLS_PER_RUN = 2  # worker_kill: n2's worker, then n1's
_COMMON: dict[str, Any] = {
    "nnodes": "1:3",
    "max_restarts": 10,
    "monitor_interval": 0.3,
    "join_timeout": 120,
}
LAUNCHERS = {  # name -> how its nodes start
    "ours": AgentOptions(**_COMMON),
    "user-inplace": AgentOptions(**_COMMON),
    "user-restart": AgentOptions(**_COMMON),
    "c10d-tuned": AgentOptions(
        torchrun=True, backend=C10D, rdzv_conf=FAST_FAILOVER_CONF, **_COMMON
    ),
    "c10d-default": AgentOptions(torchrun=True, backend=C10D, rdzv_conf="", **_COMMON),
    "plain-warm": AgentOptions(**_COMMON),
    "plain-cold": AgentOptions(**_COMMON),
}
PLAIN_SCRIPT = str(REPO / "tests" / "scripts" / "plain_ddp.py")
# The torchft comparison's job (bench/torchft_user.py is its torchft version): a 16-32-2 MLP,
# AdamW, a cosine schedule, a global batch of 12 out of 1200 samples, on elastic.Run in place.
MLP_SCRIPT = str(REPO / "tests" / "scripts" / "inplace_user.py")
MLP_ARGS = ["--epochs=1000", "--samples=1200", "--global-batch=12"]
# torchft: the same job (bench/torchft_user.py) under a Lighthouse tuned like our
# fast-failover profile (and its gloo timeout at the same 3 s), or with torchft's defaults
# (Lighthouse heartbeat 5 s, join timeout 60 s, 100 ms tick; gloo 5 s as in its example).
TORCHFT = ("torchft", "torchft-default")
TORCHFT_PG_TIMEOUT_S = {"torchft": 3.0, "torchft-default": 5.0}
LAUNCHERS["mlp-inplace"] = AgentOptions(**_COMMON)


# A user's own script on elastic.Run (examples/train_ddp.py), paced like our worker:
# in place (elastic.init_process_group) or with its own dist.init_process_group (restarts).
USER_SCRIPT = [str(REPO / "examples" / "train_ddp.py"), "--epochs=100000", "--samples=256"]
SCRIPTS = {"user-inplace": [*USER_SCRIPT, "--in-place"], "user-restart": USER_SCRIPT}


def make_cluster(name: str, run_dir: Path, step_s: float = MIN_STEP_S) -> LocalCluster:
    """A cluster of launcher ``name`` in ``run_dir`` (ours: with its own etcd; torchft: with
    its own Lighthouse), every worker paced at ``step_s`` seconds a step."""
    if name in TORCHFT:
        return _torchft_cluster(name, run_dir, step_s)
    options = LAUNCHERS[name]
    script = SCRIPTS.get(name)
    if script is not None:
        script = [*script, f"--step-delay={step_s}", f"--ckpt={run_dir / 'ckpt'}"]
    extra = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if options.backend == C10D else {}
    if name == "mlp-inplace":
        script = [MLP_SCRIPT, *MLP_ARGS, f"--step-delay={step_s}", f"--out={run_dir / 'out'}"]
    if name in PLAIN:
        (run_dir / "out").mkdir(parents=True, exist_ok=True)
        script = [PLAIN_SCRIPT, str(run_dir / "out"), f"--stop-file={run_dir / 'stop'}"]
        script.append(f"--step-delay={step_s}")
        if name == "plain-cold":
            extra["ELASTIC_WARM_START"] = "0"
    return LocalCluster(
        run_dir,
        f"bench-{uuid.uuid4().hex[:8]}",
        options=options,
        config=TINY,
        max_steps=MAX_STEPS,
        overrides={
            "job.log_every": 1,
            "job.min_step_s": step_s,
            "checkpoint.interval": CKPT_INTERVAL,
        },
        env=agent_env(LOGLEVEL="INFO", PYTHONPATH=pythonpath(), **extra),
        cwd=REPO,
        script=script,
    )


def _torchft_cluster(name: str, run_dir: Path, step_s: float) -> LocalCluster:
    from torchft_cluster import LIGHTHOUSE_DEFAULTS, LIGHTHOUSE_TUNED, TorchftCluster

    return TorchftCluster(
        run_dir,
        f"bench-{uuid.uuid4().hex[:8]}",
        lighthouse=LIGHTHOUSE_TUNED if name == "torchft" else LIGHTHOUSE_DEFAULTS,
        script_args=[
            *MLP_ARGS,
            f"--step-delay={step_s}",
            f"--pg-timeout={TORCHFT_PG_TIMEOUT_S[name]:g}",
        ],
        env=agent_env(PYTHONPATH=pythonpath()),
        cwd=REPO,
    )


def torchft_refusal(backends: list[str]) -> str | None:
    """The one sentence that refuses a torchft backend when torchft is not installed."""
    if not any(b in TORCHFT for b in backends):
        return None
    from torchft_cluster import missing

    return missing()


MARKERS = {  # phase -> (log text, which occurrence in the window)
    "agent_up_s": ("starting workers for entrypoint", "first"),  # a joining node's agent
    "noticed_s": ("will restart worker group|Stopping worker group|are gone; re-forming", "first"),
    "worker_stopped_s": ("Stopped at step", "last"),
    "rdzv_begin_s": ("Rendezvous'ing worker group", "last"),
    "rdzv_s": ("Rendezvous complete for workers", "last"),
    "workers_started_s": ("Starting worker group", "last"),
    "worker_ready_s": ("Training from step", "last"),  # the worker joined and resumed
}
TORCH_TS = re.compile(r"^[IWE](\d\d)(\d\d) (\d\d):(\d\d):(\d\d\.\d+) ")
WORKER_TS = re.compile(r"^(\d{4})-(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d),(\d{3}) ")


def _line_ts(line: str) -> float | None:
    """The wall-clock time of a torch (glog style) or worker log line, local time."""
    if m := TORCH_TS.match(line):
        month, day, hour, minute, sec = m.groups()
        stamp = datetime(datetime.now().year, int(month), int(day), int(hour), int(minute))
        return stamp.timestamp() + float(sec)
    if m := WORKER_TS.match(line):
        y, mo, d, h, mi, s, ms = map(int, m.groups())
        return datetime(y, mo, d, h, mi, s).timestamp() + ms / 1000
    return None


def _log_phases(cluster: LocalCluster, t0: float, t1: float) -> dict[str, float]:
    """Seconds from the event to each marker of :data:`MARKERS` in the agents' logs."""
    hits: dict[str, list[float]] = {k: [] for k in MARKERS}
    rounds = 0  # rendezvous rounds one node went through: > 1 means a spurious round
    for node in cluster.nodes.values():
        mine = 0
        for line in node.output().splitlines():
            ts = _line_ts(line)
            if ts is None or not t0 < ts <= t1:
                continue
            for phase, (pattern, _) in MARKERS.items():
                if re.search(pattern, line):
                    hits[phase].append(ts)
                    mine += phase == "rdzv_s"
        rounds = max(rounds, mine)
    out: dict[str, float] = {"rounds": rounds}
    for phase, (_, which) in MARKERS.items():
        if hits[phase]:
            ts = min(hits[phase]) if which == "first" else max(hits[phase])
            out[phase] = round(ts - t0, 2)
    return out


def _annotate(cluster: LocalCluster, entry: dict[str, Any], first: dict[str, Any]) -> None:
    """Where the recovery time went: log markers and the checkpoint load (the training
    pause is :func:`~elastic_tools.harness.cluster.measure`'s ``pause_s``)."""
    t0 = entry["t"]
    entry.update(_log_phases(cluster, t0, first["ts"]))
    _inplace_phases(cluster, entry, t0, first["ts"])
    _torchft_phases(cluster, entry, t0, first["ts"])
    _beyond_a_step(cluster, entry, t0)
    loads = [e for e in cluster.events("ckpt.load") if t0 < e["ts"] <= first["ts"]]
    if loads:
        entry["ckpt_loaded_s"] = round(max(e["ts"] for e in loads) - t0, 2)
        entry["load_s"] = round(max(e["seconds"] for e in loads), 2)
    _derive(entry)


def _beyond_a_step(cluster: LocalCluster, entry: dict[str, Any], t0: float) -> None:
    """``step_s``: the median gap between the last steps before the event (a step's own
    time, here mostly its pacing); ``stall_s`` = ``pause_s`` - ``step_s`` (how much longer
    than a normal step the gap was: what the change cost) and ``recover_over_step_s`` =
    ``recover_s`` - ``step_s`` (a failed step is redone: one step is part of any recovery)."""
    ts = sorted(e["ts"] for e in cluster.steps() if e["ts"] < t0)[-6:]
    gaps = [b - a for a, b in itertools.pairwise(ts)]
    if not gaps:
        return
    step = statistics.median(gaps)
    entry["step_s"] = round(step, 3)
    if entry.get("pause_s") is not None:
        entry["stall_s"] = round(max(0.0, entry["pause_s"] - step), 3)
    if entry.get("recover_s") is not None:
        entry["recover_over_step_s"] = round(max(0.0, entry["recover_s"] - step), 3)


def _inplace_phases(cluster: LocalCluster, entry: dict[str, Any], t0: float, t1: float) -> None:
    """In place, seconds from the event: the agents' round done (``round_s``), the workers
    re-formed (``reformed_s``: group formed and state agreed), with the slowest worker's
    wait for the round, group formation and how the state moved (``state``)."""
    rounds = [e for e in cluster.events("rdzv.inplace") if t0 < e["ts"] <= t1]
    reforms = [e for e in cluster.events("recovery.inplace") if t0 < e["ts"] <= t1]
    if rounds:
        entry["round_s"] = round(max(e["ts"] for e in rounds) - t0, 3)
        entry["round_took_s"] = max(e["seconds"] for e in rounds)
    if reforms:
        entry["reformed_s"] = round(max(e["ts"] for e in reforms) - t0, 3)
        entry["form_s"] = max(e["form_s"] for e in reforms)
        entry["state"] = sorted({e["state"] for e in reforms})


def _torchft_phases(cluster: LocalCluster, entry: dict[str, Any], t0: float, t1: float) -> None:
    """torchft, seconds from the event: a new replica's script imported torch
    (``tft_started_s``), then torchft, and made its manager (``tft_ready_s``); the last
    replica holding the quorum of the new size (``tft_quorum_s``, the joiner's healed state
    included; the longest quorum call then, ``tft_quorum_took_s``)."""
    phases = [e for e in cluster.events("tft.phase") if t0 < e["ts"] <= t1]
    for phase in ("started", "ready"):
        hits = [e["ts"] for e in phases if e["phase"] == phase]
        if hits:
            entry[f"tft_{phase}_s"] = round(min(hits) - t0, 3)
    quorums = [
        e for e in phases if e["phase"] == "quorum" and e.get("world_size") == entry["world"]
    ]
    if quorums:
        entry["tft_quorum_s"] = round(max(e["ts"] for e in quorums) - t0, 3)
        entry["tft_quorum_took_s"] = max(e["seconds"] for e in quorums)
        entry["tft_healed"] = any(e.get("healed") for e in quorums)


def _derive(entry: dict[str, Any]) -> dict[str, Any]:
    """Split ``recover_s``: the launcher's share (until the new workers were spawned), then
    the workers' own start (import torch, process group, model, checkpoint, first step)."""
    if entry.get("workers_started_s") is not None and entry.get("recover_s") is not None:
        entry["launcher_s"] = entry["workers_started_s"]
        entry["worker_start_s"] = round(entry["recover_s"] - entry["workers_started_s"], 2)
    return entry


# --kill-first: the order of the torchft comparison (issue 27): the kill takes the world
# from 3 to 2 and the leave from 2 to 1 (torchft's Lighthouse treats these two differently:
# a quorum of a majority of the heartbeating replicas forms after its join timeout, a half
# waits for the gone one's heartbeat to expire).
KILL_FIRST = "n1+n2 train; n3 joins (->3); n3 kill -9 (->2); n2 SIGTERM (->1)"


def scenario(cluster: LocalCluster, timeout: float) -> list[dict[str, Any]]:
    """n1 and n2 train; n3 joins; n2 leaves by SIGTERM; n3 is killed with -9."""
    return membership_scenario(
        cluster,
        ("n1", "n2", "n3"),
        steps_between=STEPS_BETWEEN,
        timeout=timeout,
        annotate=functools.partial(_annotate, cluster),
    )


class JoinTrace(threading.Thread):
    """``--trace-join``: what a joining node's processes do, sampled every ``every`` s from the
    join until its first step at the new size (from outside: /proc and the agent's channel
    files, nothing in the processes changes). Per process below the agent: when it started
    (``/proc``, ~10 ms), its name, and its CPU seconds at each sample; per channel file
    (``channel-<local rank>.{agent,worker}``, :mod:`elastic.node.channel`): each new
    version's mtime and contents, also of the ``others`` agents (name -> pid): when the
    running nodes' agents hand their workers the new round and the workers take it."""

    def __init__(self, agent: int, others: dict[str, int], every: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.agent, self.t0, self.every = agent, time.time(), every
        self.others = others
        self.procs: dict[int, dict[str, Any]] = {}
        self.files: dict[str, list[dict[str, Any]]] = {}
        self.theirs: dict[str, dict[str, list[float]]] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.every):
            with contextlib.suppress(OSError, ValueError):
                self.sample()

    def sample(self) -> None:
        now = time.time() - self.t0
        for pid in [self.agent, *descendants(self.agent)]:
            proc = self.procs.get(pid)
            if proc is None:
                start = started_at(pid)
                proc = self.procs[pid] = {
                    "pid": pid,
                    "name": proc_name(pid),
                    "cmd": _cmdline(pid),
                    "ppid": _ppid(pid),
                    "start_s": round(start - self.t0, 3) if start else None,
                    "cpu": [],
                }
            cpu = _cpu_s(pid)
            if cpu is not None and (not proc["cpu"] or proc["cpu"][-1][1] != cpu):
                proc["cpu"].append((round(now, 3), cpu))
        for path in Path(channel.DIRECTORY).glob(f"elastic-*/{self.agent}/channel-*"):
            versions = self.files.setdefault(path.name, [])
            mtime = path.stat().st_mtime
            if not versions or versions[-1]["mtime"] != mtime:
                body = json.loads(path.read_text())
                versions.append({"mtime": mtime, "s": round(mtime - self.t0, 3), "body": body})
        for name, pid in self.others.items():
            for path in Path(channel.DIRECTORY).glob(f"elastic-*/{pid}/channel-*"):
                seen = self.theirs.setdefault(name, {}).setdefault(path.name, [])
                at = round(path.stat().st_mtime - self.t0, 3)
                if not seen or seen[-1] != at:
                    seen.append(at)

    def phases(self, t0: float) -> dict[str, Any]:
        """Seconds from the join at ``t0``: the fork server started and went idle (its
        imports done), the worker forked, went idle (waiting for its group), registered on
        the channel, got its assignments."""
        self.done.set()
        self.join(1.0)
        out: dict[str, Any] = {"trace_lag_s": round(self.t0 - t0, 3)}
        # the worker: a fork of the fork server (a grandchild of the agent), or named so
        workers = [
            p
            for p in self.procs.values()
            if p["pid"] != self.agent and (p["ppid"] != self.agent or p["name"] == WORKER_NAME)
        ]
        worker = min(workers, key=lambda p: p["start_s"] or 0.0) if workers else None
        out["trace_procs"] = [
            {k: p[k] for k in ("pid", "name", "cmd", "ppid", "start_s")}
            | {"cpu_last": p["cpu"][-1] if p["cpu"] else None}
            for p in self.procs.values()
        ]
        server = self.procs.get(worker["ppid"]) if worker else None
        if server is not None and server["pid"] != self.agent:
            out["trace_server_start_s"] = server["start_s"]
            busy = [t for t, _ in server["cpu"] if worker is None or t <= worker["start_s"] + 0.05]
            out["trace_server_busy_until_s"] = busy[-1] if busy else None
        if worker is not None:
            out["trace_worker_forked_s"] = worker["start_s"]
            cpu = worker["cpu"][-1][1] if worker["cpu"] else None
            out["trace_worker_cpu"] = str(cpu)  # CPU seconds used by then, not a time
            out["trace_worker_idle_s"] = _went_idle(worker["cpu"])
        for name, versions in self.files.items():
            key = "registered" if name.endswith(".worker") else "assigned"
            out[f"trace_{key}_s"] = [v["s"] for v in versions]
            if key == "assigned":
                out["trace_assignments"] = [
                    {k: v["body"].get(k) for k in ("round", "rank", "world_size", "pending")}
                    for v in versions
                ]
        out["trace_others"] = {
            name: {f: _shift(v, out["trace_lag_s"]) for f, v in files.items()}
            for name, files in self.theirs.items()
        }
        lag = out["trace_lag_s"]
        return {k: _shift(v, lag) if k != "trace_lag_s" else v for k, v in out.items()}


def _shift(value: Any, by: float) -> Any:
    """``value`` (seconds from the trace's start; a list of them) as seconds from the event."""
    if isinstance(value, float) and not isinstance(value, bool):
        return round(value + by, 3)
    if isinstance(value, list) and all(isinstance(v, float) for v in value):
        return [round(v + by, 3) for v in value]
    return value


def _cmdline(pid: int) -> str:
    """The first 120 characters of ``pid``'s command line ("" when it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:120]


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of ``pid``."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)


def _went_idle(cpu: list[tuple[float, float]], quiet_s: float = 0.3) -> float | None:
    """The first sample after which the CPU seconds did not grow for ``quiet_s``."""
    for (t, _), (t_next, _) in itertools.pairwise(cpu):
        if t_next - t >= quiet_s:
            return t
    return None


def ordered(
    cluster: LocalCluster, timeout: float, kill_first: bool = False, trace: bool = False
) -> list[dict[str, Any]]:
    """n1 and n2 train; n3 joins; then n2 leaves by SIGTERM and n3 is killed with -9 (the
    scenario of :func:`scenario`), or with ``kill_first`` n3 is killed, then n2 leaves.
    ``trace``: a :class:`JoinTrace` of the join."""
    start_pair(cluster, ("n1", "n2"), STEPS_BETWEEN, timeout)
    tracer: list[JoinTrace] = []

    def join() -> None:
        node = cluster.start("n3", host=False)
        if trace:
            others = {n: x.pid for n, x in cluster.nodes.items() if n != "n3" and x.running()}
            tracer.append(JoinTrace(node.pid, others))
            tracer[0].start()

    plan: list[tuple[str, str, int, Callable[[], object]]] = [
        ("join", "n3", 3, join),
        ("leave", "n2", 2, lambda: cluster.leave("n2")),
        ("kill", "n3", 1, lambda: cluster.kill_node("n3")),
    ]
    if kill_first:
        plan[1:] = [
            ("kill", "n3", 2, lambda: cluster.kill_node("n3")),
            ("leave", "n2", 1, lambda: cluster.leave("n2")),
        ]
    done: list[dict[str, Any]] = []
    for kind, node, world, act in plan:
        entry, first = measure(cluster, kind, node, world, act, timeout)
        if kind == "join" and tracer:
            entry.update(tracer[0].phases(entry["t"]))
        done.append(entry)
        if first is None:
            break
        _annotate(cluster, entry, first)
        cluster.train_more(STEPS_BETWEEN, timeout)
    return done


def freeze(cluster: LocalCluster, timeout: float) -> list[dict[str, Any]]:
    """n1 and n2 train; n2 is frozen (SIGSTOP of its agent and worker: a hung host), then
    thawed after :data:`FREEZE_S` (SIGCONT): does it rejoin? The freeze comes a random
    part of :data:`FREEZE_PHASE_S` after the pair trains (``phase_s`` in the event)."""
    start_pair(cluster, ("n1", "n2"), STEPS_BETWEEN, timeout)
    phase = random.uniform(0.0, FREEZE_PHASE_S)
    until = time.monotonic() + phase
    cluster.wait_for(lambda: time.monotonic() >= until, "the freeze's phase", phase + 5, 0.01)
    node = cluster.nodes["n2"]
    pids = [node.pid, *descendants(node.pid)]
    stop = functools.partial(_signal_all, pids, signal.SIGSTOP)
    entry, first = measure(cluster, "freeze", "n2", 1, stop, timeout)
    entry["phase_s"] = round(phase, 3)
    if first is not None:
        _annotate(cluster, entry, first)
    cluster.wait_for(lambda: time.time() - entry["t"] >= FREEZE_S, "the freeze", FREEZE_S + 5)
    thaw = functools.partial(_signal_all, pids, signal.SIGCONT)
    back, again = measure(cluster, "thaw", "n2", 2, thaw, timeout)
    if again is not None:
        _annotate(cluster, back, again)
    return [entry, back]


def _plain_starts(cluster: LocalCluster) -> list[dict[str, Any]]:
    """What each start of the plain script wrote (pid, rank, restart), oldest first."""
    found = []
    for path in (cluster.run_dir / "out").glob("start-*.json"):
        with contextlib.suppress(OSError, ValueError):
            start = json.loads(path.read_text())
            found.append({k: start[k] for k in ("pid", "ppid", "restart", "preloaded")})
            found[-1].update(rank=int(start["env"]["RANK"]), at=path.stat().st_mtime)
    return sorted(found, key=lambda s: s["at"])


def worker_kill(cluster: LocalCluster, timeout: float) -> list[dict[str, Any]]:
    """n1 and n2 train the plain script; kill -9 n2's worker, then n1's: the kill to the
    first step of a new worker process (``recover_s``), and whether it started warm."""
    start_pair(cluster, ("n1", "n2"), STEPS_BETWEEN, timeout)
    out = []
    for i in range(KILLS_PER_RUN):
        rank = 1 - i % 2  # n2 holds rank 1 (it joined second), then n1's rank 0
        # the newest start of that rank (an agent that re-formed for a peer's failure
        # without a failure of its own keeps its restart count: go by time)
        victim = [s for s in _plain_starts(cluster) if s["rank"] == rank][-1]
        writer = cluster.steps()[-1]["pid"]
        before = cluster.last_step()
        t0 = time.time()
        os.kill(victim["pid"], signal.SIGKILL)
        entry: dict[str, Any] = {"kind": "worker_kill", "node": f"rank {rank}", "world": 2}
        entry.update(t=round(t0, 3), step_before=before)

        def first_new(t0: float = t0, writer: int = writer) -> dict[str, Any] | None:
            later = [e for e in cluster.steps() if e["ts"] > t0 and e["pid"] != writer]
            return later[0] if later else None

        try:
            first = cluster.wait_for(first_new, "a step by a new worker", timeout)
        except WaitTimeout as exc:
            entry.update(recover_s=None, error=str(exc))
            out.append(entry)
            return out
        entry.update(recover_s=round(first["ts"] - t0, 2), first_step=first["step"])
        entry["steps_lost"] = before  # a plain script starts over: every step is redone
        news = [s for s in _plain_starts(cluster) if s["at"] > t0]
        entry["warm"] = bool(news) and all("torch" in s["preloaded"] for s in news)
        _annotate(cluster, entry, first)
        out.append(entry)
        cluster.train_more(STEPS_BETWEEN, timeout)
    return out


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def host_kill(cluster: LocalCluster, timeout: float) -> dict[str, Any]:
    """Kill -9 the first node (under c10d: the rendezvous store host); does the other go on?"""
    start_pair(cluster, ("n1", "n2"), STEPS_BETWEEN, timeout)
    label = "n1 (store host)" if cluster.options.backend == C10D else "n1 (first node)"
    killed_at = time.time()
    entry, first = measure(cluster, "kill", label, 1, lambda: cluster.kill_node("n1"), timeout)
    if first is not None:
        _annotate(cluster, entry, first)
    survivor = cluster.nodes["n2"]
    try:
        code: int | None = survivor.wait(5 if first is not None else 60)
        entry["survivor_exit_s"] = round(time.time() - killed_at, 1)
    except subprocess.TimeoutExpired:
        code = None
    tail = survivor.output().strip().splitlines()
    errors = [line for line in tail if "Error" in line or "error" in line]
    entry.update(
        recovered=first is not None,
        survivor_exit_code=code,
        survivor_last_error=(errors[-1][:300] if errors else None),
    )
    return entry


def _worker_processes(cluster: LocalCluster) -> int:
    if not cluster.event_log.exists():
        return 0
    evs = cluster.events()
    agents = {e["pid"] for e in evs if e["kind"].startswith(("rdzv.", "node.", "worker."))}
    return len({e["pid"] for e in evs} - agents)


def run_one(
    name: str,
    base: Path,
    event_timeout: float,
    keep: bool,
    body: Callable[[LocalCluster, float], Any],
    step_s: float = MIN_STEP_S,
) -> tuple[Any, LocalCluster, float, str | None, int]:
    """Run ``body`` on a fresh cluster in its own dir; always kill what it started. Returns
    its result, the cluster, seconds, the error (a wait that timed out) and how many worker
    processes ran (every pid in the event log but the agents')."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=base))
    cluster = make_cluster(name, run_dir, step_s)
    started = time.time()
    result: Any = None
    error = None
    try:
        cluster.open()
        result = body(cluster, event_timeout)
    except WaitTimeout as exc:
        error = str(exc)
    finally:
        restarts = _worker_processes(cluster)
        cluster.close()
        if not keep:
            shutil.rmtree(run_dir, ignore_errors=True)
    return result, cluster, round(time.time() - started, 1), error, restarts


def scenario_result(
    name: str, base: Path, args: argparse.Namespace, kind: str = "membership"
) -> dict[str, Any]:
    bodies = {"membership": scenario, "freeze": freeze, "worker_kill": worker_kill}
    if name in PLAIN:
        kind = "worker_kill"
    if kind == "membership" and (args.kill_first or args.trace_join):
        bodies["membership"] = functools.partial(
            ordered, kill_first=args.kill_first, trace=args.trace_join
        )
    found, cluster, total, error, restarts = run_one(
        name, base, args.event_timeout, args.keep, bodies[kind], args.step_s
    )
    evs = found or []
    want = {"membership": 3, "freeze": 2, "worker_kill": KILLS_PER_RUN}[kind]
    ok = error is None and len(evs) == want and all(e["recover_s"] is not None for e in evs)
    out = {
        "backend": name,
        "scenario": kind,
        "run_id": cluster.run_id,
        "events": evs,
        "ok": ok,
        "total_s": total,
        "worker_processes": restarts,
    }
    if error:
        out["error"] = error
    if args.keep:
        out["dir"] = str(cluster.run_dir)
    print(json.dumps(out), file=sys.stderr, flush=True)
    return out


def _median(results: list[dict[str, Any]], backend: str, kind: str, key: str) -> float | None:
    vals = [
        e[key]
        for r in results
        if r["backend"] == backend
        for e in r["events"]
        if e["kind"] == kind and e.get(key) is not None
    ]
    return round(statistics.median(vals), 2) if vals else None


def summarize(results: list[dict[str, Any]], backends: list[str]) -> dict[str, Any]:
    """Medians per backend and event of ``recover_s`` and of ``launcher_s`` (the time until
    the new workers were spawned: what the agent and rendezvous control); ratios to c10d."""
    summary: dict[str, Any] = {}
    for key in ("recover_s", "launcher_s"):
        for backend in backends:
            for kind in KINDS:
                summary[f"median_{kind}_{key}_{backend}"] = _median(results, backend, kind, key)
    for key, name in (("recover_s", "recovery"), ("launcher_s", "launcher")):
        for kind in KINDS:
            ours, base = (_median(results, b, kind, key) for b in ("ours", "c10d-tuned"))
            ratio = round(ours / base, 2) if ours is not None and base else None
            summary[f"{kind}_{name}_ratio_ours_over_c10d_tuned"] = ratio
    return summary


def spread(results: list[dict[str, Any]], backends: list[str]) -> dict[str, Any]:
    """Per backend and event: median, min and max of ``recover_s`` and ``pause_s`` over the
    runs, the most steps lost, and how many worker processes each run started."""
    out: dict[str, Any] = {}
    for backend in backends:
        mine = [r for r in results if r["backend"] == backend]
        row: dict[str, Any] = {
            "runs": len(mine),
            # in the membership scenario 3 nodes run: 3 means no worker ever restarted
            "worker_processes_per_run": sorted(r.get("worker_processes", 0) for r in mine),
        }
        for kind in KINDS:
            evs = [e for r in mine for e in r["events"] if e["kind"] == kind]
            if not evs:
                continue
            row[kind] = {
                "n": len(evs),
                "steps_lost_max": max(e.get("steps_lost") or 0 for e in evs),
            }
            for key in _timed_keys(evs):
                vals = sorted(e[key] for e in evs if e.get(key) is not None)
                if vals:
                    row[kind][key] = {
                        "median": round(statistics.median(vals), 2),
                        "min": vals[0],
                        "max": vals[-1],
                    }
        out[backend] = row
    return out


FIRST_KEYS = ("recover_s", "pause_s", "stall_s", "recover_over_step_s")


def _timed_keys(evs: list[dict[str, Any]]) -> list[str]:
    """The figures in seconds the events carry (``*_s``): the four of :data:`FIRST_KEYS`
    first, then the phases, in the order first seen."""
    seen = dict.fromkeys(FIRST_KEYS)
    for e in evs:
        for key, value in e.items():
            if key.endswith("_s") and isinstance(value, int | float) and key != "total_s":
                seen.setdefault(key)
    return [k for k in seen if any(e.get(k) is not None for e in evs)]


def versus_torchft(spread_: dict[str, Any], ours: str = "mlp-inplace") -> dict[str, Any]:
    """Per event, the median of ``ours`` over torchft's (tuned Lighthouse) for the figure
    that event is judged by (join: the pause and event -> first step with the new node;
    the others: event -> next step at the new size); below 1: ours is faster."""
    out: dict[str, Any] = {}
    mine, theirs = spread_.get(ours), spread_.get("torchft")
    if not mine or not theirs:
        return out
    pairs = [
        ("join", "pause_s"),
        ("join", "recover_s"),
        ("kill", "recover_s"),
        ("leave", "recover_s"),
        ("freeze", "recover_s"),
    ]
    for kind, key in pairs:
        a = mine.get(kind, {}).get(key, {}).get("median")
        b = theirs.get(kind, {}).get(key, {}).get("median")
        out[f"{kind}_{key}_{ours}_over_torchft"] = round(a / b, 2) if a is not None and b else None
    return out


def goals(results: list[dict[str, Any]], summary: dict[str, Any]) -> dict[str, Any]:
    ratio = summary.get("kill_recovery_ratio_ours_over_c10d_tuned")
    ours = [e for r in results if r["backend"] == "ours" for e in r["events"]]
    planned = [e for e in ours if e["kind"] in ("join", "leave")]
    all_ok = all(r["ok"] for r in results if r["backend"] == "ours")
    runs = [r for r in results if r["backend"] == "ours"]
    return {
        "kill_recovery_le_0.5x_tuned": ratio is not None and ratio <= 0.5,
        "join_and_leave_lose_0_steps": bool(planned)
        and all_ok
        and all(e["steps_lost"] == 0 for e in planned),
        # the issue asks for 20/20: true only when at least 20 runs were made
        "joins_and_restarts_succeed_20_of_20": len(runs) >= 20 and all_ok,
        "plain_warm_worker_kill_le_1.0s": _plain_goal(results),
        **{
            f"{b}_in_place": _inplace_goals(results, b)
            for b in ("ours", "user-inplace", "mlp-inplace")
            if any(r["backend"] == b for r in results)
        },
    }


# Issue 16's goals for an in-place path, event kind -> (measure, bound in seconds); a
# frozen node: the heartbeat expiry of profile=fast-failover (3 s) + 0.3 s.
INPLACE_GOALS = {
    "kill": ("recover_s", 0.3),
    "join": ("pause_s", 0.2),
    "leave": ("recover_s", 0.3),
    "freeze": ("recover_s", 3.3),
}


def _inplace_goals(results: list[dict[str, Any]], backend: str) -> dict[str, bool | None]:
    """Each goal of :data:`INPLACE_GOALS` met by the median (None: not measured), 0 steps
    lost in every event, and no worker process beyond one per node (survivors kept)."""
    runs = [r for r in results if r["backend"] == backend]
    out: dict[str, bool | None] = {}
    for kind, (key, bound) in INPLACE_GOALS.items():
        vals = [e[key] for r in runs for e in r["events"] if e["kind"] == kind and e.get(key)]
        out[f"{kind}_{key}_le_{bound}s"] = statistics.median(vals) <= bound if vals else None
    events = [e for r in runs for e in r["events"]]
    out["0_steps_lost"] = bool(events) and all(e.get("steps_lost") == 0 for e in events)
    member = [r for r in runs if r["scenario"] == "membership"]
    out["survivors_kept"] = bool(member) and all(r["worker_processes"] <= 3 for r in member)
    return out


def _plain_goal(results: list[dict[str, Any]]) -> bool | None:
    """The median kill -9 -> next step of the plain script restarted warm is <= 1.0 s."""
    vals = [
        e["recover_s"]
        for r in results
        if r["backend"] == "plain-warm"
        for e in r["events"]
        if e.get("recover_s") is not None
    ]
    return statistics.median(vals) <= 1.0 if vals else None


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=1, help="runs of each scenario (default 1)")
    p.add_argument(
        "--with-defaults",
        action="store_true",
        help="also run c10d with torch's default timeouts (~50 s per event)",
    )
    p.add_argument(
        "--backends",
        default="ours,c10d-tuned",
        help="comma list of ours, user-inplace, user-restart, mlp-inplace, torchft, "
        "torchft-default, c10d-tuned, c10d-default, plain-warm, plain-cold",
    )
    p.add_argument(
        "--no-host-kill",
        action="store_true",
        help="skip the first-node (c10d store host) kill runs",
    )
    p.add_argument(
        "--event-timeout",
        type=float,
        default=120.0,
        help="seconds an event may take before it counts as not recovered",
    )
    p.add_argument(
        "--step-s",
        type=float,
        default=MIN_STEP_S,
        help=f"each worker's paced step, seconds (default {MIN_STEP_S})",
    )
    p.add_argument("--keep", action="store_true", help="keep run dirs (logs, event logs)")
    p.add_argument("--freeze", action="store_true", help="also freeze a node (SIGSTOP) and thaw it")
    p.add_argument(
        "--trace-join",
        action="store_true",
        help="sample the joining node's processes and channel files every 20 ms (JoinTrace)",
    )
    p.add_argument(
        "--kill-first",
        action="store_true",
        help="after the join, kill -9 the joiner (3 -> 2) before n2 leaves (2 -> 1)",
    )
    p.add_argument("--json-out", type=Path, help="also write the JSON here")
    p.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="run nothing: one report over the results of these earlier outputs",
    )
    return p.parse_args(argv)


def report(
    results: list[dict[str, Any]],
    host: list[dict[str, Any]],
    backends: list[str],
    repeats: int,
    load: list[float],
    step_s: float = MIN_STEP_S,
    kill_first_order: bool = False,
) -> dict[str, Any]:
    import torch

    summary = summarize(results, backends)
    spread_ = spread(results, backends)
    return {
        **provenance(),
        "torch": torch.__version__,
        "scenario": {
            "nodes": KILL_FIRST if kill_first_order else SCENARIO,
            "worker": "elastic_tools.training.worker configs/tiny.yaml",
            "scripts": {
                "user-inplace": " ".join([*SCRIPTS["user-inplace"]]),
                "mlp-inplace": " ".join([MLP_SCRIPT, *MLP_ARGS]),
                "torchft": " ".join(["bench/torchft_user.py", *MLP_ARGS]),
            },
            "min_step_s": step_s,
            "checkpoint_interval": CKPT_INTERVAL,
            "steps_between_events": STEPS_BETWEEN,
            "launcher_flags": "--nnodes=1:3 --nproc-per-node=1 --max-restarts=10 "
            "--monitor-interval=0.3",
            "rdzv_conf": {b: _settings(b) for b in backends},
            "c10d_env": {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
            "c10d_kill_target": "a non-host node (the store host's kill: first_node_kill)",
            "repeats": repeats,
            "cpus": os.cpu_count(),
            "loadavg_1min_start_end": load,
        },
        "results": results,
        "successes": {
            b: {
                "runs": sum(r["backend"] == b for r in results),
                "ok": sum(r["ok"] for r in results if r["backend"] == b),
            }
            for b in backends
        },
        "first_node_kill": host,
        "summary": summary,
        "spread": spread_,
        "versus_torchft": versus_torchft(spread_),
        "goals": goals(results, summary),
    }


def _settings(backend: str) -> str:
    """How ``backend``'s membership is configured, for the report."""
    if backend in TORCHFT:
        from torchft_cluster import LIGHTHOUSE_DEFAULTS, LIGHTHOUSE_TUNED

        light = LIGHTHOUSE_TUNED if backend == "torchft" else LIGHTHOUSE_DEFAULTS
        return (
            "torchft_lighthouse --min_replicas=1 "
            + " ".join(f"--{k}={v}" for k, v in light.items())
            + f"; bench/torchft_user.py --pg-timeout={TORCHFT_PG_TIMEOUT_S[backend]:g} "
            "(gloo), manager timeout 30 s, synchronous quorum, heartbeat every 100 ms"
        )
    return LAUNCHERS[backend].conf() or "torch defaults"


def merged(paths: list[Path]) -> dict[str, Any]:
    """One report over the results of earlier reports (more samples for the medians)."""
    olds = [json.loads(p.read_text()) for p in paths]
    results = [r for old in olds for r in old["results"]]
    for r in results:
        r["events"] = [_derive(e) for e in r["events"]]
    backends = list(dict.fromkeys(r["backend"] for r in results))
    load = [x for old in olds for x in old["scenario"].get("loadavg_1min_start_end", [])]
    host = [h for old in olds for h in old.get("first_node_kill", old.get("c10d_host_kill", []))]
    repeats = sum(old["scenario"]["repeats"] for old in olds)
    step_s = olds[0]["scenario"].get("min_step_s", MIN_STEP_S)
    kill_first_order = olds[0]["scenario"].get("nodes") == KILL_FIRST
    out = report(results, host, backends, repeats, load, step_s, kill_first_order)
    out["merged_from"] = [
        {"path": str(p), "commit": old.get("commit"), "utc": old.get("utc")}
        for p, old in zip(paths, olds, strict=True)
    ]
    return out


FREEZABLE = ("ours", "user-inplace", "user-restart", "mlp-inplace", *TORCHFT)


def run_all(args: argparse.Namespace, backends: list[str]) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    results: list[dict[str, Any]] = []
    host: list[dict[str, Any]] = []
    load = [os.getloadavg()[0]]
    try:
        for _ in range(args.repeats):
            results += [scenario_result(b, base, args) for b in backends]
            if args.freeze:
                frozen = [b for b in backends if b in FREEZABLE]
                results += [scenario_result(b, base, args, "freeze") for b in frozen]
        for name in [] if args.no_host_kill else ["c10d-tuned", "ours"]:
            found, cluster, _, error, _ = run_one(
                name, base, args.event_timeout, args.keep, host_kill
            )
            found = found or {"recovered": False, "error": error, "run_id": cluster.run_id}
            host.append({"backend": name, **found})
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    load.append(os.getloadavg()[0])
    return report(results, host, backends, args.repeats, load, args.step_s, args.kill_first)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    backends = args.backends.split(",")
    if args.with_defaults and "c10d-default" not in backends:
        backends.append("c10d-default")
    unknown = [b for b in backends if b not in LAUNCHERS and b not in TORCHFT]
    if unknown:
        raise SystemExit(f"Unknown backend(s) {', '.join(unknown)}: see --help for the list.")
    if not args.merge and (refusal := torchft_refusal(backends)):
        raise SystemExit(refusal)
    out = merged(args.merge) if args.merge else run_all(args, backends)
    return benchjson.output(out, args.json_out)


if __name__ == "__main__":
    raise SystemExit(main())
