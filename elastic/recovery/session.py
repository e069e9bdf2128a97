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
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler as _TorchDistributedSampler

from elastic import env, events, reform, runid
from elastic.errors import RecoveryError
from elastic.inplace import groups
from elastic.inplace.channel import Assignment
from elastic.inplace.member import BROKEN, READY, Member
from elastic.procs import die_with_parent
from elastic.recovery import exchange
from elastic.recovery.codec import from_json, to_json
from elastic.recovery.jit import AUTO, Every, StepSnapshots, stable_ptrs
from elastic.recovery.sampler import DistributedSampler
from elastic.recovery.snapshot import DEFAULT_DIR, SnapshotStore

logger = logging.getLogger(__name__)
B = TypeVar("B")
REFORM_ATTEMPTS = 3  # rounds a re-form tries while peers keep failing, before it restarts


class _Reform(Exception):
    """The group re-forms in place after this step (a round changed, a peer is gone)."""


class _Interrupted(RecoveryError):
    """A re-form was cut short before any state moved (a peer failed): try the next round."""


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
        run_id: names the snapshots and checkpoints; default: the rendezvous id, else
            ``"local"`` (the rule: :func:`elastic.runid.resolve`).
        keep_last: persisted checkpoints kept.
        snapshot_dir: node-local shared memory (``/dev/shm``).
        global_batch_size: keep the global batch constant across world sizes: each rank's
            loader (given to :meth:`batches`) yields ``global_batch_size // world_size``
            samples a step, set again after every re-form. None: the loader's own.
        checkpoint: every checkpoint setting (an
            :class:`elastic.training.config.CheckpointConfig`) in place of
            ``checkpoint_url``/``checkpoint_every``/``keep_last``.
        init_from: a checkpoint that plain ``torch.distributed.checkpoint.save`` wrote
            (torchtitan, an earlier run of yours): a job with no state of its own yet
            starts from its model and optimizer (what it lacks, e.g. a data position, is
            logged and starts fresh). Default: ``checkpoint.init_from``.

    In-place re-forms: when the script formed its group with
    :func:`elastic.init_process_group` under our agent, a change of membership re-forms the
    group inside this process (:mod:`elastic.inplace`); :attr:`rank` and
    :attr:`world_size` follow it.
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
        global_batch_size: int | None = None,
        checkpoint: Any = None,
        init_from: str | None = None,
    ) -> None:
        if env.RUN_ID in os.environ:  # under an agent: never outlive it (a kill -9 of it)
            die_with_parent()
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.sampler = _exact(sampler)
        self.run_id = runid.resolve(run_id)
        self.snapshot_every = snapshot_every
        self.checkpoint_every = checkpoint_every
        self.global_batch_size = global_batch_size
        self._loader: Any = None
        self.step, self.epoch, self.consumed = 0, 0, 0
        self.resumed_from = "fresh"
        self.received_bytes = 0
        self.reforms = 0  # in-place re-forms this process took part in
        self._join_group()
        self._configure_checkpoints(checkpoint, checkpoint_url, checkpoint_every, keep_last)
        self._init_from = init_from or getattr(checkpoint, "init_from", None)
        self._make_snapshots(snapshot_dir)
        self._reset_loop_state()
        self._install_signals()
        self._start()

    def _join_group(self) -> None:
        """Where this rank trains: the job's group, joined in place when the agent offers
        it (``elastic.init_process_group``), else the one the script formed, or none."""
        self._member = Member.from_env()
        joined: Assignment | None = None
        if self._member is not None:
            self._member.guard.install(self.model, self.optimizer, self.scheduler)
            joined = self._member.join()[0]
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self._round_of_state = -1  # the round whose group produced the live state
        self._ctl = self._control_group() if self.distributed else None
        self._fence = _fence_from_env(joined.fence if joined is not None else None)
        self._round = joined.round if joined is not None else _round_of(self._fence)

    def _configure_checkpoints(
        self, checkpoint: Any, url: str | os.PathLike[str] | None, every: int, keep_last: int
    ) -> None:
        """The checkpoint settings (``checkpoint=`` wins over the plain arguments) and, off
        the in-place path, the manager (in place it is made with each group)."""
        self._checkpoints: Any = None
        self._ckpt_cfg: Any = checkpoint if checkpoint is None or checkpoint.enabled else None
        if checkpoint is not None:
            self.checkpoint_every = checkpoint.interval
        elif url is not None:
            from elastic.checkpoint.config import CheckpointConfig

            self._ckpt_cfg = CheckpointConfig(url=str(url), interval=every, keep_last=keep_last)
        if self._ckpt_cfg is not None and self._member is None:
            self._checkpoints = self._checkpoint_manager()

    def _make_snapshots(self, directory: str) -> None:
        local_rank = int(os.environ.get(env.LOCAL_RANK, "0"))
        self._store = SnapshotStore(self.run_id, local_rank, directory=directory)
        self._jit = StepSnapshots(
            self._store,
            self.optimizer,
            self.state,
            self._advance,
            self.snapshot_every,
            self._round,
            model=self.model,
            extra=self._extra,
        )
        self._snapshots = self._jit.snapshotter

    def _reset_loop_state(self) -> None:
        self._in_batches = False
        self._dealt = False  # the current epoch's body ran through batches()
        self._job_stopped = False  # every rank stopped at the last agreement
        self._stop = False
        self._signalled = False
        self._reform_only = False  # our agent stops us to re-form (elastic.reform)
        self._persist_on_stop = True
        self._previous: dict[int, Any] = {}
        self._last_saved = -1
        self._last_step_at = time.perf_counter()
        self._batch = 0
        self._loss = torch.zeros(2, dtype=torch.float64)  # this step's (sum, weight)
        self.loss: float | None = None  # the group's mean loss of the last step

    def _start(self) -> None:
        """Resume: in place, join the group's state; else the usual resume."""
        if self._member is not None:
            self._on_new_group()
            self._sync_state(live=False)
            return
        if self._checkpoints is not None:
            # An unwritable URL: one sentence, at start (a collective: every rank starts
            # here together, unlike a joiner in place, whose peers are mid-run).
            self._checkpoints.check_storage()
        self._resume()

    def _control_group(self) -> dist.ProcessGroup | None:
        """Our collectives' group: the job's own when in place (it is swapped on each
        re-form; our collectives run on the training thread between steps), else a
        gloo group of its own."""
        return dist.group.WORLD if self._member is not None else _gloo_group()

    def _checkpoint_manager(self) -> Any:
        from elastic.checkpoint import CheckpointManager

        group = None
        if self.distributed:
            group = groups.side_group() if self._member is not None else _gloo_group()
        return CheckpointManager(self._ckpt_cfg, self.run_id, group, self._fence)

    # -- the loop ---------------------------------------------------------------------------

    def steps(self, total: int) -> Iterator[int]:
        """Yield the index of each step still to run, up to ``total`` steps in all."""
        self._jit.restart_clock()
        with self._failures("steps"):
            while self.step < total:
                yield self.step
                try:
                    self._finish_step(final=self.step + 1 >= total)
                except _Reform:
                    self._reform()
        self._complete()

    def epochs(self, total: int) -> Iterator[int]:
        """Yield the epochs still to run (the first one may be resumed mid-way).

        Raises:
            RecoveryError: an epoch's body left the epoch counter anywhere but on the next
                epoch (the loop would skip epochs and end early, silently).
        """
        while self.epoch < total:
            epoch = self.epoch
            if self.sampler is not None and hasattr(self.sampler, "set_epoch"):
                self.sampler.set_epoch(epoch)
            self._dealt = False
            yield epoch
            if not self._dealt:  # the body did not run through batches()
                self.epoch, self.consumed = epoch + 1, 0
            elif self.epoch != epoch + 1:
                raise RecoveryError(
                    f"Epoch {epoch} ended with the epoch counter at {self.epoch} (step "
                    f"{self.step}); the loop stops rather than skip epochs. This is a bug: "
                    "please report it with the worker's log."
                )
        self._complete()

    def batches(self, loader: Iterable[B]) -> Iterator[B]:
        """Yield the batches of the current epoch still to train on; each one is a step."""
        if self.sampler is None:
            self.sampler = _exact(getattr(loader, "sampler", None))
        if isinstance(self.sampler, DistributedSampler):
            self.sampler.set_epoch(self.epoch)
            self.sampler.consumed = self.consumed
        self._loader = loader
        self._dealt = True
        epoch = self.epoch
        self._set_batch()
        self._jit.restart_clock()
        with self._failures("batches"):
            self._in_batches = True
            while True:
                try:
                    for batch in loader:
                        yield batch
                        self._finish_step()
                    break
                except _Reform:
                    self._reform()
                    self._deal_rest(epoch)
            self._in_batches = False
        self.epoch, self.consumed = self.epoch + 1, 0

    def _finish_step(self, final: bool = False) -> None:
        """Count the step just run, unless its collectives failed before the optimizer
        stepped (in place: then the state of the last completed step is restored and the
        group re-forms; a step whose optimizer stepped is complete and counts)."""
        guard = self._member.guard if self._member is not None else None
        if guard is not None and guard.failure is not None and not guard.committed:
            if self._stop or self._member.leaving:  # type: ignore[union-attr]
                self._leave()  # the step in flight was this node's last
            self._rewind()
            self._loss.zero_()
            raise _Reform
        if guard is not None:
            guard.committed = False
        if self._in_batches:
            self.consumed += self._batch * self.world_size
        self._after_step(final=final)

    def _set_batch(self) -> None:
        """Each rank's batch: the loader's, or the share of the constant global batch."""
        loader = self._loader
        if self.global_batch_size is not None:
            share, rest = divmod(self.global_batch_size, self.world_size)
            if rest or not share:
                raise RecoveryError(
                    f"global_batch_size={self.global_batch_size} does not divide among "
                    f"{self.world_size} ranks; choose a multiple of every world size the "
                    "job may run at."
                )
            batch_sampler = getattr(loader, "batch_sampler", None)
            if batch_sampler is not None and hasattr(batch_sampler, "batch_size"):
                batch_sampler.batch_size = share
            self._batch = share
            return
        self._batch = int(getattr(loader, "batch_size", 0) or 0)

    def _deal_rest(self, epoch: int) -> None:
        """After a re-form in epoch ``epoch``: deal its remaining samples to the new group.

        The state the group agreed on (a rewound step, a peer's) may be the boundary kept
        at the end of the previous epoch: its last step's, taken before the loop moved on
        to ``epoch`` (``epoch - 1``, every sample consumed). It is the same point as
        ``epoch`` with nothing consumed, and is taken as such: dealt as it stands, the
        epoch would find nothing left and the epoch loop would skip one (issue 25).

        Raises:
            RecoveryError: the agreed state is of another epoch still (a bug).
        """
        self.epoch, self.consumed = rolled_over(self.epoch, self.consumed, epoch, self.step)
        if isinstance(self.sampler, DistributedSampler):
            self.sampler.set_epoch(self.epoch)
            self.sampler.consumed = self.consumed
        self._set_batch()

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

    def all_reduce(self, tensor: torch.Tensor, op: Any = None) -> bool:
        """``dist.all_reduce(tensor)`` (sum) on the group, safe across a peer's failure: in
        place, a collective that fails or hangs on a lost peer returns False instead of
        raising or hanging, the step does not count and is redone after the re-form (its
        ``optimizer.step()`` does nothing). True when the result is in ``tensor``."""
        op = dist.ReduceOp.SUM if op is None else op
        if not self.distributed or self.world_size == 1:
            return True
        if self._member is None:
            dist.all_reduce(tensor, op=op)
            return True
        return self._member.guard.all_reduce(tensor, op)

    def log_loss(self, value: float | torch.Tensor, weight: float = 1.0) -> None:
        """This rank's loss of the step (``weight``: e.g. its number of samples). It rides
        on the group's own agreement after the step (no collective of its own): the
        weighted mean over the ranks is :attr:`loss` and the ``train.step`` event's."""
        self._loss[0] += float(value) * weight
        self._loss[1] += weight

    def save(self, block: bool = False) -> None:
        """Persist the current step now (besides every ``checkpoint_every`` steps); with
        ``block``, return when it is committed. Without a checkpoint URL it does nothing."""
        if self._checkpoints is not None:
            self._checkpoints.save(self.step, self._persist_state(), block=block)
            self._last_saved = self.step

    def wait(self) -> None:
        """Wait for the checkpoint and snapshot in flight."""
        self._snapshots.wait()
        if self._checkpoints is not None:
            self._checkpoints.wait()

    @property
    def stopped_by_signal(self) -> bool:
        """Whether SIGTERM/SIGINT stopped this run (it saved first)."""
        return self._signalled

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

    def _resume(self, stale_live: bool = False) -> None:
        started = time.perf_counter()
        found = self._store.newest()
        held = (found[1].step, found[1].round) if found and not stale_live else None
        persisted = self._persisted_step() if self.rank == 0 else -1
        plan = exchange.agree(held, persisted, self._ctl)
        if plan.source == "storage":
            self._load_storage()
        elif plan.source == "memory":
            self._load_memory(plan)
        elif plan.source == "fresh" and self._init_from:
            self._start_from(self._init_from)
        elif plan.source == "fresh" and self._member is not None:
            self._broadcast_model()  # DDP's own broadcast ran in a group of one
        self._round_of_state = self._round
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

    def _start_from(self, url: str) -> None:
        """Load a foreign checkpoint's model and optimizer (every rank reads it)."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        from elastic.checkpoint import init_from

        started = time.perf_counter()
        state = self._persist_state()
        group = self._checkpoints.group if self._checkpoints is not None else None
        missing = init_from(url, state, group)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        self.resumed_from = "foreign"
        seconds = round(time.perf_counter() - started, 4)
        events.emit("ckpt.init", url=url, seconds=seconds, rank=self.rank, missing=missing[:20])

    def _broadcast_model(self) -> None:
        module = getattr(self.model, "module", self.model)
        for tensor in module.state_dict().values():
            dist.broadcast(tensor, src=0)

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

    # -- in-place re-forms ------------------------------------------------------------------

    def _reform(self) -> None:
        """Re-form the group in this process: wait for the agent's next round, swap its
        group in and agree on the state; any failure falls back to a restart (exit
        :data:`elastic.reform.EXIT_CODE` after a failure-time snapshot)."""
        member = self._member
        assert member is not None
        started = time.perf_counter()
        old_round, old_world = self._round, self.world_size
        failed = member.guard.failure is not None and member.guard.aborted is None
        broken = member.guard.aborted is not None or member.guard.failure is not None
        for attempt in range(REFORM_ATTEMPTS):
            try:
                joined, waited, formed = member.join(failed=failed)
                self._on_new_group(broken)
                synced = self._sync_state(live=True)
                break
            except _Interrupted as exc:  # a peer failed mid-way: its loss makes a new round
                logger.warning(
                    "Re-form %d of round %d was interrupted: %s", attempt, member.round, exc
                )
                failed = broken = True
                if attempt + 1 == REFORM_ATTEMPTS:
                    self._fall_back(exc)
            except (RecoveryError, RuntimeError) as exc:
                if self._stop or member.leaving:
                    self._leave()
                self._fall_back(exc)
        self.reforms += 1
        seconds = time.perf_counter() - started
        logger.info(
            "Re-formed in place: round %d -> %d, world %d -> %d, rank %d, at step %d in "
            "%.3f s (waited %.3f s for the round, formed the group in %.3f s, state: %s).",
            old_round,
            joined.round,
            old_world,
            self.world_size,
            self.rank,
            self.step,
            seconds,
            waited,
            formed,
            synced,
        )
        events.emit(
            "recovery.inplace",
            step=self.step,
            round=joined.round,
            rank=self.rank,
            world_size=self.world_size,
            pid=os.getpid(),
            seconds=round(seconds, 4),
            waited_s=round(waited, 4),
            form_s=round(formed, 4),
            state=synced,
        )
        self._jit.restart_clock()

    def _fall_back(self, exc: BaseException) -> NoReturn:
        logger.warning("The in-place re-form failed (%s); restarting from memory instead.", exc)
        events.emit("recovery.fallback", step=self.step, reason=str(exc)[:300], pid=os.getpid())
        self._jit.failed("the in-place re-form failed")
        self._jit.close()
        self._restore_signals()
        if self._member is not None:
            self._member.close()
        raise SystemExit(reform.EXIT_CODE) from exc

    def _rewind(self) -> None:
        """Undo what a failed step changed outside ``optimizer.step()`` (which the guard
        skipped): buffers, RNG, schedule and counters return to the last boundary."""
        boundary = self._jit.last_boundary
        if boundary is None or boundary.extra is None or boundary.step != self.step:
            return
        if boundary.buffers:
            for buf in self.model.buffers():
                kept = boundary.buffers.get(buf.data_ptr())
                if kept is not None:
                    buf.data.copy_(kept)
        self._apply_extra(boundary.extra)

    def _on_new_group(self, broken: bool = False) -> None:
        """Carry what depends on the group into the new one: ranks, DDP, the sampler's
        share, the per-rank batch, the fence and the checkpoints' group."""
        member = self._member
        assert member is not None and member.assignment is not None
        self.distributed = True
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._ctl = self._control_group()
        self._round = member.assignment.round
        self._jit.round = self._round
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            groups.update_ddp(self.model)
        if self.sampler is not None and hasattr(self.sampler, "num_replicas"):
            self.sampler.num_replicas, self.sampler.rank = self.world_size, self.rank
        if self._loader is not None:
            self._set_batch()
        if member.assignment.fence:
            self._fence = _fence_from_env(member.assignment.fence)
        if self._checkpoints is not None and broken:
            self._checkpoints.abandon()
        elif self._checkpoints is not None:
            self._checkpoints.close()
        if self._ckpt_cfg is not None:
            self._checkpoints = self._checkpoint_manager()

    def _sync_state(self, live: bool) -> str:
        """Agree on the state after a re-form: when every rank holds the same step live,
        nothing moves ("live"); otherwise the holders of the newest state write it to
        their snapshot and the usual resume runs (a joiner receives it from a peer)."""
        offer = (self._round_of_state, self.step) if live else None
        offers = self._gather_offers(offer)
        if live and all(o == offer for o in offers):
            source = "live"
        else:
            newest = max((tuple(o) for o in offers if o is not None), default=None)
            stale = not live or newest is None or tuple(offer or ()) < newest
            if not stale:
                self._jit.write_live(self.step)
            self._resume(stale_live=live and stale)
            source = self.resumed_from
        self._round_of_state = self._round
        self._jit.keep_boundary(self.step)
        return source

    def _gather_offers(self, offer: tuple[int, int] | None) -> list[tuple[int, int] | None]:
        """Every rank's ``(round, step)`` of its live state (None: none), as plain integers
        (nothing a peer sends is unpickled), through the guard (a peer that dies or
        freezes meanwhile fails the re-form instead of hanging it)."""
        mine = torch.tensor([*(offer or (-1, -1)), int(offer is not None)], dtype=torch.int64)
        everyone = [torch.zeros_like(mine) for _ in range(self.world_size)]
        assert self._member is not None
        if not self._member.guard.run(lambda: dist.all_gather(everyone, mine, async_op=True)):
            raise _Interrupted("A peer failed while the group agreed on its state.")
        return [(int(t[0]), int(t[1])) if t[2] else None for t in everyone]

    # -- after each step --------------------------------------------------------------------

    def _after_step(self, final: bool = False) -> None:
        self.step += 1
        now = time.perf_counter()
        seconds, self._last_step_at = now - self._last_step_at, now
        self._jit.boundary(self.step)
        try:
            stop = self._agree_stop()
        finally:  # the step is complete even when its agreement failed (a peer was lost)
            if self.rank == 0:
                self._report(seconds)
        if (
            self._checkpoints is not None
            and self.step % self.checkpoint_every == 0
            and not (stop or final)
        ):
            self._checkpoints.save(self.step, self._persist_state())
            self._last_saved = self.step
        if stop:
            if self._job_stopped and self.rank == 0:
                events.emit("job.stopped", step=self.step, reason=self._stop_reason())
            self._complete(persist=self._persist_on_stop)
            self._teardown_groups()
            if self._signalled or (self._member is not None and self._member.leaving):
                logger.info("Stopped at step %d on request; exiting.", self.step)
                raise SystemExit(reform.OK)
            logger.info("A peer asked the group to stop at step %d; exiting to re-form.", self.step)
            raise SystemExit(reform.EXIT_CODE)

    def _report(self, seconds: float) -> None:
        fields: dict[str, Any] = {}
        samples = self.global_batch_size or self._batch * self.world_size
        if samples:
            fields["samples_per_s"] = round(samples / max(seconds, 1e-9), 2)
        if self.loss is not None:
            fields["loss"] = round(self.loss, 6)
        events.emit(
            "train.step",
            step=self.step,
            world_size=self.world_size,
            epoch=self.epoch,
            lr=self.optimizer.param_groups[0].get("lr"),
            **fields,
        )

    def _agreed(self, summed: torch.Tensor) -> None:
        """Take the group's loss from the agreement's sums (the last two values)."""
        total, weight = float(summed[-2]), float(summed[-1])
        self.loss = total / weight if weight else None
        self._loss.zero_()

    def _agree_stop(self) -> bool:
        """Whether the group stops after this step; also agrees whether that stop needs a
        persisted checkpoint (any rank's vote, see :meth:`_persist_vote`)."""
        self.loss = None  # until the group agreed on it
        if self._member is not None:
            return self._agree_in_place()
        flags = torch.tensor([int(self._stop), int(self._persist_vote())], dtype=torch.float64)
        flags = torch.cat([flags, self._loss])
        if self._ctl is not None:
            dist.all_reduce(flags, group=self._ctl)
        self._agreed(flags)
        self._persist_on_stop = bool(flags[1].item())
        self._job_stopped = int(flags[0].item()) == self.world_size
        return bool(flags[0].item())

    def _agree_in_place(self) -> bool:
        """One all-reduce: does anyone stop, does everyone (the job ends), can every rank
        move to the agent's newer round (all ready), can one not (broken). A partial stop (a
        planned leave), a broken rank or a ready round re-forms the group in place; the
        leaving ranks exit, a broken one restarts."""
        member = self._member
        assert member is not None
        stop, vote = int(self._stop or member.leaving), member.switch_vote()
        ready, broken = int(vote == READY), int(vote == BROKEN)
        flags = torch.cat([torch.tensor([stop, broken, ready], dtype=torch.float64), self._loss])
        if not member.guard.run(lambda: dist.all_reduce(flags, async_op=True)):
            self._loss.zero_()
            raise _Reform  # this step is complete: the re-form keeps it
        self._agreed(flags)
        world = self.world_size
        any_stop, all_stop = flags[0].item() > 0, flags[0].item() == world
        if broken:  # this rank cannot join the new round: restart it, the others go on
            self._fall_back(RecoveryError("This rank cannot reach the new round's store."))
        self._persist_on_stop = True
        if any_stop and all_stop:
            self._job_stopped = True
            return True
        if any_stop and (self._stop or member.leaving):
            self._leave()
        # A peer leaves or cannot join (it restarts), or every rank of a new round is ready.
        if any_stop or flags[1].item() > 0 or flags[2].item() == world:
            raise _Reform
        return False

    def _leave(self) -> NoReturn:
        """This rank leaves a group that goes on without it: its peers keep the state."""
        logger.info("Leaving the group at step %d; the others go on in place.", self.step)
        self._jit.wait()
        self._jit.close()
        if self._checkpoints is not None:
            self._checkpoints.close()
        self._restore_signals()
        self._store.close()
        if self._member is not None:
            self._member.close()
        groups.drop_world()
        raise SystemExit(reform.OK)

    def _stop_reason(self) -> str:
        if self._signalled:
            return "every rank was stopped (SIGTERM/SIGINT)"
        return "every node left the job"

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
    def round(self) -> int:
        """The rendezvous round whose group this rank trains in (0 without a fence)."""
        return self._round

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


