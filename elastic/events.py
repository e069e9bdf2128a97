"""Structured events as JSON lines: what tests and users must be able to see.

An event is one JSON object per line with at least ``ts`` (unix seconds),
``kind`` and ``pid``. The kinds, each with its meaning, are :data:`KINDS` (a test
checks that every kind emitted in ``elastic/`` is listed there).
The log file comes from ``$ELASTIC_EVENT_LOG``; appends of one short line are
atomic on POSIX, so many processes may share one file. A write that fails (a full
disk, a missing directory) is logged once per process and never stops the caller.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from elastic import env

logger = logging.getLogger(__name__)

KINDS: Mapping[str, str] = MappingProxyType(
    {
        # agents (elastic.rendezvous.announce, elastic.agent.node)
        "rdzv.round": "an agent completed a rendezvous round: round, node, rank, world_size",
        "rdzv.untrusted": "a member key not signed by the job's secret was given no rank: node",
        "rdzv.dropped": "an agent is no longer a participant of its round (outage, missed "
        "heartbeats) and rejoins",
        "node.leave": "an agent left the rendezvous on purpose (SIGTERM): node, seconds",
        "node.lost": "peers of an agent's round are gone; it re-forms the group: nodes",
        "node.dead": "agents whose probe ports refuse connections were removed from the "
        "rendezvous without waiting for their heartbeats to expire: nodes",
        "etcd.reset": "an agent saw etcd lose its data (restarted empty, or a new cluster) and "
        "announced again: node, round (the newest it knew; the next comes after it), reason",
        "node.expired": "an agent's own etcd lease expired while it ran (etcd stalled, or the "
        "agent too slow to renew it): its round goes on without it and it rejoins: node",
        "node.probation": "a node dropped as a straggler left its round in place and sits out: "
        "step, ratio, median_s, baseline_s, next check",
        "probation.baseline": "with the straggler policy on, a node timed its health check's "
        "probe while it trained steadily (its round in place): one of the probes whose median "
        "is the healthy time a check is held to: run_id, round, seconds, samples, baseline_s",
        "probation.check": "a node on probation timed its health check: seconds, baseline_s, "
        "passed, failures, next check",
        "node.rejoin": "a node back from probation joined a round again: round, world_size, "
        "seconds on probation, rendezvous seconds",
        "probation.gave_up": "a node on probation failed its checks (or was dropped a third "
        "time) and left the job for good (exit 0)",
        "worker.restart": "an agent restarts its workers: reason 'reform' (a membership "
        "change) or 'failure' (spends the job's restart budget, kept in etcd)",
        "worker.frozen": "an agent ended a worker stopped (SIGSTOP) for FROZEN_S seconds so "
        "that it restarts: pid, local_rank, seconds",
        "worker.stuck": "an agent ended a worker that was stopped (SIGSTOP) and that its "
        "waiting peers named stuck; its node leaves the round and rejoins, spending no "
        "restart (elastic.agent.stuck): pid, local_rank",
        "etcd.unreachable": "an agent lost etcd; training goes on until outage_timeout",
        "etcd.reachable": "an agent reached etcd again after an outage: seconds it lasted",
        # workers (elastic_tools.training.worker, elastic.checkpoint.manager)
        "ckpt.save": "a rank's checkpoint save ended: step, ok, url, blocking_s, durable_s "
        "(error and last_good when it failed)",
        "ckpt.load": "a rank loaded a checkpoint: step, url, seconds, world_size",
        "ckpt.missing": "rank 0 resumed from an older step than etcd's commit records name "
        "(deleted or unreadable): step (the newest recorded), steps, loaded, url",
        "ckpt.older": "rank 0 resumed from an older step than the newest step directory in "
        "storage, which is not complete (its files gone, torn or forged; no commit record "
        "names a newer step): step (the newest), steps, loaded, reason, url",
        "ckpt.init": "a job with no state of its own started from a foreign (plain DCP) "
        "checkpoint: url, seconds, rank, missing (what it did not hold)",
        "train.step": "rank 0 completed a step: step, loss, lr, samples_per_s, world_size, epoch "
        "(see completed_steps for the steps a dead rank 0 could not report)",
        "train.samples": "the sample indices a rank trains on in a step, recorded before the "
        "step runs; a redone step's record replaces it (job.sample_ledger)",
        # elastic.worker (the elastic.Run API)
        "recovery.inplace": "a rank re-formed its group in place (same process): step, round, "
        "rank, world_size, pid, seconds, waited_s (for the round), form_s, state (live, "
        "memory, peer, storage)",
        "recovery.fallback": "an in-place re-form failed; the rank restarts and resumes from "
        "memory: step, reason",
        "rdzv.inplace": "an agent handed its running workers a new round instead of restarting "
        "them: round, world_size, change, seconds",
        "recovery.resume": "a rank resumed: step, source (memory: its node's snapshot, peer: "
        "streamed from a holder, storage, fresh), seconds, bytes received, held, persisted",
        "job.finished": "an agent whose workers had not joined yet found the job finished "
        "(its rendezvous closed): they stop and it exits 0: run_id",
        "boundary.refused": "rank 0: a rank's record at a step boundary was not well-formed "
        "(a vote not 0 or 1, a figure not finite or out of range): it counts as voting nothing "
        "and reporting no figures (elastic.worker.boundary); once per rank and round: rank, "
        "step, round, reason",
        "job.stopped": "rank 0: every rank was asked to stop after a step, so the job's loop "
        "ends (elastic.worker.agreement): step, reason",
        # elastic.worker.timing, elastic.worker.hang (slow and stuck ranks)
        "straggler.detected": "rank 0: a node ran slower than threshold times the median for "
        "steps consecutive steps and slow_s seconds of its compute time (at least "
        "straggler.steps and straggler.min_slow_s): step, node, ranks, rank (its first), "
        "ratio, steps, slow_s, threshold, policy (whether it is dropped), median_s (the "
        "ranks' median compute time)",
        "straggler.dropped": "rank 0: the straggler policy drops a node in place (its agent "
        "leaves the job): step, node, ranks, ratio, reason, median_s",
        "worker.hang.peers": "the ranks waiting in a step past the hang bound named those that "
        "never reached its collectives: rank (the lowest waiting), step, ranks, seconds, round",
        "worker.hang.suspects": "the lowest rank waiting in a step past the hang bound named "
        "in the round's store the ranks without a mark 0.05 s into the roll call (their "
        "agents end a named worker that is stopped): step, ranks, round, seconds (since "
        "the step began), bound_s",
        "worker.hang": "a rank stayed inside a step past the hang bound without reaching its "
        "collectives; it exits so that the group goes on: rank, step, pid, seconds, bound_s",
        "worker.stacks": "the Python stacks of every thread of a stuck worker "
        "(faulthandler): rank, step, pid, stacks",
    }
)
_warned_pid: int | None = None  # the process that already warned of a failed write


def emit(kind: str, path: str | os.PathLike[str] | None = None, **fields: Any) -> dict[str, Any]:
    """Record one event to the event log (if configured) and the debug log.

    Args:
        kind: one of :data:`KINDS`, e.g. ``"ckpt.save"``.
        path: the log file; defaults to ``$ELASTIC_EVENT_LOG``.
        fields: JSON-serialisable details.

    Returns:
        The event (also when writing it failed).
    """
    event = {"ts": round(time.time(), 6), "kind": kind, "pid": os.getpid(), **fields}
    target = path or os.environ.get(env.EVENT_LOG)
    logger.debug("event %s", event)
    if target:
        line = json.dumps(event, default=str, separators=(",", ":")) + "\n"
        try:
            _append(target, line.encode())
        except OSError as exc:
            _warn_once(target, exc)
    return event


def _append(target: str | os.PathLike[str], data: bytes) -> None:
    fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _warn_once(target: str | os.PathLike[str], exc: OSError) -> None:
    """A failed write must not stop training: say so once per process, then go on."""
    global _warned_pid
    if _warned_pid == os.getpid():
        return
    _warned_pid = os.getpid()
    logger.warning(
        "Cannot write the event log %s (%s); this process goes on without recording "
        "its events there.",
        target,
        exc.strerror or exc,
    )


def read(path: str | os.PathLike[str], kind: str | None = None) -> list[dict[str, Any]]:
    """Return the events in ``path`` (optionally only one kind), skipping torn lines."""
    events: list[dict[str, Any]] = []
    p = Path(path)
    if not p.exists():
        return events
    for line in p.read_text().splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if kind is None or event.get("kind") == kind:
            events.append(event)
    return events


RESUMED = ("ckpt.load", "recovery.inplace")  # a group went on from a state at ``step``


def completed_steps(log: Iterable[Mapping[str, Any]]) -> set[int]:
    """The steps that ran, as an event log shows them: those rank 0 reported
    (``train.step``) and those some rank went on from (``ckpt.load``, or
    ``recovery.inplace``: the group re-formed in place with that step's state).

    A state at step N exists only if step N ran. The second source matters when rank 0
    dies right after its group agreed on step N: the survivors complete N and hold it in
    memory, the next world goes on from it, and rank 0 never reported it.
    """
    kinds = ("train.step", *RESUMED)
    return {
        int(e["step"]) for e in log if e.get("kind") in kinds and isinstance(e.get("step"), int)
    }


def resumptions(log: Iterable[Mapping[str, Any]], after: float) -> list[Mapping[str, Any]]:
    """Where each group went on after ``after`` (unix time): every ``ckpt.load`` (a
    restart, or a joiner's state) and ``recovery.inplace`` (survivors in place), in order."""
    return [e for e in log if e.get("kind") in RESUMED and float(e.get("ts", 0)) > after]


class Tail:
    """The events appended to a JSON-lines log since the last :meth:`read`.

    Each :meth:`read` costs one ``stat`` and one ``read`` of the new bytes, so a log of
    megabytes can be polled often. It returns whole events only: a torn last line waits
    for its end, and lines that are not JSON objects are skipped. A file that does not
    exist yet reads as no events; one that was truncated or replaced (a smaller size or
    another inode) is read again from its start, and :attr:`restarted` says so.

    Args:
        path: the event log.
        kinds: only events of these kinds (None: all); lines that do not even contain
            one of these names are not parsed.
        skip: events of these kinds are left out.
        max_backlog: when more bytes than this are unread, skip to the newest ones (the
            first line read after the jump, probably the tail of a line, is dropped);
            None reads everything.
        max_partial: a line that grew longer than this without a newline is dropped;
            None keeps it however long it gets.

    Errors other than a missing file (the path is a directory, say) reach the caller.
    Not thread-safe: callers that share one lock it.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        kinds: Collection[str] | None = None,
        skip: Collection[str] = (),
        max_backlog: int | None = None,
        max_partial: int | None = None,
    ) -> None:
        self.path = Path(path)
        self.kinds = frozenset(kinds) if kinds is not None else None
        self.skip = frozenset(skip)
        self.max_backlog = max_backlog
        self.max_partial = max_partial
        self.restarted = False  # the last read started the file over
        self._wanted = tuple(kind.encode() for kind in self.kinds or ())
        self._inode: int | None = None
        self._offset = 0
        self._partial = b""

    def read(self) -> list[dict[str, Any]]:
        """Return the whole events appended since the last call."""
        self.restarted = False
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return []
        if st.st_ino != self._inode or st.st_size < self._offset:
            self.restarted = self._inode is not None
            self._inode, self._offset, self._partial = st.st_ino, 0, b""
        if st.st_size == self._offset:
            return []
        start, skipped = self._offset, False
        if self.max_backlog is not None and st.st_size - start > self.max_backlog:
            start, skipped, self._partial = st.st_size - self.max_backlog, True, b""
        with open(self.path, "rb") as f:
            f.seek(start)
            data = f.read(st.st_size - start)
        self._offset = start + len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        if self.max_partial is not None and len(self._partial) > self.max_partial:
            self._partial = b""
        if skipped and lines:
            lines = lines[1:]  # the first one is probably the tail of a line
        return [event for event in map(self._parse, lines) if event is not None]

    def _parse(self, line: bytes) -> dict[str, Any] | None:
        if self._wanted and not any(kind in line for kind in self._wanted):
            return None
        try:
            event = json.loads(line)
        except ValueError:  # a torn or foreign line
            return None
        if not isinstance(event, dict):
            return None
        kind = event.get("kind")
        name = kind if isinstance(kind, str) else None  # a list would not hash
        if (self.kinds is not None and name not in self.kinds) or name in self.skip:
            return None
        return event


__all__ = ["KINDS", "RESUMED", "Tail", "completed_steps", "emit", "read", "resumptions"]
