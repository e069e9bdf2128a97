"""The per-step training snapshot in node-local shared memory, double-buffered.

Each local rank owns two files, ``<dir>/elastic-<run>-p<agent pid>-r<local rank>-{a,b}``
(``<dir>`` is ``/dev/shm`` by default). They outlive the worker: a restarted worker of
the same agent finds them; the agent removes them when it exits, and an agent that
starts removes the files of agents that are gone (:func:`remove_orphans`).

A file is a 4 KiB header, the JSON metadata (:mod:`elastic.recovery.codec`), then the
raw tensor bytes. The header holds a magic, a sequence counter, the step, the
rendezvous round and the sizes. A write makes the counter odd, copies, fills in the
step and sizes, then makes the counter even: a reader ignores a file whose counter is
odd (the writer died mid-copy: a torn buffer) and the writer always writes the file
that does *not* hold the newest complete snapshot, so one complete snapshot survives
any kill.

:class:`Snapshotter` takes a snapshot after a step: tensors that change before the
next optimizer step (BatchNorm buffers, RNG states) are copied at once, the rest
(parameters, optimizer state) in a background thread; :meth:`Snapshotter.wait` must
run before the next ``optimizer.step()`` (the session registers a step pre-hook). On
CUDA the device-to-host copies run on a side stream into pinned buffers.
``$ELASTIC_SNAPSHOT_BACKGROUND=0`` copies on the training thread instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import queue
import re
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from elastic import env, procs
from elastic.errors import RecoveryError
from elastic.recovery.codec import encode_meta, flatten, layout, view

logger = logging.getLogger(__name__)

DEFAULT_DIR = "/dev/shm"
OWNER_ENV = env.SNAPSHOT_OWNER  # kept for importers; the name lives in elastic.env
BACKGROUND_ENV = env.SNAPSHOT_BACKGROUND
MAGIC = b"ELSNAP01"
_HEADER = struct.Struct("<8sQqqQQQ")  # magic, seq, step, round, meta_len, data_len, data_off
HEADER_BYTES = 4096
_GROW = 1 << 20
_NAME = re.compile(r"^elastic-(?P<run>.+)-p(?P<pid>\d+)-r(?P<rank>\d+)-(?P<buf>[ab])$")
BUFFERS = ("a", "b")


@dataclass(frozen=True)
class Header:
    """A snapshot file's header."""

    seq: int
    step: int
    round: int
    meta_len: int
    data_len: int
    data_off: int

    @property
    def complete(self) -> bool:
        return self.seq > 0 and self.seq % 2 == 0


def safe_run_id(run_id: str) -> str:
    """``run_id`` with every character a file name may not hold replaced by ``_``."""
    return re.sub(r"[^A-Za-z0-9_.]", "_", run_id) or "run"


def snapshot_path(directory: str, run_id: str, owner: int, local_rank: int, buf: str) -> Path:
    return Path(directory) / f"elastic-{safe_run_id(run_id)}-p{owner}-r{local_rank}-{buf}"


def owner_pid() -> int:
    """The agent whose node holds this worker's snapshots: ``$ELASTIC_SNAPSHOT_OWNER`` (set
    by ``elastic-agent``), else the parent (torchrun's agent), else this process."""
    raw = os.environ.get(OWNER_ENV, "")
    if raw.isdigit():
        return int(raw)
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return os.getppid()
    return os.getpid()


def remove_owned(owner: int, directory: str = DEFAULT_DIR) -> list[Path]:
    """Remove every snapshot file of agent ``owner`` (the agent calls it when it exits)."""
    return _remove(directory, lambda pid: pid == owner)


def remove_orphans(directory: str = DEFAULT_DIR) -> list[Path]:
    """Remove the snapshot files whose owning agent is no longer running."""
    return _remove(directory, lambda pid: not procs.alive(pid))


def _remove(directory: str, doomed: Any) -> list[Path]:
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    for name in names:
        match = _NAME.match(name)
        if match and doomed(int(match["pid"])):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))
                removed.append(Path(directory) / name)
    if removed:
        logger.info("Removed %d snapshot files from %s.", len(removed), directory)
    return removed


