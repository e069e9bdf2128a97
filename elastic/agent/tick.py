"""The agent's tick: what :class:`elastic.agent.node.NodeAgent` does after each look at its
workers, as a pure function of a frozen :class:`Observation`.

Nothing here does I/O or reads a clock. ``NodeAgent._monitor_workers`` gathers the
observation (torch's view of the workers, the probation request this node's lowest rank
left, how long each worker has been stopped, the restart budget, ``now``), calls
:func:`decide` and executes the :class:`Decision`; every side effect lives in that
dispatch. The rules, in order:

* **A probation request** (this node was dropped as a straggler) comes first: sit out on
  probation (:attr:`Action.SIT_OUT`, health-checked) when the node can (probation on, the
  workers in place), else leave the job (:attr:`Action.LEAVE_JOB`, exit 0).
* **Without our rendezvous handler** torch's answer stands (:attr:`Action.PASS_ON`).
* **Healthy workers** go on (:attr:`Action.KEEP_GOING`), ending those stopped (SIGSTOP) for
  the frozen limit, unless the job finished before they joined it
  (:attr:`Action.SUCCEEDED`), or a worker is stuck: named by its waiting peers and seen
  stopped (:func:`elastic.agent.stuck.stuck_pids`); in place, that worker is ended at once
  and the node sits out without a health check and rejoins (:attr:`Action.SIT_OUT` with
  ``checked=False``), spending no restart.
* **Workers that all exited 75** stopped for a membership change: re-form without spending
  a restart (:attr:`Action.REFORM`).
* **Any other failure** is first recorded in the job's restart budget
  (:attr:`Action.RECORD_FAILURE`; the dispatch decides again with the budget left). Then a
  worker that ended itself stuck inside a step (exit 76) makes the node sit out without a
  health check and rejoin (:attr:`Action.SIT_OUT` with ``checked=False``) while the budget
  lasts and the workers run in place; else torch restarts or fails the group by its budget
  (:attr:`Action.RESTART`).
* Anything else (succeeded, a failure with no failed worker named) is torch's answer
  (:attr:`Action.PASS_ON`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType

from torch.distributed.elastic.agent.server.api import WorkerState

from elastic.agent.frozen import FROZEN_S, frozen_pids
from elastic.agent.stuck import CONFIRM_S, stuck_pids
from elastic.node import reform
from elastic.worker.probation import Request


class Action(str, Enum):
    """What the agent does with this tick."""

    KEEP_GOING = "keep_going"  # healthy: end frozen workers, report, torch asks for nodes waiting
    PASS_ON = "pass_on"  # torch's result as it is
    SUCCEEDED = "succeeded"  # the job finished before our workers joined: stop them, exit 0
    REFORM = "reform"  # the workers stopped for a membership change: re-form, no restart spent
    RECORD_FAILURE = "record_failure"  # spend a job restart, then decide again
    RESTART = "restart"  # torch's result: it restarts within its budget, else fails
    SIT_OUT = "sit_out"  # leave the round, sit out (checked or not), rejoin
    LEAVE_JOB = "leave_job"  # leave the job for good (exit 0, the rendezvous stays open)


@dataclass(frozen=True)
class Observation:
    """What the agent saw this tick. ``state`` None: the workers were not polled (a
    probation request came first)."""

    now: float  # monotonic seconds, the caller's clock
    state: WorkerState | None = None  # torch's RunResult.state
    exit_codes: tuple[int, ...] = ()  # of the failed workers (RunResult.failures)
    has_handler: bool = True  # the rendezvous handler is ours (a MembershipHandler)
    in_place: bool = False  # this agent offers in-place re-forms (it has an InPlaceHost)
    request: Request | None = None  # a probation request taken this tick
    can_sit_out: bool = False  # probation on, and every local worker is in place and alive
    finished_before_join: bool = False  # the rendezvous closed before our workers joined
    stopped_since: Mapping[int, float] = field(default_factory=lambda: MappingProxyType({}))
    frozen_limit_s: float = FROZEN_S  # a worker stopped this long is frozen
    named_stuck: frozenset[int] = frozenset()  # pids the waiting ranks named stuck
    stuck_confirm_s: float = CONFIRM_S  # a named worker stopped this long is stuck
    failure_recorded: bool = False  # this tick's failure is in the job's restart budget
    restarts_left: int = 0  # torch's _remaining_restarts, after the failure was recorded


@dataclass(frozen=True)
class Decision:
    """:func:`decide`'s answer: the action, its parameters, and a sentence for the log."""

    action: Action
    reason: str
    end_frozen: tuple[int, ...] = ()  # the pids to SIGKILL: frozen (KEEP_GOING), stuck (SIT_OUT)
    checked: bool = True  # SIT_OUT: run the health check (a straggler) or not (stuck)


def decide(obs: Observation) -> Decision:
    """What the agent does after this look at its workers (see the module)."""
    if obs.request is not None:
        if obs.can_sit_out:
            return Decision(
                Action.SIT_OUT,
                f"this node was dropped as a straggler ({obs.request.reason}); it sits out "
                "on probation",
            )
        return Decision(
            Action.LEAVE_JOB,
            f"this node is slow ({obs.request.reason}) and cannot sit out (probation off, or "
            "its workers not in place); it leaves the job",
        )
    if not obs.has_handler:
        return Decision(Action.PASS_ON, "the rendezvous handler is not ours: torch's answer")
    if obs.state == WorkerState.HEALTHY:
        if obs.finished_before_join:
            return Decision(
                Action.SUCCEEDED,
                "the job finished before this node's workers joined it; nothing is left to train",
            )
        stuck = tuple(stuck_pids(obs.stopped_since, obs.named_stuck, obs.now, obs.stuck_confirm_s))
        if stuck and obs.in_place:
            return Decision(
                Action.SIT_OUT,
                f"workers {list(stuck)} are stopped and their waiting peers named them stuck: "
                "they are ended",
                end_frozen=stuck,
                checked=False,
            )
        frozen = tuple(frozen_pids(obs.stopped_since, obs.now, obs.frozen_limit_s))
        reason = "the workers are healthy"
        if frozen:
            reason += f"; workers {list(frozen)} have been stopped for the frozen limit"
        return Decision(Action.KEEP_GOING, reason, end_frozen=frozen)
    if obs.state != WorkerState.FAILED or not obs.exit_codes:
        return Decision(Action.PASS_ON, f"the workers are {_name(obs.state)}: torch's answer")
    if all(code == reform.EXIT_CODE for code in obs.exit_codes):
        return Decision(Action.REFORM, "the workers stopped for a membership change")
    if not obs.failure_recorded:
        return Decision(Action.RECORD_FAILURE, "a worker failed: the job spends a restart")
    if reform.HUNG in obs.exit_codes and obs.in_place and obs.restarts_left > 0:
        return Decision(
            Action.SIT_OUT,
            "a worker was stuck inside a step and ended itself; this node leaves its round "
            "so that the others go on, and rejoins",
            checked=False,
        )
    return Decision(
        Action.RESTART,
        f"a worker failed (exit codes {sorted(set(obs.exit_codes))}); "
        f"{obs.restarts_left} restart(s) left",
    )


def _name(state: WorkerState | None) -> str:
    return "not polled" if state is None else state.name.lower()


__all__ = ["Action", "Decision", "Observation", "decide"]
