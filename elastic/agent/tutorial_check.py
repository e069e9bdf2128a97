"""One sentence instead of a silent hang for a script written for ``mp.spawn``.

The classic DDP tutorial starts its own processes (``torch.multiprocessing.spawn``), sets
``MASTER_ADDR``/``MASTER_PORT`` in the code and passes ``rank=`` and ``world_size=`` to
``init_process_group``. Under ``elastic-agent`` the agent already started the processes and
set those variables, so such a script waits on a store nobody hosts (torch's 30-minute
timeout) or on ranks that never come. :func:`install_runtime_guard`, called in each worker
before the user's script runs (:mod:`elastic.agent.run_script` on a cold start, the fork
server's child on a warm one), makes these calls end the worker at once with one sentence
that says what to change, written where torch's agent reads a worker's error
(``$TORCHELASTIC_ERROR_FILE``), and exit code 2 (bad configuration).

What is refused, against the agent's variables as they were when the guard was installed
(a script that assigns ``os.environ["MASTER_ADDR"]`` itself changes them later):

* ``torch.multiprocessing.spawn`` / ``start_processes``: the agent starts the processes;
* ``init_process_group`` without a ``store``, where the address it would use
  (``MASTER_ADDR``/``MASTER_PORT`` for ``env://``, the host and port of ``tcp://``), the
  ``rank`` or the ``world_size`` differs from the agent's.

torch is never imported here: the patches are made when the script imports
``torch.multiprocessing`` / ``torch.distributed`` (at once when they already are, as in
the fork server), so a script that sets variables before it imports torch keeps its
meaning. ``ELASTIC_TUTORIAL_CHECK=0`` turns the guard off. :func:`scan` finds the same
lines in a script's source without running it.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.abc
import importlib.machinery
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

from elastic import env

GUIDE = "docs/from-the-tutorial.md"
EXIT_CODE = 2  # a worker's "bad configuration" (README: worker exit codes)
_AGENT_VARS = (env.RANK, env.WORLD_SIZE, env.MASTER_ADDR, env.MASTER_PORT)
_MARK = "_elastic_tutorial_check"

_agent: dict[str, str] = {}  # the agent's variables when the guard was installed


class TutorialScriptError(SystemExit):
    """A worker that would hang: ends it with :data:`EXIT_CODE` (a SystemExit, so that a
    script's ``except Exception`` does not swallow it)."""

    def __init__(self, sentence: str) -> None:
        super().__init__(EXIT_CODE)
        self.sentence = sentence

    def __str__(self) -> str:
        return self.sentence


def install_runtime_guard() -> None:
    """Record the agent's variables and patch ``torch.multiprocessing.spawn`` /
    ``start_processes`` and ``torch.distributed.init_process_group`` in this process (now if
    imported, else when the script imports them). Idempotent; a no-op when
    ``$ELASTIC_TUTORIAL_CHECK`` is off or this process was not started by an agent."""
    if not env.flag(env.TUTORIAL_CHECK) or env.RUN_ID not in os.environ:
        return
    _agent.clear()
    _agent.update({k: os.environ[k] for k in _AGENT_VARS if k in os.environ})
    for name, patch in _PATCHES.items():
        module = sys.modules.get(name)
        if module is not None:
            patch(module)
    if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


# -- the checks: pure functions of (the call, the agent's values, the environment) ----------


def spawn_sentence(name: str) -> str:
    """What to change when a worker calls ``torch.multiprocessing.<name>``."""
    return (
        f"This worker called torch.multiprocessing.{name}, but under elastic-agent the agent "
        "starts one process per --nproc-per-node itself: call your training function once, "
        "without mp.spawn, take the rank from os.environ['RANK'] and the device from "
        f"os.environ['LOCAL_RANK'] (see {GUIDE})."
    )


def init_sentence(
    kwargs: dict[str, Any], agent: dict[str, str], environ: dict[str, str] | Any
) -> str | None:
    """Why ``init_process_group(**kwargs)`` would not join the agent's group, or None.

    ``agent``: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT as the agent set them;
    ``environ``: the environment at the call (``env://`` reads it)."""
    if kwargs.get("store") is not None:
        return None  # a store of the caller's own making (elastic's in-place groups)
    problems: list[str] = []
    method = kwargs.get("init_method") or "env://"
    parts = urlsplit(str(method))
    if parts.scheme == "env":
        addr, port = environ.get(env.MASTER_ADDR), environ.get(env.MASTER_PORT)
    elif parts.scheme == "tcp":
        addr, port = parts.hostname, str(parts.port) if parts.port else None
    else:
        addr = port = None  # file:// and friends: no address to compare
    if addr is not None and env.MASTER_ADDR in agent and addr != agent[env.MASTER_ADDR]:
        problems.append(f"MASTER_ADDR {addr} (the agent's: {agent[env.MASTER_ADDR]})")
    if port is not None and env.MASTER_PORT in agent and port != agent[env.MASTER_PORT]:
        problems.append(f"MASTER_PORT {port} (the agent's: {agent[env.MASTER_PORT]})")
    for arg, var in (("rank", env.RANK), ("world_size", env.WORLD_SIZE)):
        value = kwargs.get(arg)
        if value is None or value == -1:
            value = environ.get(var) if parts.scheme == "env" else None
        if value is not None and var in agent and str(value) != agent[var]:
            problems.append(f"{arg} {value} (the agent's: {agent[var]})")
    if not problems:
        return None
    return (
        "init_process_group would wait forever on a group elastic-agent did not form: it got "
        f"{', '.join(problems)}; delete the lines that set MASTER_ADDR/MASTER_PORT and call "
        "init_process_group(backend) without rank= and world_size=: the agent sets all four "
        f"(see {GUIDE})."
    )


# -- refusing ------------------------------------------------------------------------------


def refuse(sentence: str) -> TutorialScriptError:
    """Record ``sentence`` where torch's agent reads a worker's error (else print it) and
    return the exception that ends the worker."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    written = False
    if path:
        try:
            Path(path).write_text(json.dumps({"message": sentence, "timestamp": int(time.time())}))
            written = True
        except OSError:
            pass
    if not written:
        print(f"elastic: error: {sentence}", file=sys.stderr, flush=True)
    return TutorialScriptError(sentence)


def _guard_spawn(module: ModuleType) -> None:
    for name in ("spawn", "start_processes"):
        original = getattr(module, name, None)
        if callable(original) and not getattr(original, _MARK, False):
            setattr(module, name, _refusing(name, original))


def _refusing(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise refuse(spawn_sentence(name))

    setattr(refused, _MARK, True)
    return refused


def _guard_init(module: ModuleType) -> None:
    original = getattr(module, "init_process_group", None)
    if not callable(original) or getattr(original, _MARK, False):
        return
    import inspect

    try:
        signature: inspect.Signature | None = inspect.signature(original)
    except (TypeError, ValueError):
        signature = None

    @functools.wraps(original)
    def checked(*args: Any, **kwargs: Any) -> Any:
        named = dict(kwargs)
        if signature is not None:
            with contextlib.suppress(TypeError):  # torch's own call reports bad arguments
                named = dict(signature.bind_partial(*args, **kwargs).arguments)
        sentence = init_sentence(named, _agent, os.environ)
        if sentence is not None:
            raise refuse(sentence)
        return original(*args, **kwargs)

    setattr(checked, _MARK, True)
    module.init_process_group = checked  # type: ignore[attr-defined]
    # `from torch.distributed.distributed_c10d import init_process_group` after this point
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is not None and getattr(c10d, "init_process_group", None) is original:
        c10d.init_process_group = checked  # type: ignore[attr-defined]


_PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "torch.multiprocessing": _guard_spawn,
    "torch.multiprocessing.spawn": _guard_spawn,
    "torch.distributed": _guard_init,
}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches a module of :data:`_PATCHES` right after its own code ran."""

    def __init__(self) -> None:
        self._finding: set[str] = set()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        patch = _PATCHES.get(fullname)
        if patch is None or fullname in self._finding:
            return None
        self._finding.add(fullname)
        try:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        finally:
            self._finding.discard(fullname)
        loader = spec.loader if spec is not None else None
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


# -- the same, read from the source --------------------------------------------------------


def scan(path: str | os.PathLike[str]) -> str | None:
    """The first line of a script that would hang under the agent, as one sentence
    (``FILE:LINE: ...``), or None. Reads the source only; a file that does not parse is
    None (Python reports it when the worker starts)."""
    try:
        source = Path(path).read_text(encoding="utf-8")
        tree = ast.parse(source, str(path))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    found = []  # (spawn first, line, sentence): the spawn is what the user must change first
    for node in ast.walk(tree):
        what = _suspect(node)
        if what is not None:
            found.append((not what.startswith("calls"), getattr(node, "lineno", 0), what))
    if not found:
        return None
    _, line, what = min(found)
    return f"{path}:{line}: {what}"


def _suspect(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name in ("spawn", "start_processes") and _mentions_mp(func):
            return (
                f"calls {name}: under elastic-agent the agent starts the processes; call "
                f"the training function once instead (see {GUIDE})."
            )
    if isinstance(node, ast.Assign):
        for target in node.targets:
            key = _environ_key(target)
            if key in (env.MASTER_ADDR, env.MASTER_PORT):
                return (
                    f"sets {key}: under elastic-agent the agent sets it; delete the line "
                    f"(see {GUIDE})."
                )
    return None


def _mentions_mp(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):  # from torch.multiprocessing import spawn
        return True
    text = ast.unparse(func)
    return "mp." in text or "multiprocessing" in text


def _environ_key(target: ast.expr) -> str | None:
    if isinstance(target, ast.Subscript) and "environ" in ast.unparse(target.value):
        key = target.slice
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            return key.value
    return None


__all__ = [
    "EXIT_CODE",
    "TutorialScriptError",
    "init_sentence",
    "install_runtime_guard",
    "refuse",
    "scan",
    "spawn_sentence",
]
