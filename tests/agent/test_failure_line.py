"""A failed worker is reported in one line: node, rank, exit code or signal, last stderr.

Real agents on a real etcd run tests/scripts/fails.py (2 local ranks; rank 1 fails). The
old line was torch's "a worker failed: To enable traceback see ...", with none of these.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from elastic.agent.failure import describe, exit_text
from elastic.etcd.server import EtcdServer
from elastic_tools.harness.cluster import AgentOptions, LocalCluster
from tests.helpers import REPO, node_env

ERROR = "elastic-agent: error: a worker failed: "


def _failure_line(tmp: Path, endpoint: str, mode: str, *tee: str) -> str:
    options = AgentOptions(nnodes="1", nproc=2, max_restarts=0, command=None)
    cluster = LocalCluster(
        tmp / mode,
        endpoint=endpoint,
        options=options,
        env=node_env(),
        cwd=REPO,
        script=[*tee, "tests/scripts/fails.py", mode],
    )
    try:
        node = cluster.start("n1")
        try:
            code = node.wait(90)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the agent did not end: {node.output()[-3000:]}")
        output = node.output()
        assert code == 1, output[-3000:]
        lines = [line for line in output.splitlines() if line.startswith(ERROR)]
        assert len(lines) == 1, output[-3000:]
        return lines[0]
    finally:
        cluster.close()


@pytest.mark.parametrize(
    ("mode", "ended"),
    [("exit", "exit code 3"), ("kill", "killed by SIGKILL"), ("raise", "exit code 1")],
)
def test_the_line_names_node_rank_and_how_it_ended(
    tmp_path: Path, etcd: EtcdServer, mode: str, ended: str
) -> None:
    line = _failure_line(tmp_path, etcd.endpoint, mode)
    assert "node 127.0.0.1 (agent pid " in line, line
    assert "rank 1, local rank 1, pid " in line, line
    assert ended in line, line
    assert "To enable traceback" not in line, line


def test_with_tee_the_line_quotes_the_last_stderr_lines(tmp_path: Path, etcd: EtcdServer) -> None:
    line = _failure_line(tmp_path, etcd.endpoint, "raise", "--tee=2")
    assert "exit code 1" in line, line
    assert "last stderr: " in line, line
    assert "RuntimeError: the batch had no labels" in line, line


class _Failure:
    def __init__(self, exitcode: int, message: str = "") -> None:
        self.local_rank, self.pid, self.exitcode = 0, 7, exitcode
        self.message, self.timestamp = message, 0


def test_describe_puts_the_workers_own_message_first() -> None:
    line = describe("h", {3: _Failure(2, "Bad configuration: lr < 0.")})
    assert line == (
        "a worker failed: Bad configuration: lr < 0. "
        "(node h, rank 3, local rank 0, pid 7, exit code 2)"
    )


def test_describe_drops_torchs_placeholder_and_counts_the_others(tmp_path: Path) -> None:
    for attempt, text in ((0, "old\n"), (2, "a\n\nb\nc\nd\n"), (10, None)):
        (tmp_path / f"attempt_{attempt}" / "0").mkdir(parents=True)
        if text is not None:
            (tmp_path / f"attempt_{attempt}" / "0" / "stderr.log").write_text(text)
    placeholder = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
    failures = {
        2: _Failure(-signal.SIGKILL, placeholder),
        1: _Failure(-signal.SIGTERM),
    }
    line = describe("h", failures, str(tmp_path))
    assert line == (
        "a worker failed: rank 2 killed by SIGKILL (node h, rank 2, local rank 0, pid 7, "
        "killed by SIGKILL); last stderr: b | c | d; 1 more worker of this node stopped too"
    )


def test_exit_text() -> None:
    assert exit_text(0) == "exit code 0"
    assert exit_text(-15) == "killed by SIGTERM"
    assert exit_text(-200) == "killed by signal 200"
