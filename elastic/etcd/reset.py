"""Whether etcd lost its data: a verdict from the response headers a client sees.

An etcd restarted on an empty data directory (a single etcd without a volume, ``docker
compose down``/``up``) answers on the same address, often with the same cluster and member
ids (they derive from the peer URLs and the cluster token), but its revision starts again
at 1 and every key and lease is gone. A client that kept revisions (watches from the next
one, compare-and-sets on a key's ``mod_revision``) would wait for revisions that are
history, or fence every write against keys that no longer exist.

:func:`verdict` is pure: from the identity and the highest revision seen last, and the
header seen now, it says whether etcd is another store now (:attr:`Verdict.RESET`), merely
a lagging member of the same cluster, or the same store. :class:`Identity` applies it to
every header the client reads (:class:`elastic.etcd.client.EtcdClient`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from enum import Enum
from typing import Any


@dataclass(frozen=True)
class Seen:
    """What one response header said: cluster id, member id, revision, raft term."""

    cluster_id: int
    member_id: int
    revision: int
    term: int = 0  # 0: not known

    @classmethod
    def of(cls, header: Any) -> Seen:
        term = int(getattr(header, "raft_term", 0))
        return cls(int(header.cluster_id), int(header.member_id), int(header.revision), term)

    def __str__(self) -> str:
        return (
            f"cluster {self.cluster_id:x}, member {self.member_id:x}, revision {self.revision}, "
            f"term {self.term}"
        )


class Verdict(Enum):
    SAME = "same"  # the store we knew: take the header's revision as the newest seen
    LAGGING = "lagging"  # another member of the same cluster, behind: ignore the header
    RESET = "reset"  # another store (a new cluster, or one that lost its data): start over


NOTHING = Seen(0, 0, 0)  # what a request sent before any header was seen had seen


def verdict(last: Seen | None, now: Seen, sent: Seen | None = None) -> tuple[Verdict, str]:
    """Whether ``now`` comes from the store ``last`` came from (``last``: the highest
    revision seen, None: nothing yet), and why. ``sent``: the highest seen when the request
    that ``now`` answers went out (None: ``last``); only a header below *that* shows a loss,
    since answers to requests in flight at once on other threads come back in any order.

    * another cluster id: a new cluster (reset);
    * the same member, a lower revision or a lower raft term: that member lost its data
      (reset: neither ever goes backwards on a member, not even across a restart that kept
      its data; the term catches a store that took more writes since than the old one held);
    * another member of the same cluster, a lower revision: it lags behind (a follower
      that has not applied every entry yet); nothing is concluded from it.
    """
    if last is None or not now.cluster_id or not last.cluster_id:
        return Verdict.SAME, "the first header seen"
    if now.cluster_id != last.cluster_id:
        return Verdict.RESET, f"the cluster id changed ({last} before, {now} now)"
    floor = last if sent is None else sent
    same_member = now.member_id == last.member_id == floor.member_id
    if same_member and 0 < now.term < floor.term:
        return Verdict.RESET, f"the raft term went backwards ({floor} before, {now} now)"
    if now.revision >= last.revision:
        return Verdict.SAME, "the revision did not go backwards"
    if now.revision >= floor.revision:
        return Verdict.LAGGING, f"an answer overtaken by a newer one ({last} seen, {now} now)"
    if same_member:
        return Verdict.RESET, f"the revision went backwards ({floor} before, {now} now)"
    return Verdict.LAGGING, f"another member lags behind ({last} before, {now} now)"


class Identity:
    """The store a client talks to, as its response headers show; counts resets.

    :meth:`note` is called with every header; it returns the reason when that header shows
    etcd lost its data (the caller then tells its listeners), else None.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.last: Seen | None = None
        self.resets = 0  # how many times etcd was seen to have lost its data

    def note(self, header: Any, sent: Seen | None = None) -> str | None:
        """``sent``: :attr:`last` when the request this header answers went out (None:
        :attr:`last` now)."""
        if header is None:
            return None
        now = Seen.of(header)
        with self._lock:
            kind, reason = verdict(self.last, now, sent)
            if kind is Verdict.LAGGING:
                return None
            self.last = now
            if kind is Verdict.RESET:
                self.resets += 1
                return reason
            return None


__all__ = ["NOTHING", "Identity", "Seen", "Verdict", "verdict"]
