"""Plain ``torchrun --rdzv-backend=etcd-v3`` leaves no snapshots in RAM-backed /dev/shm."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from elastic import env
from elastic.etcd.server import EtcdServer
from tests.helpers import REPO, wait_until


def test_plain_torchrun_removes_the_snapshots_when_it_exits(
    shared: Path, etcd: EtcdServer, run_id: str
) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc-per-node=1",
        "--rdzv-backend=etcd-v3",
        f"--rdzv-endpoint={etcd.endpoint}",
        f"--rdzv-id={run_id}",
        "--max-restarts=0",
        str(Path(__file__).with_name("run_worker.py")),
        str(shared),
        "3",
    ]
    environ = {k: v for k, v in os.environ.items() if k != env.SNAPSHOT_OWNER}
    environ.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output = proc.communicate(timeout=240)[0]
    assert proc.returncode == 0, output[-4000:]
    folder = shared / f"elastic-{os.geteuid()}" / str(proc.pid)  # torchrun's agent is the owner
    assert f"kept 2 in {folder}" in output, output[-4000:]
    wait_until(lambda: not folder.exists(), 30, "the snapshots to go once torchrun exited")
    assert list((shared / f"elastic-{os.geteuid()}").iterdir()) == []
