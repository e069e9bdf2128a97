"""The training worker: ``python -m elastic.training.worker --config FILE [k=v ...]``.

Run it under torch elastic (``torchrun``), which sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``; without them it runs as a world
of one. On start it resumes from the newest complete checkpoint, whatever world
size wrote it. On SIGTERM it finishes the current step, saves a checkpoint
synchronously, and exits 0. Exit codes: 0 done or stopped, 1 checkpoint or
runtime failure, 2 bad configuration.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel

from elastic import env, events, reform
from elastic.checkpoint import CheckpointManager, CommitFence
from elastic.errors import CheckpointError, ConfigError
from elastic.procs import WORKER_NAME, die_with_parent, set_name
from elastic.recovery import exchange
from elastic.recovery.jit import StepSnapshots, parse_every
from elastic.recovery.snapshot import SnapshotStore
from elastic.training.config import (
    Config,
    DistributedConfig,
    JobConfig,
    checkpoint_run_id,
    load_config,
)
from elastic.training.data import build_dataset
from elastic.training.model import build_model
from elastic.training.sampler import Cursor, ElasticSampler
from elastic.training.train import StepResult, Trainer, build_optimizer, build_scheduler

logger = logging.getLogger(__name__)

SNAPSHOT_EVERY_ENV = env.SNAPSHOT_EVERY  # kept for importers; the name lives in elastic.env


@dataclass(frozen=True)
class DistContext:
    """This process's place in the job."""

    rank: int
    world_size: int
    device: torch.device
    checkpoint_group: dist.ProcessGroup | None


_stop_signals: list[int] = []  # the stop signals this process received


def stopped_by_signal() -> bool:
    """Whether SIGTERM/SIGINT stopped this process's training (it saved first)."""
    return bool(_stop_signals)


class _StopFlag:
    """Set by SIGTERM/SIGINT; the loop stops after the current step."""

    def __init__(self) -> None:
        self.requested = False
        self.persist = True  # False: our agent stops us to re-form (elastic.reform)
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopFlag:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        logger.warning(
            "Received %s; stopping after this step with a checkpoint (send it "
            "again to stop at once).",
            signal.Signals(signum).name,
        )
        self.requested = True
        self.persist = not reform.stopping_for_reform()
        _stop_signals.append(signum)
        signal.signal(signum, signal.SIG_DFL)  # a second signal ends the process at once


def init_distributed(cfg: DistributedConfig) -> DistContext:
    """Join the process group from torch elastic's env vars (or form a world of one)."""
    use_cuda = torch.cuda.is_available() and cfg.backend != "gloo"
    backend = "nccl" if use_cuda else "gloo"
    timeout = timedelta(seconds=cfg.timeout_s)
    if env.WORLD_SIZE in os.environ:
        local_rank = int(os.environ.get(env.LOCAL_RANK, "0"))
        if use_cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend, timeout=timeout)
    else:
        local_rank = 0
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.checkpoint_timeout_s))
    assert isinstance(group, dist.ProcessGroup), "this rank belongs to the new group"
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    return DistContext(dist.get_rank(), dist.get_world_size(), device, group)


def _wrap_ddp(model: torch.nn.Module, device: torch.device) -> DistributedDataParallel:
    """Wrap in DDP without buffer broadcasts: BatchNormStats keeps buffers consistent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
        return DistributedDataParallel(
            model, broadcast_buffers=False, device_ids=[device] if device.type == "cuda" else None
        )


def _setup_torch(cfg: JobConfig) -> None:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False


def total_steps(cfg: Config, sampler: ElasticSampler) -> int:
    """The schedule's length: ``max_steps`` or ``max_epochs`` worth of steps, whichever is less."""
    limits = [cfg.job.max_steps] if cfg.job.max_steps else []
    if cfg.job.max_epochs:
        limits.append(cfg.job.max_epochs * sampler.steps_per_epoch)
    return min(limits)


