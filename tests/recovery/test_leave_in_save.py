"""A planned leave that lands inside the first step of an epoch, while the checkpoint of the
step before is being saved, under real agents and a user's script (tests/scripts/
inplace_user.py). The survivor redoes that step in place and trains every step of the job.

Before the fix, the failed step was rewound to the boundary kept at the end of the previous
epoch (epoch e, every sample consumed), the re-dealt loader had nothing left, and the epoch
loop counted epoch e+1 as run: the job ended with exit 0 a whole epoch early (issue 25)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elastic_tools.harness.cluster import LocalCluster
from tests.helpers import node_env
from tests.recovery.test_inplace import SCRIPT, _kept, _records, _relative_l2

pytestmark = pytest.mark.slow
SAMPLES, BATCH, EPOCHS = 48, 12, 3
PER_EPOCH = SAMPLES // BATCH
LEAVE_STEP = 2 * PER_EPOCH  # the first step of the last epoch
BOUND = 1e-12


def _args(out: Path, epochs: int = EPOCHS) -> list[str]:
    return [f"--epochs={epochs}", f"--samples={SAMPLES}", f"--global-batch={BATCH}", f"--out={out}"]


@pytest.mark.timeout(300)
def test_a_leave_in_the_first_step_of_an_epoch_ends_no_loop(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    out, ref = tmp_path / "out", tmp_path / "ref"
    _reference_run(ref)
    worker = [str(SCRIPT), *_args(out), "--step-delay=0.05", f"--ckpt={tmp_path / 'ckpt'}"]
    worker += [f"--ckpt-every={PER_EPOCH}", f"--leave-at=1:{LEAVE_STEP}"]
    a = cluster.start("a", worker=worker)
    b = cluster.start("b", worker=worker)
    assert a.wait(240) == 0, cluster.logs()
    assert b.wait(60) == 0, cluster.logs()
    assert (out / "left").exists(), "the constructed leave did not happen"
    steps = [e["step"] for e in cluster.steps()]
    assert steps and steps[-1] == EPOCHS * PER_EPOCH, f"the job ended at step {steps[-1:]}"
    assert steps == sorted(set(steps)), "a completed step was redone"
    kept = _kept(_records(out))
    assert sorted(kept) == list(range(EPOCHS * PER_EPOCH))
    for epoch in range(EPOCHS):
        window = range(epoch * PER_EPOCH, (epoch + 1) * PER_EPOCH)
        assert sorted(i for s in window for i in kept[s]) == list(range(SAMPLES)), epoch
    assert not cluster.events("job.stopped"), "nobody stopped the job"
    assert not cluster.events("recovery.fallback"), cluster.events("recovery.fallback")
    final, expected = torch.load(out / "final.pt"), torch.load(ref / "final.pt")
    assert _relative_l2(final, expected) < BOUND
    assert cluster.events("recovery.inplace"), "the survivor did not re-form in place"


def _reference_run(ref: Path) -> None:
    argv = [sys.executable, str(SCRIPT), *_args(ref)]
    done = subprocess.run(argv, env=node_env(), capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
