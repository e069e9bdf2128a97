"""Shared test helpers: polling with a deadline, node processes, cleanup by PID.

Nodes are started and driven by :class:`elastic_tools.harness.cluster.LocalCluster` (tests wrap
it in ``tests/agent/jobs.py`` and ``tests/rendezvous/nodes.py``, or use
:func:`local_cluster` and :func:`run_node`). A test of the agent's own command line
builds it with :func:`agent_argv` from :class:`~elastic_tools.harness.cluster.AgentOptions`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from elastic.node.procs import alive as pid_alive  # noqa: F401  (re-exported for the tests)
from elastic.node.procs import kill as kill_pid  # noqa: F401  (re-exported for the tests)
from elastic_tools.harness.cluster import (  # noqa: F401  (Node: re-exported)
    AgentOptions,
    LocalCluster,
    Node,
    agent_env,
    fast_conf,
    poll,
)

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
# The ``elastic-agent`` console script of this venv (absent when the package is not installed).
ELASTIC_AGENT = Path(PYTHON).with_name("elastic-agent")
# The tests' --rdzv-conf: the fast-failover profile, 60 s to join.
FAST_CONF = fast_conf(join_timeout=60)


def wait_until(predicate: Callable[[], T], timeout: float, what: str, every: float = 0.1) -> T:
    """Poll ``predicate`` until it returns something truthy; fail naming ``what``."""
    return poll(
        predicate,
        timeout,
        every,
        timed_out=lambda: AssertionError(f"timed out after {timeout} s waiting for {what}"),
    )


def node_env(**extra: str) -> dict[str, str]:
    """An agent's environment (:func:`agent_env`) that imports this checkout first."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))
    return agent_env(PYTHONPATH=path, **extra)


def run_process(
    argv: Sequence[str], timeout: float = 120, **extra_env: str
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` to its end in this checkout (:func:`node_env` with ``extra_env``, in
    ``REPO``), capturing its output."""
    environ = node_env(**extra_env)
    return subprocess.run(
        list(argv), capture_output=True, text=True, timeout=timeout, env=environ, cwd=REPO
    )


def agent_argv(
    worker: Sequence[str],
    *,
    endpoint: str = "127.0.0.1:1",
    run_id: str = "x",
    console_script: bool = False,
    **options: Any,
) -> list[str]:
    """An agent's command line running ``worker``: :meth:`AgentOptions.argv` with the
    fields ``options``. The default endpoint has nothing listening (for tests of the
    command line); ``console_script`` starts the ``elastic-agent`` script when this venv
    has it (else ``python -m elastic.agent.launch``, which it runs)."""
    if console_script and ELASTIC_AGENT.exists():
        options["command"] = (str(ELASTIC_AGENT),)
    return AgentOptions(**options).argv(endpoint, run_id, worker)


def local_cluster(
    run_dir: Path,
    endpoint: str,
    run_id: str,
    environ: Mapping[str, str] | None = None,
    **options: Any,
) -> LocalCluster:
    """Agents of this checkout on ``endpoint``: ``options`` are :class:`AgentOptions`
    fields, ``environ`` the agents' environment (default :func:`node_env`), run in
    ``REPO``. Use it in a ``with`` block: every process it starts dies at its end."""
    return LocalCluster(
        run_dir,
        run_id,
        endpoint,
        options=AgentOptions(**options),
        env=node_env() if environ is None else environ,
        cwd=REPO,
    )


def run_node(
    cluster: LocalCluster,
    worker: Sequence[str],
    timeout: float,
    name: str = "node",
    **start: Any,
) -> tuple[int, str]:
    """Start node ``name`` running ``worker`` (``start``: more arguments of
    :meth:`LocalCluster.start`), wait for its agent to exit and return its exit code and
    output (stdout and stderr); fail with that output if it runs past ``timeout`` s."""
    node = cluster.start(name, worker=worker, **start)
    try:
        code = node.wait(timeout)
    except subprocess.TimeoutExpired:
        tail = node.output()[-3000:]
        raise AssertionError(f"node {name} still ran after {timeout} s:\n{tail}") from None
    return code, node.output()


def run_ranks(code: str, *args: str, world: int = 2, timeout: float = 150) -> list[Any]:
    """Run ``python -c code RANK *args`` for ranks 0..world-1 at once (this checkout on the
    path, one thread each); every rank must exit 0 and print its result as JSON on its last
    line, which is returned in rank order."""
    import json

    environ = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(rank), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=environ,
            cwd=REPO,
        )
        for rank in range(world)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.splitlines()[-1]))
    return results
