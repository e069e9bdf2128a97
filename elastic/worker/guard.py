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
timeout; the group is dropped, never joined (``elastic.worker.groups``). A collective
released early thus goes on in gloo's thread, reading and writing its tensors: each guarded
collective works on a copy of its own, put into the caller's tensor only when it succeeded
(before, a leaving rank released from the BatchNorm all-reduce divided that tensor in place
while gloo still sent it, and its peers' step completed with those values: the last BN
layer's statistics ended 7e-3 from a fault-free run's, parameters exact).

No Python callback is ever attached to a gloo future itself: a collective of a dropped
group fails when its peers exit, and gloo's thread then ran such a callback after the
interpreter had finalized (SIGSEGV in ``PyThreadState_New`` under
``pybind11::gil_scoped_acquire`` from ``ProcessGroupGloo::AsyncWork::finishWorkGlooError``:
the thawed worker's crash at the job's end). Each collective's gloo future is linked, in
C++, to a future of the guard's own (``torch.futures.collect_all`` of it, the *link*), and
the guard's callback hangs on the link. A collective that succeeds or fails completes the
link in gloo's thread, which runs the callback at once: the waiting thread (DDP's reducer,
or the training thread in :meth:`StepGuard.run`) wakes as it would on gloo's own future, with
no thread and no polling in between. A release (an abort, a re-form, the exit) completes the
link itself while Python runs, so its callback runs then and is gone; gloo completing it
later finds it complete and runs no Python (``collectAll`` checks), and the released link
is kept alive for good, so that gloo's thread never frees the Python value it holds.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from elastic.worker import groups

logger = logging.getLogger(__name__)


CLOSE_WAIT_S = 1.0  # at exit: how long a callback that gloo's thread is running may take


class _Entry:
    """A guarded collective (or future) in flight: the guard's future ``out``, what
    completes it on success (``value``) and on failure or release (``fallback``); for a
    collective, gloo's future and its link."""

    __slots__ = ("fallback", "generation", "gloo", "link", "out", "released", "settled", "value")

    def __init__(self, out: torch.futures.Future[Any], fallback: Any, generation: int) -> None:
        self.out, self.fallback, self.generation = out, fallback, generation
        self.value: Callable[[], Any] = lambda: None
        self.gloo: torch.futures.Future[Any] | None = None
        self.link: torch.futures.Future[Any] | None = None
        self.released = False
        self.settled = False  # the link's callback has run

    def release(self) -> bool:
        """Complete ``out`` with the fallback and dispose of the link's callback now; False
        when gloo's thread is completing the link itself (its callback runs there)."""
        self.released = True
        link, gloo = self.link, self.gloo
        mine = True
        if link is not None and gloo is not None:
            mine = not gloo.done()
            if mine:
                with contextlib.suppress(RuntimeError):  # gloo completed it just now
                    link.set_result(None)
                _keep_forever(link)
        _complete(self.out, self.fallback)
        return mine


