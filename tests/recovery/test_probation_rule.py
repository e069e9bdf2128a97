"""Probation's rule (elastic.worker.probation.decide), table-tested with a fake clock; the
request a dropped node's worker leaves for its agent; the agent's probe."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest

from elastic.agent.probation import Ending
from elastic.errors import ConfigError
from elastic.node import nodelocal
from elastic.worker import probation
from elastic.worker.probation import Action, History, Options, Request, decide

OPTS = Options(first_s=5.0, cap_s=20.0, max_failures=4, pass_ratio=1.5, max_probations=3)
INF = math.inf


def _walk(
    measurements: list[float], baseline: float | None = 1.0, probations: int = 1
) -> list[tuple[Action, float | None]]:
    """Enter at t=0, then run each check when the previous decision said: (action, the
    next check's time) per step, the entry first."""
    history = History(0.0, baseline, probations)
    first = decide(history, None, 0.0, OPTS)
    out = [(first.action, first.next_check_at)]
    now = first.next_check_at
    for seconds in measurements:
        assert now is not None
        d = decide(history, seconds, now, OPTS)
        history = d.history
        out.append((d.action, d.next_check_at))
        now = d.next_check_at
    return out


W, R, L = Action.WAIT, Action.REJOIN, Action.LEAVE


@pytest.mark.parametrize(
    ("measurements", "expected"),
    [
        ([1.2], [(W, 5.0), (R, None)]),  # healthy at the first check: rejoin
        ([1.5], [(W, 5.0), (R, None)]),  # at the bound: passes
        ([3.0, 1.0], [(W, 5.0), (W, 15.0), (R, None)]),  # back-off 10 s, then passes
        ([3.0, INF, 1.1], [(W, 5.0), (W, 15.0), (W, 35.0), (R, None)]),  # 10, 20 (cap)
        ([3.0, 3.0, 3.0, 3.0], [(W, 5.0), (W, 15.0), (W, 35.0), (W, 55.0), (L, None)]),
        ([INF] * 4, [(W, 5.0), (W, 15.0), (W, 35.0), (W, 55.0), (L, None)]),  # a failed probe
    ],
)
def test_checks_back_off_and_end(
    measurements: list[float], expected: list[tuple[Action, float | None]]
) -> None:
    assert _walk(measurements) == expected


def test_the_backoff_doubles_to_its_cap() -> None:
    assert [probation.backoff(n, OPTS) for n in range(4)] == [5.0, 10.0, 20.0, 20.0]
    defaults = Options()
    assert [probation.backoff(n, defaults) for n in range(1, 5)] == [10.0, 20.0, 40.0, 60.0]


def test_without_a_baseline_a_probe_that_completes_passes() -> None:
    assert _walk([7.0], baseline=None)[-1] == (R, None)
    assert _walk([INF, 7.0], baseline=None)[-1] == (R, None)


def test_the_third_probation_leaves_at_once() -> None:
    assert _walk([], probations=2) == [(W, 5.0)]
    first = decide(History(0.0, 1.0, 3), None, 0.0, OPTS)
    assert first.action is L and "keeps being dropped" in first.reason


def test_reasons_say_what_was_measured() -> None:
    history = History(0.0, 0.1, 1)
    failed = decide(history, 0.3, 5.0, OPTS)
    assert "0.300 s, 3.00x its healthy 0.100 s (above 1.5x)" in failed.reason
    assert "next check in 10 s" in failed.reason
    assert failed.history.checks[-1] == probation.Check(5.0, 0.3, False)
    passed = decide(failed.history, 0.1, 15.0, OPTS)
    assert passed.action is R and "within 1.5x" in passed.reason
    gone = decide(History(0.0, 0.1, 1), INF, 5.0, Options(max_failures=1))
    assert gone.action is L and "failed or ran past its timeout" in gone.reason


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, Options()),
        ("on", Options()),
        ("off", Options(enabled=False)),
        ("1,2,4", Options(first_s=1.0, cap_s=2.0, max_failures=4)),
    ],
)
def test_options_from_env(raw: str | None, expected: Options) -> None:
    environ = {} if raw is None else {probation.ENV: raw}
    assert probation.options_from_env(environ) == expected


@pytest.mark.parametrize("raw", ["5", "5,60", "a,b,c", "0,1,1", "5,2,1", "5,60,0"])
def test_bad_options_are_refused(raw: str) -> None:
    with pytest.raises(ConfigError, match="ELASTIC_PROBATION"):
        probation.options_from_env({probation.ENV: raw})


def test_the_request_reaches_the_agent_once(tmp_path: Path) -> None:
    base, owner = str(tmp_path), os.getpid()
    assert probation.take_request(owner, base) is None
    request = Request(step=41, ratio=3.1, median_s=0.05, reason="node 7 at 3.1x")
    path = probation.write_request(owner, request, base)
    assert path.stat().st_mode & 0o077 == 0
    assert probation.take_request(owner, base) == request
    assert probation.take_request(owner, base) is None  # taken: removed
    nodelocal.write_whole(path, b"not json")
    assert probation.take_request(owner, base) is None and not path.exists()


