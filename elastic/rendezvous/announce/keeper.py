"""The keeper: this node's lease alive, its peers probed, the dead ones' keys reaped.

Two threads of their own, so that a slow etcd request delays neither the probes nor the
renewal: :meth:`Keeper.lease_loop` renews this node's :class:`MemberLease` every
``keep_alive_interval`` (a lease that expired makes the node announce afresh), and
:meth:`Keeper.probe_loop` probes the peers this node watches over (its predecessor; the
closer: the newest member and, while a round waits for them, a few of the members not yet
ready, in turn, :func:`~elastic.rendezvous.announce.policy.probe_targets`) every quarter
lease TTL (1-2 s), and at once when they change (a new round, a new predecessor, a member
that re-announced: then those still running the old round are probed again even if they
answered a moment ago; a suspect that still accepts is probed again every
:data:`SUSPECT_REPROBE_S` for :data:`SUSPECT_WINDOW_S` after the wake-up, since a killed
agent's port accepts until the kernel has torn its process down). A refusal on a port seen accepting
(:mod:`elastic.rendezvous.liveness`) deletes the dead node's key (only the incarnation that
was probed), so nobody waits for its lease to expire.
"""

from __future__ import annotations

import logging
import time

from elastic import events
from elastic.etcd.client import (
    REQUEST_ERRORS,
    EtcdClient,
    compare_created,
    op_delete,
)
from elastic.rendezvous.announce.outage import Outage
from elastic.rendezvous.announce.policy import PROBES_PER_TICK, Limits, probe_targets
from elastic.rendezvous.announce.records import Member
from elastic.rendezvous.announce.state import NodeState
from elastic.rendezvous.keys import RunKeys
from elastic.rendezvous.liveness import DeathDetector, ProbeListener

logger = logging.getLogger(__name__)

PROBE_EVERY_S = 1.0  # probes go every quarter lease TTL, from this to twice this
# A killed agent's probe port accepts until the kernel has torn the process down (it unmaps
# the memory before it closes the files: 20-50 ms measured for a small Python, more for one
# that imported torch), just when a survivor asks for a new round and the closer probes it;
# a suspect that still accepts is probed again this soon, within this long of the wake-up.
# Before: such a kill -9 waited for the next tick, 1.05-1.2 s (bench/recovery.py --step-s 0.05).
SUSPECT_REPROBE_S = 0.05
SUSPECT_WINDOW_S = 1.0


def probe_wait(probe_every: float, alive_suspects: bool, fast_until: float, now: float) -> float:
    """Seconds until the next probe: soon while a suspect the prober was woken for still
    accepts, within :data:`SUSPECT_WINDOW_S` of the wake-up (``fast_until``); else the tick."""
    if alive_suspects and now < fast_until:
        return min(SUSPECT_REPROBE_S, fast_until - now)
    return probe_every


class MemberLease:
    """This node's own lease, which its member key lives on (``id`` 0: none)."""

    def __init__(self, client: EtcdClient, ttl: int) -> None:
        self._client = client
        self.ttl = ttl
        self.id = 0

    def grant(self) -> int:
        self.id = self._client.grant(self.ttl)
        return self.id

    def revoke(self) -> None:
        """Revoke the lease, if any: this node's key vanishes at once."""
        if self.id:
            lease, self.id = self.id, 0
            self._client.revoke(lease)


