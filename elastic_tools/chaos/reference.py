"""The fault-free run a chaos job is compared with, and the final model of a run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from elastic import env, events
from elastic_tools.chaos.job import ChaosJob, overrides


class Reference:
    """The same job without faults: ``agents`` ranks throughout (``torchrun --standalone``).

    Not world 1: the order of float sums differs between world sizes, and for some seeds
    a fault-free world-3 run already differs from world 1 by 6e-3 after 240 steps (seed
    11), so only world-size changes that faults cause should show.
    """

    def __init__(self, job: ChaosJob) -> None:
        self.job = job
        self.losses: dict[int, float] = {}  # step -> loss, once :meth:`model` ran

    def model(self) -> dict[str, Any]:
        """Run it; its final model (its losses are kept in :attr:`losses`)."""
        job = self.job
        url = job.run_dir / "reference"
        log = job.run_dir / "reference-events.jsonl"
        environ = {**job.environ(), env.EVENT_LOG: str(log)}
        subprocess.run(self._argv(url), env=environ, check=True, capture_output=True, timeout=1800)
        self.losses = {e["step"]: e["loss"] for e in events.read(log, "train.step") if "loss" in e}
        return final_model(job, url)

    def _argv(self, url: Path) -> list[str]:
        job = self.job
        values = {
            **overrides(job.opts),
            "job.run_id": job.run_id,
            "job.max_steps": job.max_steps,
            "job.min_step_s": 0,
            "job.sample_ledger": False,
            "checkpoint.url": url,
            "checkpoint.interval": 100000,
        }
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={job.opts.agents}",
            "-m",
            "elastic_tools.training.worker",
            "--config",
            str(job.opts.config),
            *(f"{k}={v}" for k, v in values.items()),
        ]


def final_model(job: ChaosJob, url: Path) -> dict[str, Any]:
    """The model of the newest complete step under ``url``, which must be the last step.

    Raises:
        RuntimeError: the newest complete step is not the job's last.
    """
    import torch.distributed.checkpoint as dcp

    from elastic.checkpoint import find_latest_complete
    from elastic.checkpoint.storage import SafeLoadPlanner, make_reader
    from elastic_tools.training.config import load_config
    from elastic_tools.training.model import build_model

    info = find_latest_complete(str(url), job.run_id, secret=job.secret())
    if info is None or info.step != job.max_steps:
        raise RuntimeError(
            f"The newest complete checkpoint under {url} is {info}, not step {job.max_steps}."
        )
    if job.opts.script is not None:
        return stored_model(info.url, info.metadata_record)
    cfg = load_config(job.opts.config, [])
    state = {"model": build_model(cfg.model).state_dict()}
    reader = make_reader(info.url, info.metadata_record)  # .metadata checked before unpickling
    dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    return state["model"]


def stored_model(url: str, metadata_record: dict[str, Any] | None) -> dict[str, Any]:
    """The ``model`` tensors of the checkpoint at ``url`` (one step's directory), for any
    script: their shapes and dtypes come from the checkpoint's own (verified) metadata."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from elastic.checkpoint.storage import SafeLoadPlanner, make_reader

    reader = make_reader(url, metadata_record)  # .metadata checked before unpickling
    metadata = reader.read_metadata()
    model: dict[str, Any] = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        if fqn.startswith("model.") and isinstance(meta, TensorStorageMetadata):
            dtype = meta.properties.dtype
            model[fqn[len("model.") :]] = torch.empty(meta.size, dtype=dtype)
    state = {"model": model}
    reader = make_reader(url, metadata_record)
    dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    return state["model"]


__all__ = ["Reference", "final_model", "stored_model"]
