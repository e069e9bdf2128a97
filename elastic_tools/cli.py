"""The ``elastic`` command: ``elastic demo``, ``status``, ``timeline``, ``dashboard``,
``chaos`` and ``checkpoint``."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from elastic.errors import ConfigError, ElasticError, EtcdConnectionError
from elastic.node import reform
from elastic_tools.chaos import command as chaos_command

if TYPE_CHECKING:
    from elastic.etcd.client import EtcdOptions

logger = logging.getLogger(__name__)
WATCH_S = 2.0  # --watch without a value: seconds between reports
CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen (a terminal only)


def _add_etcd_flags(parser: argparse.ArgumentParser) -> None:
    """The agent's ways to reach and log into etcd (the password never on the command line)."""
    from elastic_tools.status import PASSWORD_ENV

    parser.add_argument(
        "--etcd",
        "--rdzv-endpoint",
        dest="etcd",
        required=True,
        help="host:port[,host:port...] of etcd (https://host:port for TLS)",
    )
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--prefix", default="/elastic")
    parser.add_argument("--cacert", help="CA bundle (PEM) that signed the etcd server certificates")
    parser.add_argument("--cert", help="client certificate (PEM) for mutual TLS")
    parser.add_argument("--key", help="the client certificate's private key (PEM)")
    parser.add_argument("--user", help="etcd user (etcd's auth enabled)")
    parser.add_argument(
        "--password-file",
        help=f"file that holds the etcd password (default: ${PASSWORD_ENV})",
    )
    # Refused with a sentence (argparse's own error would echo the password back).
    parser.add_argument("--password", help=argparse.SUPPRESS)


def _parser() -> argparse.ArgumentParser:
    # No abbreviations: `--password SECRET` must not pass as `--password-file` (and then be
    # printed in the error that names the file).
    parser = argparse.ArgumentParser(prog="elastic", description=__doc__, allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="a local elastic run on an embedded etcd")
    demo.add_argument("--run-id", default=f"demo-{time.strftime('%Y%m%d-%H%M%S')}")
    demo.add_argument("--runs-dir", type=Path, default=Path("runs"))
    demo.add_argument(
        "--config",
        type=Path,
        default=None,
        help="default: the shipped default.yaml (tiny.yaml with --quick)",
    )
    demo.add_argument(
        "--quick",
        action="store_true",
        help="a small CNN (tiny.yaml), paced, for a shorter scenario (about 1.5 minutes)",
    )
    demo.add_argument(
        "--dashboard-port",
        type=int,
        default=8080,
        help="serve the live dashboard on this port of 127.0.0.1 while the demo runs (a free "
        "port when it is taken; 0: any free port); default %(default)s",
    )
    demo.add_argument("--no-dashboard", action="store_true", help="do not serve the dashboard")

    status = sub.add_parser(
        "status", help="a run's rendezvous and newest checkpoint", allow_abbrev=False
    )
    _add_etcd_flags(status)
    status.add_argument("--checkpoint-url", help="where the run writes checkpoints")
    status.add_argument(
        "--verify",
        choices=("size", "crc"),
        default="size",
        help="checkpoint check: 'size' lists the files (default, cheap on object storage); "
        "'crc' reads every byte",
    )
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.add_argument(
        "--event-log",
        default=None,
        help="the run's event log (default $ELASTIC_EVENT_LOG): the slowest ranks, stuck ones",
    )
    status.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=WATCH_S,
        default=None,
        metavar="SECONDS",
        help=f"report again every SECONDS (default {WATCH_S:g}) until Ctrl-C",
    )

    timeline = sub.add_parser("timeline", help="draw a run's world size, loss and samples/s")
    timeline.add_argument("source", type=Path, help="a run directory or its events.jsonl")
    timeline.add_argument("-o", "--output", type=Path, default=Path("timeline.png"))
    timeline.add_argument("--title", help="default: the run directory's name")

    dash = sub.add_parser(
        "dashboard", help="a read-only web page of a running job", allow_abbrev=False
    )
    _add_etcd_flags(dash)
    logs = dash.add_mutually_exclusive_group()
    logs.add_argument("--runs-dir", type=Path, help="the event log is RUNS_DIR/RUN_ID/events.jsonl")
    logs.add_argument("--event-log", type=Path, help="the run's event log (JSON lines)")
    dash.add_argument("--checkpoint-url", help="where the run writes checkpoints")
    dash.add_argument("--host", default="127.0.0.1", help="address to serve on")
    dash.add_argument("--port", type=int, default=8080, help="0: any free port")
    dash.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="also answer requests that name this host (with --host 0.0.0.0, the name or "
        "address browsers use); repeatable",
    )

    chaos = sub.add_parser("chaos", help=chaos_command.HELP, allow_abbrev=False)
    chaos_command.add_arguments(chaos)
    from elastic_tools.checkpoint import add_parser as add_checkpoint_parser

    add_checkpoint_parser(sub)
    return parser


