"""What a Run does after each step: count it, agree with the group, act on the outcome.

:class:`StepEnd` holds the step boundary of :class:`elastic.Run`: this rank's
:class:`~elastic.worker.boundary.Vote`, the group's one all-gather of every rank's record
(its vote, loss and figures: :class:`~elastic.worker.boundary.Layout`), the pure rule
(:func:`~elastic.worker.boundary.decide`), and what each outcome does: go on (and save
when a checkpoint is due), re-form in place, leave, restart, or stop the job (event
``job.stopped``).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from elastic import events
from elastic.errors import RecoveryError
from elastic.node import reform
from elastic.worker import ending
from elastic.worker.boundary import Action, Layout, Outcome, Tally, Vote, decide
from elastic.worker.ending import END_REFORMS, Exit
from elastic.worker.hang import HangWatch
from elastic.worker.parts import Parts
from elastic.worker.straggler import LIMITS, SLOTS, hang_limits
from elastic.worker.timing import StepTimes

logger = logging.getLogger(__name__)


class StepEnd:
    """The step boundary of a run's ``parts`` (see the module; its group is chosen)."""

    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        guard = getattr(parts.group, "guard", None)
        # every rank's step times (elastic.worker.straggler), Run's straggler=...
        self.times = StepTimes(parts.train, parts.place, guard, parts.options.straggler)
        self._hang: HangWatch | None = None
        self._named: set[tuple[int, int]] = set()  # (round, rank): refused records named
        self._last_step_at = time.perf_counter()

    def after_step(self, final: bool = False) -> bool:
        """:meth:`_after_step`, with the hang watch paused over the boundary."""
        if self._hang is None:
            guard = getattr(self.parts.group, "guard", None)
            recent = lambda: tuple(self.times.recent)  # noqa: E731
            place, train = self.parts.place, self.parts.train
            self._hang = HangWatch(
                guard, recent, lambda: (place.rank, train.step), round_store=self._store
            )
            if guard is not None:  # Run's hang=..., over $ELASTIC_HANG_*
                self._hang.limits = hang_limits(self.parts.options.hang)
        self._hang.pause()
        try:
            return self._after_step(final)
        finally:
            self._hang.resume()

    def _store(self) -> tuple[Any, int, int] | None:
        """The store of this rank's round, its number and world size (in place), for the
        hang watch's roll call."""
        member = self.parts.group.member
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
        parts = self.parts
        train, place = parts.train, parts.place
        if parts.group.step_failed():
            train.take_loss()
            outcome = decide(None, place.world_size, Vote(stop=self.stopping()), in_place=True)
            return self._act(outcome, failed=True, everyone=False, final=final)
        train.advance(parts.batches.samples(place.world_size))
        now = time.perf_counter()
        seconds, self._last_step_at = now - self._last_step_at, now
        parts.jit.boundary(train.step)
        try:
            outcome, everyone = self._agree()
        finally:  # the step is complete even when its agreement failed (a peer was lost)
            if place.rank == 0:
                self._report(seconds)
        return self._act(outcome, failed=False, everyone=everyone, final=final)

    def _agree(self) -> tuple[Outcome, bool]:
        """The group's one all-gather after a step: every rank's record (its vote, its loss,
        its figures: :mod:`elastic.worker.boundary`); the outcome, and whether every rank
        stops."""
        parts = self.parts
        train, place = parts.train, parts.place
        train.agreed_loss(None)  # until the group agreed on it
        vote = self._vote()
        layout = self.layout()
        loss = train.take_loss()
        slots = self.times.slots()
        slots["hang_commit"] = self._hang.commit() if self._hang is not None else 0.0
        row = layout.row(vote, loss, slots)
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
        drop = False  # the straggler rule drops a node here: it takes effect at this boundary
        if tally is not None:
            self._refused(tally)
            drop = self.times.observe(tally)
            if self._hang is not None:  # every rank's mark commitment for the next step
                commits = tuple(s[len(SLOTS)] for s in tally.slots)
                self._hang.committed(place.round, train.step + 1, commits)
        train.agreed_loss(tally.mean_loss if tally is not None else None)
        everyone = tally is not None and tally.stops == place.world_size
        return decide(tally, place.world_size, vote, parts.group.in_place, drop), everyone

    def layout(self) -> Layout:
        """Each rank's record: its votes, loss sums, straggler figures and hang commitment."""
        limits = {**LIMITS, "hang_commit": (0.0, 2.0**48 - 1)}
        return Layout(self.parts.place.world_size, (*SLOTS, "hang_commit"), limits)

    def gather(self, row: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``row``, ``[world, fields]`` (row ``r`` from rank ``r``: one
        all-gather on the group's control group); None when a peer was lost (in place)."""
        group, place = self.parts.group, self.parts.place
        control = group.control
        if control is None or not place.distributed:
            return row.reshape(1, -1)
        world = place.world_size
        out = torch.empty(world * row.numel(), dtype=row.dtype)  # gloo: flat
        start = lambda: dist.all_gather_single(out, row, group=control, async_op=True)  # noqa: E731
        return out.reshape(world, -1) if group.collective(start) else None

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
        place, step = self.parts.place, self.parts.train.step
        for rank, reason in tally.refused:
            key = (place.round, rank)
            if key in self._named:
                continue
            self._named.add(key)
            logger.warning(
                "Rank %d's record at step %d was refused (%s); it counts as voting nothing.",
                rank,
                step,
                reason,
            )
            if place.rank == 0:
                events.emit(
                    "boundary.refused", rank=rank, step=step, round=place.round, reason=reason
                )

    def _act(self, outcome: Outcome, failed: bool, everyone: bool, final: bool) -> bool:
        """Carry out the boundary's outcome; True when the group re-formed in place."""
        parts = self.parts
        group, step = parts.group, parts.train.step
        action, in_place = outcome.action, group.in_place
        if action is Action.GO_ON:
            if parts.checkpoints.due(step, final):
                parts.checkpoints.manager.save(step, parts.persist_state())
            return False
        if action is Action.REFORM:
            if failed:
                group.rewind()
            group.reform()
            return True
        if action is Action.RESTART and in_place:
            group.fall_back(RecoveryError(f"{outcome.reason[0].upper()}{outcome.reason[1:]}."))
        if action is Action.LEAVE and in_place and not everyone:
            self.leave_now()
        if action is Action.STOP_ALL and parts.place.rank == 0:
            events.emit("job.stopped", step=step, reason=outcome.reason)
        code = reform.EXIT_CODE if action is Action.RESTART else reform.OK
        logger.info("Stopping at step %d: %s (exit %d).", step, outcome.reason, code)
        ending.shutdown(parts, Exit.STOPPED, persist=outcome.persist, code=code)
        return False  # not reached: shutdown raised SystemExit

    def end_in_newest_round(self, refused: bool = False) -> bool:
        """The loop ran to its end: never end in a round that is no longer the job's (its
        final checkpoint would be refused by the fence, and a joiner admitted to the newer
        round would train the job's end again, alone). While the group agrees that a newer
        round formed (:meth:`Group.newer_round`), wait (bounded by the re-form's join
        timeout) until its ranks are ready, and re-form in place; True when it re-formed."""
        group, place = self.parts.group, self.parts.place
        if self._hang is not None:
            self._hang.pause()  # the loop is over: waiting for a joiner is not a step
        moved = False
        for _ in range(END_REFORMS):
            if not group.newer_round(refused and not moved):
                break
            logger.info(
                "The job reached its end (step %d) in round %d, but a newer round formed; "
                "re-forming in place before it ends.",
                self.parts.train.step,
                place.round,
            )
            group.reform()
            moved = True
        return moved

    def _vote(self) -> Vote:
        stop = self.stopping()
        broken, ready = self.parts.group.switch_vote()
        regroup = stop and self.parts.signals.regroup
        return Vote(stop, regroup, self._persist_vote(), broken, ready)

    def stopping(self) -> bool:
        """Whether this rank stops after this step: a signal, or its node leaves the job."""
        return self.parts.signals.requested or self.parts.group.leaving

    def _persist_vote(self) -> bool:
        """Yes unless our agent stops us to re-form and keeps our memory snapshot."""
        parts = self.parts
        survives = parts.jit.enabled and parts.store.owner != os.getpid()
        return not survives or (self.stopping() and not parts.signals.regroup)

    def leave_now(self) -> None:
        """This rank leaves a group that goes on without it: its peers keep the state."""
        step = self.parts.train.step
        logger.info("Leaving the group at step %d; the others go on in place.", step)
        ending.shutdown(self.parts, Exit.LEFT, code=reform.OK)

    def fall_back(self, exc: BaseException) -> None:
        """Exit for a restart after a failure-time snapshot (in place: a re-form failed)."""
        ending.shutdown(self.parts, Exit.FELL_BACK, code=reform.EXIT_CODE, cause=exc)

    def _report(self, seconds: float) -> None:
        train, place, batches = self.parts.train, self.parts.place, self.parts.batches
        fields: dict[str, Any] = {}
        samples = batches.global_batch_size or batches.size * place.world_size
        if samples:
            fields["samples_per_s"] = round(samples / max(seconds, 1e-9), 2)
        if train.loss is not None:
            fields["loss"] = round(train.loss, 6)
        fields.update(self.times.fields())  # the slowest ranks (elastic.worker.straggler)
        events.emit(
            "train.step",
            step=train.step,
            world_size=place.world_size,
            epoch=train.epoch,
            lr=train.optimizer.param_groups[0].get("lr"),
            **fields,
        )


__all__ = ["StepEnd"]