class Worker:
    """Owns the model, optimizer, data and checkpoints of one rank."""

    def __init__(
        self, cfg: Config, ctx: DistContext, commit_fence: CommitFence | None = None
    ) -> None:
        self.cfg = cfg
        self.ctx = ctx
        dataset = build_dataset(cfg.data, cfg.model.num_classes, cfg.job.seed)
        self.sampler = ElasticSampler(
            len(dataset),  # type: ignore[arg-type]  # our datasets are sized
            cfg.data.global_batch_size,
            cfg.data.micro_batch_size,
            cfg.job.seed,
        )
        if ctx.world_size > self.sampler.micro_batches_per_step:
            raise ConfigError(
                f"world size {ctx.world_size} exceeds the {self.sampler.micro_batches_per_step} "
                "micro-batches per step; lower data.micro_batch_size or raise "
                "data.global_batch_size."
            )
        torch.manual_seed(cfg.job.seed)
        model = build_model(cfg.model).to(ctx.device)
        self.model = _wrap_ddp(model, ctx.device)
        self.optimizer = build_optimizer(cfg.optimizer, self.model)
        self.total_steps = total_steps(cfg, self.sampler)
        self.scheduler = build_scheduler(
            self.optimizer, cfg.optimizer, self.total_steps, ctx.world_size
        )
        self.trainer = Trainer(
            self.model,
            self.optimizer,
            self.scheduler,
            dataset,
            self.sampler,
            ctx.rank,
            ctx.world_size,
            ctx.device,
        )
        self.run_id = checkpoint_run_id(cfg)
        self.checkpoints = CheckpointManager(
            cfg.checkpoint, self.run_id, ctx.checkpoint_group, commit_fence
        )
        self.step = 0
        self.cursor = Cursor()
        self.round = int(getattr(commit_fence, "round", 0) or 0)
        self.snapshots = self._snapshots()
        self._persist_stop = True  # the group's vote at the last step (see _persist_vote)
        self.resumed_from = "fresh"

    def _snapshots(self) -> StepSnapshots | None:
        """Memory snapshots: ``$ELASTIC_SNAPSHOT_EVERY`` (N, "auto" or 0); "auto" by default
        under elastic-agent, which removes the files (a plain torchrun would leave them)."""
        default = "auto" if os.environ.get(env.SNAPSHOT_OWNER) else "0"
        raw = os.environ.get(env.SNAPSHOT_EVERY, default) or "0"
        try:
            every = parse_every(raw)
        except ConfigError as exc:
            raise ConfigError(f"${env.SNAPSHOT_EVERY}: {exc}") from exc
        if every == 0:
            return None
        store = SnapshotStore(self.run_id, int(os.environ.get(env.LOCAL_RANK, "0")))
        return StepSnapshots(
            store,
            self.optimizer,
            self.memory_state,
            self._advance,
            every,
            self.round,
            model=self.model,
            extra=self._memory_extra,
        )

    def _advance(self) -> int:
        """Move the step and cursor on as :meth:`run` does after a step (for a snapshot
        taken when a step failed after its optimizer step)."""
        _, self.cursor = self.sampler.global_batch(self.cursor)
        self.step += 1  # every rank recorded its samples of this step before it ran
        return self.step

    def memory_state(self) -> dict[str, Any]:
        """The state a memory snapshot holds (tensors are not copied)."""
        return {
            "model": self.model.state_dict(),
            "optim": self.optimizer.state_dict(),
            **self._memory_extra(),
        }

    def _memory_extra(self) -> dict[str, Any]:
        """The part of :meth:`memory_state` that changes outside ``optimizer.step()``."""
        sched = {k: v for k, v in self.scheduler.state_dict().items() if k != "lr_lambdas"}
        train = {
            "step": self.step,
            **self.cursor.as_dict(),
            "world_size": self.ctx.world_size,
            "rng_cpu": torch.get_rng_state(),
        }
        return {"scheduler": sched, "train": train}

    def _resume_from_memory(self) -> bool:
        """Agree with the group on the newest state; load it if someone holds it in memory."""
        store = self.snapshots.store if self.snapshots is not None else None
        found = store.newest() if store is not None else None
        held = (found[1].step, found[1].round) if found else None
        persisted = -1
        if self.ctx.rank == 0 and self.cfg.checkpoint.enabled:
            fence = self.checkpoints.commit_fence
            persisted = exchange.persisted_step(self.cfg.checkpoint.url, self.run_id, fence)
        started = time.perf_counter()
        plan = exchange.agree(held, persisted, self.ctx.checkpoint_group)
        if plan.source != "memory":
            return False
        assert store is not None or not plan.holds(self.ctx.rank)
        state, source, received = exchange.fetch(
            plan, store or SnapshotStore(self.run_id, 0), self.ctx.checkpoint_group
        )
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        self._apply_train(state)
        self.resumed_from = source
        seconds = time.perf_counter() - started
        logger.info(
            "Resumed at step %d from %s in %.3f s (%d bytes received; newest checkpoint %d).",
            self.step,
            "this node's memory" if source == "memory" else "a peer's memory",
            seconds,
            received,
            plan.persisted,
        )
        events.emit(
            "ckpt.load",
            step=self.step,
            url="",
            source=source,
            seconds=round(seconds, 4),
            rank=self.ctx.rank,
            world_size=self.ctx.world_size,
            bytes=received,
        )
        return True

    def _apply_train(self, state: dict[str, Any]) -> None:
        """Restore the LR schedule (rescaled to this world size), RNG, step and cursor."""
        self.scheduler.load_state_dict({**self.scheduler.state_dict(), **state["scheduler"]})
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs, strict=True):
            group["lr"] = base * self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)
        train = state["train"]
        torch.set_rng_state(train["rng_cpu"])
        self.step = int(train["step"])
        self.cursor = Cursor(int(train["epoch"]), int(train["consumed"]))

    def state_dict(self) -> dict[str, Any]:
        """The checkpointed state: model, optimizer, LR schedule, train state."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        sched = {k: v for k, v in self.scheduler.state_dict().items() if k != "lr_lambdas"}
        train = {
            "step": self.step,
            **self.cursor.as_dict(),
            "world_size": self.ctx.world_size,
            "rng_cpu": torch.get_rng_state(),
        }
        return {"model": model_sd, "optim": optim_sd, "scheduler": sched, "train": train}

    def resume(self) -> None:
        """Load the newest complete checkpoint, if any, into this (possibly resized) world."""
        restarts = int(os.environ.get(env.RESTART_COUNT, "0"))
        if self.ctx.rank == 0:
            logger.info(
                "Worker start: world size %d, torch elastic restart %d, run %s.",
                self.ctx.world_size,
                restarts,
                self.run_id,
            )
        if self.cfg.checkpoint.enabled:
            self.checkpoints.check_storage()
        if self._resume_from_memory() or not self.cfg.checkpoint.enabled:
            return
        loaded = self.checkpoints.load_latest(self.state_dict)
        if loaded is None:
            return
        state = loaded[1]
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        self._apply_train(state)
        self.resumed_from = "storage"
        train = state["train"]
        logger.info(
            "Resumed at step %d (epoch %d, %d samples in) with world size %d; the "
            "checkpoint was written by world size %d.",
            self.step,
            self.cursor.epoch,
            self.cursor.consumed,
            self.ctx.world_size,
            int(train["world_size"]),
        )

    def save(self, block: bool) -> None:
        """Checkpoint the current step (in the background unless ``block``)."""
        if self.cfg.checkpoint.enabled:
            self.checkpoints.save(self.step, self.state_dict(), block=block)

    def run(self, stop: _StopFlag) -> int:
        """Train until the last step or a stop request; return the exit code."""
        end = min(self.total_steps, self.cfg.job.stop_at or self.total_steps)
        progress = _Progress(end, self.ctx.rank == 0 and self.cfg.job.progress_bar)
        last_saved = self.step if self.resumed_from == "storage" else None
        try:
            last_saved = self._loop(stop, end, progress, last_saved)
        except BaseException as exc:  # a peer died (a collective raised), or worse
            if self.snapshots is not None and not isinstance(exc, SystemExit):
                self.snapshots.failed(f"{type(exc).__name__} in step {self.step + 1}: {exc}")
            raise
        progress.close()
        snapshots = self.snapshots
        if snapshots is not None and snapshots.store.owner != os.getpid():
            snapshots.failed("the loop stopped")  # the newest state, for this node's restart
        if last_saved != self.step and (self.step >= end or self._persist_stop):
            self.save(block=True)
        self.checkpoints.close()
        if self.snapshots is not None:
            self.snapshots.wait()
        logger.info("Stopped at step %d of %d.", self.step, self.total_steps)
        if self.step < end and not stop.requested:
            logger.info("A peer asked the group to stop; exiting for the group to re-form.")
            return reform.EXIT_CODE
        return reform.OK

    def _persist_vote(self, stop: _StopFlag) -> bool:
        """Whether a stop now needs a persisted checkpoint, as far as this rank knows: yes
        unless its agent stops it to re-form and keeps its memory snapshot."""
        survives = self.snapshots is not None and self.snapshots.store.owner != os.getpid()
        return not survives or (stop.requested and stop.persist)

    def _loop(
        self, stop: _StopFlag, end: int, progress: _Progress, last_saved: int | None
    ) -> int | None:
        """The training steps; returns the step last saved."""
        if self.snapshots is not None:
            self.snapshots.restart_clock()
        while self.step < end:
            started = time.perf_counter()
            if self.cfg.job.sample_ledger:
                self._record_samples()
            result = self.trainer.step(self.cursor, stop.requested, self._persist_vote(stop))
            self._persist_stop = result.persist
            self.step += 1
            self.cursor = result.cursor
            if self.snapshots is not None:
                self.snapshots.boundary(self.step)
            self._report(result, time.perf_counter() - started, progress)
            if result.stop:
                break  # at once: pacing a step that ends the group only delays the re-form
            pace = self.cfg.job.min_step_s - (time.perf_counter() - started)
            if pace > 0:
                time.sleep(pace)
            if self.step % self.cfg.checkpoint.interval == 0 and self.step < end:
                self.save(block=False)
                last_saved = self.step
        return last_saved

    def _record_samples(self) -> None:
        """Record this rank's samples of the next step before it runs: a rank that dies
        right after its group agreed on a step never reaches the end of it, yet the
        survivors complete it. A redone step's record replaces this one
        (:func:`elastic.tools.chaos.kept_samples`)."""
        indices, after = self.sampler.global_batch(self.cursor)
        mine = self.sampler.for_rank(indices, self.ctx.rank, self.ctx.world_size)
        events.emit(
            "train.samples",
            step=self.step + 1,
            rank=self.ctx.rank,
            world_size=self.ctx.world_size,
            epoch=after.epoch,
            indices=[int(i) for mb in mine for i in mb],
        )

    def _report(self, result: StepResult, seconds: float, progress: _Progress) -> None:
        samples_per_s = self.sampler.global_batch_size / max(seconds, 1e-9)
        if self.ctx.rank != 0:
            return
        lr = self.optimizer.param_groups[0]["lr"]
        events.emit(
            "train.step",
            step=self.step,
            loss=round(result.loss, 6),
            samples_per_s=round(samples_per_s, 2),
            lr=lr,
            world_size=self.ctx.world_size,
            epoch=result.cursor.epoch,
        )
        progress.update(self.step, result.loss)
        if self.step % self.cfg.job.log_every == 0 or self.step == 1:
            logger.info(
                "step %d/%d loss %.4f lr %.4g %.1f samples/s world %d",
                self.step,
                self.total_steps,
                result.loss,
                lr,
                samples_per_s,
                self.ctx.world_size,
            )


class _Progress:
    """A one-line progress bar on a terminal; silent otherwise."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total = total
        self.enabled = enabled and sys.stderr.isatty()

    def update(self, step: int, loss: float) -> None:
        if self.enabled:
            filled = int(30 * step / max(self.total, 1))
            sys.stderr.write(
                f"\r[{'#' * filled}{'.' * (30 - filled)}] {step}/{self.total} loss {loss:.4f}"
            )
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def train(cfg: Config, commit_fence: CommitFence | None = None) -> int:
    """Run one worker to completion inside the current torch elastic world."""
    _setup_torch(cfg.job)
    with _StopFlag() as stop:
        ctx = init_distributed(cfg.distributed)
        worker: Worker | None = None
        try:
            worker = Worker(cfg, ctx, commit_fence)
            worker.resume()
            return worker.run(stop)
        finally:
            if worker is not None and worker.snapshots is not None:
                worker.snapshots.wait()
                worker.snapshots.close()
                store = worker.snapshots.store
                if store.owner == os.getpid():  # no agent: nobody could ever use them
                    store.remove()
            dist.destroy_process_group()


def _fence_from_env() -> CommitFence | None:
    """The commit fence our agent hands us (None under plain torchrun)."""
    from elastic.rendezvous.fence import FenceSpec, RoundFence

    spec = FenceSpec.from_env()
    return RoundFence(spec) if spec is not None else None


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m elastic.training.worker",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return parser.parse_args(argv)


@record
def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code (torch elastic records uncaught errors)."""
    args = _parse(argv)
    set_name(WORKER_NAME)
    if env.RUN_ID in os.environ:
        # never outlive the agent (or the warm-start fork server) that started us
        server = os.environ.get(env.FORK_SERVER_PID)
        die_with_parent(parent=int(server) if server else None)
    rank = os.environ.get(env.RANK, "0")
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s"
    )
    try:
        return train(load_config(args.config, args.overrides), _fence_from_env())
    except ConfigError as exc:
        print(f"elastic.training.worker: error: {exc}", file=sys.stderr)
        return reform.USAGE
    except CheckpointError as exc:
        logger.error("%s", exc)
        return reform.FAILED


if __name__ == "__main__":
    sys.exit(main())
