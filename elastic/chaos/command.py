"""``elastic chaos``: its options (:func:`add_arguments`, which ``elastic``'s parser uses)
and its run (:func:`command`); ``python -m elastic.chaos`` is the same command.

Import-light: the run's modules (torch among them) are imported when a run starts.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from elastic.chaos.plan import ChaosOptions

HELP = "a seeded fault schedule against a local job, then checks"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``elastic chaos``."""
    from elastic.chaos.plan import KINDS

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


def kind_list(text: str) -> list[str]:
    """``--kinds``: comma-separated names of :data:`~elastic.chaos.plan.KINDS`.

    Raises:
        argparse.ArgumentTypeError: a name is no fault kind.
    """
    from elastic.chaos.plan import KINDS

    kinds = [k for k in text.split(",") if k]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown fault kinds {', '.join(unknown)}; choose from {', '.join(KINDS)}"
        )
    return kinds


def options(args: argparse.Namespace) -> ChaosOptions:
    """The run that parsed options ask for; progress lines go to stderr unless ``--json-only``."""
    from elastic.chaos.plan import ChaosOptions

    return ChaosOptions(
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


def command(args: argparse.Namespace) -> int:
    """Run ``elastic chaos`` from parsed options; 0 when every invariant held."""
    from elastic.chaos.report import table
    from elastic.chaos.run import run_chaos
    from elastic.errors import ElasticError

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
    """``python -m elastic.chaos [options]``: ``elastic chaos`` without the other commands."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="elastic chaos", description=HELP, allow_abbrev=False)
    add_arguments(parser)
    return command(parser.parse_args(argv))


__all__ = ["HELP", "add_arguments", "command", "kind_list", "main", "options"]
