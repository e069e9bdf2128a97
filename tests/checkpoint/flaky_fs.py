"""A local filesystem under ``flaky://`` whose writes fail on demand (a test double for storage).

Writes to any path containing one of the comma-separated substrings in
``$FLAKY_FAIL`` raise ``OSError``; everything else behaves like local files.
"""

from __future__ import annotations

import os
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

FAIL_ENV = "FLAKY_FAIL"


class FlakyFileSystem(LocalFileSystem):
    """Local files, except that writes to matching paths fail."""

    protocol = ("flaky",)

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, str) and path.startswith("flaky://"):
            path = path[len("flaky://") :]
        return super()._strip_protocol(path)

    def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        patterns = [p for p in os.environ.get(FAIL_ENV, "").split(",") if p]
        if any(ch in mode for ch in "wa") and any(p in path for p in patterns):
            raise OSError(f"injected storage failure writing {path}")
        return super()._open(path, mode, *args, **kwargs)


def register() -> None:
    """Make ``flaky://`` known to fsspec in this process."""
    fsspec.register_implementation("flaky", FlakyFileSystem, clobber=True)
