"""Our node agent: torch's LocalElasticAgent plus planned leave and re-form on request.

Small hooks into torch's agent:

* **Re-form on request.** A worker that stops because a *peer* asked the group
  to stop (a planned leave elsewhere) exits with :data:`elastic.node.reform.EXIT_CODE`. The
  agent treats that as a change of membership, not a failure: it re-runs the
  rendezvous without spending a restart.
* **A job-wide restart budget.** ``--max-restarts`` counts failed rounds of
  the whole job in etcd (one key per failed round, whoever sees it first),
  not failures seen by this agent.
* **Planned leave.** On SIGTERM/SIGINT the agent lets torch stop its workers
  (ours finish the current step and write a checkpoint with their peers), then
  removes this node from the rendezvous at once instead of leaving the others
  to wait for its heartbeats to expire.
* **Lost peers.** When a peer vanished from the round (a crash, a cut link) the
  workers are stuck in a collective with it, out of reach of a stop request:
  they get :data:`LOST_PEER_GRACE_S` to exit, then are killed, instead of
  waiting for the collective timeout.
* **Warm starts of a user's script** (:class:`elastic.agent.plain_script.PlainScript`):
  before each start the agent checks that forking is still safe, else starts that round's
  workers with torchrun's command (:func:`elastic.agent.forkserver.server_cold_reason`). A
  forked script holds no descriptor of torch's, as a fresh process: it hands torch no
  return value, and the agent reads its exit instead (:meth:`NodeAgent._collect_script_exits`).
  A forked worker's failure is logged without torch's traceback formatter, which would
  import ``torch._dynamo`` (seconds) before the restart.
* **The commit fence in the worker environment,** since warm workers fork from a
  server that took the agent's environment before the rendezvous set it.
* **Node-local files** (:mod:`elastic.node.nodelocal`): snapshots, channels and the re-form marker
  live in this agent's private directory, ``/dev/shm/elastic-<uid>/<agent pid>/`` (0700), made
  when it starts; workers learn this agent's pid, so their snapshots outlive a worker restart.
  The agent removes its directory when it exits, and on start what agents that are gone left
  (skipping, with one log line, what is not this uid's to remove: it starts regardless).
* **In-place re-forms** (:mod:`elastic.worker`): when every local worker is a script on
  ``elastic.Run`` that registered on its channel, a change of membership runs the
  rendezvous and hands the running workers their new ranks instead of restarting them:
  torch's ``_restart_workers`` goes in place when the host is ready, else restarts
  (:class:`elastic.agent.inplace_host.InPlaceHost` does the in-place part).
* **Metrics** (:mod:`elastic.agent.metrics`, with ``--metrics-port``): each round, change,
  failure and spent restart is recorded; the hooks do nothing when metrics are off.
* **A worker's exit is noticed at once.** torch sleeps ``--monitor-interval`` between
  checks, so a worker that fails (its peer was killed: gloo's connection closed) waits
  half an interval on average to be seen. Here the wait between checks ends as soon
  as a worker process ends (:meth:`NodeAgent._wait_for_worker_exit`), and in place as
  soon as the rendezvous shows a new membership change (a planned leave was seen 0.16-0.19 s
  after the SIGTERM, at the 0.3 s tick); the interval still paces the checks of healthy
  workers.
* **Probation** (:mod:`elastic.agent.probation`): when the straggler policy drops this node
  (its lowest rank leaves a request in this agent's node-local directory), the agent leaves
  the round in place as a planned leave does, sits out running a health check with back-off,
  and rejoins as a joiner once a check passes (or leaves for good after the rule's bound).
  Without in-place workers, or with ``$ELASTIC_PROBATION=off``, it leaves the job: the run
  ends with its result (exit 0) and the rendezvous stays open for the others
  (:meth:`NodeAgent._leave_job`). A worker stuck inside a step that ended itself (exit 76)
  takes the same "leave, then rejoin" path with no health check
  (:func:`elastic.agent.probation.sit_out_stuck`).
* **The tick is a pure function** (:mod:`elastic.agent.tick`): :meth:`NodeAgent._monitor_workers`
  gathers an observation, ``tick.decide`` answers with an action and a reason, and
  :meth:`NodeAgent._dispatch` does it; every side effect of a tick lives in the dispatch.
* **A frozen worker is ended.** A worker stopped (SIGSTOP) for ``FROZEN_S`` seconds while
  its agent runs is killed and restarted like a failed one (:mod:`elastic.agent.frozen`):
  its peers would otherwise wait on it round after round.
* **A stuck worker is gone around** (:mod:`elastic.agent.stuck`): in place, a worker that is
  stopped and that its waiting peers named stuck past the hang bound (their verdict in the
  round's store, read each tick only while a worker is stopped) is ended at once, and the
  node leaves its round with no health check and rejoins as a joiner
  (:func:`elastic.agent.probation.sit_out_stuck`); no restart is spent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import re
import select
import signal
import time
from pathlib import Path
from typing import Any, cast

from torch.distributed.elastic.agent.server.api import (
    DEFAULT_ROLE,
    RunResult,
    WorkerGroup,
    WorkerState,
)
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous import RendezvousHandler

from elastic import env, events
from elastic.agent import inplace_host, jobdir, metrics, tick
from elastic.agent.cold_start import note_cold
from elastic.agent.forkserver import server_cold_reason
from elastic.agent.frozen import FROZEN_S, FrozenWatch
from elastic.agent.inplace_host import InPlaceHost
from elastic.agent.plain_script import PlainScript
from elastic.agent.probation import Ending, Probation, SatOut, request_path, sit_out_stuck
from elastic.agent.stuck import CONFIRM_S, VerdictReader, stuck_pids
from elastic.node import channel, nodelocal, procs, reform
from elastic.rendezvous.contract import ChangeKind, MembershipChange, MembershipHandler
from elastic.worker import probation, snapshot

logger = logging.getLogger(__name__)

WAITING_TICK_S = 0.02  # how often the agent looks at its in-place workers' registrations
LOST_PEER_GRACE_S = 3  # after a peer vanished, workers get this long to exit before SIGKILL
_PEER_GONE = (ChangeKind.PEERS_LOST, ChangeKind.DROPPED)


class _KeptOpen:
    """torch's own rendezvous handler of a node that left the job on its own: torch's
    launcher shuts the handler down when the agent's run ends, which would close the
    rendezvous (the job) for the others; this one leaves it open (the node's heartbeat
    ends with the process, as a planned leave's does)."""

    def __init__(self, handler: RendezvousHandler) -> None:
        self._handler = handler

    def shutdown(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handler, name)


class NodeAgent(LocalElasticAgent):
    """LocalElasticAgent that re-forms on request and leaves the rendezvous when told to stop."""

    _change: MembershipChange | None = None  # what made the current restart, once seen
    _tick_s: float | None = None  # the monitor interval, while _invoke_run waits on exits
    _frozen: FrozenWatch | None = None  # workers seen stopped (SIGSTOP), made on first use
    _probation: Probation | None = None  # with the straggler policy on (made in run)
    _request: Path | None = None  # where a dropped node's worker asks for probation
    _left: str | None = None  # why this node left the job on its own (the run then ends)
    _verdicts: VerdictReader | None = None  # reads the round's stuck verdicts (first use)
    _named_stuck: frozenset[int] = frozenset()  # worker pids the waiting ranks named stuck

    def _handler(self) -> MembershipHandler | None:
        handler = self._worker_group.spec.rdzv_handler
        return handler if isinstance(handler, MembershipHandler) else None

    def _set_local_rank_env(
        self, worker_env: dict[str, str | None], local_rank: int, spec: Any
    ) -> None:
        super()._set_local_rank_env(worker_env, local_rank, spec)
        # The round's fence comes from the rendezvous (after a warm worker's fork server
        # took this process's environment).
        fence = self._fence()
        if fence:
            worker_env[env.FENCE] = fence
        worker_env[env.SNAPSHOT_OWNER] = str(os.getpid())  # whose node the snapshots are
        worker_env[env.JOB_DIR] = str(jobdir.ensure(spec.rdzv_handler.get_run_id()))
        if self._host is not None:
            worker_env[env.CHANNEL] = str(self._host.channel_of(local_rank))

    def _fence(self) -> str:
        handler = self._handler()
        return handler.fence() if handler is not None else ""

    # -- in-place re-forms (elastic.node.channel; the host: elastic.agent.inplace_host) --

    @functools.cached_property
    def _host(self) -> InPlaceHost | None:
        """The in-place host when this agent offers in-place re-forms, else None."""
        handler = self._worker_group.spec.rdzv_handler
        return InPlaceHost(handler) if inplace_host.offered(handler) else None

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        if self._host is not None:
            self._host.prepare_start(worker_group)
        spec = worker_group.spec
        script = spec.entrypoint
        reason = server_cold_reason() if isinstance(script, PlainScript) else None
        if not isinstance(script, PlainScript) or reason is None:
            return super()._start_workers(worker_group)
        # A warm start of this script is not safe now: torchrun's command, this once.
        note_cold(reason)
        args = spec.args
        spec.entrypoint, spec.args = script.executable, (*script.cold_args, *args)
        try:
            return super()._start_workers(worker_group)
        finally:
            spec.entrypoint, spec.args = script, args

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        """In place when the group is healthy (a membership change, not a failure) and
        every local worker can re-form in place (they keep their processes), else torch's
        restart: stop, rendezvous, start. A failed group never re-forms in place: a worker
        torch saw end (its fork server killed, say) can still be alive for a moment as
        it dies, and a re-form would then go on with no worker at all."""
        host = self._host
        healthy = worker_group.state == WorkerState.HEALTHY
        if host is not None and healthy and host.ready(worker_group):
            change, self._change = self._change, None
            host.reform_in_place(worker_group, change, self._rendezvous)
        else:
            super()._restart_workers(worker_group)

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        # The node stays: the workers need not persist a checkpoint (see elastic.node.reform).
        with reform.marking(os.getpid()):
            self._stop_or_kill_after_grace(worker_group)

    def _stop_or_kill_after_grace(self, worker_group: WorkerGroup) -> None:
        """torch's stop, or, when a peer is gone, SIGTERM and SIGKILL after the grace."""
        change, self._change = self._change, None
        if change is not None and change.kind in _PEER_GONE:
            # A peer vanished mid-run: our workers are (or soon will be) blocked in a
            # collective with it, where a stop request cannot reach them; they could only
            # wait for the collective timeout. A worker that is already finishing (a peer's
            # planned leave) exits well within the grace; the rest are killed after it.
            logger.warning(
                "A peer is gone: stopping the workers, killing them after %d s.",
                LOST_PEER_GRACE_S,
            )
            self._shutdown(death_sig=signal.SIGTERM, timeout=LOST_PEER_GRACE_S)
            return
        super()._stop_workers(worker_group)

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        super()._rendezvous(worker_group)
        metrics.on_round(worker_group)

    def _invoke_run(self, role: str = DEFAULT_ROLE) -> RunResult:
        # torch's loop sleeps the interval before each check; ours waits it out in
        # _monitor_workers instead, waking when a worker ends.
        spec = self._worker_group.spec
        self._tick_s, spec.monitor_interval = spec.monitor_interval, 0.0
        try:
            return super()._invoke_run(role)
        except SignalException:
            if self._host is not None:
                self._host.leave(self._worker_group)
            raise
        finally:
            spec.monitor_interval, self._tick_s = self._tick_s, None

    def _wait_for_worker_exit(self, timeout: float) -> None:
        """Sleep up to ``timeout`` seconds, waking as soon as a worker process ends or (in
        place) a worker starts to wait for a new round (its step failed on a lost peer)
        or the handler sees a new membership change (a peer left: the workers wait on it
        in their next collective): every tick of this wait would be added to the
        recovery. The handler's answer is local (its watch keeps it current)."""
        group: WorkerGroup | None = getattr(self, "_worker_group", None)
        host = self._host if group is not None else None
        handler = self._handler() if host is not None else None
        before = handler.membership_change() if handler is not None else None
        deadline = time.monotonic() + timeout
        with contextlib.ExitStack() as stack:
            handles = _exit_handles(getattr(self, "_pcontext", None), stack)
            poller = select.poll()  # one for the whole wait: a tick costs one poll(2)
            for handle in handles:
                poller.register(handle, select.POLLIN)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                step = min(left, WAITING_TICK_S) if host is not None else left
                if handles:
                    if poller.poll(math.ceil(step * 1000)):
                        return
                else:
                    time.sleep(step)
                if host is not None and group is not None and host.any_waiting(group):
                    return
                if host is not None and group is not None and self._look_for_stuck(group, host):
                    return  # a worker named stuck and stopped: gone around (_monitor_workers)
                if handler is not None and handler.membership_change() != before:
                    return
                if self._request is not None and self._request.exists():
                    return  # this node was dropped: probation (_monitor_workers)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        """One tick: gather what the agent sees, decide (:func:`elastic.agent.tick.decide`,
        pure), then do it (:meth:`_dispatch`: every side effect of the tick is there)."""
        if self._tick_s is not None:
            self._wait_for_worker_exit(self._tick_s)
        observation, result = self._observe(worker_group)
        decision = tick.decide(observation)
        if decision.action is tick.Action.RECORD_FAILURE:
            handler = self._handler()
            metrics.on_change("failure")
            if handler is not None:
                self._spend_job_restart(handler)
            observation = dataclasses.replace(
                observation, failure_recorded=True, restarts_left=self._remaining_restarts
            )
            decision = tick.decide(observation)
        return self._dispatch(decision, worker_group, result, observation.request)

    def _observe(self, worker_group: WorkerGroup) -> tuple[tick.Observation, RunResult]:
        """What the tick decides on, and torch's view of the workers (reads only, besides
        taking the probation request and the frozen watch's bookkeeping)."""
        handler, host = self._handler(), self._host
        if self._request is not None and self._request.exists():
            request = probation.take_request(os.getpid())
            if request is not None:
                sitter = self._probation
                can = sitter is not None and host is not None and handler is not None
                observation = tick.Observation(
                    now=time.monotonic(),
                    request=request,
                    can_sit_out=can and host is not None and host.ready(worker_group),
                    has_handler=handler is not None,
                    in_place=host is not None,
                )
                return observation, RunResult(state=worker_group.state)
        self._collect_script_exits()
        result = super()._monitor_workers(worker_group)
        codes = tuple(f.exitcode for f in result.failures.values())
        finished = stopped = None
        if handler is not None and result.state == WorkerState.HEALTHY:
            finished = host is not None and host.finished_before_join(worker_group)
            if not finished:
                stopped = self._stopped_since()
        observation = tick.Observation(
            now=time.monotonic(),
            state=result.state,
            exit_codes=codes,
            has_handler=handler is not None,
            in_place=host is not None,
            finished_before_join=bool(finished),
            stopped_since=stopped or {},
            named_stuck=self._named_stuck if stopped else frozenset(),
            frozen_limit_s=self._frozen.limit_s if self._frozen is not None else FROZEN_S,
            restarts_left=self._remaining_restarts,
        )
        return observation, result

    def _stopped_since(self) -> dict[int, float] | None:
        """When each worker was first seen stopped (SIGSTOP); None before they start."""
        pcontext = getattr(self, "_pcontext", None)
        if pcontext is None:
            return None
        self._frozen = self._frozen or FrozenWatch()
        return self._frozen.observe(pcontext.pids())

    def _look_for_stuck(self, worker_group: WorkerGroup, host: InPlaceHost) -> bool:
        """Whether a local worker is stopped and named stuck by its waiting peers, stopped
        for :data:`~elastic.agent.stuck.CONFIRM_S`; the round's store is read only while a
        worker is stopped (the named pids are kept for the tick's observation)."""
        stopped = self._stopped_since()
        ranks = {w.global_rank: w.id for w in worker_group.workers if stopped and w.id in stopped}
        addr, port = (worker_group.master_addr, worker_group.master_port) if ranks else (None, 0)
        if not addr or not port:
            self._named_stuck = frozenset()
            return False
        self._verdicts = self._verdicts or VerdictReader()
        round_ = host.joined_round()
        self._named_stuck = frozenset(self._verdicts.named(str(addr), int(port), round_, ranks))
        assert stopped is not None
        return bool(stuck_pids(stopped, self._named_stuck, time.monotonic(), CONFIRM_S))

    def _end_stuck_workers(self, handler: MembershipHandler, stuck: tuple[int, ...]) -> None:
        """SIGKILL the workers named stuck and seen stopped (they cannot handle a SIGTERM)."""
        pcontext = getattr(self, "_pcontext", None)
        pids = pcontext.pids() if pcontext is not None else {}
        for pid in stuck:
            logger.warning(
                "Worker %d is stopped and its waiting peers named it stuck; ending it so that "
                "the others go on without this node, which rejoins.",
                pid,
            )
            procs.kill(pid)
            rank = next((r for r, p in pids.items() if p == pid), None)
            events.emit("worker.stuck", pid=pid, local_rank=rank, run_id=handler.get_run_id())
        self._named_stuck = frozenset()

    def _dispatch(
        self,
        decision: tick.Decision,
        worker_group: WorkerGroup,
        result: RunResult,
        request: probation.Request | None,
    ) -> RunResult:
        """Do what the tick decided; the one place its side effects live."""
        action, handler, host = decision.action, self._handler(), self._host
        if action is tick.Action.LEAVE_JOB:
            return self._leave_job(worker_group, decision.reason, left=False)
        if action is tick.Action.SIT_OUT and handler is not None and host is not None:
            if decision.checked and self._probation is not None and request is not None:
                sat = self._probation.sit_out(
                    request,
                    worker_group,
                    host,
                    handler,
                    self._stop_workers,
                    self._initialize_workers,
                )
            else:
                self._end_stuck_workers(handler, decision.end_frozen)
                sat = sit_out_stuck(
                    worker_group,
                    host,
                    handler,
                    self._stop_workers,
                    self._initialize_workers,
                    why=decision.reason,
                )
            return self._back_from_sit_out(worker_group, sat)
        if handler is None or action in (tick.Action.PASS_ON, tick.Action.RESTART):
            return result
        if action is tick.Action.SUCCEEDED:
            return self._finished_before_join(worker_group, handler)
        if action is tick.Action.REFORM:
            logger.info("Workers stopped for a membership change; re-forming the group.")
            metrics.on_change("reform")
            events.emit("worker.restart", reason="reform", run_id=handler.get_run_id())
            handler.request_reform()
            return RunResult(state=WorkerState.HEALTHY)
        if action is not tick.Action.KEEP_GOING:
            return result
        self._end_frozen_workers(handler, decision.end_frozen)
        if host is not None:
            host.ask_for_round_if_wanted(worker_group)
            host.report_round(worker_group)  # the closer's in-place rule
            if self._probation is not None:  # its baseline, timed while training is steady
                self._probation.observe(host.running_round(), handler.get_run_id())
        self._note_change(handler)  # torch then asks num_nodes_waiting() and restarts
        return result

    def _back_from_sit_out(self, worker_group: WorkerGroup, sat: SatOut) -> RunResult:
        """HEALTHY once rejoined; SUCCEEDED when the job finished meanwhile; else this node
        leaves the job (:meth:`_leave_job`)."""
        if sat.ending is Ending.REJOINED:
            self._change = None
            return RunResult(state=WorkerState.HEALTHY)
        if sat.ending is Ending.LEFT:
            return self._leave_job(worker_group, sat.reason, left=True)
        values: dict[int, Any] = {w.global_rank: None for w in worker_group.workers}
        return RunResult(state=WorkerState.SUCCEEDED, return_values=values)

    def _finished_before_join(
        self, worker_group: WorkerGroup, handler: MembershipHandler
    ) -> RunResult:
        """The job finished before our workers joined it: stop them, and end with 0."""
        logger.warning(
            "The job finished before this node's workers joined it; nothing is left to "
            "train, so they stop and this node exits."
        )
        events.emit("job.finished", run_id=handler.get_run_id())
        self._stop_workers(worker_group)
        values: dict[int, Any] = {w.global_rank: None for w in worker_group.workers}
        return RunResult(state=WorkerState.SUCCEEDED, return_values=values)

    def _leave_job(self, worker_group: WorkerGroup, reason: str, *, left: bool) -> RunResult:
        """This node leaves the job for good on its own (dropped as a straggler without
        probation, or probation gave up) while the others go on: it leaves the rendezvous
        (unless it ``left`` already, sitting out), stops its workers and ends the run with
        its result (exit 0); the handler keeps the rendezvous open for the others when
        torch's launcher shuts it down, and no exit barrier waits for them."""
        logger.warning("This node leaves the job: %s.", reason)
        handler, host = self._handler(), self._host
        if not left and host is not None:
            host.leave(worker_group)
        if not left and handler is not None and not (host is not None and host.left):
            try:
                handler.leave()
            except Exception as exc:  # the others drop us at heartbeat expiry instead
                logger.warning("Could not leave the rendezvous: %s", exc)
        if handler is not None:
            handler.keep_open()
        else:  # torch's own handler: its shutdown() would close the rendezvous for all
            spec = worker_group.spec
            spec.rdzv_handler = cast(RendezvousHandler, _KeptOpen(spec.rdzv_handler))
        self._left = reason
        self._stop_workers(worker_group)
        values: dict[int, Any] = {w.global_rank: None for w in worker_group.workers}
        return RunResult(state=WorkerState.SUCCEEDED, return_values=values)

    def _exit_barrier(self) -> None:
        """torch's wait (up to 300 s) for every agent of the round to finish, unless this
        node left the job on its own (the others go on), or our workers ended in an older
        round than this node joined last: a join formed as the job finished, and the
        joiner's agent would not reach the barrier in time."""
        if self._left is not None:
            return
        if self._probation is not None and self._probation.finished:
            return  # the job finished while this node sat out: it holds no round
        host = self._host
        if host is not None and host.ended_before_round(self._worker_group):
            logger.warning(
                "Our workers ended before round %d formed (a join as the job finished); "
                "not waiting for its other agents at the exit barrier.",
                host.joined_round(),
            )
            return
        super()._exit_barrier()

    def _collect_script_exits(self) -> None:
        """Hand torch the (None) return value of each forked script that ended with 0.

        A forked script closes the descriptors it inherited, torch's return-value queue
        among them, as a fresh process has none (:mod:`elastic.agent.plain_script`), and
        ends without returning to torch's wrapper; torch's context waits for a value from
        every worker before it reports the group done. torch's own workers (ours, a
        function entrypoint) put theirs before they exit: their queue is not empty then.
        """
        pcontext = getattr(self, "_pcontext", None)
        processes = getattr(getattr(pcontext, "_pc", None), "processes", None)
        queues = getattr(pcontext, "_ret_vals", None)
        values = getattr(pcontext, "_return_values", None)
        if not processes or queues is None or values is None:
            return  # not a forked group (a cold start: torch reads the exit codes)
        for rank, proc in enumerate(processes):
            if rank not in values and proc.exitcode == 0 and queues[rank].empty():
                queues[rank].put(None)

    def _end_frozen_workers(self, handler: MembershipHandler, frozen: tuple[int, ...]) -> None:
        """SIGKILL the workers stopped for the frozen limit: the next check sees them failed."""
        pcontext = getattr(self, "_pcontext", None)
        if pcontext is None or not frozen or self._frozen is None:
            return
        pids = pcontext.pids()
        self._frozen.kill(list(frozen))
        for pid in frozen:
            rank = next(r for r, p in pids.items() if p == pid)
            events.emit(
                "worker.frozen",
                pid=pid,
                local_rank=rank,
                seconds=self._frozen.limit_s,
                run_id=handler.get_run_id(),
            )

    def _note_change(self, handler: MembershipHandler) -> None:
        """Ask the handler whether the group must re-form; log and record why, once."""
        change = handler.membership_change()
        if change is None or change == self._change:
            return
        self._change = change
        metrics.on_change(change.kind.value)
        run_id = handler.get_run_id()
        if change.kind is ChangeKind.PEERS_LOST:
            logger.warning(
                "Peers %s of round %s are gone; re-forming the group.",
                list(change.nodes),
                change.round,
            )
            events.emit("node.lost", run_id=run_id, round=change.round, nodes=list(change.nodes))
        elif change.kind is ChangeKind.DROPPED:
            logger.warning(
                "This node is no longer a participant of round %s of the rendezvous "
                "'%s' (an etcd outage or missed heartbeats); it will rejoin.",
                change.round,
                run_id,
            )
            events.emit("rdzv.dropped", run_id=run_id, round=change.round)

    def _spend_job_restart(self, handler: MembershipHandler) -> None:
        """Make ``--max-restarts`` a budget of the whole job, kept in etcd, not per agent."""
        used = handler.record_failed_round()
        if used is None:
            return
        budget = self._worker_group.spec.max_restarts
        # torch restarts while _remaining_restarts > 0, then decrements it.
        self._remaining_restarts = budget - used + 1 if used <= budget else 0
        metrics.on_restarts(used, budget)
        events.emit(
            "worker.restart",
            reason="failure",
            run_id=handler.get_run_id(),
            job_restarts_used=used,
            job_restart_budget=budget,
        )
        if used > budget:
            logger.error(
                "The job has failed %d times, over its budget of %d restarts; stopping.",
                used,
                budget,
            )

    def run(self, role: str = "default") -> Any:
        _prepare_node()
        self._probation = Probation.from_env()  # its baseline: timed while training
        self._request = request_path(os.getpid())
        try:
            return super().run(role)
        except SignalException as exc:
            handler = self._handler()
            if handler is not None and not (self._host is not None and self._host.left):
                logger.warning("Received %s: leaving the rendezvous.", exc.sigval)
                try:
                    handler.leave()
                except Exception as leave_exc:  # the others will notice by heartbeat expiry
                    logger.warning("Could not leave the rendezvous: %s", leave_exc)
            raise
        finally:
            nodelocal.remove_owned(os.getpid())  # snapshots, channels, marker


