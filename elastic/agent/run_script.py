"""``python -m elastic.agent.run_script SCRIPT ARGS`` (or ``-m MODULE ARGS``): a cold worker.

The agent starts a worker that cannot fork warm with this instead of torchrun's
``python -u SCRIPT ARGS``: it installs :func:`elastic.agent.tutorial_check.install_runtime_guard`
and then runs the script as ``python SCRIPT ARGS`` would: a fresh ``__main__`` (``__file__``
absolute, ``__spec__`` None), ``sys.argv`` ``[SCRIPT, *ARGS]`` as given, ``sys.path[0]`` the
script's real directory (``-m``: the cwd; the module run as ``python -m`` runs it), none
of this package's modules in ``sys.modules``. An uncaught exception prints its traceback
and exits 1, as Python would (the frames of this module are left out).
"""

from __future__ import annotations

import importlib.machinery
import os
import runpy
import sys
import types
from collections.abc import Sequence
from pathlib import Path

MODULE = __name__ if __name__ != "__main__" else "elastic.agent.run_script"


def wrap_args(args: Sequence[str]) -> list[str]:
    """torchrun's interpreter arguments (``-u [-m] TARGET ARGS``) through this module."""
    args = list(args)
    flags: list[str] = []
    while args and args[0] == "-u":
        flags.append(args.pop(0))
    return [*flags, "-m", MODULE, *args]


def main(argv: Sequence[str]) -> None:
    """Run ``argv`` (``[SCRIPT, *ARGS]`` or ``["-m", MODULE, *ARGS]``) as Python would."""
    from elastic.agent.tutorial_check import install_runtime_guard

    argv = list(argv)
    if not argv:
        raise SystemExit("usage: python -m elastic.agent.run_script (SCRIPT | -m MODULE) [ARGS]")
    install_runtime_guard()
    _as_if_python_ran(argv)
    # A fresh process: the script's first line finds none of our modules imported (the
    # guard keeps what it needs by reference).
    for name in [n for n in sys.modules if n == "elastic" or n.startswith("elastic.")]:
        del sys.modules[name]
    if argv[0] == "-m":
        sys.argv[:] = argv[1:]  # runpy puts the module's file in argv[0]
        sys.modules.pop("__main__", None)
        runpy._run_module_as_main(argv[1], alter_argv=True)  # type: ignore[attr-defined]
        return
    script = argv[0]
    path = os.path.abspath(script)
    sys.argv[:] = argv
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    exec_as_main(path)


def exec_as_main(path: str) -> None:
    """Run the source file at ``path`` (absolute) as a fresh ``__main__``, as ``python PATH``
    does: ``__file__`` set, ``__spec__`` None, no ``__mp_main__`` left from before."""
    code = compile(Path(path).read_bytes(), path, "exec")
    main_module = types.ModuleType("__main__")
    main_module.__dict__.update(
        __file__=path,
        __cached__=None,
        __builtins__=__builtins__,
        __loader__=importlib.machinery.SourceFileLoader("__main__", path),
    )
    sys.modules["__main__"] = main_module
    sys.modules.pop("__mp_main__", None)
    exec(code, main_module.__dict__)


def _as_if_python_ran(argv: list[str]) -> None:
    """``sys.orig_argv`` as ``python -u SCRIPT ARGS`` has it (without ``-m`` this module)."""
    orig = list(getattr(sys, "orig_argv", []))
    n = len(orig) - len(argv)
    if n >= 2 and orig[n - 2 : n] == ["-m", MODULE] and orig[n:] == argv:
        sys.orig_argv[:] = [*orig[: n - 2], *argv]


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        # Python's own report (sys.excepthook: the script may have set one) and exit code,
        # without the two frames of this module
        tb = exc.__traceback__
        for _ in range(2):
            tb = tb.tb_next if tb is not None and tb.tb_next is not None else tb
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        sys.exit(1)
