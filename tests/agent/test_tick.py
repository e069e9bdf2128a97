"""The agent's tick (elastic.agent.tick), table-style with a fake clock: each row is an
observation and the action, parameters and reason expected, one row per branch of
``NodeAgent._monitor_workers``. No process, no etcd: decide is a pure function."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from torch.distributed.elastic.agent.server.api import WorkerState

from elastic.agent import tick
from elastic.agent.tick import Action, Observation
from elastic.node import reform
from elastic.worker.probation import Request

NOW = 1000.0  # the fake clock's time
REQUEST = Request(step=12, ratio=2.4, median_s=0.06, reason="node 7 at 2.4x")
HEALTHY, FAILED = WorkerState.HEALTHY, WorkerState.FAILED


def seen(**fields: object) -> Observation:
    """An observation at ``NOW`` of an in-place agent with our handler."""
    base = Observation(now=NOW, in_place=True)
    return replace(base, **fields)  # type: ignore[arg-type]


def failed(*codes: int, recorded: bool = True, left: int = 2, **fields: object) -> Observation:
    return seen(
        state=FAILED, exit_codes=codes, failure_recorded=recorded, restarts_left=left, **fields
    )


@dataclass(frozen=True)
class Row:
    name: str
    observation: Observation
    action: Action
    reason: str  # a fragment of the reason
    end_frozen: tuple[int, ...] = ()
    checked: bool = True


ROWS = [
    # a probation request comes first, whatever the workers' state
    Row("straggler, can sit out", seen(request=REQUEST, can_sit_out=True), Action.SIT_OUT,
        "sits out on probation"),
    Row("straggler, probation off or not in place", seen(request=REQUEST), Action.LEAVE_JOB,
        "cannot sit out"),
    Row("straggler, no handler of ours", seen(request=REQUEST, has_handler=False),
        Action.LEAVE_JOB, "node 7 at 2.4x"),
    # not our rendezvous handler: torch's answer, whatever it is
    Row("torch's handler, healthy", seen(state=HEALTHY, has_handler=False), Action.PASS_ON,
        "not ours"),
    Row("torch's handler, failed", seen(state=FAILED, exit_codes=(1,), has_handler=False),
        Action.PASS_ON, "not ours"),
    # healthy workers
    Row("finished before our workers joined", seen(state=HEALTHY, finished_before_join=True),
        Action.SUCCEEDED, "finished before"),
    Row("healthy", seen(state=HEALTHY), Action.KEEP_GOING, "healthy"),
    Row("healthy, a worker stopped under the limit",
        seen(state=HEALTHY, stopped_since={41: NOW - 2.9}), Action.KEEP_GOING, "healthy"),
    Row("healthy, workers frozen for the limit",
        seen(state=HEALTHY, stopped_since={43: NOW - 3.0, 41: NOW - 9.0, 42: NOW - 0.5}),
        Action.KEEP_GOING, "[41, 43]", end_frozen=(41, 43)),
    Row("healthy, a shorter frozen limit",
        seen(state=HEALTHY, stopped_since={41: NOW - 1.0}, frozen_limit_s=1.0),
        Action.KEEP_GOING, "[41]", end_frozen=(41,)),
    # a worker its waiting peers named stuck: gone around only when also seen stopped
    Row("healthy, named stuck and stopped",
        seen(state=HEALTHY, stopped_since={41: NOW - 0.1, 42: NOW - 5.0},
             named_stuck=frozenset({41, 42})),
        Action.SIT_OUT, "named them stuck", end_frozen=(41, 42), checked=False),
    Row("healthy, named stuck, stopped under the confirmation",
        seen(state=HEALTHY, stopped_since={41: NOW - 0.05}, named_stuck=frozenset({41})),
        Action.KEEP_GOING, "healthy"),
    Row("healthy, named stuck but running (a hostile or late verdict)",
        seen(state=HEALTHY, stopped_since={42: NOW - 1.0}, named_stuck=frozenset({41})),
        Action.KEEP_GOING, "healthy"),
    Row("healthy, named stuck and frozen, not in place",
        seen(state=HEALTHY, stopped_since={41: NOW - 3.0}, named_stuck=frozenset({41}),
             in_place=False),
        Action.KEEP_GOING, "[41]", end_frozen=(41,)),
    # neither healthy nor a failure with failed workers named: torch's answer
    Row("succeeded", seen(state=WorkerState.SUCCEEDED), Action.PASS_ON, "succeeded"),
    Row("unhealthy", seen(state=WorkerState.UNHEALTHY), Action.PASS_ON, "unhealthy"),
    Row("failed, no failure named", seen(state=FAILED), Action.PASS_ON, "failed"),
    # failures
    Row("all stopped for a membership change", failed(75, 75, recorded=False), Action.REFORM,
        "membership change"),
    Row("a failure, not yet recorded", failed(1, recorded=False), Action.RECORD_FAILURE,
        "spends a restart"),
    Row("a re-form and a failure, not yet recorded", failed(75, 1, recorded=False),
        Action.RECORD_FAILURE, "spends a restart"),
    Row("stuck, in place, budget left", failed(76, 75), Action.SIT_OUT, "stuck inside a step",
        checked=False),
    Row("stuck, in place, budget spent", failed(76, left=0), Action.RESTART, "0 restart(s)"),
    Row("stuck, not in place", failed(76, in_place=False), Action.RESTART, "[76]"),
    Row("a failure, budget left", failed(1, 75), Action.RESTART, "[1, 75]"),
    Row("a failure, budget spent", failed(-9, left=0), Action.RESTART, "0 restart(s)"),
]  # fmt: skip


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_decide(row: Row) -> None:
    decision = tick.decide(row.observation)
    assert decision.action is row.action, decision
    assert row.reason in decision.reason, decision
    assert decision.end_frozen == row.end_frozen, decision
    assert decision.checked == row.checked, decision


def test_every_action_has_a_row() -> None:
    assert {r.action for r in ROWS} == set(Action)


def test_a_failure_is_recorded_then_decided_again() -> None:
    """The dispatch records a failure, then decides again with the budget it left: the same
    observation, recorded, never asks to record again."""
    first = tick.decide(failed(76, recorded=False, left=5))
    assert first.action is Action.RECORD_FAILURE
    again = tick.decide(failed(76, recorded=True, left=1))
    assert again.action is Action.SIT_OUT and not again.checked
    assert tick.decide(failed(76, recorded=True, left=0)).action is Action.RESTART


def test_the_frozen_verdict_follows_the_clock() -> None:
    """A worker first seen stopped at t=100 is frozen from t=103 on (the 3 s limit)."""
    stopped = {7: 100.0}
    ticks = [(101.0, ()), (102.99, ()), (103.0, (7,)), (150.0, (7,))]
    for now, expected in ticks:
        decision = tick.decide(seen(now=now, state=HEALTHY, stopped_since=stopped))
        assert decision.end_frozen == expected, (now, decision)


def test_the_stuck_verdict_follows_the_clock() -> None:
    """A worker named stuck and first seen stopped at t=100 is gone around 0.1 s later
    (CONFIRM_S) and not before; a continue (no longer stopped) takes it out of the verdict."""
    named = frozenset({7})
    ticks = [(100.0, {7: 100.0}, ()), (100.09, {7: 100.0}, ()), (100.125, {7: 100.0}, (7,)),
             (101.0, {}, ())]  # fmt: skip
    for now, stopped, expected in ticks:
        decision = tick.decide(
            seen(now=now, state=HEALTHY, stopped_since=stopped, named_stuck=named)
        )
        assert decision.end_frozen == expected, (now, decision)
        assert (decision.action is Action.SIT_OUT) == bool(expected), (now, decision)


def test_reform_exit_code_is_75() -> None:
    assert (reform.EXIT_CODE, reform.HUNG) == (75, 76)


class _Host:
    def __init__(self) -> None:
        self.left, self.leaves = True, 0

    def leave(self, group: object) -> None:
        self.leaves += 1


class _Handler:
    def __init__(self) -> None:
        self.leaves = 0

    def leave(self) -> None:
        self.leaves += 1


def test_a_stuck_worker_is_a_probation_without_a_check() -> None:
    """The stuck path is the one "leave, then rejoin" path, with no health check: it leaves
    the rendezvous at once (its workers are stopped, not told), sits out STUCK_REJOIN_S and
    rejoins; a rendezvous closed meanwhile ends it FINISHED."""
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

    from elastic.agent.probation import STUCK_REJOIN_S, Ending, sit_out_stuck

    done: list[str] = []
    host, handler, group = _Host(), _Handler(), object()

    def rejoin(g: object) -> None:
        done.append("rejoin")

    sat = sit_out_stuck(
        group,  # type: ignore[arg-type]
        host,  # type: ignore[arg-type]
        handler,  # type: ignore[arg-type]
        lambda g: done.append("stop"),
        rejoin,
        sleep=lambda s: done.append(f"sleep {s:g}"),
    )
    assert sat.ending is Ending.REJOINED, sat
    assert done == ["stop", f"sleep {STUCK_REJOIN_S:g}", "rejoin"], done
    assert (handler.leaves, host.leaves, host.left) == (1, 0, False)

    def closed(g: object) -> None:
        raise RendezvousClosedError

    sat = sit_out_stuck(group, host, handler, lambda g: None, closed, sleep=lambda s: None)  # type: ignore[arg-type]
    assert sat.ending is Ending.FINISHED and "finished" in sat.reason, sat
