"""The public API: ``elastic.Run`` wraps a plain DDP training loop.

::

    run = elastic.Run(model, optimizer, scheduler, sampler, checkpoint_url="runs/ckpt")
    for epoch in run.epochs(num_epochs):          # was: for epoch in range(num_epochs):
        for x, y in run.batches(loader):          # was: for x, y in loader:
            ...  # forward, backward, optimizer.step() as before

(or ``for step in run.steps(total):`` for a loop without epochs). Constructing the Run
resumes (:mod:`elastic.worker.resume`): from this node's shared-memory snapshot, else from
a peer's (streamed over a gloo group), else from shared storage. After every
``snapshot_every`` steps (``"auto"``: as often as costs under 3 % of the step time) the
state is snapshotted to shared memory (:mod:`elastic.worker.snapshot`), and when the
loop fails (a peer died: a collective raised; an exception; a stop) the state of the
last completed step is written there at once (:mod:`elastic.worker.jit`); every
``checkpoint_every`` steps it is also persisted, fenced, through
:class:`elastic.checkpoint.CheckpointManager`.

After each step the group agrees, in one all-reduce, on what follows
(:mod:`elastic.worker.boundary`); what a membership change does depends on the path
chosen at construction (:mod:`elastic.worker.group`): restart, or re-form in place.
Only a stop of every rank ends the job's loop early (event ``job.stopped``).
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
from collections.abc import Iterable, Iterator, Mapping
from types import FrameType
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler as _TorchDistributedSampler

from elastic import env, runid
from elastic.errors import RecoveryError
from elastic.node import options as node_options
from elastic.node import reform
from elastic.node.procs import die_with_parent
from elastic.worker import ending
from elastic.worker import group as paths
from elastic.worker.agreement import Exit, StepEnd
from elastic.worker.codec import to_json
from elastic.worker.jit import AUTO, Every, StepSnapshots
from elastic.worker.resume import Resumer
from elastic.worker.sampler import DistributedSampler
from elastic.worker.snapshot import DEFAULT_DIR, SnapshotStore

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
        run_id: names the snapshots and checkpoints; default: the rendezvous id, else
            ``"local"`` (the rule: :func:`elastic.runid.resolve`).
        keep_last: persisted checkpoints kept.
        snapshot_dir: node-local shared memory (``/dev/shm``).
        global_batch_size: keep the global batch constant across world sizes: each rank's
            loader (given to :meth:`batches`) yields ``global_batch_size // world_size``
            samples a step, set again after every re-form. None: the loader's own.
        checkpoint: every checkpoint setting (an
            :class:`elastic_tools.training.config.CheckpointConfig`) in place of
            ``checkpoint_url``/``checkpoint_every``/``keep_last``.
        init_from: a checkpoint that plain ``torch.distributed.checkpoint.save`` wrote
            (torchtitan, an earlier run of yours): a job with no state of its own yet
            starts from its model and optimizer (what it lacks, e.g. a data position, is
            logged and starts fresh). Default: ``checkpoint.init_from``.
        straggler: the straggler options (``drop``, ``ratio``, ``steps``, ``min_slow_s``,
            ``min_nodes``, ``window_s``: :class:`elastic.node.options.StragglerOptions`), a
            dict or the model,
            over ``$ELASTIC_STRAGGLER_*``. A bad value raises ``ConfigError``.
        hang: the stuck-step check (``enabled``, ``floor_s``, ``multiple``), likewise over
            ``$ELASTIC_HANG_*``.

    In-place re-forms: when the script formed its group with
    :func:`elastic.init_process_group` under our agent, a change of membership re-forms the
    group inside this process (:mod:`elastic.worker`); :attr:`rank` and
    :attr:`world_size` follow it.

    Global side effects of constructing a Run (it buys the four-line API):

    * under an agent, this process dies with its parent (``PR_SET_PDEATHSIG``);
    * SIGTERM and SIGINT handlers (restored when the Run ends);
    * a torch ``DistributedSampler`` given (or the loader's) becomes an
      :class:`elastic.DistributedSampler` (its class is swapped, no new state);
    * ``global_batch_size``: the loader's batch sampler's ``batch_size`` is set;
    * forward/step hooks on the model and optimizer for snapshots, and ``sys.excepthook``
      (a failure-time snapshot, :mod:`elastic.worker.jit`);
    * restart path: a gloo group of its own (and one for checkpoints);
    * in place: the default process group itself is replaced on each re-form; the
      optimizer's and scheduler's ``step`` are wrapped, the model gets a DDP comm hook and
      its buffer broadcast is guarded (:mod:`elastic.worker.guard`); ``faulthandler``
      is enabled; the DDP model's reducer is rebuilt on each re-form.
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
        straggler: Mapping[str, Any] | node_options.StragglerOptions | None = None,
        hang: Mapping[str, Any] | node_options.HangOptions | None = None,
    ) -> None:
        # The worker's own options (elastic.node.options), over $ELASTIC_STRAGGLER_* and
        # $ELASTIC_HANG_*: e.g. straggler={"drop": True, "ratio": 2}, hang={"enabled": True}.
        self.options = node_options.load(straggler=straggler, hang=hang)
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
        self._resumer = Resumer(self)
        self._step_end = StepEnd(self)
        self._group = paths.pick(self)  # the one choice of path
        self._member = self._group.member
        if checkpoint_url is not None or getattr(checkpoint, "enabled", False):
            # The checkpoint code (DCP: ~1 s) and the round's commit fence (the etcd client,
            # grpc: ~0.1 s) are imported now, while no peer waits on us. A script without
            # checkpoints never needs them, and the fork server of a script on Run does not
            # preload them: they would delay a joiner's first worker.
            import elastic.checkpoint
            import elastic.rendezvous.fence  # noqa: F401
        self._join_group()
        self._configure_checkpoints(checkpoint, checkpoint_url, checkpoint_every, keep_last)
        self._init_from = init_from or getattr(checkpoint, "init_from", None)
        self._make_snapshots(snapshot_dir)
        self._reset_loop_state()
        self._signals = _StopSignals()
        self._group.start()

    def _join_group(self) -> None:
        """Where this rank trains: the job's group (in place: the agent's round)."""
        joined = self._group.join()
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self._round_of_state = -1  # the round whose group produced the live state
        self._set_fence(joined.fence if joined is not None else None)
        self._round = joined.round if joined is not None else _round_of(self._fence)

    def _set_fence(self, value: str | None) -> None:
        """The round's commit fence: ``value`` (the round's FenceSpec JSON) or the
        environment's, made when first used (by the checkpoints)."""
        self._fence_value = value
        self._fence_made: Any = _UNMADE

    @property
    def _fence(self) -> Any:
        """The round's commit fence (a RoundFence), or None."""
        if self._fence_made is _UNMADE:
            self._fence_made = _fence_from_env(self._fence_value)
        return self._fence_made

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
        if self._ckpt_cfg is not None and not self._group.in_place:
            self._checkpoints = self._checkpoint_manager()

    def _checkpoint_manager(self) -> Any:
        from elastic.checkpoint import CheckpointManager

        group = self._group.checkpoint_group() if self.distributed else None
        return CheckpointManager(self._ckpt_cfg, self.run_id, group, self._fence)

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
        self._last_saved = -1
        self._last_step_at = time.perf_counter()
        self._batch = 0
        self._loss = torch.zeros(2, dtype=torch.float64)  # this step's (sum, weight)
        self.loss: float | None = None  # the group's mean loss of the last step

    # -- the loop ---------------------------------------------------------------------------

    def steps(self, total: int) -> Iterator[int]:
        """Yield the index of each step still to run, up to ``total`` steps in all."""
        self._jit.restart_clock()
        with self._failures("steps"):
            while self.step < total:
                yield self.step
                self._finish_step(final=self.step + 1 >= total)
        self._shutdown(Exit.DONE)

    def epochs(self, total: int) -> Iterator[int]:
        """Yield the epochs still to run (the first one may be resumed mid-way).

        Raises:
            RecoveryError: an epoch's body through :meth:`batches` left the epoch counter
                where it was (the loop would count the epoch as run and skip one).
        """
        while self.epoch < total:
            epoch = self.epoch
            if self.sampler is not None and hasattr(self.sampler, "set_epoch"):
                self.sampler.set_epoch(epoch)
            self._dealt = False
            yield epoch
            if not self._dealt:  # the body did not run through batches()
                self.epoch, self.consumed = epoch + 1, 0
            elif self.epoch <= epoch:  # (beyond epoch + 1: a frozen rank caught up)
                raise RecoveryError(
                    f"Epoch {epoch} ended with the epoch counter at {self.epoch} (step "
                    f"{self.step}); the loop stops rather than skip epochs. This is a bug: "
                    "please report it with the worker's log."
                )
        self._shutdown(Exit.DONE)

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
            dealing = True
            while dealing:  # again after each re-form: the rest of the epoch, re-dealt
                dealing = False
                for batch in loader:
                    yield batch
                    if self._finish_step():
                        self._deal_rest(epoch)
                        dealing = True
                        break
            self._in_batches = False
        self.epoch, self.consumed = self.epoch + 1, 0

    def _finish_step(self, final: bool = False) -> bool:
        """After each step: count it, agree, act (:class:`StepEnd`); True: re-formed."""
        return self._step_end.after_step(final)

    def _set_batch(self) -> None:
        self._batch = _set_batch(self._loader, self.global_batch_size, self.world_size)

    def _deal_rest(self, epoch: int) -> None:
        """After a re-form in epoch ``epoch``: deal its remaining samples to the new group
        (a state of the previous epoch's last boundary is ``epoch``'s start:
        :func:`rolled_over`)."""
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
        except SystemExit:  # our own stop: _shutdown() wrote the final snapshot
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

    # -- the user's calls -------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: Any = None) -> bool:
        """``dist.all_reduce(tensor)`` (sum) on the group, safe across a peer's failure: in
        place, a collective that fails or hangs on a lost peer returns False instead of
        raising or hanging, the step does not count and is redone after the re-form (its
        ``optimizer.step()`` does nothing). True when the result is in ``tensor``."""
        op = dist.ReduceOp.SUM if op is None else op
        if not self.distributed or self.world_size == 1:
            return True
        return self._group.all_reduce(tensor, op)

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

    def close(self) -> None:
        """Wait for background work and unmap the snapshot files (they stay for a restart)."""
        self._shutdown(Exit.CLOSED)

    @property
    def stopped_by_signal(self) -> bool:
        """Whether SIGTERM/SIGINT stopped this run (it saved first)."""
        return self._signals.signalled

    @property
    def round(self) -> int:
        """The rendezvous round whose group this rank trains in (0 without a fence)."""
        return self._round

    @property
    def snapshot_stats(self) -> dict[str, float]:
        """Counts and seconds spent on snapshots (``sync_s`` on the training thread)."""
        return dict(self._snapshots.stats)

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

    # -- the one way out (elastic.worker.ending) -----------------------------------------

    def _shutdown(
        self,
        how: Exit,
        persist: bool = True,
        code: int | None = None,
        cause: BaseException | None = None,
    ) -> None:
        """End the run ``how`` says (:func:`elastic.worker.ending.shutdown`)."""
        ending.shutdown(self, how, persist=persist, code=code, cause=cause)

    def _save_final(self, at_end: bool) -> None:
        """Persist the last completed step (:func:`elastic.worker.ending.save_final`)."""
        ending.save_final(self, at_end)


