"""The step guard: a step's collectives that fail or hang never raise into the user's loop.

A worker re-formed in place must survive a peer that dies (gloo: "Connection closed by
peer" about 0.3 s later) or freezes (no error at all: the collective waits for its
timeout, minutes). The guard owns every collective of a step that ``Run`` can reach:

* DDP's gradient all-reduce, as a communication hook (:meth:`StepGuard.ddp_hook`), and
  DDP's buffer broadcast (:meth:`StepGuard.install`);
* ``Run``'s own per-step agreement and state exchange (:meth:`StepGuard.run`).

Each returns a future of our own that completes with the real result, or, when the
collective fails or :meth:`StepGuard.abort` is called (the agent says a peer is gone),
at once with the unreduced input. The step is then marked failed and
``optimizer.step()`` / ``scheduler.step()`` do nothing, so the state of the last completed
step stays in memory untouched; ``Run`` rewinds the rest (buffers, RNG) and re-forms.

A stuck collective of the old group stays stuck in gloo's own thread until that group's
timeout; the group is dropped, never joined (``elastic.inplace.groups``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class StepGuard:
    """Turns failed or aborted collectives into a failed step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[torch.futures.Future[Any], Any]] = {}
        self._started: dict[int, float] = {}  # monotonic start time of each pending collective
        self.failure: str | None = None  # why this step failed; None while it is fine
        self.aborted: str | None = None  # the agent's abort, until the group re-forms
        # optimizer.step() ran in this step: its all-reduce had succeeded, so the step is
        # complete whatever fails after it (nothing after it is skipped).
        self.committed = False
        # Bumped by reset(): a collective of an older group that fails late (its peer left
        # long ago) must not fail the step of the current one.
        self._generation = 0

    # -- state -----------------------------------------------------------------------------

    def reset(self) -> None:
        """A new group: nothing failed, nothing pending."""
        with self._lock:
            self.failure = self.aborted = None
            self._pending, self._started = {}, {}
            self.committed = False
            self._generation += 1

    def fail(self, reason: str, generation: int | None = None) -> None:
        with self._lock:
            if generation is not None and generation != self._generation:
                return  # a collective of a group that was re-formed away
            if self.failure is None:
                self.failure = reason
                logger.warning("This step failed: %s.", reason)

    def abort(self, reason: str) -> None:
        """Release every collective in flight and skip the rest until :meth:`reset`."""
        with self._lock:
            self.aborted = reason
            pending, self._pending, self._started = self._pending, {}, {}
        self.fail(reason)
        for out, fallback in pending.values():
            _complete(out, fallback)

    def in_flight_since(self) -> float | None:
        """When the oldest collective still in flight started (``time.monotonic()``)."""
        with self._lock:
            return min(self._started.values(), default=None)

    # -- collectives -----------------------------------------------------------------------

    def watch(self, fut: torch.futures.Future[Any], fallback: Any) -> torch.futures.Future[Any]:
        """A future that completes with ``fut``'s value, or with ``fallback`` (and a failed
        step) when ``fut`` fails or the guard aborts."""
        out: torch.futures.Future[Any] = torch.futures.Future()
        with self._lock:
            generation = self._generation
            skip = self.aborted is not None
            if not skip:
                self._pending[id(out)] = (out, fallback)
                self._started[id(out)] = time.monotonic()
        if skip:
            out.set_result(fallback)
            return out

        def done(f: torch.futures.Future[Any]) -> None:
            try:
                value = f.value()
            except Exception as exc:  # the group broke: a peer died
                self.fail(f"a collective failed ({_first_line(exc)})", generation)
                value = fallback
            with self._lock:
                self._pending.pop(id(out), None)
                self._started.pop(id(out), None)
            _complete(out, value)

        fut.add_done_callback(done)
        return out

    def run(self, start: Callable[[], dist.Work | None], fallback: Any = None) -> bool:
        """Start a collective and wait for it; False when it failed or was aborted."""
        if self.aborted is not None or self.failure is not None:
            return False
        try:
            work = start()
        except Exception as exc:
            self.fail(f"a collective failed to start ({_first_line(exc)})")
            return False
        if work is not None:
            self.watch(work.get_future(), fallback).wait()
        return self.failure is None

    def ddp_hook(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """DDP communication hook: the average over the current group, guarded."""
        buf = bucket.buffer()
        if self.failure is not None or self.aborted is not None:
            return self.watch(_done(buf), buf)
        world = dist.get_world_size()
        try:
            fut = dist.all_reduce(buf, async_op=True).get_future()
        except Exception as exc:
            self.fail(f"the gradient all-reduce failed to start ({_first_line(exc)})")
            return self.watch(_done(buf), buf)
        return self.watch(fut.then(lambda f: f.value()[0].div_(world)), buf)

    def install(self, model: torch.nn.Module, optimizer: Any, scheduler: Any) -> None:
        """Route ``model``'s (DDP) collectives through the guard; make ``optimizer.step()`` and
        ``scheduler.step()`` do nothing in a failed step."""
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            # DDP checks the hook's annotations, which this module keeps as strings.
            model.register_comm_hook(None, lambda state, bucket: self.ddp_hook(state, bucket))
            model._distributed_broadcast_coalesced = self._broadcast  # type: ignore[method-assign]
        optimizer.step = self._skipping(optimizer.step)  # as torch's LR schedulers do
        if scheduler is not None:  # its state_dict() is its __dict__: change the class
            cls = type(scheduler)
            step = self._skipping_method(cls.step)
            scheduler.__class__ = type(cls.__name__, (cls,), {"step": step})

    def _broadcast(self, tensors: list[torch.Tensor], buffer_size: int, src: int = 0) -> None:
        for t in tensors:
            if not self.run(functools.partial(dist.broadcast, t, src=src, async_op=True)):
                return

    def _skipping(self, step: Callable[..., Any]) -> Callable[..., Any]:
        # wraps() keeps the marks torch's LR schedulers put on optimizer.step
        @functools.wraps(step)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if self.failure is not None and not self.committed:
                return None  # the gradients are not the group's: keep the last state
            out = step(*args, **kwargs)
            self.committed = True
            return out

        return guarded

    def _skipping_method(self, step: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(owner: Any, *args: Any, **kwargs: Any) -> Any:
            if self.failure is not None and not self.committed:
                return None
            return step(owner, *args, **kwargs)

        return guarded


def _done(value: Any) -> torch.futures.Future[Any]:
    fut: torch.futures.Future[Any] = torch.futures.Future()
    fut.set_result(value)
    return fut


def _complete(out: torch.futures.Future[Any], value: Any) -> None:
    with contextlib.suppress(RuntimeError):  # completed already (a collective and an abort raced)
        out.set_result(value)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


__all__ = ["StepGuard"]