class SnapshotFile:
    """One buffer: a shared-memory file mapped into this process."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._mm: mmap.mmap | None = None
        self.u8 = torch.empty(0, dtype=torch.uint8)

    @property
    def size(self) -> int:
        return self._mm.size() if self._mm is not None else 0

    def open(self, create: bool) -> bool:
        """Map the file (creating it when ``create``); False if it does not exist."""
        if self._mm is not None:
            return True
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        try:
            fd = os.open(self.path, flags, 0o600)
        except FileNotFoundError:
            return False
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                if not create:
                    return False
                os.ftruncate(fd, HEADER_BYTES)
                size = HEADER_BYTES
            self._map(fd, size)
        finally:
            os.close(fd)
        return True

    def _map(self, fd: int, size: int) -> None:
        self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.u8 = torch.frombuffer(self._mm, dtype=torch.uint8)

    def ensure(self, size: int) -> None:
        """Grow the file to hold ``size`` bytes (the header's seq is already odd)."""
        if size <= self.size:
            return
        size = (size + size // 4 + _GROW - 1) // _GROW * _GROW
        fd = os.open(self.path, os.O_RDWR)
        try:
            os.ftruncate(fd, size)
            self.u8 = torch.empty(0, dtype=torch.uint8)  # drop the old mapping's views
            self._mm = None
            self._map(fd, size)
        finally:
            os.close(fd)

    def header(self) -> Header | None:
        """The header, or None when the file holds no snapshot (never written, bad magic)."""
        if self._mm is None:
            return None
        magic, *fields = _HEADER.unpack_from(self._mm, 0)
        return Header(*fields) if magic == MAGIC else None

    def begin(self) -> None:
        """Mark the buffer as being written (odd seq): a reader will never use it now."""
        assert self._mm is not None
        head = self.header()
        seq = head.seq if head is not None else 0
        seq += 1 if seq % 2 == 0 else 2
        _HEADER.pack_into(self._mm, 0, MAGIC, seq, -1, -1, 0, 0, 0)

    def commit(self, step: int, round_: int, meta_len: int, data_len: int, data_off: int) -> None:
        """Fill in the header and make the seq even: the snapshot is complete."""
        assert self._mm is not None
        head = self.header()
        assert head is not None and head.seq % 2 == 1
        _HEADER.pack_into(self._mm, 0, MAGIC, head.seq, step, round_, meta_len, data_len, data_off)
        struct.pack_into("<Q", self._mm, 8, head.seq + 1)

    def write_meta(self, meta: bytes) -> None:
        assert self._mm is not None
        self._mm[HEADER_BYTES : HEADER_BYTES + len(meta)] = meta

    def read(self) -> tuple[Header, bytes, torch.Tensor] | None:
        """The complete snapshot (header, metadata, data as a uint8 view), or None."""
        head = self.header()
        if head is None or not head.complete:
            return None
        if head.data_off + head.data_len > self.size or HEADER_BYTES + head.meta_len > self.size:
            return None
        assert self._mm is not None
        meta = bytes(self._mm[HEADER_BYTES : HEADER_BYTES + head.meta_len])
        return head, meta, self.u8[head.data_off : head.data_off + head.data_len]

    def still(self, head: Header) -> bool:
        """Whether the file still holds the snapshot ``head`` described."""
        return self.header() == head

    def close(self) -> None:
        self.u8 = torch.empty(0, dtype=torch.uint8)
        if self._mm is not None:
            with contextlib.suppress(BufferError):
                self._mm.close()
        self._mm = None


class SnapshotStore:
    """The two buffers of one local rank of one run on this node."""

    def __init__(
        self,
        run_id: str,
        local_rank: int,
        owner: int | None = None,
        directory: str = DEFAULT_DIR,
    ) -> None:
        self.owner = owner if owner is not None else owner_pid()
        self.files = {
            b: SnapshotFile(snapshot_path(directory, run_id, self.owner, local_rank, b))
            for b in BUFFERS
        }
        self._newest: str | None = None

    def newest(self) -> tuple[str, Header] | None:
        """The buffer holding the newest complete snapshot and its header, or None."""
        best: tuple[str, Header] | None = None
        for name, f in self.files.items():
            if not f.open(create=False):
                continue
            head = f.header()
            if head is None or not head.complete:
                if head is not None:
                    logger.warning("Ignoring the torn snapshot %s (seq %d).", f.path, head.seq)
                continue
            if best is None or (head.step, head.round, head.seq) > (
                best[1].step,
                best[1].round,
                best[1].seq,
            ):
                best = (name, head)
        self._newest = best[0] if best else None
        return best

    def read(self) -> tuple[Header, bytes, torch.Tensor] | None:
        """The newest complete snapshot: header, metadata, data (a view: copy it out)."""
        found = self.newest()
        return self.files[found[0]].read() if found else None

    def target(self) -> SnapshotFile:
        """The buffer to write next: never the one holding the newest complete snapshot."""
        if self._newest is None:
            self.newest()
        name = "b" if self._newest == "a" else "a"
        f = self.files[name]
        f.open(create=True)
        return f

    def committed(self, f: SnapshotFile) -> None:
        self._newest = next(n for n, g in self.files.items() if g is f)

    def remove(self) -> None:
        for f in self.files.values():
            f.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f.path)

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """One plain ``memmove`` (no GIL) for contiguous CPU tensors: ``Tensor.copy_`` from this
    thread would run an OpenMP parallel region next to the training thread's, and their
    spinning threads oversubscribe the cores (measured: 4x slower, training 30 % slower)."""
    if src.device.type == "cpu" and src.is_contiguous() and dst.is_contiguous():
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size())
    else:
        dst.copy_(src)


