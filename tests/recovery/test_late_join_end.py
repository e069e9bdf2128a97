"""The job's end with a newer round pending (elastic.worker.agreement.StepEnd.
end_in_newest_round and elastic.worker.ending.save_final): the group never ends in a round
whose fence moved on; it re-forms into the newer round and commits the last step there.
Stand-ins for the group and the checkpoint manager (the units under test are the end's
decisions); milliseconds."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from elastic.worker.agreement import StepEnd
from elastic.worker.ending import END_REFORMS, save_final

STEP = 16


@dataclass
class Manager:
    """A checkpoint manager whose saves succeed unless the fence moved (``stale``)."""

    world: World
    last_good: int | None = None

    def wait(self) -> None:
        return None

    def save(self, step: int, state: dict[str, Any], block: bool = False) -> Any:
        ok = not self.world.stale
        self.world.saves.append((step, self.world.round, ok))
        if ok:
            self.last_good = step
        if self.world.form_during_save:  # a join's round forms while the save runs
            self.world.form_during_save = False
            self.world.pending = self.world.round + 1
        return SimpleNamespace(ok=ok)


@dataclass
class World:
    """The group (its round, a newer one pending, whether the fence moved) and its run."""

    round: int = 5
    pending: int | None = None  # a newer round the agents formed
    fence_moved: bool = False  # the fence names a newer round (etcd: current)
    form_during_save: bool = False
    saves: list[tuple[int, int, bool]] = field(default_factory=list)
    asked: list[bool] = field(default_factory=list)
    endless: bool = False  # a newer round forms after every re-form

    @property
    def stale(self) -> bool:
        return self.pending is not None or self.fence_moved

    def newer_round(self, refused: bool = False) -> bool:
        self.asked.append(refused)
        return self.pending is not None or (refused and self.fence_moved)

    def reform(self) -> None:
        self.round = self.pending if self.pending is not None else self.round + 1
        self.pending = self.round + 1 if self.endless else None
        self.fence_moved = False
        self.parts.checkpoints.manager = Manager(self)  # a new group: a new manager

    def make_parts(self) -> Any:
        """A run's parts: its state at step STEP, this group, a checkpoint manager."""
        parts: Any = SimpleNamespace(
            train=SimpleNamespace(step=STEP),
            place=SimpleNamespace(round=self.round, rank=0),
            group=self,
            checkpoints=SimpleNamespace(manager=Manager(self)),
            persist_state=dict,
        )
        end = StepEnd.__new__(StepEnd)
        end.parts, end._hang = parts, None
        parts.step_end = end
        self.parts = parts
        return parts


def _end(world: World) -> Any:
    parts = world.make_parts()
    parts.step_end.end_in_newest_round()
    save_final(parts, at_end=True)
    return parts


def test_no_newer_round_saves_once_in_its_round() -> None:
    world = World()
    _end(world)
    assert world.saves == [(STEP, 5, True)]


def test_a_join_pending_at_the_end_reforms_before_the_final_save() -> None:
    world = World(pending=6)
    _end(world)
    assert world.saves == [(STEP, 6, True)], "the last step is committed in the new round"


def test_a_round_that_formed_during_the_save_refuses_it_and_the_group_saves_again() -> None:
    world = World(fence_moved=True)  # the round formed after the end's first look
    _end(world)
    assert world.saves == [(STEP, 5, False), (STEP, 6, True)]
    assert True in world.asked, "rank 0 asked the fence after the refusal"


def test_a_refusal_without_a_newer_round_does_not_wait_for_one() -> None:
    world = World()
    world.make_parts()
    world.saves.clear()
    parts = world.parts
    parts.checkpoints.manager.save = lambda *a, **k: SimpleNamespace(ok=False)  # no etcd
    save_final(parts, at_end=True)
    assert world.round == 5


def test_a_join_formed_during_a_committed_save_ends_with_the_joiner() -> None:
    world = World(form_during_save=True)
    _end(world)
    assert world.saves == [(STEP, 5, True), (STEP, 6, True)]


def test_newer_rounds_forming_forever_are_bounded() -> None:
    world = World(pending=6, endless=True)
    _end(world)
    assert len(world.asked) <= END_REFORMS * (END_REFORMS + 1)


def test_a_stop_saves_once_and_never_waits_for_a_round() -> None:
    world = World(pending=6)
    parts = world.make_parts()
    save_final(parts, at_end=False)
    assert world.saves == [(STEP, 5, False)] and world.asked == []
