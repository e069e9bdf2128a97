"""Agree on the newest training state after a (re-)formed group, and stream it from a holder.

One all-gather over the group settles it: every rank offers the state live in its memory
(in place, after a re-form), the snapshot it holds (step and the rendezvous round that
produced each) and rank 0 adds the newest persisted step; :func:`newest` then decides, the
same on every rank. When every rank holds the same live state nothing moves. Otherwise the
newest state wins: the ranks that hold it live write it to their snapshot, ranks holding the
same (step, round) load their own copy, the lowest of them streams it to the others by
broadcast in chunks of :data:`CHUNK` bytes. Shared storage is read only when nobody holds a
state at least as new as the newest persisted checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastic import secret as job_secret
from elastic.errors import RecoveryError
from elastic.worker.codec import decode
from elastic.worker.snapshot import SnapshotStore

logger = logging.getLogger(__name__)

CHUNK = 16 << 20
MAX_META = 64 << 20  # bytes of a snapshot's JSON metadata a receiver accepts
TAG = 32  # bytes of the keyed digest that authenticates a streamed state

Held = tuple[int, int]  # (step, round) of a complete snapshot


@dataclass(frozen=True)
class Offer:
    """One rank's word to the agreement."""

    live: Held | None = None  # the state in this process's memory (in place), None: none
    held: Held | None = None  # its newest complete snapshot
    persisted: int = -1  # the newest committed checkpoint's step (rank 0 reads it)


@dataclass(frozen=True)
class Plan:
    """What every rank does to resume; identical on every rank."""

    source: str  # "live" (every rank has it), "memory" (held by someone), "storage", "fresh"
    step: int = 0
    round: int = 0
    src_rank: int = -1  # group rank that streams the state
    holders: tuple[int, ...] = ()  # group ranks that hold it locally
    persisted: int = -1

    def holds(self, rank: int) -> bool:
        return rank in self.holders

    @property
    def needs_stream(self) -> bool:
        return self.source == "memory" and self.receivers > 0

    @property
    def receivers(self) -> int:
        return self.world_size - len(self.holders)

    world_size: int = 1
    writers: tuple[int, ...] = ()  # group ranks that first write their live state to memory


def newest(offers: list[Offer]) -> Plan:
    """The plan, from every rank's offer (in rank order): the one choice of the newest state.

    States are ordered by ``(step, round)``: the most completed steps first, the newer
    round between two copies of the same step. A higher step can come from an older round
    only when the newer round went back (its ranks lost their memory and resumed from an
    older snapshot or checkpoint), and that step was then completed by every rank of its
    own group (a collective needs them all), so it is the job's own progress, not a split
    brain's: taking it redoes the fewest steps. Ordering by round first would throw it away.

    A rank's live state counts as held once it writes it (it does when its live state is
    the newest); a rank whose live state is older offers nothing (its snapshot is older
    still), and the rest offer their snapshot.
    """
    lives = [o.live for o in offers]
    world = len(offers)
    if offers and None not in lives and len(set(lives)) == 1:
        step, round_ = lives[0]  # type: ignore[misc]
        return Plan("live", step, round_, world_size=world)
    top = max((live for live in lives if live is not None), default=None)
    held = [(o.live if o.live == top else None) if o.live is not None else o.held for o in offers]
    plan = decide(held, offers[0].persisted if offers else -1)  # rank 0's word only
    if plan.source != "memory":
        return plan
    writers = tuple(r for r, live in enumerate(lives) if live is not None and live == top)
    return dataclasses.replace(plan, writers=writers)


def decide(offers: list[Held | None], persisted: int) -> Plan:
    """The plan, from every rank's held snapshot (in rank order) and the newest persisted
    step (ordered as :func:`newest` says)."""
    held = [o for o in offers if o is not None]
    world = len(offers)
    if held:
        newest = max(held)
        if newest[0] >= persisted:
            holders = tuple(r for r, o in enumerate(offers) if o == newest)
            return Plan("memory", newest[0], newest[1], holders[0], holders, persisted, world)
    if persisted >= 0:
        return Plan("storage", persisted, persisted=persisted, world_size=world)
    return Plan("fresh", world_size=world)


