"""The snapshot's state layout: JSON metadata plus raw tensor bytes, no pickle.

:func:`flatten` turns a nested state (dicts, lists, tuples, numbers, strings, tensors,
numpy arrays) into a JSON-able tree in which every tensor is replaced by a reference
``{"__t": i}``, and the list of those tensors. :func:`layout` places the tensors in
one byte range (64-byte aligned), :func:`unflatten` rebuilds the state from the tree
and a byte buffer. Dicts are stored as key/value pairs so that integer keys (an
optimizer's parameter ids) come back as integers.

Metadata is read as untrusted input (a snapshot file, a peer's stream): :func:`check` bounds
and validates it before anything is built (at most :data:`MAX_META` bytes and
:data:`MAX_DEPTH` levels; every slot a known type whose shape fills exactly its bytes, inside
the data; every reference to an existing slot), so a crafted or corrupt document is one
:class:`~elastic.errors.RecoveryError` sentence, never an ``IndexError`` or an allocation
beyond the data it came with.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from dataclasses import dataclass
from typing import Any

import torch

from elastic.errors import RecoveryError

ALIGN = 64
MAX_META = 64 << 20  # bytes of JSON metadata read at most
MAX_DEPTH = 64  # nesting levels of the state tree (an optimizer's state is ~6)
MAX_DIMS = 64
_REFS = ("__t", "__np")


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives in the data range."""

    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise RecoveryError(f"The snapshot names an unknown tensor type {name!r}; it is corrupt.")
    return value


