"""The snapshot's state layout: JSON metadata plus raw tensor bytes, no pickle.

:func:`flatten` turns a nested state (dicts, lists, tuples, numbers, strings, tensors,
numpy arrays) into a JSON-able tree in which every tensor is replaced by a reference
``{"__t": i}``, and the list of those tensors. :func:`layout` places the tensors in
one byte range (64-byte aligned), :func:`unflatten` rebuilds the state from the tree
and a byte buffer. Dicts are stored as key/value pairs so that integer keys (an
optimizer's parameter ids) come back as integers.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

import torch

from elastic.errors import RecoveryError

ALIGN = 64


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


def decode(meta: bytes, data: torch.Tensor, clone: bool = True) -> Any:
    """Rebuild the state from its metadata and the uint8 tensor ``data``.

    With ``clone`` every tensor is copied out of ``data`` (needed when ``data`` is a
    shared-memory mapping that will be written again).
    """
    try:
        doc = json.loads(meta)
        slots = [Slot(o, n, d, tuple(s)) for o, n, d, s in doc["slots"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise RecoveryError(
            f"The snapshot's metadata cannot be read ({exc}); it is corrupt."
        ) from exc
    if slots and slots[-1].offset + slots[-1].nbytes > data.numel():
        raise RecoveryError("The snapshot's data is shorter than its metadata says; it is corrupt.")

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
            return base64.b64decode(value["__b"])
        if "__dt" in value:
            return _dtype(value["__dt"])
        if "__np" in value:
            return tensor(value["__np"]).numpy()
        raise RecoveryError(f"The snapshot's metadata has an unknown node {sorted(value)}.")

    return dec(doc["tree"])


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
    """Inverse of :func:`to_json`."""
    doc = json.loads(text)
    raw = bytearray(base64.b64decode(doc["data"]))
    data = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return decode(doc["meta"].encode(), data)


__all__ = [
    "RecoveryError",
    "Slot",
    "decode",
    "encode_meta",
    "flatten",
    "from_json",
    "layout",
    "to_json",
    "view",
]
