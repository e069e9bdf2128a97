"""The DCP planning codec: torch's save and load plans as checked JSON, never pickles.

torch's ``dcp.save`` and ``dcp.load`` move the save and load plans, the write results and
the global metadata between ranks as pickles, so any member of the checkpoint group could
run code in another. :mod:`elastic.checkpoint.dcp_driver` sends them as JSON made here:

* :func:`encode` / :func:`decode` know exactly the planning types of torch 2.14
  (:data:`CLASSES`: plans, their items, indices, chunk and tensor properties, write
  results, the filesystem writer's storage records, enums, ``torch.Size``, dtypes,
  layouts, memory formats) and plain values; tuples stay tuples, dicts travel as
  key/value pairs (keys of any allowed type). Anything else, a wrong number of fields,
  a value of the wrong type, an integer outside int64, nesting deeper than
  :data:`MAX_DEPTH` is a :class:`~elastic.errors.CheckpointError` in one sentence;
  a message is at most ``wire.MAX_WIRE`` (8 MiB) per rank. ResNet-18's
  save plan (195 items with SGD's momentum) is 43 KB of JSON, some 220 bytes a
  tensor, so the cap fits models of up to about 35k tensors.
* The classes a plan holds hundreds of (write and read items, indices, write results)
  travel in a compact form (fields in place, shapes as plain lists): 5x faster than
  the generic form, with the same checks.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

from elastic.checkpoint.storage import StorageInfo, StoragePrefix
from elastic.errors import CheckpointError

T = TypeVar("T")
MAX_DEPTH = 32  # nesting of one encoded value (a plan is 6 deep, planner_data a few more)
MAX_DIMS = 64  # dimensions of a torch.Size (torch's own limit for a tensor's dims)
_INT64 = (-(1 << 63), (1 << 63) - 1)


Check = Callable[[Any], bool]


def _is(*types: type) -> Check:
    return lambda value: type(value) in types


def _optional(check: Check) -> Check:
    return lambda value: value is None or check(value)


def _list_of(check: Check) -> Check:
    return lambda value: type(value) is list and all(check(v) for v in value)


def _sequence_of(check: Check) -> Check:
    return lambda value: type(value) in (list, tuple) and all(check(v) for v in value)


def _any(value: Any) -> bool:
    return True


_str = _is(str)
_bool = _is(bool)
_int = _is(int)
_size = _is(torch.Size)
_natural: Check = lambda value: type(value) is int and value >= 0  # noqa: E731


@dataclasses.dataclass(frozen=True)
class _Class:
    """How one allowed class travels: its fields, in order, each with its check."""

    cls: type
    fields: tuple[tuple[str, Check], ...]


def _spec(cls: type, **fields: Check) -> _Class:
    names = tuple(f.name for f in dataclasses.fields(cls))
    if names != tuple(fields):  # a torch release changed the class: fail at import
        raise ImportError(f"{cls.__qualname__} has the fields {names}, not {tuple(fields)}")
    return _Class(cls, tuple(fields.items()))


_index = _is(MetadataIndex)
_SPECS = [
    _spec(MetadataIndex, fqn=_str, offset=_optional(_size), index=_optional(_natural)),
    _spec(ChunkStorageMetadata, offsets=_size, sizes=_size),
    _spec(
        TensorProperties,
        dtype=_is(torch.dtype),
        layout=_is(torch.layout),
        requires_grad=_bool,
        memory_format=_is(torch.memory_format),
        pin_memory=_bool,
    ),
    _spec(
        TensorWriteData,
        chunk=_is(ChunkStorageMetadata),
        properties=_is(TensorProperties),
        size=_size,
    ),
    _spec(
        WriteItem,
        index=_index,
        type=_is(WriteItemType),
        bytes_io_data=_optional(_is(BytesIOWriteData)),
        tensor_data=_optional(_is(TensorWriteData)),
    ),
    _spec(
        SavePlan, items=_list_of(_is(WriteItem)), storage_data=_any, planner_data=_any, usable=_bool
    ),
    _spec(
        ReadItem,
        type=_is(LoadItemType),
        dest_index=_index,
        dest_offsets=_size,
        storage_index=_index,
        storage_offsets=_size,
        lengths=_size,
    ),
    _spec(LoadPlan, items=_list_of(_is(ReadItem)), storage_data=_any, planner_data=_any),
    _spec(WriteResult, index=_index, size_in_bytes=_natural, storage_data=_any),
    _spec(
        StorageInfo,
        relative_path=_str,
        offset=_natural,
        length=_natural,
        transform_descriptors=_optional(_sequence_of(_str)),
    ),
    _spec(StoragePrefix, prefix=_str),
    _spec(BytesIOWriteData, nbytes=_natural),
]

_ENUMS: tuple[type[enum.Enum], ...] = (WriteItemType, LoadItemType)


def _named(kind: type) -> dict[str, Any]:
    """torch's values of ``kind`` (dtype, layout, memory_format) by their name."""
    found = (getattr(torch, name, None) for name in dir(torch))
    return {str(v).removeprefix("torch."): v for v in found if isinstance(v, kind)}


