"""``elastic checkpoint ls|verify|export``: listings, verdicts, exports and one-sentence errors."""

from __future__ import annotations

import argparse
import os
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from elastic.checkpoint import list_steps
from elastic.errors import CheckpointError, ConfigError
from elastic.secret import secret_path
from elastic_tools.checkpoint import add_parser, command

from .conftest import RUN, assert_same_bytes, make_state, save_with_project
from .tamper import restore_crc, tensor_offset

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _elastic(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="elastic")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return command(parser.parse_args(["checkpoint", *argv]))


@pytest.fixture
def url(tmp_path: Path) -> str:
    url = str(tmp_path / "ckpt")
    save_with_project(url, 1, make_state(1))
    save_with_project(url, 2, make_state(2))
    return url


def test_ls_lists_every_step_complete_or_why_not(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (Path(url) / RUN / "step-3").mkdir()
    assert _elastic("ls", url, "--run-id", RUN) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "step 3  incomplete: no commit marker"
    assert lines[1].startswith("step 2  complete  world size 1  signed")
    assert lines[2].startswith("step 1  complete")


def test_verify_reads_every_file_of_the_newest_step(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _elastic("verify", f"{url}/{RUN}") == 0  # the run's own directory: no --run-id
    assert capsys.readouterr().out.strip() == "step 2: ok (signed, 2 files read)"


def test_verify_names_the_corrupt_file(url: str) -> None:
    data_dir = next((Path(url) / RUN / "step-2").glob("save-*"))
    shard = data_dir / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    crc = zlib.crc32(data)
    data[tensor_offset(data_dir, "model.conv.weight")] ^= 0xFF
    restore_crc(data, tensor_offset(data_dir, "model.half"), crc)
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as caught:
        _elastic("verify", url, "--run-id", RUN)
    assert str(caught.value) == ("Step 2 is not usable: __0_0.distcp: checksum mismatch (corrupt).")
    assert _elastic("verify", url, "--run-id", RUN, "--step", "1") == 0


def test_verify_errors_are_one_sentence(url: str, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"^There is no step 9 under .* \(newest: 2, 1\)\.$"):
        _elastic("verify", url, "--run-id", RUN, "--step", "9")
    save_with_project(url, 3, make_state(3), secret=None)
    with pytest.raises(
        CheckpointError, match=r"^Step 3 is not usable: commit marker is not signed"
    ):
        _elastic("verify", url, "--run-id", RUN)
    os.unlink(secret_path())
    with pytest.raises(CheckpointError, match=r"^Step 2 is signed but no secret is at hand"):
        _elastic("verify", url, "--run-id", RUN, "--step", "2")
    with pytest.raises(CheckpointError, match=r"^There are no checkpoints under "):
        _elastic("export", str(tmp_path / "none"), "--run-id", RUN, "-o", str(tmp_path / "x"))
    assert list_steps(url, RUN) == [3, 2, 1]


def test_export_to_torch_save(url: str, tmp_path: Path) -> None:
    out = tmp_path / "model.pt"
    assert _elastic("export", url, "--run-id", RUN, "-o", str(out)) == 0
    want = make_state(2)
    assert_same_bytes(torch.load(out, weights_only=True), _contiguous(want["model"]))
    both = tmp_path / "both.pt"
    assert (
        _elastic("export", url, "--run-id", RUN, "--step", "1", "-o", str(both), "--optimizer") == 0
    )
    loaded = torch.load(both, weights_only=True)
    want = make_state(1)
    assert_same_bytes(loaded, {"model": _contiguous(want["model"]), "optim": want["optim"]})


def test_export_to_safetensors(url: str, tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    assert _elastic("export", url, "--run-id", RUN, "-o", str(out), "--format", "safetensors") == 0
    assert_same_bytes(load_file(out), _contiguous(make_state(2)["model"]))
    both = tmp_path / "both.safetensors"
    argv = ["export", url, "--run-id", RUN, "-o", str(both), "--format", "safetensors"]
    assert _elastic(*argv, "--optimizer") == 0
    tensors = load_file(both)
    want = make_state(2)["optim"]["state"]["conv.weight"]["momentum_buffer"]
    assert torch.equal(tensors["optim.state.conv.weight.momentum_buffer"], want)
    assert torch.equal(tensors["model.fc.bias"], make_state(2)["model"]["fc.bias"])


def _contiguous(model: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.contiguous() for k, v in model.items()}


def test_a_url_with_one_run_takes_it(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    # the checkpoint URL itself, not the run's directory, and no --run-id: the only run
    assert _elastic("ls", url) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0].startswith("step 2  complete")
    assert err.strip() == f"run {RUN} (the only run under {url})"
    assert _elastic("verify", url + "/") == 0
    assert capsys.readouterr().out.strip() == "step 2: ok (signed, 2 files read)"


def test_a_url_with_several_runs_names_them(url: str, tmp_path: Path) -> None:
    (Path(url) / "other-run" / "step-5").mkdir(parents=True)
    (Path(url) / "not-a-run").mkdir()  # no step: not named
    with pytest.raises(ConfigError, match=r"holds the checkpoints of 2 runs \(other-run, r\); "):
        _elastic("export", url, "-o", str(tmp_path / "x.pt"))
    # a wrong --run-id: the runs that are there
    with pytest.raises(
        CheckpointError,
        match=r"^There are no checkpoints under .*/ckpt/nope; the runs under .*/ckpt: "
        r"other-run, r \(give --run-id\)\.$",
    ):
        _elastic("export", url, "--run-id", "nope", "-o", str(tmp_path / "x.pt"))
