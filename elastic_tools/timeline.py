"""``elastic timeline``: a picture of a run from its event log (matplotlib, Agg backend).

Three stacked panels share one time axis (seconds since the run's first event): the world
size, the loss and the throughput (samples/s) of each completed step. Every membership
change is a labelled vertical line: a node joining (its first ``rdzv.round`` after the
first round), leaving on purpose (``node.leave``, SIGTERM), dying (``node.dead``,
``node.lost``, ``worker.restart`` with reason ``failure``: kill -9), and the recovery (the
first step after the change). Each pause (from the last ``train.step`` before a membership
event to the first one after it) is shaded.

:func:`analyse` turns events into that plain data (:class:`Timeline`); :func:`build_figure`
draws it; :func:`render_timeline` writes the PNG (``elastic demo`` calls it after a run);
:func:`render_png` returns the bytes (the dashboard serves them).
"""

from __future__ import annotations

import bisect
import io
import logging
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from elastic import events as event_log
from elastic.errors import ConfigError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

logger = logging.getLogger(__name__)

EVENT_LOG_NAME = "events.jsonl"  # a run directory's event log (elastic_tools.harness.cluster)
# The events that mean the group's membership changed (or is about to).
MEMBERSHIP_KINDS = frozenset(
    {"rdzv.round", "rdzv.dropped", "node.leave", "node.lost", "node.dead", "worker.restart"}
)
# Marker kind -> (line colour, line style).
STYLES: Mapping[str, tuple[str, Literal["-", ":"]]] = {
    "join": ("tab:green", "-"),
    "leave": ("tab:orange", "-"),
    "kill": ("tab:red", "-"),
    "recovery": ("tab:blue", ":"),
}
PAUSE_COLOUR = "tab:gray"
PAUSE_ALPHA = 0.25
PAUSE_GID = "pause"  # the shaded spans' id in the figure (and in an SVG of it)
PANELS = ("world size", "loss", "samples/s")
# Reports of one dead node (each survivor's node.lost, node.dead, worker.restart) this close
# together are one incident: one line.
KILL_WINDOW_S = 10.0
SIZE = (11.0, 7.5)  # inches at 100 dpi: 1100 x 750 pixels


@dataclass(frozen=True)
class Marker:
    """One labelled vertical line: ``kind`` is a key of :data:`STYLES`; ``t`` in seconds."""

    t: float
    kind: str
    label: str


@dataclass(frozen=True)
class Pause:
    """Training stood still from ``start`` to ``end`` (seconds) around a membership change."""

    start: float
    end: float | None  # None: no step came after it (the run ended, or has not recovered yet)

    @property
    def seconds(self) -> float | None:
        return None if self.end is None else self.end - self.start


@dataclass
class Timeline:
    """What :func:`build_figure` draws; times in seconds since ``t0`` (unix seconds)."""

    t0: float
    steps: list[dict[str, Any]] = field(default_factory=list)  # train.step events, by time
    markers: list[Marker] = field(default_factory=list)
    pauses: list[Pause] = field(default_factory=list)
    last: float = 0.0  # the newest event (an unfinished pause lasts until then)

    def times(self) -> list[float]:
        return [e["ts"] - self.t0 for e in self.steps]

    def end(self) -> float:
        """The last second worth showing (the newest step, marker or pause)."""
        ends = [self.last, *self.times(), *(m.t for m in self.markers)]
        ends += [p.end for p in self.pauses if p.end is not None]
        ends += [p.start for p in self.pauses]
        return max(ends, default=0.0)


