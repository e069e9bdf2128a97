"""Warm starts of a plain torchrun-style script (no elastic.Run): real agents, real etcd.

Two single-node jobs run side by side with the same script (tests/scripts/plain_ddp.py,
2 local ranks): one warm, one that must start cold (its agent runs with ``-X
faulthandler``, an interpreter option a fresh worker would not have). The cold one is the
reference: a warm worker sees what it sees (environment, argv, cwd, sys.path[0],
__file__), and each gets the same kill -9, SIGTERM and exit code.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastic.etcd.server import EtcdServer
from elastic.node.procs import kill
from elastic_tools.harness.cluster import AgentOptions, LocalCluster
from tests.helpers import REPO, node_env, wait_until

SCRIPT = "tests/scripts/plain_ddp.py"  # relative, as a user types it
# What differs between two runs by nature: ports, run ids, the agent's pid and files.
PER_RUN = {
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_ERROR_FILE",
    "ELASTIC_CHANNEL",
    "ELASTIC_SNAPSHOT_OWNER",
    "ELASTIC_FENCE",
    "ELASTIC_EVENT_LOG",
    "ELASTIC_JOB_DIR",  # <root>/<run id>
    "TORCHELASTIC_RESTART_COUNT",  # compared per generation below
    # set in the agent's own environment by torch as it logs a forked worker's failure
    # (a cold start from that agent would inherit it too): the agents differ, not the starts
    "TORCHINDUCTOR_CACHE_DIR",
}
COLD_LINE = "Starting the workers cold (fresh processes): the agent runs with interpreter options"


class Job:
    def __init__(
        self, tmp: Path, endpoint: str, name: str, command: tuple[str, ...], nproc: int
    ) -> None:
        self.out = tmp / name / "out"
        self.out.mkdir(parents=True)
        self.stop = tmp / name / "stop"
        self.nproc = nproc
        options = AgentOptions(nnodes="1", nproc=nproc, max_restarts=2, command=command)
        self.cluster = LocalCluster(
            tmp / name,
            endpoint=endpoint,
            options=options,
            env=node_env(LOGLEVEL="INFO"),
            cwd=REPO,
            script=[SCRIPT, str(self.out), "--stop-file", str(self.stop), "--exit-code", "3"],
        )
        self.node = self.cluster.start("n1")

    def starts(self, restart: int) -> list[dict[str, Any]]:
        found = []
        for p in self.out.glob("start-*.json"):
            with contextlib.suppress(json.JSONDecodeError):  # still being written
                found.append(json.loads(p.read_text()))
        return sorted((s for s in found if s["restart"] == restart), key=lambda s: s["env"]["RANK"])

    def wait_generation(self, restart: int) -> list[dict[str, Any]]:
        def all_of_them() -> list[dict[str, Any]]:
            gen = self.starts(restart)
            return gen if len(gen) == self.nproc else []

        return wait_until(all_of_them, 240, f"the workers of restart {restart} ({self.node.log})")


# One process per node: the fork server is a fork of the agent once it has imported torch;
# two: a spawned server that imports torch under torchrun's OMP_NUM_THREADS=1.
@pytest.fixture(params=[1, 2], ids=["forked-server", "spawned-server"])
def jobs(
    request: pytest.FixtureRequest, tmp_path: Path, etcd: EtcdServer
) -> Iterator[tuple[Job, Job]]:
    python, nproc = sys.executable, request.param
    warm = Job(tmp_path, etcd.endpoint, "warm", (python, "-m", "elastic.agent.launch"), nproc)
    cold = Job(
        tmp_path,
        etcd.endpoint,
        "cold",
        (python, "-X", "faulthandler", "-m", "elastic.agent.launch"),
        nproc,
    )
    yield warm, cold
    for job in (warm, cold):
        job.cluster.close()


def assert_warm(job: Job, gen: list[dict[str, Any]]) -> None:
    from elastic.node.procs import children

    server = gen[0]["ppid"]
    assert server != job.node.pid, "the worker's parent is the agent: a cold start"
    assert all(s["ppid"] == server for s in gen)
    assert server in children(job.node.pid), "the worker's parent is not the agent's fork server"
    assert all("torch" in s["preloaded"] for s in gen), "torch was not imported before line 1"
    # the server's imports are frozen out of the worker's collections
    # (elastic.agent.forkserver_ready)
    assert all(s["gc_frozen"] > 100_000 for s in gen), [s["gc_frozen"] for s in gen]


def assert_same_as_cold(warm: dict[str, Any], cold: dict[str, Any]) -> None:
    warm_env = {k: v for k, v in warm["env"].items() if k not in PER_RUN}
    cold_env = {k: v for k, v in cold["env"].items() if k not in PER_RUN}
    assert warm_env == cold_env
    for key in ("cwd", "path0", "file", "sigterm_default", "signals", "sid_is_pid", "gc_enabled"):
        assert warm[key] == cold[key], key
    assert warm["argv"][0] == cold["argv"][0] == SCRIPT
    assert warm["argv"][2:] != [] and warm["argv"][2] == cold["argv"][2] == "--stop-file"


@pytest.mark.slow
def test_plain_script_starts_warm_and_behaves_as_a_fresh_process(jobs: tuple[Job, Job]) -> None:
    warm, cold = jobs
    # first start
    w0, c0 = warm.wait_generation(0), cold.wait_generation(0)
    assert_warm(warm, w0)
    assert all(s["ppid"] == cold.node.pid and s["preloaded"] == [] for s in c0), "not cold"
    assert all(s["gc_enabled"] and s["gc_frozen"] == 0 for s in c0)
    for w, c in zip(w0, c0, strict=True):
        assert_same_as_cold(w, c)
    # kill -9 of a worker: restarted, warm again
    for gen in (w0, c0):
        kill(gen[-1]["pid"], signal.SIGKILL)
    w1, c1 = warm.wait_generation(1), cold.wait_generation(1)
    assert_warm(warm, w1)
    assert {s["pid"] for s in w1}.isdisjoint(s["pid"] for s in w0)
    for w, c in zip(w1, c1, strict=True):
        assert_same_as_cold(w, c)
    # SIGTERM to a worker kills it (default disposition), as for a fresh process
    for gen in (w1, c1):
        kill(gen[0]["pid"], signal.SIGTERM)
    w2 = warm.wait_generation(2)
    cold.wait_generation(2)
    assert_warm(warm, w2)
    for job in (warm, cold):
        assert "failed (exitcode: -15)" in job.node.output(), job.node.log
    # the script's exit code reaches the agent (no restarts left: the agent fails)
    for job in (warm, cold):
        job.stop.touch()
    codes = [job.node.wait(120) for job in (warm, cold)]
    assert codes[0] == codes[1] != 0
    for job in (warm, cold):
        assert "failed (exitcode: 3)" in job.node.output(), job.node.log
    assert cold.node.output().count(COLD_LINE) == 1
    assert COLD_LINE not in warm.node.output()
    assert "Starting the workers cold" not in warm.node.output()


# -- the rules and the exit, without an agent ----------------------------------------------


@pytest.mark.integration
def test_cold_reasons_name_what_is_unsafe(tmp_path: Path) -> None:
    from elastic.agent import cold_start as warm

    steers = tmp_path / "steers.py"
    steers.write_text("import os\nos.environ['OMP_NUM_THREADS'] = '4'\nimport torch\n")
    fine = tmp_path / "fine.py"
    fine.write_text("import os\nimport torch\nos.environ['X'] = '1'\n")
    assert warm.cold_reason(str(fine), False, False, False) is None
    reason = warm.cold_reason(str(steers), False, False, False)
    assert reason is not None and "before it imports torch" in reason
    reason = warm.cold_reason(str(tmp_path), False, False, False)
    assert reason is not None and "not a Python source file" in reason
    reason = warm.cold_reason("no_such_module_here", True, False, False)
    assert reason is not None and "no_such_module_here" in reason
    on_run = tmp_path / "on_run.py"
    on_run.write_text("import torch\n\ndef main():\n    from elastic import Run\n")
    assert warm.cold_reason(str(on_run), False, False, False) is None  # Run scripts too
    reason = warm.cold_reason(str(fine), False, True, False)
    assert reason is not None and "--no-python" in reason


EXIT = """
import os, signal, sys
from elastic.agent import plain_script as warm
warm._fresh_signals()
{body}
"""


def _exit_of(body: str) -> Any:
    import subprocess

    argv = [sys.executable, "-c", EXIT.format(body=body)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO)


@pytest.mark.integration
def test_a_forked_script_ends_as_a_fresh_interpreter() -> None:
    # a handled SIGTERM, then exit 0: dies by SIGTERM (the agent that sent it must not wait)
    handled = _exit_of(
        "signal.signal(signal.SIGTERM, lambda s, f: None)\n"
        "assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "warm._finish(*warm._run_main(lambda: None))\n"
        "print('returned')"
    )
    assert handled.returncode == -signal.SIGTERM and "returned" not in handled.stdout
    # exit 0 without a signal: the process ends (the agent reads its exit code), after
    # atexit and with its output flushed
    clean = _exit_of(
        "import atexit\n"
        "atexit.register(lambda: print('atexit ran'))\n"
        "warm._finish(*warm._run_main(lambda: print('done', end='')))\n"
        "print('returned')"
    )
    assert clean.returncode == 0 and clean.stdout == "doneatexit ran\n"
    interrupted = _exit_of(
        "def f():\n    raise KeyboardInterrupt\nwarm._finish(*warm._run_main(f))"
    )
    assert interrupted.returncode == -signal.SIGINT and "KeyboardInterrupt" in interrupted.stderr
    message = _exit_of("warm._finish(*warm._run_main(lambda: sys.exit('bad config')))")
    assert message.returncode == 1 and "bad config" in message.stderr
    code = _exit_of("warm._finish(*warm._run_main(lambda: sys.exit(7)))")
    assert code.returncode == 7
    crash = _exit_of("def f():\n    raise ValueError('boom')\nwarm._finish(*warm._run_main(f))")
    assert crash.returncode == 1 and "ValueError: boom" in crash.stderr


def test_a_scripts_fork_server_preloads_neither_torchvision_nor_our_worker(tmp_path: Path) -> None:
    from elastic.agent import cold_start, forkserver

    plain = tmp_path / "plain.py"
    plain.write_text("import torch\nimport torch.distributed as dist\n")
    on_run = tmp_path / "on_run.py"
    on_run.write_text("import torch\n\ndef main():\n    from elastic import Run\n")
    assert cold_start.preload_for(str(plain), False) == forkserver.SCRIPT_PRELOAD
    with_run = cold_start.preload_for(str(on_run), False)
    assert with_run == [*forkserver.SCRIPT_PRELOAD, *cold_start.RUN_PRELOAD]
    for preload in (cold_start.preload_for(str(plain), False), with_run):
        assert "torchvision" not in preload and forkserver.WORKER_MODULE not in preload
    assert "torchvision" in forkserver.PRELOAD  # our worker's server: its dataset needs it


@pytest.mark.integration  # the interpreter-options probe runs a python
def test_a_scripts_fork_server_starts_as_the_agent_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from elastic.agent import cold_start

    started: list[tuple[str, list[str], dict[str, str] | None]] = []
    monkeypatch.setattr(
        cold_start,
        "start_server",
        lambda m, extra_env=None: started.append(("spawned", m, extra_env)),
    )
    monkeypatch.setattr(cold_start, "fork_server", lambda m: started.append(("forked", m, None)))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    agent = ["--nnodes=1:3", "--nproc-per-node", "2"]
    assert cold_start.start_early_for_script([*agent, SCRIPT, "out"])
    # torchrun sets OMP_NUM_THREADS=1 for 2 processes once its options are parsed: a
    # spawned server imports torch under it
    preload = cold_start.preload_for(SCRIPT, False)
    assert started == [("spawned", preload, {"OMP_NUM_THREADS": "1"})]
    # one process: a fork of the agent, which has imported torch
    assert cold_start.start_early_for_script(["--nnodes=1:3", SCRIPT, "out"])
    assert started[1:] == [("forked", preload, None)] and "torch" in sys.modules
    assert not cold_start.start_early_for_script(["--nproc-per-node=auto", SCRIPT])
    assert not cold_start.start_early_for_script(["--no-python", SCRIPT])
    assert not cold_start.start_early_for_script(["-m", "pkg.mod"])
    assert len(started) == 2