def _prepare_node(base: str = nodelocal.DEFAULT_BASE) -> None:
    """Remove what agents killed with -9 on this node left and make this agent's private
    directory. Never raises: a node-local problem must not stop the agent from starting."""
    snapshot.remove_orphans(base)
    channel.remove_orphans(base)
    try:
        nodelocal.directory(os.getpid(), base)
    except OSError as exc:  # the workers refuse their snapshots with the same sentence
        logger.warning("%s", exc)


def _exit_handles(pcontext: Any, stack: contextlib.ExitStack) -> list[Any]:
    """What becomes ready when one of ``pcontext``'s running workers ends: the process
    sentinels torch itself joins on (workers started as functions, warm starts), or a
    pidfd per running process (workers started as commands); [] if neither is known."""
    sentinels = getattr(getattr(pcontext, "_pc", None), "sentinels", None)
    if sentinels:
        return list(sentinels)
    handlers = getattr(pcontext, "subprocess_handlers", None) or {}
    fds = []
    for handler in handlers.values():
        proc = getattr(handler, "proc", None)
        if proc is None or proc.returncode is not None:
            continue
        try:
            fd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):  # no pidfd here (old kernel): torch's sleep
            return []
        stack.callback(os.close, fd)
        fds.append(fd)
    return fds


