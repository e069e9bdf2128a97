"""Checkpoints in torch's format: the project writes, torch's stock tools read, and back.

Every reader here runs in a fresh Python that never imports elastic.
"""

from __future__ import annotations

import json
import pickle
import zlib
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from elastic.checkpoint import COMMIT_MARKER, CheckpointManager, StepInfo
from elastic.checkpoint.config import CheckpointConfig
from elastic.checkpoint.foreign import init_from
from elastic.checkpoint.record import frame
from elastic.checkpoint.storage import METADATA, RAW_FORMAT
from elastic.errors import CheckpointError

from .conftest import (
    RUN,
    assert_same_bytes,
    make_state,
    run_without_elastic,
    save_with_project,
    zeros_like,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

STOCK_READ = """
import torch, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
src, out = {src!r}, {out!r}
dcp_to_torch_save(src, out + ".converted")
template = torch.load({template!r}, weights_only=True)
dcp.load(template, storage_reader=FileSystemReader(src))
torch.save({{"converted": torch.load(out + ".converted", weights_only=True),
            "loaded": template}}, out)
"""


@pytest.mark.integration
def test_a_project_checkpoint_loads_with_torchs_stock_tools(tmp_path: Path) -> None:
    state = make_state(1)
    info = save_with_project(str(tmp_path / "ckpt"), 3, state)
    template = tmp_path / "template.pt"
    torch.save(zeros_like(state), template)
    out = tmp_path / "read.pt"
    code = STOCK_READ.format(src=info.data_url, out=str(out), template=str(template))
    run_without_elastic(code, tmp_path)
    read = torch.load(out, weights_only=True)
    want = {**state, "model": {k: v.contiguous() for k, v in state["model"].items()}}
    assert_same_bytes(read["converted"], want)
    assert_same_bytes(read["loaded"], want)


@pytest.mark.integration
def test_every_tensor_record_is_a_plain_torch_save_record(tmp_path: Path) -> None:
    info = save_with_project(str(tmp_path / "ckpt"), 1, make_state())
    code = f"""
import pickle
metadata = pickle.load(open({str(Path(info.data_url) / METADATA)!r}, "rb"))
print(sorted({{tuple(s.transform_descriptors or ()) for s in metadata.storage_data.values()}}))
"""
    assert run_without_elastic(code, tmp_path).strip() == "[()]"


STOCK_SAVE = """
import torch, torch.distributed.checkpoint as dcp
state = torch.load({state!r}, weights_only=True)
dcp.save(state, checkpoint_id={dst!r})
"""


@pytest.mark.integration
def test_a_stock_dcp_checkpoint_starts_a_run(tmp_path: Path) -> None:
    state = make_state(2)
    saved = tmp_path / "state.pt"
    torch.save(state, saved)
    foreign = tmp_path / "titan" / "step-100"
    run_without_elastic(STOCK_SAVE.format(state=str(saved), dst=str(foreign)), tmp_path)
    template = zeros_like(state)
    template["sampler"] = {"cursor": torch.tensor(0)}
    missing = init_from(str(foreign), template)
    assert missing == ["sampler.cursor"]
    cursor = template.pop("sampler")
    assert_same_bytes(template, {**state, "model": state["model"]})
    assert int(cursor["cursor"]) == 0


@pytest.mark.integration
def test_a_model_only_checkpoint_fills_the_model(tmp_path: Path) -> None:
    state = make_state(3)
    saved = tmp_path / "model.pt"
    torch.save(state["model"], saved)  # torchtitan's last_save_model_only: keys at the top
    foreign = tmp_path / "model-only"
    run_without_elastic(STOCK_SAVE.format(state=str(saved), dst=str(foreign)), tmp_path)
    template = zeros_like(state)
    missing = init_from(str(foreign), template)
    assert_same_bytes(template["model"], state["model"])
    assert "optim.state.conv.weight.momentum_buffer" in missing
    assert "train.step" in missing and template["train"]["step"] == -1


def test_starting_from_a_directory_without_a_checkpoint_is_one_sentence(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"holds no readable DCP checkpoint .*\.$"):
        init_from(str(tmp_path), zeros_like(make_state()))


def _to_legacy_raw(info: StepInfo) -> None:
    """Rewrite a step as versions before torch-format records wrote it: each tensor's raw
    bytes alone, described by RAW_FORMAT (an unsigned marker, recomputed)."""
    data_dir = Path(info.data_url)
    metadata = pickle.loads((data_dir / METADATA).read_bytes())  # our own test file
    shard = (data_dir / "__0_0.distcp").read_bytes()
    out = bytearray()
    for index, entry in sorted(metadata.storage_data.items(), key=lambda kv: kv[1].offset):
        record = shard[entry.offset : entry.offset + entry.length]
        meta = metadata.state_dict_metadata[index.fqn]
        descriptors = None
        if isinstance(meta, TensorStorageMetadata):
            framing = frame(meta.properties.dtype, tuple(meta.size))
            record, descriptors = record[framing.data_offset :][: framing.nbytes], [RAW_FORMAT]
        metadata.storage_data[index] = _StorageInfo(
            entry.relative_path, len(out), len(record), transform_descriptors=descriptors
        )
        out += record
    assert len(out) < len(shard)  # the torch.save heads and tails are gone
    (data_dir / "__0_0.distcp").write_bytes(bytes(out))
    (data_dir / METADATA).write_bytes(pickle.dumps(metadata))
    files = {
        p.name: {"size": p.stat().st_size, "crc32": f"{zlib.crc32(p.read_bytes()):08x}"}
        for p in data_dir.iterdir()
    }
    marker = {**(info.marker or {}), "files": files, "version": 2}
    (Path(info.step_dir) / COMMIT_MARKER).write_text(json.dumps(marker))


def test_checkpoints_of_the_raw_format_still_load(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    state = make_state(4)
    info = save_with_project(url, 5, state, secret=None)
    _to_legacy_raw(info)
    manager = CheckpointManager(CheckpointConfig(url=url, interval=1), RUN, secret=None)
    loaded = manager.load_latest(lambda: zeros_like(make_state()))
    assert loaded is not None and loaded[0] == 5
    assert_same_bytes(loaded[1]["model"], state["model"])
    assert_same_bytes(loaded[1]["optim"], state["optim"])


@pytest.mark.integration
def test_a_torchtitan_layout_fills_model_and_optimizer(tmp_path: Path) -> None:
    state = make_state(6)
    titan = {**state["model"], "optimizer": state["optim"], "train_state": {"step": 100}}
    saved = tmp_path / "titan.pt"
    torch.save(titan, saved)
    foreign = tmp_path / "titan"
    run_without_elastic(STOCK_SAVE.format(state=str(saved), dst=str(foreign)), tmp_path)
    template = zeros_like(state)
    missing = init_from(str(foreign), template)
    assert missing == ["train.consumed", "train.epoch", "train.step"]
    assert_same_bytes(template["model"], state["model"])
    assert_same_bytes(template["optim"], state["optim"])
