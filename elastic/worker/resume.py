"""Where a Run's state comes from: the agreement on the newest state, and its loading.

:class:`Resumer` runs :func:`elastic.worker.exchange.agree` (one all-gather of every
rank's live state, snapshot and persisted step) and carries out its plan: nothing (every
rank holds it live), this node's memory or a peer's (:func:`~elastic.worker.exchange.fetch`),
shared storage, a foreign checkpoint (``init_from``), or a fresh start.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

import torch.distributed as dist

from elastic import events
from elastic.worker import exchange
from elastic.worker.codec import from_json
from elastic.worker.parts import Parts

logger = logging.getLogger(__name__)


class Resumer:
    """Resumes a run's ``parts``: at start (:meth:`resume`), and after an in-place re-form
    (:meth:`sync`, which moves nothing when every rank holds the same live state).
    ``init_from``: a foreign checkpoint a fresh job starts from. ``source`` and
    ``received_bytes`` say where the last load came from and what it streamed."""

    def __init__(self, parts: Parts, init_from: str | None = None) -> None:
        self.parts = parts
        self.init_from = init_from
        self.source = "fresh"
        self.received_bytes = 0

    def resume(self) -> str:
        """Agree on the newest state (no live one) and load it; its source."""
        return self.sync(live=False)

    def sync(self, live: bool) -> str:
        """Agree on the newest state, offering this rank's live one when ``live``, and load
        it unless every rank holds it live already; the source (``live``, ``memory``,
        ``peer``, ``storage``, ``foreign`` or ``fresh``)."""
        parts = self.parts
        train, place, group = parts.train, parts.place, parts.group
        started = time.perf_counter()
        # A rank that never took a state (a joiner whose first sync was cut short) offers
        # none: its model is the fresh one.
        of_state = place.round_of_state
        mine = (train.step, of_state) if live and of_state >= 0 else None
        found = parts.store.newest()
        held = (found[1].step, found[1].round) if found else None
        # Rank 0 reads the persisted step unless it holds a live state (a re-form): a live
        # group is never behind the checkpoints its own ranks committed.
        persisted = self._persisted_step() if place.rank == 0 and mine is None else -1
        plan = exchange.agree(held, persisted, group.control, mine, group.collective)
        if plan.source == "live":
            source = "live"
        else:
            holds_live = mine is not None and mine == (plan.step, plan.round)
            if place.rank in plan.writers:
                parts.jit.write_live(train.step, of_state)
            self._load(plan, live=holds_live and place.rank in plan.writers)
            source = self.source
            self._report(plan, held, time.perf_counter() - started)
        place.took_state()
        parts.jit.keep_boundary(train.step)
        return source

    def _load(self, plan: exchange.Plan, live: bool = False) -> None:
        if plan.source == "storage":
            self._load_storage()
        elif plan.source == "memory":
            self._load_memory(plan, live)
        elif plan.source == "fresh" and self.init_from:
            self._start_from(self.init_from)
        elif plan.source == "fresh" and self.parts.group.in_place:
            self._broadcast_model()  # DDP's own broadcast ran in a group of one

    def _report(self, plan: exchange.Plan, held: Any, seconds: float) -> None:
        step, place = self.parts.train.step, self.parts.place
        logger.info(
            "Resumed at step %d from %s in %.3f s (world size %d; held %s, persisted %d).",
            step,
            self.source,
            seconds,
            place.world_size,
            held,
            plan.persisted,
        )
        events.emit(
            "recovery.resume",
            step=step,
            source=self.source,
            seconds=round(seconds, 4),
            bytes=self.received_bytes,
            rank=place.rank,
            world_size=place.world_size,
            held=held[0] if held else None,
            persisted=plan.persisted,
        )

    def _start_from(self, url: str) -> None:
        """Load a foreign checkpoint's model and optimizer (every rank reads it)."""
        from elastic.checkpoint import init_from

        parts = self.parts
        started = time.perf_counter()
        state = parts.persist_state()
        manager = parts.checkpoints.manager
        missing = init_from(url, state, manager.group if manager is not None else None)
        parts.train.load_persisted(state, None)
        self.source = "foreign"
        seconds = round(time.perf_counter() - started, 4)
        rank = parts.place.rank
        events.emit("ckpt.init", url=url, seconds=seconds, rank=rank, missing=missing[:20])

    def _broadcast_model(self) -> None:
        """Rank 0's fresh model to the others, each broadcast through the group's
        ``collective`` (in place: released when a peer fails or moves on).

        Raises:
            Interrupted: a broadcast failed or was released.
        """
        model = self.parts.train.model
        module = getattr(model, "module", model)
        for tensor in module.state_dict().values():
            # On a copy: a released broadcast goes on in gloo's thread, writing its tensor.
            work = tensor.detach().clone()
            start = functools.partial(dist.broadcast, work, src=0, async_op=True)
            if not self.parts.group.collective(start):
                raise exchange.Interrupted("A peer failed while rank 0 sent the fresh model.")
            tensor.copy_(work)

    def _load_memory(self, plan: exchange.Plan, live: bool = False) -> None:
        """Load ``plan``'s state from memory or a peer. ``live``: this rank holds that state
        live (a survivor of a join, which just wrote it): its model and optimizer are it
        already, so only the rest (counters, schedule, sampler, RNG) is put back to the
        snapshot's, as every other rank's is."""
        parts = self.parts
        started = time.perf_counter()
        state, self.source, self.received_bytes = exchange.fetch(
            plan, parts.store, parts.group.control, parts.group.collective
        )
        if live:
            parts.train.load_extra(state)
        else:
            parts.train.load_state_dict(state)
        events.emit(
            "ckpt.load",
            step=parts.train.step,
            url="",
            source=self.source,
            seconds=round(time.perf_counter() - started, 4),
            rank=parts.place.rank,
            world_size=parts.place.world_size,
        )

    def _load_storage(self) -> None:
        parts = self.parts
        manager = parts.checkpoints.manager
        assert manager is not None
        loaded = manager.load_latest(parts.persist_state)
        if loaded is None:
            return
        state = loaded[1]
        parts.train.load_persisted(state, from_json(state["extra"]))
        self.source = "storage"

    def _persisted_step(self) -> int:
        """The newest committed checkpoint's step (commit records in etcd when fenced)."""
        checkpoints = self.parts.checkpoints
        if checkpoints.manager is None:
            return -1
        url = checkpoints.manager.cfg.url
        return exchange.persisted_step(url, checkpoints.run_id, checkpoints.fence)


__all__ = ["Resumer"]
