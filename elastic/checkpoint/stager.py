"""Staging: copy a state dict into reused CPU buffers so training may go on.

The first call allocates one CPU buffer per tensor (pinned when CUDA is
available, so device-to-host copies run at full PCIe speed and can be
non-blocking); later calls only ``copy_`` into them. That is the floor cost of
taking a consistent snapshot: the blocking part of an async save is this copy.
Non-tensor leaves (ints, lists, bytes) are deep-copied; they are small.

For signed saves the stager also starts the data file's SHA-256 tree as it copies: the
writer leaves it the file's :class:`~elastic.checkpoint.digest.LeafPlan` (which tree leaf
covers which buffer), and each leaf is hashed, beside the copy, as soon as the buffers it
covers hold their new bytes. The hashing so runs during the copy and DCP's planning, on
bytes the copy has just brought into the cache, instead of only once the write starts;
the next writer uses those hashes only when its file is laid out exactly as planned.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from elastic.checkpoint.digest import LeafPlan

_owners: weakref.WeakValueDictionary[int, Stager] = weakref.WeakValueDictionary()


class Stager:
    """Copies nested state dicts into preallocated CPU tensors, reusing them across calls."""

    def __init__(self, pin_memory: bool | None = None) -> None:
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._buffers: dict[str, torch.Tensor] = {}
        self._sizes: dict[int, int] = {}  # buffer address -> bytes
        self.leaf_plan: LeafPlan | None = None  # the last signed file's, from its writer
        self._copied: list[int] = []  # addresses copied asynchronously (CUDA), this call

    def stage(self, state: Any) -> Any:
        """Return a CPU copy of ``state`` whose tensors live in this stager's buffers.

        The copy stays valid until the next call; the caller must not stage again
        while a save of the previous copy is in flight.
        """
        plan = self.leaf_plan
        if plan is not None:
            plan.begin()
        self._copied = []
        staged = self._copy(state, "")
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if plan is not None:
            for address in self._copied:
                plan.ready(address)
        return staged

    def owns(self, address: int, nbytes: int) -> bool:
        """Whether one of this stager's buffers is ``nbytes`` at ``address``."""
        return self._sizes.get(address) == nbytes

    def _copy(self, value: Any, key: str) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value, key)
        if isinstance(value, dict):
            return {k: self._copy(v, f"{key}/{k}") for k, v in value.items()}
        if isinstance(value, list | tuple):
            items = [self._copy(v, f"{key}/{i}") for i, v in enumerate(value)]
            return type(value)(items) if isinstance(value, tuple) else items
        return copy.deepcopy(value)

    def _tensor(self, tensor: torch.Tensor, key: str) -> torch.Tensor:
        tensor = tensor.detach()
        buf = self._buffers.get(key)
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            buf = torch.empty(
                tensor.shape,
                dtype=tensor.dtype,
                device="cpu",
                pin_memory=self.pin_memory and tensor.is_cuda,
            )
            old = self._buffers.get(key)
            if old is not None:
                self._sizes.pop(old.data_ptr(), None)
            self._buffers[key] = buf
            nbytes = buf.numel() * buf.element_size()
            if nbytes:
                self._sizes[buf.data_ptr()] = nbytes
                _owners[buf.data_ptr()] = self
        buf.copy_(tensor, non_blocking=tensor.is_cuda)
        if self.leaf_plan is not None:
            if tensor.is_cuda:
                self._copied.append(buf.data_ptr())  # ready once synchronized
            else:
                self.leaf_plan.ready(buf.data_ptr())
        return buf


def owner_of(buffers: Iterable[tuple[int, int]]) -> Stager | None:
    """The stager whose buffers are all of ``buffers`` (``(address, nbytes)``), or ``None``."""
    owner: Stager | None = None
    for address, nbytes in buffers:
        stager = _owners.get(address)
        if stager is None or not stager.owns(address, nbytes) or owner not in (None, stager):
            return None
        owner = stager
    return owner


__all__ = ["Stager", "owner_of"]
