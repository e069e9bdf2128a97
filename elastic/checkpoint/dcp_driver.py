"""DCP's save and load drivers without pickles between ranks, and with bounded work.

:func:`save` and :func:`load` make the same planner and storage calls in the same order as
torch 2.14's ``_save_state_dict`` and ``_load_state_dict`` (the coordinator is group rank
0), but every value that crosses ranks is JSON from :mod:`elastic.checkpoint.dcp_codec`,
sent through :class:`~elastic.checkpoint.wire.Coordinated`:

* A failure on one rank (planning, writing, reading, or a message it sent that does not
  decode) reaches the coordinator, whose verdict every rank receives: all ranks raise the
  same :class:`~elastic.errors.CheckpointError`, none hangs. A rank decodes its own part
  of the coordinator's reply inside its next step, so a bad reply fails that step, which
  is again gathered.
* The coordinator bounds the work the ranks' save plans may cost before torch's own
  checks see them (:func:`check_save_plans`: items, chunks per tensor, chunks inside
  their tensor, no two overlapping, together filling it), and checks every rank's write
  results before it writes ``.metadata`` (:func:`check_write_results`: each names a plain
  file of that rank's own, ``__<rank>_*``).
* The global metadata stays on the coordinator (torch broadcasts it): :func:`save`
  returns it there and ``None`` elsewhere.
* Loading plans locally: DCP's default load planner and the filesystem readers leave
  the global plan as the ranks' own plans, and every rank reads the global ``.metadata``
  (checked against the commit marker it verified itself), so each rank plans and reads by
  itself and one all-gather of the outcome follows. Any other planner or reader gets
  torch's exchange, through the codec. There is no fall-back to rank-local metadata.

Nothing here changes the files: they are torch's DCP format as the storage writer writes
them.
"""

from __future__ import annotations

import inspect
import logging
import re
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from elastic.checkpoint.dcp_codec import decode_as, decode_list, encode
from elastic.checkpoint.storage import StorageInfo
from elastic.checkpoint.wire import Coordinated, shown
from elastic.errors import CheckpointError

logger = logging.getLogger(__name__)

MAX_ITEMS = 1 << 16  # write items in one rank's save plan (8 MiB of JSON holds ~38k)
MAX_CHUNKS_PER_RANK = 16  # distinct chunks of one tensor per rank (a shard is one chunk)
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


def _part(data: Any, rank: int, world_size: int) -> Any:
    """This rank's part of the coordinator's list of plans."""
    if type(data) is not list or len(data) != world_size:
        raise CheckpointError(
            f"The checkpoint planning message from rank 0 holds {shown(data)} where "
            f"{world_size} plans belong; it is refused: check that every node runs the "
            "same version."
        )
    return data[rank]


def _stateful(value: Any) -> Any:
    return value.state_dict() if isinstance(value, Stateful) else value


# -- the coordinator's checks --------------------------------------------------------------


def check_save_plans(plans: list[SavePlan]) -> None:
    """Refuse save plans whose checks would cost the coordinator more than linear work.

    torch's global plan check compares every pair of a tensor's chunks that overlap along
    its longest dimension and logs a line per overlap, per chunk out of bounds and per
    tensor not filled: a few hundred kilobytes of overlapping chunks cost seconds and
    hundreds of thousands of log lines. This runs first, stops at the first problem and
    logs nothing: at most :data:`MAX_ITEMS` items a rank, :data:`MAX_CHUNKS_PER_RANK` distinct
    chunks of one tensor per rank, each inside its tensor, none overlapping another, and
    (with several ranks) together the tensor's volume.

    Raises:
        CheckpointError: the first problem, in one sentence naming the rank and tensor.
    """
    for rank, plan in enumerate(plans):
        if len(plan.items) > MAX_ITEMS:
            raise CheckpointError(
                f"The checkpoint save is refused: rank {rank}'s save plan holds "
                f"{len(plan.items)} items, more than {MAX_ITEMS}."
            )
    tensors: dict[str, tuple[Any, dict[tuple[int, ...], tuple[int, ...]], int]] = {}
    per_rank: dict[tuple[int, str], int] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            data = item.tensor_data
            if item.type == WriteItemType.BYTE_IO or data is None:
                continue
            fqn = item.index.fqn
            size = tuple(data.size)
            offsets = tuple(data.chunk.offsets)
            sizes = tuple(data.chunk.sizes)
            known = tensors.setdefault(fqn, (size, {}, rank))
            if known[0] != size:
                raise _bad_plan(rank, fqn, f"gives it the shape {list(size)}, not {list(known[0])}")
            if len(offsets) != len(size) or len(sizes) != len(size):
                raise _bad_plan(rank, fqn, f"gives a chunk of {len(offsets)} dimensions")
            if any(o + s > n for o, s, n in zip(offsets, sizes, size, strict=True)):
                raise _bad_plan(rank, fqn, f"places a chunk outside it at {list(offsets)}")
            chunks = known[1]
            if offsets in chunks:
                if chunks[offsets] != sizes:
                    raise _bad_plan(rank, fqn, f"gives two chunks at {list(offsets)}")
                continue  # the same chunk again: a replicated tensor
            count = per_rank.get((rank, fqn), 0) + 1
            if count > MAX_CHUNKS_PER_RANK:
                raise _bad_plan(rank, fqn, f"splits it into more than {MAX_CHUNKS_PER_RANK} chunks")
            per_rank[(rank, fqn)] = count
            chunks[offsets] = sizes
    several = len(plans) > 1 and all(plan.usable for plan in plans)
    for fqn, (size, chunks, _) in tensors.items():
        _check_disjoint(fqn, size, chunks, several)


