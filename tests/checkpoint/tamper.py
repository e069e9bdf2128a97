"""Tampering as a storage writer would: change bytes of a shard and restore its CRC-32."""

from __future__ import annotations

import pickle
import zlib
from pathlib import Path

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from elastic.checkpoint.record import frame


def tensor_offset(data_dir: Path, fqn: str) -> int:
    """Where the bytes of tensor ``fqn`` (one chunk) lie in its shard file."""
    metadata = pickle.loads((data_dir / ".metadata").read_bytes())  # our own test file
    meta = metadata.state_dict_metadata[fqn]
    assert isinstance(meta, TensorStorageMetadata)
    (index,) = [i for i in metadata.storage_data if i.fqn == fqn]
    info = metadata.storage_data[index]
    return info.offset + frame(meta.properties.dtype, tuple(meta.size)).data_offset


def restore_crc(data: bytearray, at: int, target: int) -> None:
    """Choose ``data[at:at + 4]`` so that the CRC-32 of ``data`` is ``target`` again
    (CRC-32 is affine over GF(2): solve for the 32 bits)."""

    def crc_with(value: int) -> int:
        data[at : at + 4] = value.to_bytes(4, "little")
        return zlib.crc32(data)

    base = crc_with(0)
    basis: list[tuple[int, int]] = []  # (vector, the patch bits that produce it)
    for bit in range(32):
        vector, combo = crc_with(1 << bit) ^ base, 1 << bit
        for known, known_combo in basis:
            if vector ^ known < vector:
                vector, combo = vector ^ known, combo ^ known_combo
        if vector:
            basis.append((vector, combo))
            basis.sort(reverse=True)
    want, patch = target ^ base, 0
    for known, known_combo in basis:
        if want ^ known < want:
            want, patch = want ^ known, patch ^ known_combo
    assert want == 0, "the 4 bytes cannot restore this CRC"
    crc_with(patch)
