"""Run our CNN worker under real elastic-agent processes and read what happened.

The comparisons (final model vs a fault-free run, samples of the kept trajectory) live in
:mod:`elastic_tools.chaos`, which ``elastic chaos`` shares with these tests.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from elastic import env
from elastic_tools.chaos import LR, MODEL_RTOL, kept_samples, model_differences
from elastic_tools.harness.cluster import AgentOptions, LocalCluster
from tests.helpers import PYTHON, REPO, Node, node_env

TINY = REPO / "configs" / "tiny.yaml"


def assert_models_match(final: dict[str, Any], reference: dict[str, Any]) -> None:
    """``final`` equals ``reference`` up to float summation order (see :data:`MODEL_RTOL`)."""
    assert final.keys() == reference.keys(), "the final checkpoint has other parameters"
    for key, rel in model_differences(final, reference).items():
        assert rel < MODEL_RTOL, f"{key} differs from the fault-free run by {rel:.1e} (relative)"


class Job(LocalCluster):
    """Agents of one run, its event log and checkpoints, and cleanup of every process."""

    def __init__(self, tmp: Path, endpoint: str, run_id: str, max_steps: int = 100) -> None:
        super().__init__(
            tmp,
            run_id,
            endpoint,
            options=AgentOptions(join_timeout=90, max_restarts=3, monitor_interval=0.3),
            config=TINY,
            max_steps=max_steps,
            overrides={
                "job.log_every": 1,
                "job.min_step_s": 0.4,
                "job.sample_ledger": True,
                "optimizer.lr": LR,
                "checkpoint.url": tmp / "ckpt",
                "checkpoint.interval": 5,
            },
            env=node_env(),
        )
        self.tmp = tmp

    def start(
        self,
        name: str,
        nnodes: str = "1:3",
        max_restarts: int = 3,
        netns: str | None = None,
        addr: str = "127.0.0.1",
        worker: Sequence[str] | None = None,
        **cfg: Any,
    ) -> Node:
        """Start one agent (inside network namespace ``netns`` when given) running
        ``worker`` (default: the CNN worker with this job's overrides and ``cfg``)."""
        return super().start(
            name,
            worker=worker,
            overrides=cfg,
            nnodes=nnodes,
            max_restarts=max_restarts,
            netns=netns,
            addr=addr,
        )

    def final_model(self, url: Path | None = None, run_id: str | None = None) -> dict[str, Any]:
        """The model state of the newest complete checkpoint."""
        import torch.distributed.checkpoint as dcp

        from elastic.checkpoint import find_latest_complete
        from elastic.checkpoint.storage import make_reader
        from elastic_tools.training.config import load_config
        from elastic_tools.training.model import build_model

        info = find_latest_complete(str(url or self.tmp / "ckpt"), run_id or self.run_id)
        assert info is not None and info.step == self.max_steps, info
        cfg = load_config(TINY, [])
        state = {"model": build_model(cfg.model).state_dict()}
        dcp.load(state, storage_reader=make_reader(info.url))
        return state["model"]

    def reference_model(self) -> dict[str, Any]:
        """Train the same job fault-free in one process (world 1) and return its model."""
        url = self.tmp / "reference"
        argv = [
            PYTHON,
            "-m",
            "elastic_tools.training.worker",
            "--config",
            str(TINY),
            f"job.run_id={self.run_id}",
            f"job.max_steps={self.max_steps}",
            f"checkpoint.url={url}",
            "checkpoint.interval=1000",
            f"optimizer.lr={LR}",
        ]
        environ = {k: v for k, v in node_env().items() if k != env.EVENT_LOG}
        subprocess.run(argv, env=environ, cwd=REPO, check=True, capture_output=True, timeout=300)
        return self.final_model(url)

    def ledger(self) -> list[int]:
        """Sample indices of the trajectory that survived (a redone step replaces the old)."""
        kept = kept_samples(self.events("train.samples"))
        return [i for _, indices in sorted(kept.items()) for i in indices]

    def cleanup(self) -> list[int]:
        """Kill everything still running; return the worker pids that were left behind."""
        return self.close()
