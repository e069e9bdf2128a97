"""DCP's ``.metadata`` read without running code, and checked before any tensor is read.

``.metadata`` is torch's pickle of a :class:`~torch.distributed.checkpoint.metadata.Metadata`.
:func:`read_metadata` unpickles it with ``find_class`` restricted to exactly the classes
a DCP save of torch 2.14 pickles (:data:`ALLOWED`: the metadata dataclasses, the
filesystem writer's storage record, ``torch.Size``, dtypes and layouts by name, a POSIX
path for the checkpoint id), with and
without a job secret: a member that holds the secret and signs a hostile file still cannot
run code. Nor can it change a class or a shared object: the opcodes that change an object
in place act only on what the pickle built itself: BUILD sets the fields of a fresh
metadata dataclass instance (by its field names, or ``TensorProperties``' own
``__setstate__``) and nothing else (not a class, whose slot state would be ``setattr`` on
it, not an enum member or a layout), APPEND(S) only on lists and SETITEM(S) only on dicts
(issue 38: a signed file that set ``Metadata.__reduce_ex__`` broke every later save). Then
it checks the structure: every field of the type it must be, every chunk
inside its tensor, and every item's storage record (where its bytes lie) naming a plain
file in the checkpoint's own directory (no ``/``, no ``..``, no other protocol); given the
commit marker's files, one of them, with the bytes inside the file's recorded size.
Anything else is one :class:`~elastic.errors.CheckpointError` before a byte is read.
"""

from __future__ import annotations

import dataclasses
import io
import pathlib
import pickle
import re
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from elastic.checkpoint.storage import MemoryFormatEncoding, StorageInfo, get_layout
from elastic.errors import CheckpointError

METADATA = ".metadata"
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")
_CLASSES: tuple[Any, ...] = (
    Metadata,
    MetadataIndex,
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
    BytesStorageMetadata,
    StorageMeta,
    MemoryFormatEncoding,
    StorageInfo,
)
# (module, name) -> the object a pickle may name: nothing else is ever looked up.
ALLOWED: dict[tuple[str, str], Any] = {
    **{(c.__module__, c.__qualname__): c for c in _CLASSES},
    ("torch", "Size"): torch.Size,
    # StorageMeta.checkpoint_id of a save given a path (dcp.save(..., checkpoint_id=Path))
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("torch.serialization", "_get_layout"): get_layout,
    **{
        ("torch", name): value
        for name in dir(torch)
        if isinstance(value := getattr(torch, name, None), torch.dtype)
    },
}


# The classes whose fresh instances BUILD may fill in -> the names it may set (their fields).
_BUILT: dict[type, frozenset[str]] = {
    c: frozenset(f.name for f in dataclasses.fields(c))
    for c in _CLASSES
    if isinstance(c, type) and dataclasses.is_dataclass(c)
}


class _MetadataUnpickler(pickle._Unpickler):
    """An unpickler that finds only :data:`ALLOWED` names and changes only what it built.

    Python's pure unpickler (``.metadata`` is small), its opcodes that change an object in
    place replaced: the C unpickler's BUILD would ``setattr`` on any object, a class too.
    """

    _base: ClassVar[dict[int, Any]] = pickle._Unpickler.dispatch
    stack: list[Any]
    metastack: list[list[Any]]

    def find_class(self, module: str, name: str) -> Any:
        found = ALLOWED.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata class")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("DCP metadata holds no persistent references")

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        cls = type(inst)
        fields = _BUILT.get(cls)
        if fields is None:
            raise pickle.UnpicklingError(
                f"it sets the state of {_shown(inst)} (a {cls.__name__}), which DCP never does"
            )
        own = cls.__dict__.get("__setstate__")  # TensorProperties: a tuple of its fields
        if own is not None and type(state) is tuple:
            own(inst, state)
            return
        if type(state) is not dict or not all(type(k) is str and k in fields for k in state):
            raise pickle.UnpicklingError(
                f"it sets {_shown(state)} on a {cls.__name__}, not the fields of one"
            )
        inst.__dict__.update(state)

    def load_append(self) -> None:
        self._container(self.stack[-2], list, "APPEND")
        self._base[pickle.APPEND[0]](self)

    def load_appends(self) -> None:
        self._container(self._below_mark(), list, "APPENDS")
        self._base[pickle.APPENDS[0]](self)

    def load_setitem(self) -> None:
        self._container(self.stack[-3], dict, "SETITEM")
        self._base[pickle.SETITEM[0]](self)

    def load_setitems(self) -> None:
        self._container(self._below_mark(), dict, "SETITEMS")
        self._base[pickle.SETITEMS[0]](self)

    def load_additems(self) -> None:
        self._container(self._below_mark(), set, "ADDITEMS")
        self._base[pickle.ADDITEMS[0]](self)

    def _below_mark(self) -> Any:
        """What an opcode that ends at the last MARK adds to (None when there is none)."""
        return self.metastack[-1][-1] if self.metastack and self.metastack[-1] else None

    @staticmethod
    def _container(target: Any, kind: type, opcode: str) -> None:
        if type(target) is not kind:
            raise pickle.UnpicklingError(
                f"its {opcode} adds to a {type(target).__name__}, not a {kind.__name__}"
            )

    dispatch: ClassVar[dict[int, Any]] = {
        **_base,
        pickle.BUILD[0]: load_build,
        pickle.APPEND[0]: load_append,
        pickle.APPENDS[0]: load_appends,
        pickle.SETITEM[0]: load_setitem,
        pickle.SETITEMS[0]: load_setitems,
        pickle.ADDITEMS[0]: load_additems,
    }