class _StopSignals:
    """SIGTERM/SIGINT: the group stops after this step with a checkpoint (a second signal
    stops at once). ``regroup``: our agent stops us only to re-form (:mod:`elastic.node.reform`)."""

    def __init__(self) -> None:
        self.requested = self.signalled = self.regroup = False
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def restore(self) -> None:
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        logger.warning(
            "Received %s; the group stops after this step with a checkpoint (send it again "
            "to stop at once).",
            signal.Signals(signum).name,
        )
        self.requested = self.signalled = True
        self.regroup = reform.stopping_for_reform()
        signal.signal(signum, signal.SIG_DFL)


def _set_batch(loader: Any, global_batch_size: int | None, world_size: int) -> int:
    """Each rank's batch: the loader's, or its share of the constant global batch (set on
    the loader's batch sampler).

    Raises:
        RecoveryError: the global batch does not divide among the ranks.
    """
    if global_batch_size is None:
        return int(getattr(loader, "batch_size", 0) or 0)
    share, rest = divmod(global_batch_size, world_size)
    if rest or not share:
        raise RecoveryError(
            f"global_batch_size={global_batch_size} does not divide among {world_size} "
            "ranks; choose a multiple of every world size the job may run at."
        )
    batch_sampler = getattr(loader, "batch_sampler", None)
    if batch_sampler is not None and hasattr(batch_sampler, "batch_size"):
        batch_sampler.batch_size = share
    return share


def rolled_over(state_epoch: int, consumed: int, loop_epoch: int, step: int) -> tuple[int, int]:
    """``(epoch, consumed)`` of a state the group agreed on inside epoch ``loop_epoch``: the
    state of the previous epoch's last boundary is ``loop_epoch``'s start; a newer epoch
    stands (a rank that was frozen catches up with the others).

    Raises:
        RecoveryError: the state is of an epoch before the previous one (the loop would
            repeat epochs).
    """
    if state_epoch == loop_epoch - 1:
        return loop_epoch, 0
    if state_epoch >= loop_epoch:
        return state_epoch, consumed
    raise RecoveryError(
        f"The state agreed on at step {step} is of epoch {state_epoch}, but the loop is in "
        f"epoch {loop_epoch}; the run stops rather than repeat epochs."
    )


def _exact(sampler: Any) -> Any:
    """Give torch's DistributedSampler an exact resume point (a subclass, no new state)."""
    if type(sampler) is _TorchDistributedSampler:
        sampler.__class__ = DistributedSampler
    return sampler


_UNMADE = object()  # a fence not made yet


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
