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
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from elastic import events
from elastic.worker import exchange
from elastic.worker.codec import from_json

if TYPE_CHECKING:
    from elastic.worker.session import Run

logger = logging.getLogger(__name__)


class Resumer:
    """Resumes ``run``: at start (:meth:`resume`), and after an in-place re-form
    (:meth:`sync`, which moves nothing when every rank holds the same live state)."""

    def __init__(self, run: Run) -> None:
        self.run = run

    def resume(self) -> str:
        """Agree on the newest state (no live one) and load it; its source."""
        return self.sync(live=False)

    def sync(self, live: bool) -> str:
        """Agree on the newest state, offering this rank's live one when ``live``, and load
        it unless every rank holds it live already; the source (``live``, ``memory``,
        ``peer``, ``storage``, ``foreign`` or ``fresh``)."""
        run = self.run
        started = time.perf_counter()
        # A rank that never took a state (a joiner whose first sync was cut short) offers
        # none: its model is the fresh one.
        mine = (run.step, run._round_of_state) if live and run._round_of_state >= 0 else None
        found = run._store.newest()
        held = (found[1].step, found[1].round) if found else None
        # Rank 0 reads the persisted step unless it holds a live state (a re-form): a live
        # group is never behind the checkpoints its own ranks committed.
        persisted = self._persisted_step() if run.rank == 0 and mine is None else -1
        plan = exchange.agree(held, persisted, run._group.control, mine, run._group.collective)
        if plan.source == "live":
            source = "live"
        else:
            holds_live = mine is not None and mine == (plan.step, plan.round)
            if run.rank in plan.writers:
                run._jit.write_live(run.step, run._round_of_state)
            self._load(plan, live=holds_live and run.rank in plan.writers)
            source = run.resumed_from
            self._report(plan, held, time.perf_counter() - started)
        run._round_of_state = run._round
        run._jit.keep_boundary(run.step)
        return source

    def _load(self, plan: exchange.Plan, live: bool = False) -> None:
        run = self.run
        if plan.source == "storage":
            self._load_storage()
        elif plan.source == "memory":
            self._load_memory(plan, live)
        elif plan.source == "fresh" and run._init_from:
            self._start_from(run._init_from)
        elif plan.source == "fresh" and run._group.in_place:
            self._broadcast_model()  # DDP's own broadcast ran in a group of one
        run._last_saved = run.step if plan.source == "storage" else -1

    def _report(self, plan: exchange.Plan, held: Any, seconds: float) -> None:
        run = self.run
        logger.info(
            "Resumed at step %d from %s in %.3f s (world size %d; held %s, persisted %d).",
            run.step,
            run.resumed_from,
            seconds,
            run.world_size,
            held,
            plan.persisted,
        )
        events.emit(
            "recovery.resume",
            step=run.step,
            source=run.resumed_from,
            seconds=round(seconds, 4),
            bytes=run.received_bytes,
            rank=run.rank,
            world_size=run.world_size,
            held=held[0] if held else None,
            persisted=plan.persisted,
        )

    def _start_from(self, url: str) -> None:
        """Load a foreign checkpoint's model and optimizer (every rank reads it)."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        from elastic.checkpoint import init_from

        run = self.run
        started = time.perf_counter()
        state = run._persist_state()
        group = run._checkpoints.group if run._checkpoints is not None else None
        missing = init_from(url, state, group)
        set_state_dict(
            run.model,
            run.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        run.resumed_from = "foreign"
        seconds = round(time.perf_counter() - started, 4)
        events.emit("ckpt.init", url=url, seconds=seconds, rank=run.rank, missing=missing[:20])

    def _broadcast_model(self) -> None:
        """Rank 0's fresh model to the others, each broadcast through the group's
        ``collective`` (in place: released when a peer fails or moves on).

        Raises:
            Interrupted: a broadcast failed or was released.
        """
        run = self.run
        module = getattr(run.model, "module", run.model)
        for tensor in module.state_dict().values():
            # On a copy: a released broadcast goes on in gloo's thread, writing its tensor.
            work = tensor.detach().clone()
            start = functools.partial(dist.broadcast, work, src=0, async_op=True)
            if not run._group.collective(start):
                raise exchange.Interrupted("A peer failed while rank 0 sent the fresh model.")
            tensor.copy_(work)

    def _load_memory(self, plan: exchange.Plan, live: bool = False) -> None:
        """Load ``plan``'s state from memory or a peer. ``live``: this rank holds that state
        live (a survivor of a join, which just wrote it): its model and optimizer are it
        already, so only the rest (counters, schedule, sampler, RNG) is put back to the
        snapshot's, as every other rank's is."""
        run = self.run
        started = time.perf_counter()
        state, run.resumed_from, run.received_bytes = exchange.fetch(
            plan, run._store, run._group.control, run._group.collective
        )
        if live:
            run._apply_extra(state)
        else:
            run._apply(state)
        events.emit(
            "ckpt.load",
            step=run.step,
            url="",
            source=run.resumed_from,
            seconds=round(time.perf_counter() - started, 4),
            rank=run.rank,
            world_size=run.world_size,
        )

    def _load_storage(self) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        run = self.run
        assert run._checkpoints is not None
        loaded = run._checkpoints.load_latest(run._persist_state)
        if loaded is None:
            return
        state = loaded[1]
        set_state_dict(
            run.model,
            run.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        run._apply_extra(from_json(state["extra"]))
        run.resumed_from = "storage"

    def _persisted_step(self) -> int:
        """The newest committed checkpoint's step (commit records in etcd when fenced)."""
        run = self.run
        if run._checkpoints is None:
            return -1
        return exchange.persisted_step(run._checkpoints.cfg.url, run.run_id, run._fence)


__all__ = ["Resumer"]