def load_events(source: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The events of a run directory (its ``events.jsonl``) or of an event log file."""
    path = Path(source)
    if path.is_dir():
        path = path / EVENT_LOG_NAME
    if not path.is_file():
        raise ConfigError(
            f"There is no event log at {path}; pass a run directory (runs/<run-id>) or its "
            f"{EVENT_LOG_NAME}."
        )
    return event_log.read(path)


def _valid(events: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Events with a numeric ``ts`` and a ``kind``, oldest first (the file's order is not
    strictly by time: many processes append to it)."""
    good = [
        dict(e)
        for e in events
        if isinstance(e.get("ts"), (int, float)) and isinstance(e.get("kind"), str)
    ]
    return sorted(good, key=lambda e: e["ts"])


def _nodes(event: Mapping[str, Any]) -> list[str]:
    nodes = event.get("nodes")
    if isinstance(nodes, list):
        return [str(n) for n in nodes]
    node = event.get("node")
    return [str(node)] if node else []


def _short(node: str) -> str:
    """A node's name as torch prints it (``host_pid_uuid``) shortened for a label."""
    return node if len(node) <= 18 else node[:15] + "..."


def _membership_markers(events: Sequence[Mapping[str, Any]], t0: float) -> list[Marker]:
    """Joins, leaves and kills, one line per incident (agents each report the same one)."""
    markers: list[Marker] = []
    rounds: dict[int, list[Mapping[str, Any]]] = {}
    for e in events:
        if e["kind"] == "rdzv.round" and isinstance(e.get("round"), int):
            rounds.setdefault(e["round"], []).append(e)
    seen: set[str] = set()
    for i, number in enumerate(sorted(rounds)):
        members = rounds[number]
        new = sorted({n for e in members for n in _nodes(e)} - seen)
        seen.update(new)
        if i and new:
            t = min(e["ts"] for e in members) - t0
            world = max(int(e.get("world_size", 0)) for e in members)
            markers.append(Marker(t, "join", f"join {', '.join(map(_short, new))} (->{world})"))
    left: set[str] = set()
    kills: list[tuple[float, list[str], bool]] = []  # (t, nodes, a worker failure)
    for e in events:
        kind, t = e["kind"], e["ts"] - t0
        if kind == "node.leave":
            nodes = [n for n in _nodes(e) if n not in left]
            left.update(nodes)
            if nodes:
                markers.append(Marker(t, "leave", f"SIGTERM {', '.join(map(_short, nodes))}"))
        elif kind in ("node.dead", "node.lost") or (
            kind == "worker.restart" and e.get("reason") == "failure"
        ):
            nodes = _nodes(e) if kind != "worker.restart" else []
            if kills and t - kills[-1][0] <= KILL_WINDOW_S:  # the same incident, seen again
                first_t, known, failure = kills[-1]
                extra = [n for n in nodes if n not in known]
                kills[-1] = (first_t, known + extra, failure or kind == "worker.restart")
            else:
                kills.append((t, list(nodes), kind == "worker.restart"))
    for t, nodes, _failure in kills:
        what = f"kill {', '.join(map(_short, nodes))}" if nodes else "worker failure"
        markers.append(Marker(t, "kill", what))
    return markers


def _pauses(
    steps: Sequence[Mapping[str, Any]], events: Sequence[Mapping[str, Any]], t0: float
) -> tuple[list[Pause], list[Marker]]:
    """The gaps between consecutive steps with a membership event inside (before the first
    step nothing trained, so nothing paused), and a recovery marker at each gap's end."""
    changes = sorted(e["ts"] for e in events if e["kind"] in MEMBERSHIP_KINDS)
    if not steps or not changes:
        return [], []
    loads = [e for e in events if e["kind"] == "ckpt.load"]
    pauses: list[Pause] = []
    markers: list[Marker] = []
    times = [s["ts"] for s in steps]
    for before, after, step in zip(times, times[1:], steps[1:], strict=False):
        i = bisect.bisect_right(changes, before)  # the first change after ``before``
        if i < len(changes) and changes[i] < after:
            pauses.append(Pause(before - t0, after - t0))
            label = f"world {step.get('world_size', '?')}"
            loaded = [e for e in loads if before < e["ts"] < after]
            if loaded:
                where = loaded[-1].get("source") or "ckpt"  # memory, peer, or storage
                label += f", from {where} {loaded[-1].get('step', '?')}"
            markers.append(Marker(after - t0, "recovery", label))
    if any(c > times[-1] for c in changes):
        pauses.append(Pause(times[-1] - t0, None))
    return pauses, markers


def analyse(events: Iterable[Mapping[str, Any]]) -> Timeline:
    """The steps, markers and pauses of a run's events (any order; torn entries skipped)."""
    ordered = _valid(events)
    if not ordered:
        return Timeline(t0=0.0)
    t0 = ordered[0]["ts"]
    steps = [e for e in ordered if e["kind"] == "train.step" and isinstance(e.get("step"), int)]
    pauses, recoveries = _pauses(steps, ordered, t0)
    markers = sorted([*_membership_markers(ordered, t0), *recoveries], key=lambda m: m.t)
    last = ordered[-1]["ts"] - t0
    return Timeline(t0=t0, steps=steps, markers=markers, pauses=pauses, last=last)


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) else math.nan


