"""The public API is pinned: a change to ``elastic.__all__`` or to ``Run``'s signature is
deliberate (this test changes with it, and the README says what users gain)."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

import elastic

PUBLIC = [
    "EXIT_CODE",
    "DistributedSampler",
    "RecoveryError",
    "Run",
    "__version__",
    "init_process_group",
]
RUN_METHODS = {
    "all_reduce",
    "batches",
    "close",
    "epochs",
    "log_loss",
    "save",
    "state",
    "steps",
    "wait",
}
RUN_ARGS = [
    "self",
    "model",
    "optimizer",
    "scheduler",
    "sampler",
    "checkpoint_url",
    "checkpoint_every",
    "snapshot_every",
    "run_id",
    "keep_last",
    "snapshot_dir",
    "global_batch_size",
    "checkpoint",
    "init_from",
    "straggler",
    "hang",
]


def test_all_is_pinned_and_every_name_resolves() -> None:
    assert elastic.__all__ == PUBLIC
    for name in PUBLIC:
        assert getattr(elastic, name) is not None, name
    assert sorted(dir(elastic)) == sorted(PUBLIC)


def test_run_signature_and_methods_are_pinned() -> None:
    assert list(inspect.signature(elastic.Run.__init__).parameters) == RUN_ARGS
    methods = {n for n, v in vars(elastic.Run).items() if not n.startswith("_") and callable(v)}
    assert methods == RUN_METHODS


@pytest.mark.integration
def test_import_elastic_stays_light() -> None:
    """``import elastic`` imports neither torch nor etcd (the names load on first use)."""
    code = "import sys, elastic; print([m for m in ('torch', 'etcd3', 'grpc') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
