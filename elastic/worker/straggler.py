"""Which node holds the group back: a pure rule over every rank's time of recent steps.

Each rank measures, every step, its *compute* time (the step's wall time less the time its
collectives were in flight) and its *wait* (that time in flight), and writes them, with
its node's id, into its own slots of the step's agreement vector
(:class:`elastic.worker.boundary.Layout`, :data:`SLOTS`): the one all-gather the step
already does hands every rank every rank's figures (no collective, no etcd write of its
own). Every rank then applies :func:`decide` to the same figures and gets the same answer.

The rule:

* A rank's **ratio** is its compute time over the median of the ranks'; a node's is its
  slowest rank's time over the median of the nodes' (the unit that is dropped is a node).
* A node is **slow** at a step when its ratio exceeds ``ratio`` (X). It is **detected**
  (event ``straggler.detected``, once per crossing) when it has been slow for at least
  ``steps`` (K) consecutive steps *and* at least ``min_slow_s`` (T) seconds: the sum of its
  compute times (its slowest rank's) over those steps. Steps alone are not time: on a
  loaded host a scheduler hiccup makes 5 steps of 60 ms slow, 0.3 s, and a GC pause or a
  save makes one long step; the default T (:data:`DEFAULT_MIN_SLOW_S`, 10 s) is more than a
  2 s GC pause, a save of a few seconds or a burst of hiccups adds up to, while a node that
  is really slower is slow for as long as it runs. The seconds are summed from the step's
  figures, which every rank holds alike, not read from a clock, so every rank names the
  node at the same step. A step some rank did not measure (the first one, the one after a
  re-form or a join) starts the counts anew: the group changed, and a joiner has no counts
  to keep.
* With fewer than :data:`MIN_NODES_TO_NAME` nodes nothing is named: the median of two
  nodes is their mean, which cannot say which of the two is slow (one at half speed and
  one at full speed read 1.33 and 0.67, or, on a loaded host, the other way round).
  Ratios are still reported.
* The **policy** (off by default, :func:`options_from_env`): a detected node is dropped
  (in place, like a planned leave) unless that would leave fewer than ``min_nodes`` nodes,
  or a node was dropped less than ``window_s`` ago (at most one node per window; the
  slowest goes first). The window's age is the youngest any rank reports in its slots
  (:attr:`View.since_drop`), so every rank, a joiner too, reads the same. A dropped node
  sits out on probation and rejoins once its health check passes
  (:mod:`elastic.worker.probation`). On a two-node job nothing is named, so nothing is
  dropped.

:func:`hang_bound` is the bound after which a step that has not reached its collectives
counts as stuck (:mod:`elastic.worker.hang`).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from elastic import env
from elastic.node import options as node_options

# each rank's slots in the agreement vector; since_drop_s: seconds since the last drop this
# rank knows of (0: none), so that a joiner keeps the window as the others do
SLOTS = ("compute_s", "wait_s", "node", "since_drop_s")
MAX_SECONDS = 1e7  # about 115 days: a figure beyond it is refused (elastic.worker.boundary)
LIMITS = {
    "compute_s": (0.0, MAX_SECONDS),
    "wait_s": (0.0, MAX_SECONDS),
    "node": (0.0, 2.0**32 - 1),
    "since_drop_s": (0.0, MAX_SECONDS),
}
MIN_NODES_TO_NAME = 3
ENV = env.STRAGGLER  # the old packed spelling (elastic.node.options)
MIN_NODES_ENV = env.STRAGGLER_MIN_NODES  # never drop below this many nodes
HANG_ENV = env.HANG  # the old packed spelling (elastic.node.options)
DEFAULT_RATIO = 2.0
DEFAULT_STEPS = 5
DEFAULT_MIN_SLOW_S = 10.0
DEFAULT_WINDOW_S = 60.0
DEFAULT_HANG_FLOOR_S = 60.0
DEFAULT_HANG_MULTIPLE = 10.0


@dataclass(frozen=True)
class Options:
    ratio: float = DEFAULT_RATIO  # X: slower than X times the median
    steps: int = DEFAULT_STEPS  # K: for K consecutive steps
    drop: bool = False  # the policy: drop a detected node in place
    min_nodes: int = 1  # never drop below this many nodes
    window_s: float = DEFAULT_WINDOW_S  # at most one drop per window
    min_slow_s: float = DEFAULT_MIN_SLOW_S  # T: and for at least T s of its compute time


@dataclass(frozen=True)
class View:
    """One step's figures, per rank (index = rank); a compute time of 0: not measured."""

    step: int
    compute: tuple[float, ...]
    wait: tuple[float, ...]
    nodes: tuple[int, ...]
    since_drop: tuple[float, ...] = ()  # per rank: seconds since the last drop it knows; 0: none