class Keeper:
    """Keeps this node's lease alive and watches over its peers (see the module docstring).

    Args:
        client: the etcd client.
        keys: the run's key layout.
        state: the node's shared state.
        lease: this node's lease.
        outage: where background failures are recorded.
        interval: seconds between keep-alives (keep_alive_interval).
        limits: the rendezvous limits (the closer's view of who is not ready).
    """

    def __init__(
        self,
        client: EtcdClient,
        keys: RunKeys,
        state: NodeState,
        lease: MemberLease,
        outage: Outage,
        interval: float,
        limits: Limits,
    ) -> None:
        self._client, self._keys, self._state = client, keys, state
        self.lease = lease
        self._outage = outage
        self._interval = interval
        self._limits = limits
        self.listener: ProbeListener | None = ProbeListener()
        self._detector = DeathDetector(lambda: dict(state.ports))
        self._turn = 0
        self.keepalives = 0  # etcd requests spent on keep-alives

    def close(self) -> None:
        """Close the probe port (peers then see this node as dead)."""
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    def lease_loop(self) -> None:
        """Renew the lease every ``interval`` until the node stops."""
        while not self._state.stopped.wait(self._interval):
            try:
                self._keep_alive()
            except REQUEST_ERRORS as exc:
                self._outage.record(exc)
            except Exception:
                logger.exception("The keep-alive thread of '%s' failed; retrying.", self._me)

    def probe_loop(self) -> None:
        """Probe the watched peers every quarter lease TTL (1-2 s), and when woken (then
        the suspects that still accept again soon, :func:`probe_wait`)."""
        probe_every = min(max(PROBE_EVERY_S, self.lease.ttl / 4), 2 * PROBE_EVERY_S)
        state = self._state
        wait, fast_until = probe_every, 0.0
        while not state.stopped.is_set():
            if state.probe_now.wait(wait):
                fast_until = time.monotonic() + SUSPECT_WINDOW_S
            state.probe_now.clear()
            if state.stopped.is_set():
                return
            wait = probe_every
            try:
                alive = self._probe()
                wait = probe_wait(probe_every, alive, fast_until, time.monotonic())
            except REQUEST_ERRORS as exc:
                self._outage.record(exc)
            except Exception:
                logger.exception("The liveness thread of '%s' failed; retrying.", self._me)

    @property
    def _me(self) -> str:
        return self._state.name

    def _keep_alive(self) -> None:
        state = self._state
        lease = self.lease.id
        if not lease or state.expired:
            return
        self.keepalives += 1
        if self._client.keepalive(lease) <= 0:
            with state.cond:
                if lease != self.lease.id:
                    return  # an announcement took a fresh lease meanwhile
                state.expire()
            logger.warning(
                "The etcd lease of node '%s' expired (an etcd outage, or this node was too "
                "slow to renew it); it will rejoin.",
                self._me,
            )
            events.emit("node.expired", run_id=self._state.run_id, node=self._me)
        self._outage.record(None)

    def _targets(self) -> tuple[list[Member], list[str]]:
        """Whom to probe now, and whom to probe even if they answered a moment ago."""
        state = self._state
        with state.cond:
            if not state.closer:
                return ([state.pred] if state.pred is not None else []), []
            targets, suspects = probe_targets(state.view(self._limits), self._me, self._turn)
        if suspects:
            self._turn += PROBES_PER_TICK - 1
        return targets, suspects

    def _probe(self) -> bool:
        """Probe the targets, reap the dead; whether a suspect probed did not refuse."""
        targets, suspects = self._targets()
        if not targets:
            return False
        pairs = [(m.name, m.addr) for m in targets]
        self._detector.verify(pairs)
        dead = set(self._detector.dead(pairs, recheck=suspects))
        for member in targets:
            if member.name in dead:
                self.reap(member)
        return any(m.name in suspects and m.name not in dead for m in targets)

    def reap(self, member: Member) -> None:
        """Delete a dead node's key (only the incarnation that was probed)."""
        key = self._keys.members + member.name.encode()
        compare = compare_created(key, member.create_revision)
        if self._client.txn([compare], [op_delete(key)], []).succeeded:
            logger.warning(
                "The agent of '%s' is gone (its probe port refuses connections); removed it "
                "from the rendezvous without waiting for its lease to expire.",
                member.name,
            )
            events.emit(
                "node.dead", run_id=self._state.run_id, nodes=[member.name], evidence="probe"
            )


__all__ = [
    "PROBE_EVERY_S",
    "SUSPECT_REPROBE_S",
    "SUSPECT_WINDOW_S",
    "Keeper",
    "MemberLease",
    "probe_wait",
]
