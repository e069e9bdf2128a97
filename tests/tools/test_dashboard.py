"""elastic dashboard: its JSON and pages over HTTP, and the page in a real headless browser."""

from __future__ import annotations

import gc
import http.client
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import time
import tracemalloc
import urllib.error
import urllib.request
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from elastic.etcd.server import EtcdServer
from elastic_tools.dashboard import (
    MAX_OTHER,
    MAX_STEPS,
    Dashboard,
    EventTail,
    Served,
    allowed_hosts,
    host_name,
    serve,
)
from elastic_tools.status import etcd_options
from tests.agent.jobs import Job
from tests.helpers import PYTHON, REPO, node_env, wait_until

CHROMIUM = Path("/usr/bin/chromium")
SETUP = REPO / ".ci" / "browser-setup.sh"


def _get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read()


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.fixture
def served(etcd: EtcdServer, run_id: str, tmp_path: Path) -> Iterator[Served]:
    log = tmp_path / "events.jsonl"
    dashboard = Dashboard(etcd_options(etcd.endpoint), run_id, event_log=log)
    with serve(dashboard, port=0) as server:
        yield server


def test_event_tail_reads_only_what_was_appended(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    tail = EventTail(log)
    assert tail.poll() == []  # no file yet
    log.write_bytes(b'{"kind": "a", "ts": 1}\n{"kind": "b", "ts"')
    assert [e["kind"] for e in tail.poll()] == ["a"]  # the torn line waits for its end
    with open(log, "ab") as f:
        f.write(b': 2}\nnot json\n{"kind": "train.samples", "ts": 2.5}\n{"kind": "c", "ts": 3}\n')
    assert [e["kind"] for e in tail.poll()] == ["a", "b", "c"]
    log.write_bytes(b'{"kind": "d", "ts": 4}\n')  # rewritten (shorter): read again
    assert [e["kind"] for e in tail.poll()] == ["d"]
    assert EventTail(None).poll() == []


def test_pages_and_json_of_a_run_that_has_not_started(served: Served, run_id: str) -> None:
    assert served.port > 0 and served.url == f"http://127.0.0.1:{served.port}/"
    status, kind, body = _get(served.url)
    assert status == 200 and kind.startswith("text/html")
    page = body.decode()
    assert f'run <span id="run-id">{run_id}</span>' in page
    assert 'id="members"' in page and 'id="timeline"' in page and "setInterval(poll, 1000)" in page
    status, kind, body = _get(served.url + "api/status")
    assert status == 200 and kind == "application/json"
    data = json.loads(body)
    assert data["run_id"] == run_id and data["rendezvous"] == {"exists": False}
    assert data["step"] is None and data["events"] == 0 and data["errors"] == []
    status, kind, body = _get(served.url + "timeline.png?t=1")
    assert status == 200 and kind == "image/png" and _png_size(body) == (1100, 600)
    status, _, body = _get(served.url + "nothing")
    assert status == 404 and b"No such page on this dashboard" in body


def test_status_reads_new_events_and_reports_etcd_errors(
    served: Served, tmp_path: Path, etcd: EtcdServer
) -> None:
    log = tmp_path / "events.jsonl"
    lines = [
        {
            "ts": 10.0,
            "kind": "train.step",
            "step": 1,
            "loss": 2.5,
            "samples_per_s": 9.0,
            "world_size": 1,
        },
        {"ts": 11.0, "kind": "ckpt.save", "step": 1, "ok": True, "url": "file:///c/step-1"},
        {"ts": 12.0, "kind": "ckpt.save", "step": 2, "ok": False, "error": "disk full"},
        {
            "ts": 13.0,
            "kind": "train.step",
            "step": 2,
            "loss": 2.0,
            "samples_per_s": 10.0,
            "world_size": 1,
        },
    ]
    log.write_text("".join(json.dumps(e) + "\n" for e in lines))
    data = wait_until(
        lambda: (d := json.loads(_get(served.url + "api/status")[2]))["events"] == 4 and d,
        10,
        "the dashboard to read the event log",
    )
    assert data["step"] == {
        "step": 2,
        "loss": 2.0,
        "samples_per_s": 10.0,
        "world_size": 1,
        "ts": 13.0,
    }
    assert data["checkpoint"]["saved_step"] == 1  # the failed save does not count

    from elastic.etcd.server import free_port

    unreachable = Dashboard(
        etcd_options(f"127.0.0.1:{free_port()}", request_timeout=1.0), "x", event_log=log
    )
    try:
        status = unreachable.status()
    finally:
        unreachable.close()
    assert status["rendezvous"] is None and status["step"]["step"] == 2
    assert any("Could not reach etcd" in e for e in status["errors"]), status["errors"]


def _get_as(port: int, host: str | None, path: str = "/api/status") -> tuple[int, bytes]:
    """GET ``path`` from 127.0.0.1:``port`` with this ``Host`` header (None: no header)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest("GET", path, skip_host=True)
        if host is not None:
            conn.putheader("Host", host)
        conn.endheaders()
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _strict(body: bytes) -> Any:
    """``body`` as a browser's ``JSON.parse`` reads it: NaN and Infinity are refused."""

    def refuse(constant: str) -> None:
        raise ValueError(f"/api/status is not JSON: it holds {constant}")

    return json.loads(body, parse_constant=refuse)


def test_a_nan_loss_keeps_the_status_json_and_the_page_updating(
    served: Served, tmp_path: Path
) -> None:
    """Issue 38, item 10: a diverged loss (NaN, as events.emit writes it) made /api/status
    invalid JSON, and the page, which parses it every second, stopped updating."""
    log = tmp_path / "events.jsonl"
    step: dict[str, Any] = {"ts": 10.0, "kind": "train.step", "step": 1, "world_size": 1}
    diverged = {**step, "loss": float("nan"), "samples_per_s": float("inf")}
    log.write_text(json.dumps(diverged) + "\n")
    assert "NaN" in log.read_text()  # the event log holds Python's bare NaN
    url = served.url + "api/status"
    data = wait_until(lambda: (d := _strict(_get(url)[2]))["events"] == 1 and d, 10, "the NaN step")
    assert data["step"]["loss"] == "NaN" and data["step"]["samples_per_s"] == "Infinity"
    with open(log, "a") as f:
        f.write(json.dumps({**step, "ts": 11.0, "step": 2, "loss": 1.5}) + "\n")
    data = wait_until(
        lambda: (d := _strict(_get(url)[2]))["events"] == 2 and d, 10, "the next step"
    )
    assert data["step"]["step"] == 2 and data["step"]["loss"] == 1.5


def test_only_requests_that_name_the_server_are_answered(served: Served) -> None:
    """A page whose DNS name was rebound to 127.0.0.1 sends its own name as Host."""
    port = served.port
    names = ("127.0.0.1", "localhost", "LocalHost.", "[::1]")
    # any port: a container's published port is not the one it listens on
    for host in [f"{name}:{port}" for name in names] + ["localhost:1", "localhost"]:
        status, body = _get_as(port, host)
        assert status == 200 and "run_id" in json.loads(body), host
    refused = ["evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "[::2]:1", ""]
    for bad in [*refused, None]:
        for path in ("/api/status", "/", "/timeline.png"):
            status, body = _get_as(port, bad, path)
            assert status == 421, (bad, path, status)
            assert body.startswith(b"This dashboard does not answer for the host"), body
            assert b"--allow-host NAME." in body and b"run_id" not in body


def test_allow_host_adds_a_name(etcd: EtcdServer, run_id: str) -> None:
    dashboard = Dashboard(etcd_options(etcd.endpoint), run_id)
    with serve(dashboard, port=0, allow_hosts=["Dash.Example"]) as server:
        port = server.port
        assert _get_as(port, f"dash.example:{port}")[0] == 200
        assert _get_as(port, "DASH.example")[0] == 200
        assert _get_as(port, f"evil.example:{port}")[0] == 421


def test_allowed_hosts_and_host_names() -> None:
    assert allowed_hosts("0.0.0.0") == {"127.0.0.1", "localhost", "[::1]"}
    assert "10.0.0.5" in allowed_hosts("10.0.0.5")
    assert {"[fe80::1]", "box"} <= allowed_hosts("fe80::1", ["BOX. "])
    assert host_name("[fe80::1]:8080") == "[fe80::1]" and host_name("Box.:80") == "box"
    assert host_name("evil.example:8080") == "evil.example" and host_name("") == ""


def _write_events(log: Path, start: int, n: int) -> None:
    """``n`` events from number ``start``: nine steps in ten, then a round or a save."""
    lines = []
    for i in range(start, start + n):
        if i % 10:
            event = {"ts": float(i), "kind": "train.step", "step": i, "loss": 1.0 / (i + 1)}
        elif i % 20:
            event = {"ts": float(i), "kind": "rdzv.round", "round": i, "world_size": 2}
        else:
            event = {"ts": float(i), "kind": "ckpt.save", "step": i, "ok": True, "url": "u"}
        lines.append(json.dumps(event) + "\n")
    with open(log, "a") as f:
        f.writelines(lines)


def test_a_long_event_log_keeps_memory_bounded(tmp_path: Path) -> None:
    log, batch, bound = tmp_path / "events.jsonl", 60_000, MAX_STEPS + MAX_OTHER + 2
    tail = EventTail(log)
    tracemalloc.start()
    try:
        sizes, kept = [], []
        for round_ in range(3):
            _write_events(log, round_ * batch, batch)
            kept = tail.poll()
            gc.collect()
            sizes.append(tracemalloc.get_traced_memory()[0])
            assert tail.count == (round_ + 1) * batch and len(kept) <= bound, len(kept)
    finally:
        tracemalloc.stop()
    # what stays after the second batch does not grow with the third (5%: the allocator)
    assert sizes[2] < sizes[1] * 1.05, sizes
    assert sizes[2] < 30 * 2**20, sizes  # a few MB, not the 180,000 events
    newest = 3 * batch - 1
    assert kept[0]["ts"] == 0.0 and kept[-1]["step"] == newest  # the timeline's two ends
    steps = [e["step"] for e in kept if e["kind"] == "train.step"]
    assert steps == sorted(steps) and len(steps) <= MAX_STEPS + 1 and steps[0] < batch
    summary = tail.summary()
    assert summary.count == 3 * batch and summary.step is not None
    assert summary.step["step"] == newest
    assert summary.saved is not None and summary.saved["step"] == newest - newest % 20


def _write_big_log(log: Path, n: int) -> int:
    """``n`` events of about 170 bytes, as workers write them (compact JSON): the newest
    successful save's step."""
    pad = "x" * 90
    saved = -1
    with open(log, "w") as f:
        for i in range(n):
            if i % 50 == 0:
                ok = i % 100 == 0
                saved = i if ok else saved
                event = {"ts": float(i), "kind": "ckpt.save", "step": i, "ok": ok, "url": pad}
            elif i % 7 == 0:
                event = {"ts": float(i), "kind": "train.samples", "step": i, "pad": pad}
            else:
                event = {"ts": float(i), "kind": "train.step", "step": i, "loss": 0.5, "pad": pad}
            f.write(json.dumps(event, separators=(",", ":")) + "\n")
    return saved


def test_a_large_log_it_starts_on_costs_little_time_and_memory(tmp_path: Path) -> None:
    """400,000 events (about 65 MiB): the first summary took 4.2 s and 425 MiB more."""
    log, n = tmp_path / "events.jsonl", 400_000
    saved = _write_big_log(log, n)
    assert log.stat().st_size > 60 << 20
    samples = len([i for i in range(n) if i % 50 and i % 7 == 0])
    started = time.perf_counter()
    EventTail(log).summary()
    seconds = time.perf_counter() - started
    assert seconds < 5.0, f"{seconds:.1f} s"  # about 0.2 s on an idle core
    tail = EventTail(log)
    tracemalloc.start()
    try:
        summary = tail.summary()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"{peak >> 20} MiB"
    assert summary.count == n - samples, (summary.count, n - samples)
    assert summary.step is not None and summary.step["step"] == n - 1
    assert summary.saved is not None and summary.saved["step"] == saved
    kept = tail.poll()
    assert kept[0]["ts"] == 0.0 and kept[-1]["step"] == n - 1
    assert len(kept) <= MAX_STEPS + MAX_OTHER + 2
    with open(log, "a") as f:  # what comes next is read whole, as before
        f.write(json.dumps({"ts": 1e6, "kind": "train.step", "step": n}) + "\n")
    assert tail.summary().count == n - samples + 1


# -- the page in a real browser -------------------------------------------------------------


@pytest.fixture(scope="module")
def chromium() -> Path:
    """Debian's chromium; installed by .ci/browser-setup.sh when missing. Outside CI a machine
    that cannot install it skips the browser test; in CI (``$CI`` set) that fails."""
    if not CHROMIUM.exists() and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["bash", str(SETUP)], capture_output=True, timeout=900, check=False)
    if CHROMIUM.exists():
        return CHROMIUM
    why = f"{CHROMIUM} is missing and .ci/browser-setup.sh could not install it (needs root + apt)"
    if os.environ.get("CI"):
        pytest.fail(f"{why}; CI must run the browser test.")
    pytest.skip(why)


def browse(chromium: Path, tmp: Path, url: str, *action: str) -> subprocess.CompletedProcess[str]:
    """One headless chromium run (a fresh profile) on ``url``: ``--dump-dom`` or
    ``--screenshot=PNG``."""
    profile = tmp / f"profile-{len(list(tmp.glob('profile-*')))}"
    profile.mkdir()
    argv = [
        str(chromium),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--window-size=1280,900",
        "--virtual-time-budget=5000",
        *action,
        url,
    ]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=180, cwd=tmp)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


