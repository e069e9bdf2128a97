"""``elastic checkpoint ls|verify|export``: a run's checkpoints from the command line.

* ``ls URL``: every step with a directory, newest first, complete or why not;
* ``verify URL [--step N]``: read every file of a step (default: the newest) against its
  digest and check the marker's signature with the job's secret;
* ``export URL [--step N] -o FILE [--format torch|safetensors] [--optimizer]``: the model
  (and with ``--optimizer`` the optimizer) of a complete step as one plain ``torch.save``
  file or a safetensors file, for inference or another framework.

``URL`` is the checkpoint URL with ``--run-id R``; without it, the run's own directory
(``<url>/<run_id>``) or a checkpoint URL that holds one run (several: they are named).
The secret is the one the workers use: ``$ELASTIC_SECRET_FILE``, else a local run's
generated secret when it exists; without one, unsigned steps are checked by their
digests and signed ones cannot be verified. Every error is one sentence: no such step,
unsigned, the corrupt file named.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from elastic import env
from elastic import secret as signing
from elastic.checkpoint import StepInfo, inspect_step, list_steps
from elastic.checkpoint.foreign import MODEL, read_entries
from elastic.checkpoint.storage import filesystem, join
from elastic.errors import CheckpointError, ConfigError

OPTIMIZER = "optim"
FORMATS = ("torch", "safetensors")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add ``checkpoint`` and its ``ls``, ``verify`` and ``export`` commands."""
    parser = subparsers.add_parser(
        "checkpoint", help="list, verify or export a run's checkpoints", allow_abbrev=False
    )
    actions = parser.add_subparsers(dest="action", required=True)
    for name, text in (
        ("ls", "list the steps, complete or why not"),
        ("verify", "check every file's digest and the signature of a step"),
        ("export", "write a step's model as one torch.save or safetensors file"),
    ):
        action = actions.add_parser(name, help=text, allow_abbrev=False)
        action.add_argument("url", help="checkpoint URL (with --run-id) or the run's directory")
        action.add_argument("--run-id", help="default: the last part of URL")
        if name != "ls":
            default = "the newest step" if name == "verify" else "the newest complete step"
            action.add_argument("--step", type=int, help=f"default: {default}")
    export = actions.choices["export"]
    export.add_argument("-o", "--output", type=Path, required=True, help="the file to write")
    export.add_argument("--format", choices=FORMATS, default="torch")
    export.add_argument("--optimizer", action="store_true", help="also the optimizer state")


def command(args: argparse.Namespace) -> int:
    """Run ``elastic checkpoint ...``; errors raise with one sentence."""
    url, run_id = _run(args.url, args.run_id)
    if args.action == "ls":
        print(format_steps(url, run_id))
        return 0
    info = choose_step(url, run_id, args.step, full=args.action == "verify")
    if args.action == "verify":
        print(f"step {info.step}: ok ({_vouched(info)}, {len(_files(info))} files read)")
        return 0
    out = export_step(info, args.output, args.format, args.optimizer)
    print(f"step {info.step}: exported to {out}")
    return 0


def _run(url: str, run_id: str | None) -> tuple[str, str]:
    """The checkpoint URL and run id that ``url`` (and ``--run-id``) name: with
    ``--run-id``, as given; else ``url`` is the run's own directory, or the checkpoint URL
    of the only run under it (several: an error naming them)."""
    if run_id:
        return url, run_id
    stripped = url.rstrip("/")
    parent, _, name = stripped.rpartition("/")
    own_dir = bool(parent and name and not parent.endswith(":/"))
    if own_dir and _steps(parent, name):
        return parent, name
    runs = list_runs(url)
    if len(runs) == 1:
        print(f"run {runs[0]} (the only run under {stripped})", file=sys.stderr)
        return url, runs[0]
    if runs:
        raise ConfigError(
            f"{stripped} holds the checkpoints of {len(runs)} runs ({_names(runs)}); give --run-id."
        )
    if not own_dir:
        raise ConfigError(f"Cannot tell the run from {url!r}; give --run-id.")
    return parent, name


