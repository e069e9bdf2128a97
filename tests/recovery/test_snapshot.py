"""The shared-memory snapshot: round trip, torn buffers, double buffering, cleanup."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elastic.worker.codec import RecoveryError, decode, from_json, to_json
from elastic.worker.sampler import DistributedSampler
from elastic.worker.snapshot import (
    SnapshotStore,
    Snapshotter,
    remove_orphans,
    remove_owned,
    snapshot_path,
)


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(8, 6)).square().mean().backward()
    opt.step()
    return model, opt


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "train": {"step": step, "cursor": (1, 48)},
        "blob": b"\x00\x01",
        "empty": torch.empty(0),
    }


def _stable(opt: torch.optim.Optimizer) -> set[int]:
    ptrs = {p.data_ptr() for g in opt.param_groups for p in g["params"]}
    for st in opt.state.values():
        ptrs.update(v.data_ptr() for v in st.values() if isinstance(v, torch.Tensor))
    return ptrs


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))  # type: ignore[arg-type]
    return a == b


@pytest.mark.parametrize("background", [True, False])
def test_round_trip_is_bit_identical(tmp_path: Path, background: bool) -> None:
    model, opt = _trained()
    store = SnapshotStore("run-1", 0, owner=os.getpid(), directory=str(tmp_path))
    snaps = Snapshotter(store, background=background)
    state = _state(model, opt, 7)
    snaps.take(7, 3, state, _stable(opt))
    snaps.wait()
    head, meta, data = store.read()
    assert (head.step, head.round) == (7, 3)
    assert _equal(decode(meta, data), state)
    assert isinstance(decode(meta, data)["optim"]["state"], dict)
    assert list(decode(meta, data)["optim"]["state"]) == [0, 1, 2, 3]  # int keys survive


@pytest.mark.integration
def test_a_reader_in_another_process_sees_it(tmp_path: Path) -> None:
    model, opt = _trained()
    snaps = Snapshotter(SnapshotStore("run-1", 2, owner=4242, directory=str(tmp_path)))
    snaps.take(5, 0, _state(model, opt, 5), _stable(opt))
    snaps.wait()
    code = (
        "from elastic.worker.snapshot import SnapshotStore\n"
        f"s = SnapshotStore('run-1', 2, owner=4242, directory={str(tmp_path)!r})\n"
        "print(s.read()[0].step)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "5"


def test_writes_alternate_and_never_touch_the_newest(tmp_path: Path) -> None:
    model, opt = _trained()
    store = SnapshotStore("run-1", 0, owner=1, directory=str(tmp_path))
    snaps = Snapshotter(store)
    written = []
    for step in (1, 2, 3):
        snaps.take(step, 0, _state(model, opt, step), _stable(opt))
        snaps.wait()
        written.append(store.newest()[0])
    assert written == ["a", "b", "a"]


def test_a_torn_buffer_is_never_loaded(tmp_path: Path) -> None:
    """A worker killed mid-copy leaves an odd seq: the reader takes the other buffer."""
    model, opt = _trained()
    store = SnapshotStore("run-1", 0, owner=1, directory=str(tmp_path))
    snaps = Snapshotter(store)
    snaps.take(1, 0, _state(model, opt, 1), _stable(opt))
    snaps.wait()
    snaps.take(2, 0, _state(model, opt, 2), _stable(opt))
    snaps.wait()
    newest = snapshot_path(str(tmp_path), "run-1", 1, 0, "b")
    with open(newest, "r+b") as f:  # the kill: seq odd, step 2's bytes half overwritten
        f.seek(8)
        (seq,) = struct.unpack("<Q", f.read(8))
        f.seek(8)
        f.write(struct.pack("<Q", seq + 1))
        f.seek(9000)
        f.write(b"\xff" * 64)
    fresh = SnapshotStore("run-1", 0, owner=1, directory=str(tmp_path))
    head, meta, data = fresh.read()
    assert head.step == 1
    assert decode(meta, data)["train"]["step"] == 1
    # and the next write goes into the torn buffer, keeping step 1 intact
    assert fresh.target().path == newest
    writer = Snapshotter(fresh)
    writer.take(3, 0, _state(model, opt, 3), _stable(opt))
    writer.wait()
    assert fresh.newest()[0] == "b"
    assert fresh.files["a"].header().step == 1


@pytest.mark.integration
def test_kill_mid_copy_in_a_real_process_leaves_the_older_one(tmp_path: Path) -> None:
    """A writer process killed while its background copy runs (seq stays odd)."""
    code = f"""
