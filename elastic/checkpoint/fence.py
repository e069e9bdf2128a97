"""What a checkpoint writer asks of a commit fence: the seam to the rendezvous.

Only the writers of the current rendezvous round may commit, purge or vouch for a step.
:class:`elastic.rendezvous.fence.RoundFence` (records in etcd, transactions on the round)
is the implementation; the checkpoint manager sees only this protocol, and no fence at all
(``None``) where nothing fences the run (a world of one, plain torchrun).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

__all__ = ["CommitFence"]


@runtime_checkable
class CommitFence(Protocol):
    """A round's right to write the run's checkpoints."""

    @property
    def round(self) -> int:
        """The rendezvous round whose writers this fence admits."""
        ...

    @property
    def job(self) -> str:
        """The job (run id) whose records it keeps."""
        ...

    def commit(self, step: int, record: dict[str, Any]) -> None:
        """Record the commit of ``step`` (its marker's digest and files); raise
        :class:`elastic.errors.CheckpointError` to refuse (the round is no longer current)."""
        ...

    def check(self) -> None:
        """Raise :class:`elastic.errors.CheckpointError` when this round may no longer
        write (before a save touches the storage)."""
        ...

    def records(self) -> dict[int, dict[str, Any]]:
        """Every committed step's record: the truth about which steps are complete."""
        ...

    def forget(self, steps: Iterable[int]) -> None:
        """Drop the records of purged steps (fenced like a commit)."""
        ...
