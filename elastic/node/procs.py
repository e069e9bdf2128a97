"""Process plumbing: find a process's children, kill by PID, die with the parent."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import time
from pathlib import Path

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
WORKER_NAME = "elastic-worker"


def _parents() -> dict[int, int]:
    """Every process's parent pid, from one pass over ``/proc``."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return parents


def children(pid: int) -> list[int]:
    """PIDs whose parent is ``pid`` (torch starts workers in their own sessions, so a
    process group does not reach them)."""
    return [kid for kid, parent in _parents().items() if parent == pid]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, grandchildren ...), parents first."""
    parents = _parents()  # one pass over /proc, not one per process of the tree
    out, frontier = [], [pid]
    while frontier:
        kids = [k for k, parent in parents.items() if parent in frontier]
        out.extend(kids)
        frontier = kids
    return out


def name(pid: int) -> str:
    """The process's short name (``/proc/PID/comm``); "" if it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def set_name(title: str) -> None:
    """Name this process (what ``ps -o comm`` and :func:`name` show; 15 bytes at most)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(_PR_SET_NAME, title.encode()[:15], 0, 0, 0)


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return state(pid) not in ("", "Z")


def state(pid: int) -> str:
    """Process ``pid``'s state letter from ``/proc/PID/stat`` (``R``, ``S``, ``D``, ``T``
    stopped, ``Z`` ...); "" if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def started_at(pid: int) -> float | None:
    """When process ``pid`` started (``time.time()`` scale, about 10 ms resolution); None if
    it is gone or this is not Linux. Tells a pid that was reused from the process it was."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def kill(pid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to ``pid``; a process that is already gone is fine."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent (the agent) dies.

    Returns False where that is not available (not Linux). If the parent is
    already gone when this runs (``parent``: the pid it must be; by default the
    parent at the time of the call), the process ends at once.
    """
    parent = os.getppid() if parent is None else parent
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), sig)
    return True


__all__ = [
    "WORKER_NAME",
    "alive",
    "children",
    "descendants",
    "die_with_parent",
    "kill",
    "name",
    "set_name",
    "started_at",
    "state",
]
