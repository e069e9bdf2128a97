"""What a Run's parts share, each piece with one owner: where this rank trains, the batch,
the group, and the bundle that hands them to the parts.

* :class:`Place`: this rank's group: distributed or not, rank, world size, round, the round
  whose group produced the live state, the in-place re-forms taken part in.
* :class:`Batches`: the loader being dealt and each rank's batch (constant global batch).
* :class:`Group`: what a Run asks of its group (two paths: :mod:`elastic.worker.group`).
* :class:`Parts`: the run's parts (the :class:`~elastic.worker.state.TrainState`, the
  group, the checkpoints, the snapshots, the stop signals, the resume and the step boundary),
  handed to each part instead of the Run; only the Run assembles it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from elastic.errors import RecoveryError

if TYPE_CHECKING:
    from elastic.node.channel import Assignment
    from elastic.node.options import NodeOptions
    from elastic.worker.jit import StepSnapshots
    from elastic.worker.member import Member
    from elastic.worker.persist import Checkpoints
    from elastic.worker.signals import StopSignals
    from elastic.worker.snapshot import SnapshotStore
    from elastic.worker.state import TrainState


class Place:
    """Where this rank trains; its only writers are the join and the re-form."""

    def __init__(self) -> None:
        self._distributed, self._rank, self._world_size, self._round = False, 0, 1, 0
        self._round_of_state = -1  # the round whose group produced the live state
        self._reforms = 0

    @property
    def distributed(self) -> bool:
        return self._distributed

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def round(self) -> int:
        """The rendezvous round whose group this rank trains in (0 without a fence)."""
        return self._round

    @property
    def round_of_state(self) -> int:
        """The round whose group produced the live state; -1: none yet."""
        return self._round_of_state

    @property
    def reforms(self) -> int:
        """In-place re-forms this process took part in."""
        return self._reforms

    def move(self, distributed: bool, rank: int, world_size: int, round_: int) -> None:
        """This rank trains in a (new) group."""
        self._distributed, self._rank, self._world_size = distributed, rank, world_size
        self._round = round_

    def took_state(self) -> None:
        """The group agreed on the state: it is this round's now."""
        self._round_of_state = self._round

    def reformed(self) -> None:
        self._reforms += 1


class Batches:
    """The loader :meth:`elastic.Run.batches` deals and each rank's batch of it."""

    def __init__(self, global_batch_size: int | None) -> None:
        self.global_batch_size = global_batch_size
        self._loader: Any = None
        self._size = 0
        self._dealing = False

    @property
    def size(self) -> int:
        """Each rank's batch (0: unknown)."""
        return self._size

    @property
    def dealing(self) -> bool:
        """Whether the loop is inside :meth:`elastic.Run.batches` (a step consumes)."""
        return self._dealing

    def deal(self, loader: Any, world_size: int) -> None:
        """The loop deals ``loader`` now."""
        self._loader = loader
        self.resize(world_size)

    def set_dealing(self, dealing: bool) -> None:
        self._dealing = dealing

    def resize(self, world_size: int) -> None:
        """Each rank's batch in a group of ``world_size`` (:func:`per_rank`)."""
        if self._loader is not None:
            self._size = per_rank(self._loader, self.global_batch_size, world_size)

    def samples(self, world_size: int) -> int:
        """Samples the group consumes in a step (0 outside :meth:`elastic.Run.batches`)."""
        return self._size * world_size if self._dealing else 0


def per_rank(loader: Any, global_batch_size: int | None, world_size: int) -> int:
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


class Group(Protocol):
    """What a Run asks of its group (:mod:`elastic.worker.group`)."""

    in_place: bool
    member: Member | None

    def join(self) -> Assignment | None:
        """Join the job's group at construction (in place: the agent's round)."""

    @property
    def control(self) -> dist.ProcessGroup | None:
        """The group of Run's own collectives (the agreement, the state exchange)."""

    def checkpoint_group(self) -> dist.ProcessGroup | None:
        """A group for a new checkpoint manager (its collectives run on its own thread)."""

    def start(self) -> None:
        """Resume at construction."""

    @property
    def leaving(self) -> bool:
        """Whether this node was told to leave the job (in place)."""

    def switch_vote(self) -> tuple[bool, bool]:
        """``(broken, ready)`` on moving to the agent's newer round (in place)."""

    def all_reduce(self, tensor: torch.Tensor, op: Any) -> bool:
        """A collective of the user's; False when it failed (in place: the step is redone)."""

    def collective(self, start: Callable[[], Any]) -> bool:
        """Start one of Run's collectives (``async_op``) and wait; False when it failed."""

    def step_failed(self) -> bool:
        """Whether the step just run failed before its optimizer stepped (in place)."""

    def reform(self) -> None:
        """Re-form the group in place (never on the restart path)."""

    def newer_round(self, refused: bool = False) -> bool:
        """At the job's end, agreed by the group: whether it must move to a newer round
        before it ends (in place: a join formed one; ``refused``: the final save was
        refused, and rank 0 asks the fence too). The restart path: never."""

    def rewind(self) -> None:
        """Undo what a failed step changed outside ``optimizer.step()`` (in place)."""

    def fall_back(self, exc: BaseException) -> None:
        """Give up on this process: snapshot and exit for a restart (never returns)."""

    def close(self) -> None:
        """Release what the group holds (threads, channel files)."""


class Resume(Protocol):
    """Where the state comes from (:class:`elastic.worker.resume.Resumer`)."""

    def resume(self) -> str:
        """At start: agree on the newest state and load it; its source."""

    def sync(self, live: bool) -> str:
        """After a re-form: agree on the newest state, offering the live one (``live``)."""


class Boundary(Protocol):
    """What the group and the end ask of the step boundary
    (:class:`elastic.worker.agreement.StepEnd`)."""

    def stopping(self) -> bool:
        """Whether this rank stops after this step."""

    def leave_now(self) -> None:
        """Leave a group that goes on without this rank (never returns)."""

    def fall_back(self, exc: BaseException) -> None:
        """Exit for a restart after a failure-time snapshot (never returns)."""

    def end_vote(self, seen: bool) -> bool:
        """At the job's end: whether any rank saw a newer round."""

    def end_in_newest_round(self, refused: bool = False) -> bool:
        """At the job's end: re-form into a newer round first; True when it re-formed."""


class Parts:
    """A Run's parts, handed to each of them in place of the Run (see the module). The Run
    sets each one once, at construction; nothing else assigns them."""

    train: TrainState
    place: Place
    batches: Batches
    options: NodeOptions
    group: Group
    checkpoints: Checkpoints
    store: SnapshotStore
    jit: StepSnapshots
    signals: StopSignals
    resumer: Resume
    step_end: Boundary

    def persist_state(self) -> dict[str, Any]:
        """The state a checkpoint holds now (:meth:`TrainState.persist_state`)."""
        return self.train.persist_state(self.place.world_size)


__all__ = ["Batches", "Boundary", "Group", "Parts", "Place", "Resume", "per_rank"]
