"""What the group does after a step: one record per rank, one all-gather, one pure rule.

After each completed step every rank writes its :class:`Vote`, its share of the step's loss
and its own figures (:attr:`Layout.per_rank`, e.g. its compute time and collective wait)
into its own row of the boundary's records (:class:`Layout`); the group all-gathers the
rows, every rank counts them (:meth:`Layout.parse`) and applies :func:`decide` to the same
counts, so that all take the same branch, on both paths:

======================  =======================================================  ========
outcome                 when                                                     path
======================  =======================================================  ========
``STOP_ALL``            every rank stops, not for its agent's re-form            both
``LEAVE``               this rank stops (and not every rank does)                both
``RESTART``             restart path: a peer stops (the agents re-form: exit 75)  restart
                        in place: this rank cannot reach the newer round          in place
``REFORM``              in place: a peer stops or cannot join the newer round,   in place
                        every rank is ready for it, the straggler rule drops a
                        node at this boundary, or the agreement failed
``GO_ON``               otherwise                                                both
======================  =======================================================  ========

Only ``STOP_ALL`` ends the job's loop; it needs every rank's own stop (its row), so a
leave, a failed save, a thawed node, an abandoned checkpoint or a rank that writes
nonsense can never end the others' loop. Row ``r`` comes from rank ``r`` (the collective
places it), so a rank votes, times and reports for itself only; a row that is not
well-formed (a vote other than 0 or 1, a figure not finite or out of range) is refused:
its rank counts as voting nothing and reporting no figures (:attr:`Tally.refused`).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch


class Action(enum.Enum):
    GO_ON = "go on"
    STOP_ALL = "stop all"
    LEAVE = "leave"
    REFORM = "re-form"
    RESTART = "restart"


@dataclass(frozen=True)
class Outcome:
    action: Action
    reason: str
    persist: bool = True  # a stop persists a checkpoint first (any rank's vote)


@dataclass(frozen=True)
class Vote:
    """One rank's word at a step boundary."""

    stop: bool = False  # it stops after this step (a signal, or its node leaves)
    regroup: bool = False  # that stop is its agent's re-form: the node stays (elastic.node.reform)
    persist: bool = False  # a stop needs a persisted checkpoint (its memory would not survive)
    broken: bool = False  # in place: it cannot reach the agent's newer round (it restarts)
    ready: bool = False  # in place: every rank of the agent's newer round is ready to form it
    newer: bool = False  # at the job's end: a newer round formed (elastic.worker.ending)


@dataclass(frozen=True)
class Tally:
    """The group's counts of the votes, its summed loss, every rank's slot values, and the
    ranks whose record was refused (rank, reason): they count as voting nothing."""

    stops: int
    regroups: int
    persists: int
    broken: int
    ready: int
    loss: float
    weight: float
    slots: tuple[tuple[float, ...], ...] = ()  # per rank, in :attr:`Layout.per_rank` order
    refused: tuple[tuple[int, str], ...] = ()
    newer: int = 0

    @property
    def mean_loss(self) -> float | None:
        return self.loss / self.weight if self.weight else None


VOTES = ("stop", "regroup", "persist", "broken", "ready", "newer")
SUMS = ("loss", "weight")
NO_LIMIT = (-math.inf, math.inf)


