"""FileWatch: a worker's channel thread sleeps until the agent replaces its file (inotify)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from elastic.node import nodelocal
from elastic.node.notify import FileWatch


def test_a_watch_wakes_for_its_file_only(tmp_path: Path) -> None:
    mine, other = tmp_path / "channel-0.agent", tmp_path / "channel-1.agent"
    watch = FileWatch.open(mine)
    assert watch is not None  # Linux: inotify is there
    try:
        assert watch.wait(0.01) is False  # nothing yet
        nodelocal.write_whole(other, b"{}")
        assert watch.wait(0.05) is False  # another worker's file
        nodelocal.write_whole(mine, b"{}")
        assert watch.wait(1.0) is True  # renamed over: the news
        assert watch.wait(0.01) is False  # drained
    finally:
        watch.close()
    assert watch.wait(0.01) is True  # closed: the caller looks and stops


def test_a_blocked_wait_returns_as_soon_as_the_file_is_written(tmp_path: Path) -> None:
    path = tmp_path / "channel-0.agent"
    watch = FileWatch.open(path)
    assert watch is not None
    try:
        timer = threading.Timer(0.05, nodelocal.write_whole, (path, b"{}"))
        started = time.monotonic()
        timer.start()
        assert watch.wait(5.0) is True
        assert time.monotonic() - started < 2.0
    finally:
        watch.close()


def test_no_watch_without_the_directory(tmp_path: Path) -> None:
    assert FileWatch.open(tmp_path / "missing" / "channel-0.agent") is None
