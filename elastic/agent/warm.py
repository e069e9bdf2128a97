"""Warm worker starts, in three modules (this one keeps the names the launcher imports).

* :mod:`elastic.agent.forkserver`: the agent's fork server (what it preloads, when forking
  it is unsafe, our worker's entry point);
* :mod:`elastic.agent.cold_start`: when a user's script must start cold instead;
* :mod:`elastic.agent.plain_script`: a forked user's script made the fresh process
  torchrun would start.
"""

from __future__ import annotations

from elastic.agent.cold_start import cold_reason, note_cold, preload_for, start_early_for_script
from elastic.agent.forkserver import (
    PRELOAD,
    SCRIPT_PRELOAD,
    START_METHOD,
    enabled,
    fork_server,
    run_worker,
    server_cold_reason,
    start_server,
)
from elastic.agent.plain_script import PlainScript

__all__ = [
    "PRELOAD",
    "SCRIPT_PRELOAD",
    "START_METHOD",
    "PlainScript",
    "cold_reason",
    "enabled",
    "fork_server",
    "note_cold",
    "preload_for",
    "run_worker",
    "server_cold_reason",
    "start_early_for_script",
    "start_server",
]
