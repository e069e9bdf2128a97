"""fsspec storage for DCP: the one place that imports torch's private fsspec writer/reader.

torch 2.14 keeps ``FsspecWriter`` and ``FsspecReader`` in the private module
``torch.distributed.checkpoint._fsspec_filesystem``; if it moves, only this
module changes. :class:`HashingWriter` adds two things to torch's writer:

* every byte written is checksummed (zlib CRC-32, about 6x cheaper
  than SHA-256 on this class of CPU and GIL-free) on the way out, so the commit
  marker records checksums without reading the checkpoint back. The checksum
  guards against torn, truncated and bit-flipped files, not against tampering;
  ``.metadata`` (small, and unpickled on load) also gets a SHA-256, which the
  signed commit marker carries and :class:`VerifyingReader` checks before it
  unpickles a byte;
* streams are flushed and (where the stream has a file descriptor) fsynced
  before close. torch issue #144752: fsspec streams have no ``fileno`` on remote
  stores, so torch's own fsync is skipped with a warning there; remote stores
  make data durable on ``close()`` (S3 completes the multipart upload), which
  torch does before ``finish``. Issue #183878 (unflushed writes on remote
  stores): we never report a file as written before its stream was closed, and
  the commit marker is written only after every rank's files were closed.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import secrets
import threading
import warnings
import zlib
from collections.abc import Generator
from contextlib import contextmanager, suppress
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint._fsspec_filesystem import (  # private in torch 2.14
    FsspecReader,
    FsspecWriter,
)
from torch.distributed.checkpoint._traverse import set_element  # private in torch 2.14
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from elastic.errors import CheckpointError

METADATA = ".metadata"


class _HashingStream:
    """A write-only stream proxy that hashes and counts what passes through."""

    def __init__(self, raw: Any, record: dict[str, Any], sha256: bool = False) -> None:
        self._raw = raw
        self._crc = 0
        self._record = record
        self._size = 0
        self._sha = hashlib.sha256() if sha256 else None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._crc = zlib.crc32(view, self._crc)
        if self._sha is not None:
            self._sha.update(view)
        self._size += view.nbytes
        return self._raw.write(data)

    def tell(self) -> int:
        return self._raw.tell()

    def flush(self) -> None:
        self._raw.flush()

    def close(self) -> None:
        self.seal()
        self._raw.close()

    def seal(self) -> None:
        """Record the size and digest of everything written so far."""
        self._record.update(size=self._size, crc32=f"{self._crc:08x}")
        if self._sha is not None:
            self._record["sha256"] = self._sha.hexdigest()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class HashingWriter(FsspecWriter):
    """torch's ``FsspecWriter`` that records a CRC-32 and size per file it writes."""

    def __init__(self, path: str, **kwargs: Any) -> None:
        super().__init__(path, sync_files=True, **kwargs)
        self.written: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        inner = self.fs.create_stream

        @contextmanager
        def create_stream(path: str | os.PathLike[str], mode: str) -> Generator[Any, None, None]:
            if "r" in mode:
                with inner(path, mode) as stream:
                    yield stream
                return
            name = os.path.basename(os.fspath(path)).removesuffix(".tmp")
            record: dict[str, Any] = {}
            with self._lock:
                self.written[name] = record
            with inner(path, mode) as stream, warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="fsync not supported")
                proxy = _HashingStream(stream, record, sha256=name == METADATA)
                yield proxy
                proxy.seal()

        self.fs.create_stream = create_stream  # type: ignore[method-assign]


class VerifyingReader(FsspecReader):
    """torch's fsspec reader that checks ``.metadata`` against its commit record before
    unpickling it, and never falls back to unverified rank-local metadata.

    ``expected=None`` skips the check: only for tools reading a step they trust.
    """

    def __init__(self, path: str, expected: dict[str, Any] | None, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.expected = expected

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError(
                f"The checkpoint {self.path} has no verified global {METADATA}; rank-local "
                "metadata is not trusted."
            )
        path = self._get_metadata_path(None)
        with self.fs.create_stream(path, "rb") as stream:
            data = stream.read()
        problem = metadata_problem(data, self.expected)
        if problem:
            raise CheckpointError(
                f"Refusing to read {path}: {problem}; it is not the file the commit marker "
                "vouches for."
            )
        metadata = pickle.loads(data)  # verified against the (signed) marker above
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def metadata_problem(data: bytes, expected: dict[str, Any] | None) -> str:
    """Why ``data`` is not the ``.metadata`` that ``expected`` (a marker entry) describes."""
    if expected is None:
        return ""
    if len(data) != expected.get("size"):
        return f"size {len(data)} bytes, expected {expected.get('size')}"
    if f"{zlib.crc32(data):08x}" != expected.get("crc32"):
        return "checksum mismatch"
    sha = expected.get("sha256")
    if sha is not None and hashlib.sha256(data).hexdigest() != sha:
        return "SHA-256 mismatch"
    return ""


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor items load with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def make_reader(path: str, expected_metadata: dict[str, Any] | None = None) -> FsspecReader:
    """Return a reader for a DCP directory that verifies ``.metadata`` (against the marker's
    record of it, when given) before unpickling it."""
    return VerifyingReader(path, expected_metadata)


def filesystem(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """Return the fsspec filesystem for ``url`` and the path within it."""
    fs, path = fsspec.core.url_to_fs(url)
    return fs, path.rstrip("/") or path


def join(url: str, *parts: str) -> str:
    """Join URL path segments with ``/`` (fsspec URLs always use forward slashes)."""
    return "/".join([url.rstrip("/"), *(p.strip("/") for p in parts)])


def write_durably(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write a small file and make it durable: fsync where there is a descriptor."""
    with fs.open(path, "wb") as f:
        f.write(data)
        f.flush()
        fileno = getattr(f, "fileno", None)
        if fileno is not None:
            with suppress(OSError, io.UnsupportedOperation, AttributeError):
                os.fsync(fileno())


def write_atomically(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that readers see the old or the new bytes, never a mix.

    Local filesystems: write a temporary file, fsync it, rename it over ``path``,
    fsync the directory. Object stores: one PUT, which is atomic by itself.
    """
    if not isinstance(fs, LocalFileSystem):
        fs.pipe_file(path, data)
        return
    local = fs._strip_protocol(path)
    directory = os.path.dirname(local)
    tmp = os.path.join(directory, f".{os.path.basename(local)}.{secrets.token_hex(6)}.tmp")
    try:
        write_durably(fs, tmp, data)
        os.replace(tmp, local)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_directory(directory)


def fsync_directory(directory: str) -> None:
    """fsync a local directory so a rename in it survives a crash (best effort)."""
    with suppress(OSError):
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def probe_writable(url: str) -> None:
    """Write and delete a small file under ``url``; raise ``OSError`` if that fails."""
    fs, root = filesystem(url)
    fs.makedirs(root, exist_ok=True)
    probe = f"{root}/.probe-{os.getpid()}-{secrets.token_hex(4)}"
    fs.pipe_file(probe, b"elastic write probe")
    fs.rm(probe)


def crc32_of(fs: fsspec.AbstractFileSystem, path: str, chunk: int = 8 << 20) -> str:
    """Checksum a stored file by streaming it (same format as the writer records)."""
    crc = 0
    with fs.open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


__all__ = [
    "METADATA",
    "HashingWriter",
    "SafeLoadPlanner",
    "VerifyingReader",
    "crc32_of",
    "filesystem",
    "fsync_directory",
    "join",
    "make_reader",
    "metadata_problem",
    "probe_writable",
    "write_atomically",
    "write_durably",
]
