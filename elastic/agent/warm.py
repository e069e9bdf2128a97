"""Warm worker starts: fork workers from a server that has already imported torch.

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

Plain scripts. A user's Python script (``elastic-agent ... train.py ARGS`` or ``-m pkg.mod``,
a plain torchrun-style DDP script) forks from the same server:
:class:`PlainScript` is the entrypoint, and the forked child makes itself the process that
``python -u train.py ARGS`` (torchrun's command) would have been before it runs the script
in a fresh ``__main__`` (``-m``: :func:`runpy._run_module_as_main`, as ``python -m`` does).
A script on ``elastic.Run`` starts the same way (its first start, a joining node's worker,
a restart after a failed in-place re-form); its in-place re-forms then keep that process.
The forked child becomes what a fresh process would have been:

* environment: exactly the agent's ``os.environ`` at the start (sent with each start)
  plus torch's worker variables (RANK, WORLD_SIZE, MASTER_ADDR, TORCHELASTIC_*, ours),
  without the server's own (``ELASTIC_FORK_SERVER_PID``); the agent's cwd;
* ``sys.argv`` (``[script, *args]``; ``-m``: the module's file), ``sys.path[0]`` (the
  script's real directory; ``-m``: the cwd), ``__file__`` (absolute), unbuffered
  stdout/stderr on the log files torch's agent chose, a session of its own (setsid),
  signal dispositions of a fresh interpreter (SIGTERM: default, so it kills; SIGINT:
  KeyboardInterrupt), ``multiprocessing`` seeing a main process;
* the exit: ``sys.exit(n)``/an uncaught exception/KeyboardInterrupt end as in a fresh
  interpreter (n; traceback and 1; death by SIGINT), after non-daemon threads and atexit.
  A script that handles SIGTERM or SIGINT itself and then ends with 0 dies by that
  signal instead (torch's agent, which sent it, would otherwise wait up to 30 s for a
  forked worker's return value).

Where a warm start could differ from a fresh process it is not made: the agent starts
that worker cold, as torchrun would, and logs the reason once (:func:`cold_reason`,
:func:`server_cold_reason`). Cold when: ``ELASTIC_WARM_START=0``; ``--no-python`` (not
Python) or ``--run-path``; ``$PYTHON_EXEC`` names another interpreter; the agent runs with
interpreter options a fresh ``python -u`` would not have (``-X``, ``-O``, ``-W``, ``-I`` ...);
the script is not a Python source file (a directory, a zip, a .pyc) or its module is not
found; the script touches ``os.environ``/``putenv`` before its first import of torch (it
means to steer torch's import, which the server already made); at each start, the agent's
environment differs from the one the server started with (``TORCHELASTIC_*`` and the
inductor cache dir aside: torch's agent sets them, torch reads them at run time); the
server has more than one thread, or has loaded the CUDA driver or opened a GPU device (a
CUDA context must never be forked; the server only imports, so this is a check, not
expected). For a plain script the server starts once torchrun's options are parsed (they
set OMP_NUM_THREADS), so the first start waits for its imports; restarts are forks.

Known differences that remain: ``os.getppid()`` is the fork server, not the agent (the
agent's pid is ``$ELASTIC_SNAPSHOT_OWNER``); stdin is /dev/null (a fresh worker shares the
agent's); the worker dies with the agent (``kill -9`` of the agent leaves none behind);
``signal.signal`` is wrapped to notice a handled SIGTERM/SIGINT (``getsignal`` returns
the script's own handler); modules the server imported (torch, torchvision, ours) are
already in ``sys.modules`` when the script's first line runs.
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import importlib.machinery
import importlib.util
import io
import logging
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import traceback
import types
import zipfile
from collections.abc import Callable
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

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
_server_env: dict[str, str] = {}  # the agent's environment when the server started
_told: set[str] = set()  # the cold-start reasons already logged


def enabled() -> bool:
    """Whether warm starts are on (``ELASTIC_WARM_START=0`` turns them off)."""
    return env.flag(env.WARM_START)


def start_server() -> None:
    """Start the fork server now and have it import :data:`PRELOAD` in the background.

    Returns at once; the first fork waits for the imports to finish. Call it
    before anything else starts (the server inherits this process's environment).
    """
    global _started
    if _started:
        return
    _started = True
    _server_env.update(os.environ)
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


# -- plain scripts ------------------------------------------------------------------------

# What imports the server made: a script that sets the environment before one of these
# means to steer that import.
_PRELOADED_ROOTS = ("torch", "torchvision")
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Variables torch's agent sets in its own environment after the server started
# (TORCHELASTIC_SIGNALS_TO_HANDLE, the inductor cache dir): read at run time, not by an
# import; the worker still gets their values of the moment. (The user's environment cannot
# change after the agent started: what changes is the agent's own doing.)
_RUNTIME_ONLY = ("TORCHELASTIC_", "TORCHINDUCTOR_CACHE_DIR")
# A fresh interpreter ignores these; every other catchable signal has its default action
# (SIGINT: KeyboardInterrupt).
_IGNORED_AT_START = (signal.SIGPIPE, signal.SIGXFSZ)


def note_cold(reason: str) -> None:
    """Log once per reason that workers start cold (fresh processes): at INFO when that is
    asked for (``ELASTIC_WARM_START=0``)."""
    if reason not in _told:
        _told.add(reason)
        expected = reason.startswith(f"${env.WARM_START}")
        level = logging.INFO if expected else logging.WARNING
        logger.log(level, "Starting the workers cold (fresh processes): %s", reason)


# The interpreter options a worker inherits from the server (the agent's), all but -u
# (torchrun's, which the forked worker makes for itself), as one printable value.
_FLAGS_PROBE = (
    "import sys; print(repr(sorted((n, getattr(sys.flags, n)) for n in dir(sys.flags) "
    "if not n.startswith(('_', 'n_', 'count', 'index', 'unbuffered')))) "
    "+ repr(sys._xoptions) + repr(sys.warnoptions))"
)


def _fresh_flags(executable: str) -> str | None:
    """The options of a fresh ``python -u`` under this environment, or None."""
    try:
        out = subprocess.run(
            [executable, "-u", "-c", _FLAGS_PROBE], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _own_flags() -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(_FLAGS_PROBE, {})
    return buf.getvalue().strip()


def _script_source(target: str, module: bool) -> tuple[str | None, str]:
    """(the script's source file, "") or (None, why it cannot start warm)."""
    if module:
        try:
            spec = importlib.util.find_spec(target)
        except (ImportError, ValueError) as exc:
            return None, f"the module {target} cannot be found ({exc})."
        if spec is not None and spec.submodule_search_locations is not None:
            spec = importlib.util.find_spec(f"{target}.__main__")
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            return None, f"the module {target} is not a Python source file."
        return spec.origin, ""
    path = Path(target)
    if not path.is_file() or path.suffix in (".pyc", ".pyo") or zipfile.is_zipfile(path):
        return None, f"{target} is not a Python source file (a directory, zip or .pyc)."
    return str(path), ""


def _sets_env_before_torch(source: str) -> bool:
    """Whether the script touches ``os.environ``/``putenv`` before it first imports torch."""
    try:
        tree = ast.parse(Path(source).read_bytes())
    except (OSError, SyntaxError, ValueError):
        return True  # a fresh interpreter reports it the way the script's user expects
    for stmt in tree.body:
        for node in ast.walk(stmt):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            if any(n.split(".")[0] in _PRELOADED_ROOTS for n in names):
                return False
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "putenv"):
                return True
            if isinstance(node, ast.Name) and node.id in ("environ", "putenv"):
                return True
    return False


def cold_reason(target: str, module: bool, no_python: bool, run_path: bool) -> str | None:
    """Why a user's script must start cold (once, at the agent's start), or None."""
    if not enabled():
        return f"${env.WARM_START} turns warm starts off."
    if no_python:
        return "--no-python: the entrypoint is not a Python script."
    if run_path:
        return "--run-path runs the script inside the agent."
    executable = os.environ.get("PYTHON_EXEC", sys.executable)
    if os.path.realpath(executable) != os.path.realpath(sys.executable):
        return f"$PYTHON_EXEC ({executable}) is not the agent's interpreter."
    source, why = _script_source(target, module)
    if source is None:
        return why
    if _sets_env_before_torch(source):
        return f"{source} sets environment variables before it imports torch."
    fresh = _fresh_flags(executable)
    if fresh != _own_flags():
        return (
            "the agent runs with interpreter options (-X, -O, -W ...) that its workers, "
            "fresh `python -u` processes, would not have."
        )
    return None


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


class PlainScript:
    """The entrypoint of a user's script forked from the server (see the module docstring).

    Picklable: each start sends the agent's environment and cwd of that moment, as a
    fresh process would take them; the forked child then runs the script.
    """

    def __init__(self, target: str, module: bool, executable: str) -> None:
        self.target, self.module, self.executable = target, module, executable
        self.__name__ = self.__qualname__ = "plain_script"  # torch names entrypoints
        self._agent_env: dict[str, str] = {}
        self._cwd = ""
        self._server_env: dict[str, str] = {}

    @property
    def cold_args(self) -> list[str]:
        """torchrun's command after the interpreter: ``-u [-m] TARGET``."""
        return ["-u", *(["-m"] if self.module else []), self.target]

    def __getstate__(self) -> dict[str, Any]:
        # In the agent, as the worker starts: what a fresh process would inherit.
        state = dict(self.__dict__)
        state.update(_agent_env=dict(os.environ), _cwd=os.getcwd())
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # In the forked child, before torch's wrapper adds the worker's variables.
        self.__dict__.update(state)
        self._server_env = dict(os.environ)

    def __call__(self, *argv: str) -> None:
        os.setsid()  # torchrun's workers: start_new_session
        server = os.environ.get(env.FORK_SERVER_PID)
        from elastic.procs import die_with_parent

        die_with_parent(parent=int(server) if server else None)
        self._become_fresh(list(argv))
        code, sig = _run_main(self._run)
        _finish(code, sig)

    def _become_fresh(self, argv: list[str]) -> None:
        worker = {k: v for k, v in os.environ.items() if self._server_env.get(k) != v}
        os.environ.clear()
        os.environ.update({**self._agent_env, **worker})
        os.chdir(self._cwd)
        path0 = os.getcwd() if self.module else os.path.dirname(os.path.realpath(self.target))
        sys.path[:] = [path0, *sys.path[1:]]
        sys.argv[:] = ["-m" if self.module else self.target, *argv]
        _fresh_stdio()
        _fresh_signals()
        _fresh_multiprocessing()

    def _run(self) -> None:
        if self.module:
            runpy._run_module_as_main(self.target, alter_argv=True)  # type: ignore[attr-defined]
            return
        path = os.path.abspath(self.target)
        code = compile(Path(path).read_bytes(), path, "exec")
        main = types.ModuleType("__main__")
        main.__dict__.update(
            __file__=path,
            __cached__=None,
            __builtins__=__builtins__,
            __loader__=importlib.machinery.SourceFileLoader("__main__", path),
        )
        sys.modules["__main__"] = main
        sys.modules.pop("__mp_main__", None)
        exec(code, main.__dict__)


_stopped_by: int | None = None  # a stop signal the script's own handler received


def _fresh_stdio() -> None:
    """Unbuffered stdout and stderr on fds 1 and 2, as ``python -u`` makes them."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        with contextlib.suppress(Exception):
            old.flush()
        new = io.TextIOWrapper(
            io.FileIO(fd, "w", closefd=False),
            encoding=getattr(old, "encoding", None),
            errors=getattr(old, "errors", None),
            write_through=True,
        )
        setattr(sys, name, new)
        setattr(sys, f"__{name}__", new)


def _fresh_signals() -> None:
    """A fresh interpreter's dispositions and mask; note a handled SIGTERM/SIGINT."""
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        handler: Any = signal.SIG_IGN if sig in _IGNORED_AT_START else signal.SIG_DFL
        if sig == signal.SIGINT:
            handler = signal.default_int_handler
        with contextlib.suppress(OSError, ValueError):
            signal.signal(sig, handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    original, original_get = signal.signal, signal.getsignal

    def noting(signum: int, handler: Any) -> Any:
        if signum in _STOP_SIGNALS and callable(handler):
            users = handler

            def wrapped(sig: int, frame: Any) -> Any:
                global _stopped_by
                _stopped_by = sig
                return users(sig, frame)

            wrapped._elastic_user = users  # type: ignore[attr-defined]
            handler = wrapped
        previous = original(signum, handler)
        return getattr(previous, "_elastic_user", previous)

    def getsignal(signum: int) -> Any:
        current = original_get(signum)
        return getattr(current, "_elastic_user", current)

    signal.signal, signal.getsignal = noting, getsignal  # type: ignore[assignment]


def _fresh_multiprocessing() -> None:
    """``multiprocessing`` in the script sees a main process, as in a fresh interpreter."""
    from multiprocessing import process, resource_tracker

    from elastic.agent.forkserver_init import MAIN_PROCESS

    process._current_process = MAIN_PROCESS()  # type: ignore[attr-defined]
    process._parent_process = None  # type: ignore[attr-defined]
    process._children = set()  # type: ignore[attr-defined]
    tracker: Any = resource_tracker._resource_tracker
    tracker._fd, tracker._pid = None, None  # its own tracker when it needs one


def _run_main(run: Callable[[], None]) -> tuple[int, int | None]:
    """Run the script as a fresh interpreter's main: (exit code, signal to die by)."""
    code, sig = 0, None
    try:
        run()
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code, sig = 1, signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    return code, sig


def _finish(code: int, sig: int | None) -> None:
    """End as a fresh interpreter does: threads, atexit, flushed output, then the code."""
    with contextlib.suppress(Exception):
        threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if sig is None and code == 0 and _stopped_by is not None:
        sig = _stopped_by  # see the module docstring: the agent is stopping us
    if sig is not None:
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    if code != 0:
        os._exit(code & 0xFF)
    # 0: return to torch's wrapper, which hands the agent the (None) result; a SIGTERM
    # sent by an agent that stops us meanwhile ends the process at once.
    for stop in _STOP_SIGNALS:
        signal.signal(stop, signal.SIG_DFL)


__all__ = [
    "PRELOAD",
    "START_METHOD",
    "PlainScript",
    "cold_reason",
    "enabled",
    "note_cold",
    "run_worker",
    "server_cold_reason",
    "start_server",
]
