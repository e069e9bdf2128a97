"""The straggler rule (elastic.worker.straggler): a pure function of (view, state, now),
table-tested with a fake clock; and the boundary vector's per-rank slots carry it."""

from __future__ import annotations

import json
from pathlib import Path
from types import MappingProxyType

import pytest
import torch

from elastic.errors import ConfigError
from elastic.worker import straggler
from elastic.worker.boundary import Layout, Vote
from elastic.worker.straggler import Options, State, View, decide

# min_slow_s=0: K alone decides (the time rule: test_named_after_k_steps_and_t_seconds)
ON = Options(ratio=2.0, steps=3, drop=True, min_nodes=2, window_s=60.0, min_slow_s=0.0)


def _view(step: int, compute: list[float], nodes: list[int] | None = None) -> View:
    nodes = nodes if nodes is not None else list(range(len(compute)))
    return View(step, tuple(compute), tuple(0.0 for _ in compute), tuple(nodes))


def _run(
    steps: list[list[float]], options: Options, nodes: list[int] | None = None, t0: float = 0.0
) -> list[straggler.Decision]:
    state, out = State(), []
    for i, compute in enumerate(steps):
        d = decide(_view(i, compute, nodes), state, t0 + i, options)
        state = d.state
        out.append(d)
    return out


def test_ratios_are_to_the_median() -> None:
    assert straggler.ratios((1.0, 1.0, 3.0)) == (1.0, 1.0, 3.0)
    assert straggler.ratios((0.0, 0.0)) == (1.0, 1.0)


@pytest.mark.parametrize(
    ("steps", "detected_at", "dropped_at"),
    [
        ([[1, 1, 3]] * 5, 2, 2),  # K=3 consecutive steps: named and dropped at the third
        ([[1, 1, 3], [1, 1, 3], [1, 1, 1], [1, 1, 3], [1, 1, 3], [1, 1, 3]], 5, 5),  # reset
        ([[1, 1, 1.9]] * 6, None, None),  # below X
        ([[1, 1, 3], [1, 1, 3], [0, 0, 0], [1, 1, 3], [1, 1, 3]], None, None),  # anew
        ([[1, 1, 3], [0, 0, 0], [1, 1, 3], [1, 1, 3], [1, 1, 3]], 4, 4),  # after a re-form
    ],
)
def test_k_consecutive_steps_above_x(
    steps: list[list[float]], detected_at: int | None, dropped_at: int | None
) -> None:
    decisions = _run(steps, ON)
    detected = [i for i, d in enumerate(decisions) if d.detected]
    dropped = [i for i, d in enumerate(decisions) if d.drop is not None]
    assert detected == ([] if detected_at is None else [detected_at])
    assert dropped == ([] if dropped_at is None else [dropped_at])
    for i in dropped:
        drop = decisions[i].drop
        assert drop is not None and drop.node == 2 and drop.ranks == (2,) and drop.ratio == 3.0


HEALTHY = [0.06, 0.06, 0.06]


@pytest.mark.parametrize(
    ("steps", "k", "t", "detected_at"),
    [
        ([[1, 1, 3]] * 5, 3, 0.0, 2),  # K alone (T = 0)
        ([[1, 1, 3]] * 5, 3, 9.0, 2),  # 3 + 3 + 3 = 9 s at the K-th step: both at once
        ([[1, 1, 3]] * 5, 3, 10.0, 3),  # K steps are 9 s: T decides, one step later
        ([[1, 1, 3]] * 5, 1, 7.0, 2),  # 3, 6, 9 s
        # a scheduler hiccup on a loaded host: 5 steps of 0.2 s at 3.3x (1 s): nobody
        ([HEALTHY] * 3 + [[0.06, 0.06, 0.2]] * 5 + [HEALTHY] * 3, 5, 10.0, None),
        # a 2 s GC pause, or a save, is one step: nobody, even at K = 1
        ([HEALTHY] * 3 + [[0.06, 0.06, 2.0]] + [HEALTHY] * 3, 1, 10.0, None),
        ([HEALTHY] * 3 + [[0.06, 0.06, 8.0]] * 1 + [HEALTHY] * 3, 1, 10.0, None),
        # the seconds start anew with the streak: a healthy step between two long ones
        ([[1, 1, 6], [1, 1, 1], [1, 1, 6]], 1, 10.0, None),
        ([[1, 1, 6], [0, 0, 0], [1, 1, 6]], 1, 10.0, None),  # and after an unmeasured step
        ([[1, 1, 6], [1, 1, 6]], 1, 10.0, 1),  # 12 s in a row
    ],
)
def test_named_after_k_steps_and_t_seconds(
    steps: list[list[float]], k: int, t: float, detected_at: int | None
) -> None:
    decisions = _run(steps, Options(ratio=2.0, steps=k, drop=True, min_slow_s=t))
    detected = [i for i, d in enumerate(decisions) if d.detected]
    assert detected == ([] if detected_at is None else [detected_at])
    dropped = [i for i, d in enumerate(decisions) if d.drop is not None]
    assert dropped == detected  # the policy drops what is named, when it is named
    for i in detected:
        slow = decisions[i].detected[0]
        assert slow.node == 2 and slow.steps >= k and slow.seconds >= t, slow


