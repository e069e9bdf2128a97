"""The etcd password, kept out of every child's environment, argv, logs and files.

``$ELASTIC_ETCD_PASSWORD`` is taken out of the agent's environment as it starts
(:func:`take_password_from_env`, before it starts any process), so no worker, fork server
or user script inherits it; the rendezvous options then read it from memory.

Removing it from ``os.environ`` is not enough: ``/proc/<pid>/environ`` shows the block of
memory the process was started with (the top of its initial stack), which ``unsetenv``
leaves as it was. That block is the process's own writable memory, so
:func:`take_password_from_env` overwrites the variable's bytes there with zeros, through
``/proc/self/mem`` (no capability needed, unlike ``prctl(PR_SET_MM_ENV_START)``, which
needs ``CAP_SYS_RESOURCE``; and no re-exec).

Workers read the password from :func:`password_file`: an anonymous memory file that no
directory holds and that the kernel frees when the agent dies, even by ``SIGKILL``.

Import-light on purpose: the agent calls this before it imports torch.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading

from elastic import env

logger = logging.getLogger(__name__)

_env_password: str | None = None
_files: dict[str, str] = {}  # password -> its /proc/<pid>/fd/<n> path in this process
_files_lock = threading.Lock()
# /proc/<pid>/stat after the command's closing parenthesis: field 3 first (man 5 proc).
_ENV_START_FIELD, _ENV_END_FIELD = 50, 51
_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


def take_password_from_env() -> None:
    """Move ``$ELASTIC_ETCD_PASSWORD`` out of the environment into this process's memory,
    and wipe it from the initial environment that ``/proc/<pid>/environ`` shows."""
    global _env_password
    value = os.environ.pop(env.ETCD_PASSWORD, None)
    if value:
        _env_password = value
    if value is not None:
        try:
            wipe_initial_environment(env.ETCD_PASSWORD)
        except OSError as exc:
            logger.warning(
                "Cannot wipe $%s from this process's initial environment (%s): processes of "
                "this user can still read it in /proc/%d/environ.",
                env.ETCD_PASSWORD,
                exc,
                os.getpid(),
            )


def password_from_env() -> str | None:
    """The password taken by :func:`take_password_from_env` (or still in the environment)."""
    return _env_password or os.environ.get(env.ETCD_PASSWORD) or None


def _initial_environment_span() -> tuple[int, int]:
    """Where this process's initial environment block lies in its memory."""
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return int(fields[_ENV_START_FIELD - 3]), int(fields[_ENV_END_FIELD - 3])


def wipe_initial_environment(name: str) -> int:
    """Overwrite every ``name=value`` entry of this process's initial environment block with
    zeros; return how many there were.

    Call it only once the variable is out of ``os.environ`` (C ``environ`` then points at
    it no more). Raises OSError when ``/proc`` cannot be read or written.
    """
    start, end = _initial_environment_span()
    fd = os.open("/proc/self/mem", os.O_RDWR | os.O_CLOEXEC)
    try:
        block = os.pread(fd, end - start, start)
        prefix, offset, wiped = name.encode() + b"=", 0, 0
        for entry in block.split(b"\0"):
            if entry.startswith(prefix):
                os.pwrite(fd, bytes(len(entry)), start + offset)
                wiped += 1
            offset += len(entry) + 1
    finally:
        os.close(fd)
    return wiped


def password_file(password: str) -> str:
    """A path from which this process's descendants read ``password`` while it lives.

    The password lives in a sealed anonymous memory file (``memfd_create``, mode 0600),
    named ``/proc/<this pid>/fd/<n>``: no directory holds it, only this user (and root) may
    open it, and the kernel frees it when this process exits, ``SIGKILL`` included, so
    nothing is left behind on disk. One file per password per process.

    Raises:
        OSError: the kernel has no ``memfd_create`` (not Linux).
    """
    with _files_lock:
        path = _files.get(password)
        if path is not None and path.startswith(f"/proc/{os.getpid()}/"):
            return path
        fd = os.memfd_create("elastic-etcd-password", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.fchmod(fd, 0o600)
        os.write(fd, password.encode())
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        path = _files[password] = f"/proc/{os.getpid()}/fd/{fd}"
        return path


__all__ = [
    "password_file",
    "password_from_env",
    "take_password_from_env",
    "wipe_initial_environment",
]
