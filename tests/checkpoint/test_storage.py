"""Multi-process checkpoints on remote and failing storage: s3:// (moto), flaky://."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from elastic import events
from elastic.checkpoint import find_latest_complete, list_steps

from .conftest import launch
from .flaky_fs import register

HERE = Path(__file__).resolve().parent


@pytest.mark.integration
def test_s3_save_and_resharded_resume(
    tmp_path: Path, tiny_config: Callable[..., Path], s3_env: dict[str, str]
) -> None:
    url = f"s3://ckpt-bucket/{uuid.uuid4().hex[:8]}"
    config = tiny_config(checkpoint__url=url, checkpoint__interval=5)
    log = tmp_path / "events.jsonl"
    for nproc, stop in ((2, 10), (3, 15)):
        run = launch(nproc, config, [f"job.stop_at={stop}"], log, extra_env=s3_env)
        assert run.returncode == 0, run.output[-4000:]
    assert [e["step"] for e in events.read(log, "ckpt.load")] == [10, 10, 10]
    info = find_latest_complete(url, "t")
    assert info is not None and info.step == 15
    assert info.marker["world_size"] == 3
    assert {"__0_0.distcp", ".metadata"} <= set(info.marker["files"])
    assert list_steps(url, "t") == [15, 10]


@pytest.mark.integration
def test_failing_storage_never_stops_training(
    tmp_path: Path, tiny_config: Callable[..., Path]
) -> None:
    url = f"flaky://{tmp_path}/ckpt"
    config = tiny_config(checkpoint__url=url, checkpoint__interval=5, checkpoint__keep_last=5)
    log = tmp_path / "events.jsonl"
    run = launch(
        2,
        config,
        ["job.stop_at=25"],
        log,
        script=HERE / "flaky_worker.py",
        extra_env={"FLAKY_FAIL": "step-15,step-20"},
    )
    assert run.returncode == 0, run.output[-4000:]
    saves = {(e["step"], e["ok"], e.get("last_good")) for e in events.read(log, "ckpt.save")}
    assert saves == {
        (5, True, None),
        (10, True, None),
        (15, False, 10),
        (20, False, 10),
        (25, True, None),
    }
    assert max(e["step"] for e in events.read(log, "train.step")) == 25
    assert "The newest complete checkpoint is still step 10" in run.output
    register()
    assert find_latest_complete(url, "t", warn=False).step == 25


@pytest.mark.integration
def test_repeated_storage_failures_stop_with_a_clear_error(
    tmp_path: Path, tiny_config: Callable[..., Path]
) -> None:
    config = tiny_config(
        checkpoint__url=f"flaky://{tmp_path}/ckpt",
        checkpoint__interval=5,
        checkpoint__max_failures=2,
    )
    run = launch(
        2,
        config,
        ["job.stop_at=25"],
        tmp_path / "events.jsonl",
        script=HERE / "flaky_worker.py",
        extra_env={"FLAKY_FAIL": "step-"},
    )
    assert run.returncode != 0
    assert "2 checkpoint saves in a row failed" in run.output
    assert "Fix the storage at flaky://" in run.output
    steps = [e["step"] for e in events.read(tmp_path / "events.jsonl", "train.step")]
    assert max(steps) < 25


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_memory_url_in_one_process(tmp_path: Path, tiny_config: Callable[..., Path]) -> None:
    """memory:// is per process, so it is exercised in-process with a world of one."""
    from elastic_tools.training.config import load_config
    from elastic_tools.training.worker import train

    url = f"memory://ckpt-{uuid.uuid4().hex[:8]}"
    config = tiny_config(checkpoint__url=url, checkpoint__interval=4)
    assert train(load_config(config, ["job.stop_at=8"], environ={})) == 0
    assert find_latest_complete(url, "t").step == 8
    assert train(load_config(config, ["job.stop_at=12"], environ={})) == 0
    assert find_latest_complete(url, "t").step == 12
