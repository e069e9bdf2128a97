"""The one door to torch's c10d internals for in-place re-forms: form, drop and swap groups.

A re-formed group is a *new* gloo process group made through the new round's bootstrap
store, swapped in as the default group; DDP follows with ``_update_process_group``. The
old group is dropped from torch's bookkeeping without ``shutdown()``: a collective stuck on
a frozen peer keeps one gloo thread until the group's :data:`TIMEOUT`, and joining it
would block the re-form (measured: a destroyed group with a stuck all-reduce hung the
next step). Dropped groups are kept referenced (:data:`_DROPPED`), never destroyed.

torch 2.14's own ``_reconfigure`` is not used: its gloo handle is the rank and address of
the store given at ``init_process_group`` (``gloo:<rank>:-1:<rank>:<host>:<port>``), so it
stops working once that store's host, rank 0's agent of the first round, is gone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from elastic import secret
from elastic.worker.formstore import FormingStore

logger = logging.getLogger(__name__)

TIMEOUT = timedelta(minutes=5)  # of an in-place group: bounds how long a stuck op lives on
_timeout = TIMEOUT  # this process's, from elastic.init_process_group(timeout=...)
# Each connect attempt of a formation: gloo tries 5 times, so a peer that died after it
# published its address holds the others ~5 x this (26 s measured at 5 s), not 5 x the
# group's timeout (25 minutes, seen in CI: a node killed while a joiner's round formed);
# a peer frozen for 8 s mid-connect still joins. The group's collectives then get _timeout.
FORM_TIMEOUT = timedelta(seconds=5)
_interrupt: Callable[[], None] | None = None  # the current round's (see form)
KEY_PREFIX = "elastic/worker"
_DROPPED: list[Any] = []
_FORMING: list[FormingStore] = []  # every round's, kept as _DROPPED keeps its groups
_T = TypeVar("_T")


def init_alone(backend: str = "gloo", timeout: timedelta | None = None) -> None:
    """A default group of this process alone (DDP can be built; ``Run`` joins the job).
    ``timeout`` (default :data:`TIMEOUT`) is every in-place group's, and how long a worker
    waits for the agent's next round, as a collective would wait on a peer."""
    global _timeout
    _timeout = timeout or TIMEOUT
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=_timeout)


def timeout_s() -> float:
    """The in-place groups' timeout, in seconds."""
    return _timeout.total_seconds()


def drop_world() -> None:
    """Forget every process group as ``destroy_process_group`` does, but without
    ``shutdown()`` (it would wait for a collective stuck on a frozen peer).

    The group counter goes back to 0 even when no group is left: c10d names each group by
    it (the default group ``"0"``) and prefixes the group's store keys with the name, and a
    formation cut short (a newer round came) has counted a group it never made. Without
    the reset, the next round's default group on this rank would be ``"1"`` and its peers'
    ``"0"``: each would wait for keys the other never writes, for the store's timeout."""
    world = c10d._world
    world.group_count = 0
    if not dist.is_initialized():
        return
    _DROPPED.extend(list(world.pg_map))
    c10d._update_default_pg(None)
    for table in (
        world.pg_map,
        world.pg_names,
        world.pg_group_ranks,
        world.pg_backend_config,
        world.pg_to_tag,
        world.tags_to_pg,
        world.pg_coalesce_state,
    ):
        table.clear()
    c10d._unregister_all_process_groups()


