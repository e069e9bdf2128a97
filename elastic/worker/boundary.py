"""What the group does after a step: one vote per rank, one all-reduce, one pure rule.

After each completed step every rank adds its :class:`Vote` (and its share of the step's
loss) to one vector (:class:`Layout`), the group sums it in one all-reduce, and every rank
applies :func:`decide` to the same sums, so that all take the same branch, on both paths:

======================  =======================================================  ========
outcome                 when                                                     path
======================  =======================================================  ========
``STOP_ALL``            every rank stops, not for its agent's re-form            both
``LEAVE``               this rank stops (and not every rank does)                both
``RESTART``             restart path: a peer stops (the agents re-form: exit 75)  restart
                        in place: this rank cannot reach the newer round          in place
``REFORM``              in place: a peer stops or cannot join the newer round,   in place
                        every rank is ready for it, or the agreement failed
``GO_ON``               otherwise                                                both
======================  =======================================================  ========

Only ``STOP_ALL`` ends the job's loop; it needs every rank's stop, so a leave, a failed
save, a thawed node or an abandoned checkpoint can never end the others' loop.

The vector has room for per-rank slots (:attr:`Layout.per_rank`, e.g. each rank's compute
time and collective wait): rank ``r`` writes its values at its own offset, zeros elsewhere,
so the same sum delivers every rank's values to every rank.
"""

from __future__ import annotations

import enum
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


@dataclass(frozen=True)
class Tally:
    """The group's sums of the votes, its summed loss, and every rank's slot values."""

    stops: int
    regroups: int
    persists: int
    broken: int
    ready: int
    loss: float
    weight: float
    slots: tuple[tuple[float, ...], ...] = ()  # per rank, in :attr:`Layout.per_rank` order

    @property
    def mean_loss(self) -> float | None:
        return self.loss / self.weight if self.weight else None


VOTES = ("stop", "regroup", "persist", "broken", "ready")
SUMS = ("loss", "weight")


class Layout:
    """Builds and parses the boundary vector: the votes, the loss sums, then
    ``world_size * len(per_rank)`` per-rank slots (float64, summed by one all-reduce)."""

    def __init__(self, world_size: int, per_rank: tuple[str, ...] = ()) -> None:
        self.world_size = world_size
        self.per_rank = per_rank
        self.head = len(VOTES) + len(SUMS)

    @property
    def size(self) -> int:
        return self.head + self.world_size * len(self.per_rank)

    def build(
        self,
        vote: Vote,
        loss: tuple[float, float] = (0.0, 0.0),
        rank: int = 0,
        slots: dict[str, float] | None = None,
    ) -> torch.Tensor:
        out = torch.zeros(self.size, dtype=torch.float64)
        for i, name in enumerate(VOTES):
            out[i] = float(getattr(vote, name))
        out[len(VOTES)], out[len(VOTES) + 1] = loss
        if self.per_rank:
            at = self.head + rank * len(self.per_rank)
            for i, name in enumerate(self.per_rank):
                out[at + i] = float((slots or {}).get(name, 0.0))
        return out

    def parse(self, summed: torch.Tensor) -> Tally:
        values: list[float] = summed.tolist()
        n = len(self.per_rank)
        slots = tuple(
            tuple(values[self.head + r * n : self.head + (r + 1) * n])
            for r in range(self.world_size if n else 0)
        )
        stops, regroups, persists, broken, ready = (round(v) for v in values[: len(VOTES)])
        loss, weight = values[len(VOTES)], values[len(VOTES) + 1]
        return Tally(stops, regroups, persists, broken, ready, loss, weight, slots)


def decide(tally: Tally | None, world: int, mine: Vote, in_place: bool) -> Outcome:
    """The step boundary's outcome for this rank (``mine``), from the group's sums
    (``tally``; None: the agreement failed, a peer was lost, in place only)."""
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
    if tally.ready == world:
        return Outcome(Action.REFORM, "every rank is ready for the agent's newer round")
    return Outcome(Action.GO_ON, "no rank stops and no newer round is ready")


def ends_the_job(outcome: Outcome) -> bool:
    """Whether the outcome ends the job's loop (not only this rank's process)."""
    return outcome.action is Action.STOP_ALL


__all__ = ["Action", "Layout", "Outcome", "Tally", "Vote", "decide", "ends_the_job"]