# Tag -> how to build it. Every other tag, hence every other class, is refused.
_BY_TAG: dict[str, _Class] = {spec.cls.__name__: spec for spec in _SPECS}
_BY_TYPE: dict[type, _Class] = {spec.cls: spec for spec in _SPECS}
_ENUM_BY_TAG: dict[str, type[enum.Enum]] = {e.__name__: e for e in _ENUMS}
_VALUES: dict[str, dict[str, Any]] = {
    "dtype": _named(torch.dtype),
    "layout": _named(torch.layout),
    "memory_format": _named(torch.memory_format),
}
_VALUE_TYPES: dict[type, str] = {
    torch.dtype: "dtype",
    torch.layout: "layout",
    torch.memory_format: "memory_format",
}
# The allowed classes, by the tag they travel under (for the record and the tests).
CLASSES: dict[str, type] = {
    **{tag: spec.cls for tag, spec in _BY_TAG.items()},
    **_ENUM_BY_TAG,
    "Size": torch.Size,
    "tuple": tuple,
    "list": list,
    "dict": dict,
    "dtype": torch.dtype,
    "layout": torch.layout,
    "memory_format": torch.memory_format,
}
_CONTAINERS = {"tuple", "list", "dict", "Size"}


def encode(value: Any, depth: int = 0) -> Any:
    """``value`` as JSON-encodable data that :func:`decode` turns back into an equal value.

    Scalars (``None``, bools, int64 integers, finite floats, strings) stay as they are;
    anything else becomes a list whose first element names its type (:data:`CLASSES`).

    Raises:
        CheckpointError: ``value`` holds something outside :data:`CLASSES`, an integer
            outside int64, a non-finite float, or nests deeper than :data:`MAX_DEPTH`.
    """
    if depth > MAX_DEPTH:
        raise CheckpointError(
            f"A checkpoint planning value nests deeper than {MAX_DEPTH} levels; it is not sent."
        )
    kind = type(value)
    if value is None or kind is str or kind is bool:
        return value
    if kind is int:
        if not _INT64[0] <= value <= _INT64[1]:
            raise CheckpointError(
                f"The checkpoint planning integer {value} does not fit in 64 bits; it is not sent."
            )
        return value
    if kind is float:
        if not math.isfinite(value):
            raise CheckpointError(
                f"The checkpoint planning number {value} is not finite; it is not sent."
            )
        return value
    d = depth + 1
    if kind is torch.Size:
        return ["Size", *(encode(v, d) for v in value)]
    if kind is tuple:
        if all(type(v) is str for v in value):  # a flatten mapping's path: fast
            return ["tuple", *value]
        return ["tuple", *(encode(v, d) for v in value)]
    if kind is list:
        return ["list", *(encode(v, d) for v in value)]
    if kind is dict:
        out: list[Any] = ["dict"]
        for key, item in value.items():
            out += (encode(key, d), encode(item, d))
        return out
    compact = _COMPACT_BY_TYPE.get(kind)
    if compact is not None:
        return compact[1](value, d)
    spec = _BY_TYPE.get(kind)
    if spec is not None:
        return [kind.__name__, *(encode(getattr(value, name), d) for name, _ in spec.fields)]
    if kind in _ENUMS:
        return [kind.__name__, value.name]
    if kind in _VALUE_TYPES:
        return [_VALUE_TYPES[kind], str(value).removeprefix("torch.")]
    raise _unsendable(kind)


