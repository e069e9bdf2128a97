"""The checks of a chaos run on a user's script, and its options (no job: milliseconds)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from elastic_tools.chaos.command import options
from elastic_tools.chaos.compound import COMPOUND, compound_schedule
from elastic_tools.chaos.script import CKPT, DDP_SCRIPT, ScriptSpec, ddp_script
from elastic_tools.chaos.script_checks import _ranges, explain, once, stale_reports
from elastic_tools.cli import _parser

LAST = 300


@pytest.mark.parametrize(
    ("name", "code", "step", "problem"),
    [
        ("n1", 0, LAST, None),  # ran to the end
        ("n2", 0, 120, None),  # left: SIGTERM
        ("n3", -9, 80, None),  # killed by us
        ("n3", 0, 80, "was killed with kill -9 but exited 0"),
        ("n1", 0, 200, "exited 0 at step 200 of 300 though nobody stopped it"),  # issue 25
        ("n1", 1, LAST, "exited 1 (neither killed nor stopped)"),
        ("n2", 75, 120, "exited 75"),
        ("n1", None, LAST, "still running at the end"),
    ],
)
def test_every_exit_code_needs_a_reason(
    name: str, code: int | None, step: int, problem: str | None
) -> None:
    why = explain(name, code, step, LAST, killed={"n3"}, left={"n2"})
    assert (why is None) == (problem is None), why
    if problem is not None:
        assert why is not None and problem in why


def test_a_resume_behind_the_newest_step_is_a_step_done_twice() -> None:
    def step(n: int) -> dict:
        return {"kind": "train.step", "step": n}

    fine = [step(1), step(2), {"kind": "recovery.inplace", "step": 2}, step(3)]
    fine += [step(2), {"kind": "ckpt.load", "step": 3}]  # a thawed rank's stale report
    assert once(fine)["ok"] and once(fine)["checks"] == 2
    assert stale_reports([step(2), step(2), step(3)]) == [2]
    redone = [step(5), step(6), {"kind": "recovery.resume", "step": 4, "pid": 9}]
    result = once(redone)
    assert not result["ok"] and "steps 5-6 ran twice" in result["problems"][0]
    # A live node whose lease expired looks frozen to the rendezvous: the group without
    # it resumes from what it holds. Named in the check, and only until the job passes the
    # newest step again.
    expired = {"kind": "node.expired", "node": "n2"}
    false_death = [step(5), step(6), expired, {"kind": "recovery.resume", "step": 4, "pid": 9}]
    result = once(false_death)
    assert result["ok"] and "lease of n2 expired" in result["invariant"]
    later = [*false_death, step(5), step(6), step(7), {"kind": "ckpt.load", "step": 5}]
    assert not once(later)["ok"]
    assert _ranges([1, 2, 3, 7, 9, 10]) == "1-3, 7, 9-10"
    assert _ranges([]) == ""


def test_ours_is_world_size_free_and_its_reference_unpaced() -> None:
    spec = ddp_script(in_place=True, epochs=5)
    assert spec.steps == 5 * 20 and spec.steps_per_epoch == 20
    job = spec.command("/ckpt")
    assert job[0] == str(DDP_SCRIPT) and "--in-place" in job and "--ckpt=/ckpt" in job
    assert {"--norm=group", "--double", "--ledger", "--global-batch-size=12"} <= set(job)
    ref = spec.command("/ref", reference=True)
    assert ref[-2:] == ["--step-delay=0", "--checkpoint-every=1000000"]
    assert "--in-place" not in ddp_script(in_place=False).argv


def test_the_cli_takes_a_script_and_its_arguments(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    argv = ["chaos", "--script", str(script), "--steps", "40", "--compound", "2"]
    opts = options(_parser().parse_args([*argv, "--", "--ckpt", CKPT, "--lr=0.1"]))
    assert isinstance(opts.script, ScriptSpec)
    assert opts.script.command("/c") == [str(script), "--ckpt", "/c", "--lr=0.1"]
    assert opts.script.steps == 40 and opts.compound == 2
    ours = options(_parser().parse_args(["chaos", "--script", "ddp", "--restart"]))
    assert ours.script is not None and "--in-place" not in ours.script.argv
    with pytest.raises(SystemExit):
        options(_parser().parse_args(["chaos", "--script", str(script)]))


def test_the_compound_schedule_repeats_its_round() -> None:
    assert compound_schedule(1) == list(COMPOUND)
    assert compound_schedule(3) == list(COMPOUND) * 3
    assert "freeze_leave_in_save" in COMPOUND and "etcd_freeze_in_save" in COMPOUND


# An agent (its command line names the script), its fork server (a fork of it: the same
# command line) and a worker forked from that server, plus a cold worker it started itself.
_TREE = """
import os, subprocess, sys, time
cold = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", sys.argv[1]])
server = os.fork()
if server == 0:
    worker = os.fork()
    if worker == 0:
        time.sleep(60)
        os._exit(0)
    print(os.getpid(), worker, cold.pid, flush=True)
    time.sleep(60)
    os._exit(0)
time.sleep(60)
"""


@pytest.mark.integration  # a real process tree
def test_the_agents_forked_fork_server_is_not_a_worker(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    from elastic.node.procs import descendants
    from elastic_tools.chaos.script import script_workers

    path = str(tmp_path / "train.py")
    agent = subprocess.Popen([sys.executable, "-c", _TREE, path], stdout=subprocess.PIPE, text=True)
    try:
        assert agent.stdout is not None
        server, worker, cold = map(int, agent.stdout.readline().split())
        # the chaos harness once killed the server as "a worker": every worker died with it
        assert sorted(script_workers(agent.pid, path)) == sorted([worker, cold])
        assert server not in script_workers(agent.pid, path)
    finally:
        for pid in [*descendants(agent.pid), agent.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        agent.wait(30)