def _check_disjoint(
    fqn: str, size: tuple[int, ...], chunks: dict[tuple[int, ...], tuple[int, ...]], fill: bool
) -> None:
    """No two chunks of one tensor overlap and (``fill``) they fill it: torch's sweep along
    the longest dimension, stopped at the first overlap."""
    volume = 0
    for sizes in chunks.values():
        n = 1
        for s in sizes:
            n *= s
        volume += n
    if len(chunks) > 1 and size:
        dim = max(range(len(size)), key=lambda d: size[d])
        order = sorted(chunks.items(), key=lambda c: (c[0][dim], c[0]))
        active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        for offsets, sizes in order:
            start = offsets[dim]
            active = [a for a in active if a[0][dim] + a[1][dim] > start]
            for other, other_sizes in active:
                if all(
                    o < p + t and p < o + s
                    for o, s, p, t in zip(offsets, sizes, other, other_sizes, strict=True)
                ):
                    raise _bad_plan(None, fqn, f"has overlapping chunks at {list(offsets)}")
            active.append((offsets, sizes))
    whole = 1
    for n in size:
        whole *= n
    if size and fill and volume != whole:
        raise _bad_plan(None, fqn, f"has chunks of {volume} elements for {whole}")


def _bad_plan(rank: int | None, fqn: str, problem: str) -> CheckpointError:
    who = f"rank {rank}'s save plan" if rank is not None else "the ranks' save plans"
    return CheckpointError(
        f"The checkpoint save is refused: {who} for the tensor {fqn[:120]!r} {problem}."
    )


def check_write_results(results: list[list[WriteResult]]) -> None:
    """Each rank's write results name plain files of the prefix torch's filesystem writers
    give that rank (``__<rank>_``); anything else is refused before ``.metadata`` names it
    (a member could otherwise point the checkpoint at any file)."""
    for rank, written in enumerate(results):
        prefix = f"__{rank}_"
        for result in written:
            info = result.storage_data
            if type(info) is not StorageInfo:
                continue  # another writer's own records: its finish() checks them
            path = info.relative_path
            if not _PLAIN_NAME.match(path) or path in (".", "..") or not path.startswith(prefix):
                raise CheckpointError(
                    f"The checkpoint save is refused: rank {rank} reports writing "
                    f"{result.index.fqn[:120]!r} to {path[:120]!r}, not to a file of its own "
                    f"({prefix}*) in the checkpoint directory."
                )


# -- save ------------------------------------------------------------------------------------


