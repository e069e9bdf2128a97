"""The per-step training snapshot in node-local shared memory, double-buffered.

Each local rank owns two files, ``snap-<run>-r<local rank>-{a,b}``, in its agent's private
directory ``<dir>/elastic-<uid>/<agent pid>/`` (``<dir>`` is ``/dev/shm`` by default; only this
uid may enter it, see :mod:`elastic.node.nodelocal`): no other local user can plant a snapshot to
resume from, link a buffer to a file of theirs, or read one. The files outlive the worker: a
restarted worker of the same agent finds them; the agent removes its directory when it exits,
and an agent that starts removes those of agents that are gone (:func:`remove_orphans`). Under
plain ``torchrun`` (whose agent removes nothing) the worker that creates the directory starts
a small process that removes it once that agent exits, whatever the way it ends.

Both buffers are allocated in full (``posix_fallocate``) when the run starts, for the state as
it is then, and again whenever it grows, so a full ``/dev/shm`` is one sentence
(:class:`~elastic.errors.RecoveryError`) before the first step, never a ``SIGBUS`` while
copying. A reader checks every header and the metadata (:func:`elastic.worker.codec.check`)
before it trusts a buffer: a corrupt newest buffer is skipped for the older one.

A file is a 4 KiB header, the JSON metadata (:mod:`elastic.worker.codec`), then the
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
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from elastic import env
from elastic.errors import RecoveryError
from elastic.node import nodelocal, procs
from elastic.worker.codec import MAX_META, check, encode_meta, flatten, layout, view

logger = logging.getLogger(__name__)

DEFAULT_DIR = "/dev/shm"
MAGIC = b"ELSNAP01"
_HEADER = struct.Struct("<8sQqqQQQ")  # magic, seq, step, round, meta_len, data_len, data_off
HEADER_BYTES = 4096
_GROW = 1 << 20
_LEGACY = re.compile(r"^elastic-(?P<run>.+)-p(?P<pid>\d+)-r(?P<rank>\d+)-(?P<buf>[ab])$")
_NAME = re.compile(r"^snap-.+-r\d+-[ab]$")
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


def snapshot_name(run_id: str, local_rank: int, buf: str) -> str:
    return f"snap-{safe_run_id(run_id)}-r{local_rank}-{buf}"


def snapshot_path(directory: str, run_id: str, owner: int, local_rank: int, buf: str) -> Path:
    """Where buffer ``buf`` lives: agent ``owner``'s private directory (created if missing)."""
    return nodelocal.directory(owner, directory) / snapshot_name(run_id, local_rank, buf)


def owner_pid() -> int:
    """The agent whose node holds this worker's snapshots: ``$ELASTIC_SNAPSHOT_OWNER`` (set
    by ``elastic-agent``), else the parent (torchrun's agent), else this process."""
    raw = os.environ.get(env.SNAPSHOT_OWNER, "")
    if raw.isdigit():
        return int(raw)
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return os.getppid()
    return os.getpid()


def remove_owned(owner: int, directory: str = DEFAULT_DIR) -> list[Path]:
    """Remove every snapshot file of agent ``owner`` (the agent removes its whole directory
    when it exits: :func:`elastic.node.nodelocal.remove_owned`)."""
    folder = nodelocal.find(owner, directory)
    removed: list[Path] = []
    if folder is None:
        return removed
    with contextlib.suppress(OSError):
        for name in os.listdir(folder):
            if _NAME.match(name):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(folder / name)
                    removed.append(folder / name)
    return removed


def remove_orphans(directory: str = DEFAULT_DIR) -> list[Path]:
    """Remove the node-local files of agents that are no longer running: their directories,
    and snapshot files of this uid under the flat names of earlier versions. Never raises:
    what it cannot or should not remove is logged once and left."""
    removed = nodelocal.remove_orphans(directory)
    removed += nodelocal.remove_stale(directory, _LEGACY, lambda pid: not procs.alive(pid))
    return removed


