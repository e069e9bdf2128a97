"""Checkpoint layout, commit markers, and the search for the newest complete step.

Layout::

    <url>/<run_id>/step-<N>/                         one step (any world size)
    <url>/<run_id>/step-<N>/save-<nonce>/            one save attempt: a DCP checkpoint
    <url>/<run_id>/step-<N>/save-<nonce>/.metadata   DCP's plan, after every rank's shards
    <url>/<run_id>/step-<N>/save-<nonce>/__<r>_0.distcp
    <url>/<run_id>/step-<N>/COMMIT.json              the commit marker, written last

Every save writes into a fresh ``save-<nonce>`` directory, so a save never
deletes or overwrites anything to make room: a stale or failing writer cannot
damage a committed step. The commit marker names the attempt, the run, the
writers' rendezvous job and round, and every file with its size and digest
(:mod:`elastic.checkpoint.digest`: CRC-32, or when signed AES-GMAC under a key of the
file's own; ``.metadata`` with its SHA-256); with a job secret (:mod:`elastic.secret`)
it carries an HMAC-SHA256 over all of that. It replaces any older marker of the
step atomically (temporary file + rename).

A step is *complete* only when ``COMMIT.json`` exists, is well formed, names
this run, is signed with this job's secret (when there is one), and every file
it lists exists with the recorded size (and, with ``verify="full"``, the
recorded digest; a signed marker must vouch for every file by a MAC or a SHA-256, and
its MACs are checked with keys derived from the job secret). Anything else is never
loaded. Markers written before this layout (no ``attempt``: the files lie in the
step directory) are still read when no secret is configured.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import fsspec

from elastic import env, runid
from elastic import secret as signing
from elastic.checkpoint.digest import KEYED, STRONG, FileKeys, matches, recorded_kind
from elastic.checkpoint.storage import (
    METADATA,
    filesystem,
    join,
    write_atomically,
)
from elastic.errors import CheckpointError, ConfigError

logger = logging.getLogger(__name__)

COMMIT_MARKER = "COMMIT.json"
MARKER_VERSION = 4  # 4: a signed marker vouches for data files by GMAC (3: a SHA-256 tree)
_STRONG_SINCE = 3  # signed markers from this version on must vouch by STRONG digests only
_STEP_DIR = re.compile(r"^step-(\d+)$")
_ATTEMPT = re.compile(r"^save-[0-9a-f]{8,64}$")
FILE_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")
Verify = Literal["full", "size"]
_WARNED_WEAK: list[bool] = []  # the CRC-only signed marker warning, once per process
_WARNED_KEYLESS: list[bool] = []  # the MACs-unchecked-without-the-secret warning, once


@dataclass(frozen=True)
class StepInfo:
    """One step directory and what its commit marker says.

    ``url`` is where the step's DCP files lie (the committed attempt's directory,
    or the step directory when there is no well-formed marker); ``step_dir`` is
    the step directory. ``foreign`` marks a well-formed marker that is not this
    run's (another run id, or not signed with this job's secret): never loaded,
    never purged.
    """

    step: int
    url: str
    complete: bool
    reason: str = ""
    marker: dict[str, Any] | None = None
    digest: str = ""
    foreign: bool = False
    step_dir: str = ""

    @property
    def data_url(self) -> str:
        """The directory that holds the DCP files of the committed attempt."""
        return self.url

    @property
    def metadata_record(self) -> dict[str, Any] | None:
        """What the marker says about ``.metadata`` (size, CRC-32, SHA-256)."""
        files = (self.marker or {}).get("files") or {}
        return files.get(METADATA)


def validate_run_id(run_id: str) -> str:
    """Return ``run_id`` if it names one directory; raise ``ConfigError`` otherwise."""
    if not isinstance(run_id, str) or not run_id or run_id in (".", "..") or "/" in run_id:
        raise ConfigError(
            f"The run id {run_id!r} is invalid: it names a checkpoint directory, so it must "
            "be a non-empty name other than '.' or '..' without '/'."
        )
    size = len(run_id.encode(errors="replace"))
    if size > runid.MAX_LENGTH:
        raise ConfigError(
            f"The run id {run_id[:40]!r}... is {size} bytes long: it names a directory, so "
            f"use at most {runid.MAX_LENGTH}."
        )
    if "\0" in run_id or "\\" in run_id:
        raise ConfigError(
            f"The run id {run_id!r} is invalid: it must not contain NUL or '\\'; use letters, "
            "digits, '.', '_' and '-'."
        )
    return run_id


def run_url(url: str, run_id: str) -> str:
    """Return ``<url>/<run_id>``."""
    return join(url, validate_run_id(run_id))


def step_url(url: str, run_id: str, step: int) -> str:
    """Return ``<url>/<run_id>/step-<step>``."""
    return join(url, validate_run_id(run_id), f"step-{int(step)}")


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


def make_marker(
    step: int,
    world_size: int,
    files: dict[str, dict[str, Any]],
    *,
    run: str,
    attempt: str,
    job: str | None = None,
    round_: int | None = None,
    secret: bytes | None = None,
) -> bytes:
    """Return the bytes of a commit marker (signed when ``secret`` is given)."""
    marker: dict[str, Any] = {
        "version": MARKER_VERSION,
        "step": step,
        "world_size": world_size,
        "time": time.time(),
        "run": run,
        "job": job,
        "round": round_,
        "attempt": attempt,
        "files": files,
    }
    if secret is not None:
        marker["hmac"] = signing.sign(secret, _signed_content(marker))
    return json.dumps(marker, sort_keys=True).encode()


def marker_digest(data: bytes) -> str:
    """The SHA-256 of a marker's bytes: what the commit record in etcd vouches for."""
    return hashlib.sha256(data).hexdigest()


