"""What a Run does after each step: count it, agree with the group, act on the outcome.

:class:`StepEnd` holds the step boundary of :class:`elastic.Run`: this rank's
:class:`~elastic.worker.boundary.Vote`, the group's one all-gather of every rank's record
(its vote, loss and figures: :class:`~elastic.worker.boundary.Layout`), the pure rule
(:func:`~elastic.worker.boundary.decide`), and what each outcome does: go on (and save
when a checkpoint is due), re-form in place, leave, restart, or stop the job (event
``job.stopped``).
"""

from __future__ import annotations

import enum
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from elastic import events
from elastic.errors import RecoveryError
from elastic.node import reform
from elastic.worker.boundary import Action, Layout, Outcome, Tally, Vote, decide
from elastic.worker.hang import HangWatch
from elastic.worker.straggler import LIMITS, SLOTS, hang_limits
from elastic.worker.timing import StepTimes

if TYPE_CHECKING:
    from elastic.worker.session import Run

logger = logging.getLogger(__name__)
END_REFORMS = 3  # re-forms at the job's end while newer rounds keep forming


class Exit(enum.Enum):
    """How a Run ends (:meth:`elastic.Run._shutdown`, its one way out)."""

    DONE = "the loop ran to its end"
    STOPPED = "the group stopped after a step"
    LEFT = "this rank left; the others go on in place with the state"
    FELL_BACK = "an in-place re-form failed; the agent restarts this worker"
    CLOSED = "close() was called"