class _Dom(HTMLParser):
    """The member rows, the plot element and the cards of a dumped DOM."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, Any]] = []
        self.images: list[dict[str, str | None]] = []
        self.values: dict[str, str] = {}
        self._cell: list[str] | None = None
        self._value: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "tr" and a.get("class") == "member":
            self.rows.append({"node": a.get("data-node"), "cells": []})
        elif tag == "td" and self.rows:
            self._cell = []
        elif tag == "img":
            self.images.append(a)
        elif tag == "div" and a.get("class") == "value" and a.get("id"):
            self._value = str(a["id"])
            self.values[self._value] = ""

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)
        if self._value is not None:
            self.values[self._value] += data

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._cell is not None:
            self.rows[-1]["cells"].append("".join(self._cell))
            self._cell = None
        elif tag == "div":
            self._value = None


@pytest.mark.slow
def test_the_page_of_a_running_job_in_chromium(
    chromium: Path, tmp_path: Path, etcd: EtcdServer, run_id: str
) -> None:
    job = Job(tmp_path / "job", etcd.endpoint, run_id, max_steps=400)
    try:
        node = job.start("a", nnodes="1:2")
        wait_until(lambda: len(job.steps()) >= 3, 240, "the job's third step")
        dashboard = Dashboard(
            etcd_options(etcd.endpoint),
            run_id,
            event_log=job.event_log,
            checkpoint_url=str(job.tmp / "ckpt"),
        )
        with serve(dashboard, port=0) as server:
            dom = _Dom()
            dom.feed(browse(chromium, tmp_path, server.url, "--dump-dom").stdout)
            shot = tmp_path / "dashboard.png"
            browse(chromium, tmp_path, server.url, f"--screenshot={shot}")
            assert node.running(), "the job must run while the page is loaded"
        rows = {r["node"]: r["cells"] for r in dom.rows}
        ours = [n for n in rows if n and n.split("_")[1] == str(node.pid)]
        assert ours, f"no member row for the agent (pid {node.pid}): {dom.rows}"
        cells = rows[ours[0]]
        assert cells[:4] == [ours[0], "127.0.0.1", str(node.pid), "rank 0"], cells
        assert [i for i in dom.images if i.get("id") == "timeline"], dom.images
        assert dom.values["world"] == "1" and dom.values["round"] != "-"
        assert int(dom.values["step"]) >= 3, dom.values
        assert float(dom.values["loss"]) > 0
        assert shot.is_file() and _png_size(shot.read_bytes()) == (1280, 900)
        assert shot.stat().st_size > 20_000  # a page, not a blank
    finally:
        job.cleanup()


def test_the_command_serves_until_ctrl_c(etcd: EtcdServer, run_id: str, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    (runs / run_id).mkdir(parents=True)
    step = {"ts": 5.0, "kind": "train.step", "step": 7, "loss": 1.5, "world_size": 1}
    (runs / run_id / "events.jsonl").write_text(json.dumps(step) + "\n")
    out = tmp_path / "dashboard.out"
    argv = [PYTHON, "-m", "elastic_tools.cli", "dashboard", "--port", "0"]
    argv += ["--etcd", etcd.endpoint, "--run-id", run_id, "--runs-dir", str(runs)]
    with open(out, "wb") as f:
        proc = subprocess.Popen(
            argv, stdout=f, stderr=subprocess.PIPE, env=node_env(), cwd=REPO, text=True
        )
    try:
        found = wait_until(
            lambda: re.search(r"(http://127\.0\.0\.1:\d+/)", out.read_text()), 60, "the URL"
        )
        assert found is not None
        status, _, body = _get(found.group(1) + "api/status")
        assert status == 200 and json.loads(body)["step"]["step"] == 7
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.stderr is not None and "Traceback" not in proc.stderr.read()
    assert f"dashboard of run {run_id}: http://127.0.0.1:" in out.read_text()


@pytest.mark.slow
def test_the_page_shows_a_nan_loss_in_chromium(
    chromium: Path, served: Served, tmp_path: Path
) -> None:
    """Issue 38, item 10, in a browser: the page parses /api/status with JSON.parse and
    renders the diverged step (before: the parse failed and every card stayed at '-')."""
    step = {"ts": 10.0, "kind": "train.step", "step": 5, "loss": float("nan"), "world_size": 1}
    (tmp_path / "events.jsonl").write_text(json.dumps({**step, "samples_per_s": 8.0}) + "\n")
    dom = _Dom()
    dom.feed(browse(chromium, tmp_path, served.url, "--dump-dom").stdout)
    assert dom.values["step"] == "5" and dom.values["loss"] == "NaN", dom.values
    assert dom.values["rate"] == "8.0", dom.values
