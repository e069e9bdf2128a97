"""Shared test helpers: polling with a deadline, node processes, cleanup by PID.

Nodes are started and driven by :class:`elastic.tools.cluster.LocalCluster` (tests wrap
it in ``tests/agent/jobs.py`` and ``tests/rendezvous/nodes.py``).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from elastic.procs import alive as pid_alive  # noqa: F401  (re-exported for the tests)
from elastic.procs import kill as kill_pid  # noqa: F401  (re-exported for the tests)
from elastic.tools.cluster import Node, agent_env, fast_conf  # noqa: F401  (Node: re-exported)

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
# The tests' --rdzv-conf: the fast-failover profile, 60 s to join.
FAST_CONF = fast_conf(join_timeout=60)


def wait_until(predicate: Callable[[], T], timeout: float, what: str, every: float = 0.1) -> T:
    """Poll ``predicate`` until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)


def node_env(**extra: str) -> dict[str, str]:
    """An agent's environment (:func:`agent_env`) that imports this checkout first."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))
    return agent_env(PYTHONPATH=path, **extra)