def save(
    state_dict: dict[str, Any],
    *,
    storage_writer: StorageWriter,
    planner: SavePlanner | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> Metadata | None:
    """``dcp.save(state_dict, storage_writer=, planner=, process_group=)`` without pickles
    between ranks; the same files.

    Returns:
        The checkpoint's global metadata on the coordinator (group rank 0), ``None`` on the
        other ranks.

    Raises:
        CheckpointError: planning, writing or finishing failed on some rank, a rank sent
            a message that does not decode, or a plan or write result the coordinator
            refuses; the same error on every rank.
    """
    ranks = Coordinated(process_group)
    state = {k: _stateful(v) for k, v in state_dict.items()}
    plan_with = planner if planner is not None else DefaultSavePlanner()
    metadata: Metadata | None = None

    def local_step() -> Any:
        storage_meta = storage_writer.storage_meta()
        if "storage_meta" in inspect.signature(plan_with.set_up_planner).parameters:
            plan_with.set_up_planner(
                state_dict=state, storage_meta=storage_meta, is_coordinator=ranks.is_coordinator
            )
        else:
            plan_with.set_up_planner(state, ranks.is_coordinator)  # type: ignore[arg-type]
        if "kwargs" in inspect.signature(storage_writer.set_up_storage_writer).parameters:
            storage_writer.set_up_storage_writer(
                ranks.is_coordinator, rank=ranks.rank, use_collectives=True
            )
        else:
            storage_writer.set_up_storage_writer(ranks.is_coordinator)
        plan = storage_writer.prepare_local_plan(plan_with.create_local_plan())
        return encode(plan)

    def global_step(plans: list[Any]) -> Any:
        nonlocal metadata
        decoded = [decode_as(SavePlan, p, f"rank {r}") for r, p in enumerate(plans)]
        check_save_plans(decoded)
        global_plan, metadata = plan_with.create_global_plan(decoded)
        return [encode(p) for p in storage_writer.prepare_global_plan(global_plan)]

    mine = ranks.reduce("save's planning", local_step, global_step)

    def write_step() -> Any:
        plan = decode_as(SavePlan, _part(mine, ranks.rank, ranks.world_size), "rank 0")
        writes = storage_writer.write_data(plan_with.finish_plan(plan), plan_with)
        writes.wait()
        return encode(writes.value())

    def finish_step(results: list[Any]) -> None:
        decoded = [decode_list(WriteResult, r, f"rank {i}") for i, r in enumerate(results)]
        if metadata is None:
            raise CheckpointError("The coordinator has no metadata to finish the save with.")
        check_write_results(decoded)
        storage_writer.finish(metadata=metadata, results=decoded)

    ranks.reduce("save's writing", write_step, finish_step)
    return metadata if ranks.is_coordinator else None


# -- load ------------------------------------------------------------------------------------


def plans_locally(planner: LoadPlanner, reader: StorageReader) -> bool:
    """Whether the global load plan is the ranks' own plans for ``planner`` and ``reader``
    (DCP's default planner and filesystem readers: each rank may plan by itself)."""
    return (
        type(planner).create_global_plan is DefaultLoadPlanner.create_global_plan
        and type(reader).prepare_global_plan is FileSystemReader.prepare_global_plan
    )


def load(
    state_dict: dict[str, Any],
    *,
    storage_reader: StorageReader,
    planner: LoadPlanner | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """``dcp.load(state_dict, storage_reader=, planner=, process_group=)`` without pickles
    between ranks: loads into ``state_dict`` in place.

    Raises:
        CheckpointError: reading or planning failed on some rank, or a rank sent a
            message that does not decode; the same error on every rank.
    """
    ranks = Coordinated(process_group)
    keys = sorted(state_dict)
    state = {k: _stateful(state_dict[k]) for k in keys}
    plan_with = planner if planner is not None else DefaultLoadPlanner()

    def local_step() -> LoadPlan:
        metadata = storage_reader.read_metadata()
        plan_with.set_up_planner(state, metadata, ranks.is_coordinator)
        if "kwargs" in inspect.signature(storage_reader.set_up_storage_reader).parameters:
            storage_reader.set_up_storage_reader(
                metadata, ranks.is_coordinator, rank=ranks.rank, use_collectives=True
            )
        else:
            storage_reader.set_up_storage_reader(metadata, ranks.is_coordinator)
        return storage_reader.prepare_local_plan(plan_with.create_local_plan())

    def read(plan: LoadPlan) -> None:
        storage_reader.read_data(plan_with.finish_plan(plan), plan_with).wait()

    if plans_locally(plan_with, storage_reader):
        ranks.agree("load", lambda: read(local_step()))
    else:

        def global_step(plans: list[Any]) -> Any:
            decoded = [decode_as(LoadPlan, p, f"rank {r}") for r, p in enumerate(plans)]
            central = storage_reader.prepare_global_plan(plan_with.create_global_plan(decoded))
            return [encode(p) for p in central]

        mine = ranks.reduce("load's planning", lambda: encode(local_step()), global_step)
        ranks.agree(
            "load",
            lambda: read(decode_as(LoadPlan, _part(mine, ranks.rank, ranks.world_size), "rank 0")),
        )
    for key in keys:
        value = state_dict[key]
        if isinstance(value, Stateful):
            value.load_state_dict(state[key])
        else:
            state_dict[key] = state[key]


__all__ = [
    "MAX_CHUNKS_PER_RANK",
    "MAX_ITEMS",
    "check_save_plans",
    "check_write_results",
    "load",
    "plans_locally",
    "save",
]
