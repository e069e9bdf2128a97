"""fsspec storage for DCP: the one place that imports torch's private fsspec writer/reader.

torch 2.14 keeps ``FsspecWriter`` and ``FsspecReader`` in the private module
``torch.distributed.checkpoint._fsspec_filesystem``; if it moves, only this
module changes. :class:`HashingWriter` changes three things in torch's writer:

* each rank's tensors go to one file (``__<rank>_0.distcp``), one large
  sequential write after another, each in torch's own format: the
  ``torch.save`` record of the tensor, whose head and tail torch writes once
  per dtype and shape (:mod:`elastic.checkpoint.record`) while the tensor's
  memory goes to the file as it is. Serializing each tensor through
  ``torch.save`` made a save 3-5x slower than one ``torch.save`` of the whole
  state; this costs the same as raw bytes (about 1.5 KB of headers per
  tensor) and torch's stock tools read it: ``FileSystemReader``, ``dcp.load``,
  ``format_utils.dcp_to_torch_save``, with nothing of ours imported.
  :class:`VerifyingReader` reads such records straight into the destination
  tensors, and still reads the raw records of :data:`RAW_FORMAT` that earlier
  versions wrote (torch's reader refuses those: "Unknown extension");
  non-tensor items are ``torch.save`` bytes as in torch;
* every byte written is digested on the way out (:mod:`elastic.checkpoint.digest`:
  CRC-32, and when the marker is signed AES-GMAC under a key of the file's own too), in
  one pass that runs beside the writes, so the commit marker records digests without
  reading the checkpoint back. ``.metadata`` (small, and unpickled on load) gets a
  SHA-256, which the signed commit marker carries and :class:`VerifyingReader`
  checks before it unpickles a byte (no key needed);
* local files are written with ``os.write`` on the staged tensors' memory (no
  copy, no Python buffering), their write-back to the disk is started as the
  writes go (``sync_file_range`` on Linux) and they are fsynced once at the end.
  Streams without a file descriptor (remote stores) get the same bytes in large
  ``write`` calls. torch issue #144752: fsspec streams have no ``fileno`` on
  remote stores, so there is no fsync there; remote stores make data durable
  on ``close()`` (S3 completes the multipart upload), which happens before
  ``finish``. Issue #183878 (unflushed writes on remote stores): we never report
  a file as written before its stream was closed, and the commit marker is
  written only after every rank's files were closed.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import io
import logging
import os
import secrets
import sys
import threading
import warnings
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager, suppress
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
from torch.distributed._shard._utils import narrow_tensor_by_index  # private in torch 2.14
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint._fsspec_filesystem import (  # private in torch 2.14
    FsspecReader,
    FsspecWriter,
)
from torch.distributed.checkpoint._nested_dict import (  # private in torch 2.14
    flatten_state_dict,
)
from torch.distributed.checkpoint._traverse import set_element  # private in torch 2.14
from torch.distributed.checkpoint.default_planner import (  # private in torch 2.14
    _EmptyStateDictLoadPlanner,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.filesystem import (  # private in torch 2.14
    DEFAULT_SUFFIX,
    _StorageInfo,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import (  # private in torch 2.14
    _MEM_FORMAT_ENCODING,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import (  # private in torch 2.14
    _create_write_item_for_tensor,
)
from torch.distributed.checkpoint.state_dict_loader import (  # private in torch 2.14
    _load_state_dict,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future as TorchFuture
from torch.serialization import _get_layout  # private in torch 2.14

from elastic.checkpoint.digest import (
    CRC32,
    CRC32_IMPLEMENTATION,
    KEYED,
    SHA256,
    FileDigest,
    FileKeys,
    bytes_digest,
    crc32,
    recorded_kind,
    require,
)
from elastic.checkpoint.record import frame
from elastic.errors import CheckpointError

logger = logging.getLogger(__name__)

# The door: torch's private DCP names that the other checkpoint modules use, under names of
# ours (tests/rendezvous/test_layering.py keeps every private torch name in this module and
# elastic/worker/groups.py).
StorageInfo = _StorageInfo  # where one item lies: relative_path, offset, length
StoragePrefix = _StoragePrefix  # a rank's file prefix in a save plan
MemoryFormatEncoding = _MEM_FORMAT_ENCODING  # how .metadata pickles a memory format
get_layout = _get_layout  # how torch pickles a torch.layout (by its name)
EmptyStateDictLoadPlanner = _EmptyStateDictLoadPlanner  # a load planner without a template

METADATA = ".metadata"
# The transform descriptor of a tensor stored as its raw bytes (C order, little-endian, the
# dtype and chunk shape that .metadata records), as versions before torch-format records
# wrote them; read, never written. torch's own reader rejects it as unknown.
RAW_FORMAT = "elastic-raw/1"
_CHUNK = 8 << 20  # bytes per write call and per started write-back
_SYNC_FILE_RANGE_WRITE = 2


class _HashingStream:
    """A write-only stream proxy that digests and counts what passes through."""

    def __init__(self, raw: Any, record: dict[str, Any], digests: list[FileDigest]) -> None:
        self._raw = raw
        self._digests = digests
        self._record = record
        self._size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for digest in self._digests:
            # the tree hashes later: a copy, as the caller may reuse its buffer (small)
            digest.update(bytes(view) if digest.copies_needed else view)
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
        """Record the size and digests of everything written so far."""
        self._record["size"] = self._size
        for digest in self._digests:
            self._record.update(digest.record())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class HashingWriter(FsspecWriter):
    """torch's ``FsspecWriter`` that writes each rank's tensors into one file as
    ``torch.save`` records framed around their memory, and records a digest (``digest``:
    CRC-32, or GMAC under ``keys``, :mod:`elastic.checkpoint.digest`) and size per file it
    writes (in :attr:`written`). ``.metadata`` gets a SHA-256 (and the unkeyed ``digest``).

    Raises:
        CheckpointError: GMAC without ``keys``, or without the ``cryptography`` package.
    """

    def __init__(
        self, path: str, digest: str = CRC32, keys: FileKeys | None = None, **kwargs: Any
    ) -> None:
        super().__init__(path, sync_files=True, **kwargs)
        self.written: dict[str, dict[str, Any]] = {}
        self.digest = digest
        require(digest)  # refuse an unknown kind now, not in the writer thread
        if digest in KEYED and keys is None:
            raise CheckpointError(
                f"The checkpoint digest {digest!r} is keyed, but the writer of {path} was "
                "given no keys; this is a bug in the caller."
            )
        self._keys = keys
        self._lock = threading.Lock()
        inner = self.fs.create_stream
        self._open_stream = inner  # torch's: removes a partly written file on error

        @contextmanager
        def create_stream(path: str | os.PathLike[str], mode: str) -> Generator[Any, None, None]:
            if "r" in mode:
                with inner(path, mode) as stream:
                    yield stream
                return
            name = os.path.basename(os.fspath(path)).removesuffix(".tmp")
            record = self._record(name)
            with inner(path, mode) as stream, warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="fsync not supported")
                proxy = _HashingStream(stream, record, self._digests(name))
                yield proxy
                proxy.seal()

        self.fs.create_stream = create_stream  # type: ignore[method-assign]

    def _digests(self, name: str) -> list[FileDigest]:
        """The digests to record for the file ``name``. ``.metadata``: a SHA-256 (and the
        CRC-32, or the unkeyed kind), checked without a key. Data files: the kind, and beside
        a MAC the CRC-32 (12 GB/s), so that readers without the secret still find torn and
        flipped files."""
        if self.digest not in KEYED:
            return [FileDigest(self.digest)] + ([FileDigest(SHA256)] if name == METADATA else [])
        if name == METADATA:
            return [FileDigest(CRC32), FileDigest(SHA256)]
        assert self._keys is not None  # checked in __init__
        return [FileDigest(self.digest, self._keys.key(name)), FileDigest(CRC32)]

    def _record(self, name: str) -> dict[str, Any]:
        record: dict[str, Any] = {}
        with self._lock:
            self.written[name] = record
        return record

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> TorchFuture[list[WriteResult]]:
        """Write this rank's items into ``<prefix>0.distcp`` in plan order (tensors as
        ``torch.save`` records around their memory, other values as their ``torch.save``
        bytes), digested beside the writes and fsynced once."""
        if sys.byteorder != "little":  # the framed records are little-endian
            return super().write_data(plan, planner)
        storage: _StoragePrefix = plan.storage_data
        name = f"{storage.prefix}0{DEFAULT_SUFFIX}"
        views: list[memoryview] = []
        keep: list[Any] = []  # owners of the views' memory, alive until the file is closed
        results: list[WriteResult] = []
        offset = 0
        for item in plan.items:
            parts = _item_views(item, planner.resolve_data(item), keep)
            length = sum(part.nbytes for part in parts)
            info = _StorageInfo(name, offset, length)
            results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=info))
            views += parts
            offset += length
        path = self.fs.concat_path(self.path, name)
        with self._open_stream(path, "wb") as stream:
            size, digest = write_views(stream, views, self._digests(name))
        self._record(name).update(size=size, **digest)  # closed, and durable
        future: TorchFuture[list[WriteResult]] = TorchFuture()
        future.set_result(results)
        return future


def _item_views(item: WriteItem, data: Any, keep: list[Any]) -> list[memoryview]:
    """The byte views that make up one item's record (``keep`` receives their owners)."""
    if item.type == WriteItemType.BYTE_IO:
        if not isinstance(data, io.BytesIO):
            raise CheckpointError(
                f"The planner resolved the non-tensor item {item.index.fqn} to a "
                f"{type(data).__name__}, not bytes; it cannot be written."
            )
        keep.append(data)
        return [data.getbuffer()]
    tensor = _cpu_contiguous(data)
    keep.append(tensor)
    framing = frame(tensor.dtype, tuple(tensor.shape))
    return [memoryview(framing.head), byte_view(tensor), memoryview(framing.tail)]