Runner = Callable[[Callable[[], Any]], bool]  # starts a collective (async_op) and waits


def agree(
    held: Held | None,
    persisted: int,
    group: dist.ProcessGroup | None = None,
    live: Held | None = None,
    run: Runner | None = None,
) -> Plan:
    """All-gather the offers over ``group`` and decide with :func:`newest` (a world of one:
    locally); ``run`` starts and waits for the all-gather (in place, the step guard's
    ``run``: a peer lost meanwhile fails it instead of hanging it).

    Each offer is seven integers (nothing a peer sends is unpickled), and each is checked:
    a negative step or round, or a persisted step a rank claims that is not -1 or above,
    is refused in one sentence.

    Raises:
        RecoveryError: an impossible offer; or ``run`` said the all-gather failed.
    """
    mine = Offer(live, held, persisted)
    if not (dist.is_available() and dist.is_initialized()):
        return newest([mine])
    sent = torch.tensor(_encode(mine), dtype=torch.int64)
    everyone = [torch.zeros_like(sent) for _ in range(dist.get_world_size(group))]
    if run is None:
        dist.all_gather(everyone, sent, group=group)
    elif not run(lambda: dist.all_gather(everyone, sent, group=group, async_op=True)):
        raise Interrupted("A peer failed while the group agreed on its state.")
    return newest([_offer(rank, t) for rank, t in enumerate(everyone)])


class Interrupted(RecoveryError):
    """The agreement or the state's stream was cut short (a peer failed, or moved on to a
    newer round) before this rank took any state."""


def _encode(o: Offer) -> list[int]:
    live, held = o.live or (0, 0), o.held or (0, 0)
    return [int(o.live is not None), *live, int(o.held is not None), *held, o.persisted]


def _offer(rank: int, t: torch.Tensor) -> Offer:
    has_live, live_step, live_round, has, step, round_, persisted = (int(v) for v in t.tolist())
    if (
        has not in (0, 1)
        or has_live not in (0, 1)
        or min(step, round_, live_step, live_round) < 0
        or persisted < -1
    ):
        raise RecoveryError(
            f"Rank {rank} offered an impossible state (held={has}, step={step}, "
            f"round={round_}, live={has_live}, live step={live_step}, live round="
            f"{live_round}, persisted={persisted}); it runs other code than this rank: "
            "check that every node runs the same version."
        )
    live = (live_step, live_round) if has_live else None
    return Offer(live, (step, round_) if has else None, persisted)


