"""The CNN worker, except that rank 0 dies (SIGKILL) once, right after its group agreed
(``StepEnd._agree``: after the step, before rank 0 reports it) on step K:
``python -m tests.recovery.agreed_then_killed K MARKER <worker args>``.

The survivors complete step K (the agreement was their last collective of it) while
rank 0 never reports it. ``MARKER`` is created once, by the rank that dies, so that the
kill happens once per job. Rank 0 waits a moment before it dies so that the all-reduce
surely completed on the others (a reset connection may discard data still in flight).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

from elastic.worker.agreement import StepEnd
from elastic_tools.training.worker import main

SETTLE_S = 0.5


def _arm(step: int, marker: str) -> None:
    agree = StepEnd._agree

    def agree_then_die(self: StepEnd) -> Any:
        agreed = agree(self)
        if self.parts.place.rank == 0 and self.parts.train.step == step and _first(marker):
            time.sleep(SETTLE_S)
            os.kill(os.getpid(), signal.SIGKILL)
        return agreed

    StepEnd._agree = agree_then_die  # type: ignore[method-assign]


def _first(marker: str) -> bool:
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


if __name__ == "__main__":
    _arm(int(sys.argv[1]), sys.argv[2])
    sys.exit(main(sys.argv[3:]))
