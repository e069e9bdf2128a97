"""Crafted or corrupt snapshot metadata: one RecoveryError sentence, and the older buffer."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic.worker import codec
from elastic.worker.codec import RecoveryError, decode, from_json
from elastic.worker.snapshot import HEADER_BYTES, SnapshotStore
from tests.trust.conftest import worker

DATA = torch.zeros(4096, dtype=torch.uint8)  # a 4 KiB data range


def _meta(tree: Any, slots: list[Any]) -> bytes:
    return json.dumps({"tree": tree, "slots": slots}).encode()


CRAFTED = {
    "a reference past the slots": _meta({"__t": 5}, []),
    "a shape that does not fill its bytes": _meta({"__t": 0}, [[0, 8, "float32", [3]]]),
    "1 GiB from an empty slot": _meta({"__t": 0}, [[0, 0, "float32", [1 << 28]]]),
    "a huge slot past the data": _meta({"__t": 0}, [[0, 1 << 32, "uint8", [1 << 32]]]),
    "a negative offset": _meta({"__t": 0}, [[-8, 8, "float32", [2]]]),
    "an unaligned offset": _meta({"__t": 0}, [[2, 4, "float32", [1]]]),
    "a boolean offset": _meta({"__t": 0}, [[True, 4, "float32", [1]]]),
    "an unknown type": _meta({"__t": 0}, [[0, 4, "float33", [1]]]),
    "a type that is no dtype": _meta({"__t": 0}, [[0, 4, "Tensor", [1]]]),
    "too many dimensions": _meta({"__t": 0}, [[0, 0, "uint8", [0] * 100]]),
    "bad base64": _meta({"__b": "!!not base64!!"}, []),
    "a dict as a key": _meta({"__d": [[{"__d": []}, 1]]}, []),
    "a pair of one": _meta({"__d": [[1]]}, []),
    "an unknown node": _meta({"__x": 1}, []),
    "two kinds in one node": _meta({"__t": 0, "__b": ""}, [[0, 0, "uint8", [0]]]),
    "a bfloat16 numpy array": _meta({"__np": 0}, [[0, 2, "bfloat16", [1]]]),
    "deep JSON": b"[" * 100_000 + b"]" * 100_000,
    "a deep tree": _meta(json.loads("[" * 500 + "]" * 500), []),
    "not JSON": b"\xff\xfe{",
    "not a document": b"[1, 2]",
    "slots that are no list": _meta(None, {"0": 1}),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("meta", CRAFTED.values(), ids=CRAFTED.keys())
def test_crafted_metadata_is_refused_in_one_sentence(meta: bytes) -> None:
    with pytest.raises(RecoveryError) as refused:
        decode(meta, DATA)
    text = str(refused.value)
    assert text.startswith("The snapshot's metadata is corrupt (") or "tensor type" in text
    assert text.endswith("it is not used.") or text.endswith("it is corrupt.")
    assert "\n" not in text and len(text) < 300


def test_metadata_over_the_bound_is_not_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec, "MAX_META", 64)
    with pytest.raises(RecoveryError, match="over the 64 this node reads"):
        decode(_meta([1] * 100, []), DATA)


@pytest.mark.parametrize("text", ["[]", '{"meta": 1, "data": ""}', '{"data": "!!"}', "{"])
def test_a_corrupt_json_state_is_refused_in_one_sentence(text: str) -> None:
    with pytest.raises(RecoveryError, match=r"^The snapshot's metadata is corrupt"):
        from_json(text)


def _newest_file(base: Path, owner: int) -> Path:
    found = SnapshotStore("trust", 0, owner=owner, directory=str(base))
    newest = found.newest()
    assert newest is not None
    path = found.files[newest[0]].path
    found.close()
    return path


@pytest.mark.integration
def test_a_corrupt_newest_buffer_falls_back_to_the_older_one(tmp_path: Path) -> None:
    owner = os.getpid()
    first = worker(tmp_path, 3, owner)
    assert first.returncode == 0, first.stderr[-3000:]
    newest = _newest_file(tmp_path, owner)
    with open(newest, "r+b") as f:  # the header stays complete; its metadata is garbage
        f.seek(HEADER_BYTES)
        f.write(b'{"tree": {"__t": 99}, "slots": []}      ')
    again = worker(tmp_path, 5, owner)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed 2 memory" in again.stdout, again.stdout  # the older buffer: step 2
    assert again.stderr.count(f"Ignoring the corrupt snapshot {newest} of step 3") == 1


@pytest.mark.integration
def test_a_header_out_of_range_falls_back_and_both_corrupt_start_fresh(tmp_path: Path) -> None:
    owner = os.getpid()
    first = worker(tmp_path, 3, owner)
    assert first.returncode == 0, first.stderr[-3000:]
    for buf in "ab":
        path = next(tmp_path.glob(f"elastic-*/{owner}/snap-trust-r0-{buf}"))
        with open(path, "r+b") as f:  # data_len (at 40): a terabyte
            f.seek(40)
            f.write(struct.pack("<Q", 1 << 40))
    again = worker(tmp_path, 2, owner)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed 0 fresh" in again.stdout, again.stdout  # no checkpoint here: fresh
    assert again.stderr.count("Ignoring the corrupt snapshot") == 2, again.stderr
