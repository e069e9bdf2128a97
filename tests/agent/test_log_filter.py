"""torch's error log for a worker exit: a re-form (exit 75) is one INFO line, a failure stays."""

from __future__ import annotations

import logging

from elastic.agent.node import _ReformIsNotAFailure
from elastic.node.reform import EXIT_CODE as REFORM_EXIT_CODE

MSG = "failed (exitcode: %s) local_rank: %s (pid: %s) of fn: %s (start_method: %s)"


def record(code: int) -> logging.LogRecord:
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        import sys

        exc = sys.exc_info()
    args = (code, 0, 4242, "run_worker", "forkserver")
    return logging.LogRecord("torch", logging.ERROR, __file__, 1, MSG, args, exc)


def test_a_reform_exit_is_logged_as_info_without_a_traceback() -> None:
    rec = record(REFORM_EXIT_CODE)
    assert _ReformIsNotAFailure().filter(rec)
    assert rec.levelno == logging.INFO and rec.exc_info is None
    assert rec.getMessage() == "Worker (pid 4242) stopped for the group to re-form."


def test_a_real_failure_keeps_its_error_and_traceback() -> None:
    rec = record(1)
    assert _ReformIsNotAFailure().filter(rec)
    assert rec.levelno == logging.ERROR and rec.exc_info is not None
