"""bench/gpu_check.py without a GPU: its arguments, its plan (``--dry-run``), and a real run
that says in one sentence that no GPU is present and exits non-zero.

The checks themselves need a CUDA machine (``bash bench/gpu_check.sh`` there); here the
dry run goes through the wrapper as a person would start it, with CUDA hidden
(``CUDA_VISIBLE_DEVICES=""``), and the real run sees no CUDA, so that the answers are the
same on a machine that has one."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from elastic_tools.harness import benchjson
from tests.helpers import PYTHON, REPO

SCRIPT = REPO / "bench" / "gpu_check.py"
WRAPPER = REPO / "bench" / "gpu_check.sh"


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check = _module()


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": PYTHON}
    return subprocess.run(
        ["bash", str(WRAPPER), *argv],
        capture_output=True,
        text=True,
        env=environ,
        cwd=REPO,
        timeout=120,
    )


@pytest.mark.integration
def test_dry_run_prints_the_plan_and_exits_0_without_cuda() -> None:
    done = _run(
        "--dry-run", "--ranks", "4", "--only", "user:node_kill", "--only", "cnn:worker_freeze"
    )
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["dry_run"] is True and plan["cuda"] is False and plan["gpus"] == 0
    assert [(s["workload"], s["fault"]) for s in plan["inplace"]] == [
        ("user", "node_kill"),
        ("cnn", "worker_freeze"),
    ]
    assert {s["ranks"] for s in plan["inplace"]} == {4}
    assert {s["victim"] for s in plan["inplace"]} == {"n4"}


def test_a_real_run_without_cuda_says_so_in_one_sentence_and_fails(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--checks", "inplace"]) == gpu_check.NO_GPU_EXIT != 0
    out, err = capsys.readouterr()
    assert out == ""
    message = err.strip()
    assert len(message.splitlines()) == 1 and message.endswith(".")
    assert "No CUDA device is present" in message


def test_the_default_plan_is_every_workload_against_every_fault() -> None:
    args = gpu_check.parse([])
    plan = gpu_check.plan(args, cuda=True, gpus=4)
    assert plan["backend"] == "nccl" and plan["checks"] == list(gpu_check.CHECKS)
    pairs = [(s["workload"], s["fault"]) for s in plan["inplace"]]
    assert pairs == [(w, f) for w in gpu_check.WORKLOADS for f in gpu_check.FAULTS]
    assert {s["backend"] for s in plan["inplace"]} == {"nccl"}  # a GPU per rank
    assert plan["inplace"][0]["devices"] == ["0", "1", "2"]
    assert plan["restart"] == ["worker_kill", "node_kill"] and "inplace_backend_why" not in plan
    # three agents on two GPUs: GPU i % 2, the third shares GPU 0, so not on NCCL
    shared = gpu_check.plan(args, cuda=True, gpus=2)
    assert shared["inplace"][0]["devices"] == ["0", "1", "0"]
    assert {s["backend"] for s in shared["inplace"]} == {"gloo"}
    assert "Duplicate GPU" in shared["inplace_backend_why"]
    one_gpu = gpu_check.plan(gpu_check.parse(["--checks", "restart,inplace"]), True, 1)
    assert one_gpu["restart"] == ["worker_kill"]
    assert one_gpu["inplace"][0]["devices"] == ["0", "0", "0"]
    forced = gpu_check.plan(gpu_check.parse(["--inplace-backend", "nccl"]), True, 1)
    assert {s["backend"] for s in forced["inplace"]} == {"nccl"}
    assert "inplace_backend_why" not in forced


@pytest.mark.parametrize(
    "argv",
    [["--ranks", "5"], ["--ranks", "1"], ["--only", "user:reboot"], ["--checks", "gpu"]],
)
def test_bad_arguments_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        gpu_check.parse(argv)
    assert stop.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_recovered_step_is_the_first_after_a_reform(tmp_path: Path) -> None:
    """A step that ends after the fault but before any re-form event is the old group's."""

    class Events:
        def __init__(self, log: list[dict[str, Any]]) -> None:
            self.log = log

        def events(self) -> list[dict[str, Any]]:
            return self.log

        def steps(self) -> list[dict[str, Any]]:
            return [e for e in self.log if e["kind"] == "train.step"]

    log = [
        {"ts": 9.0, "kind": "rdzv.round"},
        {"ts": 10.5, "kind": "train.step", "step": 41, "world_size": 3},  # in flight at 10
        {"ts": 12.0, "kind": "rdzv.inplace"},
        {"ts": 12.4, "kind": "train.step", "step": 42, "world_size": 2},
    ]
    assert gpu_check.first_recovered_step(Events(log), 10.0)["step"] == 42
    assert gpu_check.first_recovered_step(Events(log[:2]), 10.0) is None


def test_benchjson_output_and_spread(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    assert benchjson.output({"a": 1, "p": tmp_path}, out) == 0
    printed = capsys.readouterr().out
    assert json.loads(printed) == json.loads(out.read_text()) == {"a": 1, "p": str(tmp_path)}
    assert benchjson.spread([3, None, 1, 2]) == {
        "n": 3,
        "median": 2.0,
        "min": 1.0,
        "max": 3.0,
        "missing": 1,
    }
    assert benchjson.spread([None])["median"] is None
