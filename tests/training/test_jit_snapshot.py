"""The CNN worker's failure-time snapshot under torchrun: kill -9 of one rank loses no
completed step, and the job ends with the model of a fault-free run.

Periodic snapshots are off in effect (``$ELASTIC_SNAPSHOT_EVERY`` beyond the run), so
only the survivor's failure-time snapshot can hold the last completed step. torchrun
restarts the pair (``--max-restarts=1``); both ranks resume from it (one from its own
node's memory, one streamed from the peer), not from the checkpoint of step 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from elastic import env, events
from elastic.checkpoint import find_latest_complete
from elastic.checkpoint.storage import make_reader
from elastic.node import nodelocal
from elastic_tools.training.config import ModelConfig
from elastic_tools.training.model import build_model
from tests.helpers import REPO, wait_until

from .conftest import WORKER_TIMEOUT_S, launch

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]
STEPS = 30


def _final_state(url: str, run_id: str) -> dict[str, torch.Tensor]:
    info = find_latest_complete(url, run_id)
    assert info is not None and info.step == STEPS, info
    state = {"model": build_model(ModelConfig(name="tiny_cnn", num_classes=4)).state_dict()}
    dcp.load(state, storage_reader=make_reader(info.url))
    return state["model"]


def _worker_pid(agent: int, rank: int) -> int | None:
    """The pid of the worker of ``rank`` that torchrun ``agent`` started, if running."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == agent and f"{env.RANK}={rank}".encode() in environ:
            return int(entry.name)
    return None


def _last_step(log: Path) -> int:
    return max((e["step"] for e in events.read(log, "train.step")), default=0)


def _torchrun(config: Path, overrides: list[str], log: Path) -> subprocess.Popen[str]:
    environ = {
        **os.environ,
        env.EVENT_LOG: str(log),
        env.SNAPSHOT_EVERY: "1000000",
        env.TORCH_DISABLE_SHARE_RDZV_TCP_STORE: "1",  # a restarted round gets a fresh store
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["--max-restarts=1", "-m", "elastic_tools.training.worker", "--config", str(config)]
    return subprocess.Popen(
        cmd + overrides,
        cwd=REPO,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_kill_9_of_a_rank_loses_no_step(tmp_path: Path, tiny_config: Callable[..., Path]) -> None:
    run_id = f"jit{uuid.uuid4().hex[:8]}"
    config = tiny_config(job__max_steps=STEPS, job__run_id=run_id)
    url_a, url_b = str(tmp_path / "a"), str(tmp_path / "b")
    ref = launch(2, config, [f"checkpoint.url={url_a}"], tmp_path / "a.jsonl")
    assert ref.returncode == 0, ref.output[-4000:]

    log = tmp_path / "b.jsonl"
    overrides = [f"checkpoint.url={url_b}", "checkpoint.interval=1000", "job.min_step_s=0.3"]
    proc = _torchrun(config, overrides, log)
    try:
        wait_until(lambda: _last_step(log) >= 8, 120, "step 8")
        victim = wait_until(lambda: _worker_pid(proc.pid, 1), 30, "rank 1's pid")
        before = _last_step(log)
        os.kill(victim, signal.SIGKILL)
        output = proc.communicate(timeout=WORKER_TIMEOUT_S)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        nodelocal.remove_owned(proc.pid)  # torchrun's own cleanup would do it too
    # A known bug apart from this test's point (docs/inplace.md, Limits): in one CI run
    # (73f29f9) rank 0 aborted in C++ teardown *after* both ranks had stopped at the last step
    # and committed it ("terminate called without an active exception"); the recovery under
    # test had completed, and everything below still checks it.
    finished = output.count(f"Stopped at step {STEPS} of {STEPS}.") >= 2
    teardown_abort = "terminate called without an active exception" in output
    assert proc.returncode == 0 or (finished and teardown_abort), output[-4000:]
    assert "Wrote the state of step" in output, output[-4000:]
    loads = events.read(log, "ckpt.load")
    assert sorted(e.get("source") for e in loads) == ["memory", "peer"], loads
    assert all(e["step"] >= before for e in loads), f"completed {before}, resumed {loads}"
    a, b = _final_state(url_a, run_id), _final_state(url_b, run_id)
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-6, atol=1e-7, msg=key)
