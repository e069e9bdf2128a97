"""elastic.checkpoint.dcp_codec and dcp_driver: DCP's save and load, ranks exchanging JSON.

The codec round-trips every planning type torch 2.14 sends between ranks and refuses
everything else in one sentence (pure tests); two real gloo ranks save through the
driver and HashingWriter, load back equal (planned locally, and through the exchange),
torch's own reader reads the files, and a rank that sends a hostile plan (an unknown
class, a pickle, an oversized message) fails that save on both ranks without running it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

from elastic.checkpoint import dcp_codec
from elastic.checkpoint.dcp_codec import decode, encode
from elastic.checkpoint.storage import FastSavePlanner, HashingWriter
from elastic.errors import CheckpointError
from tests.checkpoint.conftest import make_state, run_without_elastic
from tests.helpers import run_ranks


def _roundtrip(value: Any) -> Any:
    """Through the codec and JSON text, as between ranks."""
    return decode(json.loads(json.dumps(encode(value))), "rank 1")


def _same(got: Any, want: Any) -> None:
    """Equal, and of the same types all the way down (tuples stay tuples, Sizes Sizes)."""
    assert type(got) is type(want), (got, want)
    if isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            _same(g, w)
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for key in want:
            _same(got[key], want[key])
    elif hasattr(want, "__dataclass_fields__"):
        for name in want.__dataclass_fields__:
            _same(getattr(got, name), getattr(want, name))
    else:
        assert got == want


def _local_plan() -> SavePlan:
    """FastSavePlanner's plan of a varied state (tensors, plain values, nesting)."""
    planner = FastSavePlanner()
    planner.set_up_planner(make_state(), None, True)
    return planner.create_local_plan()


def test_a_real_save_plan_round_trips_with_its_flatten_mapping(tmp_path: Path) -> None:
    plan = _local_plan()
    assert {item.type for item in plan.items} == {WriteItemType.TENSOR, WriteItemType.BYTE_IO}
    assert any(isinstance(k, int) for path in plan.planner_data.values() for k in path)
    _same(_roundtrip(plan), plan)
    (central,) = HashingWriter(str(tmp_path)).prepare_global_plan([plan])
    assert type(central.storage_data) is _StoragePrefix
    _same(_roundtrip(central), central)
    _same(_roundtrip(SavePlan([], usable=False)), SavePlan([], usable=False))


def test_every_planning_type_round_trips() -> None:
    index = MetadataIndex("optim.state.0.exp_avg", torch.Size([2, 0]), 3)
    props = TensorProperties(
        dtype=torch.bfloat16,
        layout=torch.sparse_coo,
        requires_grad=True,
        memory_format=torch.channels_last,
        pin_memory=True,
    )
    chunk = ChunkStorageMetadata(offsets=torch.Size([2, 0]), sizes=torch.Size([2, 5]))
    tensor = WriteItem(
        index=index,
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(chunk=chunk, properties=props, size=torch.Size([4, 5])),
    )
    blob = WriteItem(MetadataIndex("train.step"), WriteItemType.BYTE_IO, BytesIOWriteData(12))
    read = ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex("w", torch.Size([0]), 0),
        dest_offsets=torch.Size([1]),
        storage_index=MetadataIndex("w", torch.Size([0])),
        storage_offsets=torch.Size([0]),
        lengths=torch.Size([3]),
    )
    values: list[Any] = [
        SavePlan([tensor, blob], storage_data=_StoragePrefix("__1_"), planner_data={"a": ("a",)}),
        LoadPlan([read], storage_data={"k": [1, 2.5]}, planner_data=None),
        WriteResult(
            index=index, size_in_bytes=40, storage_data=_StorageInfo("__0_0.distcp", 8, 40)
        ),
        WriteResult(index, 0, _StorageInfo("f", 0, 0, transform_descriptors=("a", "b"))),
        WriteResult(index, 0, _StorageInfo("f", 0, 0, transform_descriptors=["raw"])),
        WriteResult(index, 0, ("tuple", 1, 2)),  # another writer's storage data
        WriteResult(index, 0, None),
        {("a", 1): [(), [torch.Size([])]], 3: None, index: True, -(2**63): "min"},
        [props, chunk, torch.float8_e4m3fn, torch.strided, torch.preserve_format, 1.5, ""],
        (LoadItemType.BYTE_IO, WriteItemType.TENSOR, (1, (2, [3]))),
    ]
    for value in values:
        _same(_roundtrip(value), value)
    assert {type(v).__name__ for v in values[:3]} <= set(dcp_codec.CLASSES)


