"""The public API: ``elastic.Run`` wraps a plain DDP training loop.

::

    run = elastic.Run(model, optimizer, scheduler, sampler, checkpoint_url="runs/ckpt")
    for epoch in run.epochs(num_epochs):          # was: for epoch in range(num_epochs):
        for x, y in run.batches(loader):          # was: for x, y in loader:
            ...  # forward, backward, optimizer.step() as before

(or ``for step in run.steps(total):`` for a loop without epochs). Constructing the Run
resumes: from this node's shared-memory snapshot, else from a peer's (streamed over a
gloo group), else from shared storage (:mod:`elastic.recovery.exchange`). After every
``snapshot_every`` steps (``"auto"``: as often as costs under 3 % of the step time) the
state is snapshotted to shared memory (:mod:`elastic.recovery.snapshot`), and when the
loop fails (a peer died: a collective raised; an exception; a stop) the state of the
last completed step is written there at once (:mod:`elastic.recovery.jit`); every
``checkpoint_every`` steps it is also persisted, fenced, through
:class:`elastic.checkpoint.CheckpointManager`. On SIGTERM the group finishes the step,
saves, and this rank exits 0; its peers exit :data:`elastic.reform.EXIT_CODE` so that
their agents re-form the group without spending a restart.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from types import FrameType
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler as _TorchDistributedSampler

from elastic import env, events, reform
from elastic.recovery import exchange
from elastic.recovery.codec import from_json, to_json
from elastic.recovery.jit import AUTO, Every, StepSnapshots, stable_ptrs
from elastic.recovery.sampler import DistributedSampler
from elastic.recovery.snapshot import DEFAULT_DIR, SnapshotStore

logger = logging.getLogger(__name__)
B = TypeVar("B")


class Run:
    """One rank's training run: resume, per-step snapshots, fenced checkpoints, stops.

    Args:
        model: the (DDP-wrapped) model.
        optimizer: its optimizer.
        scheduler: an LR scheduler with ``state_dict()``, or None.
        sampler: the data sampler; a ``torch.utils.data.DistributedSampler`` becomes an
            :class:`elastic.DistributedSampler` (exact mid-epoch resume); any other needs
            ``state_dict()``/``load_state_dict()`` to resume exactly. Default: the
            sampler of the loader given to :meth:`batches`.
        checkpoint_url: where persisted checkpoints go (fsspec URL); None: memory only.
        checkpoint_every: persist every N steps.
        snapshot_every: snapshot to shared memory every N steps, or ``"auto"`` (an
            interval whose cost stays under ~3 % of the step time); a failed loop
            snapshots its last completed step either way. 0: no snapshots at all.
        run_id: names the snapshots and checkpoints; default: the rendezvous id.
        keep_last: persisted checkpoints kept.
        snapshot_dir: node-local shared memory (``/dev/shm``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        sampler: Any = None,
        *,
        checkpoint_url: str | os.PathLike[str] | None = None,
        checkpoint_every: int = 50,
        snapshot_every: Every = AUTO,
        run_id: str | None = None,
        keep_last: int = 3,
        snapshot_dir: str = DEFAULT_DIR,
    ) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.sampler = _exact(sampler)
        self.run_id = run_id or os.environ.get(env.RUN_ID) or "local"
        self.snapshot_every = snapshot_every
        self.checkpoint_every = checkpoint_every
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.step, self.epoch, self.consumed = 0, 0, 0
        self.resumed_from = "fresh"
        self.received_bytes = 0
        self._ctl = _gloo_group() if self.distributed else None
        self._fence = _fence_from_env()
        self._round = int(getattr(self._fence, "round", 0) or 0)
        self._checkpoints = None
        if checkpoint_url is not None:
            from elastic.checkpoint import CheckpointManager
            from elastic.training.config import CheckpointConfig

            cfg = CheckpointConfig(
                url=str(checkpoint_url), interval=checkpoint_every, keep_last=keep_last
            )
            group = _gloo_group() if self.distributed else None
            self._checkpoints = CheckpointManager(cfg, self.run_id, group, self._fence)
        local_rank = int(os.environ.get(env.LOCAL_RANK, "0"))
        self._store = SnapshotStore(self.run_id, local_rank, directory=snapshot_dir)
        self._jit = StepSnapshots(
            self._store,
            optimizer,
            self.state,
            self._advance,
            snapshot_every,
            self._round,
            model=model,
            extra=self._extra,
        )
        self._snapshots = self._jit.snapshotter
        self._in_batches = False
        self._stop = False
        self._signalled = False
        self._reform_only = False  # our agent stops us to re-form (elastic.reform)
        self._persist_on_stop = True
        self._previous: dict[int, Any] = {}
        self._install_signals()
        self._last_saved = -1
        self._last_step_at = time.perf_counter()
        self._batch = 0
        self._resume()

    # -- the loop ---------------------------------------------------------------------------

    def steps(self, total: int) -> Iterator[int]:
        """Yield the index of each step still to run, up to ``total`` steps in all."""
        self._jit.restart_clock()
        with self._failures("steps"):
            while self.step < total:
                yield self.step
                self._after_step(final=self.step + 1 >= total)
        self._complete()

    def epochs(self, total: int) -> Iterator[int]:
        """Yield the epochs still to run (the first one may be resumed mid-way)."""
        while self.epoch < total:
            epoch = self.epoch
            if self.sampler is not None and hasattr(self.sampler, "set_epoch"):
                self.sampler.set_epoch(epoch)
            yield epoch
            if self.epoch == epoch:  # the body did not run through batches()
                self.epoch, self.consumed = epoch + 1, 0
        self._complete()

    def batches(self, loader: Iterable[B]) -> Iterator[B]:
        """Yield the batches of the current epoch still to train on; each one is a step."""
        if self.sampler is None:
            self.sampler = _exact(getattr(loader, "sampler", None))
        if isinstance(self.sampler, DistributedSampler):
            self.sampler.set_epoch(self.epoch)
            self.sampler.consumed = self.consumed
        self._batch = int(getattr(loader, "batch_size", 0) or 0)
        self._jit.restart_clock()
        with self._failures("batches"):
            self._in_batches = True
            for batch in loader:
                yield batch
                self.consumed += self._batch * self.world_size
                self._after_step()
            self._in_batches = False
        self.epoch, self.consumed = self.epoch + 1, 0

    @contextlib.contextmanager
    def _failures(self, where: str) -> Iterator[None]:
        """Snapshot the last completed step when the loop fails or is left early (a
        collective raised because a peer died, an exception, ``break``)."""
        try:
            yield
        except GeneratorExit:
            self._jit.failed(f"the loop over {where}() ended early")
            raise
        except SystemExit:  # our own stop: _complete() wrote the final snapshot
            raise
        except BaseException as exc:
            self._jit.failed(f"{type(exc).__name__} in {where}(): {exc}")
            raise

    def _advance(self) -> int:
        """Move the counters on as the loop does after ``optimizer.step()`` (for a
        failure-time snapshot taken after the optimizer stepped)."""
        if self._in_batches:
            self.consumed += self._batch * self.world_size
        self.step += 1
        return self.step

    # -- state ------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The training state that snapshots hold (tensors are not copied)."""
        return {
            "model": self.model.state_dict(),
            "optim": self.optimizer.state_dict(),
            **self._extra(),
        }

    def _extra(self) -> dict[str, Any]:
        extra: dict[str, Any] = {
            "train": {
                "step": self.step,
                "epoch": self.epoch,
                "consumed": self.consumed,
                "world_size": self.world_size,
            },
            "rng": _rng_state(),
        }
        if self.scheduler is not None:
            extra["scheduler"] = self.scheduler.state_dict()
        if self.sampler is not None and hasattr(self.sampler, "state_dict"):
            extra["sampler"] = self.sampler.state_dict()
        return extra

    def _stable(self) -> set[int]:
        """Tensors only ``optimizer.step()`` changes: copied in the background."""
        return stable_ptrs(self.optimizer)

    def _apply(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        self._apply_extra(state)

    def _apply_extra(self, state: dict[str, Any]) -> None:
        train = state["train"]
        self.step, self.epoch = int(train["step"]), int(train["epoch"])
        self.consumed = int(train["consumed"])
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.sampler is not None and "sampler" in state:
            self.sampler.load_state_dict(state["sampler"])
        _set_rng_state(state["rng"])

    def _persist_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "extra": to_json(self._extra())}

    # -- resume -----------------------------------------------------------------------------

    def _resume(self) -> None:
        started = time.perf_counter()
        found = self._store.newest()
        held = (found[1].step, found[1].round) if found else None
        persisted = self._persisted_step() if self.rank == 0 else -1
        plan = exchange.agree(held, persisted, self._ctl)
        if plan.source == "storage":
            self._load_storage()
        elif plan.source == "memory":
            self._load_memory(plan)
        seconds = time.perf_counter() - started
        self._last_saved = self.step if plan.source == "storage" else -1
        logger.info(
            "Resumed at step %d from %s in %.3f s (world size %d; held %s, persisted %d).",
            self.step,
            self.resumed_from,
            seconds,
            self.world_size,
            held,
            plan.persisted,
        )
        events.emit(
            "recovery.resume",
            step=self.step,
            source=self.resumed_from,
            seconds=round(seconds, 4),
            bytes=self.received_bytes,
            rank=self.rank,
            world_size=self.world_size,
            held=held[0] if held else None,
            persisted=plan.persisted,
        )

    def _load_memory(self, plan: exchange.Plan) -> None:
        started = time.perf_counter()
        state, self.resumed_from, self.received_bytes = exchange.fetch(plan, self._store, self._ctl)
        self._apply(state)
        events.emit(
            "ckpt.load",
            step=self.step,
            url="",
            source=self.resumed_from,
            seconds=round(time.perf_counter() - started, 4),
            rank=self.rank,
            world_size=self.world_size,
        )

    def _load_storage(self) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        assert self._checkpoints is not None
        loaded = self._checkpoints.load_latest(self._persist_state)
        if loaded is None:
            return
        state = loaded[1]
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        self._apply_extra(from_json(state["extra"]))
        self.resumed_from = "storage"

    def _persisted_step(self) -> int:
        """The newest committed checkpoint's step (commit records in etcd when fenced)."""
        if self._checkpoints is None:
            return -1
        return exchange.persisted_step(self._checkpoints.cfg.url, self.run_id, self._fence)

    def _group_rank(self) -> int:
        return dist.get_rank(self._ctl) if self._ctl is not None else 0

    # -- after each step --------------------------------------------------------------------

    def _after_step(self, final: bool = False) -> None:
        self.step += 1
        now = time.perf_counter()
        seconds, self._last_step_at = now - self._last_step_at, now
        self._jit.boundary(self.step)
        if self.rank == 0:
            fields: dict[str, Any] = {}
            if self._batch:
                fields["samples_per_s"] = round(self._batch * self.world_size / seconds, 2)
            events.emit(
                "train.step",
                step=self.step,
                world_size=self.world_size,
                epoch=self.epoch,
                lr=self.optimizer.param_groups[0].get("lr"),
                **fields,
            )
        stop = self._agree_stop()
        if (
            self._checkpoints is not None
            and self.step % self.checkpoint_every == 0
            and not (stop or final)
        ):
            self._checkpoints.save(self.step, self._persist_state())
            self._last_saved = self.step
        if stop:
            self._complete(persist=self._persist_on_stop)
            self._teardown_groups()
            if self._signalled:
                logger.info("Stopped at step %d on request; exiting.", self.step)
                raise SystemExit(reform.OK)
            logger.info("A peer asked the group to stop at step %d; exiting to re-form.", self.step)
            raise SystemExit(reform.EXIT_CODE)

    def _agree_stop(self) -> bool:
        """Whether the group stops after this step; also agrees whether that stop needs a
        persisted checkpoint (any rank's vote, see :meth:`_persist_vote`)."""
        if self._ctl is None:
            self._persist_on_stop = self._persist_vote()
            return self._stop
        flags = torch.tensor([int(self._stop), int(self._persist_vote())], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._ctl)
        self._persist_on_stop = bool(flags[1].item())
        return bool(flags[0].item())

    def _persist_vote(self) -> bool:
        """Yes unless our agent stops us to re-form and keeps our memory snapshot."""
        survives = self._jit.enabled and self._store.owner != os.getpid()
        return not survives or (self._stop and not self._reform_only)

    def _complete(self, persist: bool = True) -> None:
        """Finish: the snapshot in flight, a final persisted checkpoint (unless the group
        only re-forms: ``persist`` False), the signal handlers."""
        if self._store.owner != os.getpid():  # a restart of this node may use it
            self._jit.failed("the loop stopped")
        self._jit.wait()
        self._jit.close()  # the loop is over: no failure-time snapshot from here on
        if self._checkpoints is not None:
            if persist and self._last_saved != self.step and self.step > 0:
                self._checkpoints.save(self.step, self._persist_state(), block=True)
                self._last_saved = self.step
            self._checkpoints.close()
        self._restore_signals()
        if self._store.owner == os.getpid():
            self._store.remove()

    def _teardown_groups(self) -> None:
        """Destroy the process groups before the process exits (their C++ threads must be
        joined while the interpreter is alive, or the exit can end in std::terminate)."""
        self._jit.close()
        self._store.close()
        if self.distributed and dist.is_initialized():
            if self._ctl is not None:
                dist.barrier(group=self._ctl)
            dist.destroy_process_group()
        self._ctl = None

    def close(self) -> None:
        """Wait for background work and unmap the snapshot files (they stay for a restart)."""
        self._snapshots.wait()
        if self._checkpoints is not None:
            self._checkpoints.close()
        self._jit.close()
        if self._store.owner == os.getpid():  # no agent: nobody could ever use them
            self._store.remove()
        self._store.close()
        self._restore_signals()

    @property
    def snapshot_stats(self) -> dict[str, float]:
        """Counts and seconds spent on snapshots (``sync_s`` on the training thread)."""
        return dict(self._snapshots.stats)

    # -- signals ----------------------------------------------------------------------------

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _restore_signals(self) -> None:
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        logger.warning(
            "Received %s; the group stops after this step with a checkpoint (send it again "
            "to stop at once).",
            signal.Signals(signum).name,
        )
        self._stop = self._signalled = True
        self._reform_only = reform.stopping_for_reform()
        signal.signal(signum, signal.SIG_DFL)


def _gloo_group() -> dist.ProcessGroup:
    """A gloo group of every rank (its own: never shared between two threads)."""
    group = dist.new_group(backend="gloo")
    assert isinstance(group, dist.ProcessGroup)
    return group


def _exact(sampler: Any) -> Any:
    """Give torch's DistributedSampler an exact resume point (a subclass, no new state)."""
    if type(sampler) is _TorchDistributedSampler:
        sampler.__class__ = DistributedSampler
    return sampler


def _fence_from_env() -> Any:
    if not os.environ.get(env.FENCE):
        return None
    from elastic.rendezvous.fence import FenceSpec, RoundFence

    spec = FenceSpec.from_env()
    return RoundFence(spec) if spec is not None else None


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    numpy = sys.modules.get("numpy")
    if numpy is not None and "numpy" in state:
        numpy.random.set_state(tuple(state["numpy"]))


__all__ = ["Run"]
