"""DCP save plans are bounded in work, not only in size (issue 26, item 5).

torch's global plan check compares the overlapping chunks of a tensor pairwise and logs a
line per overlap: about 110 KB of overlapping chunks from one rank cost the coordinator
18-25 s and 320,000 log lines. ``dcp_driver.check_save_plans`` refuses such plans first,
in one sentence, in linear work (pure tests, and one save through the driver).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from elastic.checkpoint import dcp_driver
from elastic.checkpoint.dcp_driver import MAX_CHUNKS_PER_RANK, check_save_plans
from elastic.checkpoint.storage import FastSavePlanner, HashingWriter
from elastic.errors import CheckpointError


def _item(fqn: str, offsets: list[int], sizes: list[int], size: list[int]) -> WriteItem:
    return WriteItem(
        index=MetadataIndex(fqn, torch.Size(offsets)),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
            properties=TensorProperties(dtype=torch.float32),
            size=torch.Size(size),
        ),
    )


def _rows(rank: int, world: int, rows: int = 8, cols: int = 4) -> WriteItem:
    share = rows // world
    return _item("w", [rank * share, 0], [share, cols], [rows, cols])


def test_sharded_and_replicated_plans_pass() -> None:
    replicated = _item("b", [0], [4], [4])
    check_save_plans([SavePlan([_rows(r, 4), replicated]) for r in range(4)])
    columns = [_item("c", [0, r], [1000, 1], [1000, 4]) for r in range(4)]  # across the sweep
    check_save_plans([SavePlan([c]) for c in columns])


@pytest.mark.parametrize(
    ("plans", "why"),
    [
        ([SavePlan([_rows(0, 2), _item("w", [2, 0], [4, 4], [8, 4])])], "overlapping chunks"),
        ([SavePlan([_item("w", [6, 0], [4, 4], [8, 4])])], "places a chunk outside it"),
        ([SavePlan([_rows(0, 2)]), SavePlan([_item("w", [4, 0], [4, 4], [9, 4])])], "the shape"),
        ([SavePlan([_rows(0, 2)]), SavePlan([])], "chunks of 16 elements for 32"),
        (
            [SavePlan([_item("w", [i, 0], [1, 4], [100, 4]) for i in range(17)])],
            f"more than {MAX_CHUNKS_PER_RANK} chunks",
        ),
    ],
    ids=["overlap", "out-of-bounds", "two-shapes", "not-filled", "too-many-chunks"],
)
def test_a_costly_plan_is_one_sentence(plans: list[SavePlan], why: str) -> None:
    with pytest.raises(CheckpointError, match=why) as caught:
        check_save_plans(plans)
    assert str(caught.value).startswith("The checkpoint save is refused: ")


class _Overlapping(FastSavePlanner):
    """A rank's planner that sends ``count`` overlapping chunks of one tensor (~110 bytes
    of JSON each)."""

    count = 1200

    def create_local_plan(self) -> SavePlan:
        size = [self.count + 1000]
        items = [_item("model.w", [i], [1000], size) for i in range(self.count)]
        self.plan = SavePlan(items, planner_data={"model.w": ("model", "w")})
        return self.plan


def test_overlapping_chunks_cost_the_coordinator_milliseconds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = {"model": {"w": torch.zeros(2200)}}
    started = time.perf_counter()
    with caplog.at_level(logging.WARNING), pytest.raises(CheckpointError, match="save is refused"):
        dcp_driver.save(
            state, storage_writer=HashingWriter(str(tmp_path / "c")), planner=_Overlapping()
        )
    seconds = time.perf_counter() - started
    torch_lines = [r for r in caplog.records if r.name.startswith("torch.distributed")]
    assert len(torch_lines) == 0, f"{len(torch_lines)} lines from torch's plan check"
    assert seconds < 2.0, f"the refusal took {seconds:.2f} s"
