"""Checkpoint saving and loading: async with one save in flight, commit markers, failures.

A save has three phases:

1. **stage** (blocking, on the training thread): copy the state into reused CPU
   buffers (:class:`~elastic.checkpoint.stager.Stager`);
2. **write** (background thread): rank 0 checks the fence (if any) and picks a
   fresh attempt directory; DCP's save of the staged copy
   (:func:`elastic.checkpoint.dcp_driver.save`: torch's files, no pickles between the
   ranks) goes there through
   :class:`~elastic.checkpoint.storage.HashingWriter`, using the checkpoint
   process group (a dedicated gloo group: sharing DDP's default group between
   two threads deadlocks). Nothing is deleted to make room;
3. **commit** (background thread): the ranks all-gather their file checksums;
   rank 0 checks that each rank names only files of its own (``__<rank>_*``) and that
   every item of ``.metadata`` lies inside one of them, builds the (signed) marker,
   records it through the optional fence
   (one etcd transaction that refuses when the writers' rendezvous round is no
   longer current, and stores the marker's digest: the source of truth), writes
   ``COMMIT.json`` atomically and broadcasts the outcome so every rank agrees
   (the save is durable from here on: ``durable_s``); then it purges old steps
   (fenced, never newer than its own step).

What the ranks tell each other (the step to load, the attempt, each rank's files and
errors, the verdict, and DCP's plans) travels as length-prefixed JSON bytes in uint8
tensors, never as pickles (:mod:`elastic.checkpoint.wire`,
:mod:`elastic.checkpoint.dcp_driver`): every rank decodes the same bytes and checks their
size and their shape before use, so a peer that sends something else makes every rank
raise the same :class:`~elastic.errors.CheckpointError`. Rank 0 decides through
:class:`~elastic.checkpoint.wire.Coordinated`: one typed
:class:`~elastic.checkpoint.wire.Verdict` (ok, skipped, failed) reaches every rank.

Loading tries the best complete step (one whose marker matches its etcd commit
record first) and falls back to the next older one when a step cannot be read
(a purge racing the reader, a corrupt file): every rank tries the same step. Rank 0
names only the step and its marker's digest: every rank reads and verifies that marker
itself (its signature with the job secret, its files' sizes) under the configured
storage, and loads only the files it names from the step's own directory
(:mod:`elastic.checkpoint.dcp_metadata` reads ``.metadata`` through an allowlist and
checks every item against them), so no peer picks what another rank reads. When etcd's
commit records name a newer step than the one loaded (deleted from the storage, or
unreadable), a warning and a ``ckpt.missing`` event say so.

A failed save never stops training by itself: the previous complete step stays
the newest, the error is logged, and the next interval tries again. After
``max_failures`` consecutive failures :meth:`CheckpointManager.wait` raises
:class:`~elastic.errors.CheckpointError` on every rank at the same step.

A save whose fence etcd does not answer within :data:`FENCE_TIMEOUT_S` (an etcd
outage) is *skipped*, not failed: nothing is committed, the failure count stays,
training goes on. The unanswered call keeps its own thread, and until it returns
every later fence call is skipped at once, so an outage costs a save at most
:data:`FENCE_TIMEOUT_S` of its background thread, once. A fence that refuses before
anything is written (this group's round is no longer the newest: a join forms while the
others train on in place, or the agents are about to restart the group) skips the save
too: counted as failures, a slow joiner's few seconds made ``max_failures`` refusals
in a row and stopped the job. A refusal at commit, after the files were written, is
still a failure.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from elastic import events
from elastic import secret as signing
from elastic.checkpoint import dcp_driver
from elastic.checkpoint.config import CheckpointConfig
from elastic.checkpoint.dcp_metadata import structure_problem
from elastic.checkpoint.digest import file_keys, kind_for
from elastic.checkpoint.fence import CommitFence
from elastic.checkpoint.layout import (
    FILE_NAME,
    StepInfo,
    complete_steps,
    inspect_step,
    make_marker,
    marker_digest,
    new_attempt,
    purge,
    run_url,
    step_url,
    validate_run_id,
    write_marker,
)
from elastic.checkpoint.stager import Stager
from elastic.checkpoint.storage import (
    METADATA,
    FastSavePlanner,
    HashingWriter,
    SafeLoadPlanner,
    join,
    make_reader,
    probe_writable,
)
from elastic.checkpoint.wire import Coordinated, Kind, Verdict, refused
from elastic.errors import CheckpointError, EtcdConnectionError

logger = logging.getLogger(__name__)

# The commit fence: called with the step, raises to refuse. A richer fence (see
# elastic.rendezvous.fence.RoundFence) may also offer ``commit(step, record)``,
# ``check()``, ``records()``, ``forget(steps)`` and the ``round``/``job`` attributes.
_AUTO: Any = object()
_WRITER_NICENESS = 10
FENCE_TIMEOUT_S = 3.0  # how long a save waits for etcd to answer one fence call


@dataclass
class SaveOutcome:
    """What became of one save, identical on every rank."""

    step: int
    ok: bool
    error: str = ""
    blocking_s: float = 0.0
    durable_s: float = 0.0
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    kind: Kind = Kind.OK

    @property
    def skipped(self) -> bool:
        """Whether the save was skipped (its fence could not be reached, or refused before
        anything was written), not failed."""
        return self.kind is Kind.SKIPPED

    @classmethod
    def of(cls, step: int, verdict: Verdict) -> SaveOutcome:
        """The outcome that rank 0's commit ``verdict`` says (its detail: the files, or why)."""
        if verdict.is_ok:
            return cls(step, True, files=dict(verdict.detail))
        return cls(step, False, str(verdict.detail), kind=verdict.kind)