class _ReformIsNotAFailure(logging.Filter):
    """torch logs every non-zero worker exit as an error with a traceback; a worker that
    exits 75 to re-form the group is expected, so say so in one line at INFO."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        msg = record.msg if isinstance(record.msg, str) else ""
        if msg.startswith("failed (exitcode") and args and args[0] == reform.EXIT_CODE:
            record.levelno, record.levelname, record.exc_info = logging.INFO, "INFO", None
            record.msg, record.args = (
                "Worker (pid %s) stopped for the group to re-form.",
                (args[2],),
            )
        return True


class _FailureWithoutTorchsFormatter(logging.Filter):
    """A forked (warm) worker's failure is logged with torch's exception attached, and torch's
    log formatter imports ``torch._dynamo`` to format any traceback: seconds of this agent's
    time, the first time, between a worker's death and its restart. The traceback is of
    torch's own join (what the worker raised is in the exception's message): keep the
    message, drop the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg if isinstance(record.msg, str) else ""
        if msg.startswith("failed (exitcode") and record.exc_info:
            exc = record.exc_info[1]
            record.exc_info, record.exc_text = None, None
            if exc is not None and str(exc).strip():
                args = record.args if isinstance(record.args, tuple) else ()
                record.msg, record.args = msg + ": %s", (*args, str(exc).strip())
        return True


class _RedactPasswords(logging.Filter):
    """torch's launcher logs the rendezvous options at INFO: never a password among them."""

    _PATTERN = re.compile(r"""(password['"]?\s*[:=]\s*['"]?)[^'",\s}]+""")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "password" in message:
            record.msg, record.args = self._PATTERN.sub(r"\1***", message), None
        return True


def install() -> None:
    """Make torch's launcher build :class:`NodeAgent` (``launch_agent`` looks the name up)."""
    from torch.distributed.elastic.multiprocessing import api as mp_api
    from torch.distributed.launcher import api as launcher_api

    launcher_api.LocalElasticAgent = NodeAgent  # type: ignore[misc]
    mp_api.logger.addFilter(_FailureWithoutTorchsFormatter())
    mp_api.logger.addFilter(_ReformIsNotAFailure())
    launcher_api.logger.addFilter(_RedactPasswords())


__all__ = ["LOST_PEER_GRACE_S", "WAITING_TICK_S", "NodeAgent", "install"]
