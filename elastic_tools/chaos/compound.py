"""Compound faults: two faults aimed to land together, the way they meet in production.

:data:`COMPOUND` is the schedule, one round of it (``elastic chaos --compound``; more
rounds repeat it). From 3 agents a round goes 3 -> 2 -> 3 -> 3 -> 3:

* ``freeze_leave_in_save``: one node frozen (SIGSTOP of its agent and its workers) for
  ``freeze_s``, thawed (SIGCONT), then another node's agent gets SIGTERM (a planned leave)
  the moment a checkpoint save is seen in flight (a ``save-<nonce>`` directory whose step
  has no marker naming it yet; the storage is polled every 5 ms).
* ``join_in_reform``: a new agent starts; the moment its member key is in etcd (it has
  announced itself, the round that admits it is being decided), another node's worker is
  killed (``kill -9``): the group re-forms for the loss and the join at once.
* ``kill_in_transfer``: a new agent starts; the moment its worker has opened its group's
  sockets and has not resumed yet (no ``recovery.resume`` of its pid), a node holding the
  state (agent and worker) is killed with ``kill -9``: the joiner's state transfer loses
  its sender.
* ``etcd_freeze_in_save``: every etcd member frozen (SIGSTOP) for ``etcd_freeze_s`` the
  moment a checkpoint save is seen in flight: its commit cannot reach the fence.

Each aimed moment that was not seen before its deadline still injects, and the fault
counts as ``attempted`` rather than ``hit``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

from elastic.node.procs import descendants, kill
from elastic_tools.chaos.fault import Fault
from elastic_tools.chaos.injectors import Injector
from elastic_tools.chaos.job import etcd_client
from elastic_tools.chaos.observers import PREFIX, pause
from elastic_tools.harness.cluster import Node

COMPOUND: tuple[str, ...] = (
    "freeze_leave_in_save",
    "join_in_reform",
    "kill_in_transfer",
    "etcd_freeze_in_save",
)
COMPOUND_KINDS = {
    "freeze_leave_in_save": "a node frozen and thawed, then a planned leave during a save",
    "join_in_reform": "a join whose round also re-forms for a killed worker",
    "kill_in_transfer": "kill -9 of a state holder while a joiner waits for its state",
    "etcd_freeze_in_save": "etcd frozen (SIGSTOP) while a checkpoint save is in flight",
}
AIM_S = 120.0  # how long an aimed fault waits for its moment


def compound_schedule(rounds: int) -> list[str]:
    """``rounds`` rounds of :data:`COMPOUND`."""
    return [k for _ in range(max(1, rounds)) for k in COMPOUND]


class CompoundInjector(Injector):
    """The compound faults, beside the single ones of :class:`Injector`."""

    # -- a freeze, then a leave inside a save ------------------------------------------------

    def _freeze_leave_in_save(self, fault: Fault) -> None:
        frozen = self._victim()
        seconds = self.opts.freeze_s
        stopped = self._freeze_node(frozen, seconds)
        attempt = self._save_started(time.monotonic() + AIM_S)
        leaver = self._other(frozen.name)
        if leaver is None:
            fault.node, fault.hit = frozen.name, False
            fault.detail = f"{frozen.name} frozen {seconds:g} s; no other node left to leave"
            return
        step_now = self.job.tail.last_step()
        fault.node = f"{frozen.name}+{leaver.name}"
        fault.t, fault.step_before = time.time(), step_now  # the leave
        self.job.exited_ok_required.add(leaver.name)
        self.job.left.add(leaver.name)
        self.job.cluster.leave(leaver.name)
        fault.hit = attempt is not None
        where = f"during the save of {attempt}" if attempt else "(no save in flight was seen)"
        fault.detail = (
            f"{frozen.name} frozen {seconds:g} s ({stopped} processes), then {leaver.name} "
            f"SIGTERM at step {step_now} {where}"
        )

    def _save_started(self, deadline: float) -> str | None:
        """Wait for a save to start: with the script's checkpoint interval known, the
        moment rank 0 reports a step that saves (the save starts right after; the leave
        then lands in the next step, the first of an epoch for ours), else a save attempt
        seen on storage. What was seen (None: nothing before ``deadline``)."""
        every = self.opts.script.checkpoint_every if self.opts.script else 0
        if not every:
            return self._save_in_flight(deadline)
        reported = self.job.tail.last_step()
        while time.monotonic() < deadline and self.job.cluster.running():
            step = self.job.tail.last_step()
            if step != reported and step % every == 0 and not self._markers().get(step):
                return f"step {step} (reported, not committed)"
            reported = step
            pause(0.005)
        return None

    def _freeze_node(self, node: Node, seconds: float) -> int:
        """SIGSTOP of ``node``'s agent and every process below it; SIGCONT after
        ``seconds``. How many processes it stopped."""
        pids = [node.pid, *descendants(node.pid)]
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGSTOP)
                self.stopped.add(pid)
        try:
            pause(seconds)
        finally:
            for pid in reversed(pids):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGCONT)
                self.stopped.discard(pid)
        return len(pids)

    def _save_in_flight(self, deadline: float) -> str | None:
        """Wait for a save attempt that no marker names yet: ``step-N/save-<nonce>``
        (None: none before ``deadline``)."""
        known = set(self._attempts())
        while time.monotonic() < deadline and self.job.cluster.running():
            for attempt, (step, named) in self._attempts().items():
                if attempt not in known and not named:
                    return f"step-{step}/{attempt}"
            pause(0.005)
        return None

    def _other(self, not_this: str) -> Node | None:
        """A live node other than ``not_this`` (None: none is left; the job ended)."""
        live = sorted((n for n in self.job.live() if n.name != not_this), key=lambda n: n.name)
        return self.rng.choice(live) if live else None

    # -- a join during a re-form -------------------------------------------------------------

    def _join_in_reform(self, fault: Fault) -> None:
        prefix = f"{PREFIX}/{self.job.run_id}/announce/members/".encode()
        victim = self._victim()
        before = self._members(prefix)
        joiner = self.job.start_node()
        deadline = time.monotonic() + AIM_S
        announced = False
        while time.monotonic() < deadline and not announced:
            announced = self._members(prefix) > before
            if not announced:
                pause(0.02)
        workers = self.job.workers_of(victim.name)
        fault.node = f"{joiner}+{victim.name}"
        fault.t, fault.step_before = time.time(), self.job.tail.last_step()
        if workers:
            kill(workers[0])
        fault.hit = announced and bool(workers)
        fault.detail = (
            f"{joiner} joined; "
            + ("its member key was in etcd when " if announced else "no member key seen; ")
            + (f"{victim.name}'s worker {workers[0]} was killed" if workers else "no worker")
        )

    def _members(self, prefix: bytes) -> int:
        """How many member keys the rendezvous holds now."""
        try:
            with etcd_client(self.job.endpoint, request_timeout=2.0) as client:
                return len(client.range(prefix, prefix=True).kvs)
        except Exception:  # etcd busy: count again next poll
            return -1

    # -- a kill during a state transfer --------------------------------------------------------

    def _kill_in_transfer(self, fault: Fault) -> None:
        joiner = self.job.start_node()
        node = self.job.cluster.nodes[joiner]
        deadline = time.monotonic() + AIM_S
        worker, opened = self._joiner_in_sync(node, deadline)
        holder = self._other(joiner)
        if holder is None:
            fault.node, fault.hit = joiner, False
            fault.detail = f"{joiner} joined; no node holding the state was left to kill"
            return
        fault.node = f"{joiner}+{holder.name}"
        fault.t, fault.step_before = time.time(), self.job.tail.last_step()
        self.job.killed.add(holder.name)
        self.job.exited_ok_required.discard(holder.name)
        self.job.cluster.kill_node(holder.name)
        resumed = worker is not None and self._resumed(worker)
        fault.hit = opened and not resumed
        fault.detail = f"{joiner} joined; {holder.name} killed (agent and worker) " + (
            f"while {joiner}'s worker {worker} had its group's sockets open and no state"
            if fault.hit
            else "without seeing the joiner's worker wait for its state"
        )

    def _joiner_in_sync(self, node: Node, deadline: float) -> tuple[int | None, bool]:
        """Wait for the joiner's worker to open its group's sockets (gloo's connections to
        its peers) before it resumed: (its pid, whether that moment was seen)."""
        worker: int | None = None
        baseline = 0
        while time.monotonic() < deadline and node.running():
            workers = self.job.workers_of(node.name)
            if workers and worker != workers[0]:
                worker, baseline = workers[0], _sockets(workers[0])
            if worker is not None:
                if self._resumed(worker):
                    return worker, False
                if _sockets(worker) >= baseline + 2:
                    return worker, True
            pause(0.005)
        return worker, False

    def _resumed(self, pid: int) -> bool:
        return any(e.get("pid") == pid for e in self.job.tail.of("recovery.resume"))

    # -- an etcd freeze during a save ----------------------------------------------------------

    def _etcd_freeze_in_save(self, fault: Fault) -> None:
        attempt = self._save_in_flight(time.monotonic() + AIM_S)
        seconds = self.opts.etcd_freeze_s
        pids = [m.proc.pid for m in self.job.members if m.proc is not None]
        fault.t, fault.step_before = time.time(), self.job.tail.last_step()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
            self.stopped.add(pid)
        try:
            pause(seconds)
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
                self.stopped.discard(pid)
        fault.hit = attempt is not None
        where = f"during the save {attempt}" if attempt else "(no save in flight was seen)"
        fault.detail = f"{len(pids)} etcd member(s) stopped {seconds:g} s {where}"


def _sockets(pid: int) -> int:
    """How many sockets process ``pid`` holds open."""
    count = 0
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return count


__all__ = ["AIM_S", "COMPOUND", "COMPOUND_KINDS", "CompoundInjector", "compound_schedule"]
