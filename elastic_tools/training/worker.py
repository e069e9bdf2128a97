"""Our CNN worker: ``python -m elastic_tools.training.worker --config FILE [k=v ...]``.

A client of :class:`elastic.Run`, as a user's own script is: one recovery path (resume from
memory, a peer or storage; snapshots; fenced checkpoints; stops; in-place re-forms). What is
ours here is the model, the data and a step with a constant global batch
(:mod:`elastic_tools.training.train`). Run it under an agent or torchrun, which set ``RANK``,
``WORLD_SIZE``, ...; without them it runs as a world of one. Exit codes: 0 done or stopped,
1 checkpoint or runtime failure, 2 bad configuration, :data:`elastic.node.reform.EXIT_CODE` to
re-form.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel

from elastic import env, events
from elastic.errors import CheckpointError, ConfigError
from elastic.node import reform
from elastic.node.procs import WORKER_NAME, die_with_parent, set_name
from elastic.worker import init_process_group, offered
from elastic.worker.jit import parse_every
from elastic.worker.session import Run
from elastic_tools.training.config import (
    Config,
    DistributedConfig,
    JobConfig,
    checkpoint_run_id,
    load_config,
)
from elastic_tools.training.data import build_dataset
from elastic_tools.training.model import build_model
from elastic_tools.training.sampler import Cursor, ElasticSampler
from elastic_tools.training.train import Trainer, build_optimizer, build_scheduler

logger = logging.getLogger(__name__)

_stopped: list[bool] = []  # set when a signal stopped this process's run (it saved first)


def stopped_by_signal() -> bool:
    """Whether SIGTERM/SIGINT stopped this process's training (it saved first)."""
    return bool(_stopped)


