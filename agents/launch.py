"""``elastic-agent``: torchrun's agent with the ``etcd-v3`` rendezvous and clear errors.

Takes torchrun's options (``--nnodes MIN:MAX``, ``--nproc-per-node``,
``--rdzv-endpoint``, ``--rdzv-id``, ``--max-restarts``, ``--local-addr`` ...) with
``--rdzv-backend`` defaulting to ``etcd-v3``, and runs any training script the way
torchrun does. Bad input and an unreachable etcd end in one sentence on stderr
and a non-zero exit, not a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

logger = logging.getLogger(__name__)

EXIT_FAILED = 1
EXIT_USAGE = 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run one node's agent until its workers finish; return the exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    from agents.agent import install
    from elastic.errors import ConfigError, ElasticError

    install()

    parser = get_args_parser()
    parser.prog = "elastic-agent"
    parser.set_defaults(rdzv_backend="etcd-v3")
    args = parser.parse_args(argv)
    try:
        _preflight_worker_config(args)
    except ConfigError as exc:
        return _fail(str(exc), EXIT_USAGE)
    try:
        config, cmd, cmd_args = config_from_args(args)
    except (AssertionError, ValueError) as exc:  # torchrun's checks of --nnodes and friends
        return _fail(f"{exc}; check the command-line options.", EXIT_USAGE)
    try:
        elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
    except SignalException as exc:
        print(f"elastic-agent: left the job on {exc.sigval.name}.", file=sys.stderr)
        return 0
    except ConfigError as exc:
        return _fail(str(exc), EXIT_USAGE)
    except (ElasticError, RendezvousError) as exc:
        return _fail(str(exc), EXIT_FAILED)
    except ChildFailedError as exc:
        return _fail(f"a worker failed: {exc.get_first_failure()[1].message}", EXIT_FAILED)
    return 0


def _preflight_worker_config(args: argparse.Namespace) -> None:
    """Validate our worker's config here, once, instead of in every worker and restart."""
    if not (args.module and args.training_script == "elastic.worker"):
        return
    from elastic.config import load_config
    from elastic.errors import ConfigError

    worker_args = list(args.training_script_args)
    if "--config" not in worker_args or worker_args.index("--config") + 1 >= len(worker_args):
        raise ConfigError("elastic.worker needs --config FILE; pass the worker's YAML config.")
    at = worker_args.index("--config")
    overrides = [a for a in worker_args[at + 2 :] if "=" in a]
    load_config(worker_args[at + 1], overrides)


def _fail(message: str, code: int) -> int:
    print(f"elastic-agent: error: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