def _refused(exc: OSError, where: str) -> RecoveryError:
    """A node-local path we may not use, as one sentence."""
    if exc.strerror is None:  # elastic.node.nodelocal's own sentence
        return RecoveryError(str(exc))
    return RecoveryError(
        f"Cannot keep snapshots in {where}: {exc.strerror}; give the run a directory this "
        "user can write (snapshot_dir)."
    )


_REAPER = (
    "import os, select, shutil, sys\n"
    "try:\n"
    "    fd = os.pidfd_open(int(sys.argv[1]))\n"
    "except OSError:\n"
    "    sys.exit()\n"
    "select.select([fd], [], [])\n"
    "shutil.rmtree(sys.argv[2], ignore_errors=True)\n"
)


def _reap_after(owner: int, folder: Path) -> None:
    """Remove ``folder`` once process ``owner`` (plain torchrun's agent) exits: a small
    process of its own session waits on its pidfd (no pid reuse can fool it)."""
    try:
        subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _REAPER, str(owner), str(folder)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            close_fds=True,
            start_new_session=True,
            cwd="/",
        )
    except OSError as exc:  # the next elastic-agent on this node removes them instead
        logger.warning("Cannot start the cleanup of %s after torchrun exits: %s", folder, exc)


def _torchrun_owner(owner: int) -> bool:
    """Whether ``owner`` is plain torchrun's agent (ours says so in the environment)."""
    return not os.environ.get(env.SNAPSHOT_OWNER) and owner == os.getppid() and owner != os.getpid()


