"""Probation: when a node dropped as a straggler checks its health and comes back.

A node the straggler policy drops (:mod:`elastic.worker.straggler`) leaves the group in
place like a planned leave (0 steps lost), but its agent stays: it sits out and runs a short
health check (:mod:`elastic.agent.probation` runs the probe), and rejoins once a check
passes. :func:`decide` is the rule, a pure function of (history, measurement, now):

* The first check runs ``first_s`` after the node left.
* A check **passes** when the probe took at most ``pass_ratio`` times its *baseline*: the
  node rejoins (it announces itself again as a joiner and takes the group's state from a
  peer). A probe that failed or ran past its timeout is a failed check (``inf`` seconds).
  Without a baseline (none taken yet, or its probes failed) a probe that completes passes.
* The **baseline** is the same probe timed while the node trains steadily, not as its
  agent starts (then the node's agents and workers import torch and the probe read 0.22-0.40
  s against 0.09-0.18 s later, so every check passed): :func:`baseline_due` takes
  :data:`BASELINE_SAMPLES` probes, :data:`BASELINE_GAP_S` apart, once the node's round has
  run in place for :data:`BASELINE_SETTLE_S` (its workers registered, none waiting for a
  new round); a re-form starts that wait anew. The baseline is their median, taken once per
  agent (a node back from probation keeps it).
* A **failed** check waits before the next: ``first_s`` doubled after each failed check
  (10, 20, 40 s ... with the defaults), at most ``cap_s``. After ``max_failures`` failed
  checks the node leaves the job for good.
* A node put on probation for the ``max_probations``-th time leaves for good at once: a
  node that passes its check and is dropped again each time would otherwise flap between
  the group and probation.

:class:`Request` is what a dropped node's lowest rank leaves for its agent (a small file in
the agent's private node-local directory, :func:`write_request` / :func:`take_request`).
"""

from __future__ import annotations

import contextlib
import enum
import json
import math
import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from elastic import env
from elastic.node import nodelocal
from elastic.node import options as node_options

ENV = env.PROBATION  # the old packed spelling (elastic.node.options)
PROBE_ENV = env.PROBATION_PROBE  # option probation.probe: a health-check command
REQUEST = "probation.json"  # in the agent's node-local directory
DEFAULT_FIRST_S = 5.0
DEFAULT_CAP_S = 60.0
DEFAULT_MAX_FAILURES = 5
DEFAULT_PASS_RATIO = 1.5
DEFAULT_MAX_PROBATIONS = 3
BASELINE_SETTLE_S = 5.0  # training is steady this long after its round runs in place
BASELINE_SAMPLES = 3  # the baseline is the median of this many probes
BASELINE_GAP_S = 1.0  # between the starts of two of them


class Action(enum.Enum):
    WAIT = "wait"  # check again at next_check_at
    REJOIN = "rejoin"  # the check passed: join the job again
    LEAVE = "leave"  # leave the job for good


@dataclass(frozen=True)
class Options:
    enabled: bool = True
    first_s: float = DEFAULT_FIRST_S  # the first check, and the first back-off
    cap_s: float = DEFAULT_CAP_S  # the longest back-off
    max_failures: int = DEFAULT_MAX_FAILURES  # failed checks before leaving for good
    pass_ratio: float = DEFAULT_PASS_RATIO  # pass: probe <= pass_ratio x the baseline
    max_probations: int = DEFAULT_MAX_PROBATIONS  # the n-th probation leaves at once


@dataclass(frozen=True)
class Check:
    at: float  # when (the caller's clock)
    seconds: float  # the probe's time; inf: it failed or timed out
    passed: bool


@dataclass(frozen=True)
class History:
    """One probation: when it began, what a healthy probe took, the checks so far."""

    entered: float
    baseline_s: float | None  # the probe timed when the node was healthy; None: unknown
    probations: int = 1  # this node's probations in this job, this one included
    checks: tuple[Check, ...] = ()

    @property
    def failures(self) -> int:
        return sum(1 for c in self.checks if not c.passed)


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    next_check_at: float | None  # with WAIT
    history: History  # with this measurement's check appended


def backoff(failures: int, options: Options) -> float:
    """Seconds to wait after the ``failures``-th failed check: ``first_s`` doubled each
    time (10, 20, 40 s with the defaults), at most ``cap_s``."""
    return min(options.cap_s, options.first_s * 2.0 ** max(failures, 0))


def passes(seconds: float, baseline_s: float | None, options: Options) -> tuple[bool, str]:
    """Whether a probe that took ``seconds`` passes, and why."""
    if not math.isfinite(seconds):
        return False, "the probe failed or ran past its timeout"
    if baseline_s is None or baseline_s <= 0:
        return True, f"the probe completed in {seconds:.3f} s (no healthy baseline to compare)"
    ratio = seconds / baseline_s
    verdict = "within" if ratio <= options.pass_ratio else "above"
    text = (
        f"the probe took {seconds:.3f} s, {ratio:.2f}x its healthy {baseline_s:.3f} s "
        f"({verdict} {options.pass_ratio:g}x)"
    )
    return ratio <= options.pass_ratio, text


