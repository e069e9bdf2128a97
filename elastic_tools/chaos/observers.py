"""What a chaos run watches while it runs: the event log (:class:`EventTail`), the
checkpoint storage and etcd's commit records (:class:`StorageObserver`), and each fault's
recovery (:func:`wait_stable`)."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic import events
from elastic.checkpoint.layout import COMMIT_MARKER, inspect_step
from elastic_tools.chaos.fault import Fault

PREFIX = "/elastic"  # the job's etcd prefix


def pause(seconds: float) -> None:
    """Wait ``seconds`` (none when negative)."""
    threading.Event().wait(max(0.0, seconds))


# -- the event log, read incrementally -------------------------------------------------------


class EventTail:
    """The event log by kind, read from where the last read stopped (the log grows to
    megabytes) through :class:`elastic.events.Tail`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tail = events.Tail(path)
        self._lock = threading.Lock()
        self.by_kind: dict[str, list[dict[str, Any]]] = {}

    def poll(self) -> None:
        with self._lock:
            new = self._tail.read()
            if self._tail.restarted:
                self.by_kind = {}
            for event in new:
                self.by_kind.setdefault(event.get("kind", ""), []).append(event)

    def of(self, kind: str) -> list[dict[str, Any]]:
        self.poll()
        return self.by_kind.get(kind, [])

    def last_step(self) -> int:
        """The newest step trained (0 before the first)."""
        steps = self.of("train.step")
        return steps[-1]["step"] if steps else 0


# -- observing storage and etcd ---------------------------------------------------------------


@dataclass
class Observations:
    """What the storage observer saw."""

    markers: dict[int, set[str]] = field(default_factory=dict)  # step -> complete digests seen
    first_seen: dict[int, float] = field(default_factory=dict)  # step -> first seen complete
    records: dict[int, dict[str, dict[str, Any]]] = field(default_factory=dict)  # step->digest->
    newest_checks: int = 0
    violations: list[str] = field(default_factory=list)
    polls: int = 0


class StorageObserver(threading.Thread):
    """Polls the run's checkpoint directory and etcd commit records until stopped.

    Records every complete marker (by digest) and every commit record seen, and checks at
    every poll that the newest complete step seen so far still exists, complete, unless a
    newer complete step has replaced it as the newest.
    """

    def __init__(
        self, ckpt: Path, run_id: str, endpoint: str, secret: bytes, every: float = 0.1
    ) -> None:
        super().__init__(name="chaos-storage-observer", daemon=True)
        self.ckpt, self.run_id, self.secret, self.every = ckpt, run_id, secret, every
        self.endpoint = endpoint
        self.seen = Observations()
        self._stop_event = threading.Event()
        self._newest: int | None = None
        self._marker_stat: dict[int, tuple[int, int]] = {}

    def stop(self) -> None:
        self._stop_event.set()
        self.join(30)

    def run(self) -> None:
        from elastic.etcd.client import EtcdClient, EtcdOptions, parse_endpoints

        options = EtcdOptions(
            parse_endpoints(self.endpoint)[0], connect_timeout=1.0, request_timeout=1.0
        )
        client = EtcdClient(options)
        try:
            while not self._stop_event.wait(self.every):
                self.poll(client)
        finally:
            with contextlib.suppress(Exception):
                client.close()

    def _complete(self, step: int) -> str | None:
        """The digest of ``step``'s marker when the step is complete now, else None."""
        for _ in range(2):  # a marker replaced between reading it and its files: look again
            info = inspect_step(str(self.ckpt), self.run_id, step, "size", self.secret)
            if info.complete:
                return info.digest
        return None

    def poll(self, client: Any) -> None:
        self.seen.polls += 1
        root = self.ckpt / self.run_id
        try:
            names = os.listdir(root)
        except FileNotFoundError:
            names = []
        for name in names:
            if name.startswith("step-"):
                self._marker(root, name)
        if self._newest is not None:
            self._check_newest()
        self._records(client)

    def _marker(self, root: Path, name: str) -> None:
        """Record the marker of step directory ``name`` when it is new or replaced, and
        complete."""
        step = int(name[5:])
        try:
            st = os.stat(root / name / COMMIT_MARKER)
        except OSError:
            return
        stamp = (st.st_ino, st.st_mtime_ns)
        if self._marker_stat.get(step) == stamp:
            return
        digest = self._complete(step)
        if digest is None:
            return
        self._marker_stat[step] = stamp
        self.seen.markers.setdefault(step, set()).add(digest)
        self.seen.first_seen.setdefault(step, time.time())
        if self._newest is None or step > self._newest:
            self._newest = step

    def _check_newest(self) -> None:
        """The newest complete step seen must still be complete, or a newer one be."""
        assert self._newest is not None
        self.seen.newest_checks += 1
        if self._complete(self._newest) is not None:
            return
        newer = [s for s in self._marker_stat if s > self._newest]
        if not any(self._complete(s) for s in newer):
            self.seen.violations.append(
                f"the newest complete step {self._newest} vanished at {time.time():.3f}"
                " with no newer complete step"
            )
        self._marker_stat.pop(self._newest, None)
        self._newest = max(self._marker_stat, default=None)

    def _records(self, client: Any) -> None:
        prefix = f"{PREFIX}/{self.run_id}/commits/step-".encode()
        try:
            kvs = client.range(prefix, prefix=True).kvs
        except Exception:  # etcd down (a fault of the schedule): look again next poll
            return
        for kv in kvs:
            try:
                step, record = int(kv.key[len(prefix) :]), json.loads(kv.value)
            except ValueError:
                continue
            digests = self.seen.records.setdefault(step, {})
            digests.setdefault(str(record.get("digest")), {**record, "seen": time.time()})