class StepEnd:
    """The step boundary of ``run`` (see the module)."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.times = StepTimes(run)  # every rank's step times (elastic.worker.straggler)
        self._hang: HangWatch | None = None
        self._named: set[tuple[int, int]] = set()  # (round, rank): refused records named

    def after_step(self, final: bool = False) -> bool:
        """:meth:`_after_step`, with the hang watch paused over the boundary."""
        if self._hang is None:
            guard = getattr(self.run._group, "guard", None)
            recent = lambda: tuple(self.times.recent)  # noqa: E731
            self._hang = HangWatch(
                guard, recent, lambda: (self.run.rank, self.run.step), round_store=self._store
            )
            given = getattr(self.run, "options", None)  # Run's hang=..., over $ELASTIC_HANG_*
            if guard is not None and given is not None:
                self._hang.limits = hang_limits(given.hang)
        self._hang.pause()
        try:
            return self._after_step(final)
        finally:
            self._hang.resume()

    def _store(self) -> tuple[Any, int, int] | None:
        """The store of this rank's round, its number and world size (in place), for the
        hang watch's roll call."""
        member = self.run._group.member
        a = member.assignment if member is not None else None
        if a is None:
            return None
        from elastic.worker import groups

        return groups.client(a.master_addr, a.master_port), a.round, a.world_size

    def _after_step(self, final: bool = False) -> bool:
        """Count the step just run and act on the group's agreement; True when the group
        re-formed in place. A step whose collectives failed before its optimizer stepped
        does not count: its state is rewound and the group re-forms (a step whose
        optimizer stepped is complete and counts)."""
        run = self.run
        if run._group.step_failed():
            run._loss.zero_()
            outcome = decide(None, run.world_size, Vote(stop=self.stopping()), in_place=True)
            return self._act(outcome, failed=True, everyone=False, final=final)
        if run._in_batches:
            run.consumed += run._batch * run.world_size
        run.step += 1
        now = time.perf_counter()
        seconds, run._last_step_at = now - run._last_step_at, now
        run._jit.boundary(run.step)
        try:
            outcome, everyone = self._agree()
        finally:  # the step is complete even when its agreement failed (a peer was lost)
            if run.rank == 0:
                self._report(seconds)
        return self._act(outcome, failed=False, everyone=everyone, final=final)

    def _agree(self) -> tuple[Outcome, bool]:
        """The group's one all-gather after a step: every rank's record (its vote, its loss,
        its figures: :mod:`elastic.worker.boundary`); the outcome, and whether every rank
        stops."""
        run = self.run
        run.loss = None  # until the group agreed on it
        vote = self._vote()
        layout = self.layout()
        loss = (float(run._loss[0]), float(run._loss[1]))
        slots = self.times.slots()
        slots["hang_commit"] = self._hang.commit() if self._hang is not None else 0.0
        row = layout.row(vote, loss, slots)
        run._loss.zero_()
        began = time.perf_counter()
        if self._hang is not None:
            self._hang.agreeing = True  # a peer stuck in its step holds this wait
        try:
            gathered = self.gather(row)
        finally:
            if self._hang is not None:
                self._hang.agreeing = False
        self.times.agreed(time.perf_counter() - began)
        tally = layout.parse(gathered) if gathered is not None else None
        if tally is not None:
            self._refused(tally)
            self.times.observe(tally)
            if self._hang is not None:  # every rank's mark commitment for the next step
                commits = tuple(s[len(SLOTS)] for s in tally.slots)
                self._hang.committed(run._round, run.step + 1, commits)
        run.loss = tally.mean_loss if tally is not None else None
        everyone = tally is not None and tally.stops == run.world_size
        return decide(tally, run.world_size, vote, run._group.in_place), everyone

    def layout(self) -> Layout:
        """Each rank's record: its votes, loss sums, straggler figures and hang commitment."""
        limits = {**LIMITS, "hang_commit": (0.0, 2.0**48 - 1)}
        return Layout(self.run.world_size, (*SLOTS, "hang_commit"), limits)

    def gather(self, row: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``row``, ``[world, fields]`` (row ``r`` from rank ``r``: one
        all-gather on the group's control group); None when a peer was lost (in place)."""
        run = self.run
        control = run._group.control
        if control is None or not run.distributed:
            return row.reshape(1, -1)
        out = torch.empty(run.world_size * row.numel(), dtype=row.dtype)  # gloo: flat
        start = lambda: dist.all_gather_single(out, row, group=control, async_op=True)  # noqa: E731
        return out.reshape(run.world_size, -1) if run._group.collective(start) else None

    def end_vote(self, seen: bool) -> bool:
        """At the job's end: whether any rank saw a newer round (``seen``: this rank's),
        voted in the boundary's records; a failed gather (a peer was lost) says yes."""
        layout = self.layout()
        gathered = self.gather(layout.row(Vote(newer=seen)))
        if gathered is None:
            return True
        tally = layout.parse(gathered)
        self._refused(tally)
        return tally.newer > 0

    def _refused(self, tally: Tally) -> None:
        """Rank 0 names each rank whose record was refused (event ``boundary.refused``,
        once per rank and round); it counted as voting nothing and reporting no figures."""
        run = self.run
        for rank, reason in tally.refused:
            key = (run._round, rank)
            if key in self._named:
                continue
            self._named.add(key)
            logger.warning(
                "Rank %d's record at step %d was refused (%s); it counts as voting nothing.",
                rank,
                run.step,
                reason,
            )
            if run.rank == 0:
                events.emit(
                    "boundary.refused", rank=rank, step=run.step, round=run._round, reason=reason
                )

    def _act(self, outcome: Outcome, failed: bool, everyone: bool, final: bool) -> bool:
        """Carry out the boundary's outcome; True when the group re-formed in place."""
        run = self.run
        action, in_place = outcome.action, run._group.in_place
        if action is Action.GO_ON:
            due = run.step % run.checkpoint_every == 0 and not final
            if run._checkpoints is not None and due:
                run._checkpoints.save(run.step, run._persist_state())
                run._last_saved = run.step
            return False
        if action is Action.REFORM:
            if failed:
                run._group.rewind()
            run._group.reform()
            return True
        if action is Action.RESTART and in_place:
            run._group.fall_back(RecoveryError(f"{outcome.reason[0].upper()}{outcome.reason[1:]}."))
        if action is Action.LEAVE and in_place and not everyone:
            self.leave_now()
        if action is Action.STOP_ALL and run.rank == 0:
            events.emit("job.stopped", step=run.step, reason=outcome.reason)
        code = reform.EXIT_CODE if action is Action.RESTART else reform.OK
        logger.info("Stopping at step %d: %s (exit %d).", run.step, outcome.reason, code)
        run._shutdown(Exit.STOPPED, persist=outcome.persist, code=code)
        return False  # not reached: _shutdown raised SystemExit

    def end_in_newest_round(self, refused: bool = False) -> bool:
        """The loop ran to its end: never end in a round that is no longer the job's (its
        final checkpoint would be refused by the fence, and a joiner admitted to the newer
        round would train the job's end again, alone). While the group agrees that a newer
        round formed (:meth:`Group.newer_round`), wait (bounded by the re-form's join
        timeout) until its ranks are ready, and re-form in place; True when it re-formed."""
        run = self.run
        if self._hang is not None:
            self._hang.pause()  # the loop is over: waiting for a joiner is not a step
        moved = False
        for _ in range(END_REFORMS):
            if not run._group.newer_round(refused and not moved):
                break
            logger.info(
                "The job reached its end (step %d) in round %d, but a newer round formed; "
                "re-forming in place before it ends.",
                run.step,
                run._round,
            )
            run._group.reform()
            moved = True
        return moved

    def _vote(self) -> Vote:
        run = self.run
        stop = self.stopping()
        broken, ready = run._group.switch_vote()
        regroup = stop and run._signals.regroup
        return Vote(stop, regroup, self._persist_vote(), broken, ready)

    def stopping(self) -> bool:
        """Whether this rank stops after this step: a signal, or its node leaves the job."""
        run = self.run
        return run._signals.requested or run._group.leaving

    def _persist_vote(self) -> bool:
        """Yes unless our agent stops us to re-form and keeps our memory snapshot."""
        run = self.run
        survives = run._jit.enabled and run._store.owner != os.getpid()
        return not survives or (self.stopping() and not run._signals.regroup)

    def leave_now(self) -> None:
        """This rank leaves a group that goes on without it: its peers keep the state."""
        run = self.run
        logger.info("Leaving the group at step %d; the others go on in place.", run.step)
        run._shutdown(Exit.LEFT, code=reform.OK)

    def fall_back(self, exc: BaseException) -> None:
        """Exit for a restart after a failure-time snapshot (in place: a re-form failed)."""
        self.run._shutdown(Exit.FELL_BACK, code=reform.EXIT_CODE, cause=exc)

    def _report(self, seconds: float) -> None:
        run = self.run
        fields: dict[str, Any] = {}
        samples = run.global_batch_size or run._batch * run.world_size
        if samples:
            fields["samples_per_s"] = round(samples / max(seconds, 1e-9), 2)
        if run.loss is not None:
            fields["loss"] = round(run.loss, 6)
        fields.update(self.times.fields())  # the slowest ranks (elastic.worker.straggler)
        events.emit(
            "train.step",
            step=run.step,
            world_size=run.world_size,
            epoch=run.epoch,
            lr=run.optimizer.param_groups[0].get("lr"),
            **fields,
        )


__all__ = ["END_REFORMS", "Exit", "StepEnd"]
