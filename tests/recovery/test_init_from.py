"""Run(init_from=...): a new job starts from a checkpoint plain ``dcp.save`` wrote; a job
with a state of its own never does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import elastic
from elastic import events

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _run(model: torch.nn.Module, tmp_path: Path, **kwargs: object) -> elastic.Run:
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return elastic.Run(model, opt, snapshot_every=0, run_id="t", **kwargs)  # type: ignore[arg-type]


def test_a_new_job_starts_from_a_plain_dcp_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ELASTIC_EVENT_LOG", str(tmp_path / "events.jsonl"))
    theirs = _model(1)
    dcp.save({"model": theirs.state_dict()}, checkpoint_id=str(tmp_path / "foreign"))
    mine = _model(2)
    run = _run(mine, tmp_path, init_from=str(tmp_path / "foreign"))
    try:
        assert run.resumed_from == "foreign" and run.step == 0
        for a, b in zip(mine.state_dict().values(), theirs.state_dict().values(), strict=True):
            assert torch.equal(a, b)
    finally:
        run.close()
    (init,) = events.read(tmp_path / "events.jsonl", "ckpt.init")
    assert init["url"].endswith("foreign") and init["missing"], init  # no optimizer, no cursor


def test_a_job_with_its_own_checkpoint_ignores_init_from(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    first = _run(_model(3), tmp_path, checkpoint_url=ckpt)
    for _ in first.steps(2):
        pass
    first.close()
    dcp.save({"model": _model(1).state_dict()}, checkpoint_id=str(tmp_path / "foreign"))
    again = _run(_model(4), tmp_path, checkpoint_url=ckpt, init_from=str(tmp_path / "foreign"))
    try:
        assert again.resumed_from == "storage" and again.step == 2
    finally:
        again.close()