def stream(
    meta: bytes | None,
    data: torch.Tensor | None,
    src_rank: int,
    receive: bool,
    group: dist.ProcessGroup | None = None,
    chunk: int = CHUNK,
    run: Runner | None = None,
) -> tuple[bytes, torch.Tensor] | None:
    """Broadcast a snapshot (metadata and data bytes) from group rank ``src_rank``.

    The source passes ``meta`` and ``data`` (a uint8 tensor); the others pass None.
    Ranks with ``receive`` False (they hold the state already) take part in the
    collectives with a scratch buffer. Returns ``(meta, data)`` on receivers, else None.
    Sizes are bounded before anything is allocated; with a job secret the bytes are
    authenticated (a keyed digest the source sends first) before they are returned.
    ``run`` starts and waits for each broadcast (in place, the step guard's: a peer lost
    or gone on to a newer round releases it instead of holding it for the group's
    timeout, minutes).

    Raises:
        Interrupted: ``run`` said a broadcast failed or was released.
        RecoveryError: the sizes are out of bounds, or the bytes are not authenticated.
    """
    src = dist.get_global_rank(group, src_rank) if group is not None else src_rank
    sending = dist.get_rank(group) == src_rank
    started = time.perf_counter()
    key = _key()
    cast = _broadcaster(src, src_rank, group, run)
    meta_len, data_len, tag = _announce(meta, data, key, src_rank, sending, cast, receive)
    meta_t = (
        torch.frombuffer(bytearray(meta), dtype=torch.uint8)
        if sending and meta
        else torch.empty(meta_len, dtype=torch.uint8)
    )
    cast(meta_t)
    out = data if sending and data is not None else _buffer(receive, data_len, chunk)
    for start in range(0, data_len, chunk):
        n = min(chunk, data_len - start)
        piece = out[start : start + n] if sending or receive else out[:n]
        cast(piece)
    seconds = time.perf_counter() - started
    if sending or not receive:
        if sending:
            logger.info("Sent a %.1f MB snapshot in %.3f s (%.0f MB/s).", *_rate(data_len, seconds))
        return None
    got = meta_t.numpy().tobytes()
    if key is not None and not hmac.compare_digest(_digest(key, got, out), tag):
        raise RecoveryError(
            f"The state rank {src_rank} sent is not signed with this job's secret (or was "
            "altered on the way); it is not used. Give every node the same secret file."
        )
    mb, _, rate = _rate(data_len, seconds)
    logger.info(
        "Received a %.1f MB snapshot from rank %d in %.3f s (%.0f MB/s).",
        mb,
        src_rank,
        seconds,
        rate,
    )
    return got, out


def _broadcaster(
    src: int, src_rank: int, group: dist.ProcessGroup | None, run: Runner | None
) -> Callable[[torch.Tensor], None]:
    """One broadcast from global rank ``src``: plain, or started and waited for by ``run``.

    A released broadcast goes on in gloo's thread with its tensor: a receiver's buffer
    is dropped with the exception, and a source's bytes (a view of its snapshot file)
    stay mapped while gloo holds them (the file's close leaves an exported buffer)."""

    def cast(t: torch.Tensor) -> None:
        if run is None:
            dist.broadcast(t, src=src, group=group)
        elif not run(lambda: dist.broadcast(t, src=src, group=group, async_op=True)):
            raise Interrupted(
                f"A peer failed or moved on to a newer round while rank {src_rank} sent its state."
            )

    return cast


def _announce(
    meta: bytes | None,
    data: torch.Tensor | None,
    key: bytes | None,
    src_rank: int,
    sending: bool,
    cast: Callable[[torch.Tensor], None],
    receive: bool = True,
) -> tuple[int, int, bytes]:
    """The source's sizes and digest, broadcast; checked on the others before use."""
    sizes = torch.zeros(2, dtype=torch.int64)
    tag = torch.zeros(TAG, dtype=torch.uint8)
    if sending:
        assert meta is not None and data is not None
        sizes[0], sizes[1] = len(meta), data.numel()
        if key is not None:
            tag = torch.frombuffer(bytearray(_digest(key, meta, data)), dtype=torch.uint8)
    cast(sizes)
    cast(tag)
    meta_len, data_len = int(sizes[0]), int(sizes[1])
    if not sending:
        _check_sizes(src_rank, meta_len, data_len, receive)
    return meta_len, data_len, tag.numpy().tobytes()


def _buffer(receive: bool, data_len: int, chunk: int) -> torch.Tensor:
    """Where the data lands: all of it (a receiver), or one chunk of scratch (a holder)."""
    return torch.empty(data_len if receive else min(chunk, data_len), dtype=torch.uint8)


def _rate(data_len: int, seconds: float) -> tuple[float, float, float]:
    return data_len / 1e6, seconds, data_len / 1e6 / max(seconds, 1e-9)


def _key() -> bytes | None:
    """The key that authenticates streamed state: derived from the job secret (None: no
    secret, nothing to authenticate with; then only the sizes are checked)."""
    secret = job_secret.job_secret()
    if secret is None:
        return None
    return hashlib.sha256(b"elastic peer state v1\0" + secret).digest()