# -- each fault's recovery ---------------------------------------------------------------------


def wait_stable(
    tail: EventTail,
    fault: Fault,
    world: Callable[[], int | None],
    max_steps: int,
    timeout: float,
) -> None:
    """Wait for the first step at the expected world after the fault's last round, with
    five more steps at that world and no newer round; fill in the recovery figures.

    ``world()`` is the world size expected now (the live agents), None once every agent
    exited.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        expected = world()
        if expected is None:
            steps = tail.of("train.step")
            if max((e["step"] for e in steps), default=0) >= max_steps:
                fault.detail += "; the job ended meanwhile (nothing left to recover)"
            else:
                fault.error = "every agent exited"
            return
        fault.world = expected
        first = _recovery_step(tail, fault, max_steps)
        if first is not None:
            _recovered(tail, fault, first)
            return
        pause(0.25)
    fault.error = f"no stable training at world {fault.world} within {timeout:.0f} s"


def _recovery_step(tail: EventTail, fault: Fault, max_steps: int) -> dict[str, Any] | None:
    """The step event that ends the fault's recovery, or None while it is not over."""
    rounds = [e["ts"] for e in tail.of("rdzv.round") if e["ts"] > fault.t]
    since = max([fault.t, *rounds])
    after = [e for e in tail.of("train.step") if e["ts"] > since]
    good = [e for e in after if e["world_size"] == fault.world]
    # In place, the old group trains on after a join's round until the joiner is ready
    # (the job's start too, when one node formed the first round alone): steps of the
    # old world may come first; once the expected world trains, every later step is at it.
    switched = bool(good) and after[len(after) - len(good) :] == good
    if after and after[-1]["step"] >= max_steps and (switched or not good):
        return good[0] if switched else after[-1]
    settled = [e for e in good if e["ts"] > fault.t_end]
    if len(settled) >= 6 and switched:
        return good[0]
    return None


def _recovered(tail: EventTail, fault: Fault, first: dict[str, Any]) -> None:
    fault.recover_s = round(first["ts"] - fault.t, 2)
    loads = [e for e in tail.of("ckpt.load") if fault.t < e["ts"] <= first["ts"]]
    fault.resumed_at = loads[-1]["step"] if loads else fault.step_before
    fault.steps_lost = max(0, fault.step_before - fault.resumed_at)


__all__ = [
    "PREFIX",
    "EventTail",
    "Observations",
    "StorageObserver",
    "pause",
    "wait_stable",
]
