"""A plain torchvision-shaped script resumes from its own checkpoint by the recipe.

Two real agents on a real etcd run tests/scripts/tv_classify.py (torchvision's
classification trainer cut small: an ImageFolder, ``checkpoint.pth`` each epoch,
``--resume``), with the two lines of docs/from-the-tutorial.md: the output dir is
``$ELASTIC_JOB_DIR``, and a checkpoint there means ``--resume`` it. A ``kill -9`` of one
worker mid-run restarts the job's workers; they must resume from the checkpoint in the
job's directory (``$ELASTIC_JOB_ROOT/<run-id>``, which the old agent never set) and train
every epoch to the end.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from elastic.etcd.server import EtcdServer
from elastic.node.procs import kill
from elastic_tools.harness.cluster import AgentOptions, LocalCluster
from tests.helpers import REPO, node_env, wait_until

SCRIPT = REPO / "tests" / "scripts" / "tv_classify.py"
EPOCHS = 6


def _image_folder(root: Path) -> Path:
    """``root/train/<class>/*.png``: two classes of eight 8x8 images, what ImageFolder reads."""
    gen = torch.Generator().manual_seed(0)
    for label, name in enumerate(("cat", "dog")):
        folder = root / "train" / name
        folder.mkdir(parents=True)
        for i in range(8):
            pixels = torch.randint(0, 128, (8, 8, 3), generator=gen, dtype=torch.uint8)
            pixels[..., label] += 127  # a class one can learn
            Image.fromarray(pixels.numpy()).save(folder / f"{i}.png")
    return root


def _records(out: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    starts, steps = [], []
    for path in out.glob("start-*.json"):
        with contextlib.suppress(json.JSONDecodeError):  # still being written
            starts.append(json.loads(path.read_text()))
    for path in out.glob("steps-*.jsonl"):
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                steps.append({**json.loads(line), "rank": int(path.stem.split("-")[1])})
    return sorted(starts, key=lambda s: s["t"]), sorted(steps, key=lambda s: s["t"])


def test_a_killed_worker_resumes_from_its_own_checkpoint(
    tmp_path: Path, etcd: EtcdServer, run_id: str
) -> None:
    data, out, jobs = _image_folder(tmp_path / "data"), tmp_path / "out", tmp_path / "jobs"
    out.mkdir()
    environ = node_env(ELASTIC_JOB_ROOT=str(jobs), TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")
    script = [str(SCRIPT), "--data-path", str(data), "--epochs", str(EPOCHS)]
    script += ["--min-step-s", "0.25", "--record", str(out)]
    cluster = LocalCluster(
        tmp_path / "run",
        run_id,
        etcd.endpoint,
        options=AgentOptions(nnodes="2", nproc=1, max_restarts=3),
        env=environ,
        cwd=tmp_path,
        script=script,
    )
    checkpoint = jobs / run_id / "checkpoint.pth"
    try:
        nodes = [cluster.start("n1"), cluster.start("n2")]

        def second_epoch_saved() -> dict[str, Any] | None:
            starts, steps = _records(out)
            if not any(s["epoch"] >= 2 for s in steps) or not checkpoint.exists():
                return None
            return next(s for s in starts if s["rank"] == 1)

        victim = wait_until(second_epoch_saved, 60, f"epoch 2 ({cluster.logs()[-2000:]})")
        assert victim is not None
        saved = torch.load(checkpoint, weights_only=False)["epoch"]
        killed_at = time.time()
        kill(victim["pid"], signal.SIGKILL)
        for node in nodes:
            try:
                code = node.wait(60)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"the job did not end: {cluster.logs()[-3000:]}") from None
            assert code == 0, cluster.logs()[-3000:]
    finally:
        cluster.close()

    starts, steps = _records(out)
    # the killed worker's node counts a restart; the other node re-forms (its count stays)
    resumed = [s for s in starts if s["t"] > killed_at]
    assert {s["rank"] for s in resumed} == {0, 1}, starts
    assert max(s["restart"] for s in resumed) >= 1, resumed
    for start in resumed:  # every worker found the job's checkpoint by the recipe
        assert start["resume"] == str(checkpoint), start
        assert start["start_epoch"] >= saved + 1, (start, saved)
    after = [s for s in steps if s["t"] > killed_at]
    assert after and after[0]["epoch"] == min(s["start_epoch"] for s in resumed), after[:3]
    for rank in (0, 1):  # every epoch trained, the last one after the restart
        assert {s["epoch"] for s in steps if s["rank"] == rank} == set(range(EPOCHS)), rank
    assert torch.load(checkpoint, weights_only=False)["epoch"] == EPOCHS - 1
    redone = [s for s in steps if s["t"] <= killed_at and s["epoch"] >= after[0]["epoch"]]
    print(
        f"kill -9 of a worker -> next step {after[0]['t'] - killed_at:.2f} s; "
        f"resumed at epoch {after[0]['epoch']} (checkpoint of epoch {saved}); "
        f"{len(redone)} steps redone"
    )
