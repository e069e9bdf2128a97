"""Config: every shipped file validates; layering; bad input is one line, exit 2."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from elastic.errors import ConfigError
from elastic_tools.training.config import Config, load_config
from tests.helpers import REPO

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def test_configs_exist() -> None:
    names = {p.name for p in CONFIGS}
    assert {"default.yaml", "compose.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_validates(path: Path) -> None:
    assert isinstance(load_config(path, environ={}), Config)


def test_layers_file_then_env_then_cli() -> None:
    cfg = load_config(
        REPO / "configs/default.yaml",
        ["job.max_steps=7", "optimizer.name=adamw"],
        environ={
            "ELASTIC_JOB__MAX_STEPS": "5",
            "ELASTIC_JOB__SEED": "9",
            "ELASTIC_EVENT_LOG": "/ignored",
        },
    )
    assert (cfg.job.max_steps, cfg.job.seed, cfg.optimizer.name) == (7, 9, "adamw")


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["job.bogus=1"], "unknown field 'job.bogus'"),
        (["model.name=resnet999"], "model.name = 'resnet999' is invalid: unknown model"),
        (["optimizer.min_lr=1.0", "optimizer.lr=0.1"], "min_lr (1.0) must not exceed lr (0.1)"),
        (["checkpoint.url=s3:/bucket/x"], "malformed URL; did you mean s3://"),
        (["checkpoint.url=nosuchfs://bucket/x"], "unknown storage protocol 'nosuchfs'"),
        (["data.micro_batch_size=64", "data.global_batch_size=32"], "must not exceed"),
        (["optimizer.schedule=linear"], "optimizer.schedule = 'linear' is invalid"),
        # numbers at their limits (issue 18): inf, nan, beyond int64, beyond a sane timeout
        (["optimizer.lr=inf"], "optimizer.lr = 'inf' is invalid: Input should be a finite"),
        (["optimizer.lr=nan"], "optimizer.lr = 'nan' is invalid: Input should be a finite"),
        (["job.max_steps=9223372036854775808"], "max_steps = 9223372036854775808 does not fit"),
        (["checkpoint.interval=9223372036854775808"], "interval = 9223372036854775808 does not"),
        (["distributed.timeout_s=1e308"], "distributed.timeout_s = '1e308' is invalid"),
        (["job.min_step_s=inf"], "job.min_step_s = 'inf' is invalid"),
    ],
)
def test_bad_values_name_file_field_value(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(REPO / "configs/default.yaml", overrides, environ={})
    message = str(info.value)
    assert needle in message
    assert message.startswith(str(REPO / "configs/default.yaml"))
    assert "\n" not in message


def test_malformed_override_is_explained() -> None:
    with pytest.raises(ConfigError, match=r"section\.key=value"):
        load_config(None, ["max_steps=3"], environ={})


def _run_worker(config: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "elastic_tools.training.worker",
            "--config",
            str(config),
            *overrides,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.integration
@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["job.unknown_field=1"], "unknown field 'job.unknown_field'"),
        (["model.name=not_a_model"], "unknown model"),
        (["optimizer.min_lr=2", "optimizer.lr=1"], "must not exceed lr"),
        (
            ["data.source=cifar10", "data.path=/nonexistent/cifar"],
            "data.path = '/nonexistent/cifar'",
        ),
        (["checkpoint.url=s3:/bucket"], "malformed URL"),
    ],
    ids=["unknown-field", "unknown-model", "min-gt-max", "unreadable-data", "bad-url"],
)
def test_worker_rejects_bad_config_with_exit_2(
    tiny_config: Callable[..., Path], overrides: list[str], needle: str
) -> None:
    proc = _run_worker(tiny_config(), *overrides)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("elastic_tools.training.worker: error:")]
    assert len(errors) == 1 and needle in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.integration
def test_unreadable_config_file_exits_2(tmp_path: Path) -> None:
    proc = _run_worker(tmp_path / "missing.yaml")
    assert proc.returncode == 2
    assert "Cannot read config file" in proc.stderr and "Traceback" not in proc.stderr
