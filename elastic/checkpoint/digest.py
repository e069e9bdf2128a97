"""What a commit marker records to vouch for each file: CRC-32, or a keyed MAC when signed.

CRC-32 finds torn, truncated and bit-flipped files, but it is affine: whoever can write
the storage changes any bytes and restores the CRC with 4 chosen ones. A signed marker
therefore vouches for each data file by AES-256-GMAC (``"gmac"``, from the
``cryptography`` package: 7-10 GB/s on one thread with AES-NI and PCLMULQDQ, where
SHA-256 runs about 1.3 GB/s with SHA-NI). Each file gets a key of its own,
HMAC-SHA256(job secret, domain | run | step | attempt | file name) (:class:`FileKeys`),
so a key authenticates one file write and nothing else: a tag copied from another
step, attempt or file does not match, and no (key, IV) pair is ever used twice (the
96-bit IV is random as well and recorded beside the tag: ``"<iv hex><tag hex>"``). The
marker's HMAC covers the tags. Checking a MAC needs the secret; for readers without it
the writer records a CRC-32 beside each tag (ISA-L's runs at 12 GB/s: both together
about 5.5 GB/s), which finds torn and flipped files, not forgeries.

``.metadata`` (small, and unpickled on load) keeps a plain SHA-256 (``"sha256"``), which
the reader checks without a key before it unpickles a byte.

Older checkpoints still load: signed markers of version 3 vouch by a SHA-256 tree
(``"sha256_tree"``: the SHA-256 of a header (domain, chunk size, file size) and of the
SHA-256 of every 8 MiB chunk, in order), version 2 by CRC-32. Unsigned runs keep CRC-32
(``"crc32"``; ISA-L's where the ``isal`` package is installed, 12 GB/s): there is no
signature to trust a digest with anyway. Every digest is computed beside the writes.
"""

from __future__ import annotations

import hashlib
import hmac
import importlib
import json
import os
import struct
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import fsspec

from elastic.errors import CheckpointError

GMAC = "gmac"
SHA256_TREE = "sha256_tree"
SHA256 = "sha256"
CRC32 = "crc32"
KINDS = (GMAC, SHA256_TREE, SHA256, CRC32)  # strongest first
KEYED = frozenset({GMAC})
# What a signed marker may vouch for a file by: a cryptographic digest (the marker's HMAC
# covers it) or a MAC.
STRONG = frozenset({GMAC, SHA256_TREE, SHA256})
TREE_CHUNK = 8 << 20  # bytes per leaf of the SHA-256 tree
_TREE_DOMAIN = b"elastic-sha256-tree-v1\0"
_KEY_DOMAIN = b"elastic-checkpoint-file-gmac-v1\0"
_IV_BYTES = 12
_TAG_BYTES = 16
_CRYPTOGRAPHY = "cryptography>=46,<51"  # the range pyproject.toml names
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


class FileKeys:
    """The MAC keys of one save attempt's files: one per file name, derived from the job
    secret, the run, the step and the attempt. Never shows the secret or a key."""

    __slots__ = ("_context", "_secret")

    def __init__(self, secret: bytes, run: str, step: int, attempt: str) -> None:
        self._secret = secret
        self._context = (run, int(step), attempt)

    def key(self, name: str) -> bytes:
        """The 256-bit AES key of the file ``name`` (relative to the attempt's directory)."""
        run, step, attempt = self._context
        content = json.dumps([run, step, attempt, name], separators=(",", ":")).encode()
        return hmac.new(self._secret, _KEY_DOMAIN + content, hashlib.sha256).digest()

    def __repr__(self) -> str:
        run, step, attempt = self._context
        return f"FileKeys(run={run!r}, step={step}, attempt={attempt!r})"


def file_keys(secret: bytes | None, run: str, step: int, attempt: str) -> FileKeys | None:
    """The attempt's :class:`FileKeys`, or ``None`` for an unsigned run."""
    return None if secret is None else FileKeys(secret, run, step, attempt)


class _Authenticator(Protocol):
    def authenticate_additional_data(self, data: bytes, /) -> None: ...
    def finalize(self) -> bytes: ...
    @property
    def tag(self) -> bytes: ...


def _gmac(key: bytes, iv: bytes) -> _Authenticator:
    """An AES-256-GCM encryptor that only authenticates (GMAC)."""
    try:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    except ImportError as exc:
        raise CheckpointError(
            "Signed checkpoints vouch for their files by AES-GMAC, which needs the "
            f"cryptography package; install it (pip install '{_CRYPTOGRAPHY}')."
        ) from exc
    return Cipher(algorithms.AES(key), modes.GCM(iv)).encryptor()