def _nested(depth: int) -> list[Any]:
    data: list[Any] = ["list"]
    for _ in range(depth):
        data = ["list", data]
    return data


HOSTILE: list[tuple[Any, str]] = [
    (["posix.system", "touch /tmp/pwned"], "names the type 'posix.system'"),
    (["MetadataIndex", "w", None], "gives MetadataIndex 2 fields, where it has 3"),
    (["MetadataIndex", 7, None, None], "a MetadataIndex with a wrong field (7 is no string)"),
    (["SavePlan", ["list", "x"], None, None, True], "gives SavePlan.items the value ['x']"),
    (["SavePlan", ["list"], None, None, "yes"], "gives SavePlan.usable the value 'yes'"),
    (["WriteItemType", "EXEC"], "names the unknown WriteItemType ['EXEC']"),
    (["dtype", "__class__"], "names the unknown dtype"),
    (["Size", -1], "holds the tensor shape [-1]"),
    (["Size", *([1] * 65)], "holds the tensor shape"),
    (1 << 64, "does not fit in 64 bits"),
    ({"fqn": "w"}, "which is no encoded value"),
    ([], "which is no encoded value"),
    (b"\x80\x04\x95K\x01.", "which is no encoded value"),  # a pickle is never decoded
    (["dict", "a"], "a key but no value"),
    (["dict", ["list"], 1], "a dict keyed by []"),
    (_nested(40), "nests deeper than 32 levels"),
]


@pytest.mark.parametrize(("data", "problem"), HOSTILE, ids=[p for _, p in HOSTILE])
def test_the_codec_refuses_what_it_does_not_know_in_one_sentence(data: Any, problem: str) -> None:
    with pytest.raises(CheckpointError) as caught:
        decode(data, "rank 2")
    message = str(caught.value)
    assert message.startswith("The checkpoint planning message from rank 2 ")
    assert problem in message and message.endswith("same version.")
    assert message.count(". ") == 0  # one sentence


@pytest.mark.parametrize(
    "value",
    [object(), b"bytes", {1, 2}, float("nan"), 1 << 63, torch.zeros(1), lambda: None],
    ids=["object", "bytes", "set", "nan", "int", "tensor", "function"],
)
def test_the_codec_sends_nothing_outside_its_types(value: Any) -> None:
    with pytest.raises(CheckpointError, match="it is not sent"):
        encode({"planner_data": [value]})


def test_decode_as_insists_on_the_class() -> None:
    with pytest.raises(CheckpointError, match="holds a list where a SavePlan belongs"):
        dcp_codec.decode_as(SavePlan, encode([1]), "rank 1")
    plan = _local_plan()
    assert dcp_codec.decode_as(SavePlan, encode(plan)) == plan


# -- real ranks ------------------------------------------------------------------------------

