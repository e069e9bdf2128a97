"""The private directory of an agent's node-local files: snapshots, channels, re-form markers.

Every node-local file of an agent lives in ``<base>/elastic-<uid>/<agent pid>/`` (``<base>``
is ``/dev/shm`` by default, ``<uid>`` the effective uid). Both directories belong to that uid
with mode 0700, so no other local user can enter them: nothing can be read, planted, replaced
or linked there. They are created exclusively (``mkdir``), never reached through a symlink
(``O_NOFOLLOW``), and each open checks with ``fstat`` that it got a file or directory of this
uid that no one else may read or write; anything else is refused in one sentence.

``/dev/shm`` is world-writable, so another user may have taken the name ``elastic-<uid>``
first. Then the uid's root is ``elastic-<uid>-<token>`` beside it, where the token is an
HMAC of a random key kept private to this uid in ``$XDG_CACHE_HOME/elastic`` (default
``~/.cache/elastic``, 0700; the key file 0600): another user cannot predict that name, so
cannot take it first, and a lookup costs a few ``stat`` calls, never a scan of the base
(20,000 decoy names there once made each lookup take 440 ms). Should a name of a key be
taken after all (it was seen before a reboot emptied the base), a new key is added, up to
:data:`MAX_KEYS`; without a private place for the key, the agent refuses in one sentence.

An agent removes its directory when it exits (:func:`remove_owned`) and, when it starts, the
directories of agents that are gone (:func:`remove_orphans`); what it cannot or should not
remove (another user's, not a directory) is skipped and logged once, never raised.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

from elastic.node import procs

logger = logging.getLogger(__name__)

DEFAULT_BASE = "/dev/shm"
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
SMALL_FILE = 1 << 16  # the most bytes read_small reads (a channel file is ~300)
KEYS_NAME = "node-local-keys"  # in the key directory (keys_dir): one hex key per line
MAX_KEYS = 8  # keys kept: names another user took after seeing them


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


def keys_dir() -> Path:
    """Where this uid keeps the keys of its other root names: ``$XDG_CACHE_HOME/elastic``,
    else ``~/.cache/elastic``."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "elastic"


def _read_keys() -> list[bytes]:
    """This uid's keys (none when the file is absent); PermissionError if it is not private."""
    try:
        fd = open_file(keys_dir() / KEYS_NAME, write=False)
    except FileNotFoundError:
        return []
    try:
        data = os.read(fd, 4096)
    finally:
        os.close(fd)
    keys = []
    for line in data.decode("ascii", "replace").split()[:MAX_KEYS]:
        with contextlib.suppress(ValueError):
            keys.append(bytes.fromhex(line))
    return [k for k in keys if len(k) >= 16]


def _add_key() -> None:
    """Append a new random key (the key directory made private first)."""
    folder = keys_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_dir(folder)
    fd = open_file(folder / KEYS_NAME, create=True)
    try:
        os.lseek(fd, 0, os.SEEK_END)
        os.write(fd, (secrets.token_hex(32) + "\n").encode())
    finally:
        os.close(fd)


def _keyed(base: str, key: bytes) -> Path:
    token = hmac.new(key, b"elastic node-local root", hashlib.sha256).hexdigest()[:24]
    return Path(base) / f"elastic-{os.geteuid()}-{token}"


def _fallbacks(base: str) -> list[Path]:
    """This uid's other roots under ``base`` that exist (made when another user held the
    canonical name): a few ``stat`` calls, never a listing of ``base``."""
    try:
        keys = _read_keys()
    except OSError as exc:
        logger.debug("Cannot read the node-local keys: %s", exc)
        return []
    return [p for p in (_keyed(base, k) for k in keys) if _private(p)]


def _new_root(base: str, canonical: Path) -> Path:
    """A private root under ``base`` that no other user could have named first.

    Raises:
        OSError: one sentence, when none can be had.
    """
    for _ in range(MAX_KEYS + 1):
        try:
            keys = _read_keys()
            for key in keys:
                root = _keyed(base, key)
                _mkdir(root)
                if _private(root):
                    return root
            if len(keys) >= MAX_KEYS:
                break
            _add_key()
        except OSError as exc:
            raise PermissionError(
                f"{canonical} is not a private directory of this uid (another user made it?), "
                f"and no private key for another name can be kept in {keys_dir()} ({exc}); "
                "remove it, or give this user a writable home or $XDG_CACHE_HOME."
            ) from exc
    raise PermissionError(
        f"{canonical} is not a private directory of this uid, nor are the {MAX_KEYS} other "
        f"names of the keys in {keys_dir()} (another user made them?); remove them."
    )


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
        root = _new_root(base, canonical)
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
