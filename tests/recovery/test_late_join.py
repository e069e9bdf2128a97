"""A join whose worker starts late, pending when the job reaches its last step, under real
agents and a user's script (tests/scripts/inplace_user.py).

The round that admits the joiner moves the commit fence at once, while the running group
trains on in the old round's group until the joiner's worker is ready. Before the fix, the
group ended in the old round: its final checkpoint was refused by the fence ("the writers
are in round 5, current round 6"), the old workers exited 0, and the joiner, alone, resumed
from an older checkpoint and trained the job's last steps again. Now the group does not end
in a round that is no longer current: it waits (bounded) for the newer round, re-forms in
place with the joiner and commits the last step there; the joiner trains nothing again."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from elastic_tools.harness.cluster import LocalCluster
from tests.recovery.test_inplace import SCRIPT, _records

pytestmark = pytest.mark.slow
SAMPLES, BATCH, EPOCHS = 48, 12, 4
TOTAL = EPOCHS * SAMPLES // BATCH  # 16 steps
HOLD = TOTAL - 5  # the job waits here until the joiner's round formed
EXIT_BOUND_S = 120.0  # every agent exits within this of the job's last step


@pytest.mark.timeout(420)
def test_a_join_pending_at_the_last_step_ends_the_job_once(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    out, go = tmp_path / "out", tmp_path / "go"
    worker = [str(SCRIPT), f"--epochs={EPOCHS}", f"--samples={SAMPLES}"]
    worker += [f"--global-batch={BATCH}", f"--out={out}", f"--ckpt={tmp_path / 'ckpt'}"]
    worker += ["--ckpt-every=2", f"--hold-at={HOLD}:{go}"]
    a = cluster.start("a", worker=worker)
    b = cluster.start("b", worker=worker)
    cluster.wait_for(lambda: [e for e in cluster.steps() if e["step"] >= 2], "2 steps", 240)
    # The joiner's worker waits until the job recorded its last step: its round pends.
    c = cluster.start("c", worker=worker, extra_env={"INPLACE_USER_START_AFTER": str(TOTAL - 1)})
    joined = lambda: [e for e in cluster.events("rdzv.inplace") if e["world_size"] == 3]  # noqa: E731
    cluster.wait_for(lambda: len(joined()) >= 2, "a and b in the joiner's round", 240)
    go.touch()
    cluster.wait_for(lambda: (out / "final.pt").exists(), "the final model", 240)
    ended = time.monotonic()
    for node in (a, b, c):
        assert node.wait(EXIT_BOUND_S) == 0, cluster.logs()
    exit_s = time.monotonic() - ended
    steps = [e["step"] for e in cluster.steps()]
    assert steps == list(range(1, TOTAL + 1)), f"steps reported (a step twice?): {steps}"
    assert sorted({r["step"] for r in _records(out)}) == list(range(TOTAL))
    saved = [
        e
        for e in cluster.events("ckpt.save")
        if e.get("ok") and e["step"] == TOTAL and e["rank"] == 0
    ]
    assert len(saved) == 1, f"the last step committed {len(saved)} times"
    loads = [e for e in cluster.events("ckpt.load") if e["step"] < TOTAL]
    assert not loads, f"a worker resumed from an older checkpoint: {loads}"
    print(f"every agent exited {exit_s:.1f} s after the final model")


@pytest.mark.timeout(420)
def test_a_join_after_the_job_finished_trains_nothing(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """The joiner's round forms after the group's last look at the end (its workers are
    done but alive): the old agents do not wait out torch's 300 s exit barrier for it, and
    the joiner's agent stops its worker and exits 0, saying the job finished."""
    out = tmp_path / "out"
    worker = [str(SCRIPT), f"--epochs={EPOCHS}", f"--samples={SAMPLES}"]
    worker += [f"--global-batch={BATCH}", f"--out={out}", f"--ckpt={tmp_path / 'ckpt'}"]
    worker += ["--ckpt-every=4"]
    linger = {"INPLACE_USER_LINGER": "120"}  # until the test says go-home
    a = cluster.start("a", worker=worker, extra_env=linger)
    b = cluster.start("b", worker=worker, extra_env=linger)
    cluster.wait_for(lambda: (out / "final.pt").exists(), "the final model", 240)
    c = cluster.start("c", worker=worker)
    joined = lambda: [e for e in cluster.events("rdzv.inplace") if e["world_size"] == 3]  # noqa: E731
    cluster.wait_for(lambda: len(joined()) >= 2, "a and b in the joiner's round", 240)
    (out / "go-home").touch()
    ended = time.monotonic()
    for node in (a, b, c):
        assert node.wait(EXIT_BOUND_S) == 0, cluster.logs()
    exit_s = time.monotonic() - ended
    steps = [e["step"] for e in cluster.steps()]
    assert steps == list(range(1, TOTAL + 1)), f"steps reported (a step twice?): {steps}"
    assert cluster.events("job.finished"), "the joiner did not say the job finished"
    print(f"every agent exited {exit_s:.1f} s after the workers were let go")
