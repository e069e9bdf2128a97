"""Structured events as JSON lines: what tests and users must be able to see.

An event is one JSON object per line with at least ``ts`` (unix seconds),
``kind`` and ``pid``. Kinds in use: ``rdzv.round``, ``node.join``,
``node.leave``, ``worker.restart``, ``ckpt.save``, ``ckpt.load``, ``train.step``.
The log file comes from ``$ELASTIC_EVENT_LOG``; appends of one short line are
atomic on POSIX, so many processes may share one file.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from elastic import env

logger = logging.getLogger(__name__)


def emit(kind: str, path: str | os.PathLike[str] | None = None, **fields: Any) -> dict[str, Any]:
    """Record one event to the event log (if configured) and the debug log.

    Args:
        kind: dotted event kind, e.g. ``"ckpt.save"``.
        path: the log file; defaults to ``$ELASTIC_EVENT_LOG``.
        fields: JSON-serialisable details.

    Returns:
        The event as written.
    """
    event = {"ts": round(time.time(), 6), "kind": kind, "pid": os.getpid(), **fields}
    target = path or os.environ.get(env.EVENT_LOG)
    logger.debug("event %s", event)
    if target:
        line = json.dumps(event, default=str, separators=(",", ":")) + "\n"
        fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    return event


def read(path: str | os.PathLike[str], kind: str | None = None) -> list[dict[str, Any]]:
    """Return the events in ``path`` (optionally only one kind), skipping torn lines."""
    events = []
    p = Path(path)
    if not p.exists():
        return events
    for line in p.read_text().splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if kind is None or event.get("kind") == kind:
            events.append(event)
    return events


__all__ = ["emit", "read"]