def rolled_over(state_epoch: int, consumed: int, loop_epoch: int, step: int) -> tuple[int, int]:
    """``(epoch, consumed)`` of a state applied inside epoch ``loop_epoch``: the state of
    the previous epoch's last boundary is ``loop_epoch``'s start.

    Raises:
        RecoveryError: the state is of any other epoch.
    """
    if state_epoch == loop_epoch:
        return state_epoch, consumed
    if state_epoch == loop_epoch - 1:
        return loop_epoch, 0
    raise RecoveryError(
        f"The state agreed on at step {step} is of epoch {state_epoch}, but the loop is in "
        f"epoch {loop_epoch}; the run stops rather than skip or repeat epochs."
    )


def _exact(sampler: Any) -> Any:
    """Give torch's DistributedSampler an exact resume point (a subclass, no new state)."""
    if type(sampler) is _TorchDistributedSampler:
        sampler.__class__ = DistributedSampler
    return sampler


def _fence_from_env(value: str | None = None) -> Any:
    """The commit fence from the environment, or from ``value`` (a round's FenceSpec JSON)."""
    raw = value if value is not None else os.environ.get(env.FENCE)
    if not raw:
        return None
    from elastic.rendezvous.fence import FenceSpec, RoundFence

    spec = FenceSpec.from_env({env.FENCE: raw})
    return RoundFence(spec) if spec is not None else None


def _round_of(fence: Any) -> int:
    return int(fence.round) if fence is not None else 0


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