def form(
    round_: int,
    rank: int,
    world_size: int,
    host: str,
    port: int,
    backend: str = "gloo",
    interrupt: Callable[[], None] | None = None,
) -> float:
    """Drop the current groups and form round ``round_``'s default group through its
    bootstrap store at ``host:port``; returns the seconds it took. ``interrupt`` is called
    while a store wait of this group's formations (this one, and later ``new_group`` calls
    such as :func:`side_group`) polls, and raises to give up (:mod:`.formstore`)."""
    global _interrupt
    started = time.perf_counter()
    drop_world()
    _interrupt = interrupt
    bootstrap: dist.Store = client(host, port)
    if interrupt is not None:
        bootstrap = FormingStore(bootstrap, interrupt, wait_s=_timeout.total_seconds())
        # The Python object must outlive every C++ holder (the groups' PrefixStores):
        # without it, a later call finds no Python override and torch asserts.
        _FORMING.append(bootstrap)
    store = dist.PrefixStore(f"{KEY_PREFIX}/{round_}/", bootstrap)
    _made(
        lambda: dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=FORM_TIMEOUT
        )
    )
    dist.set_timeout(_timeout)
    return time.perf_counter() - started


def _made(make: Callable[[], _T]) -> _T:
    """``make()``, a group's formation. When it fails (gloo gave up on a peer that died or
    froze mid-connect), the round's ``interrupt`` says first whether a newer round formed
    meanwhile: its error (the member's :class:`~elastic.worker.exchange.Interrupted`)
    then replaces gloo's, and the re-form goes on in place to that round."""
    try:
        return make()
    except Exception:
        if _interrupt is not None:
            _interrupt()
        raise


def client(host: str, port: int, timeout: timedelta | None = None) -> dist.Store:
    """A client of a round's bootstrap store (``timeout``: default the groups'): with a job
    secret, the workers' keys live under a prefix only members can compute
    (:func:`elastic.secret.key_space`)."""
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout or _timeout, use_libuv=True)
    space = secret.key_space(f"{host}:{port}")
    return store if space is None else dist.PrefixStore(space, store)


def update_ddp(model: Any) -> None:
    """Give a DDP model a new reducer over the current default group, as DDP's own
    unpickling does (``__setstate__``), and register its communication hooks again.

    Not ``_update_process_group``: it keeps each rank's bucket layout, which DDP rebuilt
    in the order gradients became ready, so a survivor's layout differs from a joiner's
    fresh one, and one all-reduce of mismatched buckets sums different parameters
    (measured: a join put the final model 1e-2 away from a fault-free run). A new reducer
    on every rank starts from the same layout and rebuilds it in step with the others."""
    model.process_group = dist.group.WORLD
    parameters, expect_sparse = model._build_params_for_reducer()
    names = model._build_debug_param_to_name_mapping(parameters)
    model._ddp_init_helper(parameters, expect_sparse, names, model.static_graph)
    if model.static_graph:
        model.reducer._set_static_graph()
        model.logger._set_static_graph()
    for hook, state in model._comm_hooks:
        dist._register_comm_hook(model.reducer, state, hook)


def route_buffer_broadcast(
    model: Any, broadcast: Callable[[list[torch.Tensor], int, int], None]
) -> None:
    """Make a DDP model broadcast its buffers (BatchNorm statistics, each forward pass)
    through ``broadcast(tensors, buffer_size, src)`` instead of its own coalesced broadcast
    (DDP has no public hook for it: it calls ``_distributed_broadcast_coalesced``)."""
    model._distributed_broadcast_coalesced = broadcast


SIDE_TIMEOUT = timedelta(minutes=10)  # a checkpoint's collectives wait for the slowest write


def side_group() -> dist.ProcessGroup:
    """A gloo group of every rank, for a thread of its own (background checkpoints: its
    collectives wait for every rank's writes, so it gets at least :data:`SIDE_TIMEOUT`)."""
    group = _made(lambda: dist.new_group(backend="gloo", timeout=FORM_TIMEOUT))
    assert isinstance(group, dist.ProcessGroup)
    group.set_timeout(max(_timeout, SIDE_TIMEOUT))
    return group


__all__ = [
    "FORM_TIMEOUT",
    "KEY_PREFIX",
    "TIMEOUT",
    "client",
    "drop_world",
    "form",
    "init_alone",
    "route_buffer_broadcast",
    "side_group",
    "update_ddp",
]