def test_a_node_really_slower_is_named_once_its_slowness_reaches_t() -> None:
    """With the defaults (K = 5, T = 10 s): a node at 3x of 0.06 s steps (0.18 s) is
    named once its slow steps add up to 10 s (56 steps), once, not again while it stays
    slow; its streak's seconds are in the reason."""
    options = Options(ratio=2.0, drop=False)
    assert (options.steps, options.min_slow_s) == (5, straggler.DEFAULT_MIN_SLOW_S) == (5, 10.0)
    decisions = _run([[0.06, 0.06, 0.18]] * 80, options)
    detected = [i for i, d in enumerate(decisions) if d.detected]
    assert detected == [55], detected  # 56 x 0.18 = 10.08 s
    assert decisions[55].detected[0].seconds == pytest.approx(10.08)
    assert "(10.08 s)" in decisions[55].reason and "policy is off" in decisions[55].reason
    assert "for 5 steps and 10 s" in decisions[54].reason  # not yet: what it waits for


def test_a_slow_rank_among_healthy_ranks_of_its_node_counts_its_own_time() -> None:
    """A node's seconds are its slowest rank's compute time, against the median of the
    nodes' (the step's own ranks): a loaded host slows every node alike and names nobody."""
    nodes = [0, 0, 1, 1, 2, 2]
    loaded = [[0.5, 0.5, 0.6, 0.5, 0.5, 0.7]] * 40  # everyone slow: ratios near 1
    assert not any(d.detected for d in _run(loaded, Options(2.0, 5, True), nodes))
    slow = [[0.1, 0.1, 0.1, 0.1, 0.1, 2.5]] * 5  # rank 5: 25x, 12.5 s in 5 steps
    d = _run(slow, Options(2.0, 5, True), nodes)
    assert [i for i, x in enumerate(d) if x.detected] == [4]
    assert d[4].drop is not None and d[4].drop.ranks == (4, 5) and d[4].drop.seconds == 12.5


def test_policy_off_detects_only() -> None:
    decisions = _run([[1, 1, 3]] * 5, Options(ratio=2.0, steps=3, min_slow_s=0.0))
    assert [bool(d.detected) for d in decisions] == [False, False, True, False, False]
    assert all(d.drop is None for d in decisions)
    assert "the policy is off" in decisions[-1].reason


def test_a_node_is_its_slowest_rank() -> None:
    # 3 nodes of 2 ranks; rank 5 (node 2) is slow: node 2 is named with both its ranks
    nodes = [0, 0, 1, 1, 2, 2]
    d = _run([[1, 1, 1, 1, 1, 3]] * 3, ON, nodes)[-1]
    assert d.drop is not None and d.drop.ranks == (4, 5)
    assert d.ratios[5] == 3.0


def test_two_nodes_name_nobody() -> None:
    """The median of two is their mean: a node at 1/3 speed reads 1.5 against 0.5, and
    nothing tells which of the two holds the other back; nothing is named or dropped."""
    for d in _run([[1, 3]] * 6, ON):
        assert not d.detected and d.drop is None
        assert "cannot say which one is slow" in d.reason
        assert d.ratios == (0.5, 1.5)


def test_never_below_min_nodes() -> None:
    d = _run([[1, 1, 3]] * 3, Options(2.0, 3, True, min_nodes=3, min_slow_s=0.0))[-1]
    assert d.detected and d.drop is None and "fewer than 3 nodes" in d.reason


def test_one_drop_per_window() -> None:
    # nodes 3 and 4 both slow: the slowest goes first, the other waits for the window
    state = State()
    compute = [1.0, 1.0, 1.0, 4.0, 3.0]
    drops: list[tuple[float, int]] = []
    for now in [0.0, 1.0, 2.0, 3.0, 30.0, 61.0, 62.0, 63.0]:
        d = decide(_view(0, compute), state, now, ON)
        state = d.state
        if d.drop is not None:
            drops.append((now, d.drop.node))
            compute = [1.0, 1.0, 1.0, 1.0, 3.0]  # node 3 is gone (reads as healthy here)
    assert drops[0] == (2.0, 3)
    assert all(now - 2.0 >= 60.0 for now, _ in drops[1:]), drops
    assert [n for _, n in drops] == [3, 4]


