"""The private directory of an agent's node-local files: snapshots, channels, re-form markers.

Every node-local file of an agent lives in ``<base>/elastic-<uid>/<agent pid>/`` (``<base>``
is ``/dev/shm`` by default, ``<uid>`` the effective uid). Both directories belong to that uid
with mode 0700, so no other local user can enter them: nothing can be read, planted, replaced
or linked there. They are created exclusively (``mkdir``), never reached through a symlink
(``O_NOFOLLOW``), and each open checks with ``fstat`` that it got a file or directory of this
uid that no one else may read or write; anything else is refused in one sentence.

``/dev/shm`` is world-writable, so another user may have taken the name ``elastic-<uid>``
first. Then the uid's root is a fresh ``elastic-<uid>-<random>`` beside it (``mkdtemp``),
which the agent and its workers find the same way: the first entry of that shape that is a
private directory of this uid (holding the agent's directory, when one does).

An agent removes its directory when it exits (:func:`remove_owned`) and, when it starts, the
directories of agents that are gone (:func:`remove_orphans`); what it cannot or should not
remove (another user's, not a directory) is skipped and logged once, never raised.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

from elastic import procs

logger = logging.getLogger(__name__)

DEFAULT_BASE = "/dev/shm"
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
SMALL_FILE = 1 << 16  # the most bytes read_small reads (a channel file is ~300)


def _refusal(path: Path | str, what: str, why: str) -> PermissionError:
    return PermissionError(
        f"{path} is not a private {what} of uid {os.geteuid()} ({why}); refusing to use it: "
        "remove it, or give the run another directory."
    )


def _verify(fd: int, path: Path | str, directory: bool) -> None:
    """Raise PermissionError unless ``fd`` is this uid's, private, and of the right kind."""
    st = os.fstat(fd)
    what = "directory" if directory else "file"
    kind = stat.S_ISDIR if directory else stat.S_ISREG
    if not kind(st.st_mode):
        raise _refusal(path, what, "it is of another kind")
    if st.st_uid != os.geteuid():
        raise _refusal(path, what, f"it belongs to uid {st.st_uid}")
    if st.st_mode & 0o077:
        raise _refusal(path, what, f"its mode is {stat.S_IMODE(st.st_mode):04o}")


def check_dir(path: Path | str) -> None:
    """Raise FileNotFoundError if ``path`` is absent, PermissionError (one sentence) unless
    it is a private directory of this uid reached without a symlink."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW)
    except FileNotFoundError:
        raise
    except OSError as exc:  # ELOOP: a symlink; ENOTDIR: a file
        raise _refusal(path, "directory", "it is a symlink or not a directory") from exc
    try:
        _verify(fd, path, directory=True)
    finally:
        os.close(fd)


def _private(path: Path) -> bool:
    try:
        check_dir(path)
    except OSError:
        return False
    return True


def _mkdir(path: Path) -> bool:
    """Create ``path`` (0700); False if something already has that name."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return False
    return True


def _canonical(base: str) -> Path:
    return Path(base) / f"elastic-{os.geteuid()}"


def _fallbacks(base: str) -> list[Path]:
    """This uid's other roots under ``base`` (made when another user held the canonical name)."""
    shape = re.compile(rf"^elastic-{os.geteuid()}-[a-z0-9_]+$")  # tempfile.mkdtemp's names
    try:
        names = sorted(n for n in os.listdir(base) if shape.match(n))
    except OSError:
        return []
    return [p for p in (Path(base) / n for n in names) if _private(p)]


def find(owner: int, base: str = DEFAULT_BASE) -> Path | None:
    """Agent ``owner``'s directory if it exists (verified private), else None."""
    canonical = _canonical(base)
    if _private(canonical / str(owner)) and _private(canonical):
        return canonical / str(owner)
    for root in _fallbacks(base):
        if _private(root / str(owner)):
            return root / str(owner)
    return None