def _allocate(fd: int, size: int) -> None:
    """Back the first ``size`` bytes of ``fd`` with memory now (tmpfs: ENOSPC here, not a
    SIGBUS at the first write into a hole)."""
    if os.fstat(fd).st_size < size:
        os.posix_fallocate(fd, 0, size)


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
        try:
            fd = nodelocal.open_file(self.path, create=create)
        except FileNotFoundError:
            return False
        except PermissionError as exc:  # a symlink, another user's file: never used
            raise _refused(exc, str(self.path.parent)) from exc
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                if not create:
                    return False
                _allocate(fd, HEADER_BYTES)
                size = HEADER_BYTES
            self._map(fd, size)
        finally:
            os.close(fd)
        return True

    def _map(self, fd: int, size: int) -> None:
        self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.u8 = torch.frombuffer(self._mm, dtype=torch.uint8)

    def ensure(self, size: int) -> None:
        """Grow the file to hold ``size`` bytes, allocated in full.

        Raises:
            OSError: no room for it (ENOSPC); the file keeps its old size and content.
        """
        if size <= self.size:
            return
        size = (size + size // 4 + _GROW - 1) // _GROW * _GROW
        try:
            fd = nodelocal.open_file(self.path)
        except PermissionError as exc:
            raise _refused(exc, str(self.path.parent)) from exc
        try:
            _allocate(fd, size)
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

    def problem(self, head: Header) -> str | None:
        """Why the complete snapshot ``head`` cannot be used (its header or metadata is
        corrupt), or None when it can."""
        if not 0 < head.meta_len <= MAX_META:
            return f"its metadata length {head.meta_len} is out of range"
        if head.data_off < HEADER_BYTES + head.meta_len or head.data_off % 4096:
            return f"its data offset {head.data_off} overlaps the metadata or is unaligned"
        if head.data_off + head.data_len > self.size:
            return f"it claims {head.data_off + head.data_len} bytes of a {self.size}-byte file"
        assert self._mm is not None
        try:
            check(bytes(self._mm[HEADER_BYTES : HEADER_BYTES + head.meta_len]), head.data_len)
        except RecoveryError as exc:
            return str(exc)
        return None

    def read(self) -> tuple[Header, bytes, torch.Tensor] | None:
        """The complete snapshot (header, metadata, data as a uint8 view), or None (none,
        or its header is out of range)."""
        head = self.header()
        if head is None or not head.complete:
            return None
        if not 0 < head.meta_len <= MAX_META or head.data_off < HEADER_BYTES + head.meta_len:
            return None
        if head.data_off + head.data_len > self.size:
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
    """The two buffers of one local rank of one run on this node.

    Raises:
        RecoveryError: no private directory can be had under ``directory`` (one sentence).
    """

    def __init__(
        self,
        run_id: str,
        local_rank: int,
        owner: int | None = None,
        directory: str = DEFAULT_DIR,
    ) -> None:
        self.owner = owner if owner is not None else owner_pid()
        try:
            self.folder, made = nodelocal.ensure(self.owner, directory)
        except OSError as exc:
            raise _refused(exc, directory) from exc
        if made and _torchrun_owner(self.owner):
            _reap_after(self.owner, self.folder)
        self.files = {
            b: SnapshotFile(self.folder / snapshot_name(run_id, local_rank, b)) for b in BUFFERS
        }
        self._newest: str | None = None
        self._judged: dict[str, tuple[Header, str | None]] = {}

    def _usable(self, name: str, head: Header) -> bool:
        """Whether buffer ``name``'s complete snapshot ``head`` passes its checks (once per
        header); a corrupt one is logged once and skipped."""
        judged = self._judged.get(name)
        if judged is None or judged[0] != head:
            judged = (head, self.files[name].problem(head))
            self._judged[name] = judged
            if judged[1] is not None:
                logger.warning(
                    "Ignoring the corrupt snapshot %s of step %d: %s",
                    self.files[name].path,
                    head.step,
                    judged[1],
                )
        return judged[1] is None

    def newest(self) -> tuple[str, Header] | None:
        """The buffer holding the newest usable snapshot and its header, or None."""
        best: tuple[str, Header] | None = None
        for name, f in self.files.items():
            if not f.open(create=False):
                continue
            head = f.header()
            if head is None or not head.complete:
                if head is not None:
                    logger.warning("Ignoring the torn snapshot %s (seq %d).", f.path, head.seq)
                continue
            if not self._usable(name, head):
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
        """The newest usable snapshot: header, metadata, data (a view: copy it out)."""
        found = self.newest()
        return self.files[found[0]].read() if found else None

    def target(self) -> SnapshotFile:
        """The buffer to write next: never the one holding the newest usable snapshot."""
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
        if self.owner == os.getpid():  # no agent: the directory was this process's own
            with contextlib.suppress(OSError):
                os.rmdir(self.folder)

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
        data_off = _data_offset(len(meta))
        try:
            f = self.store.target()
            f.ensure(data_off + size)
        except OSError as exc:  # no room: the older buffers stay as they are
            raise self._failed(exc) from exc
        f.begin()
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

    def reserve(self, state: Any) -> None:
        """Allocate both buffers for a snapshot of ``state`` now (before the first step).

        Raises:
            RecoveryError: no room for them, in one sentence (Docker's /dev/shm is 64 MB).
        """
        tree, tensors = flatten(state)
        slots, size = layout(tensors)
        need = _data_offset(len(encode_meta(tree, slots))) + size
        try:
            for f in self.store.files.values():
                f.open(create=True)
                f.ensure(need)
        except OSError as exc:
            raise self._failed(exc) from exc

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
        if isinstance(error, RecoveryError):
            return error
        why = error.strerror if isinstance(error, OSError) and error.strerror else error
        failure = RecoveryError(
            f"The snapshot copy into {self.store.folder} failed: {why}. "
            "Make room in that directory (Docker: raise shm_size) or lower snapshot_every."
        )
        failure.__cause__ = error
        return failure


def _data_offset(meta_len: int) -> int:
    return (HEADER_BYTES + meta_len + 4095) // 4096 * 4096


def _overlap_helps() -> bool:
    """Copy in a background thread unless ``$ELASTIC_SNAPSHOT_BACKGROUND=0``.

    On a CPU box the memory bandwidth is the limit: a background copy and a copy on the
    training thread cost about the same share of a step (``bench/throughput.py
    --snapshot``; figures in docs/benchmarks.md). Overlap pays where a core or a DMA
    engine is idle (GPUs, many-core hosts).
    """
    return os.environ.get(env.SNAPSHOT_BACKGROUND, "1").strip() != "0"


__all__ = [
    "DEFAULT_DIR",
    "Header",
    "SnapshotFile",
    "SnapshotStore",
    "Snapshotter",
    "owner_pid",
    "remove_orphans",
    "remove_owned",
    "snapshot_name",
    "snapshot_path",
]