class Layout:
    """Builds and checks the boundary's records: one row per rank (float64): the votes,
    the loss sums, then the ``per_rank`` slots. Rank ``r`` writes row ``r`` only (an
    all-gather), so no rank can vote, time or name for another.

    A row is *refused* when a vote is not exactly 0 or 1, a sum or slot is not finite, a
    weight is negative, or a slot lies outside its ``limits`` (name: (low, high)); its rank
    then counts as voting nothing, contributing no loss and no figures (zeros: not
    measured), and :attr:`Tally.refused` names it with the reason."""

    def __init__(
        self,
        world_size: int,
        per_rank: tuple[str, ...] = (),
        limits: Mapping[str, tuple[float, float]] | None = None,
    ) -> None:
        self.world_size = world_size
        self.per_rank = per_rank
        self.limits = dict(limits or {})
        self.head = len(VOTES) + len(SUMS)

    @property
    def fields(self) -> int:
        return self.head + len(self.per_rank)

    def row(
        self,
        vote: Vote,
        loss: tuple[float, float] = (0.0, 0.0),
        slots: Mapping[str, float] | None = None,
    ) -> torch.Tensor:
        """This rank's record."""
        out = torch.zeros(self.fields, dtype=torch.float64)
        for i, name in enumerate(VOTES):
            out[i] = float(getattr(vote, name))
        out[len(VOTES)], out[len(VOTES) + 1] = loss
        for i, name in enumerate(self.per_rank):
            out[self.head + i] = float((slots or {}).get(name, 0.0))
        return out

    def check(self, row: list[float]) -> str | None:
        """Why ``row`` is refused, or None when it is well-formed."""
        for name, value in zip(VOTES, row, strict=False):
            if value not in (0.0, 1.0):
                return f"its {name} vote is {value!r}, not 0 or 1"
        for name, value in zip(SUMS + self.per_rank, row[len(VOTES) :], strict=True):
            if not math.isfinite(value):
                return f"its {name} is {value!r}, not a finite number"
            low, high = self.limits.get(name, (0.0, math.inf) if name == "weight" else NO_LIMIT)
            if not low <= value <= high:
                return f"its {name} is {value!r}, outside [{low:g}, {high:g}]"
        return None

    def parse(self, gathered: torch.Tensor) -> Tally:
        """The group's tally from every rank's record (``gathered``: ``[world, fields]``,
        row ``r`` from rank ``r``)."""
        rows: list[list[float]] = gathered.reshape(self.world_size, self.fields).tolist()
        refused: list[tuple[int, str]] = []
        counts = dict.fromkeys(VOTES, 0)
        loss = weight = 0.0
        slots: list[tuple[float, ...]] = []
        for rank, values in enumerate(rows):
            why = self.check(values)
            if why is not None:
                refused.append((rank, why))
                slots.append((0.0,) * len(self.per_rank))
                continue
            for name, value in zip(VOTES, values, strict=False):
                counts[name] += int(value)
            loss += values[len(VOTES)]
            weight += values[len(VOTES) + 1]
            slots.append(tuple(values[self.head :]))
        return Tally(
            counts["stop"],
            counts["regroup"],
            counts["persist"],
            counts["broken"],
            counts["ready"],
            loss,
            weight,
            tuple(slots) if self.per_rank else (),
            tuple(refused),
            counts["newer"],
        )


def decide(
    tally: Tally | None, world: int, mine: Vote, in_place: bool, drop: bool = False
) -> Outcome:
    """The step boundary's outcome for this rank (``mine``), from the group's sums
    (``tally``; None: the agreement failed, a peer was lost, in place only). ``drop``: the
    straggler rule, applied by every rank to the same records, drops a node at this
    boundary: in place every rank re-forms here, the dropped node's ranks too (its agent
    leaves the round and tells them to leave while they wait), so that the next step runs
    at the new world and no step is redone."""
    if tally is None:
        if mine.stop:
            return Outcome(Action.LEAVE, "the agreement failed and this rank stops")
        return Outcome(Action.REFORM, "the agreement failed: a peer was lost")
    persist = tally.persists > 0
    if tally.stops == world and tally.regroups == 0:
        return Outcome(Action.STOP_ALL, "every rank was asked to stop: the job stops", persist)
    if mine.stop:
        return Outcome(Action.LEAVE, "this rank was asked to stop; the others go on", persist)
    if tally.stops and not in_place:
        return Outcome(Action.RESTART, "a peer stopped: the agents re-form the group", persist)
    if not in_place:
        return Outcome(Action.GO_ON, "no rank stops")
    if mine.broken:
        return Outcome(Action.RESTART, "this rank cannot reach the newer round's store")
    if tally.stops:
        return Outcome(Action.REFORM, "a peer leaves: the others re-form without it")
    if tally.broken:
        return Outcome(Action.REFORM, "a peer cannot reach the newer round: it restarts")
    if drop:
        return Outcome(Action.REFORM, "a node is dropped as a straggler: the group re-forms here")
    if tally.ready == world:
        return Outcome(Action.REFORM, "every rank is ready for the agent's newer round")
    return Outcome(Action.GO_ON, "no rank stops and no newer round is ready")


def ends_the_job(outcome: Outcome) -> bool:
    """Whether the outcome ends the job's loop (not only this rank's process)."""
    return outcome.action is Action.STOP_ALL


__all__ = ["Action", "Layout", "Outcome", "Tally", "Vote", "decide", "ends_the_job"]
