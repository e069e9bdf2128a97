"""A full /dev/shm (Docker's is 64 MB): one sentence before the first step, never SIGBUS.

The shared memory here is a 4 MiB tmpfs mounted for the test (root only).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic import env
from tests.trust.conftest import python

FULL = (
    "The snapshot copy into {folder} failed: No space left on device. Make room in that "
    "directory (Docker: raise shm_size) or lower snapshot_every."
)


@pytest.fixture
def small_shm(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs, unmounted afterwards."""
    mount = tmp_path / "shm"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def _folder(mount: Path, owner: int) -> str:
    return f"{mount}/elastic-{os.geteuid()}/{owner}"


@pytest.mark.integration
def test_a_state_too_large_for_shm_is_one_sentence_before_the_first_step(
    small_shm: Path,
) -> None:
    owner = os.getpid()
    code = (
        "import torch\n"
        "from elastic.worker.session import Run\n"
        "model = torch.nn.Linear(1024, 2048)  # 8 MiB of weights, 4 MiB of room\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        f"run = Run(model, opt, run_id='full', snapshot_dir={str(small_shm)!r}, snapshot_every=1)\n"
        "for step in run.steps(3):\n"
        "    print('step', step, flush=True)\n"
    )
    ran = python(code, {env.SNAPSHOT_OWNER: str(owner)})
    assert ran.returncode == 1, (ran.returncode, ran.stderr[-3000:])  # not -SIGBUS
    assert "step" not in ran.stdout
    last = ran.stderr.strip().splitlines()[-1]
    assert last == "elastic.errors.RecoveryError: " + FULL.format(folder=_folder(small_shm, owner))


@pytest.mark.integration
def test_a_state_that_outgrows_shm_later_is_one_sentence_too(small_shm: Path) -> None:
    """The buffers are allocated again when the state grows: the error comes at that
    snapshot, and the newest complete snapshot stays readable."""
    owner = os.getpid()
    code = (
        "import torch\n"
        "from elastic.errors import RecoveryError\n"
        "from elastic.worker.snapshot import SnapshotStore, Snapshotter\n"
        f"store = SnapshotStore('grow', 0, owner={owner}, directory={str(small_shm)!r})\n"
        "snaps = Snapshotter(store, background=False)\n"
        "snaps.take(1, 0, {'w': torch.ones(1000)}, set())\n"
        "try:\n"
        "    snaps.take(2, 0, {'w': torch.ones(1_000_000)}, set())\n"
        "except RecoveryError as exc:\n"
        "    print(exc)\n"
        "print(store.read()[0].step)\n"
    )
    ran = python(code)
    assert ran.returncode == 0, (ran.returncode, ran.stderr[-3000:])
    assert ran.returncode != -signal.SIGBUS
    assert ran.stdout.splitlines() == [FULL.format(folder=_folder(small_shm, owner)), "1"]
