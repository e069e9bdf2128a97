"""``elastic chaos``'s options reach the run unchanged, and chaos never imports the CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from elastic_tools.chaos.command import options
from elastic_tools.cli import _parser


def test_the_cli_options_become_the_runs_options(tmp_path: Path) -> None:
    argv = ["chaos", "--minutes", "2", "--seed", "5", "--runs-dir", str(tmp_path)]
    args = _parser().parse_args([*argv, "--every", "8", "--kinds", "join,leave,", "--json-only"])
    opts = options(args)
    assert (opts.minutes, opts.seed, opts.runs_dir, opts.every_s) == (2.0, 5, tmp_path, 8.0)
    assert opts.kinds == ["join", "leave"]
    assert opts.agents == 3 and opts.secret
    assert options(_parser().parse_args(["chaos"])).kinds is None


def test_kinds_are_checked_and_the_new_kinds_are_among_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = _parser().parse_args(["chaos", "--kinds", "rogue_member,frozen_etcd", "--no-secret"])
    opts = options(args)
    assert opts.kinds == ["rogue_member", "frozen_etcd"] and not opts.secret
    with pytest.raises(SystemExit):
        _parser().parse_args(["chaos", "--kinds", "join,rogue"])
    assert "unknown fault kinds rogue; choose from kill_agent" in capsys.readouterr().err


@pytest.mark.integration
def test_chaos_imports_neither_the_cli_nor_the_other_commands() -> None:
    modules = (
        "command fault injectors invariants job observers plan reference report rogue run stale"
    )
    code = (
        "import sys\n"
        f"for m in {modules.split()!r}: __import__('elastic_tools.chaos.' + m)\n"
        "commands = {'cli', 'demo', 'dashboard', 'timeline', 'status', 'checkpoint'}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'elastic_tools'\n"
        "             and len(m.split('.')) > 1 and m.split('.')[1] in commands))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]", out.stdout
