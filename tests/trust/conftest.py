"""Fixtures for the trust tests: a world-writable directory like /dev/shm, another local user.

The attacker is uid/gid 65534 (nobody), run with ``setpriv``; these tests need root (CI runs
as root) and skip otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic import env
from tests.helpers import REPO

NOBODY = 65534
# Python as the other user: imports run as root (the interpreter lives in /root), then the
# process gives up root for good before it does anything that matters.
DROP_ROOT = (
    f"import os; os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})\n"
    "assert os.geteuid() != 0\n"
)


@pytest.fixture
def shared() -> Iterator[Path]:
    """A fresh directory that every local user may write, sticky, as /dev/shm is."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("the trust tests run the attacker as another uid: they need root and setpriv")
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    path = Path(tempfile.mkdtemp(prefix="trust-", dir=base))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def as_nobody(script: str) -> subprocess.CompletedProcess[str]:
    """Run the shell ``script`` as the other local user."""
    cmd = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    return subprocess.run(
        [*cmd, "sh", "-c", script], capture_output=True, text=True, timeout=30, check=False
    )


def python(
    code: str, extra_env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter of this checkout."""
    environ = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    environ.update(extra_env or {})
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environ,
        cwd=REPO,
        check=False,
    )


def worker(
    directory: Path, total: int, owner: int, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run tests/trust/run_worker.py (a Run with a snapshot every step) for agent ``owner``."""
    environ = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        env.SNAPSHOT_OWNER: str(owner),
    }
    script = str(Path(__file__).with_name("run_worker.py"))
    return subprocess.run(
        [sys.executable, script, str(directory), str(total)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environ,
        cwd=REPO,
        check=False,
    )


@pytest.fixture
def job_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The job's secret file, as every node of the job shares it, and the event log beside it
    (``events.jsonl``), both set for the processes and handlers this test starts."""
    path = tmp_path / "secret"
    path.write_text("the-job-secret-0123456789abcdef")
    path.chmod(0o600)
    monkeypatch.setenv(env.SECRET_FILE, str(path))
    monkeypatch.setenv(env.EVENT_LOG, str(tmp_path / "events.jsonl"))
    return path
