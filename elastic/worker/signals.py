"""A Run's stop signals: SIGTERM/SIGINT stop the group after the step, with a checkpoint."""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

from elastic.node import reform

logger = logging.getLogger(__name__)


class StopSignals:
    """SIGTERM/SIGINT: the group stops after this step with a checkpoint (a second signal
    stops at once). ``regroup``: our agent stops us only to re-form (:mod:`elastic.node.reform`)."""

    def __init__(self) -> None:
        self.requested = self.signalled = self.regroup = False
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def restore(self) -> None:
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        logger.warning(
            "Received %s; the group stops after this step with a checkpoint (send it again "
            "to stop at once).",
            signal.Signals(signum).name,
        )
        self.requested = self.signalled = True
        self.regroup = reform.stopping_for_reform()
        signal.signal(signum, signal.SIG_DFL)


__all__ = ["StopSignals"]
