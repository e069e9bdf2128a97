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
signature to trust a digest with anyway. Both are computed beside the writes, and
the writer's result waits only for the marker. With the tree, a signed manager's leaves
are mostly hashed before the write even starts: the stager hashes each leaf as soon as
the buffers it covers are staged (:class:`LeafPlan`, laid out by the previous save), on
the core the copy leaves idle, while DCP plans. The tree and the marker are what they
were: a checkpoint hashed ahead and one hashed by the writer are the same bytes.
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

    def __init__(self, hashed: dict[int, Future[bytes]] | None = None) -> None:
        self._pieces: list[Any] = []
        self._filled = 0
        self._size = 0
        self._leaves: list[Future[bytes]] = []
        self._hashed = hashed or {}  # leaf index -> its hash, computed ahead

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
        ahead = self._hashed.get(len(self._leaves))
        self._leaves.append(ahead or _hash_pool().submit(_sha256_of, self._pieces))
        self._pieces, self._filled = [], 0

    def hexdigest(self) -> str:
        if self._pieces or not self._leaves:
            self._flush()
        root = hashlib.sha256(_TREE_DOMAIN + struct.pack("<QQ", TREE_CHUNK, self._size))
        for leaf in self._leaves:
            root.update(leaf.result())
        return root.hexdigest()


class LeafPlan:
    """Which memory each leaf of a file's SHA-256 tree covers, so that the leaves can be
    hashed before the file is written: as soon as the state's tensors are staged.

    Built by the writer from one save's byte views and what each one is (``keys``:
    :func:`elastic.checkpoint.storage.HashingWriter.write_data`); the stager that
    owns the tensors keeps it (:class:`~elastic.checkpoint.stager.Stager`), starts a new
    round of hashes each time it stages (:meth:`begin`), and reports each tensor it has
    copied (:meth:`ready`); a leaf is hashed in the pool once all the tensors it covers are
    staged (leaves that cover other bytes, ``torch.save`` bytes of non-tensor items, are
    never hashed ahead). The next writer takes the round's hashes (:meth:`take`) only
    when its views are exactly this plan's (the same tensors, sizes and framing bytes, in
    order), and hashes every leaf it is not given. A round's hashes are taken once.
    """

    def __init__(self, keys: tuple[Any, ...], views: list[memoryview], owners: list[Any]) -> None:
        self.keys = keys
        self._owners = owners  # the memory the views point into, alive while this plan is
        self._leaves: list[list[memoryview]] = []
        needs: list[set[int] | None] = []  # None: the leaf covers bytes that change
        filled = TREE_CHUNK
        for key, whole in zip(keys, views, strict=True):
            view = whole.cast("B") if whole.format != "B" else whole
            while view.nbytes:
                if filled == TREE_CHUNK:
                    self._leaves.append([])
                    needs.append(set())
                    filled = 0
                take = min(view.nbytes, TREE_CHUNK - filled)
                self._leaves[-1].append(view[:take])
                need = needs[-1]
                if key[0] == "tensor" and need is not None:
                    need.add(key[1])
                elif key[0] != "bytes":
                    needs[-1] = None
                filled += take
                view = view[take:]
        self._needs = needs
        self._by_address: dict[int, list[int]] = {}
        for leaf, need in enumerate(needs):
            for address in need or ():
                self._by_address.setdefault(address, []).append(leaf)
        self._lock = threading.Lock()
        self._round = 0
        self._waiting: dict[int, set[int]] = {}
        self._hashes: dict[int, Future[bytes]] = {}

    def begin(self) -> None:
        """Start a round: forget the last round's hashes (the tensors are staged anew)."""
        with self._lock:
            self._round += 1
            self._hashes = {}
            self._waiting = {leaf: set(need) for leaf, need in enumerate(self._needs) if need}
            ready = [leaf for leaf, need in enumerate(self._needs) if need is not None and not need]
            round_ = self._round
        for leaf in ready:  # framing bytes only
            self._submit(leaf, round_)

    def ready(self, address: int) -> None:
        """The tensor whose memory starts at ``address`` holds its new bytes: hash every
        leaf of this round that waited only for it."""
        ready = []
        with self._lock:
            for leaf in self._by_address.get(address, ()):
                waiting = self._waiting.get(leaf)
                if waiting is not None and address in waiting:
                    waiting.discard(address)
                    if not waiting:
                        del self._waiting[leaf]
                        ready.append(leaf)
            round_ = self._round
        for leaf in ready:
            self._submit(leaf, round_)

    def _submit(self, leaf: int, round_: int) -> None:
        future = _hash_pool().submit(_sha256_of, self._leaves[leaf])
        with self._lock:
            if round_ == self._round:  # not yet taken, nor staged anew
                self._hashes[leaf] = future

    def take(self, keys: tuple[Any, ...]) -> dict[int, Future[bytes]] | None:
        """This round's leaf hashes, by leaf index, if ``keys`` are this plan's; once."""
        if keys != self.keys:
            return None
        with self._lock:
            hashes, self._hashes, self._waiting = self._hashes, {}, {}
            self._round += 1
        return hashes


class FileDigest:
    """A running digest of one file's bytes: ``kind`` is :data:`CRC32` or
    :data:`SHA256_TREE`. With the tree, the buffers passed to :meth:`update` must stay
    unchanged until :meth:`hexdigest` (they are hashed in other threads)."""

    def __init__(self, kind: str = CRC32, hashed: dict[int, Future[bytes]] | None = None) -> None:
        if kind not in (CRC32, SHA256_TREE):
            raise ValueError(f"unknown file digest {kind!r}")
        self.kind = kind
        self._crc = 0
        self._tree = _Tree(hashed) if kind == SHA256_TREE else None

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
    "LeafPlan",
    "bytes_digest",
    "crc32",
    "digest_of",
    "kind_for",
    "recorded_kind",
]
