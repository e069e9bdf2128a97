"""elastic.node.channel: the agent's assignments and the worker's registrations."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from elastic.node import channel, nodelocal
from elastic.node.channel import Assignment, Registration, Watcher


def test_assignments_and_registrations_round_trip(tmp_path: Path) -> None:
    prefix = tmp_path / "ch"
    a = Assignment(3, rank=1, world_size=2, master_addr="127.0.0.1", master_port=5)
    channel.write_assignment(prefix, a)
    assert channel.read_assignment(prefix) == a
    channel.register(prefix, Registration(42, 3, waiting=True))
    assert channel.read_registration(prefix) == Registration(42, 3, False, True)
    channel.remove(prefix)
    assert channel.read_assignment(prefix) is None and channel.read_registration(prefix) is None


def test_unreadable_files_read_as_nothing(tmp_path: Path) -> None:
    prefix = tmp_path / "ch"
    agent, worker = channel.paths(prefix)
    agent.write_text("not json")
    worker.write_text('{"pid": "x"}')
    assert channel.read_assignment(prefix) is None
    assert channel.read_registration(prefix) is None


def test_the_watcher_aborts_once_per_round_and_waits_for_a_complete_one(tmp_path: Path) -> None:
    prefix = tmp_path / "ch"
    channel.write_assignment(prefix, Assignment(1, rank=0, world_size=1))
    aborts: list[str] = []
    watcher = Watcher(prefix, aborts.append)
    try:
        watcher.joined(1)
        assert watcher.wait_for(1, 0.05) is None  # nothing newer than round 1
        channel.write_assignment(prefix, Assignment(2, pending=True, abort=True))
        threading.Timer(
            0.1, channel.write_assignment, (prefix, Assignment(2, rank=0, world_size=1))
        ).start()
        got = watcher.wait_for(1, 5)
        assert got is not None and got.round == 2 and not got.pending
        assert len(aborts) == 1
    finally:
        watcher.close()


def test_a_leave_note_marks_the_worker_leaving(tmp_path: Path) -> None:
    prefix = tmp_path / "ch"
    channel.write_assignment(prefix, Assignment(1, rank=0, world_size=1))
    aborts: list[str] = []
    watcher = Watcher(prefix, aborts.append)
    try:
        watcher.joined(1)
        channel.write_assignment(prefix, Assignment(2, pending=True, abort=True, leave=True))
        assert watcher.wait_for(1, 5) is None  # no round comes for a leaving node
        assert watcher.leaving and aborts == ["this node leaves the job"]
    finally:
        watcher.close()


@pytest.mark.integration
def test_orphans_of_dead_agents_are_removed(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    gone = int(dead.stdout)
    mine = channel.prefix_for(os.getpid(), 0, str(tmp_path))
    theirs = channel.prefix_for(gone, 0, str(tmp_path))
    for prefix in (mine, theirs):
        channel.write_assignment(prefix, Assignment(1))
    legacy = tmp_path / f"elastic-channel-{gone}-0.agent"  # the flat name of earlier versions
    legacy.write_text("{}")
    (tmp_path / "unrelated").touch()
    assert nodelocal.remove_orphans(str(tmp_path)) == [theirs.parent]
    assert channel.remove_orphans(str(tmp_path)) == 1
    assert channel.read_assignment(mine) is not None
    assert channel.read_assignment(theirs) is None
    assert not legacy.exists() and (tmp_path / "unrelated").exists()


def test_channel_files_live_in_the_agents_private_directory(tmp_path: Path) -> None:
    import os
    import stat

    prefix = channel.prefix_for(os.getpid(), 3, str(tmp_path))
    channel.write_assignment(prefix, Assignment(2))
    assert prefix.parent == tmp_path / f"elastic-{os.geteuid()}" / str(os.getpid())
    for folder in (prefix.parent, prefix.parent.parent):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE(channel.paths(prefix)[0].stat().st_mode) == 0o600


def _stuck_watch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Path, list[str], list[float | None], Watcher]:
    """A watcher of round 1 with a 0.2 s stuck check: its channel prefix, the aborts it
    fires, the start of the collective in flight (settable: ``[None]`` is none) and itself."""
    monkeypatch.setattr(channel, "STUCK_S", 0.2)
    prefix = tmp_path / "ch"
    channel.write_assignment(prefix, Assignment(1, rank=0, world_size=2))
    aborts: list[str] = []
    in_flight: list[float | None] = [None]
    return prefix, aborts, in_flight, Watcher(prefix, aborts.append, lambda: in_flight[0])


def test_a_collective_stuck_on_the_old_group_is_aborted_once_a_newer_round_formed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer whose agent stayed but whose worker died looks like a join to the others: the
    old group's collective would wait on it for good, so the watcher aborts it."""
    prefix, aborts, in_flight, watcher = _stuck_watch(tmp_path, monkeypatch)
    try:
        watcher.joined(1)
        channel.write_assignment(prefix, Assignment(2, rank=0, world_size=2))  # a "join"
        time.sleep(0.5)  # longer than STUCK_S: the watcher must stay quiet
        assert aborts == [], "no collective in flight: nothing to abort"
        in_flight[0] = time.monotonic()  # one starts and never ends
        deadline = time.monotonic() + 5
        while not aborts and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(aborts) == 1 and "round 2 is formed" in aborts[0], aborts
        time.sleep(0.3)
        assert len(aborts) == 1, "once per round"
    finally:
        watcher.close()


