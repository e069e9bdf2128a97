"""The interpreter options that make a warm start differ from a fresh ``python -u``."""

from __future__ import annotations

import gc
import sys

import pytest

from elastic.agent import forkserver
from elastic.agent.cold_start import interpreter_options

PY = "/usr/bin/python3"


@pytest.mark.parametrize(
    ("argv", "options"),
    [
        ([PY, "-m", "elastic.agent.launch", "-X", "x"], []),  # the agent's own arguments
        ([PY, "-u", "-m", "elastic.agent.launch"], []),  # torchrun's -u: a fresh worker's own
        ([PY, "/venv/bin/elastic-agent", "-O"], []),  # a console script
        ([PY, "-mpytest", "-X", "dev"], []),
        ([PY, "-c", "import x", "-W"], []),
        ([PY, "-", "-O"], []),  # the program from stdin
        ([PY, "-X", "faulthandler", "-m", "elastic.agent.launch"], ["-X", "faulthandler"]),
        ([PY, "-W", "error", "-O", "-m", "x"], ["-W", "error", "-O"]),
        ([PY, "-Xdev", "script.py"], ["-Xdev"]),
        ([PY, "-O", "-u", "-m", "x"], ["-O"]),
        ([PY, "-uB", "-m", "x"], ["-uB"]),  # -B rides with -u
        ([PY, "-I", "script.py"], ["-I"]),
        ([PY, "--check-hash-based-pycs", "always", "s.py"], ["--check-hash-based-pycs", "always"]),
    ],
)
def test_options_a_fresh_interpreter_would_not_have(argv: list[str], options: list[str]) -> None:
    assert interpreter_options(argv) == options


def test_this_interpreter_is_read_from_its_own_command_line() -> None:
    assert interpreter_options() == interpreter_options(sys.orig_argv)


def test_fork_server_gives_the_garbage_collector_back_when_it_cannot_fork(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The collector is off only while the agent imports torch and forks its server."""

    def no_fork(modules: object) -> None:
        assert not gc.isenabled()  # off for the import and the fork
        raise OSError("fork failed")

    monkeypatch.setattr(forkserver, "_started", False)
    monkeypatch.setattr(forkserver, "_fork", no_fork)
    assert gc.isenabled()
    with pytest.raises(OSError, match="fork failed"):
        forkserver.fork_server(["torch"])
    assert gc.isenabled()