@pytest.mark.integration
def test_probes() -> None:
    from elastic.agent import probation as agent_probation

    seconds = agent_probation.builtin_workload(iterations=2, repeats=1)
    assert 0 < seconds < 5
    number = f"{sys.executable} -c 'print(0.25)'"
    assert agent_probation.run_command(number) == 0.25
    wall = agent_probation.run_command(f"{sys.executable} -c 'print(\"ok\")'")
    assert 0 < wall < 30
    assert agent_probation.run_command(f"{sys.executable} -c 'raise SystemExit(3)'") == INF
    assert agent_probation.run_command("/nonexistent/probe") == INF
    slow = f"{sys.executable} -c 'import time; time.sleep(5)'"
    assert agent_probation.run_command(slow, timeout_s=0.2) == INF


class _Host:
    def __init__(self) -> None:
        self.left = False
        self.leaves = 0

    def leave(self, worker_group: object) -> None:
        self.left, self.leaves = True, self.leaves + 1

    def joined_round(self) -> int:
        return 4


class _Handler:
    def __init__(self, closed_after: int | None = None) -> None:
        self.asked, self.closed_after = 0, closed_after

    def get_run_id(self) -> str:
        return "job"

    def is_closed(self) -> bool:
        self.asked += 1
        return self.closed_after is not None and self.asked > self.closed_after


def _sitter(seconds: list[float], options: Options = OPTS):  # type: ignore[no-untyped-def]
    """A Probation on a fake clock that sleeps by advancing it; the probe returns
    ``seconds`` in turn (each run at the clock's time, recorded)."""
    from elastic.agent.probation import Probation

    clock = [100.0]
    ran: list[float] = []

    def probe() -> float:
        ran.append(clock[0])
        return seconds[len(ran) - 1]

    def sleep(s: float) -> None:
        clock[0] += s

    sitter = Probation(options, probe, clock=lambda: clock[0], sleep=sleep)
    sitter.baseline_s = 1.0
    return sitter, ran


def _group():  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    worker = SimpleNamespace(id=None, global_rank=2, world_size=3)
    return SimpleNamespace(workers=[worker], group_world_size=3, state=None)


REQUEST = Request(step=12, ratio=2.4, median_s=0.06, reason="node 7 at 2.4x")


def test_sit_out_leaves_checks_with_backoff_and_rejoins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from elastic import events

    monkeypatch.setenv("ELASTIC_EVENT_LOG", str(tmp_path / "events.jsonl"))
    sitter, ran = _sitter([3.0, 3.0, 1.0])
    host = _Host()
    stopped: list[object] = []
    rejoined: list[object] = []
    group = _group()
    sat = sitter.sit_out(
        REQUEST,
        group,
        host,
        _Handler(),
        stopped.append,
        rejoined.append,
    )
    assert sat.ending is Ending.REJOINED, sat
    assert host.leaves == 1 and not host.left  # left in place, then back
    assert stopped == [group] and rejoined == [group]
    assert ran == [105.0, 115.0, 135.0]  # first_s 5, then 10, 20
    log = tmp_path / "events.jsonl"
    entered = events.read(log, "node.probation")[0]
    assert (entered["step"], entered["ratio"], entered["next_check_in"]) == (12, 2.4, 5.0)
    checks = events.read(log, "probation.check")
    assert [(c["passed"], c["next_check_in"]) for c in checks] == [
        (False, 10.0),
        (False, 20.0),
        (True, None),
    ]
    back = events.read(log, "node.rejoin")[0]
    assert (back["round"], back["world_size"], back["checks"]) == (4, 3, 3)


def test_sit_out_gives_up_after_the_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from elastic import events

    monkeypatch.setenv("ELASTIC_EVENT_LOG", str(tmp_path / "events.jsonl"))
    sitter, ran = _sitter([INF] * 4)
    rejoined: list[object] = []
    sat = sitter.sit_out(REQUEST, _group(), _Host(), _Handler(), lambda g: None, rejoined.append)
    assert sat.ending is Ending.LEFT and "4 failed check" in sat.reason, sat
    assert len(ran) == 4 and rejoined == []
    gave_up = events.read(tmp_path / "events.jsonl", "probation.gave_up")[0]
    assert gave_up["checks"] == 4 and "for good" in gave_up["reason"]
    # the third probation of this agent leaves at once, before leaving the round
    sitter.count = 2
    host = _Host()
    sat = sitter.sit_out(REQUEST, _group(), host, _Handler(), lambda g: None, rejoined.append)
    assert sat.ending is Ending.LEFT and "keeps being dropped" in sat.reason, sat
    assert host.leaves == 0  # the agent's planned leave does it


