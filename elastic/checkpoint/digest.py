"""What a commit marker records to vouch for each file: CRC-32, or a SHA-256 tree when signed.

CRC-32 finds torn, truncated and bit-flipped files, but it is affine: whoever can write
the storage changes any bytes and restores the CRC with 4 chosen ones. A signed marker
therefore vouches for each file by a SHA-256 tree (``"sha256_tree"``): the SHA-256 of a
header (domain, chunk size, file size) and of the SHA-256 of every 8 MiB chunk, in
order. Nobody can match it without the original bytes, and the chunks are hashed in
parallel (up to 4 threads; hashlib releases the GIL), so that a save's hashing keeps up
with its writes (one thread of SHA-256 runs about 1 GB/s with SHA-NI, below a disk's
page-cache write speed; BLAKE2b is slower still on x86). The marker's HMAC covers
these digests, so the hash needs no key of its own. Unsigned runs keep CRC-32
(``"crc32"``; ISA-L's where the ``isal`` package is installed, 12 GB/s): there is no
signature to trust a digest with anyway. Both are computed beside the writes.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import struct
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import fsspec

SHA256_TREE = "sha256_tree"
CRC32 = "crc32"
TREE_CHUNK = 8 << 20  # bytes per leaf of the SHA-256 tree
_TREE_DOMAIN = b"elastic-sha256-tree-v1\0"
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _crc32_function() -> tuple[Callable[[Any, int], int], str]:
    """ISA-L's CRC-32 where the optional ``isal`` package is installed (the same checksum
    as zlib's), else zlib's."""
    try:
        module = importlib.import_module("isal.isal_zlib")
    except ImportError:
        return zlib.crc32, "zlib"
    return module.crc32, "isal"


crc32, CRC32_IMPLEMENTATION = _crc32_function()


def _hash_pool() -> ThreadPoolExecutor:
    """The threads that hash tree chunks (created on first use; they inherit the creating
    thread's lowered priority)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            workers = max(1, min(4, os.cpu_count() or 1))
            _pool = ThreadPoolExecutor(workers, thread_name_prefix="elastic-ckpt-hash")
        return _pool


def _sha256_of(pieces: list[Any]) -> bytes:
    digest = hashlib.sha256()
    for piece in pieces:
        digest.update(piece)
    return digest.digest()


class _Tree:
    """The SHA-256 tree of a byte stream, its chunks hashed in the pool as they fill."""

    def __init__(self) -> None:
        self._pieces: list[Any] = []
        self._filled = 0
        self._size = 0
        self._leaves: list[Future[bytes]] = []

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        self._size += view.nbytes
        while view.nbytes:
            take = min(view.nbytes, TREE_CHUNK - self._filled)
            self._pieces.append(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == TREE_CHUNK:
                self._flush()

    def _flush(self) -> None:
        self._leaves.append(_hash_pool().submit(_sha256_of, self._pieces))
        self._pieces, self._filled = [], 0

    def hexdigest(self) -> str:
        if self._pieces or not self._leaves:
            self._flush()
        root = hashlib.sha256(_TREE_DOMAIN + struct.pack("<QQ", TREE_CHUNK, self._size))
        for leaf in self._leaves:
            root.update(leaf.result())
        return root.hexdigest()


class FileDigest:
    """A running digest of one file's bytes: ``kind`` is :data:`CRC32` or
    :data:`SHA256_TREE`. With the tree, the buffers passed to :meth:`update` must stay
    unchanged until :meth:`hexdigest` (they are hashed in other threads)."""

    def __init__(self, kind: str = CRC32) -> None:
        if kind not in (CRC32, SHA256_TREE):
            raise ValueError(f"unknown file digest {kind!r}")
        self.kind = kind
        self._crc = 0
        self._tree = _Tree() if kind == SHA256_TREE else None

    def update(self, data: Any) -> None:
        """Add ``data`` (any buffer) to the digest."""
        if self._tree is not None:
            self._tree.update(data)
        else:
            self._crc = crc32(data, self._crc)

    def hexdigest(self) -> str:
        """The digest as the marker records it."""
        return self._tree.hexdigest() if self._tree is not None else f"{self._crc:08x}"

    def record(self) -> dict[str, str]:
        """The marker entry's digest field: ``{kind: hexdigest}``."""
        return {self.kind: self.hexdigest()}


def kind_for(signed: bool) -> str:
    """The digest a marker records per file: the SHA-256 tree when it is signed."""
    return SHA256_TREE if signed else CRC32


def recorded_kind(entry: dict[str, Any]) -> str | None:
    """The strongest digest a marker entry records, or ``None``."""
    for kind in (SHA256_TREE, CRC32):
        if isinstance(entry.get(kind), str):
            return kind
    return None


def digest_of(fs: fsspec.AbstractFileSystem, path: str, kind: str, chunk: int = 8 << 20) -> str:
    """The digest of a stored file, read in chunks (as the writer records it)."""
    digest = FileDigest(kind)
    with fs.open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)  # bytes: immutable, as the tree needs
    return digest.hexdigest()


def bytes_digest(data: bytes, kind: str) -> str:
    """The digest of ``data``."""
    digest = FileDigest(kind)
    digest.update(data)
    return digest.hexdigest()


__all__ = [
    "CRC32",
    "CRC32_IMPLEMENTATION",
    "SHA256_TREE",
    "TREE_CHUNK",
    "FileDigest",
    "bytes_digest",
    "crc32",
    "digest_of",
    "kind_for",
    "recorded_kind",
]