@dataclass(frozen=True)
class State:
    """What the rule keeps between steps."""

    streaks: Mapping[int, int] = field(default_factory=lambda: MappingProxyType({}))
    last_drop: float | None = None  # when (the caller's clock) a node was last dropped
    # per node: its compute seconds summed over its streak's steps
    slow_s: Mapping[int, float] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class Slow:
    """A node slower than X times the median for ``steps`` consecutive steps, which took
    ``seconds`` of its compute time."""

    node: int
    ranks: tuple[int, ...]
    ratio: float
    steps: int
    seconds: float = 0.0


@dataclass(frozen=True)
class Decision:
    ratios: tuple[float, ...]  # per rank (empty when the step was not measured)
    detected: tuple[Slow, ...]  # nodes that crossed the threshold at this step
    drop: Slow | None  # the node to drop now (the policy), or None
    reason: str
    state: State


def ratios(times: tuple[float, ...]) -> tuple[float, ...]:
    """Each time over the median of ``times`` (1.0 each when the median is 0)."""
    median = statistics.median(times) if times else 0.0
    return tuple(t / median if median > 0 else 1.0 for t in times)


def node_times(view: View) -> dict[int, tuple[float, tuple[int, ...]]]:
    """Each node's slowest compute time and its ranks."""
    ranks: dict[int, list[int]] = {}
    for rank, node in enumerate(view.nodes):
        ranks.setdefault(node, []).append(rank)
    return {n: (max(view.compute[r] for r in rs), tuple(rs)) for n, rs in ranks.items()}


def decide(view: View, state: State, now: float, options: Options) -> Decision:
    """The slow nodes at ``view``'s step, and whether one is dropped now (see the module)."""
    if not view.compute or min(view.compute) <= 0:
        reason = "not measured at this step (the first one, or a re-form): counts start anew"
        return Decision((), (), None, reason, State(MappingProxyType({}), state.last_drop))
    per_rank = ratios(view.compute)
    nodes = node_times(view)
    if len(nodes) < MIN_NODES_TO_NAME:
        reason = (
            f"{len(nodes)} node(s): the median of fewer than {MIN_NODES_TO_NAME} cannot say "
            "which one is slow"
        )
        return Decision(per_rank, (), None, reason, State(MappingProxyType({}), state.last_drop))
    order = sorted(nodes)
    node_ratio = dict(zip(order, ratios(tuple(nodes[n][0] for n in order)), strict=True))
    streaks: dict[int, int] = {}
    slow_s: dict[int, float] = {}
    for n in order:
        if node_ratio[n] > options.ratio:
            streaks[n] = state.streaks.get(n, 0) + 1
            slow_s[n] = state.slow_s.get(n, 0.0) + nodes[n][0]
        else:
            streaks[n], slow_s[n] = 0, 0.0
    slow = [
        Slow(n, nodes[n][1], round(node_ratio[n], 3), streaks[n], round(slow_s[n], 3))
        for n in order
        if named(streaks[n], slow_s[n], options)
    ]
    before = {n: named(state.streaks.get(n, 0), state.slow_s.get(n, 0.0), options) for n in order}
    detected = tuple(s for s in slow if not before[s.node])
    kept = State(MappingProxyType(streaks), state.last_drop, MappingProxyType(slow_s))
    if not slow:
        reason = (
            f"no node above {options.ratio:g}x the median for {options.steps} steps and "
            f"{options.min_slow_s:g} s"
        )
        return Decision(per_rank, (), None, reason, kept)
    worst = max(slow, key=lambda s: s.ratio)
    what = (
        f"node {worst.node} at {worst.ratio:g}x the median for {worst.steps} steps "
        f"({worst.seconds:g} s)"
    )
    if not options.drop:
        return Decision(per_rank, detected, None, f"{what}; the policy is off", kept)
    if len(nodes) - 1 < options.min_nodes:
        reason = f"{what}; dropping it would leave fewer than {options.min_nodes} nodes"
        return Decision(per_rank, detected, None, reason, kept)
    age = last_drop_age(view, state, now)
    if age is not None and age < options.window_s:
        reason = f"{what}; a node was dropped {age:.1f} s ago (one per window)"
        return Decision(per_rank, detected, None, reason, kept)
    dropped = State(MappingProxyType({}), now)
    return Decision(per_rank, detected, worst, f"{what}: it is dropped", dropped)