def _cpu_contiguous(data: Any) -> torch.Tensor:
    if not isinstance(data, torch.Tensor):
        raise CheckpointError(
            f"The planner resolved a tensor item to a {type(data).__name__}; it cannot be written."
        )
    tensor = data.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return tensor.contiguous()


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy; the caller keeps
    ``tensor`` alive while the view is in use)."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    array = (ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())
    return memoryview(array).cast("B")


def _chunks(views: Sequence[memoryview]) -> Iterator[memoryview]:
    for view in views:
        for start in range(0, view.nbytes, _CHUNK):
            yield view[start : start + _CHUNK]


def write_views(
    stream: Any, views: Sequence[memoryview], digests: Sequence[FileDigest] | str = CRC32
) -> tuple[int, dict[str, str]]:
    """Write ``views`` one after another to ``stream`` and make them durable; return the
    total size and the digests of it all (``{kind: hex}``; ``digests``: fresh
    :class:`FileDigest` objects, or one unkeyed kind).

    The digest runs in a second thread over the same memory while this one writes
    (both release the GIL). With a file descriptor the bytes go through
    ``os.write``, write-back to the disk starts behind the writes, and one fsync
    ends it; without one (remote stores) through ``stream.write``, and the
    store makes them durable when the stream closes.
    """
    digest_result: Future[dict[str, str]] = Future()
    running = [FileDigest(digests)] if isinstance(digests, str) else list(digests)

    def checksum() -> None:
        try:
            for chunk in _chunks(views):
                for digest in running:  # one chunk after the other: it stays in the cache
                    digest.update(chunk)
            recorded: dict[str, str] = {}
            for digest in running:
                recorded.update(digest.record())
            digest_result.set_result(recorded)
        except BaseException as exc:  # handed to the writer below
            digest_result.set_exception(exc)

    checksummer = threading.Thread(target=checksum, name="elastic-ckpt-digest", daemon=True)
    checksummer.start()
    try:
        size = _write_chunks(stream, views)
    finally:
        checksummer.join()
    return size, digest_result.result()


