"""The local channel between a node's agent and its running workers, for in-place re-forms.

Two small JSON files per worker, ``channel-<local rank>.{agent,worker}`` in the agent's private
directory (:mod:`elastic.node.nodelocal`: ``/dev/shm/elastic-<uid>/<agent pid>/``, only this uid
may enter it), each written whole (a temporary file made exclusively, renamed over the old
one), read only when it is this uid's regular file (never through a symlink, at most 64 KiB),
never unpickled:

* ``<prefix>.agent``: the agent's newest :class:`Assignment` for this worker: the round,
  its rank and world size, the round's bootstrap store and fence. ``pending`` assignments
  announce a round being formed; ``abort`` ones tell the worker that a peer is gone, so
  a collective blocked on it is released at once (:mod:`elastic.worker.guard`).
* ``<prefix>.worker``: the worker's :class:`Registration`: its pid and round once it can
  re-form in place, and whether it asks for a new round (its step failed and no round came).

The prefix reaches the worker as :data:`elastic.env.CHANNEL`; the agent removes the files
when it stops its workers, and its directory when it exits.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from elastic.node import nodelocal, procs
from elastic.node.notify import FileWatch

logger = logging.getLogger(__name__)

DIRECTORY = nodelocal.DEFAULT_BASE
POLL_S = 0.005  # how often the worker reads the agent's file where inotify is not available
IDLE_CHECK_S = 0.25  # with inotify: looks again this often anyway (and then may stop)
STUCK_CHECK_S = 0.05  # while a newer round is formed: the stuck check's pace
# A collective of the old group still waiting this long once a newer round is formed is
# taken as stuck on a gone peer (a healthy gloo all-reduce of a CNN takes milliseconds).
STUCK_S = 2.0


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
        """Parse and check an agent's file.

        Raises:
            ValueError: not a JSON object, or a field of the wrong type or out of range
                (a round is a whole number from -1 to :data:`MAX_ROUND`, a port 0-65535).
        """
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("an assignment is a JSON object")
        fields = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        for name, value in fields.items():
            _check_field(name, value)
        return cls(**fields)

    def formed_after(self, round_: int) -> bool:
        """Whether this is a formed (not pending) round newer than ``round_``: the one
        answer to "is there a newer formed round?"."""
        return not self.pending and self.round > round_


MAX_ROUND = 1 << 53  # far beyond any job's rounds, and exact in every JSON reader
_INTS = {"round": (-1, MAX_ROUND), "rank": (-1, 1 << 20), "world_size": (0, 1 << 20)}
_INTS["master_port"] = (0, 65535)


def _check_field(name: str, value: Any) -> None:
    """One field of an agent's file: its type and range (ValueError naming it)."""
    if name in _INTS:
        low, high = _INTS[name]
        if type(value) is not int or not low <= value <= high:
            raise ValueError(f"{name}={value!r} is not a whole number from {low} to {high}")
    elif name in ("pending", "abort", "leave"):
        if type(value) is not bool:
            raise ValueError(f"{name}={value!r} is not true or false")
    elif name in ("master_addr", "fence"):
        if not isinstance(value, str):
            raise ValueError(f"{name}={value!r} is not a string")
    elif name == "issued" and (type(value) not in (int, float) or not math.isfinite(value)):
        raise ValueError(f"issued={value!r} is not a finite number")


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
    """The channel of agent ``owner``'s worker ``local_rank``, in the agent's private
    directory under ``directory`` (created if missing).

    Raises:
        OSError: no private directory can be had there (one sentence).
    """
    return nodelocal.directory(owner, directory) / f"channel-{local_rank}"


def _write(path: Path, payload: dict[str, Any]) -> None:
    nodelocal.write_whole(path, json.dumps(payload, sort_keys=True).encode())


_refused: set[Path] = set()  # files already reported as not ours


def _read(path: Path) -> str | None:
    """The file's text; None when absent, unreadable, or not this uid's own (said once)."""
    try:
        return nodelocal.read_small(path).decode()
    except PermissionError as exc:
        if path not in _refused:
            _refused.add(path)
            logger.warning("%s", exc)
        return None
    except (OSError, UnicodeDecodeError):
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
    except (ValueError, TypeError, RecursionError) as exc:
        logger.warning("Ignoring the agent's file %s: %s.", paths(prefix)[0], exc)
        return None


def register(prefix: str | os.PathLike[str], registration: Registration) -> None:
    _write(paths(prefix)[1], asdict(registration))


