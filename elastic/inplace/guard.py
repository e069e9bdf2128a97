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
timeout; the group is dropped, never joined (``elastic.inplace.groups``). A collective
released early thus goes on in gloo's thread, reading and writing its tensors: each guarded
collective works on a copy of its own, put into the caller's tensor only when it succeeded
(before, a leaving rank released from the BatchNorm all-reduce divided that tensor in place
while gloo still sent it, and its peers' step completed with those values: the last BN
layer's statistics ended 7e-3 from a fault-free run's, parameters exact).

No Python callback is ever attached to a gloo future: such a collective of a dropped group
fails when its peers exit, and gloo's thread then ran the callback after the interpreter had
finalized (SIGSEGV in ``PyThreadState_New`` under ``pybind11::gil_scoped_acquire`` from
``ProcessGroupGloo::AsyncWork::finishWorkGlooError``: the thawed worker's crash at the
job's end). The training thread waits for its collectives in slices of :data:`WAIT_S`
(``Work.wait(timeout)``, woken at once when it completes), and one thread of the guard's
own completes DDP's hook futures the same way; it stops at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

WAIT_S = 0.005  # a guarded wait looks at an abort this often (a completion wakes it at once)
_SLICE = timedelta(seconds=WAIT_S)


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
        # DDP's gradient all-reduces in flight, completed in order by the hook thread.
        self._hooks: queue.SimpleQueue[tuple[Any, torch.futures.Future[Any], Any, int, int]]
        self._hooks = queue.SimpleQueue()
        self._hook_thread: threading.Thread | None = None
        self._closed = threading.Event()

    # -- state -----------------------------------------------------------------------------

    def reset(self) -> None:
        """A new group: nothing failed, nothing pending."""
        with self._lock:
            self.failure = self.aborted = None
            pending, self._pending, self._started = self._pending, {}, {}
            self.committed = False
            self._generation += 1
        for out, fallback in pending.values():  # of the dropped group: nobody waits for them
            _complete(out, fallback)

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

    def _track(self, fallback: Any) -> tuple[torch.futures.Future[Any], int] | None:
        """A released-on-abort future for a collective just started (None: aborted)."""
        out: torch.futures.Future[Any] = torch.futures.Future()
        with self._lock:
            if self.aborted is not None:
                return None
            self._pending[id(out)] = (out, fallback)
            self._started[id(out)] = time.monotonic()
            return out, self._generation

    def _untrack(self, out: torch.futures.Future[Any]) -> None:
        with self._lock:
            self._pending.pop(id(out), None)
            self._started.pop(id(out), None)

    def _wait(self, work: Any, out: torch.futures.Future[Any], generation: int) -> bool | None:
        """Wait for ``work`` in slices: True when it succeeded, False when it failed (the
        step fails), None when the guard released it first (abort, or the guard closed)."""
        while not out.done() and not self._closed.is_set() and generation == self._generation:
            try:
                if work.wait(_SLICE):
                    return True
            except Exception as exc:
                if not work.is_completed():
                    continue  # the slice ended: look at an abort, then wait on
                if work.exception() is None:
                    return True  # it completed just after the slice ended
                self.fail(f"a collective failed ({_first_line(exc)})", generation)
                return False
        return None  # released, or its group was re-formed away (nobody waits for it)

    def run(self, start: Callable[[], dist.Work | None], fallback: Any = None) -> bool:
        """Start a collective and wait for it; False when it failed or was aborted."""
        if self.aborted is not None or self.failure is not None:
            return False
        try:
            work = start()
        except Exception as exc:
            self.fail(f"a collective failed to start ({_first_line(exc)})")
            return False
        if work is None:
            return self.failure is None
        tracked = self._track(fallback)
        if tracked is None:
            return False
        out, generation = tracked
        try:
            self._wait(work, out, generation)
        finally:
            self._untrack(out)
        return self.failure is None

    def all_reduce(self, tensor: torch.Tensor, op: Any = None) -> bool:
        """``dist.all_reduce(tensor, op)`` on the current group, guarded: the collective
        runs on a copy, put into ``tensor`` only when it succeeded (a released collective
        goes on in gloo's thread: the caller's tensor is the caller's again at once)."""
        op = dist.ReduceOp.SUM if op is None else op
        work = tensor.detach().clone()
        if not self.run(lambda: dist.all_reduce(work, op=op, async_op=True)):
            return False
        tensor.copy_(work)
        return True

    def ddp_hook(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """DDP communication hook: the average over the current group, guarded (on a copy
        of the bucket: the reducer owns the bucket again when the guard releases it)."""
        buf = bucket.buffer()
        if self.failure is not None or self.aborted is not None:
            return self.watch(_done(buf), buf)
        world = dist.get_world_size()
        try:
            work = dist.all_reduce(buf.clone(), async_op=True)
        except Exception as exc:
            self.fail(f"the gradient all-reduce failed to start ({_first_line(exc)})")
            return self.watch(_done(buf), buf)
        tracked = self._track(buf)
        if tracked is None:
            return self.watch(_done(buf), buf)
        out, generation = tracked
        self._hooks.put((work, out, buf, world, generation))
        self._start_hook_thread()
        return out

    def _start_hook_thread(self) -> None:
        if self._hook_thread is None:
            self._hook_thread = threading.Thread(
                target=self._complete_hooks, name="elastic-guard", daemon=True
            )
            self._hook_thread.start()
            atexit.register(self.close)  # while Python is alive, not from a gloo thread

    def _complete_hooks(self) -> None:
        """Complete each hook future with its average, or its input when it failed."""
        while not self._closed.is_set():
            try:
                work, out, fallback, world, generation = self._hooks.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                ok = self._wait(work, out, generation)
                value = work.result()[0].div_(world) if ok else fallback
            except Exception as exc:  # a result that cannot be read: the step fails
                self.fail(f"the gradient all-reduce failed ({_first_line(exc)})", generation)
                value = fallback
            finally:
                self._untrack(out)
            _complete(out, value)

    def close(self) -> None:
        """Stop the hook thread (at exit; a collective still in flight is left to gloo)."""
        self._closed.set()
        thread = self._hook_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=1)

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
        """DDP's buffer broadcast, on copies: the source's forward pass changes its buffers
        (BatchNorm statistics) while a released broadcast could still send them."""
        for t in tensors:
            work = t.detach().clone()
            if not self.run(functools.partial(dist.broadcast, work, src=src, async_op=True)):
                return
            t.copy_(work)

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
