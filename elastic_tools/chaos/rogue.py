"""The rogue member: someone who can write etcd but holds no job secret writes a member key
for the job's announce rendezvous straight into etcd (``<prefix>/<run>/announce/members/
<node>``, an unsigned announcement on a lease of its own), watches the round key while the
agents read it, and removes the key afterwards.

The agents sign their records with the job's secret: such a key must get no rank (it is
never among a round's members) and be named by an ``rdzv.untrusted`` event, while training
goes on. :class:`RogueMember` plants the key and records what it saw (:class:`RogueSeen`);
:mod:`elastic_tools.chaos.invariants` checks the event log afterwards.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elastic.errors import ElasticError, EtcdStateError
from elastic.etcd.server import free_port
from elastic.rendezvous.announce.records import Announcement, parse_round
from elastic.rendezvous.keys import RunKeys
from elastic_tools.chaos.observers import pause

ROGUE_TTL_S = 60  # the rogue's lease: its key outlives a crashed chaos run by a minute at most


@dataclass
class RogueSeen:
    """What one rogue member saw: the rounds the round key held while its key was there,
    those that named it, and how long until an ``rdzv.untrusted`` event named it."""

    node: str
    rounds: set[int] = field(default_factory=set)
    ranked: set[int] = field(default_factory=set)  # rounds that rank it (or name it joining)
    untrusted_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "rounds": sorted(self.rounds),
            "ranked": sorted(self.ranked),
            "untrusted_s": self.untrusted_s,
        }


def rogue_announcement() -> Announcement:
    """A newcomer's announcement as an agent writes it, unsigned: loopback, this process's
    pid, ports nobody listens on."""
    return Announcement("127.0.0.1", os.getpid(), 0, free_port(), free_port(), after=-1)


class RogueMember:
    """One rogue member key of run ``keys``, written through ``client`` (an
    :class:`~elastic.etcd.client.EtcdClient`)."""

    def __init__(self, client: Any, keys: RunKeys, node: str) -> None:
        self.client, self.keys = client, keys
        self.key = keys.members + node.encode()
        self.seen = RogueSeen(node)
        self.lease = 0

    def plant(self) -> None:
        """Write the unsigned member key on a fresh lease."""
        self.lease = self.client.grant(ROGUE_TTL_S)
        self.client.put(self.key, rogue_announcement().encode(), self.lease)

    def remove(self) -> None:
        """Delete the key and its lease (errors ignored: the lease expires anyway)."""
        with contextlib.suppress(ElasticError):
            if self.lease:
                self.client.revoke(self.lease)
            self.client.delete(self.key)
        self.lease = 0

    def look(self) -> None:
        """Read the round key once; note its round, and whether it ranks the rogue (or
        names it to join the next round)."""
        kvs = self.client.range(self.keys.round).kvs
        if not kvs:
            return
        try:
            round_ = parse_round(kvs[0].value)
        except EtcdStateError:
            return
        self.seen.rounds.add(round_.round)
        if self.seen.node in round_.members or self.seen.node in round_.joining:
            self.seen.ranked.add(round_.round)

    def watch(self, named: Callable[[], bool], timeout: float, linger: float) -> RogueSeen:
        """Look at the round key every 0.1 s until ``named()`` (an ``rdzv.untrusted`` event
        names the rogue) has held for ``linger`` seconds, or ``timeout`` passed."""
        started = time.monotonic()
        until = started + timeout
        while time.monotonic() < until:
            with contextlib.suppress(ElasticError):
                self.look()
            if self.seen.untrusted_s is None and named():
                self.seen.untrusted_s = round(time.monotonic() - started, 2)
                until = min(until, time.monotonic() + linger)
            pause(0.1)
        return self.seen


__all__ = ["ROGUE_TTL_S", "RogueMember", "RogueSeen", "rogue_announcement"]
