"""Checkpoint saving and loading: async with one save in flight, commit markers, failures.

A save has three phases:

1. **stage** (blocking, on the training thread): copy the state into reused CPU
   buffers (:class:`~elastic.checkpoint.stager.Stager`);
2. **write** (background thread): ``dcp.save`` of the staged copy through
   :class:`~elastic.checkpoint.storage.HashingWriter`, using the checkpoint
   process group (a dedicated gloo group: sharing DDP's default group between
   two threads deadlocks);
3. **commit** (background thread): the ranks all-gather their file checksums;
   rank 0 calls the optional ``commit_fence`` (it raises to refuse, e.g. when
   the writers' rendezvous round is no longer current), writes ``COMMIT.json``,
   purges old steps, and broadcasts the outcome so every rank agrees.

A failed save never stops training by itself: the previous complete step stays
the newest, the error is logged, and the next interval tries again. After
``max_failures`` consecutive failures :meth:`CheckpointManager.wait` raises
:class:`~elastic.errors.CheckpointError` on every rank at the same step.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from elastic import events
from elastic.checkpoint.layout import (
    find_latest_complete,
    purge,
    remove_step,
    step_url,
    write_commit,
)
from elastic.checkpoint.stager import Stager
from elastic.checkpoint.storage import HashingWriter, make_reader
from elastic.errors import CheckpointError
from elastic.training.config import CheckpointConfig

logger = logging.getLogger(__name__)

CommitFence = Callable[[int], None]  # called with the step; raises to refuse
_WRITER_NICENESS = 10


@dataclass
class SaveOutcome:
    """What became of one save, identical on every rank."""

    step: int
    ok: bool
    error: str = ""
    blocking_s: float = 0.0
    durable_s: float = 0.0
    files: dict[str, dict[str, Any]] = field(default_factory=dict)


class CheckpointManager:
    """Saves and loads one run's checkpoints under ``<url>/<run_id>/``."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        run_id: str,
        group: dist.ProcessGroup | None = None,
        commit_fence: CommitFence | None = None,
    ) -> None:
        self.cfg = cfg
        self.run_id = run_id
        self.group = group
        self.commit_fence = commit_fence
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.failures = 0
        self.last_good: int | None = None
        self.stager = Stager()
        self._pending: Future[SaveOutcome] | None = None

    def save(self, step: int, state: dict[str, Any], block: bool = False) -> SaveOutcome | None:
        """Snapshot ``state`` for ``step`` and write it (in the background unless ``block``).

        Waits first for the previous save (at most one in flight). Returns the
        outcome of a blocking save, else ``None``.

        Raises:
            CheckpointError: ``max_failures`` consecutive saves have failed.
        """
        self.wait()
        started = time.perf_counter()
        staged = self.stager.stage(state)
        blocking = time.perf_counter() - started
        self._pending = _in_daemon_thread(self._write, step, staged, started, blocking)
        if block or not self.cfg.async_save:
            return self.wait()
        return None

    def wait(self) -> SaveOutcome | None:
        """Wait for the save in flight, if any, and account for its outcome.

        Raises:
            CheckpointError: ``max_failures`` consecutive saves have failed.
        """
        if self._pending is None:
            return None
        outcome = self._pending.result()
        self._pending = None
        self._account(outcome)
        return outcome

    def in_flight(self) -> bool:
        """Whether a save is still being written."""
        return self._pending is not None and not self._pending.done()

    def close(self) -> None:
        """Finish the save in flight (raises like :meth:`wait`)."""
        self.wait()

    def load_latest(
        self, make_state: Callable[[], dict[str, Any]]
    ) -> tuple[int, dict[str, Any]] | None:
        """Load the newest complete step, whatever world size wrote it (resharding).

        Rank 0 picks the step (skipping partial or corrupt newer ones with a
        warning) and tells the others. ``make_state`` builds the template that
        DCP loads into (called only when there is a step to load).

        Returns:
            ``(step, state)``, or ``None`` for a fresh run.

        Raises:
            CheckpointError: the chosen step cannot be read.
        """
        chosen: list[Any] = [None]
        if self.rank == 0:
            try:
                info = find_latest_complete(self.cfg.url, self.run_id, self.cfg.verify)
                chosen = [None if info is None else info.step]
            except Exception as exc:  # tell the other ranks before failing
                chosen = [f"{type(exc).__name__}: {exc}".splitlines()[0]]
        if self.distributed:
            dist.broadcast_object_list(chosen, src=_global_rank(self.group, 0), group=self.group)
        step = chosen[0]
        if isinstance(step, str):
            raise CheckpointError(
                f"Cannot list checkpoints under {self.cfg.url}: {step}. Check "
                "the URL, credentials and that the storage is reachable."
            )
        if step is None:
            logger.info(
                "No complete checkpoint under %s/%s; starting fresh.", self.cfg.url, self.run_id
            )
            return None
        started = time.perf_counter()
        url = step_url(self.cfg.url, self.run_id, step)
        state = make_state()
        try:
            dcp.load(state, storage_reader=make_reader(url), process_group=self.group)
        except (Exception, CheckpointException) as exc:  # DCP wraps storage errors
            raise CheckpointError(
                f"Cannot load checkpoint {url}: {_root_cause(exc)}. Delete or "
                "repair that step directory to fall back to an older one."
            ) from exc
        seconds = time.perf_counter() - started
        self.last_good = step
        logger.info("Loaded checkpoint %s in %.2fs.", url, seconds)
        events.emit(
            "ckpt.load",
            step=step,
            url=url,
            seconds=round(seconds, 4),
            rank=self.rank,
            world_size=self.world_size,
        )
        return step, state

    def _write(
        self, step: int, staged: dict[str, Any], started: float, blocking: float
    ) -> SaveOutcome:
        url = step_url(self.cfg.url, self.run_id, step)
        local: dict[str, Any] = {"ok": True, "error": "", "files": {}}
        self._clear_leftovers(url)
        try:
            writer = HashingWriter(url)
            dcp.save(staged, storage_writer=writer, process_group=self.group)
            local["files"] = writer.written
        except (Exception, CheckpointException) as exc:  # storage failures must not kill training
            local.update(ok=False, error=_root_cause(exc))
        outcome = self._commit(step, url, self._gather(local))
        outcome.blocking_s = blocking
        outcome.durable_s = time.perf_counter() - started
        return outcome

    def _clear_leftovers(self, url: str) -> None:
        """Remove what an earlier, failed attempt left at this step; all ranks then wait."""
        if self.rank == 0:
            try:
                remove_step(url)
            except Exception as exc:  # leftovers are harmless: the new marker lists new files
                logger.warning("Could not clear leftovers at %s: %s", url, exc)
        if self.distributed:
            dist.barrier(group=self.group)

    def _gather(self, local: dict[str, Any]) -> list[dict[str, Any]]:
        if not self.distributed:
            return [local]
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, local, group=self.group)
        return everyone

    def _commit(self, step: int, url: str, results: list[dict[str, Any]]) -> SaveOutcome:
        verdict: list[Any] = [None]
        if self.rank == 0:
            verdict = [self._commit_on_rank0(step, url, results)]
        if self.distributed:
            dist.broadcast_object_list(verdict, src=_global_rank(self.group, 0), group=self.group)
        ok, error, files = verdict[0]
        return SaveOutcome(step, ok, error, files=files)

    def _commit_on_rank0(
        self, step: int, url: str, results: list[dict[str, Any]]
    ) -> tuple[bool, str, dict[str, Any]]:
        failed = [r["error"] for r in results if not r["ok"]]
        if failed:
            return False, failed[0], {}
        files: dict[str, dict[str, Any]] = {}
        for r in results:
            files.update(r["files"])
        try:
            if self.commit_fence is not None:
                self.commit_fence(step)
            write_commit(url, step, self.world_size, files)
        except Exception as exc:  # a refused fence or a storage error: no commit
            return False, f"commit refused: {type(exc).__name__}: {exc}", {}
        try:
            purge(self.cfg.url, self.run_id, self.cfg.keep_last, protect=step)
        except Exception as exc:  # a failed purge leaves extra steps, nothing worse
            logger.warning("Could not purge old checkpoints under %s: %s", self.cfg.url, exc)
        return True, "", files

    def _account(self, outcome: SaveOutcome) -> None:
        url = step_url(self.cfg.url, self.run_id, outcome.step)
        fields = {
            "step": outcome.step,
            "ok": outcome.ok,
            "url": url,
            "rank": self.rank,
            "blocking_s": round(outcome.blocking_s, 6),
            "durable_s": round(outcome.durable_s, 4),
        }
        if outcome.ok:
            self.failures = 0
            self.last_good = outcome.step
            logger.log(
                logging.INFO if self.rank == 0 else logging.DEBUG,
                "Checkpoint %s committed (blocking %.1f ms, durable after %.2fs).",
                url,
                outcome.blocking_s * 1e3,
                outcome.durable_s,
            )
            events.emit("ckpt.save", **fields)
            return
        self.failures += 1
        logger.error(
            "Checkpoint %s failed (%d of %d allowed in a row): %s. The newest complete "
            "checkpoint is still step %s.",
            url,
            self.failures,
            self.cfg.max_failures,
            outcome.error,
            self.last_good,
        )
        events.emit("ckpt.save", error=outcome.error, last_good=self.last_good, **fields)
        if self.failures >= self.cfg.max_failures:
            raise CheckpointError(
                f"{self.failures} checkpoint saves in a row failed, the last at {url}: "
                f"{outcome.error}. Fix the storage at {self.cfg.url} (or raise "
                "checkpoint.max_failures) and restart; training resumes from step "
                f"{self.last_good}."
            )


def _in_daemon_thread(fn: Callable[..., SaveOutcome], *args: Any) -> Future[SaveOutcome]:
    """Run ``fn`` in a daemon thread: a save stuck on a dead peer never blocks process exit."""
    future: Future[SaveOutcome] = Future()

    def target() -> None:
        _lower_thread_priority()
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # hand everything to the waiter
            future.set_exception(exc)

    threading.Thread(target=target, name="elastic-ckpt", daemon=True).start()
    return future


def _lower_thread_priority() -> None:
    """Nice the writer thread (Linux: per thread) so training keeps the CPU it needs."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _WRITER_NICENESS)
    except (AttributeError, OSError) as exc:
        logger.debug("Could not lower the checkpoint thread's priority: %s", exc)


def _root_cause(exc: BaseException) -> str:
    """One line naming the first underlying error (DCP wraps per-rank failures)."""
    if isinstance(exc, CheckpointException) and exc.failures:
        rank, (inner, _) = sorted(exc.failures.items())[0]
        return f"rank {rank}: {type(inner).__name__}: {inner}".splitlines()[0]
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


def _global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    if group is None:
        return group_rank
    return dist.get_global_rank(group, group_rank)


__all__ = ["CheckpointManager", "CommitFence", "SaveOutcome"]
