"""The keeper: this node's lease alive, its peers probed, the dead ones' keys reaped.

Two threads of their own, so that a slow etcd request delays neither the probes nor the
renewal: :meth:`Keeper.lease_loop` renews this node's :class:`MemberLease` every
``keep_alive_interval`` (a lease that expired makes the node announce afresh), and
:meth:`Keeper.probe_loop` probes the peers this node watches over (its predecessor; the
closer: the newest member and, while a round waits for them, a few of the members not yet
ready, in turn, :func:`~elastic.rendezvous.announce.policy.probe_targets`) every quarter
lease TTL (1-2 s), and at once when they change (a new round, a new predecessor, a member
that re-announced: then those still running the old round are probed again even if they
answered a moment ago). A refusal on a port seen accepting
(:mod:`elastic.rendezvous.liveness`) deletes the dead node's key (only the incarnation that
was probed), so nobody waits for its lease to expire.
"""

from __future__ import annotations

import logging

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
        """Probe the watched peers every quarter lease TTL (1-2 s), and when woken."""
        probe_every = min(max(PROBE_EVERY_S, self.lease.ttl / 4), 2 * PROBE_EVERY_S)
        state = self._state
        while not state.stopped.is_set():
            state.probe_now.wait(probe_every)
            state.probe_now.clear()
            if state.stopped.is_set():
                return
            try:
                self._probe()
            except REQUEST_ERRORS as exc:
                self._outage.record(exc)
            except Exception:
                logger.exception("The liveness thread of '%s' failed; retrying.", self._me)

    @property
    def _me(self) -> str:
        return self._state.name

    def _keep_alive(self) -> None:
        state = self._state
        if not self.lease.id or state.expired:
            return
        self.keepalives += 1
        if self._client.keepalive(self.lease.id) <= 0:
            logger.warning(
                "The etcd lease of node '%s' expired (an etcd outage, or this node was too "
                "slow to renew it); it will rejoin.",
                self._me,
            )
            with state.cond:
                state.expired = True
                state.cond.notify_all()
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

    def _probe(self) -> None:
        targets, suspects = self._targets()
        if not targets:
            return
        pairs = [(m.name, m.addr) for m in targets]
        self._detector.verify(pairs)
        dead = set(self._detector.dead(pairs, recheck=suspects))
        for member in targets:
            if member.name in dead:
                self.reap(member)

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


__all__ = ["PROBE_EVERY_S", "Keeper", "MemberLease"]
