"""When a user's script must start cold (a fresh ``python -u``, torchrun's command).

Where a warm start (:mod:`elastic.agent.plain_script`) could differ from a fresh process
it is not made: the agent starts that worker cold, as torchrun would, and logs the reason
once (:func:`note_cold`). Cold when: ``ELASTIC_WARM_START=0``; ``--no-python`` (not Python)
or ``--run-path``; ``$PYTHON_EXEC`` names another interpreter; the agent runs with
interpreter options a fresh ``python -u`` would not have (``-X``, ``-O``, ``-W``, ``-I``
...); the script is not a Python source file (a directory, a zip, a .pyc) or its module is
not found; the script touches ``os.environ``/``putenv`` before its first import of torch
(it means to steer torch's import, which the server already made) (:func:`cold_reason`,
once at the agent's start). And at each start (:func:`elastic.agent.forkserver.server_cold_reason`):
the agent's environment differs from the one the server started with (``TORCHELASTIC_*``
and the inductor cache dir aside: torch's agent sets them, torch reads them at run time);
the server has more than one thread, or has loaded the CUDA driver or opened a GPU device.
For a plain script the server starts once torchrun's options are parsed (they set
OMP_NUM_THREADS), so the first start waits for its imports; restarts are forks.
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import os
import sys
import zipfile
from pathlib import Path

from elastic import env
from elastic.agent.forkserver import SCRIPT_PRELOAD, enabled, fork_server, start_server

logger = logging.getLogger(__name__)

# What a script on elastic.Run imports besides torch: preloaded for it (a plain torchrun
# script gets torch only; a joining node's worker forks once the server's imports are done).
# torch._dynamo: DDP's constructor imports it (2-3 s of CPU with sympy); the checkpoint code
# (DCP, ~1 s) and the commit fence (etcd, grpc: ~0.1 s) are left to Run, which imports them
# before it joins when checkpoints are on.
RUN_PRELOAD = [
    "torch._dynamo",
    "elastic.worker",
]
# What imports the server made: a script that sets the environment before one of these
# means to steer that import.
_PRELOADED_ROOTS = ("torch", "torchvision")
_told: set[str] = set()  # the cold-start reasons already logged

# The options that end an interpreter's own (the program follows them).
_LAST_OPTIONS = ("-m", "-c")
_TAKE_VALUE = ("-X", "-W", "--check-hash-based-pycs")  # their value is the next argument


def note_cold(reason: str) -> None:
    """Log once per reason that workers start cold (fresh processes): at INFO when that is
    asked for (``ELASTIC_WARM_START=0``)."""
    if reason not in _told:
        _told.add(reason)
        expected = reason.startswith(f"${env.WARM_START}")
        level = logging.INFO if expected else logging.WARNING
        logger.log(level, "Starting the workers cold (fresh processes): %s", reason)


def interpreter_options(orig_argv: list[str] | None = None) -> list[str]:
    """The options this interpreter was started with that a fresh ``python -u`` would not
    have (``-X``, ``-O``, ``-W``, ``-I`` ...; ``-u`` is torchrun's own), from
    ``sys.orig_argv``: a worker forked from the server inherits them. Flags the environment
    sets (``PYTHONOPTIMIZE`` ...) are the same for both: a fresh worker gets that environment."""
    argv = sys.orig_argv if orig_argv is None else orig_argv
    options: list[str] = []
    args = iter(argv[1:])
    for arg in args:
        if not arg.startswith("-") or arg.startswith(_LAST_OPTIONS) or arg == "-":
            break  # the program (-m module, -mmodule, -c code, a script, stdin) follows
        if arg != "-u":
            options.append(arg)
        if arg in _TAKE_VALUE:
            options.append(next(args, ""))
    return options


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


def _imports_elastic(source: str) -> bool:
    """Whether the script imports our package anywhere (``import elastic``, ``from elastic``)."""
    try:
        tree = ast.parse(Path(source).read_bytes())
    except (OSError, SyntaxError, ValueError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(
            a.name.split(".")[0] == "elastic" for a in node.names
        ):
            return True
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").split(".")[0] == "elastic"
        ):
            return True
    return False


def preload_for(target: str, module: bool) -> list[str]:
    """What the fork server of a user's script imports: torch, and for a script on
    ``elastic.Run`` what it imports before its first step (:data:`RUN_PRELOAD`); never
    torchvision or our own worker (:data:`elastic.agent.forkserver.PRELOAD`)."""
    source, _ = _script_source(target, module)
    extra = RUN_PRELOAD if source is not None and _imports_elastic(source) else []
    return [*SCRIPT_PRELOAD, *extra]


_NPROC = ("--nproc-per-node", "--nproc_per_node")
_NOT_EARLY = ("-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path")


def start_early_for_script(argv: list[str]) -> bool:
    """Start a user's script's fork server as the agent starts, from the raw arguments; True
    when started. With one process per node it is a fork of the agent once the agent has
    imported torch (:func:`elastic.agent.forkserver.fork_server`: torch is imported once, and
    a joining node's first worker forks sooner); with more, a spawned server that imports
    torch under torchrun's OMP_NUM_THREADS=1 (given to it in advance) beside the agent's own
    import. Only for the plain case (``SCRIPT.py``, an integer ``--nproc-per-node``, nothing
    that makes it cold). A wrong guess is caught before each start (the environment differs: that
    start is cold, :func:`elastic.agent.forkserver.server_cold_reason`)."""
    at = next((i for i, a in enumerate(argv) if a.endswith(".py")), None)
    if at is None or not enabled():
        return False
    options = argv[:at]
    if any(a.partition("=")[0] in _NOT_EARLY for a in options):
        return False
    nproc = "1"
    for i, a in enumerate(options):
        name, eq, value = a.partition("=")
        if name in _NPROC:
            nproc = value if eq else (options[i + 1] if i + 1 < len(options) else "")
    if not nproc.isdigit() or cold_reason(argv[at], False, False, False) is not None:
        return False
    if int(nproc) > 1:  # the server imports torch under torchrun's OMP_NUM_THREADS=1
        start_server(preload_for(argv[at], False), extra_env={"OMP_NUM_THREADS": "1"})
        return True
    fork_server(preload_for(argv[at], False))
    return True


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
    if interpreter_options():
        return (
            "the agent runs with interpreter options (-X, -O, -W ...) that its workers, "
            "fresh `python -u` processes, would not have."
        )
    return None


__all__ = ["RUN_PRELOAD", "cold_reason", "note_cold", "preload_for", "start_early_for_script"]
