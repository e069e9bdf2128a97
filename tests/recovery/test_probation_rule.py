"""Probation's rule (elastic.recovery.probation.decide), table-tested with a fake clock; the
request a dropped node's worker leaves for its agent; the agent's probe."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest

from elastic import nodelocal
from elastic.errors import ConfigError
from elastic.recovery import probation
from elastic.recovery.probation import Action, History, Options, Request, decide

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
