"""How long etcd has been out of reach, as the background requests of one node see it.

Training goes on while etcd is unreachable (one warning and an ``etcd.unreachable`` event,
then ``etcd.reachable`` once it answers again); the agent gives up once the outage has
lasted past ``outage_timeout``.

Only a request that completed counts as etcd answering (:meth:`Outage.record` with None):
a keep-alive's reply, a read, a write, a watch event. A watch that merely ran out does
not: a hung etcd (stopped, not refusing) accepts connections and lets watches run out too.
"""

from __future__ import annotations

import logging
import time

from elastic import events
from elastic.errors import EtcdConnectionError

logger = logging.getLogger(__name__)


class Outage:
    """The current etcd outage of one node, if any (thread-safe enough: one float)."""

    def __init__(self, run_id: str, timeout: float) -> None:
        self._run_id = run_id
        self._timeout = timeout
        self._since: float | None = None

    def record(self, exc: BaseException | None) -> None:
        """Record an etcd failure of a background request (with None: one that completed
        with etcd's answer; never call it so for a watch that just ran out)."""
        if exc is None:
            self._ended()
        elif self._since is None:  # from when the failed request started, if it says
            self._since = min(time.monotonic(), getattr(exc, "since", None) or time.monotonic())
            logger.warning(
                "etcd is unreachable (%s); training goes on, and this node gives up if etcd "
                "is still unreachable after %.0f s (rdzv-conf outage_timeout).",
                exc,
                self._timeout,
            )
            events.emit("etcd.unreachable", run_id=self._run_id)

    def _ended(self) -> None:
        if self._since is not None:
            seconds = time.monotonic() - self._since
            logger.warning("etcd is reachable again after %.1f s.", seconds)
            events.emit("etcd.reachable", run_id=self._run_id, seconds=round(seconds, 3))
            self._since = None

    def check(self) -> bool:
        """False while etcd is unreachable; raise once that lasted past outage_timeout.

        Raises:
            EtcdConnectionError: etcd has been unreachable for longer than the timeout.
        """
        since = self._since
        if since is None:
            return True
        seconds = time.monotonic() - since
        if seconds > self._timeout:
            raise EtcdConnectionError(
                f"etcd has been unreachable for {seconds:.0f} s, longer than "
                f"outage_timeout={self._timeout:.0f} s; check the etcd cluster, then "
                "restart the agents (the checkpoints are safe)."
            )
        return False


__all__ = ["Outage"]
