"""``elastic chaos``: its options (:func:`add_arguments`, which ``elastic``'s parser uses)
and its run (:func:`command`); ``python -m elastic_tools.chaos`` is the same command.

Import-light: the run's modules (torch among them) are imported when a run starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from elastic_tools.chaos.plan import ChaosOptions
    from elastic_tools.chaos.script import ScriptSpec

HELP = "a seeded fault schedule against a local job, then checks"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``elastic chaos``."""
    from elastic_tools.chaos.plan import KINDS

    parser.add_argument("--minutes", type=float, default=10.0, help="how long faults are injected")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs-dir", type=Path, default=Path("runs"))
    parser.add_argument("--every", type=float, default=120.0, help="mean seconds between faults")
    parser.add_argument(
        "--kinds",
        type=kind_list,
        default="",
        metavar="KIND[,KIND...]",
        help=f"comma-separated fault kinds (default: all), of: {', '.join(KINDS)}",
    )
    parser.add_argument("--agents", type=int, default=3, help="agents at the start (2-4)")
    parser.add_argument(
        "--no-secret",
        action="store_true",
        help="run the job without a secret (unsigned records; rogue_member is skipped)",
    )
    parser.add_argument("--json-only", action="store_true", help="print only the JSON report")
    script = parser.add_argument_group("a user's script on elastic.Run (docs/chaos.md)")
    script.add_argument(
        "--script",
        default=None,
        metavar="PATH|ddp",
        help="run this script (its arguments after --; '{ckpt}' among them is replaced by "
        "the checkpoint URL) instead of our worker; 'ddp': examples/train_ddp.py",
    )
    script.add_argument(
        "--restart", action="store_true", help="ddp: the restart path (not --in-place)"
    )
    script.add_argument("--epochs", type=int, default=30, help="ddp: epochs of 20 steps")
    script.add_argument("--steps", type=int, default=0, help="a script's last step")
    script.add_argument("--global-batch", type=int, default=0, help="a script's global batch")
    script.add_argument("--samples", type=int, default=0, help="a script's dataset size")
    script.add_argument(
        "--model-rtol", type=float, default=0.0, help="a script's model bound (relative L2)"
    )
    script.add_argument(
        "--compound",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="rounds of the compound schedule instead of the random one",
    )
    script.add_argument("--freeze-s", type=float, default=8.0, help="compound: node freeze")
    script.add_argument("--etcd-freeze-s", type=float, default=4.0, help="compound: etcd freeze")
    script.add_argument("--etcd-members", type=int, default=3, help="etcd cluster size")
    script.add_argument("script_args", nargs="*", help=argparse.SUPPRESS)


def kind_list(text: str) -> list[str]:
    """``--kinds``: comma-separated names of :data:`~elastic_tools.chaos.plan.KINDS`.

    Raises:
        argparse.ArgumentTypeError: a name is no fault kind.
    """
    from elastic_tools.chaos.plan import KINDS

    kinds = [k for k in text.split(",") if k]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown fault kinds {', '.join(unknown)}; choose from {', '.join(KINDS)}"
        )
    return kinds


def options(args: argparse.Namespace) -> ChaosOptions:
    """The run that parsed options ask for; progress lines go to stderr unless ``--json-only``."""
    from elastic_tools.chaos.plan import ChaosOptions

    return ChaosOptions(
        script=script_spec(args),
        compound=args.compound,
        freeze_s=args.freeze_s,
        etcd_freeze_s=args.etcd_freeze_s,
        etcd_members=args.etcd_members,
        minutes=args.minutes,
        seed=args.seed,
        runs_dir=args.runs_dir,
        every_s=args.every,
        agents=args.agents,
        kinds=args.kinds or None,
        secret=not args.no_secret,
        say=(lambda line: None)
        if args.json_only
        else (lambda line: print(line, file=sys.stderr, flush=True)),
    )


def script_spec(args: argparse.Namespace) -> ScriptSpec | None:
    """The user's script that parsed options name (None: our worker).

    Raises:
        SystemExit: a script other than ours without ``--steps``.
    """
    from elastic_tools.chaos.script import SCRIPT_MODEL_RTOL, ScriptSpec, ddp_script

    if args.script is None:
        return None
    if args.script == "ddp":
        spec = ddp_script(in_place=not args.restart, epochs=args.epochs)
        extra = tuple(args.script_args)
        return dataclasses.replace(spec, argv=spec.argv + extra) if extra else spec
    if args.steps <= 0:
        raise SystemExit("elastic chaos: --script needs --steps (the step its job ends at)")
    return ScriptSpec(
        (str(Path(args.script).resolve()), *args.script_args),
        steps=args.steps,
        global_batch=args.global_batch,
        samples=args.samples,
        model_rtol=args.model_rtol or SCRIPT_MODEL_RTOL,
    )


def command(args: argparse.Namespace) -> int:
    """Run ``elastic chaos`` from parsed options; 0 when every invariant held."""
    from elastic.errors import ElasticError
    from elastic_tools.chaos.report import table
    from elastic_tools.chaos.run import run_chaos

    try:
        report = run_chaos(options(args))
    except (RuntimeError, ElasticError) as exc:
        print(f"elastic chaos: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2))
    if not args.json_only:
        print(table(report))
    return 0 if report["ok"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m elastic_tools.chaos [options]``: ``elastic chaos`` without the other commands."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="elastic chaos", description=HELP, allow_abbrev=False)
    add_arguments(parser)
    return command(parser.parse_args(argv))


__all__ = [
    "HELP",
    "add_arguments",
    "command",
    "kind_list",
    "main",
    "options",
    "script_spec",
]