def write_marker(step_dir: str, data: bytes) -> None:
    """Atomically replace the commit marker of a step whose files are all durable."""
    fs, root = filesystem(step_dir)
    write_atomically(fs, f"{root}/{COMMIT_MARKER}", data)


def new_attempt() -> str:
    """A fresh save-attempt directory name."""
    import secrets

    return f"save-{secrets.token_hex(8)}"


def inspect_step(
    url: str,
    run_id: str,
    step: int,
    verify: Verify = "full",
    secret: bytes | None = None,
) -> StepInfo:
    """Decide whether one step is complete; say why not if it is not.

    Never raises for anything found in storage: a missing, unreadable or
    malformed marker or file makes the step incomplete, with the reason.
    """
    target = step_url(url, run_id, step)
    fs, root = filesystem(target)
    try:
        with fs.open(f"{root}/{COMMIT_MARKER}", "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return StepInfo(step, target, False, "no commit marker")
    except OSError as exc:
        return StepInfo(step, target, False, f"unreadable commit marker ({exc})")
    try:
        marker = json.loads(data)
    except ValueError as exc:
        return StepInfo(step, target, False, f"unreadable commit marker ({exc})")
    digest = marker_digest(data)
    problem = _malformed(marker, step)
    if problem:
        return StepInfo(step, target, False, f"malformed commit marker ({problem})", None, digest)
    data_url = join(target, marker["attempt"]) if marker.get("attempt") else target

    def verdict(reason: str = "", foreign: bool = False) -> StepInfo:
        url = data_url if not reason or foreign else target
        return StepInfo(step, url, not reason, reason, marker, digest, foreign, target)

    if marker.get("run", run_id) != run_id:
        return verdict(f"commit marker belongs to run {marker['run']!r}, not {run_id!r}", True)
    if secret is not None:
        if "hmac" not in marker:
            return verdict(
                "commit marker is not signed (forged, or written without the job secret)", True
            )
        if not signing.verify(secret, _signed_content(marker), marker["hmac"]):
            return verdict(
                "commit marker signature does not match this job's secret (forged or foreign)",
                True,
            )
        weak = _weakly_vouched(marker)
        if weak:
            return verdict(weak)
    dfs, droot = filesystem(data_url)
    keys = None if secret is None else FileKeys(secret, run_id, step, marker.get("attempt") or "")
    for name, expected in marker["files"].items():
        problem = _check_file(dfs, f"{droot}/{name}", name, expected, verify, keys)
        if problem:
            return verdict(f"{name}: {problem}")
    return verdict()


def _weakly_vouched(marker: Mapping[str, Any]) -> str:
    """Why a signed marker does not vouch for its files by a MAC or a SHA-256, or ``""``.

    Markers of version 2 (before the SHA-256 tree) vouch by CRC-32 only: still loaded, with a
    warning, so that a run resumes across the upgrade.
    """
    weak = sorted(n for n, e in marker["files"].items() if recorded_kind(e) not in STRONG)
    if not weak:
        return ""
    if int(marker.get("version") or 0) >= _STRONG_SINCE:
        return f"signed commit marker vouches for {weak[0]} by CRC-32 only (forged)"
    if not _WARNED_WEAK:
        _WARNED_WEAK.append(True)
        logger.warning(
            "A signed checkpoint marker of version %s vouches for its files by CRC-32 only: "
            "the storage could alter them undetected; new saves vouch by a keyed MAC.",
            marker.get("version"),
        )
    return ""


def _signed_content(marker: Mapping[str, Any]) -> bytes:
    body = {k: v for k, v in marker.items() if k != "hmac"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _malformed(marker: Any, step: int) -> str:
    """What is wrong with a parsed marker's shape, or ``""``."""
    if not isinstance(marker, dict):
        return f"a {type(marker).__name__}, not an object"
    files = marker.get("files")
    if not isinstance(files, dict) or not files:
        return "no file list"
    if METADATA not in files:
        return f"lists no {METADATA}"
    for name, entry in files.items():
        if not isinstance(name, str) or not FILE_NAME.match(name) or name in (".", ".."):
            return f"bad file name {name!r}"
        if not isinstance(entry, dict):
            return f"{name}: entry is not an object"
        size = entry.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return f"{name}: no valid size"
        if recorded_kind(entry) is None:
            return f"{name}: no digest (CRC-32, SHA-256, SHA-256 tree or GMAC)"
    if marker.get("step", step) != step:
        return f"names step {marker.get('step')!r}"
    attempt = marker.get("attempt")
    if attempt is not None and (not isinstance(attempt, str) or not _ATTEMPT.match(attempt)):
        return f"bad attempt {attempt!r}"
    run = marker.get("run")
    if run is not None and not isinstance(run, str):
        return "bad run id"
    return ""


def _check_file(
    fs: fsspec.AbstractFileSystem,
    path: str,
    name: str,
    expected: dict[str, Any],
    verify: Verify,
    keys: FileKeys | None,
) -> str:
    """Why the stored file ``name`` is not as ``expected`` records it, or ``""``. A MAC is
    checked with ``keys``; without them (no secret) the CRC-32 recorded beside it, or
    where there is none only the size (one warning)."""
    try:
        size = fs.info(path)["size"]
        if size != expected["size"]:
            return f"size {size} bytes, expected {expected['size']} (truncated or overwritten)"
        if verify != "full":
            return ""
        kind = recorded_kind(expected, keyed=keys is not None)
        if kind is None:
            _warn_keyless(path)
            return ""
        key = keys.key(name) if keys is not None and kind in KEYED else None
        if not matches(fs, path, kind, expected[kind], key):
            return "checksum mismatch (corrupt)"
    except FileNotFoundError:
        return "missing"
    except CheckpointError as exc:  # the MAC cannot be computed here (no cryptography)
        return str(exc).rstrip(".")
    except (OSError, KeyError, TypeError) as exc:
        return f"unreadable ({type(exc).__name__}: {exc})"
    return ""


def _warn_keyless(path: str) -> None:
    if not _WARNED_KEYLESS:
        _WARNED_KEYLESS.append(True)
        logger.warning(
            "Checkpoint file %s is vouched for by a keyed MAC, which only the job secret can "
            "check: without it its size is checked, not its contents; set $%s to check them.",
            path,
            env.SECRET_FILE,
        )


def complete_steps(
    url: str,
    run_id: str,
    verify: Verify = "full",
    warn: bool = True,
    secret: bytes | None = None,
    records: Mapping[int, Mapping[str, Any]] | None = None,
    skip: Callable[[StepInfo], bool] | None = None,
    skipped: list[StepInfo] | None = None,
) -> Iterator[StepInfo]:
    """Yield the complete steps of a run, best first, each inspected only when needed.

    With commit ``records`` (step -> record from etcd): steps that have a record
    come first, newest first, then the others; a step whose marker does not match
    its record (a stale or foreign writer's) is skipped. Skipped steps are logged
    once each (``warn``) and appended to ``skipped``.
    """
    steps = list_steps(url, run_id)
    if records:
        steps = [s for s in steps if s in records] + [s for s in steps if s not in records]
    for step in steps:
        info = inspect_step(url, run_id, step, verify, secret)
        if info.complete and records and step in records:
            expected = records[step].get("digest")
            if expected != info.digest:
                why = (
                    "its commit marker does not match the commit record in etcd (round "
                    f"{records[step].get('round')}); a stale or foreign writer replaced it"
                )
                info = StepInfo(step, info.step_dir, False, why, info.marker, info.digest)
        if not info.complete:
            if warn:
                logger.warning("Skipping checkpoint %s: %s.", info.url, info.reason)
            if skipped is not None:
                skipped.append(info)
            continue
        if skip is not None and skip(info):
            continue
        yield info


def find_latest_complete(
    url: str,
    run_id: str,
    verify: Verify = "full",
    warn: bool = True,
    secret: bytes | None = None,
    records: Mapping[int, Mapping[str, Any]] | None = None,
) -> StepInfo | None:
    """Return the best complete step of run ``run_id`` under ``url``, or ``None``.

    Newer partial or corrupt steps are skipped, each with a warning naming it.
    This is what ``elastic status`` and the worker's resume use.
    """
    return next(complete_steps(url, run_id, verify, warn, secret, records), None)


def purge(
    url: str,
    run_id: str,
    keep_last: int,
    protect: int | None = None,
    check: Callable[[], None] | None = None,
    secret: bytes | None = None,
) -> list[int]:
    """Delete all but the newest ``keep_last`` complete steps up to ``protect``.

    ``protect`` is the step this writer just committed (default: the newest
    complete step). Steps newer than it are never touched (another writer may
    own them), nor foreign steps (another run's marker, or not signed with this
    job's secret). Partial steps older than ``protect`` are deleted, and so are
    other attempts inside the kept steps. ``check`` (the commit fence) runs
    right before each deletion and raises to stop. Returns the deleted steps.
    """
    steps = list_steps(url, run_id)
    infos = {s: inspect_step(url, run_id, s, "size", secret) for s in steps}
    complete = [s for s in steps if infos[s].complete]
    upto = protect if protect is not None else (complete[0] if complete else None)
    if upto is None:
        return []
    ours = [s for s in complete if s <= upto]
    keep = set(ours[:keep_last]) | {upto}
    doomed = [s for s in steps if s < upto and s not in keep and not infos[s].foreign]
    for step in sorted(keep):
        if step in infos and infos[step].complete:
            _remove_other_attempts(infos[step], check)
    deleted = []
    for step in doomed:
        if check is not None:
            check()
        remove_step(step_url(url, run_id, step))
        deleted.append(step)
    return deleted


def _remove_other_attempts(info: StepInfo, check: Callable[[], None] | None) -> None:
    """Delete what failed or superseded attempts left next to a kept step's marker."""
    attempt = (info.marker or {}).get("attempt")
    if not attempt:
        return  # an old-layout step: its files lie in the step directory itself
    fs, root = filesystem(info.step_dir)
    fs.invalidate_cache(root)
    try:
        entries = fs.ls(root, detail=False)
    except FileNotFoundError:
        return
    for entry in entries:
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if name in (COMMIT_MARKER, attempt) or name.startswith(f".{COMMIT_MARKER}."):
            continue
        if check is not None:
            check()
        with contextlib.suppress(FileNotFoundError):
            fs.rm(f"{root}/{name}", recursive=True)


def remove_step(url: str) -> None:
    """Delete a step directory, marker first, so a half-deleted step reads as partial."""
    fs, root = filesystem(url)
    with contextlib.suppress(FileNotFoundError):
        fs.rm(f"{root}/{COMMIT_MARKER}")
    with contextlib.suppress(FileNotFoundError):
        fs.rm(root, recursive=True)


__all__ = [
    "COMMIT_MARKER",
    "FILE_NAME",
    "StepInfo",
    "complete_steps",
    "find_latest_complete",
    "inspect_step",
    "list_steps",
    "make_marker",
    "marker_digest",
    "new_attempt",
    "purge",
    "remove_step",
    "run_url",
    "step_url",
    "validate_run_id",
    "write_marker",
]
