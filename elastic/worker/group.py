"""How a Run's group behaves when its membership changes: one small interface, two paths.

:class:`Group` (:mod:`elastic.worker.parts`) is what :class:`elastic.Run` asks of its group;
:func:`pick` chooses one implementation, once, at construction:

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
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from elastic.worker.parts import Group, Parts

if TYPE_CHECKING:
    from elastic.node.channel import Assignment
    from elastic.worker.member import Member


class RestartGroup:
    """The restart path (see the module)."""

    in_place = False
    member: Member | None = None
    leaving = False

    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        self._ctl: dist.ProcessGroup | None = None

    def join(self) -> Assignment | None:
        if dist.is_available() and dist.is_initialized():
            self._ctl = _gloo_group()
        return None

    @property
    def control(self) -> dist.ProcessGroup | None:
        return self._ctl

    def checkpoint_group(self) -> dist.ProcessGroup | None:
        return _gloo_group() if self.parts.place.distributed else None

    def start(self) -> None:
        manager = self.parts.checkpoints.manager
        if manager is not None:
            # An unwritable URL: one sentence, at start (a collective: every rank starts
            # here together, unlike a joiner in place, whose peers are mid-run).
            manager.check_storage()
        self.parts.resumer.resume()

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


def pick(parts: Parts) -> Group:
    """In place when the script and its agent offer it (:meth:`Member.from_env`), else
    the restart path."""
    from elastic.worker.member import Member
    from elastic.worker.reformer import InPlaceGroup

    member = Member.from_env()
    return InPlaceGroup(parts, member) if member is not None else RestartGroup(parts)


def _gloo_group() -> dist.ProcessGroup:
    """A gloo group of every rank (its own: never shared between two threads)."""
    group = dist.new_group(backend="gloo")
    assert isinstance(group, dist.ProcessGroup)
    return group


__all__ = ["Group", "RestartGroup", "pick"]
