"""The one line an agent prints when a worker failed: node, rank, exit code or signal, cause.

torch's own message for a worker that died without an error file is "To enable traceback
see ...", with no rank, exit code or cause. :func:`describe` reads what torch's
:class:`~torch.distributed.elastic.multiprocessing.errors.ChildFailedError` holds instead:
the first failure's global and local rank, pid, exit code (or the signal that killed it),
the error file's message when the worker wrote one (torch's ``@record``, our checks), and
the last lines of its stderr when torch kept them (``--tee 2`` or ``--redirects 2``: the
newest attempt's ``stderr.log`` in torch's run log directory).
"""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

STDERR_LINES = 3  # the last lines of the worker's stderr the line quotes
_MAX_CHARS = 400  # of the quoted stderr, so the line stays one readable line
_TORCH_NO_TRACEBACK = "To enable traceback see"


class Failure(Protocol):
    """What the line reads of torch's ``ProcessFailure``."""

    local_rank: int
    pid: int
    exitcode: int
    message: str
    timestamp: int


def exit_text(code: int) -> str:
    """``exit code 3``, or ``killed by SIGKILL`` for a negative code (torch's form of a signal)."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}"
    return f"exit code {code}"


def stderr_log(log_dir: str, local_rank: int) -> Path | None:
    """The newest attempt's ``stderr.log`` of ``local_rank`` in torch's run log directory
    (``<log_dir>/attempt_<N>/<local_rank>/stderr.log``), or None."""
    found = []
    for path in Path(log_dir).glob(f"attempt_*/{local_rank}/stderr.log"):
        attempt = path.parent.parent.name.removeprefix("attempt_")
        if attempt.isdigit():
            found.append((int(attempt), path))
    return max(found)[1] if found else None


def stderr_tail(path: Path | None, lines: int = STDERR_LINES) -> list[str]:
    """The last non-empty lines of the file at ``path`` (a worker's stderr), or []."""
    if path is None:
        return []
    try:
        with open(path, "rb") as fp:
            fp.seek(0, os.SEEK_END)
            size = fp.tell()
            fp.seek(max(0, size - 16384))
            text = fp.read().decode(errors="replace")
    except OSError:
        return []
    kept = [line.strip() for line in text.splitlines() if line.strip()]
    return kept[-lines:]


def _cause(failure: Failure) -> str:
    """The worker's own message (its error file), unless it is torch's placeholder."""
    message = (failure.message or "").strip()
    if not message or message.startswith(_TORCH_NO_TRACEBACK):
        return ""
    return message.splitlines()[0]


def first(failures: Mapping[int, Failure]) -> int:
    """The rank that failed first: the agent stops the others of the node with SIGTERM once
    one fails, so a SIGTERM is a victim unless all are; then the earliest, then the lowest
    rank."""
    return min(
        failures,
        key=lambda r: (failures[r].exitcode == -signal.SIGTERM, failures[r].timestamp, r),
    )


def node_label(local_addr: str | None) -> str:
    """This node as the line names it: its address (``--local-addr``, else the host name)
    and the agent's pid (two agents may share a host)."""
    return f"{local_addr or socket.gethostname()} (agent pid {os.getpid()})"


def describe(node: str, failures: Mapping[int, Failure], log_dir: str | None = None) -> str:
    """One line for the first failed worker (:func:`first`) of ``failures`` on ``node``,
    its cause first (the worker's own message, else how it ended)::

        a worker failed: rank 1 killed by SIGKILL (node H, rank 1, local rank 0, pid 123,
        killed by SIGKILL); last stderr: ...
    """
    if not failures:
        return f"a worker failed on node {node}; torch reported no details of it."
    rank = first(failures)
    failure = failures[rank]
    ended = exit_text(failure.exitcode)
    lead = (
        _cause(failure) or f"rank {rank} {ended if failure.exitcode < 0 else 'ended with ' + ended}"
    )
    line = (
        f"a worker failed: {lead} (node {node}, rank {rank}, local rank {failure.local_rank}, "
        f"pid {failure.pid}, {ended})"
    )
    tail = stderr_tail(stderr_log(log_dir, failure.local_rank)) if log_dir else []
    if tail:
        quoted = " | ".join(tail)
        if len(quoted) > _MAX_CHARS:
            quoted = "..." + quoted[-_MAX_CHARS:]
        line += f"; last stderr: {quoted}"
    more = len(failures) - 1
    if more:
        line += f"; {more} more worker{'s' if more > 1 else ''} of this node stopped too"
    return line