def flatten(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """Return ``(tree, tensors)``: ``state`` with each tensor replaced by its index."""
    tensors: list[torch.Tensor] = []

    def enc(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value.detach())
            return {"__t": len(tensors) - 1}
        if value is None or isinstance(value, bool | int | float | str):
            return value
        if isinstance(value, dict):
            return {"__d": [[enc(k), enc(v)] for k, v in value.items()]}
        if isinstance(value, tuple):
            return {"__tu": [enc(v) for v in value]}
        if isinstance(value, list):
            return [enc(v) for v in value]
        if isinstance(value, bytes):
            return {"__b": base64.b64encode(value).decode()}
        if isinstance(value, torch.dtype):
            return {"__dt": _dtype_name(value)}
        kind = type(value).__module__
        if kind == "numpy":  # arrays and numpy scalars, e.g. in numpy's RNG state
            if hasattr(value, "shape") and value.shape:
                tensors.append(torch.from_numpy(value.copy()))
                return {"__np": len(tensors) - 1}
            return value.item()
        raise RecoveryError(
            f"Cannot snapshot a value of type {type(value).__name__} in the training state; "
            "only tensors, numbers, strings, bytes, lists, tuples and dicts are kept."
        )

    return enc(state), tensors


def layout(tensors: list[torch.Tensor]) -> tuple[list[Slot], int]:
    """Place ``tensors`` one after the other, aligned; return the slots and total size."""
    slots, offset = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        slots.append(Slot(offset, nbytes, _dtype_name(t.dtype), tuple(t.shape)))
        offset += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    return slots, offset


def encode_meta(tree: Any, slots: list[Slot]) -> bytes:
    """The metadata document: the tree and where each tensor is."""
    doc = {"tree": tree, "slots": [[s.offset, s.nbytes, s.dtype, list(s.shape)] for s in slots]}
    return json.dumps(doc, separators=(",", ":")).encode()


def view(data: torch.Tensor, slot: Slot) -> torch.Tensor:
    """The tensor of ``slot`` as a view of the uint8 tensor ``data`` (no copy)."""
    raw = data[slot.offset : slot.offset + slot.nbytes]
    dtype = _dtype(slot.dtype)
    if slot.nbytes == 0:
        return torch.empty(slot.shape, dtype=dtype)
    return raw.view(dtype).view(slot.shape)


def _corrupt(why: str) -> RecoveryError:
    return RecoveryError(f"The snapshot's metadata is corrupt ({why}); it is not used.")


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _slot(raw: Any, data_len: int) -> Slot:
    """One slot of the document, checked against the type, its shape and the data."""
    if not isinstance(raw, list) or len(raw) != 4:
        raise _corrupt("a slot is not [offset, bytes, type, shape]")
    offset, nbytes, name, shape = raw
    if not (_int(offset) and _int(nbytes) and isinstance(name, str) and isinstance(shape, list)):
        raise _corrupt("a slot's offset, size, type or shape is not what it must be")
    if len(shape) > MAX_DIMS or not all(_int(d) for d in shape):
        raise _corrupt(f"a slot's shape {shape[:8]} is not a list of sizes")
    dtype = _dtype(name)
    if math.prod(shape) * dtype.itemsize != nbytes:
        raise _corrupt(f"a {name} tensor of shape {shape[:8]} cannot take {nbytes} bytes")
    if offset + nbytes > data_len or offset % max(dtype.itemsize, 1):
        raise _corrupt(f"a slot at {offset} (+{nbytes}) lies outside {data_len} data bytes")
    return Slot(offset, nbytes, name, tuple(shape))


def _walk(value: Any, slots: int, depth: int = 0) -> None:
    """Check the tree's shape: its depth, node kinds and slot references."""
    if depth > MAX_DEPTH:
        raise _corrupt(f"the state is nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, list):
        for v in value:
            _walk(v, slots, depth + 1)
        return
    if not isinstance(value, dict):
        return
    if len(value) != 1:
        raise _corrupt(f"a node has the keys {sorted(value)[:4]}")
    ((kind, inner),) = value.items()
    if kind in _REFS:
        if not _int(inner) or inner >= slots:
            raise _corrupt(f"a tensor refers to slot {inner!r} of {slots}")
    elif kind == "__d":
        if not isinstance(inner, list) or not all(
            isinstance(kv, list) and len(kv) == 2 for kv in inner
        ):
            raise _corrupt("a dict is not a list of [key, value] pairs")
        _walk(inner, slots, depth + 1)
    elif kind == "__tu":
        if not isinstance(inner, list):
            raise _corrupt("a tuple is not a list")
        _walk(inner, slots, depth + 1)
    elif kind in ("__b", "__dt"):
        if not isinstance(inner, str):
            raise _corrupt(f"a {kind} node holds no string")
    else:
        raise _corrupt(f"an unknown node {kind!r}")


def parse(meta: bytes, data_len: int) -> tuple[Any, list[Slot]]:
    """The validated ``(tree, slots)`` of a metadata document over ``data_len`` data bytes.

    Raises:
        RecoveryError: the document is too large, not JSON, or does not describe the data.
    """
    if len(meta) > MAX_META:
        raise _corrupt(f"{len(meta)} bytes, over the {MAX_META} this node reads")
    try:
        doc = json.loads(meta)
    except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
        raise _corrupt(f"not JSON: {type(exc).__name__}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("slots"), list) or "tree" not in doc:
        raise _corrupt("not a document of a tree and its slots")
    slots = [_slot(raw, data_len) for raw in doc["slots"]]
    _walk(doc["tree"], len(slots))
    return doc["tree"], slots


def check(meta: bytes, data_len: int) -> None:
    """Raise :class:`RecoveryError` unless ``meta`` validly describes ``data_len`` bytes."""
    parse(meta, data_len)


def decode(meta: bytes, data: torch.Tensor, clone: bool = True) -> Any:
    """Rebuild the state from its metadata and the uint8 tensor ``data``.

    With ``clone`` every tensor is copied out of ``data`` (needed when ``data`` is a
    shared-memory mapping that will be written again).

    Raises:
        RecoveryError: the metadata is corrupt or does not describe ``data`` (one sentence).
    """
    tree, slots = parse(meta, data.numel())

    def tensor(i: int) -> torch.Tensor:
        t = view(data, slots[i])
        return t.clone() if clone else t

    def dec(value: Any) -> Any:
        if isinstance(value, list):
            return [dec(v) for v in value]
        if not isinstance(value, dict):
            return value
        if "__t" in value:
            return tensor(value["__t"])
        if "__d" in value:
            return {_key(dec(k)): dec(v) for k, v in value["__d"]}
        if "__tu" in value:
            return tuple(dec(v) for v in value["__tu"])
        if "__b" in value:
            return base64.b64decode(value["__b"], validate=True)
        if "__dt" in value:
            return _dtype(value["__dt"])
        return tensor(value["__np"]).numpy()

    try:
        return dec(tree)
    except (TypeError, ValueError, RuntimeError, binascii.Error) as exc:  # unhashable keys ...
        raise _corrupt(f"{type(exc).__name__}: {exc}") from exc


def _key(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


def to_json(state: Any) -> str:
    """Small states (a cursor, RNG states) as one JSON string, tensors inline (base64)."""
    tree, tensors = flatten(state)
    slots, size = layout(tensors)
    data = torch.zeros(size, dtype=torch.uint8)
    for t, slot in zip(tensors, slots, strict=True):
        if slot.nbytes:
            view(data, slot).copy_(t)
    blob = base64.b64encode(data.numpy().tobytes()).decode()
    return json.dumps({"meta": encode_meta(tree, slots).decode(), "data": blob})


def from_json(text: str) -> Any:
    """Inverse of :func:`to_json`.

    Raises:
        RecoveryError: ``text`` is not what :func:`to_json` writes (one sentence).
    """
    try:
        doc = json.loads(text)
        raw = bytearray(base64.b64decode(doc["data"], validate=True))
        meta = doc["meta"].encode()
    except (ValueError, RecursionError, TypeError, KeyError, AttributeError) as exc:
        raise _corrupt(f"not a state in JSON: {type(exc).__name__}") from exc
    data = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return decode(meta, data)


__all__ = [
    "MAX_META",
    "RecoveryError",
    "Slot",
    "check",
    "decode",
    "encode_meta",
    "flatten",
    "from_json",
    "layout",
    "parse",
    "to_json",
    "view",
]