def build_figure(
    events: Iterable[Mapping[str, Any]],
    title: str | None = None,
    size: tuple[float, float] = SIZE,
) -> Figure:
    """The three-panel figure, ``size`` inches at 100 dpi (not attached to pyplot: safe off
    the main thread)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ConfigError(
            "Drawing a timeline needs matplotlib; install it with "
            "`pip install 'elastic[plot]'` (or `pip install matplotlib`)."
        ) from exc

    timeline = analyse(events)
    fig = Figure(figsize=size, dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(3, 1, sharex=True, height_ratios=(1, 1.4, 1.4))
    times = timeline.times()
    worlds = [_number(e.get("world_size")) for e in timeline.steps]
    axes[0].step(times, worlds, where="post", color="black", linewidth=1.5)
    axes[0].plot(times, worlds, ".", color="black", markersize=3)
    top = max((w for w in worlds if not math.isnan(w)), default=1.0)
    axes[0].set_ylim(0, top + 1.2)
    axes[0].yaxis.get_major_locator().set_params(integer=True)
    axes[1].plot(*_broken(timeline, "loss"), color="tab:purple")
    losses = [v for v in _broken(timeline, "loss")[1] if v > 0]  # NaN compares False
    if losses and max(losses) / min(losses) > 20:
        axes[1].set_yscale("log")
    axes[2].plot(*_broken(timeline, "samples_per_s"), color="tab:cyan")
    for ax, name in zip(axes, PANELS, strict=True):
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
        for pause in timeline.pauses:
            end = pause.end if pause.end is not None else timeline.last
            ax.axvspan(
                pause.start, end, color=PAUSE_COLOUR, alpha=PAUSE_ALPHA, linewidth=0, gid=PAUSE_GID
            )
        for marker in timeline.markers:
            colour, style = STYLES[marker.kind]
            ax.axvline(marker.t, color=colour, linestyle=style, linewidth=1.2)
    _label_markers(axes[0], timeline.markers)
    _legend(axes[0])
    axes[2].set_xlabel("seconds since the first event")
    axes[0].set_xlim(0, max(timeline.end(), 1.0) * 1.02)
    if not timeline.steps:
        axes[1].text(0.5, 0.5, "no steps yet", transform=axes[1].transAxes, ha="center")
    pauses = [p.seconds for p in timeline.pauses if p.seconds is not None]
    summary = f"{len(timeline.steps)} steps, {len(pauses)} pauses"
    if pauses:
        summary += f" ({sum(pauses):.1f} s standing still)"
    fig.suptitle(f"{title}: {summary}" if title else summary)
    return fig


def _label_markers(ax: Any, markers: Sequence[Marker]) -> None:
    """Each marker's label, rotated, just above the world-size panel."""
    transform = ax.get_xaxis_transform()  # x in data, y relative to the panel
    for marker in markers:
        colour, _ = STYLES[marker.kind]
        ax.text(
            marker.t,
            1.02,
            marker.label,
            transform=transform,
            rotation=35,
            rotation_mode="anchor",
            ha="left",
            va="bottom",
            fontsize=7.5,
            color=colour,
            clip_on=False,
        )


def _legend(ax: Any) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles: list[Any] = [
        Line2D([], [], color=STYLES[kind][0], linestyle=STYLES[kind][1], label=label)
        for kind, label in (
            ("join", "join"),
            ("leave", "leave (SIGTERM)"),
            ("kill", "kill / failure"),
            ("recovery", "first step after"),
        )
    ]
    handles.append(Patch(color=PAUSE_COLOUR, alpha=PAUSE_ALPHA, label="pause"))
    ax.legend(handles=handles, loc="upper left", fontsize=7.5, ncols=5, framealpha=0.85)


def _broken(timeline: Timeline, key: str) -> tuple[list[float], list[float]]:
    """The steps' ``key`` over time with a gap (NaN) inside each pause: no line is drawn
    across a stretch in which nothing trained."""
    xs: list[float] = []
    ys: list[float] = []
    starts = sorted(p.start for p in timeline.pauses)
    i = 0
    for t, e in zip(timeline.times(), timeline.steps, strict=True):
        while i < len(starts) and starts[i] < t:
            xs.append(starts[i])
            ys.append(math.nan)
            i += 1
        xs.append(t)
        ys.append(_number(e.get(key)))
    return xs, ys


def render_png(
    events: Iterable[Mapping[str, Any]],
    title: str | None = None,
    size: tuple[float, float] = SIZE,
) -> bytes:
    """The timeline as PNG bytes."""
    fig = build_figure(events, title, size)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def render_timeline(
    events: Iterable[Mapping[str, Any]] | str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    title: str | None = None,
) -> Path:
    """Write the timeline of ``events`` (a list of events, a run directory or an event log)
    to ``out_path`` (PNG); return that path."""
    if isinstance(events, (str, os.PathLike)):
        if title is None:
            source = Path(events)
            title = (source if source.is_dir() else source.parent).name
        events = load_events(events)
    out = Path(out_path)
    if out.parent and not out.parent.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
    fig = build_figure(events, title)
    fig.savefig(out, format="png")
    logger.info("Wrote the timeline to %s.", out)
    return out


__all__ = [
    "MEMBERSHIP_KINDS",
    "PAUSE_GID",
    "Marker",
    "Pause",
    "Timeline",
    "analyse",
    "build_figure",
    "load_events",
    "render_png",
    "render_timeline",
]