def list_runs(url: str) -> list[str]:
    """The run ids under the checkpoint URL ``url`` (directories that hold a step), sorted."""
    fs, root = filesystem(url)
    try:
        entries = fs.ls(root, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return []
    names = [
        str(e["name"]).rstrip("/").rsplit("/", 1)[-1]
        for e in entries
        if e.get("type") == "directory"
    ]
    return sorted(n for n in names if _steps(url, n))


def _steps(url: str, run_id: str) -> list[int]:
    try:
        return list_steps(url, run_id)
    except (ConfigError, NotADirectoryError):  # not a run's name, or not a directory
        return []


def _names(runs: list[str], most: int = 5) -> str:
    shown = ", ".join(runs[:most])
    return shown if len(runs) <= most else f"{shown} and {len(runs) - most} more"


def _nothing_under(url: str, run_id: str) -> str:
    """There are no checkpoints under ``url/run_id``, and which runs ``url`` holds."""
    runs = list_runs(url)
    found = f"; the runs under {url.rstrip('/')}: {_names(runs)} (give --run-id)" if runs else ""
    return f"There are no checkpoints under {join(url, run_id)}{found}."


def checkpoint_secret() -> bytes | None:
    """The job's secret as the workers find it, without creating one."""
    if os.environ.get(env.SECRET_FILE) or signing.secret_path().exists():
        return signing.job_secret()
    return None


def format_steps(url: str, run_id: str) -> str:
    """One line per step directory, newest first."""
    steps = list_steps(url, run_id)
    if not steps:
        return _nothing_under(url, run_id)
    secret = checkpoint_secret()
    lines = []
    for step in steps:
        info = inspect_step(url, run_id, step, "size", secret)
        if info.complete:
            marker = info.marker or {}
            lines.append(
                f"step {step}  complete  world size {marker.get('world_size')}  "
                f"{_vouched(info)}  {_bytes(info)}"
            )
        else:
            lines.append(f"step {step}  incomplete: {info.reason}")
    return "\n".join(lines)


def choose_step(url: str, run_id: str, step: int | None, full: bool) -> StepInfo:
    """The complete step ``step``, its files read in full when ``full``. By default the
    newest complete step, or with ``full`` (verify) the newest step, so that a damaged
    newest step is reported, not passed over.

    Raises:
        CheckpointError: no such step, or the step is not complete (the reason named).
    """
    steps = list_steps(url, run_id)
    where = join(url, run_id)
    if not steps:
        raise CheckpointError(_nothing_under(url, run_id))
    if step is not None and step not in steps:
        shown = ", ".join(map(str, steps[:5]))
        raise CheckpointError(f"There is no step {step} under {where} (newest: {shown}).")
    if step is None and full:
        step = steps[0]
    secret = checkpoint_secret()
    for candidate in [step] if step is not None else steps:
        info = inspect_step(url, run_id, candidate, "full" if full else "size", secret)
        if info.complete or step is not None:
            return _vouch(info, secret)
    raise CheckpointError(f"No step under {where} is complete; see 'elastic checkpoint ls'.")


def _vouch(info: StepInfo, secret: bytes | None) -> StepInfo:
    if not info.complete:
        raise CheckpointError(f"Step {info.step} is not usable: {info.reason}.")
    signed = "hmac" in (info.marker or {})
    if signed and secret is None:
        raise CheckpointError(
            f"Step {info.step} is signed but no secret is at hand to check it; set "
            f"${env.SECRET_FILE} to the job's secret file."
        )
    return info


def _vouched(info: StepInfo) -> str:
    return "signed" if "hmac" in (info.marker or {}) else "unsigned"


def _files(info: StepInfo) -> dict[str, Any]:
    return dict((info.marker or {}).get("files") or {})


def _bytes(info: StepInfo) -> str:
    total = sum(int(entry.get("size", 0)) for entry in _files(info).values())
    return f"{total / 1e6:.1f} MB"


def export_step(info: StepInfo, output: Path, fmt: str, optimizer: bool) -> Path:
    """Write the model (and with ``optimizer`` the optimizer) of a complete step to
    ``output``: a ``torch.save`` file (the model's state dict itself, or
    ``{"model": ..., "optim": ...}``) or a safetensors file (dotted names, the
    optimizer's under ``optim.``; its non-tensor values as JSON in the metadata)."""
    if fmt not in FORMATS:
        raise ConfigError(f"The export format {fmt!r} is not one of {', '.join(FORMATS)}.")
    keys = [MODEL, OPTIMIZER] if optimizer else [MODEL]
    state = read_entries(info.data_url, keys, info.metadata_record)
    absent = [key for key in keys if key not in state]
    if absent:
        raise CheckpointError(f"Step {info.step} holds no {absent[0]!r} state to export.")
    output.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "torch":
        torch.save(state if optimizer else state[MODEL], output)
    else:
        _save_safetensors(state if optimizer else {MODEL: state[MODEL]}, output, optimizer)
    return output


def _save_safetensors(state: dict[str, Any], output: Path, prefixed: bool) -> None:
    try:
        from safetensors.torch import save_file
    except ImportError as exc:
        raise ConfigError(
            "Exporting to safetensors needs the safetensors package; pip install safetensors."
        ) from exc
    tensors: dict[str, torch.Tensor] = {}
    others: dict[str, Any] = {}
    for key, value in state.items():
        _flatten(value, f"{key}." if prefixed or key != MODEL else "", tensors, others)
    metadata = {"elastic.non_tensors": json.dumps(others, default=str)} if others else None
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(output), metadata=metadata)


def _flatten(value: Any, prefix: str, tensors: dict[str, torch.Tensor], others: dict) -> None:
    if isinstance(value, torch.Tensor):
        tensors[prefix.rstrip(".")] = value
    elif isinstance(value, dict):
        for key, item in value.items():
            _flatten(item, f"{prefix}{key}.", tensors, others)
    elif isinstance(value, list | tuple) and any(isinstance(v, torch.Tensor) for v in value):
        for index, item in enumerate(value):
            _flatten(item, f"{prefix}{index}.", tensors, others)
    else:
        others[prefix.rstrip(".")] = value


__all__ = [
    "add_parser",
    "checkpoint_secret",
    "choose_step",
    "command",
    "export_step",
    "list_runs",
]
