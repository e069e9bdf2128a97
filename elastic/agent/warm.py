"""Warm worker starts: fork our CNN worker from a server that has already imported torch.

A fresh worker process spends seconds starting Python and importing torch and
torchvision, most of the time from a crash to the next training step (the figures:
docs/benchmarks.md). The agent instead starts
Python's ``forkserver`` once, when it starts, and has it import the worker and
everything it needs (:data:`PRELOAD`) while the rendezvous runs. Every worker,
first or restarted, is then a ``fork()`` of that server: a few milliseconds.

Forking after ``import torch`` is safe here: the server only imports (no CUDA
context, no thread pool exists yet), as torch's own DataLoader workers rely on.

Process tree and cleanup: agent -> fork server -> workers. The server asks
Linux to kill it when the agent dies (:mod:`elastic.agent.forkserver_init`; its own
"alive" pipe is not enough, since the workers hold it too) and each worker asks
the same of the server (:func:`elastic.procs.die_with_parent`), so a ``kill -9``
of the agent still leaves no worker behind.

Only our worker (``-m elastic.training.worker``) starts warm; a user's script runs as a
fresh process exactly as under torchrun. ``ELASTIC_WARM_START=0`` turns this off.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import time
from multiprocessing import forkserver

from elastic import env, reform

logger = logging.getLogger(__name__)

START_METHOD = "forkserver"
WORKER_MODULE = "elastic.training.worker"
# Imported once by the fork server; each worker then starts with them loaded.
PRELOAD = [
    "elastic.agent.forkserver_init",  # first: the server dies with the agent
    "torch",
    "torch.distributed.checkpoint",
    "torchvision",
    WORKER_MODULE,
]


_started = False


def enabled() -> bool:
    """Whether warm starts are on (``ELASTIC_WARM_START=0`` turns them off)."""
    return os.environ.get(env.WARM_START, "1").strip().lower() not in ("0", "false", "no", "off")


def start_server() -> None:
    """Start the fork server now and have it import :data:`PRELOAD` in the background.

    Returns at once; the first fork waits for the imports to finish. Call it
    before anything else starts (the server inherits this process's environment).
    """
    global _started
    if _started:
        return
    _started = True
    started = time.monotonic()
    multiprocessing.get_context(START_METHOD).set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()
    logger.info(
        "Started the worker fork server in %.2f s; it is importing %s.",
        time.monotonic() - started,
        ", ".join(PRELOAD),
    )


def run_worker(*argv: str) -> None:
    """The agent's entry point in a forked worker: ``python -m elastic.training.worker ARGV``."""
    from elastic.training.worker import main, stopped_by_signal

    # As torchrun's workers: a session of our own (a Ctrl-C in the agent's terminal
    # reaches the agent, which forwards it once; a second signal would stop us
    # mid-step without a checkpoint), and output that is not held in a buffer.
    os.setsid()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    code = main(list(argv))
    if code == reform.OK and stopped_by_signal():
        # Stopped by a signal: whoever sent it waits for the process to end. A forked
        # worker that returns instead waits for the agent to collect its return value,
        # which an agent busy stopping its workers never does (torch then kills it
        # after 30 s). Leave as a worker stopped for a re-form does.
        code = reform.EXIT_CODE
    if code:
        sys.exit(code)


__all__ = ["PRELOAD", "START_METHOD", "enabled", "run_worker", "start_server"]
