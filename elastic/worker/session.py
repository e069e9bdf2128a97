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
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from elastic import env, runid
from elastic.errors import RecoveryError
from elastic.node import options as node_options
from elastic.node.procs import die_with_parent
from elastic.worker import ending
from elastic.worker import group as paths
from elastic.worker.agreement import StepEnd
from elastic.worker.ending import Exit
from elastic.worker.jit import AUTO, Every, StepSnapshots
from elastic.worker.parts import Batches, Parts, Place
from elastic.worker.persist import Checkpoints
from elastic.worker.resume import Resumer
from elastic.worker.signals import StopSignals
from elastic.worker.snapshot import DEFAULT_DIR, SnapshotStore
from elastic.worker.state import TrainState

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
        self.run_id = runid.resolve(run_id)
        self.snapshot_every = snapshot_every
        self.global_batch_size = global_batch_size
        # The parts (elastic.worker.parts), each handed what it shares with the others.
        parts = self._parts = Parts()
        parts.train = self._train = TrainState(model, optimizer, scheduler, sampler)
        parts.place = self._place = Place()
        parts.batches = self._batches = Batches(global_batch_size)
        parts.options = self.options
        parts.group = self._group = paths.pick(parts)  # the one choice of path
        parts.resumer = self._resumer = Resumer(
            parts, init_from or getattr(checkpoint, "init_from", None)
        )
        if checkpoint_url is not None or getattr(checkpoint, "enabled", False):
            # The checkpoint code (DCP: ~1 s) and the round's commit fence (the etcd client,
            # grpc: ~0.1 s) are imported now, while no peer waits on us. A script without
            # checkpoints never needs them, and the fork server of a script on Run does not
            # preload them: they would delay a joiner's first worker.
            import elastic.checkpoint
            import elastic.rendezvous.fence  # noqa: F401
        joined = self._group.join()
        parts.checkpoints = self._checkpoints = Checkpoints.configure(
            checkpoint,
            checkpoint_url,
            checkpoint_every,
            keep_last,
            self.run_id,
            joined.fence if joined is not None else None,
        )
        self.checkpoint_every = self._checkpoints.every
        distributed = dist.is_available() and dist.is_initialized()
        self._place.move(
            distributed,
            dist.get_rank() if distributed else 0,
            dist.get_world_size() if distributed else 1,
            joined.round if joined is not None else _round_of(self._checkpoints.fence),
        )
        if not self._group.in_place:  # in place the manager is made with each group
            self._checkpoints.renew(self._group.checkpoint_group() if distributed else None)
        parts.step_end = self._step_end = StepEnd(parts)
        parts.store, parts.jit = self._make_snapshots(snapshot_dir)
        self._store, self._jit, self._snapshots = parts.store, parts.jit, parts.jit.snapshotter
        self._dealt = False  # the current epoch's body ran through batches()
        parts.signals = self._signals = StopSignals()
        self._group.start()

    def _make_snapshots(self, directory: str) -> tuple[SnapshotStore, StepSnapshots]:
        local_rank = int(os.environ.get(env.LOCAL_RANK, "0"))
        store = SnapshotStore(self.run_id, local_rank, directory=directory)
        train, place, batches = self._train, self._place, self._batches
        jit = StepSnapshots(
            store,
            train.optimizer,
            self.state,
            # a failure-time snapshot after the optimizer stepped: the counters as the loop
            # moves them after the step
            lambda: train.advance(batches.samples(place.world_size)),
            self.snapshot_every,
            place.round,
            model=train.model,
            extra=lambda: train.extra(place.world_size),
        )
        return store, jit

    # -- what the user reads ----------------------------------------------------------------

    @property
    def train(self) -> TrainState:
        """The training state: counters, last loss, the user's objects (their one writer)."""
        return self._train

    @property
    def step(self) -> int:
        return self._train.step

    @property
    def epoch(self) -> int:
        return self._train.epoch

    @property
    def consumed(self) -> int:
        """Samples of the current epoch the group consumed."""
        return self._train.consumed

    @property
    def loss(self) -> float | None:
        """The group's mean loss of the last step (:meth:`log_loss`)."""
        return self._train.loss

    @property
    def model(self) -> torch.nn.Module:
        return self._train.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._train.optimizer

    @property
    def scheduler(self) -> Any:
        return self._train.scheduler

    @property
    def sampler(self) -> Any:
        return self._train.sampler

    @property
    def distributed(self) -> bool:
        return self._place.distributed

    @property
    def rank(self) -> int:
        return self._place.rank

    @property
    def world_size(self) -> int:
        return self._place.world_size

    @property
    def reforms(self) -> int:
        """In-place re-forms this process took part in."""
        return self._place.reforms

    @property
    def resumed_from(self) -> str:
        """Where the state came from: ``fresh``, ``memory``, ``peer``, ``storage``, ``foreign``."""
        return self._resumer.source

    @property
    def received_bytes(self) -> int:
        """Bytes of state streamed from a peer by the last resume."""
        return self._resumer.received_bytes

    # -- the loop ---------------------------------------------------------------------------

    def steps(self, total: int) -> Iterator[int]:
        """Yield the index of each step still to run, up to ``total`` steps in all."""
        self._jit.restart_clock()
        with self._failures("steps"):
            while self.step < total:
                yield self.step
                self._step_end.after_step(final=self.step + 1 >= total)
        ending.shutdown(self._parts, Exit.DONE)

    def epochs(self, total: int) -> Iterator[int]:
        """Yield the epochs still to run (the first one may be resumed mid-way).

        Raises:
            RecoveryError: an epoch's body through :meth:`batches` left the epoch counter
                where it was (the loop would count the epoch as run and skip one).
        """
        train = self._train
        while train.epoch < total:
            epoch = train.epoch
            train.set_epoch(epoch)
            self._dealt = False
            yield epoch
            if not self._dealt:  # the body did not run through batches()
                train.begin_epoch(epoch + 1)
            elif train.epoch <= epoch:  # (beyond epoch + 1: a frozen rank caught up)
                raise RecoveryError(
                    f"Epoch {epoch} ended with the epoch counter at {train.epoch} (step "
                    f"{train.step}); the loop stops rather than skip epochs. This is a bug: "
                    "please report it with the worker's log."
                )
        ending.shutdown(self._parts, Exit.DONE)

    def batches(self, loader: Iterable[B]) -> Iterator[B]:
        """Yield the batches of the current epoch still to train on; each one is a step."""
        train, batches = self._train, self._batches
        train.adopt_sampler(getattr(loader, "sampler", None))
        train.deal()
        batches.deal(loader, self.world_size)
        self._dealt = True
        epoch = train.epoch
        self._jit.restart_clock()
        with self._failures("batches"):
            batches.set_dealing(True)
            dealing = True
            while dealing:  # again after each re-form: the rest of the epoch, re-dealt
                dealing = False
                for batch in loader:
                    yield batch
                    if self._step_end.after_step():
                        # the rest of epoch ``epoch``, dealt to the new group
                        train.roll_over(epoch)
                        train.deal()
                        batches.resize(self.world_size)
                        dealing = True
                        break
            batches.set_dealing(False)
        train.begin_epoch(train.epoch + 1)

    @contextlib.contextmanager
    def _failures(self, where: str) -> Iterator[None]:
        """Snapshot the last completed step when the loop fails or is left early (a
        collective raised because a peer died, an exception, ``break``)."""
        try:
            yield
        except GeneratorExit:
            self._jit.failed(f"the loop over {where}() ended early")
            raise
        except SystemExit:  # our own stop: shutdown() wrote the final snapshot
            raise
        except BaseException as exc:
            self._jit.failed(f"{type(exc).__name__} in {where}(): {exc}")
            raise

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
        self._train.log_loss(value, weight)

    def save(self, block: bool = False) -> None:
        """Persist the current step now (besides every ``checkpoint_every`` steps); with
        ``block``, return when it is committed. Without a checkpoint URL it does nothing."""
        manager = self._checkpoints.manager
        if manager is not None:
            manager.save(self.step, self._parts.persist_state(), block=block)

    def wait(self) -> None:
        """Wait for the checkpoint and snapshot in flight."""
        self._snapshots.wait()
        if self._checkpoints.manager is not None:
            self._checkpoints.manager.wait()

    def close(self) -> None:
        """Wait for background work and unmap the snapshot files (they stay for a restart)."""
        ending.shutdown(self._parts, Exit.CLOSED)

    @property
    def stopped_by_signal(self) -> bool:
        """Whether SIGTERM/SIGINT stopped this run (it saved first)."""
        return self._signals.signalled

    @property
    def round(self) -> int:
        """The rendezvous round whose group this rank trains in (0 without a fence)."""
        return self._place.round

    @property
    def snapshot_stats(self) -> dict[str, float]:
        """Counts and seconds spent on snapshots (``sync_s`` on the training thread)."""
        return dict(self._snapshots.stats)

    def state(self) -> dict[str, Any]:
        """The training state that snapshots hold (tensors are not copied)."""
        return self._train.state_dict(self.world_size)


def _round_of(fence: Any) -> int:
    return int(fence.round) if fence is not None else 0


__all__ = ["Run"]
