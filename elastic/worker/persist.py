"""A Run's persisted checkpoints: their settings, the round's commit fence, the manager.

:class:`Checkpoints` holds what :class:`elastic.checkpoint.CheckpointManager` needs across
groups: the settings (``checkpoint=`` wins over the plain arguments), the run id and the
round's commit fence (made when first used). The manager itself is made with each group
(:meth:`Checkpoints.renew`; in place, on every re-form).
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from elastic import env

_UNMADE = object()  # a fence not made yet


class Checkpoints:
    """The checkpoints of one run (see the module); ``manager`` is None without any."""

    def __init__(self, cfg: Any, every: int, run_id: str, fence: str | None = None) -> None:
        self.cfg, self.every, self.run_id = cfg, every, run_id
        self._manager: Any = None
        self.set_fence(fence)

    @classmethod
    def configure(
        cls,
        checkpoint: Any,
        url: str | os.PathLike[str] | None,
        every: int,
        keep_last: int,
        run_id: str,
        fence: str | None = None,
    ) -> Checkpoints:
        """From Run's arguments: ``checkpoint`` (a CheckpointConfig) wins over ``url``,
        ``every`` and ``keep_last``."""
        cfg: Any = checkpoint if checkpoint is None or checkpoint.enabled else None
        if checkpoint is not None:
            every = checkpoint.interval
        elif url is not None:
            from elastic.checkpoint.config import CheckpointConfig

            cfg = CheckpointConfig(url=str(url), interval=every, keep_last=keep_last)
        return cls(cfg, every, run_id, fence)

    @property
    def manager(self) -> Any:
        """The current group's CheckpointManager, or None."""
        return self._manager

    def set_fence(self, value: str | None) -> None:
        """The round's commit fence: ``value`` (the round's FenceSpec JSON) or the
        environment's, made when first used."""
        self._fence_value = value
        self._fence_made: Any = _UNMADE

    @property
    def fence(self) -> Any:
        """The round's commit fence (a RoundFence), or None."""
        if self._fence_made is _UNMADE:
            self._fence_made = fence_from_env(self._fence_value)
        return self._fence_made

    def renew(self, group: dist.ProcessGroup | None, broken: bool = False) -> None:
        """A manager for a new group (none without settings); the previous one is closed,
        or abandoned when its group broke (``broken``: a save in flight cannot finish)."""
        if self._manager is not None and broken:
            self._manager.abandon()
        elif self._manager is not None:
            self._manager.close()
        if self.cfg is not None:
            from elastic.checkpoint import CheckpointManager

            self._manager = CheckpointManager(self.cfg, self.run_id, group, self.fence)

    def due(self, step: int, final: bool) -> bool:
        """Whether step ``step`` is persisted at its boundary (the final one is saved at the
        end instead)."""
        return self._manager is not None and step % self.every == 0 and not final


def fence_from_env(value: str | None = None) -> Any:
    """The commit fence from the environment, or from ``value`` (a round's FenceSpec JSON)."""
    raw = value if value is not None else os.environ.get(env.FENCE)
    if not raw:
        return None
    from elastic.rendezvous.fence import FenceSpec, RoundFence

    spec = FenceSpec.from_env({env.FENCE: raw})
    return RoundFence(spec) if spec is not None else None


__all__ = ["Checkpoints", "fence_from_env"]
