"""Elastic sampler: a world-size-independent sample order with a resumable cursor.

Every epoch has one global permutation of the dataset indices, seeded by
``(seed, epoch)`` and independent of the world size. Step ``k`` of an epoch
takes the next ``global_batch_size`` indices of that permutation. A global batch
is cut into fixed micro-batches of ``micro_batch_size`` (defined globally, the
same for every world size) and micro-batch ``j`` goes to rank ``j % world_size``.

The cursor ``(epoch, consumed)`` is the whole sampler state; it lives in the
checkpoint. After a resume at any world size the next global batch starts at
``perm[consumed]``: within an epoch no sample is skipped or repeated. A tail of
fewer than ``global_batch_size`` samples at the end of an epoch is dropped
(the global batch never shrinks), so pick a dataset size that is a multiple of
the global batch if every sample must be seen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Cursor:
    """Where the sampler stands: the epoch and how many of its samples were used."""

    epoch: int = 0
    consumed: int = 0

    def as_dict(self) -> dict[str, int]:
        """Return a JSON/DCP-friendly form."""
        return {"epoch": self.epoch, "consumed": self.consumed}


class ElasticSampler:
    """Deals global batches, cut into micro-batches, to a variable number of ranks."""

    def __init__(
        self, num_samples: int, global_batch_size: int, micro_batch_size: int, seed: int
    ) -> None:
        if global_batch_size % micro_batch_size:
            raise ValueError(
                f"The global batch ({global_batch_size}) must be a multiple of the micro-batch "
                f"({micro_batch_size}); change data.micro_batch_size."
            )
        if num_samples < global_batch_size:
            raise ValueError(
                f"The dataset has {num_samples} samples, fewer than one global batch "
                f"({global_batch_size}); lower data.global_batch_size."
            )
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.long)

    @property
    def steps_per_epoch(self) -> int:
        """Full global batches in one epoch."""
        return self.num_samples // self.global_batch_size

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches in one global batch."""
        return self.global_batch_size // self.micro_batch_size

    def permutation(self, epoch: int) -> torch.Tensor:
        """Return epoch ``epoch``'s global order of sample indices."""
        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.num_samples, generator=gen)
            self._perm_epoch = epoch
        return self._perm

    def normalize(self, cursor: Cursor) -> Cursor:
        """Roll a cursor whose epoch has no full global batch left into the next epoch."""
        if cursor.consumed + self.global_batch_size > self.num_samples:
            return Cursor(cursor.epoch + 1, 0)
        return cursor

    def global_batch(self, cursor: Cursor) -> tuple[torch.Tensor, Cursor]:
        """Return the next global batch's indices and the cursor after it."""
        cursor = self.normalize(cursor)
        start = cursor.consumed
        indices = self.permutation(cursor.epoch)[start : start + self.global_batch_size]
        return indices, Cursor(cursor.epoch, start + self.global_batch_size)

    def micro_batches(self, indices: torch.Tensor) -> list[torch.Tensor]:
        """Cut a global batch into its fixed micro-batches, in global order."""
        return list(indices.split(self.micro_batch_size))

    def for_rank(self, indices: torch.Tensor, rank: int, world_size: int) -> list[torch.Tensor]:
        """Return the micro-batches of ``indices`` that rank ``rank`` computes."""
        if world_size > self.micro_batches_per_step:
            raise ValueError(
                f"The world size ({world_size}) exceeds the micro-batches per step "
                f"({self.micro_batches_per_step}); some ranks would idle. Lower "
                "data.micro_batch_size or raise data.global_batch_size."
            )
        return self.micro_batches(indices)[rank::world_size]


__all__ = ["Cursor", "ElasticSampler"]
