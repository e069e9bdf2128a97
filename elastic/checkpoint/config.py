"""Checkpoint settings, validated: where (an fsspec URL) and how often checkpoints are written.

The floor that owns them: the checkpoint manager reads them, :class:`elastic.Run` takes
them as ``checkpoint=``, and the worker config (:mod:`elastic_tools.training.config`) nests them
as its ``checkpoint:`` section.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_URL_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*):")


INT64_MAX = 2**63 - 1  # every whole number of a config fits torch's int64 (steps go in tensors)


class BoundedModel(BaseModel):
    """A config section: unknown fields, inf and nan refused, whole numbers within int64."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="after")
    def _int64(self) -> BoundedModel:
        for name in type(self).model_fields:
            value = getattr(self, name)
            if type(value) is int and not -INT64_MAX <= value <= INT64_MAX:
                raise ValueError(f"{name} = {value} does not fit in 64 bits; use a smaller number")
        return self


class CheckpointConfig(BoundedModel):
    """Where and how often checkpoints are written (the ``checkpoint:`` section of a worker
    config; :class:`elastic.Run` takes one as ``checkpoint=``)."""

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
