"""The tutorial-script guard's rules (elastic.agent.tutorial_check), without a process."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from elastic.agent import tutorial_check
from elastic.agent.run_script import wrap_args

AGENT = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "node-a", "MASTER_PORT": "29500"}
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("kwargs", "environ", "names"),
    [
        ({"backend": "gloo"}, AGENT, None),  # the torchrun way
        ({"backend": "gloo", "init_method": "env://"}, AGENT, None),
        ({"backend": "gloo", "rank": 0, "world_size": 1}, AGENT, None),  # the agent's own
        ({"backend": "gloo", "rank": -1, "world_size": -1}, AGENT, None),  # torch's defaults
        # the tutorial: address and port set in the script, rank and world size its own
        (
            {"backend": "gloo", "rank": 1, "world_size": 2},
            {**AGENT, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "12355"},
            ["MASTER_ADDR 127.0.0.1", "MASTER_PORT 12355", "rank 1", "world_size 2"],
        ),
        ({"backend": "gloo"}, {**AGENT, "MASTER_PORT": "12355"}, ["MASTER_PORT 12355"]),
        ({"backend": "gloo"}, {**AGENT, "RANK": "3"}, ["rank 3 (the agent's: 0)"]),
        ({"world_size": 4}, AGENT, ["world_size 4 (the agent's: 1)"]),
        ({"init_method": "tcp://127.0.0.1:12355"}, AGENT, ["MASTER_ADDR 127.0.0.1"]),
        ({"init_method": "tcp://node-a:29500"}, AGENT, None),
        ({"init_method": "file:///tmp/x", "rank": 0, "world_size": 1}, AGENT, None),
        # a store of the caller's own: elastic's in-place groups, world of one
        ({"store": object(), "rank": 3, "world_size": 5}, {**AGENT, "MASTER_PORT": "1"}, None),
    ],
)
def test_init_process_group_refused_only_when_it_would_hang(
    kwargs: dict[str, Any], environ: dict[str, str], names: list[str] | None
) -> None:
    sentence = tutorial_check.init_sentence(kwargs, AGENT, environ)
    if names is None:
        assert sentence is None
        return
    assert sentence is not None and sentence.count(". ") == 0 and sentence.endswith(").")
    for name in names:
        assert name in sentence
    assert "delete the lines that set MASTER_ADDR/MASTER_PORT" in sentence


def test_scan_names_the_spawn_first(tmp_path: Path) -> None:
    found = tutorial_check.scan(REPO / "examples" / "tutorial" / "spawn_tutorial.py")
    assert found is not None and ": calls spawn:" in found
    for changed in ("train.py", "train_run.py"):
        assert tutorial_check.scan(REPO / "examples" / "tutorial" / changed) is None
    env_only = tmp_path / "env.py"
    env_only.write_text("import os\nos.environ['MASTER_PORT'] = '12355'\n")
    assert tutorial_check.scan(env_only) == f"{env_only}:2: " + (
        "sets MASTER_PORT: under elastic-agent the agent sets it; delete the line "
        "(see docs/from-the-tutorial.md)."
    )
    broken = tmp_path / "broken.py"
    broken.write_text("def (:\n")
    assert tutorial_check.scan(broken) is None
    assert tutorial_check.scan(tmp_path / "missing.py") is None


def test_refusal_lands_in_torchs_error_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    exc = tutorial_check.refuse(tutorial_check.spawn_sentence("spawn"))
    assert isinstance(exc, SystemExit) and exc.code == tutorial_check.EXIT_CODE
    assert json.loads(error_file.read_text())["message"] == str(exc)
    assert capsys.readouterr().err == ""  # the agent prints it, once
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")
    tutorial_check.refuse("x.")
    assert capsys.readouterr().err == "elastic: error: x.\n"


def test_guard_patches_torch_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist
    import torch.multiprocessing as mp

    originals = (mp.spawn, mp.start_processes, dist.init_process_group)
    for key, value in {**AGENT, "TORCHELASTIC_RUN_ID": "x"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    from torch.distributed import distributed_c10d as c10d

    patched = [(mp, "spawn"), (mp, "start_processes"), (dist, "init_process_group")]
    for module, name in [*patched, (c10d, "init_process_group")]:
        monkeypatch.setattr(module, name, getattr(module, name))
    tutorial_check.install_runtime_guard()
    with pytest.raises(tutorial_check.TutorialScriptError, match=r"torch\.multiprocessing\.spawn"):
        mp.spawn(print, nprocs=2)
    with pytest.raises(tutorial_check.TutorialScriptError, match="start_processes"):
        mp.start_processes(print)
    monkeypatch.setenv("MASTER_PORT", "12355")
    with pytest.raises(tutorial_check.TutorialScriptError, match="MASTER_PORT 12355"):
        dist.init_process_group("gloo")
    assert (mp.spawn, mp.start_processes, dist.init_process_group) != originals


def test_guard_is_off_outside_an_agent_or_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    tutorial_check.install_runtime_guard()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("ELASTIC_TUTORIAL_CHECK", "0")
    tutorial_check.install_runtime_guard()
    assert not any(type(f).__name__ == "_PatchOnImport" for f in sys.meta_path)


@pytest.mark.parametrize(
    ("args", "wrapped"),
    [
        (
            ["-u", "train.py", "--lr", "1"],
            ["-u", "-m", "elastic.agent.run_script", "train.py", "--lr", "1"],
        ),
        (
            ["-u", "-m", "pkg.mod", "x"],
            ["-u", "-m", "elastic.agent.run_script", "-m", "pkg.mod", "x"],
        ),
    ],
)
def test_cold_worker_command(args: list[str], wrapped: list[str]) -> None:
    assert wrap_args(args) == wrapped
