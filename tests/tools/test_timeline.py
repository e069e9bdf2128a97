"""elastic timeline: the figure of a synthetic run and of a real demo's event log."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from elastic_tools.timeline import PAUSE_GID, analyse, build_figure, load_events, render_timeline
from tests.helpers import PYTHON, REPO, node_env

T0 = 1_700_000_000.0


@pytest.fixture(scope="module", autouse=True)
def _font_cache() -> None:
    """matplotlib lists the system's fonts with ``fc-list`` (a process) the first time it
    runs on a machine, then caches them: done here, before the unit tests' no-process
    guard (function-scoped) is on, so a fresh machine's first run passes as later ones do."""
    pytest.importorskip("matplotlib.font_manager")


N1, N2, N3 = "127.0.0.1_101_0", "127.0.0.1_102_0", "127.0.0.1_103_0"


def _step(t: float, step: int, world: int) -> dict[str, Any]:
    return {
        "ts": T0 + t,
        "kind": "train.step",
        "step": step,
        "loss": 2.0 / step,
        "samples_per_s": 30.0 * world,
        "world_size": world,
    }


def _round(t: float, number: int, nodes: list[str]) -> list[dict[str, Any]]:
    return [
        {
            "ts": T0 + t + i * 0.01,
            "kind": "rdzv.round",
            "round": number,
            "node": n,
            "rank": i,
            "world_size": len(nodes),
        }
        for i, n in enumerate(nodes)
    ]


def synthetic() -> list[dict[str, Any]]:
    """Two nodes train; the third joins (->3); the second leaves (->2); the third dies (->1)."""
    events: list[dict[str, Any]] = [*_round(0, 0, [N1, N2])]
    events += [_step(1 + i, 1 + i, 2) for i in range(10)]  # t 1..10, steps 1..10
    events += _round(13, 1, [N1, N2, N3])
    events.append({"ts": T0 + 14, "kind": "ckpt.load", "step": 10, "world_size": 3})
    events += [_step(15 + i, 11 + i, 3) for i in range(10)]  # t 15..24
    events.append({"ts": T0 + 25, "kind": "worker.restart", "reason": "reform"})
    events.append({"ts": T0 + 25.1, "kind": "node.leave", "node": N2, "seconds": 0.1})
    events += _round(27, 2, [N1, N3])
    events += [_step(29 + i, 21 + i, 2) for i in range(10)]  # t 29..38
    events.append(
        {
            "ts": T0 + 39,
            "kind": "worker.restart",
            "reason": "failure",
            "job_restarts_used": 1,
            "job_restart_budget": 3,
        }
    )
    events.append({"ts": T0 + 39.2, "kind": "node.dead", "nodes": [N3], "evidence": "probe"})
    events.append({"ts": T0 + 39.3, "kind": "node.lost", "nodes": [N3], "round": 2})
    events += _round(41, 3, [N1])
    events += [_step(43 + i, 31 + i, 1) for i in range(5)]  # t 43..47
    events.append({"ts": T0 + 20.5, "kind": "ckpt.save", "step": 15, "ok": True})  # out of order
    return events


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def _spans(ax: Any) -> list[tuple[float, float]]:
    """The shaded (axvspan) x ranges of a panel."""
    spans = []
    for patch in ax.patches:
        if patch.get_gid() != PAUSE_GID:
            continue
        x0, x1 = patch.get_x(), patch.get_x() + patch.get_width()  # a Rectangle (matplotlib 3.9+)
        spans.append((round(x0, 3), round(x1, 3)))
    return sorted(spans)


