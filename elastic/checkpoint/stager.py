"""Staging: copy a state dict into reused CPU buffers so training may go on.

The first call allocates one CPU buffer per tensor (pinned when CUDA is
available, so device-to-host copies run at full PCIe speed and can be
non-blocking); later calls only ``copy_`` into them. That is the floor cost of
taking a consistent snapshot: the blocking part of an async save is this copy.
Non-tensor leaves (ints, lists, bytes) are deep-copied; they are small.
"""

from __future__ import annotations

import copy
from typing import Any

import torch


class Stager:
    """Copies nested state dicts into preallocated CPU tensors, reusing them across calls."""

    def __init__(self, pin_memory: bool | None = None) -> None:
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._buffers: dict[str, torch.Tensor] = {}

    def stage(self, state: Any) -> Any:
        """Return a CPU copy of ``state`` whose tensors live in this stager's buffers.

        The copy stays valid until the next call; the caller must not stage again
        while a save of the previous copy is in flight.
        """
        staged = self._copy(state, "")
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return staged

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
            self._buffers[key] = buf
        buf.copy_(tensor, non_blocking=tensor.is_cuda)
        return buf


__all__ = ["Stager"]