def ensure(owner: int, base: str = DEFAULT_BASE) -> tuple[Path, bool]:
    """Agent ``owner``'s directory, created if missing; ``(path, whether this call made it)``.

    Raises:
        OSError: one sentence, when no private directory can be had under ``base``.
    """
    found = find(owner, base)
    if found is not None:
        return found, False
    canonical = _canonical(base)
    _mkdir(canonical)
    roots = [canonical] if _private(canonical) else _fallbacks(base)
    if not roots:
        root = Path(tempfile.mkdtemp(prefix=f"{canonical.name}-", dir=base))
        logger.warning(
            "%s is not a private directory of this uid (another user made it?); the node-local "
            "files live in %s instead.",
            canonical,
            root,
        )
        roots = [root]
    path = roots[0] / str(owner)
    made = _mkdir(path)
    check_dir(path)
    return path, made


def directory(owner: int, base: str = DEFAULT_BASE) -> Path:
    """Agent ``owner``'s directory, created if missing (see :func:`ensure`)."""
    return ensure(owner, base)[0]


def open_file(path: Path, create: bool = False, write: bool = True) -> int:
    """Open the node-local file ``path`` (never through a symlink; created exclusively, 0600,
    when ``create`` and absent) and check that it is this uid's and private; its fd.

    Raises:
        FileNotFoundError: absent and not ``create``.
        PermissionError: one sentence, when it is a symlink or not this uid's private file.
    """
    flags = (os.O_RDWR if write else os.O_RDONLY) | _NOFOLLOW
    for _ in range(3):
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            if not create:
                raise
            try:
                fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:  # another process of ours made it first
                continue
        except OSError as exc:
            raise _refusal(path, "file", "it is a symlink or cannot be opened") from exc
        try:
            _verify(fd, path, directory=False)
        except BaseException:
            os.close(fd)
            raise
        return fd
    raise _refusal(path, "file", "it keeps changing")


def read_small(path: Path) -> bytes:
    """The whole node-local file ``path`` (at most :data:`SMALL_FILE` bytes), verified as
    :func:`open_file` does."""
    fd = open_file(path, write=False)
    try:
        if os.fstat(fd).st_size > SMALL_FILE:
            raise _refusal(path, "file", f"it is over {SMALL_FILE} bytes")
        return os.read(fd, SMALL_FILE + 1)
    finally:
        os.close(fd)


def write_whole(path: Path, payload: bytes) -> None:
    """Replace ``path`` with ``payload`` at once: a temporary file made exclusively beside it,
    renamed over it (a rename replaces a planted symlink, it never follows one)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(payload)
    os.replace(tmp, path)


def remove_owned(owner: int, base: str = DEFAULT_BASE) -> bool:
    """Remove agent ``owner``'s directory and everything in it; whether there was one."""
    found = find(owner, base)
    if found is None:
        return False
    shutil.rmtree(found, ignore_errors=True)  # fd-based: never follows a symlink inside
    return True


def remove_orphans(base: str = DEFAULT_BASE) -> list[Path]:
    """Remove the directories of this uid's agents that are no longer running. Never raises."""
    removed: list[Path] = []
    canonical = _canonical(base)
    for root in ([canonical] if _private(canonical) else []) + _fallbacks(base):
        with contextlib.suppress(OSError):
            for name in os.listdir(root):
                if name.isdigit() and not procs.alive(int(name)):
                    shutil.rmtree(root / name, ignore_errors=True)
                    removed.append(root / name)
    if removed:
        logger.info("Removed the node-local files of %d agents that are gone.", len(removed))
    return removed


def remove_stale(
    directory: str, pattern: re.Pattern[str], doomed: Callable[[int], bool]
) -> list[Path]:
    """Remove the files in ``directory`` whose name matches ``pattern`` and whose ``pid``
    group ``doomed`` accepts (the flat names of earlier versions), if they are this uid's
    regular files; skip, and log once, the rest. Never raises."""
    removed: list[Path] = []
    skipped: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    for name in names:
        match = pattern.match(name)
        if not match or not doomed(int(match["pid"])):
            continue
        path = Path(directory) / name
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                skipped.append(name)
                continue
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            continue
        except OSError:
            skipped.append(name)
    if skipped:
        logger.warning(
            "Left these entries in %s, which are not this user's files to remove: %s.",
            directory,
            ", ".join(sorted(skipped)[:5]) + (" ..." if len(skipped) > 5 else ""),
        )
    return removed


__all__ = [
    "DEFAULT_BASE",
    "check_dir",
    "directory",
    "ensure",
    "find",
    "open_file",
    "read_small",
    "remove_orphans",
    "remove_owned",
    "remove_stale",
    "write_whole",
]