def read_registration(prefix: str | os.PathLike[str]) -> Registration | None:
    text = _read(paths(prefix)[1])
    if text is None:
        return None
    try:
        raw = json.loads(text)
        pid, round_ = raw["pid"], raw["round"]
        if type(pid) is not int or type(round_) is not int:
            return None
        if not (0 < pid < 1 << 32 and -1 <= round_ <= MAX_ROUND):
            return None
        return Registration(pid, round_, bool(raw.get("want_round")), bool(raw.get("waiting")))
    except (ValueError, TypeError, KeyError, RecursionError):
        return None


def remove(prefix: str | os.PathLike[str]) -> None:
    for path in paths(prefix):
        with contextlib.suppress(OSError):
            path.unlink()


_LEGACY = re.compile(r"^elastic-channel-(?P<pid>\d+)-\d+\.(agent|worker)$")


def remove_orphans(directory: str = DIRECTORY) -> int:
    """Remove the channel files of agents that are gone (killed with -9); their count.

    The agents' directories go with :func:`elastic.node.nodelocal.remove_orphans`; this removes
    this uid's files under the flat names of earlier versions. Never raises: another user's
    entries are left and logged once."""
    gone = nodelocal.remove_stale(directory, _LEGACY, lambda pid: not procs.alive(pid))
    return len(gone)


class Watcher:
    """A worker's thread that follows the agent's file and calls ``on_abort`` once for each
    round whose assignment says a peer is gone, or once a newer round is formed while a
    collective of the old group still waits :data:`STUCK_S` later (``in_flight_since``): a
    peer whose agent stayed, but whose worker died, looks like a join to the other agents,
    and the old group's collective would wait on it for good."""

    def __init__(
        self,
        prefix: str | os.PathLike[str],
        on_abort: Callable[[str], None],
        in_flight_since: Callable[[], float | None] = lambda: None,
    ) -> None:
        self.prefix = prefix
        self._on_abort = on_abort
        self._in_flight_since = in_flight_since
        self._formed_at: tuple[int, float] | None = None  # (round, when first seen formed)
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
        """The worker now runs ``round_``: an abort for it or older is stale. One that fired
        for a newer round while ``round_`` formed was cleared with the old group's guard
        (``StepGuard.reset``), so the stuck check may fire for that round again: a collective
        of ``round_`` can wait on a rank that went on to it (seen: a joined round's first
        agreement waited out the group's 300 s timeout)."""
        with self._cond:
            self._joined_round = max(self._joined_round, round_)
            self._aborted_round = min(self._aborted_round, self._joined_round)

    def _loop(self) -> None:
        path = paths(self.prefix)[0]
        watch = FileWatch.open(path) if path.parent.is_dir() else None
        try:
            while not self._pause(watch):
                self._check_stuck()
                self._look(path)
        finally:
            if watch is not None:
                watch.close()

    def _pause(self, watch: FileWatch | None) -> bool:
        """Until the agent's file may have changed (inotify; else :data:`POLL_S`), or the
        stuck check is due; whether to stop."""
        if watch is None:
            return self._stop.wait(POLL_S)
        with self._cond:
            newest = self._newest
            formed = newest is not None and newest.formed_after(self._joined_round)
        watch.wait(STUCK_CHECK_S if formed else IDLE_CHECK_S)
        return self._stop.is_set()

    def _look(self, path: Path) -> None:
        """Take the agent's file if it changed since the last look."""
        try:
            st = path.stat()
        except OSError:
            return
        key = (st.st_mtime_ns, st.st_ino)
        if key == self._stat:
            return
        self._stat = key
        got = read_assignment(self.prefix)
        if got is not None:
            try:
                self._offer(got)
            except Exception:  # never leave the worker deaf to its agent
                logger.exception("Ignoring an assignment that could not be taken: %s", got)

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

    def _check_stuck(self) -> None:
        """Abort a collective that has waited :data:`STUCK_S` while a newer round is formed."""
        now = time.monotonic()
        with self._cond:
            newest = self._newest
            if newest is None or not newest.formed_after(self._joined_round):
                self._formed_at = None
                return
            if self._formed_at is None or self._formed_at[0] != newest.round:
                self._formed_at = (newest.round, now)
                return
            since = self._in_flight_since()
            waited = now - max(since or now, self._formed_at[1])
            if since is None or waited < STUCK_S or newest.round <= self._aborted_round:
                return
            self._aborted_round = newest.round
        self._on_abort(
            f"round {newest.round} is formed and a collective of the old group has waited "
            f"{waited:.1f} s since (a peer's worker is gone)"
        )

    def wait_for(self, after: int, timeout: float) -> Assignment | None:
        """The first complete assignment of a round newer than ``after``; None on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                a = self._newest
                if a is not None and a.formed_after(after):
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
    "MAX_ROUND",
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