WORKER = r"""
import json, os, sys
import torch, torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner
from elastic.checkpoint import dcp_driver, wire
from elastic.checkpoint.storage import FastSavePlanner, HashingWriter, SafeLoadPlanner, make_reader
from elastic.errors import CheckpointError
from tests.checkpoint.conftest import assert_same_bytes, make_state, zeros_like

rank, store, root, marker = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
group = dist.new_group(backend="gloo")
out = {}

def save(name, key="k"):
    writer = HashingWriter(f"{root}/{name}")
    try:
        metadata = dcp_driver.save(make_state(), storage_writer=writer,
                                 planner=FastSavePlanner(cache_key=key), process_group=group)
    except CheckpointError as exc:
        return str(exc)
    return {"files": sorted(writer.written), "metadata": metadata is not None}

class Exchanging(SafeLoadPlanner):  # not DCP's global step: the plans go through rank 0
    def create_global_plan(self, plans):
        return super().create_global_plan(plans)

def load(name, planner):
    state = zeros_like(make_state())
    dcp_driver.load(state, storage_reader=make_reader(f"{root}/{name}"), planner=planner,
                  process_group=group)
    assert_same_bytes(state, make_state())
    return dcp_driver.plans_locally(planner, make_reader(root))

out["first"] = save("first")
out["cached"] = save("cached")  # DCP's plan cache: unusable plans, the cached global plan
out["local"] = load("cached", SafeLoadPlanner())
out["exchange"] = load("first", Exchanging())

encode, sender = dcp_driver.encode, wire._encode
evil = f"cos\nsystem\n(S'touch {marker}'\ntR.".encode()  # runs `touch` when unpickled
planted = {
    "unknown": lambda: setattr(dcp_driver, "encode", lambda v, d=0: ["posix.system", "touch"]),
    "pickle": lambda: setattr(wire, "_encode", lambda v: evil),
    "oversized": lambda: setattr(wire, "MAX_WIRE", 1024),
    "nested": lambda: setattr(wire, "_encode", lambda v: b"[" * 100000),
}
for name, plant in planted.items():
    if rank == 1 or name == "oversized":
        plant()
    out[name] = save(name, key=name)
    dcp_driver.encode, wire._encode, wire.MAX_WIRE = encode, sender, 8 << 20
out["after"] = save("after")  # the group is still in step
dist.barrier()
print(json.dumps(out), flush=True)
os._exit(0)  # not gloo's teardown: it aborts a rank whose peer left first
"""


def _run_ranks(tmp_path: Path) -> list[dict[str, Any]]:
    argv = [str(tmp_path / "store"), str(tmp_path / "ckpt"), str(tmp_path / "pwned")]
    return run_ranks(WORKER, *argv, timeout=150)


@pytest.mark.slow
def test_two_gloo_ranks_save_and_load_through_the_driver_and_refuse_hostile_plans(
    tmp_path: Path,
) -> None:
    results = _run_ranks(tmp_path)
    for rank, got in enumerate(results):
        for name in ("first", "cached", "after"):
            assert isinstance(got[name], dict), (rank, name, got[name])
            assert got[name]["metadata"] is (rank == 0)  # the metadata stays on rank 0
        assert got["local"] is True and got["exchange"] is False
    files = [set(got["first"]["files"]) for got in results]
    assert files == [{"__0_0.distcp", ".metadata"}, {"__1_0.distcp"}]  # each rank a share
    assert (tmp_path / "ckpt" / "first" / "__1_0.distcp").stat().st_size > 0
    assert not (tmp_path / "pwned").exists()  # nothing a peer sent ran
    for name, why in [
        ("unknown", "The checkpoint planning message from rank 1 names the type 'posix.system'"),
        ("pickle", "Rank 1 sent a checkpoint message that is no JSON"),
        ("oversized", "announced a checkpoint message of"),
        ("nested", "too deeply|recursion depth"),  # ours, or wire's
    ]:
        errors = {got[name] for got in results}
        assert len(errors) == 1, errors  # the same error on both ranks
        error = errors.pop()
        assert any(part in error for part in why.split("|")), (name, error)
    # torch's own reader and dcp.load, without anything of ours imported, read those files
    loaded = run_without_elastic(
        "import json, torch, torch.distributed.checkpoint as dcp\n"
        "from torch.distributed.checkpoint import FileSystemReader\n"
        "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
        f"root = {str(tmp_path / 'ckpt')!r}\n"
        "state = {'model': {'conv.weight': torch.zeros(16, 3, 3, 3), 'fc.bias': "
        "torch.zeros(10, dtype=torch.bfloat16)}}\n"
        "dcp.load(state, storage_reader=FileSystemReader(root + '/cached'), no_dist=True)\n"
        "dcp_to_torch_save(root + '/first', root + '/whole.pt')\n"
        "whole = torch.load(root + '/whole.pt', weights_only=True)\n"
        "print(json.dumps({'w': state['model']['conv.weight'].sum().item(),\n"
        "    'b': state['model']['fc.bias'].float().sum().item(), 'train': whole['train']}))\n",
        tmp_path,
    )
    want = make_state()["model"]
    got = json.loads(loaded.splitlines()[-1])
    assert got["w"] == pytest.approx(want["conv.weight"].sum().item(), rel=1e-6)
    assert got["b"] == pytest.approx(want["fc.bias"].float().sum().item(), rel=1e-6)
    assert got["train"] == make_state()["train"]
