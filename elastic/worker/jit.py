"""Snapshots at an adaptive interval, and a just-in-time snapshot when training fails.

After the JIT checkpointing of Gupta et al. (EuroSys '24), adapted to shared memory.
When a peer dies (``kill -9``), a surviving rank's next collective fails (gloo raises
in backward, or in the per-step all-reduce), or its agent sends SIGTERM and the step
then fails. At that moment the model and optimizer in memory still hold the last
completed step, so :meth:`StepSnapshots.failed` writes *that* state synchronously into
the node's :class:`~elastic.worker.snapshot.SnapshotStore` before the process
exits: no completed step is lost, whatever the periodic interval.

Torn states are guarded by an optimizer step pre- and post-hook:

* inside ``optimizer.step()`` (the pre-hook ran, the post-hook did not) the parameters
  may be half-updated: nothing is written, the previous snapshot stays the newest;
* after ``optimizer.step()`` but before the loop advanced its counters, the owner's
  ``advance`` callable moves the step counter and data cursor on exactly as the loop
  would have, and the live state is written;
* otherwise the state of the last step boundary is written: the tensors only
  ``optimizer.step()`` changes (parameters, optimizer state) are live and unchanged;
  the rest (the model's buffers, such as BatchNorm statistics, and the counters, RNG
  and schedule) was copied at the boundary (about 0.2 ms a step for ResNet-18).

``every="auto"`` (the default) measures the snapshot's cost (its synchronous part and
its background copy) over the first :data:`PROBE_SNAPSHOTS` snapshots and the step
time over the next :data:`PROBE_STEPS` steps, then snapshots every ``N`` steps so that
the cost stays under :data:`AUTO_BUDGET` of the step time (every step when cheap),
and keeps measuring to follow a host that gets busier or quieter.
"""

from __future__ import annotations

import logging
import math
import statistics
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch

from elastic.errors import ConfigError
from elastic.worker.snapshot import SnapshotStore, Snapshotter

logger = logging.getLogger(__name__)

AUTO = "auto"
AUTO_BUDGET = 0.025  # the snapshot's share of the step time "auto" aims at (goal: <= 3 %)
PROBE_SNAPSHOTS = 4  # snapshots "auto" times (the first two also grow the files)
PROBE_STEPS = 6  # plain steps "auto" times after them
COST_WINDOW = 4  # the snapshot costs "auto" keeps choosing from
STEP_WINDOW = 32  # the plain step times "auto" keeps choosing from
MAX_INTERVAL = 1000

Every = int | str


def parse_every(value: Every | None) -> Every:
    """``"auto"`` or a step count >= 0 (0: no snapshots at all), from an int or a string.

    Raises:
        ConfigError: anything else.
    """
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", AUTO)):
        return AUTO
    try:
        every = int(value)
    except ValueError:
        every = -1
    if every < 0:
        raise ConfigError(
            f"The snapshot interval {value!r} is not 'auto' or a step count >= 0; "
            "use snapshot_every='auto', N or 0 (off)."
        )
    return every


def stable_ptrs(optimizer: torch.optim.Optimizer) -> set[int]:
    """The ``data_ptr()`` of the tensors only ``optimizer.step()`` changes."""
    ptrs = {p.data_ptr() for g in optimizer.param_groups for p in g["params"]}
    for st in optimizer.state.values():
        ptrs.update(v.data_ptr() for v in st.values() if isinstance(v, torch.Tensor))
    return ptrs


def _swap(value: Any, held: dict[int, torch.Tensor]) -> Any:
    """``value`` with every tensor whose storage ``held`` maps replaced by that copy."""
    if isinstance(value, torch.Tensor):
        return held.get(value.data_ptr(), value) if value.numel() else value
    if isinstance(value, dict):
        return {k: _swap(v, held) for k, v in value.items()}
    if isinstance(value, list):
        return [_swap(v, held) for v in value]
    if isinstance(value, tuple):
        return tuple(_swap(v, held) for v in value)
    return value


@dataclass(frozen=True)
class Boundary:
    """What changes after a step boundary outside ``optimizer.step()``, kept at it: the
    counters, RNG and schedule (``extra``) and copies of the model's buffers (BatchNorm
    statistics, by storage); None for both: the live state is the boundary's."""

    step: int
    extra: dict[str, Any] | None = None
    buffers: dict[int, torch.Tensor] | None = None

    @classmethod
    def keep(cls, step: int, model: torch.nn.Module, extra: dict[str, Any]) -> Boundary:
        buffers = {b.data_ptr(): b.detach().clone() for b in model.buffers() if b.numel()}
        return cls(step, extra, buffers)

    def state(self, live: dict[str, Any]) -> dict[str, Any]:
        """The boundary's state from the ``live`` one (tensors not copied)."""
        if self.extra is None:
            return live
        return {**_swap(live, self.buffers or {}), **self.extra}