def named(streak: int, slow_s: float, options: Options) -> bool:
    """Whether a node slow for ``streak`` consecutive steps, ``slow_s`` seconds of its
    compute time, is a straggler: at least K steps and at least T seconds."""
    return streak >= options.steps and slow_s >= options.min_slow_s


def last_drop_age(view: View, state: State, now: float) -> float | None:
    """Seconds since the last drop: the youngest age a rank reports in ``view`` (the same on
    every rank), else this rank's own record (None: no drop known)."""
    reported = [a for a in view.since_drop if a > 0]
    if reported:
        return min(reported)
    return None if state.last_drop is None else now - state.last_drop


def hang_bound(recent_steps_s: tuple[float, ...], floor_s: float, multiple: float) -> float:
    """Seconds a step may run before it counts as stuck: ``multiple`` times the median of
    the recent steps, at least ``floor_s``."""
    typical = statistics.median(recent_steps_s) if recent_steps_s else 0.0
    return max(floor_s, multiple * typical)


def options_from_env(environ: Mapping[str, str] | None = None) -> Options:
    """The ``straggler`` options (:mod:`elastic.node.options`: ``$ELASTIC_STRAGGLER_DROP``,
    ``_RATIO``, ``_STEPS``, ``_MIN_SLOW_S``, ``_MIN_NODES``, ``_WINDOW_S``; the old
    ``$ELASTIC_STRAGGLER=X,K`` with a warning). The policy drops a node slower than ``ratio``
    x the median for ``steps`` consecutive steps and ``min_slow_s`` seconds when ``drop`` is
    on; else detection only.

    Raises:
        ConfigError: a value the option does not accept.
    """
    return from_model(node_options.load(environ).straggler)


def from_model(given: node_options.StragglerOptions) -> Options:
    return Options(
        given.ratio, given.steps, given.drop, given.min_nodes, given.window_s, given.min_slow_s
    )


def hang_from_env(environ: Mapping[str, str] | None = None) -> tuple[float, float] | None:
    """The ``hang`` options (``$ELASTIC_HANG_ENABLED``, ``_FLOOR_S``, ``_MULTIPLE``; the old
    ``$ELASTIC_HANG=on`` or ``FLOOR_S,MULTIPLE`` with a warning): (floor, multiple), or None
    when off.

    Off by default: a rank that spends longer than the bound between two steps without a
    collective on purpose (an evaluation pass inside the loop, a save of the user's own)
    cannot be told apart from a stuck one by the rank itself, and every rank doing it
    would exit.

    Raises:
        ConfigError: a value the option does not accept.
    """
    return hang_limits(node_options.load(environ).hang)


def hang_limits(given: node_options.HangOptions) -> tuple[float, float] | None:
    return (given.floor_s, given.multiple) if given.enabled else None


__all__ = [
    "LIMITS",
    "SLOTS",
    "Decision",
    "Options",
    "Slow",
    "State",
    "View",
    "decide",
    "hang_bound",
    "hang_from_env",
    "last_drop_age",
    "named",
    "options_from_env",
    "ratios",
]
