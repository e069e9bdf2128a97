"""The agent's fork server: workers are forks of a process that has already imported torch.

A fresh worker process spends seconds starting Python and importing torch, most of the
time from a crash to the next training step (the figures: docs/benchmarks.md). The agent
instead starts Python's ``forkserver`` once, when it starts, and has it import what its
workers need while the rendezvous runs: :data:`PRELOAD` for our worker,
:data:`SCRIPT_PRELOAD` for a user's script (torch only: a script imports the rest itself,
and a joining node's first worker waits for these imports). Every worker, first or
restarted, is then a ``fork()`` of that server: a few milliseconds.

Forking after ``import torch`` is safe here: the server only imports (no CUDA context, no
thread pool exists yet), as torch's own DataLoader workers rely on;
:func:`server_cold_reason` checks it before each start.

Process tree and cleanup: agent -> fork server -> workers. The server asks Linux to kill
it when the agent dies (:mod:`elastic.agent.forkserver_init`; its own "alive" pipe is not
enough, since the workers hold it too) and each worker asks the same of the server
(:func:`elastic.node.procs.die_with_parent`), so a ``kill -9`` of the agent still leaves no
worker behind.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import multiprocessing
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from multiprocessing import connection, forkserver, resource_tracker, util
from pathlib import Path
from typing import Any, NoReturn

from elastic import env
from elastic.node import options as node_options
from elastic.node import reform

logger = logging.getLogger(__name__)

START_METHOD = "forkserver"
WORKER_MODULE = "elastic_tools.training.worker"
_INIT = "elastic.agent.forkserver_init"  # first: the server dies with the agent
_READY = "elastic.agent.forkserver_ready"  # last: the server's heap is frozen for its forks
# Imported once by the fork server of our worker; each worker then starts with them loaded.
PRELOAD = [_INIT, "torch", "torch.distributed.checkpoint", "torchvision", WORKER_MODULE]
# The fork server of a user's script: torch only (what the script imports first, and the
# slow part of a fresh start); a joining node's worker forks as soon as this is done.
SCRIPT_PRELOAD = [_INIT, "torch"]

# Variables the agent (torch's, or ours: the straggler policy's floor, set once the options
# are parsed) sets in its own environment after the server started
# (TORCHELASTIC_SIGNALS_TO_HANDLE, the inductor cache dir, ELASTIC_STRAGGLER_MIN_NODES): read
# at run time, not by an import; the worker still gets their values of the moment. (The
# user's environment cannot change after the agent started: what changes is the agent's own
# doing.)
# The node's options (elastic.node.options) too: the agent writes them once its flags are parsed.
_RUNTIME_ONLY = (
    "TORCHELASTIC_",
    "TORCHINDUCTOR_CACHE_DIR",
    *node_options.ENV_NAMES,
    env.STRAGGLER,
    env.HANG,
    env.PROBATION,
)

_started = False
_server_env: dict[str, str] = {}  # the agent's environment when the server started


def enabled() -> bool:
    """Whether warm starts are on (``ELASTIC_WARM_START=0`` turns them off)."""
    return env.flag(env.WARM_START)


def start_server(modules: Sequence[str] = PRELOAD, extra_env: dict[str, str] | None = None) -> None:
    """Start the fork server now and have it import ``modules`` in the background.

    Returns at once; the first fork waits for the imports to finish. Call it before
    anything else starts (the server inherits this process's environment, plus
    ``extra_env``: what this process is about to set, as torchrun sets OMP_NUM_THREADS once
    its options are parsed). Only the first call starts a server.
    """
    global _started
    if _started:
        return
    _started = True
    extra = {k: v for k, v in (extra_env or {}).items() if k not in os.environ}
    _server_env.update(os.environ, **extra)
    started = time.monotonic()
    multiprocessing.get_context(START_METHOD).set_forkserver_preload(_preload(modules))
    os.environ.update(extra)
    try:
        forkserver.ensure_running()
    finally:
        for key in extra:
            os.environ.pop(key, None)
    logger.info(
        "Started the worker fork server in %.2f s; it is importing %s.",
        time.monotonic() - started,
        ", ".join(modules),
    )


def fork_server(modules: Sequence[str] = PRELOAD) -> None:
    """Import torch here (this process's own import, made now), then start the fork server
    as a ``fork()`` of this process, which must run no thread and hold no connection yet
    (the agent, at its start): the server then imports only what ``modules`` adds to torch.
    A spawned server (:func:`start_server`) imports torch a second time beside the agent's
    own import: on a machine whose cores are busy (a node joining a running job) both
    imports take longer, and a joiner's first worker waits for the server's.

    Only the first call (of either kind) starts a server. The server gets this process's
    environment of the moment; its stop signals are reset to a fresh interpreter's and the
    etcd password this process took from its environment is dropped from its memory.
    """
    global _started
    if _started:
        return
    _started = True
    collecting = gc.isenabled()
    gc.disable()  # an import's objects live on: a collection pass over them is wasted
    try:
        import torch  # noqa: F401  (the server forks with it)

        _fork(modules)
    finally:  # the agent's own collections (the server's: elastic.agent.forkserver_ready)
        if collecting:
            gc.enable()


def _fork(modules: Sequence[str]) -> None:
    """Fork the server (its life: :func:`_serve`) and record it as multiprocessing's."""
    _server_env.update(os.environ)
    started = time.monotonic()
    server: Any = forkserver._forkserver
    resource_tracker.ensure_running()  # a spawned helper, as forkserver.ensure_running does
    with server._lock, socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()  # the server ends once every holder of alive_w closed it
        sys.stdout.flush()
        sys.stderr.flush()
        # Neither process walks the other's imports again in a collection: a walk writes
        # to each object's header, copying the pages they share (elastic.agent.forkserver_ready).
        preload = _preload(modules)
        gc.freeze()
        pid = os.fork()
        if pid == 0:
            _serve(listener.fileno(), alive_r, alive_w, preload)
        os.close(alive_r)
        server._preload_modules = preload
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid
    logger.info(
        "Forked the worker fork server in %.3f s; it is importing %s.",
        time.monotonic() - started,
        ", ".join(modules),
    )


def _preload(modules: Sequence[str]) -> list[str]:
    """``modules`` for the server to import, :data:`_READY` last (it freezes the heap)."""
    return [*(m for m in modules if m != _READY), _READY]


def _serve(listener_fd: int, alive_r: int, alive_w: int, modules: list[str]) -> NoReturn:
    """The forked server's life: never returns into the agent's code."""
    code = 0
    try:
        os.close(alive_w)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        credentials = sys.modules.get("elastic.etcd.credentials")
        if credentials is not None:
            credentials._env_password = None  # type: ignore[attr-defined]
        forkserver._forkserver.__init__()  # type: ignore[misc]  # no server of its own
        forkserver.main(listener_fd, alive_r, modules)
    except SystemExit as exc:  # its loop ends so when the agent is gone
        code = exc.code if isinstance(exc.code, int) else 0
    except BaseException:  # reported, then the process ends
        code = 1
        with contextlib.suppress(Exception):
            import traceback

            traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
    os._exit(code)


def run_worker(*argv: str) -> None:
    """The agent's entry point in a forked worker: ``python -m WORKER_MODULE ARGV``.

    The worker is a tool (:mod:`elastic_tools`), named here as a command is, never imported
    by the agent itself: only this forked process, which runs it, loads it."""
    worker = importlib.import_module(WORKER_MODULE)
    main, stopped_by_signal = worker.main, worker.stopped_by_signal

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


def _server_pid() -> int | None:
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    return pid if isinstance(pid, int) else None


def server_cold_reason() -> str | None:
    """Why the next start must be cold (checked before each start), or None."""
    drift = sorted(
        k
        for k in set(os.environ) | set(_server_env)
        if os.environ.get(k) != _server_env.get(k) and not k.startswith(_RUNTIME_ONLY)
    )
    if drift:
        return (
            "the agent's environment changed since the fork server started "
            f"({', '.join(drift)}); a fresh worker would import torch under the new one."
        )
    pid = _server_pid()
    if pid is None:
        return None  # not running yet: the first fork starts it with this environment
    try:
        threads = len(os.listdir(f"/proc/{pid}/task"))
        maps = Path(f"/proc/{pid}/maps").read_text()
        fds = []
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                fds.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    except OSError:
        return None  # it ended: the next fork starts a new one
    if threads > 1:
        return f"the fork server runs {threads} threads (forking it could copy a held lock)."
    if "libcuda.so" in maps or any(f.startswith("/dev/nvidia") for f in fds):
        return "the fork server has loaded the CUDA driver (a CUDA context must not be forked)."
    return None


__all__ = [
    "PRELOAD",
    "SCRIPT_PRELOAD",
    "START_METHOD",
    "WORKER_MODULE",
    "enabled",
    "fork_server",
    "run_worker",
    "server_cold_reason",
    "start_server",
]