def test_an_abort_that_fired_while_an_older_round_formed_does_not_silence_the_stuck_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker of round 1 forms round 2 (a join) while the agent aborts for round 3 (a
    peer left): the abort fires, then joining round 2 resets the guard. A collective of
    round 2 that waits on a rank gone on to round 3 must still be aborted."""
    prefix, aborts, in_flight, watcher = _stuck_watch(tmp_path, monkeypatch)
    try:
        watcher.joined(1)
        channel.write_assignment(prefix, Assignment(2, rank=0, world_size=3))  # the join
        assert watcher.wait_for(1, 5) is not None  # round 2 is taken and forms ...
        channel.write_assignment(prefix, Assignment(3, pending=True, abort=True))
        deadline = time.monotonic() + 5
        while not aborts and time.monotonic() < deadline:
            time.sleep(0.01)
        assert aborts == ["the agent is forming round 3 without a lost peer"]
        channel.write_assignment(prefix, Assignment(3, rank=0, world_size=2))
        watcher.joined(2)  # ... and is joined: the guard was reset
        in_flight[0] = time.monotonic()  # its first collective waits for good
        while len(aborts) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(aborts) == 2 and "round 3 is formed" in aborts[1], aborts
    finally:
        watcher.close()


BAD_ROUNDS = ["null", '"7"', "1e400", str(10**30), "true", "-2", "[1]"]


@pytest.mark.parametrize("bad", BAD_ROUNDS)
def test_a_bad_assignment_is_ignored_and_the_watcher_keeps_watching(
    tmp_path: Path, bad: str
) -> None:
    """A file whose round is null, a string, out of range or not a whole number is logged
    and ignored: the watcher neither dies nor goes deaf to the next good assignment."""
    prefix = tmp_path / "ch"
    agent = channel.paths(prefix)[0]
    agent.write_text(f'{{"round": {bad}, "rank": 0, "world_size": 1}}')
    assert channel.read_assignment(prefix) is None
    watcher = Watcher(prefix, lambda _reason: None)
    try:
        agent.write_text(f'{{"round": {bad}, "rank": 0, "world_size": 1, "issued": 1}}')
        channel.write_assignment(prefix, Assignment(2, rank=0, world_size=1))
        got = watcher.wait_for(1, 5.0)
        assert got is not None and got.round == 2
        assert watcher._thread.is_alive()
    finally:
        watcher.close()


@pytest.mark.parametrize(
    "field",
    ['"rank": "0"', '"master_port": 70000', '"pending": 1', '"fence": 5', '"issued": 1e400'],
)
def test_every_field_is_checked(tmp_path: Path, field: str) -> None:
    prefix = tmp_path / "ch"
    channel.paths(prefix)[0].write_text(f'{{"round": 1, {field}}}')
    assert channel.read_assignment(prefix) is None


def test_bad_registrations_read_as_nothing(tmp_path: Path) -> None:
    prefix = tmp_path / "ch"
    worker = channel.paths(prefix)[1]
    for raw in [
        '{"pid": 1e400, "round": 1}',
        '{"pid": 5, "round": 1e30}',
        '{"pid": 5, "round": "1"}',
    ]:
        worker.write_text(raw)
        assert channel.read_registration(prefix) is None, raw


def test_formed_after_is_the_one_newer_round_predicate() -> None:
    assert Assignment(3, rank=0, world_size=1).formed_after(2)
    assert not Assignment(3, pending=True).formed_after(2)
    assert not Assignment(2, rank=0, world_size=1).formed_after(2)