def test_a_joiner_keeps_the_window_the_others_report() -> None:
    """Every rank reports the age of the last drop it knows in its slots: a rank with no
    record of its own (a joiner, a node back from probation) reads the same window."""
    compute = (1.0, 1.0, 1.0, 4.0)
    joiner = State(MappingProxyType({3: 2}))  # it never saw the drop 10 s ago
    ages = (10.0, 10.0, 10.0, 0.0)  # the others report it; the joiner reports none
    view = View(5, compute, (0.0,) * 4, (0, 1, 2, 3), ages)
    d = decide(view, joiner, 1000.0, ON)
    assert d.detected and d.drop is None and "dropped 10.0 s ago" in d.reason
    late = View(5, compute, (0.0,) * 4, (0, 1, 2, 3), (61.0, 61.0, 61.0, 0.0))
    assert decide(late, joiner, 1000.0, ON).drop is not None
    assert straggler.last_drop_age(late, State(last_drop=990.0), 1000.0) == 61.0
    assert straggler.last_drop_age(View(5, compute, compute, (0,) * 4), State(), 1.0) is None


def test_hang_bound() -> None:
    assert straggler.hang_bound((), 5.0, 10.0) == 5.0
    assert straggler.hang_bound((1.0, 1.0, 9.0), 5.0, 10.0) == 10.0


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, Options()),
        ({"ELASTIC_STRAGGLER": "off"}, Options()),
        ({"ELASTIC_STRAGGLER": "2.5,4"}, Options(2.5, 4, True)),
        ({"ELASTIC_STRAGGLER": "2,5", "ELASTIC_STRAGGLER_MIN_NODES": "3"}, Options(2, 5, True, 3)),
        ({"ELASTIC_STRAGGLER_MIN_SLOW_S": "2.5"}, Options(min_slow_s=2.5)),
        ({"ELASTIC_STRAGGLER_MIN_SLOW_S": "0"}, Options(min_slow_s=0.0)),
    ],
)
def test_options_from_env(env: dict[str, str], expected: Options) -> None:
    assert straggler.options_from_env(env) == expected


@pytest.mark.parametrize("raw", ["2", "x,5", "1,5", "2,0"])
def test_bad_options_say_what_to_write(raw: str) -> None:
    with pytest.raises(ConfigError, match="ELASTIC_STRAGGLER"):
        straggler.options_from_env({"ELASTIC_STRAGGLER": raw})


def test_hang_from_env() -> None:
    assert straggler.hang_from_env({}) is None
    assert straggler.hang_from_env({"ELASTIC_HANG": "on"}) == (60.0, 10.0)
    assert straggler.hang_from_env({"ELASTIC_HANG": "off"}) is None
    assert straggler.hang_from_env({"ELASTIC_HANG": "2,5"}) == (2.0, 5.0)
    with pytest.raises(ConfigError):
        straggler.hang_from_env({"ELASTIC_HANG": "2"})


def test_slots_ride_on_the_agreement_vector() -> None:
    """Each rank writes its own record; the all-gather gives every rank all."""
    layout = Layout(3, straggler.SLOTS, straggler.LIMITS)
    rows = []
    for rank in range(3):
        slots = {"compute_s": 0.1 * (rank + 1), "wait_s": 0.01 * rank, "node": 4e9 + rank}
        rows.append(layout.row(Vote(), (1.0, 1.0), slots))
    tally = layout.parse(torch.stack(rows))
    assert tally.slots == (
        (0.1, 0.0, 4e9, 0.0),
        (0.2, 0.01, 4e9 + 1, 0.0),
        (0.30000000000000004, 0.02, 4e9 + 2, 0.0),
    )
    assert tally.weight == 3.0


