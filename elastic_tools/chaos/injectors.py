"""The faults a chaos run injects, one method per kind of :data:`~elastic_tools.chaos.plan.KINDS`:
kills (of a node, of a worker, of rank 0 at an observed moment), a planned leave, a join,
SIGSTOP/SIGCONT, a cut link, etcd outages (a kill, a freeze), read-only storage, a stale
writer and a rogue member key (:mod:`elastic_tools.chaos.rogue`).

Faults that need a moment to be hit (a kill during a save, between the fence and the
marker, during a purge) are aimed by observation: the injector watches the storage or etcd
and kills rank 0's worker the moment the state is seen. When that moment does not come
within the fault's deadline the kill still happens and the fault counts as ``attempted``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from elastic import env
from elastic.checkpoint.layout import COMMIT_MARKER, marker_digest
from elastic.etcd.server import EtcdServer
from elastic.node.procs import descendants, kill
from elastic.rendezvous.keys import RunKeys
from elastic_tools.chaos.fault import Fault
from elastic_tools.chaos.job import ChaosJob, etcd_client
from elastic_tools.chaos.observers import PREFIX, pause
from elastic_tools.chaos.rogue import RogueMember
from elastic_tools.chaos.stale import stale_argv
from elastic_tools.harness.cluster import Node

ROGUE_NAMED_S = 30.0  # how long a rogue key waits for an rdzv.untrusted event naming it
ROGUE_LINGER_S = 3.0  # and stays after it (the closer decides again meanwhile)


class Injector:
    """Injects faults into ``job``, drawing victims and durations from ``rng``, and undoes
    what must not outlive the run (:meth:`undo`)."""

    def __init__(self, job: ChaosJob, rng: random.Random) -> None:
        self.job, self.rng, self.opts = job, rng, job.opts
        self.stopped: set[int] = set()
        self.immutable: list[Path] = []
        self.stale_results: list[dict[str, Any]] = []
        self.stale_procs: list[tuple[subprocess.Popen[str], int]] = []
        self.rogue_results: list[dict[str, Any]] = []
        self.old_spec: str | None = None

    def inject(self, kind: str) -> Fault:
        fault = Fault(kind, time.time(), self.job.tail.last_step())
        getattr(self, f"_{kind}")(fault)
        fault.t_end = fault.t_end or time.time()
        return fault

    def capture_spec(self) -> None:
        """Keep the fence spec a worker holds now (the stale writer uses it later)."""
        pid = self.job.rank0_worker()
        if pid is None:
            return
        with contextlib.suppress(OSError):
            for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                if item.startswith(env.FENCE.encode() + b"="):
                    self.old_spec = item.split(b"=", 1)[1].decode()

    def undo(self) -> None:
        """Kill the stale writers still running, resume stopped agents, make storage
        writable again."""
        for proc, _ in self.stale_procs:
            kill(proc.pid)
        for pid in list(self.stopped):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)
        for p in list(self.immutable):
            self._immutable(p, False)

    # -- kills, leaves and joins -------------------------------------------------------------

    def _victim(self) -> Node:
        return self.rng.choice(sorted(self.job.live(), key=lambda n: n.name))

    def _kill_agent(self, fault: Fault) -> None:
        node = self._victim()
        fault.node = node.name
        self.job.killed.add(node.name)
        self.job.exited_ok_required.discard(node.name)
        self.job.cluster.kill_node(node.name)

    def _kill_worker(self, fault: Fault) -> None:
        for node in sorted(self.job.live(), key=lambda n: self.rng.random()):
            workers = self.job.workers_of(node.name)
            if workers:
                fault.node = node.name
                kill(workers[0])
                return
        fault.hit, fault.detail = False, "no worker was running"

    def _kill_rank0(self, fault: Fault, why: str) -> None:
        pid = self.job.rank0_worker()
        fault.detail = why
        if pid is None:
            fault.hit, fault.detail = False, f"{why}; no rank-0 worker to kill"
            return
        fault.node = next((n.name for n in self.job.live() if pid in descendants(n.pid)), "")
        fault.t, fault.step_before = time.time(), self.job.tail.last_step()  # the kill
        kill(pid)

    def _leave(self, fault: Fault) -> None:
        node = self._victim()
        fault.node = node.name
        self.job.exited_ok_required.add(node.name)
        self.job.left.add(node.name)
        self.job.cluster.leave(node.name)
        with contextlib.suppress(subprocess.TimeoutExpired):
            node.wait(120)
        fault.detail = f"exit code {node.proc.poll()}"

    def _join(self, fault: Fault) -> None:
        fault.node = self.job.start_node()

    # -- kills aimed at a moment of the checkpoint protocol ----------------------------------

    def _kill_in_save(self, fault: Fault) -> None:
        known = set(self._attempts())
        deadline = time.monotonic() + max(30.0, 6 * self.opts.interval * self.opts.step_s)
        while time.monotonic() < deadline:
            fresh = {a: s for a, s in self._attempts().items() if a not in known and not s[1]}
            if fresh:
                attempt, (step, _) = next(iter(fresh.items()))
                self._kill_rank0(fault, f"step {step} {attempt} had no marker")
                return
            pause(0.005)
        fault.hit = False
        self._kill_rank0(fault, "no save in flight was seen; killed anyway")

    def _attempts(self) -> dict[str, tuple[int, bool]]:
        """save-<nonce> directories: name -> (step, whether its step's marker names it)."""
        out: dict[str, tuple[int, bool]] = {}
        root = self.job.steps_root()
        with contextlib.suppress(OSError):
            for name in os.listdir(root):
                if name.startswith("step-"):
                    out.update(_step_attempts(root, name))
        return out

    def _kill_after_fence(self, fault: Fault) -> None:
        prefix = f"{PREFIX}/{self.job.run_id}/commits/".encode()
        deadline = time.monotonic() + max(40.0, 10 * self.opts.interval * self.opts.step_s)
        with etcd_client(self.job.endpoint, request_timeout=2.0) as client:
            step = self._unmarked_record(client, prefix, deadline)
            if step is not None:
                self._kill_rank0(
                    fault, f"the record of step {step} was in etcd, its marker not on storage"
                )
                return
        fault.hit = False
        self._kill_rank0(
            fault, "every marker was on storage before it could be seen; killed anyway"
        )

    def _unmarked_record(self, client: Any, prefix: bytes, deadline: float) -> int | None:
        """Watch the commit records until one appears whose marker is not on storage yet:
        its step (None: none before ``deadline``)."""
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
                marker = self._marker(step)
                if not marker or marker_digest(marker) != expected:
                    return step
            revision = int(response.header.revision)
        return None

    def _marker(self, step: int) -> bytes:
        """``step``'s commit marker on storage (empty when there is none)."""
        try:
            return (self.job.steps_root() / f"step-{step}" / COMMIT_MARKER).read_bytes()
        except OSError:
            return b""

    def _kill_in_purge(self, fault: Fault) -> None:
        before = self._markers()
        deadline = time.monotonic() + max(30.0, 6 * self.opts.interval * self.opts.step_s)
        fallback = time.monotonic() + max(20.0, 4 * self.opts.interval * self.opts.step_s)
        while time.monotonic() < deadline:
            now = self._markers()
            newest = max((s for s, m in now.items() if m), default=0)
            going = [s for s, m in now.items() if not m and before.get(s) and s < newest]
            if going:
                self._kill_rank0(fault, f"step {going[0]} was half deleted (no marker, files left)")
                return
            if time.monotonic() > fallback and any(m and not before.get(s) for s, m in now.items()):
                fault.hit = False
                why = f"killed right after step {newest} was committed, when its purge starts"
                self._kill_rank0(fault, why)
                return
            before = {**before, **now}
            pause(0.002)
        fault.hit = False
        self._kill_rank0(fault, "no commit was seen; killed anyway")

    def _markers(self) -> dict[int, bool]:
        """Every step directory: step -> whether it has its commit marker."""
        root = self.job.steps_root()
        out = {}
        with contextlib.suppress(OSError):
            for name in os.listdir(root):
                if name.startswith("step-"):
                    out[int(name[5:])] = (root / name / COMMIT_MARKER).exists()
        return out

    # -- frozen nodes, cut links, etcd and storage trouble -----------------------------------

    def _cut_link(self, fault: Fault) -> None:
        net = self.job.net
        assert net is not None, "cut_link runs only with the nodes in namespaces"
        node = self._victim()
        seconds = round(self.rng.uniform(3.0, 8.0), 1)
        fault.node, fault.detail = node.name, f"link down {seconds} s"
        ns = self.job.netns_of[node.name]
        net.link(ns, False)
        try:
            pause(seconds)
        finally:
            net.link(ns, True)

    def _stop_cont(self, fault: Fault) -> None:
        node = self._victim()
        fault.node = node.name
        seconds = round(self.rng.uniform(2.0, 5.0), 1)
        os.kill(node.pid, signal.SIGSTOP)
        self.stopped.add(node.pid)
        try:
            pause(seconds)
        finally:
            os.kill(node.pid, signal.SIGCONT)
            self.stopped.discard(node.pid)
        fault.detail = f"stopped {seconds} s"

    def _etcd_restart(self, fault: Fault) -> None:
        members = self.job.members
        seconds = round(self.rng.uniform(2.0, 5.0), 1)
        for m in members:
            m.stop(signal.SIGKILL)
        pause(seconds)
        _restart(members)
        fault.detail = f"all {len(members)} etcd members down {seconds} s"

    def _etcd_member(self, fault: Fault) -> None:
        member = self.rng.choice(self.job.members)
        seconds = round(self.rng.uniform(3.0, 8.0), 1)
        member.stop(signal.SIGKILL)
        pause(seconds)
        _restart([member])
        fault.node, fault.detail = member.name, f"etcd member down {seconds} s"

    def _storage_ro(self, fault: Fault) -> None:
        seconds = round(self.rng.uniform(2.0, 4.0), 1)
        root = self.job.steps_root()
        targets = [root, *(p for p in root.glob("step-*") if p.is_dir())]
        for p in targets:
            self._immutable(p, True)
        try:
            pause(seconds)
        finally:
            for p in reversed(targets):
                self._immutable(p, False)
        how = "chattr +i" if os.geteuid() == 0 else "chmod 555"
        fault.detail = f"read-only {seconds} s ({how})"

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

    def _frozen_etcd(self, fault: Fault) -> None:
        members = self.job.members
        member = self.rng.choice(members)
        seconds = self._frozen_s(len(members) == 1)
        assert member.proc is not None, "the job's etcd members run"
        pid = member.proc.pid
        os.kill(pid, signal.SIGSTOP)
        self.stopped.add(pid)
        try:
            pause(seconds)
        finally:
            os.kill(pid, signal.SIGCONT)
            self.stopped.discard(pid)
        only = " (the only one)" if len(members) == 1 else f" (1 of {len(members)})"
        fault.node, fault.detail = member.name, f"etcd member stopped {seconds} s{only}"

    def _frozen_s(self, only: bool) -> float:
        """How long to freeze an etcd member: 3-8 s, plus the agents' ``request_timeout``
        when it is the only one (a hung etcd counts as unreachable once a request ran out),
        and always 5 s less than their ``outage_timeout`` at most (past it they give up)."""
        rdzv = self.job.rendezvous_options()
        seconds = self.rng.uniform(3.0, 8.0) + (rdzv.request_timeout if only else 0.0)
        return round(max(1.0, min(seconds, rdzv.outage_timeout - 5.0)), 1)

    # -- a rogue member ----------------------------------------------------------------------

    def _rogue_member(self, fault: Fault) -> None:
        if not self.opts.secret:  # choose_kinds leaves it out; a direct call says why
            fault.hit, fault.detail = False, "the job has no secret; no rogue key written"
            return
        node = f"rogue-{len(self.rogue_results) + 1}"
        fault.node = node

        def named() -> bool:
            untrusted = self.job.tail.of("rdzv.untrusted")
            return any(e.get("node") == node and e["ts"] >= fault.t for e in untrusted)

        with etcd_client(self.job.endpoint, request_timeout=5.0) as client:
            rogue = RogueMember(client, RunKeys(PREFIX, self.job.run_id), node)
            try:
                rogue.plant()
                seen = rogue.watch(named, ROGUE_NAMED_S, ROGUE_LINGER_S)
            finally:
                rogue.remove()
        self.rogue_results.append({**seen.as_dict(), "t": fault.t})
        untrusted = "never named" if seen.untrusted_s is None else f"{seen.untrusted_s} s"
        fault.detail = (
            f"unsigned key {node}: rdzv.untrusted after {untrusted}; rounds seen "
            f"{sorted(seen.rounds)}, ranked in {sorted(seen.ranked) or 'none'}"
        )

    # -- the stale writer --------------------------------------------------------------------

    def _stale_writer(self, fault: Fault) -> None:
        from elastic.rendezvous.fence import FenceSpec

        spec = FenceSpec(**json.loads(self.old_spec)) if self.old_spec else None
        current = self.job.current_round()
        if spec is None or spec.round >= current:
            if current == 0:
                fault.hit, fault.detail = False, "no older round exists yet; no writer started"
                return
            spec = FenceSpec(self.job.endpoint, PREFIX, self.job.run_id, current - 1)
        step = max(self.job.observer.seen.markers, default=self.opts.interval)
        # Importing torch takes a minute on loaded cores: the writer runs beside the job
        # (as a stale process would) and its verdict is collected after the job ends.
        proc = subprocess.Popen(
            stale_argv(spec, self.job.ckpt, self.job.run_id, step),
            env=self.job.environ(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
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


def _step_attempts(root: Path, name: str) -> dict[str, tuple[int, bool]]:
    """Step directory ``name``'s save-<nonce> attempts: name -> (step, whether the step's
    marker names it)."""
    try:
        entries = os.listdir(root / name)
        marker = (root / name / COMMIT_MARKER).read_bytes() if COMMIT_MARKER in entries else b""
    except OSError:
        return {}
    committed = json.loads(marker).get("attempt") if marker else None
    return {e: (int(name[5:]), e == committed) for e in entries if e.startswith("save-")}


def _restart(members: Sequence[EtcdServer]) -> None:
    for m in members:
        m.start()
    for m in members:
        m.wait_ready(60)


__all__ = ["Injector"]