def _keep_forever(link: torch.futures.Future[Any]) -> None:
    """A released link holds a Python value: gloo's thread may drop its last C++ reference
    after the interpreter finalized, so its Python object is never freed."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(link))


class StepGuard:
    """Turns failed or aborted collectives into a failed step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[int, _Entry] = {}
        self._started: dict[int, float] = {}  # monotonic start time of each pending collective
        # Seconds some collective was in flight, summed (the rank's wait: elastic.worker.timing)
        self._waited_s = 0.0
        self._busy_since: float | None = None
        self.failure: str | None = None  # why this step failed; None while it is fine
        self.aborted: str | None = None  # the agent's abort, until the group re-forms
        # optimizer.step() ran in this step: its all-reduce had succeeded, so the step is
        # complete whatever fails after it (nothing after it is skipped).
        self.committed = False
        # Bumped by reset(): a collective of an older group that fails late (its peer left
        # long ago) must not fail the step of the current one.
        self._generation = 0
        self._exit_registered = False
        self._closed = False

    # -- state -----------------------------------------------------------------------------

    def reset(self) -> None:
        """A new group: nothing failed, nothing pending."""
        with self._lock:
            self.failure = self.aborted = None
            pending = self._take_pending()
            self.committed = False
            self._generation += 1
        for entry in pending:  # of the dropped group: nobody waits for them
            entry.release()

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
            pending = self._take_pending()
        self.fail(reason)
        for entry in pending:
            entry.release()

    def in_flight_since(self) -> float | None:
        """When the oldest collective still in flight started (``time.monotonic()``)."""
        with self._lock:
            return min(self._started.values(), default=None)

    def _take_pending(self) -> list[_Entry]:
        """(Under the lock.) Every entry in flight, forgotten."""
        pending = list(self._pending.values())
        self._pending, self._started = {}, {}
        self._idle()
        return pending

    def _track(self, fallback: Any) -> _Entry | None:
        """An entry for a collective (or future) just started; None when aborted."""
        out: torch.futures.Future[Any] = torch.futures.Future()
        with self._lock:
            if self.aborted is not None or self._closed:
                return None
            entry = _Entry(out, fallback, self._generation)
            self._pending[id(entry)] = entry
            if not self._started:
                self._busy_since = time.monotonic()
            self._started[id(entry)] = time.monotonic()
            if not self._exit_registered:
                atexit.register(self.close)  # while Python runs: release what is in flight
                self._exit_registered = True
        return entry

    def _untrack(self, entry: _Entry) -> None:
        with self._lock:
            self._pending.pop(id(entry), None)
            self._started.pop(id(entry), None)
            if not self._started:
                self._idle()

    def _idle(self) -> None:
        """(Under the lock.) Nothing is in flight any more: add the busy interval."""
        if self._busy_since is not None:
            self._waited_s += time.monotonic() - self._busy_since
            self._busy_since = None

    def waited(self) -> float:
        """Seconds some collective was in flight since this guard was made (the current
        interval included): the time this rank's step waited for its peers."""
        with self._lock:
            since = self._busy_since
            return self._waited_s + (time.monotonic() - since if since is not None else 0.0)

    # -- collectives -----------------------------------------------------------------------

    def watch(self, fut: torch.futures.Future[Any], fallback: Any) -> torch.futures.Future[Any]:
        """A future that completes with ``fut``'s value, or with ``fallback`` (and a failed
        step) when ``fut`` fails or the guard aborts. For futures made in Python (a gloo
        future goes through :meth:`_link`, see the module's doc)."""
        entry = self._track(fallback)
        if entry is None:
            return _done(fallback)

        def done(f: torch.futures.Future[Any]) -> None:
            try:
                value = f.value()
            except Exception as exc:  # the group broke: a peer died
                self.fail(f"a collective failed ({_first_line(exc)})", entry.generation)
                value = fallback
            self._untrack(entry)
            _complete(entry.out, value)

        fut.add_done_callback(done)
        return entry.out

    def _link(
        self, work: dist.Work, value: Callable[[], Any], fallback: Any
    ) -> torch.futures.Future[Any] | None:
        """The guard's future for a collective just started: ``value()`` when it succeeded,
        ``fallback`` (and a failed step) when it failed or was released; None when the guard
        is aborted (nothing is waited for)."""
        entry = self._track(fallback)
        if entry is None:
            return None
        entry.value = value
        gloo = entry.gloo = work.get_future()
        link = entry.link = torch.futures.collect_all([gloo])

        def done(_: torch.futures.Future[Any]) -> None:
            # gloo's thread (the collective completed), or a release (then never the
            # link's value: it is not the collective's).
            result = entry.fallback
            if not entry.released:
                try:
                    gloo.value()  # raises when the collective failed
                    result = entry.value()
                except Exception as exc:  # a peer died, or a result that cannot be read
                    self.fail(f"a collective failed ({_first_line(exc)})", entry.generation)
                    result = entry.fallback
            self._untrack(entry)
            _complete(entry.out, result)
            entry.settled = True

        link.add_done_callback(done)
        return entry.out

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
        out = self._link(work, lambda: None, fallback)
        if out is None:
            return False
        out.wait()  # completed in gloo's thread as the collective completes, or by a release
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
        summed = buf.clone()
        try:
            work = dist.all_reduce(summed, async_op=True)
        except Exception as exc:
            self.fail(f"the gradient all-reduce failed to start ({_first_line(exc)})")
            return self.watch(_done(buf), buf)
        out = self._link(work, lambda: summed.div_(world), buf)
        return self.watch(_done(buf), buf) if out is None else out

    def close(self) -> None:
        """At exit, while Python runs: release what is still in flight (its collective is
        left to gloo; no Python runs when it completes)."""
        with self._lock:
            self._closed = True
            pending = self._take_pending()
        racing = [entry for entry in pending if not entry.release()]
        deadline = time.monotonic() + CLOSE_WAIT_S
        while not all(entry.settled for entry in racing) and time.monotonic() < deadline:
            time.sleep(0.001)  # gloo's thread runs their callback in microseconds: let it

    def install(self, model: torch.nn.Module, optimizer: Any, scheduler: Any) -> None:
        """Route ``model``'s (DDP) collectives through the guard; make ``optimizer.step()`` and
        ``scheduler.step()`` do nothing in a failed step."""
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            # DDP checks the hook's annotations, which this module keeps as strings.
            model.register_comm_hook(None, lambda state, bucket: self.ddp_hook(state, bucket))
            groups.route_buffer_broadcast(model, self._broadcast)
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