def _options(args: argparse.Namespace, request_timeout: float | None = None) -> EtcdOptions:
    from elastic_tools.status import PASSWORD_ENV, etcd_options

    if args.password is not None:
        raise ConfigError(
            "There is no --password option: a password on the command line shows in 'ps' and "
            f"in the shell's history; pass --password-file FILE or set ${PASSWORD_ENV}."
        )
    return etcd_options(
        args.etcd,
        cacert=args.cacert,
        cert=args.cert,
        key=args.key,
        user=args.user,
        password_file=args.password_file,
        request_timeout=request_timeout,
    )


def _demo(args: argparse.Namespace) -> int:
    from elastic.configs import config_path

    from elastic_tools.demo import FULL, QUICK, run_demo

    config = args.config or config_path("tiny" if args.quick else "default")
    return run_demo(
        args.runs_dir,
        args.run_id,
        config,
        pace=QUICK if args.quick else FULL,
        dashboard_port=None if args.no_dashboard else args.dashboard_port,
    )


def _status(args: argparse.Namespace) -> int:
    from elastic.etcd.client import EtcdClient
    from elastic.rendezvous.keys import RunKeys
    from elastic.rendezvous.registry import state_secret
    from elastic_tools.status import (
        checkpoint_status,
        format_table,
        rendezvous_status,
        status_json,
        straggler_status,
    )

    if args.watch is not None and args.watch <= 0:
        raise ConfigError(f"--watch {args.watch:g} is not a positive number of seconds.")
    # A watch reports an etcd outage within seconds instead of riding it out for 30 s.
    options = _options(args, request_timeout=None if args.watch is None else 5.0)
    secret = state_secret()
    out = status_json if args.json else format_table
    clear = CLEAR if args.watch is not None and sys.stdout.isatty() and not args.json else ""

    def report(client: EtcdClient) -> str:
        rdzv = rendezvous_status(client, RunKeys(args.prefix, args.run_id), secret)
        ckpt = checkpoint_status(args.checkpoint_url, args.run_id, args.verify, secret)
        return out(args.run_id, rdzv, ckpt, straggler_status(args.event_log))

    with EtcdClient(options) as client:
        try:
            text = report(client)  # the first report must reach etcd (else a wrong endpoint)
            if args.watch is None:
                print(text)
                return 0
            while True:
                stamp = time.strftime("%H:%M:%S")
                print(f"{clear}{text}\n(every {args.watch:g} s, {stamp}; Ctrl-C stops)", flush=True)
                time.sleep(args.watch)
                try:
                    text = report(client)
                except EtcdConnectionError as exc:  # an outage: say so, keep watching
                    text = f"elastic: {exc}"
        except KeyboardInterrupt:
            if args.watch is None:
                raise
            return 0


def _timeline(args: argparse.Namespace) -> int:
    from elastic_tools.timeline import render_timeline

    out = render_timeline(args.source, args.output, args.title)
    print(f"timeline: {out}")
    return 0


def _dashboard(args: argparse.Namespace) -> int:
    from elastic.rendezvous.registry import state_secret
    from elastic_tools.dashboard import Dashboard, serve

    event_log = args.event_log
    if args.runs_dir is not None:
        event_log = args.runs_dir / args.run_id / "events.jsonl"
    dashboard = Dashboard(
        _options(args, request_timeout=5.0),
        args.run_id,
        prefix=args.prefix,
        event_log=event_log,
        checkpoint_url=args.checkpoint_url,
        secret=state_secret(),
    )
    server = serve(dashboard, args.host, args.port, allow_hosts=args.allow_host)
    print(f"dashboard of run {args.run_id}: {server.url} (Ctrl-C stops)", flush=True)
    try:
        server.thread.join()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named, not echoed: a mistyped --password's value is a password
        names = [a.split("=", 1)[0] for a in unknown if a.startswith("-")]
        values = len(unknown) - len(names)
        shown = ", ".join(names) or "none"
        parser.error(
            f"unrecognized options: {shown}"
            + (f" and {values} other argument(s), not shown" if values else "")
            + "; see --help"
        )
    try:
        if args.command == "demo":
            return _demo(args)
        if args.command == "timeline":
            return _timeline(args)
        if args.command == "dashboard":
            return _dashboard(args)
        if args.command == "chaos":
            return chaos_command.command(args)
        if args.command == "checkpoint":
            from elastic_tools.checkpoint import command as checkpoint_command

            return checkpoint_command(args)
        return _status(args)
    except ConfigError as exc:
        print(f"elastic: error: {exc}", file=sys.stderr)
        return reform.USAGE
    except ElasticError as exc:
        print(f"elastic: error: {exc}", file=sys.stderr)
        return reform.FAILED


if __name__ == "__main__":
    sys.exit(main())