def test_sit_out_ends_when_the_job_finishes() -> None:
    sitter, ran = _sitter([3.0])
    sat = sitter.sit_out(
        REQUEST,
        _group(),
        _Host(),
        _Handler(closed_after=3),
        lambda g: None,
        lambda g: None,
    )
    assert sat.ending is Ending.FINISHED and sitter.finished and ran == []


# -- the baseline: timed while training is steady --------------------------------------------

SETTLE, GAP, N = probation.BASELINE_SETTLE_S, probation.BASELINE_GAP_S, probation.BASELINE_SAMPLES


def _looks(looks: list[tuple[float, int | None]]) -> list[float]:
    """Feed ``(now, running round)`` looks to :func:`probation.baseline_due`, each probe
    taking 0.1 s; the times at which it said to probe."""
    baseline, probed = probation.Baseline(), []
    for now, running in looks:
        decision = probation.baseline_due(baseline, running, now)
        baseline = decision.baseline
        if decision.probe:
            probed.append(now)
            baseline = baseline.with_sample(0.1)
    return probed


@pytest.mark.parametrize(
    ("looks", "probed"),
    [
        # as the agent starts (no round in place yet) nothing; then SETTLE s after the round
        # runs in place, N probes GAP s apart, then never again
        (
            [(t * 0.5, None if t < 4 else 1) for t in range(60)],
            [2 + SETTLE + i * GAP for i in range(N)],
        ),
        # a re-form (round 1 -> 2) before the settle starts the wait anew
        (
            [(0.0, 1), (SETTLE - 0.1, 1), (SETTLE, 2), (2 * SETTLE - 0.1, 2), (2 * SETTLE, 2)],
            [2 * SETTLE],
        ),
        # so does a tick with no round in place (workers waiting for a new round)
        ([(0.0, 1), (1.0, None), (SETTLE, 1), (SETTLE + 1.0, 1), (2 * SETTLE, 1)], [2 * SETTLE]),
        ([(0.0, None), (100.0, None)], []),  # never in place: no baseline (checks then pass)
    ],
)
def test_the_baseline_is_timed_once_training_is_steady(
    looks: list[tuple[float, int | None]], probed: list[float]
) -> None:
    assert _looks(looks) == probed


def test_the_baseline_is_the_median_of_the_probes_that_completed() -> None:
    b = probation.Baseline()
    assert b.seconds is None and not b.done
    b = b.with_sample(0.3).with_sample(INF).with_sample(0.1)
    assert b.done and b.seconds == pytest.approx(0.2)
    assert probation.baseline_due(b, 1, 1000.0).reason == "the baseline is taken"
    assert probation.Baseline(samples=(INF,)).seconds is None


def test_the_agent_times_its_baseline_while_training_and_not_across_a_reform(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Probation.observe on a fake clock: no probe as the agent starts; N probes once its
    round ran in place SETTLE s (each a probation.baseline event), their median the
    baseline a check is held to; a probe that spans a re-form is not kept."""
    from elastic import events
    from elastic.agent.probation import Probation

    monkeypatch.setenv("ELASTIC_EVENT_LOG", str(tmp_path / "events.jsonl"))
    clock, seconds = [0.0], iter([0.2, 0.1, 0.3])
    pending: list[object] = []
    sitter = Probation(OPTS, lambda: next(seconds), clock=lambda: clock[0], spawn=pending.append)
    assert Probation.from_env() is None  # the straggler policy is off by default

    def tick(at: float, running: int | None) -> None:
        clock[0] = at
        sitter.observe(running, "job")

    tick(0.0, None)
    tick(1.0, 3)
    tick(1.0 + SETTLE - 0.1, 3)
    assert pending == [] and sitter.baseline_s is None
    for i in range(N):
        tick(1.0 + SETTLE + i * GAP, 3)
        assert len(pending) == 1, i
        tick(1.0 + SETTLE + i * GAP + 0.01, 3)  # the probe is still running: no second one
        assert len(pending) == 1
        pending.pop()()  # type: ignore[operator]  # the thread runs the probe
    tick(100.0, 3)  # the last probe is collected; no more probes
    assert pending == [] and sitter.baseline_s == pytest.approx(0.2)
    log = events.read(tmp_path / "events.jsonl", "probation.baseline")
    assert [(e["seconds"], e["samples"], e["round"]) for e in log] == [
        (0.2, 1, 3),
        (0.1, 2, 3),
        (0.3, 3, 3),
    ]
    assert log[-1]["baseline_s"] == 0.2

    # a probe that spans a re-form is not kept
    other = Probation(OPTS, lambda: 5.0, clock=lambda: clock[0], spawn=pending.append)
    sitter = other
    tick(0.0, 1)
    tick(SETTLE, 1)
    pending.pop()()  # type: ignore[operator]
    tick(SETTLE + 0.5, 2)
    assert other.baseline_s is None and other.baseline.samples == ()
