"""The stale writer: a process that holds an old round's fence and tries to save, commit,
purge and forget records (``python -m elastic_tools.chaos.stale SPEC URL RUN_ID STEP`` prints what
happened as one JSON line). Every attempt must be refused, and nothing deleted."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elastic.rendezvous.fence import FenceSpec, RoundFence


def stale_argv(spec: FenceSpec, ckpt: Path, run_id: str, step: int) -> list[str]:
    """The command line of a stale writer of ``spec``'s round."""
    return [
        sys.executable,
        "-m",
        "elastic_tools.chaos.stale",
        spec.to_env(),
        str(ckpt),
        run_id,
        str(step),
    ]


def stale_writer(spec_json: str, url: str, run_id: str, step: int) -> dict[str, Any]:
    """With an old round's fence: save ``step``, commit it directly, purge, forget records.

    Returns what happened: ``refused`` per attempt, ``passed_checks`` (fence checks that let
    a deletion go ahead: must be 0) and ``removed`` (steps it deleted: must be empty).
    """
    from elastic.checkpoint import layout
    from elastic.rendezvous.fence import FenceSpec, RoundFence

    spec = FenceSpec(**json.loads(spec_json))
    fence = RoundFence(spec)
    out: dict[str, Any] = {"round": spec.round, "refused": {}, "passed_checks": 0, "removed": []}
    _count_removals(out["removed"])
    _save(fence, url, run_id, step, out)

    def counted_check() -> None:
        fence.check()
        out["passed_checks"] += 1

    for what, attempt in (
        ("commit", lambda: fence.commit(step, {"run": run_id, "digest": "stale"})),
        ("purge", lambda: layout.purge(url, run_id, 1, check=counted_check)),
        ("forget", lambda: fence.forget([step])),
    ):
        _attempt(what, attempt, out)
    fence.close()
    return out


def _count_removals(removed: list[str]) -> None:
    """Record in ``removed`` every step this process deletes."""
    from elastic.checkpoint import layout

    real_remove = layout.remove_step

    def counting_remove(target: str) -> None:
        removed.append(target)
        real_remove(target)

    layout.remove_step = counting_remove  # type: ignore[assignment]


def _save(fence: RoundFence, url: str, run_id: str, step: int, out: dict[str, Any]) -> None:
    """A blocking save of ``step`` through the checkpoint manager, under ``fence``."""
    import torch

    from elastic import secret as signing
    from elastic.checkpoint.config import CheckpointConfig
    from elastic.checkpoint.manager import CheckpointManager

    cfg = CheckpointConfig(url=url, keep_last=1, async_save=False, max_failures=10)
    manager = CheckpointManager(cfg, run_id, commit_fence=fence, secret=signing.job_secret())
    result = manager.save(step, {"model": {"w": torch.zeros(4)}}, block=True)
    out["refused"]["save"] = bool(result is not None and not result.ok)
    out["save_error"] = result.error if result is not None else "no outcome"


def _attempt(what: str, attempt: Callable[[], Any], out: dict[str, Any]) -> None:
    """Try one write; record whether it was refused, and why."""
    from elastic.errors import CheckpointError

    try:
        done = attempt()
    except CheckpointError as exc:
        out["refused"][what] = True
        out[f"{what}_error"] = str(exc)
        return
    except Exception as exc:  # etcd down (another fault): it wrote nothing either
        out["refused"][what] = True
        out[f"{what}_error"] = f"failed before writing: {type(exc).__name__}: {exc}"
        return
    # A purge that found nothing to delete never reaches the fence: nothing to refuse.
    nothing = what == "purge" and done == [] and not out["passed_checks"]
    out["refused"][what] = nothing
    if nothing:
        out["purge_error"] = "nothing to purge"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m elastic_tools.chaos.stale SPEC URL RUN_ID STEP``."""
    spec, url, run_id, step = list(sys.argv[1:] if argv is None else argv)[:4]
    print(json.dumps(stale_writer(spec, url, run_id, int(step))), flush=True)
    return 0


__all__ = ["main", "stale_argv", "stale_writer"]

if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    raise SystemExit(main())