class CheckpointManager:
    """Saves and loads one run's checkpoints under ``<url>/<run_id>/``.

    ``secret`` signs and verifies commit markers; by default it is the job's
    secret (:func:`elastic.secret.job_secret`), ``None`` for CRC checks only.
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        run_id: str,
        group: dist.ProcessGroup | None = None,
        commit_fence: CommitFence | None = None,
        secret: bytes | None = _AUTO,
    ) -> None:
        self.cfg = cfg
        self.run_id = validate_run_id(run_id)
        self.group = group
        self.commit_fence = commit_fence
        self.secret: bytes | None = signing.job_secret() if secret is _AUTO else secret
        self._ranks = Coordinated(group)
        self.distributed = self._ranks.distributed
        self.rank = self._ranks.rank
        self.world_size = self._ranks.world_size
        self.failures = 0
        self.last_good: int | None = None
        self.stager = Stager()
        self._pending: Future[SaveOutcome] | None = None
        self._plan_key = secrets.token_hex(8)  # this manager's (so this group's) DCP plan cache
        self._gate = _FenceGate(FENCE_TIMEOUT_S)

    def check_storage(self) -> None:
        """Write and delete a probe file under the run's directory, on every rank.

        Raises:
            CheckpointError: on every rank, when any rank cannot write there.
        """
        url = run_url(self.cfg.url, self.run_id)
        try:
            probe_writable(url)
            local = ""
        except Exception as exc:  # any storage error: report it in one sentence
            local = f"rank {self.rank}: {type(exc).__name__}: {exc}".splitlines()[0]
        problems = [p for p in self._ranks.gather(local, _string) if p]
        if problems:
            raise CheckpointError(
                f"Cannot write checkpoints under {url} ({problems[0]}); make the storage "
                "writable (path, permissions, credentials) or disable checkpoints."
            )

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

    def close(self) -> None:
        """Finish the save in flight (raises like :meth:`wait`)."""
        try:
            self.wait()
        finally:
            FastSavePlanner.forget(self._plan_key)

    def abandon(self) -> None:
        """Forget the save in flight without waiting: its group was dropped (a peer is
        gone), so it cannot commit; its thread ends with that group's timeout."""
        if self._pending is not None and not self._pending.done():
            logger.warning("Abandoning the checkpoint save in flight: its group is gone.")
        self._pending = None
        FastSavePlanner.forget(self._plan_key)

    def load_latest(
        self, make_state: Callable[[], dict[str, Any]]
    ) -> tuple[int, dict[str, Any]] | None:
        """Load the best complete step, whatever world size wrote it (resharding).

        Rank 0 picks the step (skipping partial, corrupt, unsigned or stale newer
        ones with a warning) and names it and its marker's digest to the others; every
        rank verifies that marker itself and reads only the files it names. When the
        step cannot be read (e.g. a purge deleted it meanwhile) every rank falls back to
        the next older one. ``make_state`` builds the template that DCP loads into
        (called once per step tried).

        Returns:
            ``(step, state)``, or ``None`` for a fresh run.

        Raises:
            CheckpointError: the checkpoints cannot be listed, or no complete step
                can be read.
        """
        candidates = _Candidates(self) if self.rank == 0 else None
        tried: list[str] = []
        while True:
            choice = self._ranks.broadcast(
                candidates.next() if candidates is not None else None, _choice
            )
            if isinstance(choice, str):
                raise CheckpointError(
                    f"Cannot list checkpoints under {self.cfg.url}: {choice}. Check "
                    "the URL, credentials and that the storage is reachable."
                )
            if choice is None:
                break
            mine = candidates.current if candidates is not None else None
            loaded = self._load_one(choice, mine, make_state)
            if isinstance(loaded, tuple):
                if candidates is not None:
                    candidates.warn_missing(loaded[0])
                return loaded
            tried.append(f"step {choice['step']}: {loaded}")
        if candidates is not None:
            candidates.warn_missing(None)
        if tried:
            raise CheckpointError(
                f"No complete checkpoint under {self.cfg.url}/{self.run_id} could be read "
                f"({'; '.join(tried)}). Fix the storage, or move those step directories "
                "away to start fresh."
            )
        logger.info(
            "No complete checkpoint under %s/%s; starting fresh.", self.cfg.url, self.run_id
        )
        return None

    def _verify(self, step: int, digest: str) -> StepInfo:
        """The step rank 0 named, as this rank reads it: its marker under the configured
        storage, signed with the job secret (if any), with this ``digest`` and every file
        it names of the recorded size.

        Raises:
            CheckpointError: the marker is missing, malformed, foreign, not the one rank 0
                named, or a file it names is missing or of another size.
        """
        info = inspect_step(self.cfg.url, self.run_id, step, "size", self.secret)
        if not info.complete:
            raise CheckpointError(
                f"rank 0 named step {step}, which this rank cannot verify ({info.reason})"
            )
        if info.digest != digest:
            raise CheckpointError(
                f"rank 0 named step {step} with the commit marker {digest[:16]}..., but this "
                f"rank reads the marker {info.digest[:16]}... (replaced meanwhile, or rank 0 "
                "is not telling the truth)"
            )
        return info

    def _load_one(
        self,
        choice: dict[str, Any],
        mine: StepInfo | None,
        make_state: Callable[[], dict[str, Any]],
    ) -> tuple[int, dict[str, Any]] | str:
        """Load one chosen step on every rank; return it, or why it could not be read."""
        step, digest = choice["step"], choice["digest"]
        started = time.perf_counter()
        error = ""
        info = mine
        if info is None:
            try:
                info = self._verify(step, digest)
            except CheckpointError as exc:
                error = f"rank {self.rank}: {exc}"
        errors = [e for e in self._ranks.gather(error, _string) if e]
        state: dict[str, Any] = {}
        if not errors and info is not None:
            files = (info.marker or {}).get("files") or {}
            try:
                state = make_state()
                dcp_driver.load(
                    state,
                    storage_reader=make_reader(info.data_url, info.metadata_record, files),
                    planner=SafeLoadPlanner(),
                    process_group=self.group,
                )
            except (Exception, CheckpointException) as exc:  # DCP wraps storage errors
                error = _root_cause(exc)
            errors = [e for e in self._ranks.gather(error, _string) if e]
        url = step_url(self.cfg.url, self.run_id, step)
        if errors:
            logger.warning(
                "Cannot load checkpoint %s (%s); trying the next older complete step.",
                url,
                errors[0],
            )
            return errors[0]
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
        started_attempt = self._ranks.decide(self._start_attempt)
        local = started_attempt
        metadata: Any = None
        if started_attempt.is_ok:
            attempt = str(started_attempt.detail)
            try:
                keys = file_keys(self.secret, self.run_id, step, attempt)
                writer = HashingWriter(join(url, attempt), kind_for(keys is not None), keys)
                metadata = dcp_driver.save(
                    staged,
                    storage_writer=writer,
                    planner=FastSavePlanner(cache_key=self._plan_key),
                    process_group=self.group,
                )
                local = Verdict.ok(writer.written)
            except (Exception, CheckpointException) as exc:  # storage must not kill training
                local = Verdict.failed(_root_cause(exc))
        results = self._ranks.gather(local.to_json(), _result)
        verdict = self._ranks.decide(
            lambda: self._commit_on_rank0(step, url, started_attempt, results, metadata)
        )
        outcome = SaveOutcome.of(step, verdict)
        if not outcome.ok:  # every rank alike: the next save sends full plans again
            FastSavePlanner.forget(self._plan_key)
        outcome.blocking_s = blocking
        outcome.durable_s = time.perf_counter() - started
        if outcome.ok and self.rank == 0:
            self._purge(step)  # housekeeping after the commit: not part of durable_s
        return outcome

    def _start_attempt(self) -> Verdict:
        """Rank 0 checks the fence and names a fresh attempt directory (``ok``); a fence
        that etcd does not answer, or that refuses before anything is written, skips the
        save; any other fence error fails it."""
        try:
            self._fence().check()
            return Verdict.ok(new_attempt())
        except CheckpointError as exc:  # etcd does not answer, or the round moved on
            return Verdict.skipped(str(exc))
        except Exception as exc:  # the fence failed otherwise: write nothing at all
            return Verdict.failed(f"commit refused: {type(exc).__name__}: {exc}")

    def _fence(self) -> _Fence:
        return _Fence(self.commit_fence, self._gate)

    def _commit_on_rank0(
        self,
        step: int,
        url: str,
        started: Verdict,
        results: list[Verdict],
        metadata: Any,
    ) -> Verdict:
        """Rank 0's verdict on the save: ``ok`` with every file once committed, or why not."""
        if not started.is_ok:
            return started
        failed = [r for r in results if not r.is_ok]
        if failed:
            return failed[0]
        try:
            files = _claimed_files([r.detail for r in results])
            problem = structure_problem(metadata, files)
            if problem:
                raise CheckpointError(f"the save's metadata is refused: {problem}")
        except CheckpointError as exc:
            return Verdict.failed(f"commit refused: {exc}")
        fence = self._fence()
        try:
            marker = make_marker(
                step,
                self.world_size,
                files,
                run=self.run_id,
                attempt=str(started.detail),
                job=fence.job,
                round_=fence.round,
                secret=self.secret,
            )
            record = {
                "run": self.run_id,
                "round": fence.round,
                "attempt": str(started.detail),
                "digest": marker_digest(marker),
            }
            fence.commit(step, record)
            write_marker(url, marker)
        except _Unfenced as exc:  # etcd does not answer: no commit, and no failure
            return Verdict.skipped(str(exc))
        except Exception as exc:  # a refused fence or a storage error: no commit
            return Verdict.failed(f"commit refused: {type(exc).__name__}: {exc}")
        return Verdict.ok(files)

    def _purge(self, step: int) -> None:
        """Rank 0 deletes old steps (fenced, never newer than ``step``) after a commit."""
        fence = self._fence()
        try:
            purged = purge(
                self.cfg.url,
                self.run_id,
                self.cfg.keep_last,
                protect=step,
                check=fence.check,
                secret=self.secret,
            )
            fence.forget(purged)
        except Exception as exc:  # a failed purge leaves extra steps, nothing worse
            logger.warning("Could not purge old checkpoints under %s: %s", self.cfg.url, exc)

    def _account(self, outcome: SaveOutcome) -> None:
        url = step_url(self.cfg.url, self.run_id, outcome.step)
        fields: dict[str, Any] = {
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
        if outcome.skipped:
            logger.warning(
                "Checkpoint %s skipped (%s); training goes on, the newest complete checkpoint "
                "is still step %s.",
                url,
                outcome.error,
                self.last_good,
            )
            events.emit(
                "ckpt.save",
                error=f"skipped: {outcome.error}",
                skipped=True,
                last_good=self.last_good,
                **fields,
            )
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


class _Unfenced(CheckpointError):
    """etcd did not answer a fence call in time: the save is skipped, not failed."""


class _FenceGate:
    """Bounds every fence call of one manager to ``timeout_s``; while an unanswered call
    is still running (in its own thread), later calls are refused at once."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._stuck: threading.Thread | None = None

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``; raises :class:`_Unfenced` when etcd does not answer."""
        if self._stuck is not None and self._stuck.is_alive():
            raise _Unfenced("etcd has not answered an earlier commit-fence call yet")
        result: Future[Any] = Future()

        def run() -> None:
            try:
                result.set_result(fn(*args))
            except BaseException as exc:  # handed to the caller below
                result.set_exception(exc)

        thread = threading.Thread(target=run, name="elastic-ckpt-fence", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            self._stuck = thread
            raise _Unfenced(f"etcd did not answer the commit fence within {self.timeout_s:g} s")
        try:
            return result.result()
        except EtcdConnectionError as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise _Unfenced(f"etcd is unreachable ({first})") from exc


class _Fence:
    """The optional commit fence (None: nothing fences this run); the calls a save makes
    are bounded by the manager's :class:`_FenceGate`."""

    def __init__(self, fence: CommitFence | None, gate: _FenceGate) -> None:
        self._fence = fence
        self._gate = gate
        self.round: int | None = fence.round if fence is not None else None
        self.job: str | None = fence.job if fence is not None else None

    def commit(self, step: int, record: dict[str, Any]) -> None:
        """Record the commit of ``step``; raises to refuse."""
        if self._fence is not None:
            self._gate.call(self._fence.commit, step, record)

    def check(self) -> None:
        """Raise if this writer may no longer touch the run's checkpoints."""
        if self._fence is not None:
            self._gate.call(self._fence.check)

    def records(self) -> dict[int, dict[str, Any]]:
        """The commit records (step -> record), or ``{}`` when there are none to consult."""
        if self._fence is None:
            return {}
        try:  # not bounded: a load waits for the records (the stale-writer check) as long
            return dict(self._fence.records())  # as the etcd client rides out an outage
        except Exception as exc:  # etcd unreachable: the markers alone still decide
            logger.warning(
                "Cannot read the checkpoint commit records (%s); choosing by markers alone.", exc
            )
            return {}

    def forget(self, steps: list[int]) -> None:
        """Drop the commit records of purged steps."""
        if self._fence is not None and steps:
            self._gate.call(self._fence.forget, steps)


class _Candidates:
    """Rank 0's supply of steps to try, best first; one rescan after running out."""

    def __init__(self, manager: CheckpointManager) -> None:
        self._manager = manager
        self._tried: set[tuple[int, str]] = set()
        self._rescanned = False
        self._steps: Iterator[StepInfo] | None = None
        self.records: dict[int, dict[str, Any]] = {}
        self.skipped: list[StepInfo] = []  # step directories found but not complete
        self.current: StepInfo | None = None

    def next(self) -> dict[str, Any] | str | None:
        """The next step as ``{step, digest}``, ``None`` when none is left, or the error
        (one line) that stopped the listing."""
        self.current = None
        try:
            info = self._next_info()
        except Exception as exc:  # tell the other ranks before failing
            return f"{type(exc).__name__}: {exc}".splitlines()[0]
        if info is None:
            return None
        self._tried.add((info.step, info.digest))
        self.current = info
        return {"step": info.step, "digest": info.digest}

    def warn_missing(self, loaded: int | None) -> None:
        """Say so when etcd's commit records name steps newer than ``loaded`` (the step
        this job resumes from, ``None``: none): deleted from the storage, or unreadable."""
        newer = sorted(s for s in self.records if loaded is None or s > loaded)
        if not newer:
            self._say_skipped(loaded)
            return
        m = self._manager
        resumed = f"step {loaded}" if loaded is not None else "scratch"
        logger.warning(
            "The commit records in etcd say step %s was committed, but it is not in the "
            "checkpoint storage under %s/%s (deleted, or not readable): this job resumes "
            "from %s and redoes the steps since.",
            newer[-1],
            m.cfg.url,
            m.run_id,
            resumed,
        )
        events.emit(
            "ckpt.missing",
            step=newer[-1],
            steps=newer,
            loaded=loaded,
            url=run_url(m.cfg.url, m.run_id),
        )

    def _say_skipped(self, loaded: int | None) -> None:
        """Without commit records: say so when a newer step in storage has a commit marker
        but is not complete (its files gone, torn or forged), naming it and the step taken.
        A newer directory without a marker is a save that never committed: no sentence."""
        newer = [
            i for i in self.skipped if i.marker is not None and (loaded is None or i.step > loaded)
        ]
        if not newer:
            return
        newest = max(newer, key=lambda i: i.step)
        m = self._manager
        taken = (
            f"from step {loaded}, the newest complete one"
            if loaded is not None
            else "from scratch, as no step is complete"
        )
        logger.warning(
            "Step %s is the newest committed step in the checkpoint storage under %s/%s (it "
            "has a commit marker), but it is not complete (%s); this job resumes %s, and "
            "redoes the steps since.",
            newest.step,
            m.cfg.url,
            m.run_id,
            newest.reason,
            taken,
        )
        events.emit(
            "ckpt.older",
            step=newest.step,
            steps=sorted(i.step for i in newer),
            loaded=loaded,
            reason=newest.reason,
            url=run_url(m.cfg.url, m.run_id),
        )

    def _next_info(self) -> StepInfo | None:
        while True:
            if self._steps is None:
                m = self._manager
                self.records = m._fence().records()
                self._steps = complete_steps(
                    m.cfg.url,
                    m.run_id,
                    m.cfg.verify,
                    warn=not self._tried,
                    secret=m.secret,
                    records=self.records,
                    skip=lambda info: (info.step, info.digest) in self._tried,
                    skipped=self.skipped,
                )
            info = next(self._steps, None)
            if info is not None:
                return info
            if self._rescanned or not self._tried:
                return None
            self._rescanned = True  # a purge may have committed newer steps meanwhile
            self._steps = None


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


def _string(value: Any, sender: str) -> str:
    """A one-line error, or ``""``."""
    if not isinstance(value, str):
        raise refused(sender, "a string", value)
    return value


def _files(value: Any, sender: str) -> dict[str, dict[str, Any]]:
    """File name -> its record (size, digests): JSON scalars only."""
    scalars = (str, int, float, bool, type(None))
    if not isinstance(value, dict) or not all(
        isinstance(name, str)
        and isinstance(record, dict)
        and all(isinstance(k, str) and isinstance(v, scalars) for k, v in record.items())
        for name, record in value.items()
    ):
        raise refused(sender, "a map of file records", value)
    return value


def _result(value: Any, sender: str) -> Verdict:
    """A rank's save result: ``ok`` with its files, or why it failed."""
    verdict = Verdict.from_json(value, sender)
    if verdict.is_ok:
        _files(verdict.detail, sender)
    return verdict


def _claimed_files(claims: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Every rank's files, checked: rank ``r`` names only plain files of its own
    (``__<r>_*``), rank 0 also ``.metadata``, each with a natural size, none twice.

    Raises:
        CheckpointError: a rank names another file (one sentence naming it).
    """
    files: dict[str, dict[str, Any]] = {}
    for rank, claimed in enumerate(claims):
        for name, record in claimed.items():
            own = name.startswith(f"__{rank}_") or (rank == 0 and name == METADATA)
            size = record.get("size")
            if not own or not FILE_NAME.match(name) or name in files:
                raise CheckpointError(
                    f"rank {rank} reports writing {name[:120]!r}, which is not a file of its "
                    "own in the step's directory"
                )
            if type(size) is not int or size < 0:
                raise CheckpointError(f"rank {rank} reports {name!r} with the size {size!r}")
            files[name] = record
    if METADATA not in files:
        raise CheckpointError(f"no rank reports writing {METADATA}")
    return files


def _choice(value: Any, sender: str) -> dict[str, Any] | str | None:
    """Rank 0's next step to try (``{step, digest}``: every rank reads that step's marker
    itself), the listing's error, or None (no step left)."""
    if value is None or isinstance(value, str):
        return value
    if (
        not isinstance(value, dict)
        or set(value) != {"step", "digest"}
        or type(value["step"]) is not int
        or value["step"] < 0
        or type(value["digest"]) is not str
        or len(value["digest"]) != 64
    ):
        raise refused(sender, "a checkpoint step and its marker's digest", value)
    return value


__all__ = ["CheckpointManager", "CommitFence", "SaveOutcome"]
