"""A user's script forked from the fork server, made the fresh process torchrun would start.

A user's Python script (``elastic-agent ... train.py ARGS`` or ``-m pkg.mod``, a plain
torchrun-style DDP script, or one on ``elastic.Run``) forks from the agent's fork server
(:mod:`elastic.agent.forkserver`): :class:`PlainScript` is the entrypoint, and the forked
child makes itself the process that ``python -u train.py ARGS`` (torchrun's command) would
have been before it runs the script in a fresh ``__main__`` (``-m``:
:func:`runpy._run_module_as_main`, as ``python -m`` does). A script on ``elastic.Run``
starts the same way (its first start, a joining node's worker, a restart after a failed
in-place re-form); its in-place re-forms then keep that process.

What the forked child makes fresh (tested against the same script under torchrun:
tests/agent/test_warm_plain.py, tests/agent/test_warm_fresh.py):

* environment: exactly the agent's ``os.environ`` at the start (sent with each start)
  plus torch's worker variables (RANK, WORLD_SIZE, MASTER_ADDR, TORCHELASTIC_*, ours),
  without the server's own (``ELASTIC_FORK_SERVER_PID``); the agent's cwd;
* ``sys.argv`` (``[script, *args]``; ``-m``: the module's file), ``sys.orig_argv``,
  ``sys.path[0]`` (the script's real directory; ``-m``: the cwd), ``__file__`` (absolute),
  unbuffered stdout/stderr on the log files torch's agent chose, ``sys.stdin`` on fd 0 (the
  agent's stdin, which the server kept), a session of its own (setsid), signal
  dispositions of a fresh interpreter (SIGTERM: default, so it kills; SIGINT:
  KeyboardInterrupt);
* ``multiprocessing``: a main process of its own, no start method chosen (the script may
  call ``set_start_method("spawn")``; a ``DataLoader(num_workers>0)`` forks as under
  torchrun, so a lambda in its dataset works), no fork server or resource tracker;
* random numbers: Python's ``random``, numpy's global generator (when the server loaded it)
  and torch's default CPU generator seeded from the OS, as a fresh interpreter seeds them:
  distinct per process and start, never the server's state;
* file descriptors: 0-2 only, as torchrun's ``Popen`` passes (the server's pipes, the
  agent's alive pipe and resource tracker, torch's return-value queues are closed; the
  agent collects a forked script's exit instead of a return value:
  :func:`elastic.agent.node.NodeAgent._monitor_workers`);
* the exit: ``sys.exit(n)``/an uncaught exception/KeyboardInterrupt end as in a fresh
  interpreter (n; traceback and 1; death by SIGINT), after non-daemon threads and atexit.
  A script that handles SIGTERM or SIGINT itself and then ends with 0 dies by that
  signal instead (the agent that sent it waits for the process to end).

Known differences that remain: ``os.getppid()`` is the fork server, not the agent (the
agent's pid is ``$ELASTIC_SNAPSHOT_OWNER``); ``hash()`` of a str or bytes is the server's
(the same in every worker of a node, where fresh processes differ unless
``PYTHONHASHSEED`` is set); the worker dies with the agent (``kill -9`` of the agent leaves
none behind); ``signal.signal`` is wrapped to notice a handled SIGTERM/SIGINT
(``getsignal`` returns the script's own handler); modules the server imported (torch) are
already in ``sys.modules`` when the script's first line runs.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import io
import itertools
import os
import random
import runpy
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

from elastic import env

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# A fresh interpreter ignores these; every other catchable signal has its default action
# (SIGINT: KeyboardInterrupt).
_IGNORED_AT_START = (signal.SIGPIPE, signal.SIGXFSZ)


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
        from elastic.node.procs import die_with_parent

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
        sys.orig_argv[:] = [self.executable, *self.cold_args, *argv]
        _fresh_stdio()
        _fresh_signals()
        _fresh_multiprocessing()
        _fresh_descriptors()
        _fresh_random()

    def _run(self) -> None:
        _install_tutorial_guard()
        if self.module:
            runpy._run_module_as_main(self.target, alter_argv=True)  # type: ignore[attr-defined]
            return
        from elastic.agent.run_script import exec_as_main

        exec_as_main(os.path.abspath(self.target))


def _install_tutorial_guard() -> None:
    """A classic-tutorial script (it spawns its own ranks) fails fast with one sentence."""
    try:
        from elastic.agent import tutorial_check
    except ImportError:
        return
    tutorial_check.install_runtime_guard()


_stopped_by: int | None = None  # a stop signal the script's own handler received


def _fresh_stdio() -> None:
    """Unbuffered stdout and stderr on fds 1 and 2, as ``python -u`` makes them, and stdin
    on fd 0 (multiprocessing moved it to a /dev/null of its own)."""
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
    old_in = sys.stdin
    with contextlib.suppress(OSError):
        stdin = open(  # noqa: SIM115  (it is the process's stdin: never closed here)
            0,
            encoding=getattr(old_in, "encoding", None),
            errors=getattr(old_in, "errors", None),
            closefd=False,
        )
        sys.stdin = stdin
        setattr(sys, "__stdin__", stdin)  # noqa: B010  (typed Final, yet rebound at startup)


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
    """``multiprocessing`` in the script sees a main process with no start method chosen,
    no fork server and no resource tracker of its own yet, as in a fresh interpreter."""
    from multiprocessing import context, forkserver, process, resource_tracker

    from elastic.agent.forkserver_init import MAIN_PROCESS

    process._current_process = MAIN_PROCESS()  # type: ignore[attr-defined]
    process._parent_process = None  # type: ignore[attr-defined]
    process._children = set()  # type: ignore[attr-defined]
    process._process_counter = itertools.count(1)  # type: ignore[attr-defined]
    process.ORIGINAL_DIR = os.getcwd()  # type: ignore[attr-defined]
    # torch's start set the forkserver method (multiprocessing's spawn.prepare): unset it
    context._default_context._actual_context = None  # type: ignore[attr-defined]
    server: Any = forkserver._forkserver
    server.__init__()  # the script's own server, if it asks for one (its fds: closed below)
    tracker: Any = resource_tracker._resource_tracker
    tracker.__init__()  # its own tracker when it needs one


def _fresh_descriptors() -> None:
    """Close every descriptor above 2: a fresh ``python -u`` from torchrun's ``Popen`` has
    none. Those inherited here are the server's and multiprocessing's pipes (the objects
    that hold them are reset above, hold them with ``closefd=False``, or live in torch's
    wrapper frame, which never returns: :func:`_finish` ends the process)."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2:
            with contextlib.suppress(OSError):
                os.close(fd)


def _fresh_random() -> None:
    """Seed the global random generators from the OS, as a fresh interpreter seeds them (a
    fork copies the server's state: every worker would draw the same numbers)."""
    random.seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()


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
    """End as a fresh interpreter does: threads, atexit, flushed output, then the code.

    Never returns: torch's wrapper would hand the agent a return value over a queue whose
    descriptor :func:`_fresh_descriptors` closed; the agent reads the exit code instead.
    """
    with contextlib.suppress(Exception):
        threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)  # C stdio, as exit() flushes it
    if sig is None and code == 0 and _stopped_by is not None:
        sig = _stopped_by  # the agent is stopping us: it waits for the process to end
    if sig is not None:
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(code & 0xFF)


__all__ = ["PlainScript"]