def _unsendable(kind: type) -> CheckpointError:
    return CheckpointError(
        f"A checkpoint planning value holds a {kind.__module__}.{kind.__qualname__} (or one "
        "of its fields is of a type outside the few the ranks may exchange); it is not sent."
    )


def decode(data: Any, sender: str = "a rank", depth: int = 0) -> Any:
    """The value that :func:`encode` made ``data`` from, built only from :data:`CLASSES`.

    Raises:
        CheckpointError: ``data`` names another type, has the wrong fields or values of
            the wrong types, or nests deeper than :data:`MAX_DEPTH` (one sentence naming
            ``sender``).
    """
    if depth > MAX_DEPTH:
        raise _refused(sender, f"nests deeper than {MAX_DEPTH} levels")
    kind = type(data)
    if data is None or kind is str or kind is bool:
        return data
    if kind is int:
        if not _INT64[0] <= data <= _INT64[1]:
            raise _refused(sender, f"holds the integer {data}, which does not fit in 64 bits")
        return data
    if kind is float:
        if not math.isfinite(data):
            raise _refused(sender, f"holds the number {data}, which is not finite")
        return data
    if kind is not list or not data or type(data[0]) is not str:
        raise _refused(sender, f"holds {_shown(data)}, which is no encoded value")
    tag, rest = data[0], data[1:]
    d = depth + 1
    if tag in _CONTAINERS:
        plain = all(type(v) is str for v in rest)  # a flatten mapping's path: fast
        values = rest if plain else [decode(v, sender, d) for v in rest]
        return _container(tag, values, sender)
    compact = _COMPACT.get(tag)
    if compact is not None:
        if compact[0] and len(rest) != compact[0]:
            raise _refused(sender, f"gives {tag} {len(rest)} fields, where it has {compact[0]}")
        try:
            return compact[2](rest, sender, d)
        except (TypeError, ValueError, KeyError) as exc:  # a value of the wrong kind
            raise _refused(sender, f"holds a {tag} with a wrong field ({str(exc)[:80]})") from exc
    spec = _BY_TAG.get(tag)
    if spec is not None:
        if len(rest) != len(spec.fields):
            raise _refused(
                sender, f"gives {tag} {len(rest)} fields, where it has {len(spec.fields)}"
            )
        fields: dict[str, Any] = {}
        for (name, check), item in zip(spec.fields, rest, strict=True):
            value = decode(item, sender, d)
            if not check(value):
                raise _refused(sender, f"gives {tag}.{name} the value {_shown(value)}")
            fields[name] = value
        try:
            return spec.cls(**fields)
        except (TypeError, ValueError) as exc:  # a constructor's own check
            raise _refused(sender, f"holds a {tag} that cannot be built ({exc})") from exc
    if tag in _ENUM_BY_TAG or tag in _VALUES:
        names: Any = _ENUM_BY_TAG[tag].__members__ if tag in _ENUM_BY_TAG else _VALUES[tag]
        if len(rest) != 1 or type(rest[0]) is not str or rest[0] not in names:
            raise _refused(sender, f"names the unknown {tag} {_shown(rest)}")
        return names[rest[0]]
    raise _refused(sender, f"names the type {_shown(tag)}, which the ranks may not exchange")


def _container(tag: str, values: list[Any], sender: str) -> Any:
    if tag == "list":
        return values
    if tag == "tuple":
        return tuple(values)
    if tag == "Size":
        if len(values) > MAX_DIMS or not all(_natural(v) for v in values):
            raise _refused(sender, f"holds the tensor shape {_shown(values)}")
        return torch.Size(values)
    if len(values) % 2:
        raise _refused(sender, "holds a dict with a key but no value")
    out: dict[Any, Any] = {}
    for key, value in zip(values[::2], values[1::2], strict=True):
        try:
            out[key] = value
        except TypeError as exc:  # an unhashable key
            raise _refused(sender, f"holds a dict keyed by {_shown(key)}") from exc
    return out


# -- compact forms of the classes a plan holds hundreds of (tags, fields in place, shapes as
# plain lists of integers): 5x faster than the generic form, with the same checks.


def _shape(value: Any) -> torch.Size:
    if type(value) is not list or len(value) > MAX_DIMS:
        raise ValueError(f"{_shown(value)} is no tensor shape")
    for v in value:
        if type(v) is not int or v < 0 or v > _INT64[1]:
            raise ValueError(f"{_shown(value)} is no tensor shape")
    return torch.Size(value)


