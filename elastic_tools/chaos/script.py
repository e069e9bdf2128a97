"""A user's training script as the job a chaos run faults: its command line, what it must
reach (the last step, the global batch, the samples of an epoch), its workers, and its
fault-free reference.

The script runs on :class:`elastic.Run` under our agents. Its arguments may name
``{ckpt}``: the checkpoint URL the chaos run gives it (the job's, or the reference's).
Ours is ``examples/train_ddp.py`` (:func:`ddp_script`), on the in-place path
(``--in-place``: ``elastic.init_process_group()``) or the restart path (the script's own
``dist.init_process_group``).

The reference is the same script and arguments, fault-free, in one process
(``torchrun --standalone --nproc-per-node=1``). It is a reference for any world-size
trajectory when a step's math does not depend on the world size given the global batch:
ours with ``--norm group --double --global-batch-size`` (BatchNorm would normalize per
rank's batch). Measured at 40 steps: the fault-free world-1 and world-3 runs' final models
differ by 5e-16 (relative L2, worst tensor), while one step more or less moves some tensor
by more than 1e-3 (docs/chaos.md).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic import env, events
from elastic.node.procs import children, descendants

CKPT = "{ckpt}"  # replaced in a script's arguments by the checkpoint URL
DDP_SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py"
# The bound of the final model against the reference, relative L2 per tensor, for a script
# whose math is free of the world size (float64): measured 5e-16 between fault-free runs at
# world 1 and 3; a lost or doubled step moves the model by > 1e-3. Six decades from each.
SCRIPT_MODEL_RTOL = 1e-9


@dataclass(frozen=True)
class ScriptSpec:
    """A user's script under chaos.

    Args:
        argv: the script's path and arguments (``{ckpt}`` among them: its checkpoint URL).
        steps: the step the job must end at (the Run's total).
        global_batch: samples per step over all ranks (the sample check; 0: not checked).
        samples: the dataset's size (an epoch is ``samples // global_batch`` steps).
        model_rtol: the final model's bound against the reference (relative L2).
        checkpoint_every: the steps whose saves a leave is aimed at (0: unknown).
        reference_args: arguments appended for the reference run only (no pacing, ...).
    """

    argv: tuple[str, ...]
    steps: int
    global_batch: int = 0
    samples: int = 0
    model_rtol: float = SCRIPT_MODEL_RTOL
    checkpoint_every: int = 0  # its saves' steps (0: unknown; saves are found on storage)
    reference_args: tuple[str, ...] = field(default_factory=tuple)

    def command(self, ckpt: Path | str, reference: bool = False) -> list[str]:
        """The script's command line with its checkpoint URL."""
        args = [a.replace(CKPT, str(ckpt)) for a in self.argv]
        return [*args, *self.reference_args] if reference else args

    @property
    def path(self) -> str:
        return self.argv[0]

    @property
    def steps_per_epoch(self) -> int:
        return self.samples // self.global_batch if self.global_batch else 0


def ddp_script(
    in_place: bool = True,
    epochs: int = 30,
    samples: int = 240,
    global_batch: int = 12,
    checkpoint_every: int = 20,
    step_delay: float = 0.1,
    ballast_mb: float = 32.0,
) -> ScriptSpec:
    """Ours, ``examples/train_ddp.py``: world-size-free math (GroupNorm, float64, a
    constant global batch), the sample ledger, paced steps, and a frozen ballast parameter
    that makes saves, snapshots and state transfers slow enough to land a fault inside."""
    argv = [
        str(DDP_SCRIPT),
        *(["--in-place"] if in_place else []),
        f"--ckpt={CKPT}",
        f"--epochs={epochs}",
        f"--samples={samples}",
        f"--global-batch-size={global_batch}",
        f"--checkpoint-every={checkpoint_every}",
        f"--step-delay={step_delay:g}",
        f"--ballast-mb={ballast_mb:g}",
        "--norm=group",
        "--double",
        "--ledger",
    ]
    return ScriptSpec(
        tuple(argv),
        steps=epochs * (samples // global_batch),
        global_batch=global_batch,
        samples=samples,
        checkpoint_every=checkpoint_every,
        reference_args=("--step-delay=0", "--checkpoint-every=1000000"),
    )


def script_workers(agent: int, path: str) -> list[int]:
    """The processes below ``agent`` that run the script at ``path``: started with it on
    their command line, or forked from the agent's fork server. The server itself is none
    of them: a child of the agent that is either a spawned ``multiprocessing.forkserver``
    or a fork of the agent (whose command line it keeps, the script's path included)."""
    own = _cmdline(agent)
    servers = {
        pid
        for pid in children(agent)
        if b"multiprocessing.forkserver" in (line := _cmdline(pid)) or line == own
    }
    out = []
    for pid in descendants(agent):
        if pid in servers:
            continue
        cmdline = _cmdline(pid)
        if (path.encode() in cmdline and b"torch.distributed.run" not in cmdline) or _parent(
            pid
        ) in servers:
            out.append(pid)
    return out


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _parent(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[1])


class ScriptReference:
    """The fault-free run of the script in one process; started early (:meth:`start`),
    it runs beside the job, and :meth:`result` waits for it."""

    def __init__(
        self, spec: ScriptSpec, run_dir: Path, environ: Mapping[str, str], secret: bytes
    ) -> None:
        self.spec, self.secret = spec, secret
        self.url = run_dir / "reference"
        self.log = run_dir / "reference-events.jsonl"
        self.out = run_dir / "reference.log"
        self.environ = {**environ, env.EVENT_LOG: str(self.log)}
        self.environ.pop(env.RUN_ID, None)
        self.proc: subprocess.Popen[bytes] | None = None
        self.losses: dict[int, float] = {}

    def start(self) -> None:
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=1",
            *self.spec.command(self.url, reference=True),
        ]
        with open(self.out, "wb") as out:
            self.proc = subprocess.Popen(argv, env=self.environ, stdout=out, stderr=out)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            for pid in [self.proc.pid, *descendants(self.proc.pid)]:
                with contextlib.suppress(OSError):
                    os.kill(pid, 9)
            self.proc.wait(30)

    def model(self, timeout: float = 1800) -> dict[str, Any]:
        """Wait for the run; its final model (its losses in :attr:`losses`).

        Raises:
            RuntimeError: it failed or did not end at the script's last step.
        """
        if self.proc is None:
            self.start()
        assert self.proc is not None
        code = self.proc.wait(timeout)
        if code != 0:
            tail = self.out.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"The fault-free reference run exited {code}: {tail}")
        self.losses = {e["step"]: e["loss"] for e in events.read(self.log, "train.step")}
        return final_script_model(self.url, "local", self.spec.steps, self.secret)


def final_script_model(
    url: Path | str, run_id: str, steps: int, secret: bytes | None
) -> dict[str, Any]:
    """The model of the newest complete step of ``run_id`` under ``url``, which must be
    step ``steps``.

    Raises:
        RuntimeError: the newest complete step is another.
    """
    from elastic.checkpoint import find_latest_complete
    from elastic_tools.chaos.reference import stored_model

    info = find_latest_complete(str(url), run_id, secret=secret)
    if info is None or info.step != steps:
        raise RuntimeError(
            f"The newest complete checkpoint under {url} is {info and info.step}, not step {steps}."
        )
    return stored_model(info.url, info.metadata_record)


__all__ = [
    "CKPT",
    "DDP_SCRIPT",
    "SCRIPT_MODEL_RTOL",
    "ScriptReference",
    "ScriptSpec",
    "ddp_script",
    "final_script_model",
    "script_workers",
]
