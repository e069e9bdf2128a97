"""Fixtures for the checkpoint-format tests: a private secret, a varied state, a manager."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic.checkpoint import CheckpointManager, StepInfo, find_latest_complete
from elastic.checkpoint.config import CheckpointConfig
from elastic.checkpoint.fence import CommitFence

# The worker-config and S3 fixtures (the checkpoint tests that run our worker use them).
from tests.training.conftest import launch, moto_s3, s3_env, tiny_config  # noqa: F401

RUN = "r"
SUBPROCESS_TIMEOUT_S = 120


@pytest.fixture(autouse=True)
def _private_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A local run: its generated signing secret lives under tmp_path, not in the home."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    for name in ("ELASTIC_SECRET_FILE", "ELASTIC_FENCE", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)


def make_state(seed: int = 0) -> dict[str, Any]:
    """A state with every kind of leaf a run saves: several dtypes, a scalar, an empty
    tensor, a transposed (non-contiguous) one, optimizer-like nesting, plain values."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "conv.weight": torch.randn(16, 3, 3, 3, generator=g),
            "fc.weight": torch.randn(10, 16, generator=g).t(),
            "fc.bias": torch.randn(10, generator=g).to(torch.bfloat16),
            "bn.num_batches_tracked": torch.tensor(seed + 5),
            "mask": torch.rand(7, generator=g) > 0.5,
            "empty": torch.empty(0, 4),
            "half": torch.randn(3, 5, generator=g).half(),
        },
        "optim": {
            "state": {"conv.weight": {"momentum_buffer": torch.randn(16, 3, 3, 3, generator=g)}},
            "param_groups": [{"lr": 0.1, "momentum": 0.9, "params": ["conv.weight"]}],
        },
        "train": {"step": 7 + seed, "epoch": 1, "consumed": 168},
    }


def zeros_like(state: Any) -> Any:
    """A template of ``state``'s structure: tensors zeroed, plain values changed."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: zeros_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [zeros_like(v) for v in state]
    return -1 if isinstance(state, int) and not isinstance(state, bool) else state


def assert_same_bytes(got: Any, want: Any, where: str = "") -> None:
    """Equal structure, equal dtypes and shapes, byte-for-byte equal tensors."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert (got.dtype, got.shape) == (want.dtype, want.shape), where
        raw = [t.contiguous().reshape(-1).view(torch.uint8) for t in (got, want)]
        assert torch.equal(raw[0], raw[1]), where
    elif isinstance(want, dict):
        assert set(got) == set(want), where
        for key in want:
            assert_same_bytes(got[key], want[key], f"{where}.{key}")
    else:
        assert got == want, where


def save_with_project(url: str, step: int, state: dict[str, Any], **kw: Any) -> StepInfo:
    """One blocking save of ``state`` through a CheckpointManager; the committed step."""
    manager = CheckpointManager(CheckpointConfig(url=url, interval=1, keep_last=5), RUN, **kw)
    outcome = manager.save(step, state, block=True)
    manager.close()
    assert outcome is not None and outcome.ok, outcome
    info = find_latest_complete(url, RUN, warn=False, secret=manager.secret)
    assert info is not None and info.step == step
    return info


def small_state(value: float) -> dict[str, Any]:
    """A small state (a model and a train section) whose every value is ``value``."""
    return {
        "model": {"w": torch.full((64, 8), value), "b": torch.arange(4.0) + value},
        "train": {"step": int(value), "epoch": 0, "consumed": 24 * int(value)},
    }


def small_manager(
    url: str,
    run: str = RUN,
    keep_last: int = 3,
    max_failures: int = 3,
    commit_fence: CommitFence | None = None,
) -> CheckpointManager:
    """A manager that saves every step to ``url`` (run ``run``), fenced by ``commit_fence``."""
    cfg = CheckpointConfig(url=url, interval=1, keep_last=keep_last, max_failures=max_failures)
    return CheckpointManager(cfg, run, commit_fence=commit_fence)


def load_small(manager: CheckpointManager, make: Callable[[], dict] | None = None) -> Any:
    """``manager``'s newest loadable step and state (a :func:`small_state` template unless
    ``make``), or None."""
    return manager.load_latest(make or (lambda: small_state(0.0)))


# Refuses every import of elastic (torch's import of DCP loads the torchrun.handlers entry
# points, ours among them; torch logs the refusal and goes on without it).
_BLOCK_ELASTIC = """
import importlib.abc, logging, sys
class _NoElastic(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "elastic" or name.startswith("elastic."):
            raise ModuleNotFoundError(f"{name} is blocked in this process")
sys.meta_path.insert(0, _NoElastic())
logging.disable(logging.WARNING)
"""


def run_without_elastic(code: str, cwd: Path) -> str:
    """Run ``code`` in a fresh Python that cannot import elastic (asserted at its end)."""
    script = _BLOCK_ELASTIC + code + "\nassert 'elastic' not in sys.modules\n"
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
