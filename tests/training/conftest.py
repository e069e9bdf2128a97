"""Fixtures for the worker tests: torchrun launches, a moto S3 server, config files."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from elastic.etcd.server import free_port
from tests.helpers import REPO

WORKER_TIMEOUT_S = 240

# A tiny but complete setup: BatchNorm CNN, 16x16 synthetic images, 6 micro-batches per step.
TINY = {
    "job": {
        "run_id": "t",
        "max_steps": 40,
        "seed": 3,
        "log_every": 10,
        "threads": 1,
        "progress_bar": False,
    },
    "model": {"name": "tiny_cnn", "num_classes": 4},
    "data": {
        "source": "synthetic",
        "num_samples": 600,
        "image_size": 16,
        "global_batch_size": 24,
        "micro_batch_size": 4,
    },
    "optimizer": {
        "name": "sgd",
        "lr": 0.05,
        "momentum": 0.9,
        "warmup_steps": 3,
        "schedule": "cosine",
    },
    "checkpoint": {"url": "unset", "interval": 10, "keep_last": 2, "async_save": True},
    "distributed": {"backend": "gloo", "timeout_s": 120},
}


@dataclass
class WorkerRun:
    """A finished worker launch."""

    returncode: int
    output: str
    events: Path


@pytest.fixture
def tiny_config(tmp_path: Path) -> Callable[..., Path]:
    """Write TINY (with ``section.key`` overrides applied) to a YAML file; return its path."""

    def make(name: str = "tiny.yaml", **overrides: object) -> Path:
        tree = {section: dict(values) for section, values in TINY.items()}
        tree["checkpoint"]["url"] = str(tmp_path / "ckpt")
        for dotted, value in overrides.items():
            section, key = dotted.split("__", 1)
            tree[section][key] = value
        path = tmp_path / name
        path.write_text(yaml.safe_dump(tree))
        return path

    return make


def launch(
    nproc: int,
    config: Path,
    overrides: list[str],
    events: Path,
    extra_env: dict[str, str] | None = None,
    script: Path | None = None,
    timeout: float = WORKER_TIMEOUT_S,
) -> WorkerRun:
    """Run the worker under ``torchrun --standalone`` and wait for it."""
    target = [str(script)] if script else ["-m", "elastic_tools.training.worker"]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--max-restarts=0",
        *target,
        "--config",
        str(config),
        *overrides,
    ]
    environ = {
        **os.environ,
        "ELASTIC_EVENT_LOG": str(events),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
        **(extra_env or {}),
    }
    proc = subprocess.run(
        cmd, cwd=REPO, env=environ, capture_output=True, text=True, timeout=timeout, check=False
    )
    return WorkerRun(proc.returncode, proc.stdout + proc.stderr, events)


@pytest.fixture(scope="session")
def moto_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real S3 HTTP endpoint (moto server in a subprocess); yields its URL."""
    port = free_port()
    log = (tmp_path_factory.mktemp("moto") / "moto.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(endpoint + "/", timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"moto server did not start on {endpoint}") from None
            time.sleep(0.1)
    yield endpoint
    proc.terminate()
    proc.wait(timeout=10)
    log.close()


@pytest.fixture
def s3_env(moto_s3: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Point s3fs (here and in child processes) at the moto server; create a bucket."""
    import fsspec
    import s3fs

    values = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "FSSPEC_S3_ENDPOINT_URL": moto_s3,
        "AWS_ENDPOINT_URL": moto_s3,
    }
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": moto_s3})
    s3fs.S3FileSystem.clear_instance_cache()
    fs = fsspec.filesystem("s3")
    if not fs.exists("ckpt-bucket"):
        fs.mkdir("ckpt-bucket")
    return values