def test_metrics_show_every_ranks_times_and_the_counts(tmp_path: Path) -> None:
    """The agent's exporter reads the per-rank figures off rank 0's train.step events."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from elastic.agent import metrics

    log = tmp_path / "events.jsonl"
    lines = [
        {
            "ts": 1.0,
            "kind": "train.step",
            "step": 1,
            "compute_s": [0.1, 0.1, 0.3],
            "wait_s": [0.2, 0.2, 0.0],
            "slowest": [[2, 3.0], [0, 1.0], [1, 1.0]],
        },
        {
            "ts": 2.0,
            "kind": "straggler.detected",
            "step": 1,
            "node": 7,
            "ranks": [2],
            "rank": 2,
            "ratio": 3.0,
            "steps": 3,
            "threshold": 2.0,
            "policy": False,
        },
        {
            "ts": 3.0,
            "kind": "worker.hang",
            "rank": 1,
            "step": 2,
            "pid": 1,
            "seconds": 61.0,
            "bound_s": 60.0,
        },
    ]
    log.write_text("".join(json.dumps(e) + "\n" for e in lines))
    m = metrics.AgentMetrics(log)
    text = generate_latest(m.registry).decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("elastic_rank_slowness_ratio", (("rank", "2"),))] == pytest.approx(3.0)
    assert samples[("elastic_rank_compute_seconds", (("rank", "0"),))] == pytest.approx(0.1)
    assert samples[("elastic_rank_wait_seconds", (("rank", "1"),))] == pytest.approx(0.2)
    assert samples[("elastic_stragglers_detected_total", ())] == 1
    assert samples[("elastic_workers_hung_total", ())] == 1


class _Guard:
    def __init__(self) -> None:
        self.since: float | None = None

    def in_flight_since(self) -> float | None:
        return self.since


def test_hang_watch_names_only_a_rank_with_no_collective_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the bound with a collective in flight: a peer is late, not us; without one: we
    are stuck; the stacks and the hang go to the event log, then the process exits."""
    from elastic import events
    from elastic.worker.hang import HangWatch

    monkeypatch.setenv("ELASTIC_HANG", "2,5")
    monkeypatch.setenv("ELASTIC_EVENT_LOG", str(tmp_path / "events.jsonl"))
    guard, exits = _Guard(), list[int]()
    watch = HangWatch(guard, lambda: (0.1, 0.1), lambda: (3, 17), exit=exits.append)
    assert watch.bound() == 2.0
    watch._step_began, watch._in_step = 100.0, True  # (resume() would start the thread)
    assert watch.stuck_for(101.0) is None  # inside the bound
    guard.since = 100.5
    assert watch.stuck_for(103.0) is None  # waiting in a collective: a peer is late
    guard.since = None
    assert watch.stuck_for(103.0) == 3.0
    watch.pause()
    assert watch.stuck_for(200.0) is None  # at the boundary
    watch.give_up(3.0)
    assert exits == [76]  # elastic.node.reform.HUNG: its agent leaves the round, then rejoins
    stacks = events.read(tmp_path / "events.jsonl", "worker.stacks")[0]
    assert "test_hang_watch_names_only" in stacks["stacks"] and stacks["rank"] == 3
    hang = events.read(tmp_path / "events.jsonl", "worker.hang")[0]
    assert (hang["rank"], hang["step"], hang["seconds"], hang["bound_s"]) == (3, 17, 3.0, 2.0)


def test_no_hang_watch_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from elastic.worker.hang import HangWatch

    monkeypatch.delenv("ELASTIC_HANG", raising=False)
    watch = HangWatch(_Guard(), lambda: (), lambda: (0, 0))
    watch.resume()
    assert watch.limits is None and watch._thread is None


class _Waits:
    def __init__(self) -> None:
        self.total = 0.0

    def waited(self) -> float:
        return self.total