def _text(value: Any) -> str:
    if type(value) is not str:
        raise ValueError(f"{_shown(value)} is no string")
    return value


def _count(value: Any) -> int:
    if type(value) is not int or not 0 <= value <= _INT64[1]:
        raise ValueError(f"{_shown(value)} is no count")
    return value


def _flag(value: Any) -> bool:
    if type(value) is not bool:
        raise ValueError(f"{_shown(value)} is no bool")
    return value


def _name(table: Mapping[str, Any], value: Any) -> Any:
    if type(value) is not str or value not in table:
        raise ValueError(f"{_shown(value)} is no known name")
    return table[value]


def _build(cls: type[T], **fields: Any) -> T:
    """A ``cls`` (a dataclass of plain fields, no ``__post_init__``) from checked fields,
    without its ``__init__`` (frozen dataclasses set each field through a slow path):
    the same object, 30% faster to decode."""
    obj = object.__new__(cls)
    obj.__dict__.update(fields)
    return obj


def _index_out(index: MetadataIndex) -> list[Any]:
    offset = index.offset
    return [index.fqn, None if offset is None else list(offset), index.index]


def _index_in(value: Any) -> MetadataIndex:
    if type(value) is not list or len(value) != 3:
        raise ValueError(f"{_shown(value)} is no metadata index")
    fqn, offset, hint = value
    return _build(
        MetadataIndex,
        fqn=_text(fqn),
        offset=None if offset is None else _shape(offset),
        index=None if hint is None else _count(hint),
    )


_DTYPES, _LAYOUTS, _FORMATS = (_named(t) for t in (torch.dtype, torch.layout, torch.memory_format))
_WRITE_TYPES = WriteItemType.__members__
_LOAD_TYPES = LoadItemType.__members__


_NAMES: dict[Any, str] = {
    value: name for table in (_DTYPES, _LAYOUTS, _FORMATS) for name, value in table.items()
}


def _name_of(value: Any) -> str:
    name = _NAMES.get(value)
    if name is None:
        raise _unsendable(type(value))
    return name


def _write_item_out(item: WriteItem, depth: int) -> list[Any]:
    data = item.tensor_data
    tensor: list[Any] | None = None
    if data is not None:
        if type(data) is not TensorWriteData or type(data.chunk) is not ChunkStorageMetadata:
            raise _unsendable(WriteItem)
        p = data.properties
        if type(p) is not TensorProperties:
            raise _unsendable(WriteItem)
        tensor = [
            list(data.chunk.offsets),
            list(data.chunk.sizes),
            _name_of(p.dtype),
            _name_of(p.layout),
            p.requires_grad,
            _name_of(p.memory_format),
            p.pin_memory,
            list(data.size),
        ]
    if type(item.index) is not MetadataIndex or type(item.type) is not WriteItemType:
        raise _unsendable(WriteItem)
    bio = item.bytes_io_data
    return [
        "WriteItem",
        *_index_out(item.index),
        item.type.name,
        encode(bio, depth),
        tensor,
    ]


def _write_item_in(rest: list[Any], sender: str, depth: int) -> WriteItem:
    fqn, offset, hint, kind, bio, tensor = rest
    data = None
    if tensor is not None:
        if type(tensor) is not list or len(tensor) != 8:
            raise ValueError(f"{_shown(tensor)} is no tensor's write data")
        offsets, sizes, dtype, layout, grad, fmt, pinned, size = tensor
        data = _build(
            TensorWriteData,
            chunk=_build(ChunkStorageMetadata, offsets=_shape(offsets), sizes=_shape(sizes)),
            properties=_build(
                TensorProperties,
                dtype=_name(_DTYPES, dtype),
                layout=_name(_LAYOUTS, layout),
                requires_grad=_flag(grad),
                memory_format=_name(_FORMATS, fmt),
                pin_memory=_flag(pinned),
            ),
            size=_shape(size),
        )
    bytes_io = None if bio is None else decode(bio, sender, depth)
    if bytes_io is not None and type(bytes_io) is not BytesIOWriteData:
        raise ValueError(f"{_shown(bytes_io)} is no BytesIOWriteData")
    return _build(
        WriteItem,
        index=_index_in([fqn, offset, hint]),
        type=_name(_WRITE_TYPES, kind),
        bytes_io_data=bytes_io,
        tensor_data=data,
    )


