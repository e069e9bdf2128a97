"""Event kinds: one list in code (elastic.events.KINDS); a failed write never stops a process."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from elastic import env, events
from tests.helpers import REPO

EMIT_CALL = re.compile(r"\bemit\(")
EMIT_KIND = re.compile(r"\bemit\(\s*\"([^\"]+)\"")


def emitted_kinds() -> dict[str, list[str]]:
    """Every ``emit("kind", ...)`` in elastic/ and elastic_tools/: kind -> where."""
    found: dict[str, list[str]] = {}
    paths = [*(REPO / "elastic").rglob("*.py"), *(REPO / "elastic_tools").rglob("*.py")]
    for path in sorted(paths):
        if path == REPO / "elastic" / "events.py":
            continue
        source = path.read_text()
        calls = len(EMIT_CALL.findall(source))
        kinds = EMIT_KIND.findall(source)
        where = str(path.relative_to(REPO))
        assert calls == len(kinds), f"{where}: every emit() must name its kind as a literal"
        for kind in kinds:
            found.setdefault(kind, []).append(where)
    return found


def test_every_emitted_kind_is_listed_and_every_listed_kind_is_emitted() -> None:
    found = emitted_kinds()
    assert found, "no emit() found: the pattern no longer matches the source"
    unlisted = {k: v for k, v in found.items() if k not in events.KINDS}
    assert not unlisted, f"add these kinds to elastic.events.KINDS: {unlisted}"
    assert sorted(events.KINDS) == sorted(found), "KINDS lists kinds nobody emits"
    assert all(meaning.strip() for meaning in events.KINDS.values())
    assert "KINDS" in (events.__doc__ or ""), "the module docstring must point at KINDS"


@pytest.mark.parametrize("target", ["missing", "/dev/full"])
def test_a_failed_write_warns_once_and_goes_on(
    target: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = str(tmp_path / "no-such-dir" / "events.jsonl") if target == "missing" else target
    if target == "/dev/full" and not Path(target).exists():
        pytest.fail("/dev/full is missing on this machine")
    monkeypatch.setenv(env.EVENT_LOG, path)
    monkeypatch.setattr(events, "_warned_pid", None)
    with caplog.at_level(logging.WARNING, logger="elastic.events"):
        first = events.emit("train.step", step=1)
        events.emit("train.step", step=2)
    assert first["step"] == 1 and first["kind"] == "train.step"
    warnings = [r for r in caplog.records if r.name == "elastic.events"]
    assert len(warnings) == 1, warnings
    assert path in warnings[0].getMessage()


@pytest.mark.integration
def test_a_process_on_a_full_disk_keeps_going() -> None:
    """As a worker would: many events to /dev/full, one warning, exit 0."""
    script = "from elastic import events\nfor s in range(5): events.emit('train.step', step=s)\n"
    result = subprocess.run(
        [sys.executable, "-c", script],
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), env.EVENT_LOG: "/dev/full"},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("Cannot write the event log /dev/full") == 1, result.stderr


def test_completed_steps_counts_a_step_only_a_resume_shows() -> None:
    """Rank 0 reported 1, 2 and 4; the world after a failure resumed from step 3 (rank 0
    died after its group agreed on it). Step 5 neither ran nor was resumed from."""
    log = [
        {"kind": "train.step", "step": 1},
        {"kind": "train.step", "step": 2},
        {"kind": "train.samples", "step": 5, "rank": 0},
        {"kind": "ckpt.load", "step": 3, "source": "peer"},
        {"kind": "ckpt.save", "step": 5},
        {"kind": "train.step", "step": 4},
        {"kind": "train.step", "step": "6"},  # not a step number: ignored
    ]
    assert events.completed_steps(log) == {1, 2, 3, 4}


def _kinds(read: list[dict[str, object]]) -> list[object]:
    return [e.get("kind") for e in read]


def test_tail_returns_each_whole_event_once_and_follows_a_new_or_truncated_file(
    tmp_path: Path,
) -> None:
    log = tmp_path / "events.jsonl"
    tail = events.Tail(log, skip={"train.samples"})
    assert tail.read() == [] and not tail.restarted, "no file yet: no events"
    log.write_bytes(b'{"kind": "a", "ts": 1}\n{"kind": "b", "ts"')
    assert _kinds(tail.read()) == ["a"], "the torn last line waits for its end"
    assert tail.read() == [], "nothing new"
    with open(log, "ab") as f:
        f.write(b': 2}\nnot json\n[1, 2]\n{"kind": "train.samples"}\n{"kind": ["x"]}\n')
    assert _kinds(tail.read()) == ["b", ["x"]], "foreign lines and skipped kinds are left out"
    assert not tail.restarted

    log.write_bytes(b'{"kind": "c"}\n')  # truncated and rewritten: shorter than before
    assert _kinds(tail.read()) == ["c"] and tail.restarted
    assert tail.read() == [] and not tail.restarted

    other = tmp_path / "other.jsonl"  # replaced by a longer file: another inode
    other.write_bytes(b'{"kind": "d"}\n' * 10)
    other.replace(log)
    assert _kinds(tail.read()) == ["d"] * 10 and tail.restarted


def test_tail_filters_kinds_and_bounds_its_backlog_and_a_line_without_end(
    tmp_path: Path,
) -> None:
    log = tmp_path / "events.jsonl"
    with open(log, "wb") as f:
        for step in range(100):
            f.write(b'{"kind": "train.step", "step": %d, "pad": "%s"}\n' % (step, b"x" * 100))
            f.write(b'{"kind": "rdzv.round", "round": %d}\n' % step)
    tail = events.Tail(log, kinds={"train.step"}, max_backlog=4096, max_partial=64)
    steps = [e["step"] for e in tail.read()]
    assert steps[-1] == 99 and 10 < len(steps) < 40, "a backlog is skipped to its newest lines"
    assert all(e["kind"] == "train.step" for e in events.Tail(log, kinds={"train.step"}).read())

    with open(log, "ab") as f:
        f.write(b'{"kind": "train.step", "step": 100, "pad": "' + b"y" * 100)
    assert tail.read() == []
    with open(log, "ab") as f:
        f.write(b'"}\n{"kind": "train.step", "step": 101}\n')
    assert [e["step"] for e in tail.read()] == [101], "a line longer than max_partial is dropped"

    unbounded = [e.get("step") for e in events.Tail(log).read()]
    assert len(unbounded) == 202 and unbounded[-2:] == [100, 101], "no bounds: every event"
