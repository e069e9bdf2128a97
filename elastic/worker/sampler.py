"""A drop-in ``DistributedSampler`` with an exact, world-size-free resume point.

torch's sampler permutes the dataset once per epoch (seed + epoch) and gives rank
``r`` of ``W`` the positions ``r, r+W, r+2W, ...``. After ``k`` steps of batch ``B``
on every rank, exactly the first ``k*B*W`` positions of the permutation have been
trained on, whatever ``r``. This sampler drops the first :attr:`consumed`
positions of the epoch's permutation before dealing the rest, so a group that
resumes mid-epoch, at any world size, trains on each remaining sample once.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DistributedSampler as _TorchDistributedSampler


class DistributedSampler(_TorchDistributedSampler):
    """``torch.utils.data.DistributedSampler`` plus ``consumed``/``state_dict()``."""

    consumed: int = 0  # positions of this epoch's permutation already trained on

    def _remaining(self) -> list[int]:
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order: list[int] = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        rest = order[min(self.consumed, n) :]
        if self.drop_last:
            return rest[: len(rest) - len(rest) % self.num_replicas]
        pad = -len(rest) % self.num_replicas
        if rest and pad:
            rest += (rest * (pad // len(rest) + 1))[:pad]
        return rest

    def __iter__(self) -> Iterator[int]:
        return iter(self._remaining()[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        n = max(len(self.dataset) - self.consumed, 0)  # type: ignore[arg-type]
        if self.drop_last:
            return n // self.num_replicas
        return -(-n // self.num_replicas)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.set_epoch(int(state["epoch"]))
        self.consumed = int(state["consumed"])


__all__ = ["DistributedSampler"]