def _write_chunks(stream: Any, views: Sequence[memoryview]) -> int:
    fd = _fileno(stream)
    size = 0
    if fd is None:
        for chunk in _chunks(views):
            stream.write(chunk)
            size += chunk.nbytes
        stream.flush()
        return size
    stream.flush()
    started = 0  # write-back started for the bytes before this offset
    for chunk in _chunks(views):
        _write_all(fd, chunk)
        size += chunk.nbytes
        if size - started >= _CHUNK:
            _start_writeback(fd, started, size - started)
            started = size
    os.fsync(fd)
    return size


def _fileno(stream: Any) -> int | None:
    fileno = getattr(stream, "fileno", None)
    if fileno is None:
        return None
    try:
        fd = fileno()
    except (OSError, io.UnsupportedOperation, AttributeError, ValueError):
        return None
    return fd if isinstance(fd, int) and fd >= 0 else None


def _write_all(fd: int, chunk: memoryview) -> None:
    while chunk.nbytes:
        written = os.write(fd, chunk)
        chunk = chunk[written:]


def _libc_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_sync_file_range = _libc_sync_file_range()


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing a byte range to the disk (without waiting for it), so
    the final fsync has little left to do. Best effort: a no-op where unsupported."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


class VerifyingReader(FsspecReader):
    """torch's fsspec reader that checks ``.metadata`` against its commit record before
    it reads it, unpickles it only through :mod:`elastic.checkpoint.dcp_metadata` (an
    allowlist of DCP's classes, then every item's file, offset and length checked against
    ``files``, the commit marker's), and never falls back to unverified rank-local metadata.

    ``expected=None`` skips the digest check: only for tools reading a step they trust.
    """

    def __init__(
        self,
        path: str,
        expected: dict[str, Any] | None,
        files: dict[str, dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(path, **kwargs)
        self.expected = expected
        self.files = files
        self._metadata: Metadata | None = None

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._metadata = metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> TorchFuture[None]:
        """Read tensors straight into their destinations, file by file in offset order:
        framed ``torch.save`` records (:mod:`elastic.checkpoint.record`) and raw ones
        (:data:`RAW_FORMAT`); everything else (other records, non-tensor items) the way
        torch reads it."""
        tensors: dict[str, list[tuple[ReadItem, _StorageInfo]]] = {}
        others: list[ReadItem] = []
        for item in plan.items:
            info: _StorageInfo = self.storage_data[item.storage_index]
            descriptors = list(info.transform_descriptors or ())
            if item.type == LoadItemType.TENSOR and descriptors in ([], [RAW_FORMAT]):
                tensors.setdefault(info.relative_path, []).append((item, info))
            else:
                others.append(item)
        for relative_path, reads in tensors.items():
            path = os.fspath(self.fs.concat_path(self.path, relative_path))
            with self.fs.create_stream(path, "rb") as stream:
                for item, info in sorted(reads, key=lambda read: read[1].offset):
                    if not self._read_tensor(stream, path, item, info, planner):
                        others.append(item)
        if others:
            super().read_data(dataclasses.replace(plan, items=others), planner).wait()
        future: TorchFuture[None] = TorchFuture()
        future.set_result(None)
        return future

    def _read_tensor(
        self, stream: Any, path: str, item: ReadItem, info: _StorageInfo, planner: LoadPlanner
    ) -> bool:
        """Read one tensor record whose bytes lie plainly in the file; ``False`` for a
        ``torch.save`` record of another shape (torch's reader then loads it)."""
        fqn = item.storage_index.fqn
        meta = self._metadata.state_dict_metadata.get(fqn) if self._metadata else None
        legacy = bool(info.transform_descriptors)
        if not isinstance(meta, TensorStorageMetadata):
            if legacy:
                raise CheckpointError(
                    f"The checkpoint {self.path} records {fqn} as raw bytes but does not "
                    "describe it as one plain tensor; it was not written by this version."
                )
            return False
        sizes = _stored_chunk_sizes(meta, item.storage_index)
        dtype = meta.properties.dtype
        if legacy:
            nbytes = sizes.numel() * torch.empty((), dtype=dtype).element_size()
            if nbytes != info.length:
                raise CheckpointError(
                    f"The checkpoint {self.path} records {info.length} bytes for {fqn}, but "
                    f"its shape {list(sizes)} of {dtype} takes {nbytes}."
                )
            self._read_raw(stream, path, item, planner, info.offset, sizes, dtype)
            return True
        framing = frame(dtype, tuple(sizes))
        if info.length != framing.length:
            return False
        stream.seek(info.offset)
        if stream.read(framing.data_offset) != framing.head:
            return False
        self._read_raw(stream, path, item, planner, None, sizes, dtype)
        return True

    def _read_raw(
        self,
        stream: Any,
        path: str,
        item: ReadItem,
        planner: LoadPlanner,
        offset: int | None,
        sizes: torch.Size,
        dtype: torch.dtype,
    ) -> None:
        """Read a stored chunk's raw bytes (at ``offset``, or where ``stream`` stands)."""
        fqn = item.storage_index.fqn
        nbytes = sizes.numel() * torch.empty((), dtype=dtype).element_size()
        target = planner.resolve_tensor(item).detach()
        if offset is not None:
            stream.seek(offset)
        if (
            target.device.type == "cpu"
            and target.dtype == dtype
            and target.is_contiguous()
            and target.shape == sizes
            and tuple(item.lengths) == tuple(sizes)
        ):
            _read_exactly(stream, byte_view(target), path)  # the whole chunk, in place
        else:
            buffer = bytearray(nbytes)
            _read_exactly(stream, memoryview(buffer), path)
            stored = (
                torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).reshape(sizes)
                if nbytes
                else torch.empty(sizes, dtype=dtype)
            )
            tensor = narrow_tensor_by_index(stored, item.storage_offsets, item.lengths)
            if target.size() != tensor.size():
                raise CheckpointError(
                    f"The checkpoint {self.path} holds {fqn} as {list(tensor.size())}, but "
                    f"the state to load into has {list(target.size())}."
                )
            target.copy_(tensor)
        planner.commit_tensor(item, target)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError(
                f"The checkpoint {self.path} has no verified global {METADATA}; rank-local "
                "metadata is not trusted."
            )
        from elastic.checkpoint.dcp_metadata import read_metadata  # it imports this door

        path = self._get_metadata_path(None)
        with self.fs.create_stream(path, "rb") as stream:
            size = (self.expected or {}).get("size")
            data = stream.read(size + 1) if type(size) is int and size >= 0 else stream.read()
        problem = metadata_problem(data, self.expected)
        if problem:
            raise CheckpointError(
                f"Refusing to read {path}: {problem}; it is not the file the commit marker "
                "vouches for."
            )
        metadata = read_metadata(data, os.fspath(path), self.files)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _stored_chunk_sizes(meta: TensorStorageMetadata, index: MetadataIndex) -> torch.Size:
    """The shape of the stored chunk that ``index`` names."""
    chunks = meta.chunks
    hint = index.index
    if (
        hint is not None
        and 0 <= hint < len(chunks)
        and (index.offset is None or chunks[hint].offsets == index.offset)
    ):
        return chunks[hint].sizes
    for chunk in chunks:
        if index.offset is None or chunk.offsets == index.offset:
            return chunk.sizes
    raise CheckpointError(
        f"The checkpoint metadata has no chunk of {index.fqn} at offset {index.offset}."
    )


def _read_exactly(stream: Any, view: memoryview, path: str) -> None:
    """Fill ``view`` from ``stream``; a file that ends early is a truncated checkpoint."""
    readinto = getattr(stream, "readinto", None)
    filled = 0
    while filled < view.nbytes:
        if readinto is not None:
            got = readinto(view[filled:])
        else:
            data = stream.read(view.nbytes - filled)
            got = len(data)
            view[filled : filled + got] = data
        if not got:
            raise CheckpointError(
                f"{path} ends {view.nbytes - filled} bytes early; the checkpoint is truncated."
            )
        filled += got


def metadata_problem(data: bytes, expected: dict[str, Any] | None) -> str:
    """Why ``data`` is not the ``.metadata`` that ``expected`` (a marker entry) describes
    (checked by its strongest unkeyed digest, and by its SHA-256 where recorded)."""
    if expected is None:
        return ""
    if len(data) != expected.get("size"):
        return f"size {len(data)} bytes, expected {expected.get('size')}"
    kind = recorded_kind(expected, keyed=False)
    if kind is None or bytes_digest(data, kind) != expected[kind]:
        return "checksum mismatch"
    sha = expected.get(SHA256)
    if sha is not None and hashlib.sha256(data).hexdigest() != sha:
        return "SHA-256 mismatch"
    return ""


class FastSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, minus the per-tensor ``typing`` protocol checks for plain
    tensors (about 0.1 ms each, twice per tensor, a few hundred tensors per model); tensor
    subclasses (DTensor, sharded tensors) and other values are planned by DCP itself.

    With a ``cache_key`` (one per checkpoint manager, so one process group), DCP's plan
    cache skips sending and merging the plans when no rank's plan changed since the
    last save under that key. A plan counts as unchanged only when every write item
    (dtype included, which DCP's own comparison leaves out) and the key mapping are
    equal to the cached ones.
    """

    def __init__(self, cache_key: str | None = None) -> None:
        super().__init__(enable_plan_caching=cache_key is not None)
        self._cache_key = cache_key
        if cache_key is not None:
            self._cached_plans_key = f"{type(self).__name__}:{cache_key}"

    @classmethod
    def forget(cls, cache_key: str) -> None:
        """Drop the plans cached under ``cache_key``."""
        key = f"{cls.__name__}:{cache_key}"
        for cache in (
            SavePlanner._cached_save_plan,
            SavePlanner._cached_final_save_plan,
            SavePlanner._cached_all_plans,
            SavePlanner._cached_global_plan,
            SavePlanner._cached_metadata,
        ):
            cache.pop(key, None)

    def create_local_plan(self) -> SavePlan:
        items: list[WriteItem] = []
        for fqn, value in self.state_dict.items():
            if type(value) is torch.Tensor:
                items.append(_create_write_item_for_tensor(fqn, value))
            else:
                items += create_default_local_save_plan({fqn: value}, self.is_coordinator).items
        plan = SavePlan(items, planner_data=self.mappings if self.flatten_state_dict else None)
        self.plan = plan
        if self._enable_plan_caching:
            cached = SavePlanner._cached_save_plan.get(self._cached_plans_key)
            if (
                cached is not None
                and cached.items == plan.items
                and cached.planner_data == plan.planner_data
            ):
                return SavePlan([], usable=False)  # DCP reuses the cached global plan
            self._pending_local_plan = plan  # cached by finish_plan once the plan succeeded
        return plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        if self._enable_plan_caching:
            cached = SavePlanner._cached_all_plans.get(self._cached_plans_key)
            if cached is not None and len(cached) != len(all_plans) and self._cache_key:
                self.forget(self._cache_key)  # another world size: start afresh
                cached = None
            if cached is None and not all(plan.usable for plan in all_plans):
                raise CheckpointError(
                    "A rank reused its cached save plan, but the coordinator has none for "
                    "this group (it was restarted or dropped it); this save fails, and every "
                    "rank plans afresh for the next one"
                )
        return super().create_global_plan(all_plans)

    def lookup_object(self, index: MetadataIndex) -> Any:
        value = self.state_dict.get(index.fqn)
        if type(value) is torch.Tensor and (
            index.offset is None or (len(index.offset) == value.dim() and not any(index.offset))
        ):
            return value
        return super().lookup_object(index)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor items load with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        store_loaded(self, read_item, torch.load(value, weights_only=True))


def store_loaded(planner: DefaultLoadPlanner, read_item: ReadItem, obj: Any) -> None:
    """Put a loaded non-tensor value where ``planner`` keeps its state (what DCP's own
    ``load_bytes`` does after its unrestricted ``torch.load``)."""
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn], obj)
    else:
        planner.state_dict[read_item.dest_index.fqn] = obj


def make_reader(
    path: str,
    expected_metadata: dict[str, Any] | None = None,
    files: dict[str, dict[str, Any]] | None = None,
) -> FsspecReader:
    """Return a reader for a DCP directory that verifies ``.metadata`` (against the marker's
    record of it, when given), unpickles it through an allowlist and reads only what lies
    inside the marker's ``files`` (when given).

    Raises:
        CheckpointError: ``path`` is a ``data:`` URL (bytes carried in the name itself).
    """
    if path.strip().lower().startswith("data:"):
        raise CheckpointError(
            f"Refusing to read a checkpoint from a data: URL ({path[:40]}...); checkpoints "
            "are read from the configured storage only."
        )
    return VerifyingReader(path, expected_metadata, files)


def load_in_this_process(
    state: dict[str, Any], storage_reader: FsspecReader, planner: LoadPlanner
) -> None:
    """DCP's load driver in this process alone (``no_dist=True``: nothing crosses ranks,
    so nothing is pickled between them)."""
    _load_state_dict(state, storage_reader=storage_reader, planner=planner, no_dist=True)


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


__all__ = [
    "CRC32_IMPLEMENTATION",
    "METADATA",
    "RAW_FORMAT",
    "EmptyStateDictLoadPlanner",
    "FastSavePlanner",
    "HashingWriter",
    "MemoryFormatEncoding",
    "SafeLoadPlanner",
    "StorageInfo",
    "StoragePrefix",
    "VerifyingReader",
    "byte_view",
    "crc32",
    "filesystem",
    "flatten_state_dict",
    "fsync_directory",
    "get_layout",
    "join",
    "load_in_this_process",
    "make_reader",
    "metadata_problem",
    "probe_writable",
    "store_loaded",
    "write_atomically",
    "write_durably",
    "write_views",
]