def test_synthetic_run_marks_changes_and_shades_pauses(tmp_path: Path) -> None:
    events = synthetic()
    timeline = analyse(events)
    kinds = [(m.kind, round(m.t, 2)) for m in timeline.markers]
    assert kinds == [
        ("join", 13.0),
        ("recovery", 15.0),
        ("leave", 25.1),
        ("recovery", 29.0),
        ("kill", 39.0),  # the failure, node.dead and node.lost: one incident, one line
        ("recovery", 43.0),
    ]
    labels = [m.label for m in timeline.markers]
    assert N3 in labels[0] and "->3" in labels[0]
    assert N2 in labels[2] and "SIGTERM" in labels[2]
    assert N3 in labels[4]
    assert labels[1] == "world 3, from ckpt 10"
    assert [(p.start, p.end) for p in timeline.pauses] == [(10, 15), (24, 29), (38, 43)]

    fig = build_figure(events, title="synthetic")
    axes = fig.get_axes()
    assert len(axes) == 3
    assert [ax.get_ylabel() for ax in axes] == ["world size", "loss", "samples/s"]
    for ax in axes:
        assert _spans(ax) == [(10.0, 15.0), (24.0, 29.0), (38.0, 43.0)]
        assert len(ax.get_lines()) >= 6  # the data and one line per marker
    assert axes[0].get_shared_x_axes().joined(axes[0], axes[2])

    out = render_timeline(events, tmp_path / "sub" / "timeline.png")
    width, height = _png_size(out)
    assert (width, height) == (1100, 750)
    assert 20_000 < out.stat().st_size < 2_000_000


def test_no_steps_and_a_pause_that_has_not_ended(tmp_path: Path) -> None:
    assert analyse([]).markers == []
    out = render_timeline([], tmp_path / "empty.png")
    assert _png_size(out) == (1100, 750)
    events = [e for e in synthetic() if e["ts"] < T0 + 40]  # the job has not recovered yet
    timeline = analyse(events)
    assert timeline.pauses[-1].start == 38 and timeline.pauses[-1].end is None
    fig = build_figure(events)
    assert _spans(fig.get_axes()[1])[-1] == (38.0, 39.3)


def test_torn_lines_and_a_missing_log(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    lines = [json.dumps(e) for e in synthetic()]
    log.write_text("\n".join(lines[:20]) + '\n{"ts": 1, "kin\n' + "\n".join(lines[20:]) + "\n")
    assert len(load_events(tmp_path)) == len(lines)
    from elastic.errors import ConfigError

    with pytest.raises(ConfigError, match=r"There is no event log at .*nothing"):
        load_events(tmp_path / "nothing")


# The event log of a real `elastic demo` (join, SIGTERM, kill -9) is made by the slow test below;
# this one reads a checked-in excerpt of such a log.
DEMO_LOG = Path(__file__).with_name("demo-events.jsonl")


@pytest.mark.integration
def test_a_real_demo_event_log(tmp_path: Path) -> None:
    events = load_events(DEMO_LOG)
    timeline = analyse(events)
    assert [m.kind for m in timeline.markers] == [
        "join",
        "recovery",
        "leave",
        "recovery",
        "kill",
        "recovery",
    ]
    assert len(timeline.pauses) == 3 and all(p.seconds and p.seconds > 0 for p in timeline.pauses)
    fig = build_figure(events)
    assert len(fig.get_axes()) == 3
    assert all(len(_spans(ax)) == 3 for ax in fig.get_axes())
    result = _cli("timeline", str(DEMO_LOG), "-o", str(tmp_path / "demo.png"))
    assert result.returncode == 0, result.stderr
    assert f"timeline: {tmp_path / 'demo.png'}" in result.stdout
    width, height = _png_size(tmp_path / "demo.png")
    assert (width, height) == (1100, 750)
    assert (tmp_path / "demo.png").stat().st_size > 40_000


@pytest.mark.integration
def test_cli_refuses_a_missing_log(tmp_path: Path) -> None:
    result = _cli("timeline", str(tmp_path), "-o", str(tmp_path / "x.png"))
    assert result.returncode == 2
    assert "There is no event log at" in result.stderr and "Traceback" not in result.stderr


def _cli(*argv: str) -> Any:
    import subprocess

    return subprocess.run(
        [PYTHON, "-m", "elastic_tools.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=node_env(),
        cwd=REPO,
    )
