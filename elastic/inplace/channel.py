"""The local channel between a node's agent and its running workers, for in-place re-forms.

Two small JSON files per worker in node-local shared memory, each written whole (a temporary
file renamed over the old one), never unpickled:

* ``<prefix>.agent``: the agent's newest :class:`Assignment` for this worker: the round,
  its rank and world size, the round's bootstrap store and fence. ``pending`` assignments
  announce a round being formed; ``abort`` ones tell the worker that a peer is gone, so
  a collective blocked on it is released at once (:mod:`elastic.inplace.guard`).
* ``<prefix>.worker``: the worker's :class:`Registration`: its pid and round once it can
  re-form in place, and whether it asks for a new round (its step failed and no round came).

The prefix reaches the worker as :data:`elastic.env.CHANNEL`; the agent removes the files
when it stops its workers.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from elastic import procs

DIRECTORY = "/dev/shm"
POLL_S = 0.005


@dataclass(frozen=True)
class Assignment:
    """Where a worker stands in ``round``: rank, world size and the round's store.

    ``pending``: the agent is forming ``round`` (no rank yet); ``abort``: a peer is gone,
    so nothing already started in the old group can finish."""

    round: int
    rank: int = -1
    world_size: int = 0
    master_addr: str = ""
    master_port: int = 0
    fence: str = ""
    pending: bool = False
    abort: bool = False
    leave: bool = False  # with abort: this node leaves the job (SIGTERM to its agent)
    issued: float = 0.0  # time.time() when the agent wrote it

    @classmethod
    def from_json(cls, text: str) -> Assignment:
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("an assignment is a JSON object")
        fields = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        return cls(**fields)


@dataclass(frozen=True)
class Registration:
    """A worker's word to its agent: it runs ``round`` in place and may re-form in place."""

    pid: int
    round: int
    want_round: bool = False  # its step failed: please form a new round now
    waiting: bool = False  # it waits for a new round (a peer stopped): look again soon


def _order(a: Assignment) -> tuple[int, bool]:
    """Newer round first; a round's complete assignment after its pending one."""
    return a.round, not a.pending


def paths(prefix: str | os.PathLike[str]) -> tuple[Path, Path]:
    """``(agent file, worker file)`` of the channel at ``prefix``."""
    base = str(prefix)
    return Path(base + ".agent"), Path(base + ".worker")


def prefix_for(owner: int, local_rank: int, directory: str = DIRECTORY) -> Path:
    return Path(directory) / f"elastic-channel-{owner}-{local_rank}"


def _write(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload, sort_keys=True))
    os.replace(tmp, path)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def write_assignment(prefix: str | os.PathLike[str], assignment: Assignment) -> None:
    _write(paths(prefix)[0], asdict(assignment))


def read_assignment(prefix: str | os.PathLike[str]) -> Assignment | None:
    """The agent's newest assignment, or None (none yet, or not one we can read)."""
    text = _read(paths(prefix)[0])
    if text is None:
        return None
    try:
        return Assignment.from_json(text)
    except (ValueError, TypeError):
        return None


def register(prefix: str | os.PathLike[str], registration: Registration) -> None:
    _write(paths(prefix)[1], asdict(registration))


def read_registration(prefix: str | os.PathLike[str]) -> Registration | None:
    text = _read(paths(prefix)[1])
    if text is None:
        return None
    try:
        raw = json.loads(text)
        return Registration(
            int(raw["pid"]),
            int(raw["round"]),
            bool(raw.get("want_round")),
            bool(raw.get("waiting")),
        )
    except (ValueError, TypeError, KeyError):
        return None


def remove(prefix: str | os.PathLike[str]) -> None:
    for path in paths(prefix):
        with contextlib.suppress(OSError):
            path.unlink()


_NAME = re.compile(r"^elastic-channel-(?P<pid>\d+)-\d+\.(agent|worker)$")


def remove_orphans(directory: str = DIRECTORY) -> int:
    """Remove the channel files of agents that are gone (killed with -9); their count."""
    removed = 0
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            match = _NAME.match(name)
            if match and not procs.alive(int(match["pid"])):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(directory, name))
                    removed += 1
    return removed


class Watcher:
    """A worker's thread that follows the agent's file and calls ``on_abort`` once for each
    round whose assignment says a peer is gone."""

    def __init__(self, prefix: str | os.PathLike[str], on_abort: Callable[[str], None]) -> None:
        self.prefix = prefix
        self._on_abort = on_abort
        self._cond = threading.Condition()
        self._newest: Assignment | None = read_assignment(prefix)
        self._aborted_round = -1
        self._joined_round = -1
        self._stat: tuple[int, int] | None = None
        self._stop = threading.Event()
        self.leaving = False  # the agent said this node leaves the job
        self._thread = threading.Thread(target=self._loop, name="elastic-channel", daemon=True)
        self._thread.start()

    @property
    def newest(self) -> Assignment | None:
        return self._newest

    def joined(self, round_: int) -> None:
        """The worker now runs ``round_``: an abort for it or older is stale."""
        with self._cond:
            self._joined_round = max(self._joined_round, round_)

    def _loop(self) -> None:
        path = paths(self.prefix)[0]
        while not self._stop.wait(POLL_S):
            try:
                st = path.stat()
            except OSError:
                continue
            key = (st.st_mtime_ns, st.st_ino)
            if key == self._stat:
                continue
            self._stat = key
            got = read_assignment(self.prefix)
            if got is not None:
                self._offer(got)

    def _offer(self, got: Assignment) -> None:
        with self._cond:
            if self._newest is not None and _order(got) < _order(self._newest):
                return
            self._newest = got
            self._cond.notify_all()
            fire = got.abort and got.round > max(self._joined_round, self._aborted_round)
            if fire:
                self._aborted_round = got.round
                self.leaving = self.leaving or got.leave
            self._cond.notify_all()
        if fire and got.leave:
            self._on_abort("this node leaves the job")
        elif fire:
            self._on_abort(f"the agent is forming round {got.round} without a lost peer")

    def wait_for(self, after: int, timeout: float) -> Assignment | None:
        """The first complete assignment of a round newer than ``after``; None on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                a = self._newest
                if a is not None and a.round > after and not a.pending:
                    return a
                if self.leaving:
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(min(left, 0.05))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1)


__all__ = [
    "Assignment",
    "Registration",
    "Watcher",
    "paths",
    "prefix_for",
    "read_assignment",
    "read_registration",
    "register",
    "remove",
    "remove_orphans",
    "write_assignment",
]