import os, torch
import elastic.worker.snapshot as S
store = S.SnapshotStore("run-k", 0, owner=7, directory={str(tmp_path)!r})
snaps = S.Snapshotter(store, background=True)
big = torch.ones(4_000_000)
snaps.take(1, 0, {{"w": big}}, set()); snaps.wait()
copy = S._copy
def dying(dst, src):  # the kill, half-way through the background copy
    copy(dst[: dst.numel() // 2], src[: src.numel() // 2])
    os._exit(9)
S._copy = dying
twice = big * 2
snaps.take(2, 0, {{"w": twice}}, {{twice.data_ptr()}})
snaps.wait()
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 9, proc.stderr
    head, meta, data = SnapshotStore("run-k", 0, owner=7, directory=str(tmp_path)).read()
    assert head.step == 1
    assert torch.equal(decode(meta, data)["w"], torch.ones(4_000_000))


def test_a_state_that_grows_remaps_the_file(tmp_path: Path) -> None:
    store = SnapshotStore("run-1", 0, owner=1, directory=str(tmp_path))
    snaps = Snapshotter(store)
    for step, n in enumerate((10, 3_000_000, 10, 3_000_000), 1):
        snaps.take(step, 0, {"x": torch.arange(n, dtype=torch.float32)}, set())
        snaps.wait()
        head, meta, data = store.read()
        assert head.step == step and decode(meta, data)["x"].numel() == n


def test_buffers_are_allocated_in_full_before_the_first_snapshot(tmp_path: Path) -> None:
    """Allocated, not sparse: a full /dev/shm fails here, never as a SIGBUS mid-copy."""
    store = SnapshotStore("run-1", 0, owner=1, directory=str(tmp_path))
    Snapshotter(store).reserve({"w": torch.zeros(1_000_000)})
    for f in store.files.values():
        st = os.stat(f.path)
        assert st.st_size >= 4_000_000 + 4096 and st.st_blocks * 512 >= st.st_size
    assert store.newest() is None  # allocated, but nothing to resume from


def test_unsupported_values_are_refused_with_a_sentence() -> None:
    with pytest.raises(RecoveryError, match="Cannot snapshot a value of type object"):
        to_json({"x": object()})


def test_json_codec_keeps_rng_states() -> None:
    import random

    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    back = from_json(to_json(state))
    assert torch.equal(back["torch"], state["torch"])
    assert back["python"][1] == state["python"][1]


@pytest.mark.integration
def test_cleanup_of_owned_and_orphaned_files(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)
    for owner in (os.getpid(), dead_pid, 1):
        for buf in "ab":
            snapshot_path(str(tmp_path), "run-x", owner, 0, buf).write_bytes(b"x")
    legacy = [tmp_path / f"elastic-run_x-p{dead_pid}-r0-{b}" for b in "ab"]
    for path in legacy:  # the flat names of earlier versions
        path.write_bytes(b"x")
    (tmp_path / "unrelated").write_bytes(b"x")
    removed = remove_orphans(str(tmp_path))
    root = tmp_path / f"elastic-{os.geteuid()}"
    assert sorted(removed) == sorted([root / str(dead_pid), *legacy])
    assert len(remove_owned(os.getpid(), str(tmp_path))) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [root.name, "unrelated"]
    assert sorted(p.name for p in (root / "1").iterdir()) == ["snap-run_x-r0-a", "snap-run_x-r0-b"]
    assert not list((root / str(os.getpid())).iterdir())


@pytest.mark.parametrize("world", [1, 2, 3])
def test_sampler_resumes_exactly_at_any_world_size(world: int) -> None:
    """Two steps at world 2, then the rest at ``world``: every sample once."""
    data = list(range(52))  # 52 - 16 consumed = 36: no padding at world 1, 2 or 3
    first = [DistributedSampler(data, num_replicas=2, rank=r, seed=1) for r in range(2)]
    used = []
    for s in first:
        s.set_epoch(3)
        used += list(s)[: 2 * 4]  # two steps of batch 4
    rest = [DistributedSampler(data, num_replicas=world, rank=r, seed=1) for r in range(world)]
    for s in rest:
        s.load_state_dict({"epoch": 3, "consumed": 2 * 4 * 2})
        used += list(s)
        assert len(s) == len(list(s))
    assert sorted(used) == data
