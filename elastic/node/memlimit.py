"""How many bytes this process may still allocate: its memory cgroup's room, else the host's.

A container's memory limit, not the host's RAM, is where the kernel's OOM killer strikes,
so a size a peer claims (:mod:`elastic.worker.exchange`) is checked against the smallest
of, for this process's cgroup and each of its ancestors:

* cgroup v2: ``memory.max - memory.current`` (``max``: no limit at that level);
* cgroup v1: ``memory.limit_in_bytes - memory.usage_in_bytes`` of the ``memory``
  controller (a limit of 2**60 or more: none);

and the host's ``MemAvailable`` (``/proc/meminfo``). A file that is absent or unreadable
counts as no limit at its level; with nothing readable at all the answer is None.
"""

from __future__ import annotations

import logging
from pathlib import Path, PurePosixPath

logger = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")
MEMINFO = Path("/proc/meminfo")
V1_UNLIMITED = 1 << 60  # v1 writes "no limit" as a huge number (PAGE_COUNTER_MAX pages)


def _read_int(path: Path) -> int | None:
    """The integer in ``path``; None when absent, unreadable, ``max`` or not a number."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    try:
        return int(text)
    except ValueError:  # "max"
        return None


def _levels(root: Path, relative: str) -> list[Path]:
    """``root/relative`` and each ancestor up to ``root`` (those that exist)."""
    parts = PurePosixPath("/" + relative.lstrip("/")).parts[1:]
    out = [root.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]
    return [p for p in out if p.is_dir()]


def _room(levels: list[Path], limit_name: str, usage_name: str, unlimited: int) -> int | None:
    """The least ``limit - usage`` over ``levels`` (None: no limit at any)."""
    rooms = []
    for level in levels:
        limit = _read_int(level / limit_name)
        if limit is None or limit >= unlimited:
            continue
        usage = _read_int(level / usage_name) or 0
        rooms.append(max(0, limit - usage))
    return min(rooms) if rooms else None


def cgroup_room(root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> int | None:
    """Bytes this process's memory cgroup (v2, else v1) still allows; None: no limit known."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # v2: "0::/path"
            room = _room(_levels(root, path), "memory.max", "memory.current", 1 << 63)
            if room is not None:
                return room
        elif "memory" in controllers.split(","):  # v1: "N:memory:/path"
            v1 = root / "memory"
            return _room(
                _levels(v1, path), "memory.limit_in_bytes", "memory.usage_in_bytes", V1_UNLIMITED
            )
    return None


def host_available(meminfo: Path = MEMINFO) -> int | None:
    """The host's ``MemAvailable`` in bytes; None if it cannot be read."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_bytes(
    root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP, meminfo: Path = MEMINFO
) -> int | None:
    """The least of :func:`cgroup_room` and :func:`host_available`; None if neither is known."""
    known = [n for n in (cgroup_room(root, self_cgroup), host_available(meminfo)) if n is not None]
    return min(known) if known else None


__all__ = ["available_bytes", "cgroup_room", "host_available"]