class AutoInterval:
    """Chooses the snapshot interval from measured costs (``every="auto"``).

    It keeps measuring after its first choice (the last :data:`COST_WINDOW` snapshot
    costs, the last :data:`STEP_WINDOW` plain steps), so a host that gets busier or
    quieter moves the interval; only the first choice is logged at INFO.
    """

    def __init__(self, budget: float = AUTO_BUDGET) -> None:
        self.budget = budget
        self.costs: deque[float] = deque(maxlen=COST_WINDOW)
        self.steps: deque[float] = deque(maxlen=STEP_WINDOW)
        self.interval: int | None = None

    def due(self, step: int) -> bool:
        """Whether the boundary of ``step`` takes a snapshot."""
        if self.interval is not None:
            return step % self.interval == 0
        return len(self.costs) < PROBE_SNAPSHOTS

    def observe(self, step_s: float, cost_s: float | None) -> None:
        """Record one plain step's time, or (``cost_s``) the cost of the last snapshot."""
        if cost_s is not None:
            self.costs.append(cost_s)
        else:
            self.steps.append(step_s)
        if len(self.costs) >= PROBE_SNAPSHOTS and len(self.steps) >= PROBE_STEPS:
            self._decide()

    def _decide(self) -> None:
        cost = statistics.median(list(self.costs)[-3:])  # past the first files' growth
        step = min(self.steps)  # the uncontended step: a busy host errs towards fewer snapshots
        interval = min(MAX_INTERVAL, max(1, math.ceil(cost / max(step * self.budget, 1e-9))))
        first, self.interval = self.interval is None, interval
        logger.log(
            logging.INFO if first else logging.DEBUG,
            "Snapshot interval: every %d steps (a snapshot costs %.1f ms, a step %.1f ms: "
            "%.1f %% of each step on average, budget %.1f %%).",
            interval,
            1e3 * cost,
            1e3 * step,
            100 * cost / max(step, 1e-9) / interval,
            100 * self.budget,
        )