def read_metadata(
    data: bytes, where: str, files: Mapping[str, Mapping[str, Any]] | None = None
) -> Metadata:
    """The checked :class:`Metadata` that ``data`` (the bytes of ``where``) pickles.

    ``files``: the commit marker's files (name -> record with ``size``); every item must
    lie inside one of them.

    Raises:
        CheckpointError: ``data`` names a class outside :data:`ALLOWED`, is no pickle, or
            holds something that is not DCP metadata or lies outside the checkpoint.
    """
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # any unpickling error, or an allowed constructor refusing
        raise CheckpointError(
            f"Refusing the checkpoint metadata {where}: {type(exc).__name__}: "
            f"{str(exc)[:200]}; it is not what a DCP save writes, so nothing of it was "
            "used: restore the step's files from a copy or delete the step."
        ) from exc
    problem = structure_problem(metadata, files)
    if problem:
        raise CheckpointError(
            f"Refusing the checkpoint metadata {where}: {problem}; it is not what a DCP save "
            "writes, nothing was read: restore the step's files from a copy or delete the step."
        )
    return metadata


def structure_problem(metadata: Any, files: Mapping[str, Mapping[str, Any]] | None) -> str:
    """What is wrong with unpickled ``metadata`` (see :func:`read_metadata`), or ``""``."""
    try:
        return _problem(metadata, files)
    except AttributeError as exc:  # an allowed class built without one of its fields
        return f"it lacks a field ({exc})"


def _problem(metadata: Any, files: Mapping[str, Mapping[str, Any]] | None) -> str:
    if type(metadata) is not Metadata:
        return f"it holds a {type(metadata).__name__}, not DCP metadata"
    tensors = metadata.state_dict_metadata
    if type(tensors) is not dict:
        return "its state_dict_metadata is no dict"
    for fqn, entry in tensors.items():
        problem = _entry_problem(fqn, entry)
        if problem:
            return problem
    storage = metadata.storage_data
    if type(storage) is not dict:
        return "its storage_data is no dict"
    for index, info in storage.items():
        problem = _storage_problem(index, info, files)
        if problem:
            return problem
    if metadata.storage_meta is not None and type(metadata.storage_meta) is not StorageMeta:
        return "its storage_meta is no StorageMeta"
    return ""


def _natural(value: Any) -> bool:
    return type(value) is int and value >= 0


def _shape(value: Any) -> bool:
    return type(value) is torch.Size and all(_natural(v) for v in value)


def _entry_problem(fqn: Any, entry: Any) -> str:
    if type(fqn) is not str:
        return f"it names an entry {_shown(fqn)}"
    if type(entry) is BytesStorageMetadata:
        return ""
    if type(entry) is not TensorStorageMetadata:
        return f"{fqn!r} is a {type(entry).__name__}"
    if type(entry.properties) is not TensorProperties or not _shape(entry.size):
        return f"{fqn!r} has no valid properties and shape"
    if type(entry.chunks) is not list:
        return f"{fqn!r} has no chunk list"
    for chunk in entry.chunks:
        if (
            type(chunk) is not ChunkStorageMetadata
            or not _shape(chunk.offsets)
            or not _shape(chunk.sizes)
            or len(chunk.offsets) != len(entry.size)
            or len(chunk.sizes) != len(entry.size)
            or any(
                o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, entry.size, strict=True)
            )
        ):
            return f"{fqn!r} has a chunk outside its shape {list(entry.size)}"
    return ""


def _storage_problem(index: Any, info: Any, files: Mapping[str, Mapping[str, Any]] | None) -> str:
    if (
        type(index) is not MetadataIndex
        or type(index.fqn) is not str
        or not (index.offset is None or _shape(index.offset))
        or not (index.index is None or _natural(index.index))
    ):
        return f"it keys an item by {_shown(index)}"
    fqn = index.fqn[:120]
    if type(info) is not StorageInfo:
        return f"{fqn!r} lies in a {type(info).__name__}, not a file record"
    path = info.relative_path
    if type(path) is not str or not _PLAIN_NAME.match(path) or path in (".", "..", METADATA):
        return f"{fqn!r} lies in {_shown(path)}, not a data file in the checkpoint's directory"
    if not _natural(info.offset) or not _natural(info.length):
        return f"{fqn!r} lies at offset {_shown(info.offset)}, length {_shown(info.length)}"
    descriptors = info.transform_descriptors
    if descriptors is not None and (
        type(descriptors) not in (list, tuple) or not all(type(d) is str for d in descriptors)
    ):
        return f"{fqn!r} has the transforms {_shown(descriptors)}"
    if files is not None:
        record = files.get(path)
        if record is None:
            return f"{fqn!r} lies in {path!r}, a file the commit marker does not name"
        size = record.get("size")
        if type(size) is not int or size < 0 or info.offset + info.length > size:
            return (
                f"{fqn!r} lies at bytes {info.offset}..{info.offset + info.length} of {path!r}, "
                f"which the commit marker records as {size} bytes"
            )
    return ""


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


__all__ = ["ALLOWED", "read_metadata", "structure_problem"]
