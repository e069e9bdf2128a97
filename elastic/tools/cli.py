"""The ``elastic`` command: ``elastic demo`` and ``elastic status``."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from elastic import reform
from elastic.errors import ConfigError, ElasticError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elastic", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="a local elastic run on an embedded etcd")
    demo.add_argument("--run-id", default=f"demo-{time.strftime('%Y%m%d-%H%M%S')}")
    demo.add_argument("--runs-dir", type=Path, default=Path("runs"))
    demo.add_argument("--config", type=Path, default=None, help="default: the shipped default.yaml")
    status = sub.add_parser("status", help="a run's rendezvous and newest checkpoint")
    status.add_argument(
        "--etcd",
        "--rdzv-endpoint",
        dest="etcd",
        required=True,
        help="host:port[,host:port...] of etcd",
    )
    status.add_argument("--run-id", required=True)
    status.add_argument("--prefix", default="/elastic")
    status.add_argument("--checkpoint-url", help="where the run writes checkpoints")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def _status(args: argparse.Namespace) -> int:
    from elastic.etcd.client import EtcdClient, EtcdOptions, parse_endpoints
    from elastic.rendezvous.keys import RunKeys
    from elastic.rendezvous.registry import state_secret
    from elastic.tools.status import checkpoint_status, format_table, rendezvous_status, status_json

    endpoints, https = parse_endpoints(args.etcd)
    with EtcdClient(EtcdOptions(endpoints, tls=https)) as client:
        rdzv = rendezvous_status(client, RunKeys(args.prefix, args.run_id), state_secret())
    ckpt = checkpoint_status(args.checkpoint_url, args.run_id)
    out = status_json if args.json else format_table
    print(out(args.run_id, rdzv, ckpt))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = _parser().parse_args(argv)
    try:
        if args.command == "demo":
            from elastic_configs import config_path

            from elastic.tools.demo import run_demo

            return run_demo(args.runs_dir, args.run_id, args.config or config_path("default"))
        return _status(args)
    except ConfigError as exc:
        print(f"elastic: error: {exc}", file=sys.stderr)
        return reform.USAGE
    except ElasticError as exc:
        print(f"elastic: error: {exc}", file=sys.stderr)
        return reform.FAILED


if __name__ == "__main__":
    sys.exit(main())
