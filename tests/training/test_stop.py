"""Graceful stop: SIGTERM to one worker stops every rank after the step, with a checkpoint.

The worker that got the signal exits 0; its peers exit with ``reform.EXIT_CODE``
(75), which our agent reads as "re-form the group" and plain torchrun as a failure.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from elastic import events
from elastic.checkpoint import find_latest_complete
from elastic.node import reform
from tests.helpers import REPO

from .conftest import WORKER_TIMEOUT_S


def _wait_for_step(log: Path, rank: int, step: int, proc: subprocess.Popen[str]) -> int:
    """Poll the event log until ``rank`` has done ``step``; return that worker's pid."""
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    while time.monotonic() < deadline:
        for event in events.read(log, "train.samples"):
            if event["rank"] == rank and event["step"] >= step:
                return int(event["pid"])
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        time.sleep(0.2)
    raise AssertionError(f"rank {rank} did not reach step {step}")


@pytest.mark.integration
def test_sigterm_to_one_rank_saves_and_peers_ask_to_reform(
    tmp_path: Path, tiny_config: Callable[..., Path]
) -> None:
    config = tiny_config(job__max_steps=100000, job__sample_ledger=True, checkpoint__interval=1000)
    log = tmp_path / "events.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=0",
            "-m",
            "elastic_tools.training.worker",
            "--config",
            str(config),
        ],
        cwd=REPO,
        env={**os.environ, "ELASTIC_EVENT_LOG": str(log), "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        os.kill(_wait_for_step(log, rank=1, step=3, proc=proc), signal.SIGTERM)
        output, _ = proc.communicate(timeout=WORKER_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    failures = re.findall(r"rank\s*:\s*(\d+).*\n\s*exitcode\s*:\s*(-?\d+)", output)
    codes = dict(failures)
    assert codes.get("0") == str(reform.EXIT_CODE), output[-4000:]
    # torchrun stops the signalled rank once rank 0 "fails"; by then the save is committed.
    assert codes.get("1") in (None, "-15"), output[-4000:]
    last = max(e["step"] for e in events.read(log, "train.step"))
    info = find_latest_complete(str(tmp_path / "ckpt"), "t")
    assert info is not None and info.step == last
    assert "Received SIGTERM" in output
