"""LocalCluster.close() kills the event log's leftover writers, never a process that got a
writer's pid by reuse."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from elastic.node.procs import alive
from elastic_tools.harness.cluster import LocalCluster
from tests.helpers import wait_until


def _cluster_with_writer(tmp_path: Path, pid: int, ts: float) -> LocalCluster:
    cluster = LocalCluster(tmp_path, endpoint="127.0.0.1:1")  # no etcd of its own
    tmp_path.mkdir(parents=True, exist_ok=True)
    event = {"ts": ts, "kind": "train.step", "pid": pid, "step": 1}
    cluster.event_log.write_text(json.dumps(event) + "\n")
    return cluster


@pytest.mark.integration
def test_a_pid_reused_after_the_writers_events_is_left_alone(tmp_path: Path) -> None:
    proc = subprocess.Popen(["sleep", "60"])
    try:
        # The "writer" wrote under this pid a minute before this process started.
        cluster = _cluster_with_writer(tmp_path, proc.pid, time.time() - 60)
        assert cluster.close() == []
        assert alive(proc.pid)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.integration
def test_a_writer_that_outlived_its_agent_is_killed(tmp_path: Path) -> None:
    proc = subprocess.Popen(["sleep", "60"])
    try:
        cluster = _cluster_with_writer(tmp_path, proc.pid, time.time())
        assert cluster.close() == [proc.pid]
        wait_until(lambda: proc.poll() is not None, 10, "the leftover writer to die")
    finally:
        proc.kill()
        proc.wait()