def _digest(key: bytes, meta: bytes, data: torch.Tensor) -> bytes:
    h = hashlib.blake2b(key=key, digest_size=TAG)
    h.update(len(meta).to_bytes(8, "little"))
    h.update(meta)
    h.update(data.numpy().data)
    return h.digest()


def _check_sizes(src_rank: int, meta_len: int, data_len: int, receive: bool = True) -> None:
    """A peer's claim of how much it sends, bounded before anything is allocated: by what
    this process may still allocate (its memory cgroup's room, else the host's). A receiver
    needs twice the data: the bytes received, and the tensors :func:`fetch` decodes out of
    them (``decode(clone=True)``: its consumers need tensors that own their memory,
    ``torch.set_rng_state`` crashes on a view)."""
    from elastic.node import memlimit

    room = memlimit.available_bytes()
    if room is None:
        room = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    need = 2 * data_len if receive else data_len
    if not (0 < meta_len <= MAX_META) or not (0 <= need <= room):
        raise RecoveryError(
            f"Rank {src_rank} announced a state of {meta_len} + {data_len} bytes, beyond "
            f"what this process accepts ({MAX_META} bytes of metadata, and {need} bytes to "
            f"receive and decode its data where its cgroup or host has {room} left); it is "
            "not received."
        )


def fetch(
    plan: Plan,
    store: SnapshotStore,
    group: dist.ProcessGroup | None = None,
    run: Runner | None = None,
) -> tuple[Any, str, int]:
    """Carry out a ``memory`` plan: holders decode their own snapshot, the source streams
    it to the others (each broadcast through ``run``, as :func:`stream`'s). Returns
    ``(state, source, bytes received)``, source ``memory`` or ``peer``; every rank of
    ``group`` must call it.

    Raises:
        Interrupted: a broadcast of the stream failed or was released.
        RecoveryError: the held snapshot changed since the agreement.
    """
    rank = dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
    meta: bytes | None = None
    data: torch.Tensor | None = None
    state: Any = None
    source, received = "memory", 0
    if plan.holds(rank):
        read = store.read()
        if read is None or (read[0].step, read[0].round) != (plan.step, plan.round):
            raise RecoveryError(
                f"The snapshot of step {plan.step} (round {plan.round}) changed while the "
                "group agreed on it; restart the group to agree again."
            )
        _, meta, data = read
        state = decode(meta, data, clone=True)
    if plan.needs_stream:
        src = rank == plan.src_rank
        got = stream(
            meta if src else None,
            data if src else None,
            plan.src_rank,
            state is None,
            group,
            run=run,
        )
        if got is not None:
            state = decode(got[0], got[1], clone=True)  # owned tensors: _check_sizes charged 2x
            source, received = "peer", got[1].numel()
    return state, source, received


def persisted_step(url: str, run_id: str, fence: Any = None) -> int:
    """The newest committed checkpoint's step: etcd's commit records when fenced, else
    a listing of the storage; -1 when there is none (or it cannot be listed)."""
    from elastic.checkpoint.fence import CommitFence

    if isinstance(fence, CommitFence):
        try:
            return max(fence.records(), default=-1)
        except Exception as exc:  # etcd unreachable: list the storage instead
            logger.warning("Cannot read the commit records (%s); listing the storage.", exc)
    from elastic.checkpoint import find_latest_complete

    try:
        info = find_latest_complete(url, run_id)
    except Exception as exc:  # the storage path reports it again when it loads
        logger.warning("Cannot list the checkpoints under %s (%s).", url, exc)
        return -1
    return info.step if info is not None else -1


__all__ = [
    "CHUNK",
    "Held",
    "Interrupted",
    "Offer",
    "Plan",
    "agree",
    "decide",
    "fetch",
    "newest",
    "persisted_step",
    "stream",
]
