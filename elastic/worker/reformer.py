"""The in-place path of :class:`elastic.Run`: its group re-forms inside the running process.

:class:`InPlaceGroup` owns the worker's :class:`~elastic.worker.member.Member` (the channel
to the agent, the step guard) and carries a Run from one round's group to the next: wait for
the agent's round, form its group, carry ranks, DDP, the sampler's share, the per-rank
batch, the fence and the checkpoints' group over, then agree on the state
(:class:`elastic.worker.resume.Resumer`). A re-form that fails falls back to a restart
(exit :data:`elastic.node.reform.EXIT_CODE` after a failure-time snapshot).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from elastic import events
from elastic.errors import CheckpointError, RecoveryError
from elastic.node.channel import Assignment
from elastic.worker import groups
from elastic.worker.exchange import Interrupted
from elastic.worker.member import BROKEN, NOT_YET, READY, Member
from elastic.worker.parts import Parts

logger = logging.getLogger(__name__)
REFORM_ATTEMPTS = 3  # rounds a re-form tries while peers keep failing, before it restarts


class InPlaceGroup:
    """The in-place path (see the module)."""

    in_place = True

    def __init__(self, parts: Parts, member: Member) -> None:
        self.parts = parts
        self.member: Member | None = member
        self.guard = member.guard

    def join(self) -> Assignment:
        assert self.member is not None
        train = self.parts.train
        self.guard.install(train.model, train.optimizer, train.scheduler)
        for attempt in range(REFORM_ATTEMPTS):
            try:
                return self.member.join()[0]
            except Interrupted as exc:  # a newer round formed while this one's group formed
                if attempt + 1 == REFORM_ATTEMPTS:
                    raise
                logger.warning("Joining the job was interrupted: %s", exc)
        raise AssertionError("unreachable")

    @property
    def control(self) -> dist.ProcessGroup | None:
        return dist.group.WORLD  # swapped on each re-form; used between steps only

    def checkpoint_group(self) -> dist.ProcessGroup | None:
        return groups.side_group()

    def start(self) -> None:
        """The first agreement on the state in the joined round's group. A peer lost or gone
        on to a newer round meanwhile cuts it short, as it does the checkpoints' group
        forming (a peer killed mid-connect); the newer round's group then re-forms in place,
        as after a failed step."""
        try:
            self._on_new_group()
            self.parts.resumer.sync(live=False)
        except Interrupted as exc:
            assert self.member is not None
            logger.warning("The state of round %d was not agreed: %s", self.member.round, exc)
            self.reform()

    @property
    def leaving(self) -> bool:
        return self.member is not None and self.member.leaving

    def switch_vote(self) -> tuple[bool, bool]:
        vote = self.member.switch_vote() if self.member is not None else NOT_YET
        return vote == BROKEN, vote == READY

    def all_reduce(self, tensor: torch.Tensor, op: Any) -> bool:
        return self.guard.all_reduce(tensor, op)

    def collective(self, start: Callable[[], Any]) -> bool:
        return self.guard.run(start)

    def step_failed(self) -> bool:
        failed = self.guard.failure is not None and not self.guard.committed
        if not failed:
            self.guard.committed = False
        return failed

    def rewind(self) -> None:
        """Undo what a failed step changed outside ``optimizer.step()`` (which the guard
        skipped): buffers, RNG, schedule and counters return to the last boundary."""
        train = self.parts.train
        boundary = self.parts.jit.last_boundary
        if boundary is None or boundary.extra is None or boundary.step != train.step:
            return
        train.rewind(boundary.buffers, boundary.extra)

    def reform(self) -> None:
        """Wait for the agent's next round, swap its group in and agree on the state; any
        failure falls back to a restart."""
        parts, member = self.parts, self.member
        place, step_end = parts.place, parts.step_end
        assert member is not None
        started = time.perf_counter()
        old_round, old_world = place.round, place.world_size
        failed = self.guard.failure is not None and self.guard.aborted is None
        broken = self.guard.aborted is not None or self.guard.failure is not None
        for attempt in range(REFORM_ATTEMPTS):
            try:
                joined, waited, formed = member.join(failed=failed)
                self._on_new_group(broken)
                synced = parts.resumer.sync(live=True)
                break
            except Interrupted as exc:  # a peer failed mid-way: its loss makes a new round
                logger.warning(
                    "Re-form %d of round %d was interrupted: %s", attempt, member.round, exc
                )
                failed = broken = True
                if attempt + 1 == REFORM_ATTEMPTS:
                    self.fall_back(exc)
            except (RecoveryError, RuntimeError) as exc:
                if step_end.stopping():
                    step_end.leave_now()
                self.fall_back(exc)
        place.reformed()
        seconds = time.perf_counter() - started
        logger.info(
            "Re-formed in place: round %d -> %d, world %d -> %d, rank %d, at step %d in "
            "%.3f s (waited %.3f s for the round, formed the group in %.3f s, state: %s).",
            old_round,
            joined.round,
            old_world,
            place.world_size,
            place.rank,
            parts.train.step,
            seconds,
            waited,
            formed,
            synced,
        )
        events.emit(
            "recovery.inplace",
            step=parts.train.step,
            round=joined.round,
            rank=place.rank,
            world_size=place.world_size,
            pid=os.getpid(),
            seconds=round(seconds, 4),
            waited_s=round(waited, 4),
            form_s=round(formed, 4),
            state=synced,
        )
        parts.jit.restart_clock()

    def newer_round(self, refused: bool = False) -> bool:
        """At the job's end: whether a rank's agent formed a newer round (a join whose
        worker is not ready yet), or, after a refused final save (``refused``), rank 0's
        fence names a newer round than ours; voted in the boundary's records
        (:meth:`StepEnd.end_vote`). A failed agreement (a peer was lost) says yes: the
        agents form the round that replaces it."""
        assert self.member is not None
        seen = self.member.newer_round_formed()
        if refused and not seen and self.parts.place.rank == 0:
            seen = _fence_moved(self.parts.checkpoints.fence)
        return self.parts.step_end.end_vote(seen)

    def fall_back(self, exc: BaseException) -> None:
        logger.warning("The in-place re-form failed (%s); restarting from memory instead.", exc)
        step = self.parts.train.step
        events.emit("recovery.fallback", step=step, reason=str(exc)[:300], pid=os.getpid())
        self.parts.step_end.fall_back(exc)

    def _on_new_group(self, broken: bool = False) -> None:
        """Carry what depends on the group into the new one: ranks, DDP, the sampler's
        share, the per-rank batch, the fence and the checkpoints' group."""
        parts, member = self.parts, self.member
        assert member is not None and member.assignment is not None
        place, train = parts.place, parts.train
        place.move(True, dist.get_rank(), dist.get_world_size(), member.assignment.round)
        parts.jit.round = place.round
        if isinstance(train.model, torch.nn.parallel.DistributedDataParallel):
            groups.update_ddp(train.model)
        train.reshard(place.rank, place.world_size)
        parts.batches.resize(place.world_size)
        if member.assignment.fence:
            parts.checkpoints.set_fence(member.assignment.fence)
        parts.checkpoints.renew(self.checkpoint_group(), broken)

    def close(self) -> None:
        if self.member is not None:
            self.member.close()


def _fence_moved(fence: Any) -> bool:
    """Whether ``fence`` (a :class:`~elastic.rendezvous.fence.RoundFence`) refuses our round:
    a newer one is current in etcd. An unreachable etcd is not a newer round."""
    if fence is None:
        return False
    try:
        fence.check()
    except CheckpointError:
        return True
    except Exception as exc:  # etcd does not answer: nothing says a round moved on
        logger.warning("Cannot ask the commit fence whether a newer round formed: %s", exc)
    return False


__all__ = ["REFORM_ATTEMPTS", "InPlaceGroup"]
