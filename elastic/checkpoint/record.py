"""A tensor as the bytes ``torch.save`` writes for it, without serializing it through torch.

Torch's DCP stores each tensor as one ``torch.save`` record (a zip archive) and its stock
reader (``FileSystemReader``, ``dcp_to_torch_save``) ``torch.load``\\ s each record. Such a
record of a contiguous tensor whose storage is exactly its own bytes is three parts: a
small head (``data.pkl``, the format records, the local header of ``data/0``), the
tensor's raw bytes, and a small tail (data descriptor, version, serialization id, the
central directory). :func:`frame` asks torch for head and tail once per dtype and shape
(``torch.save`` under ``torch.serialization.skip_data``, which writes every header and
skips the data), so the writer sends the tensor's memory to the file as it is, between
them. The zip records carry CRC-32 0 as with ``torch.serialization.set_crc32_options(False)``
(``torch.load`` does not check them); the commit marker's digests guard the bytes.

A reader that finds a record starting with the head :func:`frame` gives for the dtype and
shape the metadata records knows where the raw bytes lie (:attr:`Frame.data_offset`);
records from torch's own writer of such tensors start with the same head.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
from torch.serialization import skip_data


@dataclass(frozen=True)
class Frame:
    """The bytes before (``head``) and after (``tail``) a tensor's raw bytes in its record."""

    head: bytes
    tail: bytes
    nbytes: int

    @property
    def data_offset(self) -> int:
        """Where the tensor's bytes start within the record."""
        return len(self.head)

    @property
    def length(self) -> int:
        """The size of the whole record."""
        return len(self.head) + self.nbytes + len(self.tail)


class _Recorder:
    """A write-only stream that keeps what ``torch.save`` writes and where it skips."""

    def __init__(self) -> None:
        self.position = 0
        self.parts: list[tuple[int, bytes]] = []
        self.gap: tuple[int, int] | None = None

    def write(self, data: bytes) -> int:
        self.parts.append((self.position, bytes(data)))
        self.position += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        target = offset if whence == os.SEEK_SET else self.position + offset
        if whence not in (os.SEEK_SET, os.SEEK_CUR) or self.gap is not None:
            raise ValueError("torch.save skipped data in an unexpected way")
        self.gap = (self.position, target)
        self.position = target
        return target

    def tell(self) -> int:
        return self.position

    def flush(self) -> None:
        pass


@functools.lru_cache(maxsize=4096)
def frame(dtype: torch.dtype, shape: tuple[int, ...]) -> Frame:
    """The record frame of a contiguous CPU tensor of ``dtype`` and ``shape``.

    Raises:
        ValueError: torch's writer did not leave exactly the tensor's bytes out.
    """
    template = torch.empty(shape, dtype=dtype)  # never touched: only its header is written
    nbytes = template.numel() * template.element_size()
    recorder = _Recorder()
    with skip_data():
        torch.save(template, recorder)  # type: ignore[arg-type]  # a file-like object
    start, end = recorder.gap if recorder.gap is not None else (recorder.position,) * 2
    if end - start != nbytes:
        raise ValueError(f"torch.save skipped {end - start} bytes for a tensor of {nbytes}")
    head = b"".join(data for at, data in recorder.parts if at < start)
    tail = b"".join(data for at, data in recorder.parts if at >= end)
    return Frame(head, tail, nbytes)


__all__ = ["Frame", "frame"]
