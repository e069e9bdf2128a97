"""Checkpoint settings, validated: where (an fsspec URL) and how often checkpoints are written.

The floor that owns them: the checkpoint manager reads them, :class:`elastic.Run` takes
them as ``checkpoint=``, and the worker config (:mod:`elastic.training.config`) nests them
as its ``checkpoint:`` section.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

_URL_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*):")


class CheckpointConfig(BaseModel):
    """Where and how often checkpoints are written (the ``checkpoint:`` section of a worker
    config; :class:`elastic.Run` takes one as ``checkpoint=``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = "runs/checkpoints"
    interval: int = Field(50, ge=1, description="save every N steps")
    keep_last: int = Field(3, ge=1)
    async_save: bool = True
    max_failures: int = Field(3, ge=1, description="consecutive failed saves that stop the job")
    verify: Literal["full", "size"] = "full"
    enabled: bool = True
    init_from: str | None = Field(
        None, description="a plain DCP checkpoint (torchtitan, dcp.save) a new job starts from"
    )

    @field_validator("url")
    @classmethod
    def _valid_url(cls, url: str) -> str:
        return validate_url(url)

    @field_validator("init_from")
    @classmethod
    def _valid_init_from(cls, url: str | None) -> str | None:
        return None if url is None else validate_url(url)


def validate_url(url: str) -> str:
    """Return ``url`` if fsspec can address it, else raise ``ValueError``."""
    import fsspec

    if not url.strip():
        raise ValueError("the checkpoint URL is empty; give a path or a URL like s3://bucket/dir")
    scheme = _URL_SCHEME.match(url)
    if "://" not in url and scheme and len(scheme.group(1)) > 1:
        raise ValueError(f"malformed URL; did you mean {scheme.group(1)}://...?")
    if "://" in url:
        protocol = url.split("://", 1)[0]
        known = set(fsspec.available_protocols()) | set(fsspec.registry)
        if protocol not in known:
            raise ValueError(
                f"unknown storage protocol {protocol!r}; fsspec knows e.g. file, s3, gcs, memory"
            )
        if not url.split("://", 1)[1].strip("/"):
            raise ValueError("the URL has no path after the protocol")
    return url


__all__ = ["CheckpointConfig", "validate_url"]
