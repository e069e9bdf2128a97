"""The agent's Prometheus exporter: scraped over HTTP, fed a fake event log and handler."""

from __future__ import annotations

import json
import os
import socket
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from elastic import env
from elastic.agent import metrics
from elastic.errors import EtcdConnectionError
from elastic.etcd.client import EtcdClient, EtcdOptions, parse_endpoints
from elastic.etcd.server import EtcdServer, free_port
from tests.helpers import FAST_CONF, local_cluster, node_env, wait_until

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    """Every sample of ``/metrics``, by name and labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def append(path: Path, *events: dict[str, Any], raw: bytes = b"") -> None:
    with open(path, "ab") as f:
        for event in events:
            f.write(json.dumps({"pid": 1, **event}).encode() + b"\n")
        f.write(raw)


def fake_handler(round_: int = 7, participants: int = 2, waiting: int = 1) -> Any:
    state = SimpleNamespace(
        round=round_,
        participants={f"node{i}": i for i in range(participants)},
        wait_list={f"late{i}" for i in range(waiting)},
    )
    view = (state.round, len(state.participants), len(state.wait_list))
    return SimpleNamespace(round_view=lambda: view)  # MembershipHandler.round_view


def worker_group(handler: Any, nodes: int, nproc: int) -> Any:
    workers = [SimpleNamespace(world_size=nodes * nproc) for _ in range(nproc)]
    spec = SimpleNamespace(rdzv_handler=handler, local_world_size=nproc)
    return SimpleNamespace(workers=workers, group_world_size=nodes, spec=spec)


@pytest.fixture
def exporter(tmp_path: Path) -> Iterator[metrics.Exporter]:
    started = metrics.start(
        0, addr="127.0.0.1", event_log=tmp_path / "events.jsonl", restart_budget=5, run_id="r"
    )
    assert started is not None and started.port > 0
    yield started
    started.close()


def test_scrape_has_the_rounds_budget_steps_and_checkpoints(
    exporter: metrics.Exporter, tmp_path: Path
) -> None:
    log = tmp_path / "events.jsonl"
    now = time.time()
    append(
        log,
        {"ts": now - 30, "kind": "ckpt.save", "step": 10, "ok": True, "rank": 0, "blocking_s": 0.2},
        {"ts": now - 29, "kind": "ckpt.save", "step": 10, "ok": True, "rank": 1, "blocking_s": 0.5},
        {"ts": now - 5, "kind": "ckpt.save", "step": 20, "ok": False, "rank": 0, "blocking_s": 1},
        {"ts": now - 2, "kind": "train.step", "step": 21, "loss": 0.75, "samples_per_s": 96.5},
        {"ts": now - 1, "kind": "worker.restart", "run_id": "r", "job_restarts_used": 2},
        {"ts": now - 1, "kind": "worker.restart", "run_id": "other", "job_restarts_used": 4},
        raw=b'not json\n{"kind": "train.step", "step": "torn',
    )
    before = scrape(exporter.port)
    assert value(before, "elastic_world_size") is None, "unknown before the first round"
    assert value(before, "elastic_job_restart_budget") == 5

    metrics.on_round(worker_group(fake_handler(round_=7, participants=2, waiting=1), 2, 2))
    samples = scrape(exporter.port)
    assert value(samples, "elastic_world_size") == 4
    assert value(samples, "elastic_nodes") == 2
    assert value(samples, "elastic_rendezvous_round") == 7
    assert value(samples, "elastic_rendezvous_members", state="participant") == 2
    assert value(samples, "elastic_rendezvous_members", state="waiting") == 1
    assert value(samples, "elastic_job_restarts_used") == 2, "other runs' events are ignored"
    assert value(samples, "elastic_job_restarts_left") == 3
    assert value(samples, "elastic_train_step") == 21
    assert value(samples, "elastic_train_loss") == 0.75
    assert value(samples, "elastic_train_samples_per_second") == 96.5
    assert value(samples, "elastic_checkpoint_step") == 10, "a failed save is not complete"
    assert 29 <= value(samples, "elastic_checkpoint_age_seconds") < 60
    assert value(samples, "elastic_checkpoint_last_stall_seconds") == 1
    assert value(samples, "elastic_checkpoint_stall_seconds_total") == pytest.approx(1.5)

    metrics.on_restarts(4, 5)
    assert value(scrape(exporter.port), "elastic_job_restarts_left") == 1
    metrics.on_restarts(9, 5)
    assert value(scrape(exporter.port), "elastic_job_restarts_left") == 0


def test_recovery_runs_from_the_change_to_the_first_step_of_the_next_round(
    exporter: metrics.Exporter, tmp_path: Path
) -> None:
    log = tmp_path / "events.jsonl"
    handler = fake_handler()
    metrics.on_round(worker_group(handler, 3, 1))
    append(log, {"ts": time.time(), "kind": "train.step", "step": 1, "loss": 1.0})
    noticed = time.time()
    metrics.on_change("peers_lost")
    metrics.on_change("failure")  # the same recovery: the first reason names it
    append(log, {"ts": time.time(), "kind": "train.step", "step": 2, "loss": 1.0})  # old round
    metrics.on_round(worker_group(handler, 2, 1))
    first = time.time() + 0.25
    append(log, {"ts": first, "kind": "train.step", "step": 3, "loss": 1.0})
    samples = scrape(exporter.port)
    assert value(samples, "elastic_recovery_seconds_count", kind="peers_lost") == 1
    assert value(samples, "elastic_recovery_seconds_count", kind="failure") is None
    seconds = value(samples, "elastic_recovery_seconds_sum", kind="peers_lost")
    assert seconds == pytest.approx(first - noticed, abs=0.05)
    assert value(samples, "elastic_world_size") == 2

    metrics.on_change("joiners")
    metrics.on_round(worker_group(handler, 3, 1))
    append(log, {"ts": time.time(), "kind": "train.step", "step": 4, "loss": 1.0})
    samples = scrape(exporter.port)
    assert value(samples, "elastic_recovery_seconds_count", kind="joiners") == 1
    assert value(samples, "elastic_recovery_seconds_count", kind="peers_lost") == 1


def test_a_change_during_a_recovery_is_part_of_it(
    exporter: metrics.Exporter, tmp_path: Path
) -> None:
    log = tmp_path / "events.jsonl"
    handler = fake_handler()
    noticed = time.time()
    metrics.on_change("dropped")
    metrics.on_round(worker_group(handler, 2, 1))
    metrics.on_change("peers_lost")  # before any step of that round: the same recovery
    metrics.on_round(worker_group(handler, 1, 1))
    first = time.time()
    append(log, {"ts": first, "kind": "train.step", "step": 5, "loss": 1.0})
    append(log, {"ts": first + 1, "kind": "train.step", "step": 6, "loss": 1.0})
    samples = scrape(exporter.port)
    assert value(samples, "elastic_recovery_seconds_count", kind="dropped") == 1
    assert value(samples, "elastic_recovery_seconds_count", kind="peers_lost") is None
    seconds = value(samples, "elastic_recovery_seconds_sum", kind="dropped")
    assert seconds == pytest.approx(first - noticed, abs=0.05)


def test_etcd_requests_are_timed_and_failures_counted(
    exporter: metrics.Exporter, etcd: EtcdServer, run_id: str
) -> None:
    with EtcdClient(EtcdOptions(parse_endpoints(etcd.endpoint)[0])) as client:
        client.put(f"/metrics-test/{run_id}".encode(), b"1")
        client.range(f"/metrics-test/{run_id}".encode())
        client.wait_for_event(f"/metrics-test/{run_id}".encode(), 10**9, timeout=0.1)
    unreachable = EtcdOptions(parse_endpoints(f"127.0.0.1:{free_port()}")[0], connect_timeout=0.2)
    with EtcdClient(unreachable) as client, pytest.raises(EtcdConnectionError):
        client.range(b"/metrics-test/x")
    samples = scrape(exporter.port)
    assert value(samples, "elastic_etcd_request_seconds_count", op="put") == 1
    assert value(samples, "elastic_etcd_request_seconds_count", op="range") == 2
    assert value(samples, "elastic_etcd_request_seconds_count", op="wait_for_event") is None
    errors = value(
        samples, "elastic_etcd_request_errors_total", op="range", error="EtcdConnectionError"
    )
    assert errors == 1


def _broken_view() -> Any:
    raise RuntimeError("the state is gone")


def test_errors_in_the_exporter_never_reach_the_agent(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    event_dir = tmp_path / "not-a-file"
    event_dir.mkdir()
    exp = metrics.start(0, addr="127.0.0.1", event_log=event_dir, restart_budget=1)
    assert exp is not None
    try:
        metrics.on_round(None)  # a hook given nonsense
        metrics.on_round(worker_group(SimpleNamespace(round_view=_broken_view), 1, 1))
        metrics.on_change("joiners")
        samples = scrape(exp.port)
        samples = scrape(exp.port)
        assert value(samples, "elastic_job_restart_budget") == 1
        assert value(samples, "elastic_world_size") == 1, "the sizes count without the state"
        assert value(samples, "elastic_rendezvous_members", state="participant") is None
        warnings = [r.getMessage() for r in caplog.records if r.name == "elastic.agent.metrics"]
        assert len([w for w in warnings if "event log" in w]) == 1, warnings
    finally:
        exp.close()
    metrics.on_change("failure")  # closed: a no-op

    busy = metrics.start(0, addr="127.0.0.1")
    assert busy is not None
    try:
        assert metrics.start(busy.port, addr="127.0.0.1") is None, "a taken port is logged"
    finally:
        busy.close()


def test_a_scrape_is_answered_while_others_hold_connections_and_closing_waits_for_none(
    exporter: metrics.Exporter,
) -> None:
    """One client drips its request head, another sits idle (each holds one of the
    server's connections, not the server): the scrape is answered meanwhile, and the agent
    closes its exporter without waiting for either."""
    drip = socket.create_connection(("127.0.0.1", exporter.port))
    idle = socket.create_connection(("127.0.0.1", exporter.port))
    try:
        drip.sendall(b"GET /metrics HT")
        assert value(scrape(exporter.port), "elastic_job_restart_budget") == 5
        started = time.monotonic()
        exporter.close()
        took = time.monotonic() - started
        assert took < 2.0, f"closing the exporter waited {took:.1f} s for its clients"
    finally:
        drip.close()
        idle.close()


def test_the_exporter_binds_a_node_name_to_its_address() -> None:
    """``--local-addr`` may be a host name: the exporter serves on what it resolves to."""
    exp = metrics.start(0, addr="localhost", restart_budget=2)
    assert exp is not None
    try:
        host = exp.server_address[0]
        assert host in ("127.0.0.1", "::1"), host
        url = f"http://{host if ':' not in host else f'[{host}]'}:{exp.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            assert b"elastic_job_restart_budget 2.0" in reply.read()
    finally:
        exp.close()


def test_tailer_reads_only_new_whole_lines_and_follows_a_new_file(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    tailer = metrics.EventTailer(log, max_backlog=4096)
    assert tailer.poll() == []
    append(log, {"ts": 1, "kind": "train.step", "step": 1}, {"ts": 1, "kind": "rdzv.round"})
    with open(log, "ab") as f:
        f.write(b'{"ts": 2, "kind": "train.step", ')
    assert [e["step"] for e in tailer.poll()] == [1]
    with open(log, "ab") as f:
        f.write(b'"step": 2}\n')
    assert [e["step"] for e in tailer.poll()] == [2]
    assert tailer.poll() == []

    log.unlink()
    append(log, {"ts": 3, "kind": "ckpt.save", "step": 3, "ok": True})
    assert [e["step"] for e in tailer.poll()] == [3]
    steps = [{"ts": 4, "kind": "train.step", "step": s, "pad": "x" * 100} for s in range(100)]
    append(log, *steps)
    seen = [e["step"] for e in tailer.poll()]
    assert seen[-1] == 99 and 20 < len(seen) < 50, "a backlog is skipped to its newest lines"


def test_event_log_for_workers_is_private_unless_set(tmp_path: Path) -> None:
    environ: dict[str, str] = {}
    directory = metrics.event_log_for_workers(environ)
    assert directory is not None
    assert environ[env.EVENT_LOG].startswith(directory)
    assert os.stat(directory).st_mode & 0o777 == 0o700
    metrics.remove_private_log(directory)
    assert not os.path.exists(directory)
    given = {env.EVENT_LOG: str(tmp_path / "e.jsonl")}
    assert metrics.event_log_for_workers(given) is None
    assert given[env.EVENT_LOG] == str(tmp_path / "e.jsonl")


SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from elastic import events
    out = sys.argv[1]
    with open(os.path.join(out, "event_log"), "w") as f:
        f.write(os.environ.get("ELASTIC_EVENT_LOG", ""))
    step = 0
    while not os.path.exists(os.path.join(out, "stop")):
        step += 1
        events.emit("train.step", step=step, loss=1.0 / step, samples_per_s=10.0, world_size=1)
        time.sleep(0.1)
    """
)