class StepSnapshots:
    """One rank's snapshots: periodic (every N steps or ``"auto"``) and at a failure.

    Args:
        store: this rank's snapshot files.
        optimizer: the optimizer (step hooks tell a torn state from a whole one).
        state: returns the state a snapshot holds (tensors not copied).
        model: the model (its buffers change in the forward pass).
        extra: returns the top-level entries of ``state()`` that change outside
            ``optimizer.step()`` (counters, RNG, LR schedule, sampler), kept at each
            step boundary (they must not alias live tensors).
        advance: moves the step counter and data cursor on as the loop does after a
            step, and returns the new step (used when ``optimizer.step()`` ran but the
            loop did not reach its end).
        every: ``"auto"``, N, or 0 (no snapshots, not even at a failure).
        round_: the rendezvous round that produced this state.

    Raises:
        RecoveryError: no room for the snapshot buffers of ``state()`` (they are allocated
            here, before the first step).
    """

    def __init__(
        self,
        store: SnapshotStore,
        optimizer: torch.optim.Optimizer,
        state: Callable[[], dict[str, Any]],
        advance: Callable[[], int],
        every: Every = AUTO,
        round_: int = 0,
        *,
        model: torch.nn.Module,
        extra: Callable[[], dict[str, Any]],
        background: bool | None = None,
    ) -> None:
        self.snapshotter = Snapshotter(store, background)
        self.every = parse_every(every)
        self.auto = AutoInterval() if self.every == AUTO else None
        self.optimizer = optimizer
        self.round = round_
        self._state, self._advance, self._extra = state, advance, extra
        self.model = model
        self._in_step = self._stepped = False
        self._boundary: Boundary | None = None
        self._cost_mark: float | None = None
        self._clock = time.perf_counter()
        self._timed = False  # the first step after a (re)start includes the start
        if self.enabled:  # a full /dev/shm: one sentence now, not at the first snapshot
            self.snapshotter.reserve(state())
        self._hooks = [
            optimizer.register_step_pre_hook(self._pre),
            optimizer.register_step_post_hook(self._post),
        ]
        _active.add(self)
        _install_excepthook()

    @property
    def store(self) -> SnapshotStore:
        return self.snapshotter.store

    @property
    def enabled(self) -> bool:
        return self.every != 0

    @property
    def interval(self) -> int | None:
        """The steps between periodic snapshots (None: "auto" is still measuring)."""
        if self.auto is not None:
            return self.auto.interval
        return int(self.every)

    def _pre(self, *_: Any) -> None:
        self.snapshotter.wait()
        self._in_step = True

    def _post(self, *_: Any) -> None:
        self._in_step = False
        self._stepped = True

    def restart_clock(self) -> None:
        """Time the next step from now (the loop was paused, e.g. between benchmark blocks)."""
        self._clock = time.perf_counter()
        self._timed = False

    def boundary(self, step: int) -> None:
        """Call after each completed step, once the loop advanced its counters to ``step``."""
        now = time.perf_counter()
        step_s, self._clock = now - self._clock, now
        self._stepped = False
        if not self.enabled:
            return
        self._observe(step_s)
        if self._due(step):
            stats = self.snapshotter.stats
            self._cost_mark = stats["sync_s"] + stats["copy_s"]
            self.snapshotter.take(step, self.round, self._state(), stable_ptrs(self.optimizer))
        self._boundary = Boundary.keep(step, self.model, self._extra())

    @property
    def last_boundary(self) -> Boundary | None:
        """What was kept at the last completed step (None before the first)."""
        return self._boundary

    def keep_boundary(self, step: int) -> None:
        """Mark the live state as step ``step``'s boundary (after a re-form moved it)."""
        self._stepped = False
        self._boundary = Boundary.keep(step, self.model, self._extra())

    def write_live(self, step: int, round_: int | None = None) -> None:
        """Snapshot the live state as step ``step`` of round ``round_`` (default: this
        round; in place, the round whose group produced it) now, synchronously (a peer will
        stream it to a joiner), unless the newest snapshot is that already."""
        round_ = self.round if round_ is None else round_
        self.snapshotter.wait()
        found = self.store.newest()
        if found is not None and (found[1].step, found[1].round) == (step, round_):
            return
        self.snapshotter.take(step, round_, self._state(), set())
        self.snapshotter.wait()

    def _due(self, step: int) -> bool:
        if self.auto is not None:
            return self.auto.due(step)
        return step % int(self.every) == 0

    def _observe(self, step_s: float) -> None:
        """Feed "auto" the last step's time, or the cost of the snapshot it took."""
        if self.auto is None:
            return
        cost: float | None = None
        timed, self._timed = self._timed, True
        if self._cost_mark is None and not timed:
            return
        if self._cost_mark is not None:
            self.snapshotter.wait()
            stats = self.snapshotter.stats
            cost, self._cost_mark = stats["sync_s"] + stats["copy_s"] - self._cost_mark, None
        self.auto.observe(step_s, cost)

    def failed(self, reason: str) -> bool:
        """Write the state of the last completed step now, synchronously, unless it is
        torn or already the newest snapshot. Never raises; returns whether it wrote."""
        if not self.enabled or not self._hooks:  # off, or closed
            return False
        if self._in_step:
            logger.warning(
                "Training failed inside optimizer.step() (%s): the state is torn, so no "
                "snapshot is written; the newest one (step %d) stays.",
                reason,
                self.snapshotter.last_step,
            )
            return False
        try:
            return self._write_now(reason)
        except Exception as exc:  # an exception path already: report, never mask it
            logger.error("The failure-time snapshot (%s) could not be written: %s", reason, exc)
            return False

    def _write_now(self, reason: str) -> bool:
        started = time.perf_counter()
        try:
            self.snapshotter.wait()
        except Exception as exc:  # the periodic copy failed; write this one regardless
            logger.warning("The snapshot in flight failed (%s); writing a new one.", exc)
        if self._stepped:  # the optimizer stepped: the live state is the next boundary's
            self._stepped = False
            self._boundary = Boundary(self._advance())
        if self._boundary is None or self._boundary.step <= self.snapshotter.last_step:
            return False
        step = self._boundary.step
        self.snapshotter.take(step, self.round, self._boundary.state(self._state()), set())
        self.snapshotter.wait()
        logger.warning(
            "Wrote the state of step %d to %s in %.3f s (%s).",
            step,
            self.store.files["a"].path.parent,
            time.perf_counter() - started,
            reason,
        )
        return True

    def wait(self) -> None:
        self.snapshotter.wait()

    def close(self) -> None:
        """Remove the hooks and stop snapshotting (the snapshot files stay)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        _active.discard(self)


_active: weakref.WeakSet[StepSnapshots] = weakref.WeakSet()
_hook_lock = threading.Lock()
_previous_hook: Any = None


def _install_excepthook() -> None:
    """Chain ``sys.excepthook`` once: an uncaught exception writes every live rank's
    failure-time snapshot (a backstop for loops that never reach their own handler)."""
    global _previous_hook
    with _hook_lock:
        if _previous_hook is not None:
            return
        _previous_hook = sys.excepthook
        sys.excepthook = _excepthook


def _excepthook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    for snapshots in list(_active):
        snapshots.failed(f"uncaught {kind.__name__}")
    _previous_hook(kind, exc, tb)


__all__ = [
    "AUTO",
    "AUTO_BUDGET",
    "AutoInterval",
    "StepSnapshots",
    "parse_every",
    "stable_ptrs",
]
