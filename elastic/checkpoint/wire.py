"""Bounded JSON between the ranks of a group: the checkpoint code's only messages.

Every cross-rank value of a save or a load (the manager's choices and outcomes, DCP's
plans through :mod:`elastic.checkpoint.planning`) goes as JSON bytes in uint8 tensors:
the length first, checked against :data:`MAX_WIRE` on every rank, then the bytes, each
rank's decoded and handed to a ``check`` function. Nothing here unpickles, so no member
of the group can run code in another; a bad message is the same one-sentence
:class:`~elastic.errors.CheckpointError` on every rank.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from elastic.errors import CheckpointError

MAX_WIRE = 8 << 20  # bytes of JSON one rank may send in one message


def _global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    if group is None:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def broadcast_json(
    value: Any, check: Callable[[Any, str], Any], group: dist.ProcessGroup | None = None
) -> Any:
    """Group rank 0's ``value`` (JSON-encodable) on every rank of ``group``, checked.

    Two broadcasts: the length (one int64), then the bytes. Every rank, rank 0 included,
    decodes and checks the same bytes, so every rank returns or raises alike.

    Raises:
        CheckpointError: the length is out of bounds, the bytes are no JSON, or ``check``
            refuses the value.
    """
    src = _global_rank(group, 0)
    device = _device(group)
    mine = _encode(value) if dist.get_rank(group) == 0 else b""
    size = torch.tensor([len(mine)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    n = _bounded(int(size.item()), 0)
    data = _tensor(mine, n, device)
    dist.broadcast(data, src=src, group=group)
    return check(_decode(data, n, 0), "rank 0")


def all_gather_json(
    value: Any, check: Callable[[Any, str], Any], group: dist.ProcessGroup | None = None
) -> list[Any]:
    """Every rank's ``value`` (JSON-encodable), in group rank order, each checked.

    Two all-gathers: the lengths (one int64 each), then the bytes padded to the longest.

    Raises:
        CheckpointError: a length is out of bounds, a rank's bytes are no JSON, or
            ``check`` refuses a rank's value (on every rank alike).
    """
    device = _device(group)
    world = dist.get_world_size(group)
    mine = _encode(value)
    size = torch.tensor([len(mine)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    lengths = [_bounded(int(s.item()), rank) for rank, s in enumerate(sizes)]
    longest = max(lengths)
    data = _tensor(mine, longest, device)
    everyone = [torch.zeros_like(data) for _ in range(world)]
    dist.all_gather(everyone, data, group=group)
    return [
        check(_decode(t, n, rank), f"rank {rank}")
        for rank, (t, n) in enumerate(zip(everyone, lengths, strict=True))
    ]


def _device(group: dist.ProcessGroup | None) -> torch.device:
    """Where the messages' tensors live: the GPU for a pure NCCL group, else the CPU."""
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encode(value: Any) -> bytes:
    """``value`` as JSON bytes (one too long is refused by :func:`_bounded` on every rank)."""
    return json.dumps(value, separators=(",", ":")).encode()


def _bounded(n: int, rank: int) -> int:
    if not 0 <= n <= MAX_WIRE:
        raise CheckpointError(
            f"Rank {rank} announced a checkpoint message of {n} bytes, outside 0..{MAX_WIRE}; "
            "it is not received: check that every node runs the same version."
        )
    return n


def _tensor(data: bytes, size: int, device: torch.device) -> torch.Tensor:
    """``data`` in a uint8 tensor of ``size`` bytes (zero-padded; empty: a receive buffer)."""
    out = torch.zeros(size, dtype=torch.uint8)
    if data:
        out[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out.to(device)


def _decode(t: torch.Tensor, n: int, rank: int) -> Any:
    raw = t[:n].cpu().numpy().tobytes()
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: hostile nesting
        raise CheckpointError(
            f"Rank {rank} sent a checkpoint message that is no JSON ({exc}); check that every "
            "node runs the same version."
        ) from exc


__all__ = ["MAX_WIRE", "all_gather_json", "broadcast_json"]