@pytest.mark.slow
def test_elastic_agent_serves_metrics_on_a_port_it_prints(
    tmp_path: Path, etcd: EtcdServer, run_id: str
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    environ = node_env(**{env.METRICS_PORT: "0"})
    options = {"nnodes": "1", "rdzv_conf": FAST_CONF, "max_restarts": 3}
    with local_cluster(tmp_path / "run", etcd.endpoint, run_id, environ, **options) as cluster:
        # No event log of ours: the agent keeps one private to its workers.
        agent = cluster.start("a", worker=[str(script), str(tmp_path)], event_log=False)

        def port_line() -> str | None:
            return next((x for x in agent.output().splitlines() if "metrics on port" in x), None)

        try:
            line = wait_until(port_line, 120, "the agent to print its metrics port")
            port = int(line.split("port")[1].split()[0])
            samples = wait_until(
                lambda: (s := scrape(port)) and (value(s, "elastic_train_step") or 0) >= 3 and s,
                120,
                "three steps in the metrics",
            )
            assert value(samples, "elastic_world_size") == 1
            assert value(samples, "elastic_nodes") == 1
            assert value(samples, "elastic_rendezvous_round") is not None
            assert value(samples, "elastic_job_restarts_left") == 3
            assert (value(samples, "elastic_etcd_request_seconds_count", op="txn") or 0) >= 1
            private_log = (tmp_path / "event_log").read_text()
            assert private_log and not private_log.startswith(str(tmp_path))
        finally:
            (tmp_path / "stop").touch()
            code = agent.wait(timeout=120)
        assert code == 0, agent.output()[-3000:]
    assert not os.path.exists(os.path.dirname(private_log)), "the private log is removed"
