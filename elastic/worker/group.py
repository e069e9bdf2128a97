"""How a Run's group behaves when its membership changes: one small interface, two paths.

:class:`Group` is what :class:`elastic.Run` asks of its group; :func:`pick` chooses one
implementation, once, at construction:

* :class:`RestartGroup`: the script formed its group itself (``dist.init_process_group``),
  or none. Our collectives run on a gloo group of their own; a stop anywhere ends every
  rank's process (the stopping one exits 0, its peers :data:`elastic.node.reform.EXIT_CODE`) and
  the agents restart the workers, which resume from memory, a peer or storage.
* :class:`elastic.worker.reformer.InPlaceGroup`: the script called
  :func:`elastic.init_process_group` under an agent that offers in-place re-forms; the
  group re-forms inside the running processes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from elastic.node.channel import Assignment
    from elastic.worker.member import Member
    from elastic.worker.session import Run


class Group(Protocol):
    """What a Run asks of its group (see the module)."""

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

    def agree(self, flags: torch.Tensor) -> bool:
        """Sum the step boundary's vector over the group; False when a peer was lost."""

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


class RestartGroup:
    """The restart path (see the module)."""

    in_place = False
    member: Member | None = None
    leaving = False

    def __init__(self, run: Run) -> None:
        self.run = run
        self._ctl: dist.ProcessGroup | None = None

    def join(self) -> Assignment | None:
        if dist.is_available() and dist.is_initialized():
            self._ctl = _gloo_group()
        return None

    @property
    def control(self) -> dist.ProcessGroup | None:
        return self._ctl

    def checkpoint_group(self) -> dist.ProcessGroup | None:
        return _gloo_group() if self.run.distributed else None

    def start(self) -> None:
        if self.run._checkpoints is not None:
            # An unwritable URL: one sentence, at start (a collective: every rank starts
            # here together, unlike a joiner in place, whose peers are mid-run).
            self.run._checkpoints.check_storage()
        self.run._resumer.resume()

    def switch_vote(self) -> tuple[bool, bool]:
        return False, False

    def all_reduce(self, tensor: torch.Tensor, op: Any) -> bool:
        dist.all_reduce(tensor, op=op)
        return True

    def collective(self, start: Callable[[], Any]) -> bool:
        work = start()
        if work is not None:
            work.wait()
        return True

    def agree(self, flags: torch.Tensor) -> bool:
        if self._ctl is not None:
            dist.all_reduce(flags, group=self._ctl)
        return True

    def step_failed(self) -> bool:
        return False

    def reform(self) -> None:
        raise AssertionError("The restart path never re-forms in place.")

    def newer_round(self, refused: bool = False) -> bool:
        return False

    def rewind(self) -> None:
        return None

    def fall_back(self, exc: BaseException) -> None:
        raise exc

    def close(self) -> None:
        self._ctl = None


def pick(run: Run) -> Group:
    """In place when the script and its agent offer it (:meth:`Member.from_env`), else
    the restart path."""
    from elastic.worker.member import Member
    from elastic.worker.reformer import InPlaceGroup

    member = Member.from_env()
    return InPlaceGroup(run, member) if member is not None else RestartGroup(run)


def _gloo_group() -> dist.ProcessGroup:
    """A gloo group of every rank (its own: never shared between two threads)."""
    group = dist.new_group(backend="gloo")
    assert isinstance(group, dist.ProcessGroup)
    return group


__all__ = ["Group", "RestartGroup", "pick"]