def test_step_times_measure_and_ask_for_probation_or_leave(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank's compute is its step less the guard's wait; rank 0 records the detection;
    the lowest rank of the dropped node asks its agent for probation, or with probation
    off sends it SIGTERM (a planned leave)."""
    import os
    import signal
    from types import SimpleNamespace

    from elastic import events
    from elastic.worker import probation, timing
    from elastic.worker.boundary import Tally

    monkeypatch.setenv("ELASTIC_STRAGGLER", "2,2")
    monkeypatch.setenv("ELASTIC_STRAGGLER_MIN_SLOW_S", "5")  # 2 steps of 3 s: 6 s
    monkeypatch.setenv("ELASTIC_SNAPSHOT_OWNER", "4242")
    monkeypatch.setenv("ELASTIC_EVENT_LOG", str(tmp_path / "events.jsonl"))
    killed: list[tuple[int, int]] = []
    monkeypatch.setattr(timing.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    guard = _Waits()
    run = SimpleNamespace(reforms=0, step=0, rank=0)  # the state and the place, as one
    times = timing.StepTimes(run, run, guard)  # type: ignore[arg-type]
    assert times.slots()["compute_s"] == 0.0  # the first step is not measured
    guard.total = 0.5
    slots = times.slots()
    assert slots["wait_s"] == pytest.approx(0.5) and slots["compute_s"] == 1e-6  # clamped
    run.reforms = 1
    assert times.slots()["compute_s"] == 0.0  # a re-form in between: not measured

    slow = ((1.0, 0.0, 7.0, 0.0), (1.0, 0.0, 8.0, 0.0), (3.0, 0.0, float(times.node), 0.0))
    for step in (1, 2):
        run.step = step
        times.observe(Tally(0, 0, 0, 0, 0, 0.0, 0.0, slow))
    assert events.read(tmp_path / "events.jsonl", "straggler.detected")[0]["ranks"] == [2]
    assert events.read(tmp_path / "events.jsonl", "straggler.dropped")[0]["median_s"] == 1.0
    assert killed == []  # rank 0 is not on the dropped node
    assert times.fields()["slowest"][0] == [2, 3.0]

    run.rank = 2  # the dropped node's lowest rank: it asks its agent for probation
    monkeypatch.setenv("ELASTIC_SNAPSHOT_OWNER", str(os.getpid()))
    asked: list[tuple[int, probation.Request]] = []
    monkeypatch.setattr(probation, "write_request", lambda o, r: asked.append((o, r)))
    times2 = timing.StepTimes(run, run, guard)  # type: ignore[arg-type]
    for step in (1, 2):
        run.step = step
        times2.observe(Tally(0, 0, 0, 0, 0, 0.0, 0.0, slow))
    assert killed == [] and len(asked) == 1 and asked[0][0] == os.getpid()
    assert (asked[0][1].step, asked[0][1].ratio, asked[0][1].median_s) == (2, 3.0, 1.0)

    monkeypatch.setenv("ELASTIC_PROBATION", "off")  # probation off: its agent leaves
    monkeypatch.setenv("ELASTIC_SNAPSHOT_OWNER", "4242")
    times3 = timing.StepTimes(run, run, guard)  # type: ignore[arg-type]
    for step in (1, 2):
        run.step = step
        times3.observe(Tally(0, 0, 0, 0, 0, 0.0, 0.0, slow))
    assert killed == [(4242, signal.SIGTERM)] and len(asked) == 1


def test_a_rank_claiming_another_nodes_id_cannot_drop_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Rank 3 (another node) writes node 9's id and a slow time into its own record: node 9
    reads as slow (its slowest rank). Node 9's lowest rank sees more ranks named for its
    node than it has ($LOCAL_WORLD_SIZE) and stays; no probation is asked."""
    import os
    from types import SimpleNamespace

    from elastic.worker import probation, timing
    from elastic.worker.boundary import Tally

    monkeypatch.setenv("ELASTIC_STRAGGLER", "2,2")
    monkeypatch.setenv("ELASTIC_STRAGGLER_MIN_SLOW_S", "0")  # K alone
    monkeypatch.setenv("ELASTIC_SNAPSHOT_OWNER", str(os.getpid()))
    monkeypatch.setenv("ELASTIC_EVENT_LOG", str(tmp_path / "events.jsonl"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    asked: list[object] = []
    monkeypatch.setattr(probation, "write_request", lambda o, r: asked.append(r))
    monkeypatch.setattr(timing.os, "kill", lambda pid, sig: asked.append((pid, sig)))
    run = SimpleNamespace(reforms=0, step=0, rank=2)  # the state and the place, as one
    times = timing.StepTimes(run, run)  # type: ignore[arg-type]
    liar = ((1.0, 0.0, 7.0, 0.0), (1.0, 0.0, 8.0, 0.0), (1.0, 0.0, 9.0, 0.0), (3.0, 0.0, 9.0, 0.0))
    for step in (1, 2):
        run.step = step
        times.observe(Tally(0, 0, 0, 0, 0, 0.0, 0.0, liar))
    assert times.last is not None and times.last.drop is not None
    assert times.last.drop.ranks == (2, 3)
    assert asked == []
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks on node 9 are its own: it goes
    times = timing.StepTimes(run, run)  # type: ignore[arg-type]
    for step in (1, 2):
        run.step = step
        times.observe(Tally(0, 0, 0, 0, 0, 0.0, 0.0, liar))
    assert len(asked) == 1


@pytest.mark.parametrize("raw", ["-1", "x", "1e8"])
def test_a_bad_min_slow_s_is_a_sentence(raw: str) -> None:
    with pytest.raises(ConfigError, match=r"straggler\.min_slow_s \(--straggler-min-slow-s"):
        straggler.options_from_env({"ELASTIC_STRAGGLER_MIN_SLOW_S": raw})
