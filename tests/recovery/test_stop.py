"""SIGTERM to one rank: the group finishes the step, saves, and exits (0 there, 75 elsewhere)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastic.checkpoint import find_latest_complete
from elastic.node import reform
from tests.helpers import REPO


@pytest.mark.slow
def test_sigterm_stops_the_group_with_a_checkpoint(tmp_path: Path) -> None:
    script = str(Path(__file__).with_name("stop_worker.py"))
    environ = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(r), "2", str(tmp_path)],
            env=environ,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outs = []
    for proc in procs:
        try:
            outs.append(proc.communicate(timeout=180)[0])
        finally:
            if proc.poll() is None:
                proc.kill()
    codes = [p.returncode for p in procs]
    assert codes == [reform.OK, reform.EXIT_CODE], "\n".join(o[-2000:] for o in outs)
    info = find_latest_complete(str(tmp_path / "ckpt"), "stop")
    assert info is not None and info.step == 4, info