def init_distributed(cfg: DistributedConfig) -> torch.device:
    """Join the job's process group (in place where the agent offers it), or a world of one."""
    use_cuda = torch.cuda.is_available() and cfg.backend != "gloo"
    local_rank = int(os.environ.get(env.LOCAL_RANK, "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    timeout = timedelta(seconds=cfg.timeout_s)
    if not use_cuda and offered():
        init_process_group("gloo", timeout=timeout)  # elastic.Run joins the job in place
    elif env.WORLD_SIZE in os.environ:
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout)
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")


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


class Position:
    """Where the sampler stands (:class:`Cursor`), as :class:`elastic.Run` keeps a
    sampler's state: in snapshots and checkpoints, and rewound with a failed step."""

    def __init__(self) -> None:
        self.cursor = Cursor()

    def state_dict(self) -> dict[str, int]:
        return self.cursor.as_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.cursor = Cursor(int(state["epoch"]), int(state["consumed"]))


def _snapshot_every() -> Any:
    """``$ELASTIC_SNAPSHOT_EVERY`` (N, "auto" or 0); "auto" by default under elastic-agent,
    which removes the files (a plain torchrun would leave them)."""
    default = "auto" if os.environ.get(env.SNAPSHOT_OWNER) else "0"
    raw = os.environ.get(env.SNAPSHOT_EVERY, default) or "0"
    try:
        return parse_every(raw)
    except ConfigError as exc:
        raise ConfigError(f"${env.SNAPSHOT_EVERY}: {exc}") from exc


class Worker:
    """The model, optimizer and data of one rank, trained through an :class:`elastic.Run`."""

    def __init__(self, cfg: Config, device: torch.device) -> None:
        self.cfg = cfg
        self.dataset = build_dataset(cfg.data, cfg.model.num_classes, cfg.job.seed)
        self.sampler = ElasticSampler(
            len(self.dataset),  # type: ignore[arg-type]  # our datasets are sized
            cfg.data.global_batch_size,
            cfg.data.micro_batch_size,
            cfg.job.seed,
        )
        torch.manual_seed(cfg.job.seed)
        self.model = _wrap_ddp(build_model(cfg.model).to(device), device)
        self.optimizer = build_optimizer(cfg.optimizer, self.model)
        self.total_steps = total_steps(cfg, self.sampler)
        self.position = Position()
        self.run: Run | None = None
        self.scheduler = build_scheduler(
            self.optimizer, cfg.optimizer, self.total_steps, self._world_size
        )
        self.trainer = Trainer(
            self.model, self.optimizer, self.scheduler, self.dataset, self.sampler, device
        )
        self.run = Run(
            self.model,
            self.optimizer,
            self.scheduler,
            self.position,
            checkpoint=cfg.checkpoint,
            snapshot_every=_snapshot_every(),
            run_id=checkpoint_run_id(cfg),
            global_batch_size=cfg.data.global_batch_size,
        )
        self.trainer.all_reduce = self.run.all_reduce
        self._check_world()

    def _world_size(self) -> int:
        """The LR scaling's world size: the group's now (it changes in place)."""
        if self.run is not None:
            return self.run.world_size
        return dist.get_world_size() if dist.is_initialized() else 1

    def _check_world(self) -> None:
        assert self.run is not None
        if self.run.world_size > self.sampler.micro_batches_per_step:
            raise ConfigError(
                f"world size {self.run.world_size} exceeds the "
                f"{self.sampler.micro_batches_per_step} micro-batches per step; lower "
                "data.micro_batch_size or raise data.global_batch_size."
            )

    def train(self) -> int:
        """Train until the last step or a stop; return the exit code."""
        run = self.run
        assert run is not None
        end = min(self.total_steps, self.cfg.job.stop_at or self.total_steps)
        progress = _Progress(end, run.rank == 0 and self.cfg.job.progress_bar)
        logger.info(
            "Training from step %d (world size %d, run %s).", run.step, run.world_size, run.run_id
        )
        try:
            for _ in run.steps(end):
                self._step(run, progress)
        except SystemExit as exc:
            if run.stopped_by_signal:
                _stopped.append(True)
            return int(exc.code or 0)
        self._log(run, progress)
        progress.close()
        run.close()
        logger.info("Stopped at step %d of %d.", run.step, self.total_steps)
        return reform.OK

    def _step(self, run: Run, progress: _Progress) -> None:
        self._log(run, progress)
        started = time.perf_counter()
        if self.cfg.job.sample_ledger:
            self._record_samples(run)
        self.trainer.rank, self.trainer.world_size = run.rank, run.world_size
        result = self.trainer.step(self.position.cursor)
        self.position.cursor = result.cursor
        run.log_loss(result.loss, result.samples)
        pace = self.cfg.job.min_step_s - (time.perf_counter() - started)
        if pace > 0:
            time.sleep(pace)

    def _log(self, run: Run, progress: _Progress) -> None:
        """The progress bar and a log line for the step just completed (rank 0)."""
        if run.rank != 0 or run.loss is None or run.step == 0:
            return
        progress.update(run.step, run.loss)
        if run.step % self.cfg.job.log_every == 0 or run.step == 1:
            logger.info(
                "step %d/%d loss %.4f lr %.4g world %d",
                run.step,
                self.total_steps,
                run.loss,
                self.optimizer.param_groups[0]["lr"],
                run.world_size,
            )

    def _record_samples(self, run: Run) -> None:
        """Record this rank's samples of the next step before it runs: a rank that dies
        right after its group agreed on a step never reaches the end of it, yet the
        survivors complete it. A redone step's record replaces this one
        (:func:`elastic_tools.chaos.invariants.kept_samples`)."""
        indices, after = self.sampler.global_batch(self.position.cursor)
        mine = self.sampler.for_rank(indices, run.rank, run.world_size)
        events.emit(
            "train.samples",
            step=run.step + 1,
            rank=run.rank,
            world_size=run.world_size,
            epoch=after.epoch,
            indices=[int(i) for mb in mine for i in mb],
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


def train(cfg: Config) -> int:
    """Run one worker to completion inside the current torch elastic world."""
    _setup_torch(cfg.job)
    device = init_distributed(cfg.distributed)
    try:
        return Worker(cfg, device).train()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m elastic_tools.training.worker",
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
        return train(load_config(args.config, args.overrides))
    except ConfigError as exc:
        print(f"elastic_tools.training.worker: error: {exc}", file=sys.stderr)
        return reform.USAGE
    except CheckpointError as exc:
        logger.error("%s", exc)
        return reform.FAILED


if __name__ == "__main__":
    sys.exit(main())
