"""``elastic demo --quick`` for real: the membership scenario on an embedded etcd, the live
dashboard answering while it runs, and the timeline picture it draws at the end."""

from __future__ import annotations

import json
import re
import signal
import socket
import struct
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from elastic_tools.demo import QUICK, _job_secret, _serve_dashboard
from elastic_tools.harness.cluster import LocalCluster
from tests.helpers import PYTHON, REPO, node_env, wait_until

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _status(url: str) -> dict[str, Any] | None:
    """The dashboard's ``/api/status``; None while it does not answer."""
    try:
        with urllib.request.urlopen(url + "api/status", timeout=10) as reply:
            data: dict[str, Any] = json.load(reply)
            return data
    except OSError:
        return None


def _trains(url: str) -> dict[str, Any] | None:
    """The dashboard's status once it shows a formed round and a logged step."""
    data = _status(url)
    rendezvous = (data or {}).get("rendezvous") or {}
    if data and rendezvous.get("world_size", 0) >= 1 and data.get("step"):
        return data
    return None


def test_dashboard_moves_to_a_free_port_when_its_port_is_taken(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = LocalCluster(tmp_path, "demo-port", endpoint="127.0.0.1:1")  # etcd not needed
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with _serve_dashboard(cluster, tmp_path / "ckpt", _job_secret(tmp_path), port) as served:
            assert served.port not in (0, port)
            with urllib.request.urlopen(served.url, timeout=10) as reply:
                assert '<span id="run-id">demo-port</span>' in reply.read().decode()
    assert f"port {port} is taken; serving on a free port instead" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_demo_serves_the_dashboard_and_draws_the_timeline(tmp_path: Path) -> None:
    runs, run_id = tmp_path / "runs", "demo-test"
    out = tmp_path / "demo.out"
    argv = [PYTHON, "-m", "elastic_tools.cli", "demo", "--quick", "--dashboard-port", "0",
            "--runs-dir", str(runs), "--run-id", run_id]  # fmt: skip
    with open(out, "wb") as f:
        proc = subprocess.Popen(
            argv, stdout=f, stderr=subprocess.PIPE, env=node_env(), cwd=REPO, text=True
        )
    try:
        found = wait_until(
            lambda: re.search(r"dashboard: (http://127\.0\.0\.1:\d+/)", out.read_text()),
            120,
            "the demo to print the dashboard's URL",
        )
        url = found.group(1)
        data = wait_until(lambda: _trains(url), 240, "the dashboard to show a training step")
        assert data["run_id"] == run_id
        assert data["event_log"] == str(runs / run_id / "events.jsonl")
        assert data["step"]["step"] >= 1
        with urllib.request.urlopen(url, timeout=10) as reply:
            assert f'<span id="run-id">{run_id}</span>' in reply.read().decode()
        code = proc.wait(420)
    finally:
        if proc.poll() is None:  # the demo's own cleanup stops its agents and etcd on SIGINT
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
    assert proc.stderr is not None
    stderr = proc.stderr.read()
    text = out.read_text()
    assert code == 0, f"elastic demo exited {code}:\n{text[-3000:]}\n{stderr[-3000:]}"
    assert "Traceback" not in stderr, stderr[-3000:]

    # The table: the three membership changes, then the final loss.
    for label in ("join", "SIGTERM", "kill -9"):
        assert re.search(rf"^\s*[\d.]+\s+{re.escape(label)}\s", text, re.M), text[-3000:]
    assert re.search(rf"^final: step {QUICK.max_steps} loss \d", text, re.M), text[-3000:]

    # The timeline: printed, next to the event log, a real picture.
    picture = runs / run_id / "timeline.png"
    assert f"timeline: {picture}" in text.splitlines(), text[-3000:]
    data_png = picture.read_bytes()
    assert data_png[:8] == PNG_MAGIC
    width, height = struct.unpack(">II", data_png[16:24])
    assert width >= 600 and height >= 300, (width, height)
    assert len(data_png) > 20_000, f"a near-empty picture ({len(data_png)} bytes)"