def decide(history: History, measurement: float | None, now: float, options: Options) -> Decision:
    """What a node on probation does now (see the module). ``measurement``: the seconds of
    the check just run (``inf``: the probe failed), or None when no check ran (on entry)."""
    if measurement is None:
        if history.probations >= options.max_probations:
            reason = (
                f"probation {history.probations} of at most {options.max_probations - 1}: "
                "the node keeps being dropped, it leaves the job for good"
            )
            return Decision(Action.LEAVE, reason, None, history)
        due = history.entered + options.first_s
        if history.checks:
            due = history.checks[-1].at + backoff(history.failures, options)
        return Decision(Action.WAIT, "on probation, waiting for its check", due, history)
    ok, why = passes(measurement, history.baseline_s, options)
    checks = (*history.checks, Check(now, measurement, ok))
    after = History(history.entered, history.baseline_s, history.probations, checks)
    if ok:
        return Decision(Action.REJOIN, f"{why}: it rejoins", None, after)
    if after.failures >= options.max_failures:
        reason = f"{why}; {after.failures} failed check(s): it leaves the job for good"
        return Decision(Action.LEAVE, reason, None, after)
    wait = backoff(after.failures, options)
    return Decision(Action.WAIT, f"{why}; next check in {wait:g} s", now + wait, after)


@dataclass(frozen=True)
class Baseline:
    """The probe's healthy time on this node, sampled once training is steady."""

    round: int | None = None  # the round last seen running in place; None: none
    steady_since: float | None = None  # when it was first seen so (the caller's clock)
    samples: tuple[float, ...] = ()  # the probes' seconds (inf: one failed)
    last_at: float | None = None  # when the last probe started

    @property
    def done(self) -> bool:
        return len(self.samples) >= BASELINE_SAMPLES

    @property
    def seconds(self) -> float | None:
        """The median of the probes that completed; None before one did."""
        finite = [t for t in self.samples if math.isfinite(t)]
        return statistics.median(finite) if finite else None

    def with_sample(self, seconds: float) -> Baseline:
        return replace(self, samples=(*self.samples, seconds))


@dataclass(frozen=True)
class BaselineDecision:
    probe: bool  # time the probe now (a sample of the baseline)
    reason: str
    baseline: Baseline  # with this look's round, and last_at when it probes


def baseline_due(baseline: Baseline, running: int | None, now: float) -> BaselineDecision:
    """Whether to time a baseline probe now: ``running`` is the round this node's workers
    run in place (None: not now: they start, re-form, or wait for a round)."""
    if baseline.done:
        return BaselineDecision(False, "the baseline is taken", baseline)
    if running is None:
        after = replace(baseline, round=None, steady_since=None)
        return BaselineDecision(False, "the workers do not run in place now", after)
    if running != baseline.round or baseline.steady_since is None:
        after = replace(baseline, round=running, steady_since=now)
        return BaselineDecision(False, f"round {running} runs in place from now", after)
    steady = now - baseline.steady_since
    if steady < BASELINE_SETTLE_S:
        reason = f"round {running} has run in place {steady:.1f} s of {BASELINE_SETTLE_S:g}"
        return BaselineDecision(False, reason, baseline)
    if baseline.last_at is not None and now - baseline.last_at < BASELINE_GAP_S:
        return BaselineDecision(False, "the last probe is too recent", baseline)
    reason = (
        f"training has run steadily for {steady:.1f} s: probe "
        f"{len(baseline.samples) + 1} of {BASELINE_SAMPLES}"
    )
    return BaselineDecision(True, reason, replace(baseline, last_at=now))


def options_from_env(environ: Mapping[str, str] | None = None) -> Options:
    """The ``probation`` options (:mod:`elastic.node.options`: ``$ELASTIC_PROBATION_ENABLED``,
    ``_FIRST_S``, ``_CAP_S``, ``_MAX_FAILURES``; the old ``$ELASTIC_PROBATION=off`` or
    ``FIRST_S,CAP_S,MAX_FAILURES`` with a warning).

    Raises:
        ConfigError: a value the option does not accept.
    """
    given = node_options.load(environ).probation
    return Options(given.enabled, given.first_s, given.cap_s, given.max_failures)


# -- the request: from the dropped node's lowest rank to its agent ---------------------------


@dataclass(frozen=True)
class Request:
    """Why this node was dropped (:class:`elastic.worker.straggler.Slow`, at ``step``)."""

    step: int
    ratio: float  # the node's compute time over the median of the nodes'
    median_s: float  # the group's median compute time at the drop
    reason: str


def write_request(owner: int, request: Request, base: str = nodelocal.DEFAULT_BASE) -> Path:
    """Leave ``request`` for agent ``owner`` (in its private node-local directory)."""
    path = nodelocal.directory(owner, base) / REQUEST
    nodelocal.write_whole(path, json.dumps(asdict(request)).encode())
    return path


def take_request(owner: int, base: str = nodelocal.DEFAULT_BASE) -> Request | None:
    """The request left for agent ``owner``, removed; None when there is none (or it cannot
    be read: a file of the wrong kind is removed and ignored)."""
    folder = nodelocal.find(owner, base)
    if folder is None:
        return None
    path = folder / REQUEST
    try:
        raw = nodelocal.read_small(path)
    except FileNotFoundError:
        return None
    except OSError:
        raw = b""
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
    try:
        data = json.loads(raw)
        return Request(
            int(data["step"]), float(data["ratio"]), float(data["median_s"]), str(data["reason"])
        )
    except (ValueError, KeyError, TypeError):
        return None


__all__ = [
    "BASELINE_GAP_S",
    "BASELINE_SAMPLES",
    "BASELINE_SETTLE_S",
    "Action",
    "Baseline",
    "BaselineDecision",
    "Check",
    "Decision",
    "History",
    "Options",
    "Request",
    "backoff",
    "baseline_due",
    "decide",
    "options_from_env",
    "passes",
    "take_request",
    "write_request",
]
