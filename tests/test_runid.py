"""The one run-id rule (elastic.runid): chosen, else the rendezvous id, else the default."""

from __future__ import annotations

import uuid

import pytest

from elastic import env, runid
from elastic.errors import ConfigError


@pytest.mark.parametrize(
    ("chosen", "environ", "expected"),
    [
        ("mine", {"TORCHELASTIC_RUN_ID": "job-a"}, "mine"),  # chosen wins
        (None, {"TORCHELASTIC_RUN_ID": "job-a"}, "job-a"),  # under an agent
        ("", {"TORCHELASTIC_RUN_ID": "job-b"}, "job-b"),  # empty is not chosen
        (None, {}, "local"),  # no agent
        (None, {"TORCHELASTIC_RUN_ID": str(uuid.uuid4())}, "local"),  # torchrun --standalone
        (None, {"TORCHELASTIC_RUN_ID": str(uuid.uuid4()).upper()}, "local"),
    ],
)
def test_the_rule(chosen: str | None, environ: dict[str, str], expected: str) -> None:
    assert runid.resolve(chosen, environ) == expected


def test_a_rendezvous_id_that_cannot_name_a_directory_is_one_sentence() -> None:
    for bad in ("..", "a/b", "sp ace"):
        with pytest.raises(ConfigError, match=r"^The rendezvous id .* choose a run id"):
            runid.resolve(None, {"TORCHELASTIC_RUN_ID": bad})


@pytest.mark.integration
def test_run_under_standalone_keeps_one_id(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torchrun --standalone`` makes up a UUID per launch: a Run must not take it, or it
    never finds its checkpoints again."""
    import torch

    import elastic

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", str(uuid.uuid4()))
    model = torch.nn.Linear(2, 1)
    run = elastic.Run(model, torch.optim.SGD(model.parameters(), lr=0.1), snapshot_every=0)
    try:
        assert run.run_id == "local"
    finally:
        run.close()


def test_a_run_id_too_long_for_a_directory_name_is_one_sentence() -> None:
    from elastic.checkpoint.layout import validate_run_id

    assert validate_run_id("a" * runid.MAX_LENGTH)
    with pytest.raises(ConfigError, match="201 bytes long"):
        validate_run_id("a" * (runid.MAX_LENGTH + 1))
    with pytest.raises(ConfigError, match="cannot name a checkpoint directory"):
        runid.resolve(None, {env.RUN_ID: "b" * 300})