def _read_item_out(item: ReadItem, depth: int) -> list[Any]:
    if (
        type(item.type) is not LoadItemType
        or type(item.dest_index) is not MetadataIndex
        or type(item.storage_index) is not MetadataIndex
    ):
        raise _unsendable(ReadItem)
    return [
        "ReadItem",
        item.type.name,
        _index_out(item.dest_index),
        list(item.dest_offsets),
        _index_out(item.storage_index),
        list(item.storage_offsets),
        list(item.lengths),
    ]


def _read_item_in(rest: list[Any], sender: str, depth: int) -> ReadItem:
    kind, dest, dest_offsets, storage, storage_offsets, lengths = rest
    return _build(
        ReadItem,
        type=_name(_LOAD_TYPES, kind),
        dest_index=_index_in(dest),
        dest_offsets=_shape(dest_offsets),
        storage_index=_index_in(storage),
        storage_offsets=_shape(storage_offsets),
        lengths=_shape(lengths),
    )


def _index_item_out(index: MetadataIndex, depth: int) -> list[Any]:
    return ["MetadataIndex", *_index_out(index)]


def _index_item_in(rest: list[Any], sender: str, depth: int) -> MetadataIndex:
    return _index_in(rest)


def _result_out(result: WriteResult, depth: int) -> list[Any]:
    if type(result.index) is not MetadataIndex:
        raise _unsendable(WriteResult)
    out = ["WriteResult", _index_out(result.index), result.size_in_bytes]
    info = result.storage_data
    if type(info) is StorageInfo and info.transform_descriptors is None:  # 5 fields
        return [*out, info.relative_path, info.offset, info.length]
    return [*out, encode(info, depth)]  # 3 fields: any other storage data


def _result_in(rest: list[Any], sender: str, depth: int) -> WriteResult:
    if len(rest) == 5:
        index, size, path, offset, length = rest
        info: Any = StorageInfo(_text(path), _count(offset), _count(length))
    elif len(rest) == 3:
        index, size, where = rest
        info = decode(where, sender, depth)
    else:
        raise _refused(sender, f"gives WriteResult {len(rest)} fields, where it has 3 or 5")
    return WriteResult(index=_index_in(index), size_in_bytes=_count(size), storage_data=info)


# tag -> (number of fields (0: the decoder checks), encoder, decoder)
_COMPACT: dict[str, tuple[int, Callable[..., list[Any]], Callable[..., Any]]] = {
    "WriteItem": (6, _write_item_out, _write_item_in),
    "ReadItem": (6, _read_item_out, _read_item_in),
    "MetadataIndex": (3, _index_item_out, _index_item_in),
    "WriteResult": (0, _result_out, _result_in),
}
_COMPACT_BY_TYPE = {
    WriteItem: _COMPACT["WriteItem"],
    ReadItem: _COMPACT["ReadItem"],
    MetadataIndex: _COMPACT["MetadataIndex"],
    WriteResult: _COMPACT["WriteResult"],
}


def _shown(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 80 else shown[:77] + "..."


def _refused(sender: str, problem: str) -> CheckpointError:
    return CheckpointError(
        f"The checkpoint planning message from {sender} {problem}; it is refused: check that "
        "every node runs the same version."
    )


def decode_as(cls: type[T], data: Any, sender: str = "a rank") -> T:
    """:func:`decode`, and the value must be a ``cls``."""
    value = decode(data, sender)
    if type(value) is not cls:
        raise _refused(sender, f"holds a {type(value).__name__} where a {cls.__name__} belongs")
    return value


def decode_list(cls: type[T], data: Any, sender: str = "a rank") -> list[T]:
    """:func:`decode`, and the value must be a list of ``cls``."""
    value = decode(data, sender)
    if type(value) is not list or not all(type(v) is cls for v in value):
        raise _refused(sender, f"holds {_shown(value)} where a list of {cls.__name__} belongs")
    return value


__all__ = ["CLASSES", "MAX_DEPTH", "MAX_DIMS", "decode", "decode_as", "decode_list", "encode"]
