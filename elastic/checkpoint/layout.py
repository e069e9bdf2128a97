"""Checkpoint layout, commit markers, and the search for the newest complete step.

Layout::

    <url>/<run_id>/step-<N>/            one DCP checkpoint (any world size)
    <url>/<run_id>/step-<N>/.metadata   DCP's plan, written after every rank's shards
    <url>/<run_id>/step-<N>/__<r>_0.distcp
    <url>/<run_id>/step-<N>/COMMIT.json the commit marker, written last

A step is *complete* only when ``COMMIT.json`` exists, parses, and every file it
lists exists with the recorded size (and, with ``verify="full"``, the recorded
CRC-32). Anything else (no marker, a truncated or corrupt shard) is partial
and is never loaded.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
from dataclasses import dataclass
from typing import Any, Literal

import fsspec

from elastic.checkpoint.storage import crc32_of, filesystem, join, write_durably

logger = logging.getLogger(__name__)

COMMIT_MARKER = "COMMIT.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
Verify = Literal["full", "size"]


@dataclass(frozen=True)
class StepInfo:
    """One step directory and what its commit marker says."""

    step: int
    url: str
    complete: bool
    reason: str = ""
    marker: dict[str, Any] | None = None


def run_url(url: str, run_id: str) -> str:
    """Return ``<url>/<run_id>``."""
    return join(url, run_id)


def step_url(url: str, run_id: str, step: int) -> str:
    """Return ``<url>/<run_id>/step-<step>``."""
    return join(url, run_id, f"step-{step}")


def list_steps(url: str, run_id: str) -> list[int]:
    """Return every step that has a directory, newest first (complete or not)."""
    fs, root = filesystem(run_url(url, run_id))
    fs.invalidate_cache(root)  # s3fs & co. cache listings; other ranks/processes write here
    try:
        entries = fs.ls(root, detail=False)
    except FileNotFoundError:
        return []
    steps = []
    for entry in entries:
        match = _STEP_DIR.match(entry.rstrip("/").rsplit("/", 1)[-1])
        if match:
            steps.append(int(match.group(1)))
    return sorted(set(steps), reverse=True)


def write_commit(url: str, step: int, world_size: int, files: dict[str, dict[str, Any]]) -> None:
    """Write the commit marker for a step whose files are all durable."""
    fs, root = filesystem(url)
    marker = {"step": step, "world_size": world_size, "time": time.time(), "files": files}
    write_durably(fs, f"{root}/{COMMIT_MARKER}", json.dumps(marker, sort_keys=True).encode())


def inspect_step(url: str, run_id: str, step: int, verify: Verify = "full") -> StepInfo:
    """Decide whether one step is complete; say why not if it is not."""
    target = step_url(url, run_id, step)
    fs, root = filesystem(target)
    try:
        with fs.open(f"{root}/{COMMIT_MARKER}", "rb") as f:
            marker = json.loads(f.read())
        files: dict[str, dict[str, Any]] = marker["files"]
    except FileNotFoundError:
        return StepInfo(step, target, False, "no commit marker")
    except (ValueError, KeyError, TypeError) as exc:
        return StepInfo(step, target, False, f"unreadable commit marker ({exc})")
    if ".metadata" not in files:
        return StepInfo(step, target, False, "commit marker lists no .metadata")
    for name, expected in files.items():
        problem = _check_file(fs, f"{root}/{name}", expected, verify)
        if problem:
            return StepInfo(step, target, False, f"{name}: {problem}", marker)
    return StepInfo(step, target, True, "", marker)


def _check_file(
    fs: fsspec.AbstractFileSystem, path: str, expected: dict[str, Any], verify: Verify
) -> str:
    try:
        size = fs.info(path)["size"]
    except FileNotFoundError:
        return "missing"
    if size != expected["size"]:
        return f"size {size} bytes, expected {expected['size']} (truncated or overwritten)"
    if verify == "full" and crc32_of(fs, path) != expected.get("crc32"):
        return "checksum mismatch (corrupt)"
    return ""


def find_latest_complete(
    url: str, run_id: str, verify: Verify = "full", warn: bool = True
) -> StepInfo | None:
    """Return the newest complete step of run ``run_id`` under ``url``, or ``None``.

    Newer partial or corrupt steps are skipped, each with a warning naming it.
    This is what ``elastic status`` and the worker's resume use.
    """
    for step in list_steps(url, run_id):
        info = inspect_step(url, run_id, step, verify)
        if info.complete:
            return info
        if warn:
            logger.warning("Skipping checkpoint %s: %s.", info.url, info.reason)
    return None


def purge(url: str, run_id: str, keep_last: int, protect: int | None = None) -> list[int]:
    """Delete all but the newest ``keep_last`` complete steps and older partial ones.

    Never deletes ``protect`` (the newest complete step) nor any step newer than
    it (an in-flight save may be writing there). Returns the deleted steps.
    """
    steps = list_steps(url, run_id)
    complete = [s for s in steps if inspect_step(url, run_id, s, "size").complete]
    keep = set(complete[:keep_last])
    if protect is not None:
        keep.add(protect)
    newest_kept = max(keep, default=None)
    doomed = [s for s in steps if s not in keep and (newest_kept is None or s < newest_kept)]
    for step in doomed:
        remove_step(step_url(url, run_id, step))
    return doomed


def remove_step(url: str) -> None:
    """Delete a step directory, marker first, so a half-deleted step reads as partial."""
    fs, root = filesystem(url)
    with contextlib.suppress(FileNotFoundError):
        fs.rm(f"{root}/{COMMIT_MARKER}")
    with contextlib.suppress(FileNotFoundError):
        fs.rm(root, recursive=True)


__all__ = [
    "COMMIT_MARKER",
    "StepInfo",
    "find_latest_complete",
    "inspect_step",
    "list_steps",
    "purge",
    "remove_step",
    "run_url",
    "step_url",
    "write_commit",
]