def require(kind: str) -> None:
    """Raise now, not in a writer thread, when ``kind`` is unknown or cannot be computed.

    Raises:
        ValueError: an unknown kind.
        CheckpointError: GMAC without the ``cryptography`` package.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown file digest {kind!r}")
    if kind == GMAC:
        _gmac(bytes(32), bytes(_IV_BYTES))


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


class _Gmac:
    """AES-256-GMAC of a byte stream: ``"<iv hex><tag hex>"``."""

    def __init__(self, key: bytes, iv: bytes | None) -> None:
        self._iv = os.urandom(_IV_BYTES) if iv is None else iv
        self._mac = _gmac(key, self._iv)
        self._hex: str | None = None

    def update(self, data: Any) -> None:
        self._mac.authenticate_additional_data(data)

    def hexdigest(self) -> str:
        if self._hex is None:
            self._mac.finalize()
            self._hex = self._iv.hex() + self._mac.tag.hex()
        return self._hex


def _split_gmac(recorded: Any) -> bytes | None:
    """The IV of a recorded GMAC value, or ``None`` when it is no such value."""
    if not isinstance(recorded, str) or len(recorded) != 2 * (_IV_BYTES + _TAG_BYTES):
        return None
    try:
        return bytes.fromhex(recorded[: 2 * _IV_BYTES])
    except ValueError:
        return None


class FileDigest:
    """A running digest of one file's bytes (``kind``: one of :data:`KINDS`).

    GMAC needs the file's ``key`` (:meth:`FileKeys.key`); ``iv`` is the recorded one when
    checking a file, random when writing. With the SHA-256 tree, the buffers passed to
    :meth:`update` must stay unchanged until :meth:`hexdigest` (other threads hash them).
    """

    def __init__(self, kind: str = CRC32, key: bytes | None = None, iv: bytes | None = None):
        if kind not in KINDS:
            raise ValueError(f"unknown file digest {kind!r}")
        if (key is not None) != (kind in KEYED):
            needs = "needs a key" if key is None else "takes no key"
            raise ValueError(f"the file digest {kind!r} {needs}")
        self.kind = kind
        self._crc = 0
        self._impl: Any = None  # the tree, the GMAC or a hashlib object; None: CRC-32
        if kind == SHA256_TREE:
            self._impl = _Tree()
        elif kind == GMAC:
            assert key is not None
            self._impl = _Gmac(key, iv)
        elif kind == SHA256:
            self._impl = hashlib.sha256()

    @property
    def copies_needed(self) -> bool:
        """Whether :meth:`update` keeps references to its buffers (the tree does)."""
        return self.kind == SHA256_TREE

    def update(self, data: Any) -> None:
        """Add ``data`` (any buffer) to the digest."""
        if self._impl is not None:
            self._impl.update(data)
        else:
            self._crc = crc32(data, self._crc)

    def hexdigest(self) -> str:
        """The digest as the marker records it."""
        return self._impl.hexdigest() if self._impl is not None else f"{self._crc:08x}"

    def record(self) -> dict[str, str]:
        """The marker entry's digest field: ``{kind: hexdigest}``."""
        return {self.kind: self.hexdigest()}


def kind_for(signed: bool) -> str:
    """The digest a marker records per data file: GMAC when it is signed."""
    return GMAC if signed else CRC32


def recorded_kind(entry: dict[str, Any], keyed: bool = True) -> str | None:
    """The strongest digest a marker entry records (a keyed one only if ``keyed``), or
    ``None``."""
    for kind in KINDS:
        if isinstance(entry.get(kind), str) and (keyed or kind not in KEYED):
            return kind
    return None


def _checker(kind: str, recorded: Any, key: bytes | None) -> FileDigest | None:
    """A digest to recompute ``recorded`` with, or ``None`` when it cannot match."""
    if kind not in KEYED:
        return FileDigest(kind)
    iv = _split_gmac(recorded)
    return None if iv is None or key is None else FileDigest(kind, key, iv)


def matches(
    fs: fsspec.AbstractFileSystem,
    path: str,
    kind: str,
    recorded: Any,
    key: bytes | None = None,
    chunk: int = 8 << 20,
) -> bool:
    """Whether the stored file's digest is ``recorded`` (read in chunks; GMAC with ``key``)."""
    digest = _checker(kind, recorded, key)
    if digest is None:
        return False
    with fs.open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)  # bytes: immutable, as the tree needs
    return hmac.compare_digest(digest.hexdigest().encode(), str(recorded).encode())


def digest_of(fs: fsspec.AbstractFileSystem, path: str, kind: str, chunk: int = 8 << 20) -> str:
    """The digest of a stored file of an unkeyed ``kind``, read in chunks."""
    digest = FileDigest(kind)
    with fs.open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)  # bytes: immutable, as the tree needs
    return digest.hexdigest()


def bytes_digest(data: bytes, kind: str) -> str:
    """The digest of ``data`` (an unkeyed ``kind``)."""
    digest = FileDigest(kind)
    digest.update(data)
    return digest.hexdigest()


__all__ = [
    "CRC32",
    "CRC32_IMPLEMENTATION",
    "GMAC",
    "KEYED",
    "KINDS",
    "SHA256",
    "SHA256_TREE",
    "STRONG",
    "TREE_CHUNK",
    "FileDigest",
    "FileKeys",
    "bytes_digest",
    "crc32",
    "digest_of",
    "file_keys",
    "kind_for",
    "matches",
    "recorded_kind",
    "require",
]