class Snapshotter:
    """Writes snapshots into a :class:`SnapshotStore`, the bulk of each in the background."""

    def __init__(self, store: SnapshotStore, background: bool | None = None) -> None:
        self.store = store
        self.background = _overlap_helps() if background is None else background
        self._thread: threading.Thread | None = None
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending: threading.Event | None = None
        self._error: BaseException | None = None
        self._pinned: dict[int, torch.Tensor] = {}
        self._side: Any = None
        self.stats = {"count": 0, "sync_s": 0.0, "copy_s": 0.0, "wait_s": 0.0, "bytes": 0}
        self.last_step = -1

    def take(self, step: int, round_: int, state: Any, stable: set[int]) -> None:
        """Start a snapshot of ``state`` at ``step``.

        ``stable`` holds the ``data_ptr()`` of tensors that only ``optimizer.step()``
        changes: they are copied in the background; the rest at once.
        """
        self.wait()
        started = time.perf_counter()
        tree, tensors = flatten(state)
        slots, size = layout(tensors)
        meta = encode_meta(tree, slots)
        data_off = (HEADER_BYTES + len(meta) + 4095) // 4096 * 4096
        f = self.store.target()
        f.begin()
        f.ensure(data_off + size)
        f.write_meta(meta)
        data = f.u8[data_off : data_off + size]
        later: list[tuple[torch.Tensor, torch.Tensor]] = []
        events: list[Any] = []
        for i, (t, slot) in enumerate(zip(tensors, slots, strict=True)):
            if not slot.nbytes:
                continue
            dst = view(data, slot)
            if t.is_cuda:
                later.append((dst, self._to_host(i, t, t.data_ptr() in stable, events)))
            elif t.data_ptr() in stable:
                later.append((dst, t))
            else:
                dst.copy_(t)
        self.stats["sync_s"] += time.perf_counter() - started
        self.stats["bytes"] = size
        job = (f, later, events, step, round_, len(meta), size, data_off)
        if not self.background:
            self._finish(*job)
            error, self._error = self._error, None
            if error is not None:
                raise self._failed(error)
            return
        done = threading.Event()
        self._jobs.put((done, job))
        self._pending = done
        if self._thread is None:  # one long-lived copier: no thread start per step
            self._thread = threading.Thread(target=self._loop, name="elastic-snapshot", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            done, args = self._jobs.get()
            try:
                self._finish(*args)
            finally:
                done.set()

    def _to_host(self, i: int, t: torch.Tensor, stable: bool, events: list[Any]) -> torch.Tensor:
        """Issue a device-to-host copy into a pinned buffer; the caller waits on ``events``."""
        pinned = self._pinned.get(i)
        if pinned is None or pinned.shape != t.shape or pinned.dtype != t.dtype:
            pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._pinned[i] = pinned
        if not stable:  # e.g. BatchNorm buffers: in stream order, before the next forward
            pinned.copy_(t, non_blocking=True)
        else:
            if self._side is None:
                self._side = torch.cuda.Stream(device=t.device)
            self._side.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(self._side):
                t.record_stream(self._side)
                pinned.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record(self._side if stable else torch.cuda.current_stream(t.device))
        events.append(done)
        return pinned

    def _finish(
        self,
        f: SnapshotFile,
        later: list[tuple[torch.Tensor, torch.Tensor]],
        events: list[Any],
        step: int,
        round_: int,
        meta_len: int,
        size: int,
        data_off: int,
    ) -> None:
        started = time.perf_counter()
        try:
            for event in events:
                event.synchronize()
            for dst, src in later:
                _copy(dst, src)
            f.commit(step, round_, meta_len, size, data_off)
            self.store.committed(f)
            self.last_step = step
            self.stats["count"] += 1
        except BaseException as exc:  # handed to the training thread by wait()
            self._error = exc
        self.stats["copy_s"] += time.perf_counter() - started

    def wait(self) -> None:
        """Wait for the snapshot in flight (before the next optimizer step, before exit).

        Raises:
            RecoveryError: the background copy failed.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        started = time.perf_counter()
        pending.wait()
        self.stats["wait_s"] += time.perf_counter() - started
        error, self._error = self._error, None
        if error is not None:
            raise self._failed(error)

    def _failed(self, error: BaseException) -> RecoveryError:
        failure = RecoveryError(
            f"The snapshot copy into {self.store.files['a'].path.parent} failed: {error}. "
            "Make room in that directory (Docker: raise shm_size) or lower snapshot_every."
        )
        failure.__cause__ = error
        return failure


def _overlap_helps() -> bool:
    """Copy in a background thread unless ``$ELASTIC_SNAPSHOT_BACKGROUND=0``.

    Measured on a 2-core CPU box (bench/throughput.py --snapshot, ResNet-18, 89.5 MB):
    the memory bandwidth is the limit (~2.8 GB/s, 30-40 ms a copy); a background copy
    and a copy on the training thread both cost about that much of each ~100 ms step,
    with run-to-run spread larger than their difference. Overlap pays where a core or a
    DMA engine is idle (GPUs, many-core hosts).
    """
    return os.environ.get(BACKGROUND_ENV, "1").strip() != "0"


__all__ = [
    "DEFAULT_DIR",
    "OWNER_ENV",
    "Header",
    "SnapshotFile",
    "SnapshotStore",
    "Snapshotter",
    "owner_pid",
    "remove_orphans",
    "remove_owned",
    "snapshot_path",
]
