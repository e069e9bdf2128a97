"""Bounded JSON between the ranks of a group, and the one "rank 0 decides" protocol.

Every cross-rank value of a save or a load (the manager's choices and outcomes, DCP's
plans through :mod:`elastic.checkpoint.dcp_driver`) goes as JSON bytes in uint8 tensors:
the length first, checked against :data:`MAX_WIRE` on every rank, then the bytes, each
rank's decoded and handed to a ``check`` function. Nothing here unpickles, so no member
of the group can run code in another; a bad message is the same one-sentence
:class:`~elastic.errors.CheckpointError` on every rank.

:class:`Coordinated` is the one protocol on top: every rank reports an outcome, group
rank 0 decides, and every rank receives the same typed :class:`Verdict` (``ok`` with its
payload, ``skipped`` or ``failed`` with one line), so every rank goes on or raises alike.
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from elastic.errors import CheckpointError

logger = logging.getLogger(__name__)

T = TypeVar("T")
MAX_WIRE = 8 << 20  # bytes of JSON one rank may send in one message
MAX_ERROR = 2000  # characters of one rank's error that travel


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


# -- the verdict protocol ---------------------------------------------------------------


class Kind(str, enum.Enum):
    """What became of one coordinated step."""

    OK = "ok"
    SKIPPED = "skipped"  # nothing was done, and that is no failure (a fence that is not there)
    FAILED = "failed"


@dataclass(frozen=True)
class Verdict:
    """One rank's outcome, or the coordinator's decision: ``kind`` and its ``detail``
    (``ok``: the payload, JSON; ``skipped`` and ``failed``: one line saying why)."""

    kind: Kind
    detail: Any = None

    @classmethod
    def ok(cls, payload: Any = None) -> Verdict:
        return cls(Kind.OK, payload)

    @classmethod
    def skipped(cls, why: str) -> Verdict:
        return cls(Kind.SKIPPED, _line(why))

    @classmethod
    def failed(cls, why: str) -> Verdict:
        return cls(Kind.FAILED, _line(why))

    @property
    def is_ok(self) -> bool:
        return self.kind is Kind.OK

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "detail": self.detail}

    @classmethod
    def from_json(cls, value: Any, sender: str) -> Verdict:
        """The verdict ``value`` encodes (checked: a known kind; a reason is a string)."""
        if type(value) is dict and set(value) == {"kind", "detail"}:
            kind = next((k for k in Kind if k.value == value["kind"]), None)
            detail = value["detail"]
            if kind is Kind.OK:
                return cls(kind, detail)
            if kind is not None and type(detail) is str and len(detail) <= MAX_ERROR + 200:
                return cls(kind, detail)
        raise refused(sender, "a step outcome", value)


def _line(text: str) -> str:
    return (str(text).splitlines() or [""])[0][: MAX_ERROR + 200]


def describe(exc: BaseException) -> str:
    """One line naming the error (DCP's own exception: its first rank's)."""
    if isinstance(exc, CheckpointException) and exc.failures:
        _, (inner, _) = sorted(exc.failures.items())[0]
        exc = inner
    return _line(f"{type(exc).__name__}: {exc}")[:MAX_ERROR]


def attempt(fn: Callable[[], Any]) -> Verdict:
    """``Verdict.ok(fn())``, or ``failed`` with the error it raised (logged in full)."""
    try:
        return Verdict.ok(fn())
    except (Exception, CheckpointException) as exc:  # every rank learns of it
        logger.debug("A coordinated checkpoint step failed on this rank.", exc_info=True)
        return Verdict.failed(describe(exc))


def shown(value: Any) -> str:
    """``repr(value)``, at most 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def refused(sender: str, what: str, value: Any) -> CheckpointError:
    """The error for a message from ``sender`` that is not ``what``."""
    return CheckpointError(
        f"The checkpoint message from {sender} is not {what} (it holds {shown(value)}); "
        "check that every node runs the same version."
    )


class Coordinated:
    """A group whose rank 0 decides: every rank reports, rank 0's :class:`Verdict` reaches
    every rank, checked alike, so every rank goes on or raises alike. Without
    ``torch.distributed`` the process is a group of one."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.is_coordinator = self.rank == 0

    def gather(self, value: Any, check: Callable[[Any, str], T]) -> list[T]:
        """Every rank's ``value`` (JSON), in rank order, each checked by ``check``."""
        if not self.distributed:
            return [check(value, "rank 0")]
        return _translated(lambda: all_gather_json(value, check, self.group))

    def broadcast(self, value: Any, check: Callable[[Any, str], T]) -> T:
        """Rank 0's ``value`` (JSON) on every rank, checked by ``check`` (on rank 0 too)."""
        if not self.distributed:
            return check(value, "rank 0")
        return _translated(lambda: broadcast_json(value, check, self.group))

    def decide(self, decide: Callable[[], Verdict]) -> Verdict:
        """Rank 0's ``decide()`` on every rank (the other ranks do not call it)."""
        mine = decide().to_json() if self.is_coordinator else None
        return self.broadcast(mine, Verdict.from_json)

    def reduce(
        self,
        what: str,
        local: Callable[[], Any],
        central: Callable[[list[Any]], Any],
    ) -> Any:
        """``local()`` on every rank (JSON), ``central(all of them)`` on the coordinator,
        its result (JSON) on every rank; a failure anywhere raises the same
        :class:`~elastic.errors.CheckpointError` on every rank."""
        gathered = self.gather(attempt(local).to_json(), Verdict.from_json)

        def verdict() -> Verdict:
            failed = [(r, v.detail) for r, v in enumerate(gathered) if not v.is_ok]
            if failed:
                return Verdict.failed(_failures(failed))
            outcome = attempt(lambda: central([v.detail for v in gathered]))
            if outcome.is_ok:
                return outcome
            return Verdict.failed(f"rank {self.rank}: {outcome.detail}")

        return _raise_unless_ok(what, self.decide(verdict))

    def agree(self, what: str, local: Callable[[], Any]) -> None:
        """``local()`` on every rank; raises the same error everywhere if one failed."""

        def run() -> None:
            local()

        gathered = self.gather(attempt(run).to_json(), Verdict.from_json)
        failed = [(r, v.detail) for r, v in enumerate(gathered) if not v.is_ok]
        if failed:
            _raise_unless_ok(what, Verdict.failed(_failures(failed)))


def _raise_unless_ok(what: str, verdict: Verdict) -> Any:
    if not verdict.is_ok:
        raise CheckpointError(
            f"The checkpoint {what} failed ({verdict.detail}); every rank of the group gives it up."
        )
    return verdict.detail


def _failures(failed: list[tuple[int, str]]) -> str:
    rank, error = failed[0]
    more = f", and on {len(failed) - 1} more rank(s)" if len(failed) > 1 else ""
    return f"rank {rank}: {error}{more}"


def _translated(fn: Callable[[], T]) -> T:
    try:
        return fn()
    except RecursionError as exc:  # a check of hostile nesting: alike on every rank
        raise CheckpointError(
            "A checkpoint message nests too deeply to decode; it is refused: check that "
            "every node runs the same version."
        ) from exc


__all__ = [
    "MAX_WIRE",
    "Coordinated",
    "Kind",
    "Verdict",
    "all_gather_json",
    "attempt",
    "broadcast_json",
    "describe",
    "refused",
]
