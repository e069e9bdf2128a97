"""The ``etcd-v3`` handler: torch's DynamicRendezvousHandler plus one query for the agent.

The agent asks :meth:`EtcdRendezvousHandler.membership_change` at every monitor tick; it
answers, without side effects, whether this node's round is still the job (see
:class:`MembershipChange`). The run's other records (fence, restart ledger, probe ports,
change watch) are in the :class:`~elastic.rendezvous.ledger.RunLedger` the handler is given.

Why a node must notice a changed round itself:

torch judges a node dead when its last heartbeat in the shared state is older
than ``keep_alive_interval * keep_alive_max_attempt``. An etcd outage longer
than that (a restart, a lost quorum) makes *every* heartbeat look old: the
first node to read the state after the outage drops all participants, the
round moves on without anyone, and the live agents, no longer in the state,
stop sending heartbeats and never notice. A node that joins later then waits
forever in a round nobody else is in. Here, a node that finds it is no longer
a participant of the round it joined reports "nodes waiting", so its agent
restarts its workers and the whole group re-forms. Likewise when a *peer*
vanishes from the round (its heartbeats expired: a crash, a cut link): the
survivors re-form at once instead of blocking in a collective until its
timeout.

torch's join loop polls the state once a second while it waits for others.
Here the wait is an etcd watch on the state key, started just after the
revision this node last read: the node wakes as soon as anyone changes the
state (a join, a completed round) instead of up to a second later; above 16
nodes it keeps torch's poll, which scales better than waking every waiter on
every change. The hook
replaces torch's module-level ``_delay`` but acts only in threads running our
handler's join; every other caller keeps torch's plain sleep.

While it waits, a node also probes peers whose heartbeats are late, and the
participants of a completed round it waits to replace, and removes those whose
agent is certainly gone (:mod:`elastic.rendezvous.liveness`); the handler is built
on the state holder and op executor of :mod:`elastic.rendezvous.rounds`, where a
round that only re-forms the previous one closes as soon as every live member is
back instead of after the last call.
"""

from __future__ import annotations

import logging
import random
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone

from torch.distributed import Store
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousInfo,
    RendezvousParameters,
    dynamic_rendezvous,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    RendezvousSettings,
    _NodeDesc,
    _RendezvousState,
)

from elastic import events
from elastic.errors import EtcdConnectionError
from elastic.rendezvous.contract import ChangeKind, MembershipChange
from elastic.rendezvous.ledger import RunLedger
from elastic.rendezvous.liveness import DeathDetector, ProbeListener
from elastic.rendezvous.options import RendezvousOptions
from elastic.rendezvous.rounds import (
    LeaveOp,
    ProbingStateHolder,
    WaitListExecutor,
    completed_members,
)

logger = logging.getLogger(__name__)

_MIN_WAKE_GAP_S = 0.1  # a waiting node re-reads the state at most this often
# Above this many nodes every change would wake every waiter (a herd that measured far
# slower than torch's 1 s poll at 128 simulated nodes); fall back to the poll there.
_MAX_WATCH_CROWD = 16
_LATE = timedelta(seconds=1)  # a heartbeat older than this (or half the interval) is probed
# While a completed round holds up the next one, its participants are probed this often.
_REPROBE_S = 0.1
_SKEW_WARN_S = 1.0  # a fresh round's heartbeats this far off now: a clock is off
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)  # a heartbeat that has surely expired
_waiter = threading.local()  # .fn: Callable[[float], None] while this thread joins
_torch_delay: Callable[[float | tuple[float, float]], None] = dynamic_rendezvous._delay


def _delay_or_watch(seconds: float | tuple[float, float]) -> None:
    wait = getattr(_waiter, "fn", None)
    if wait is None or isinstance(seconds, tuple):
        _torch_delay(seconds)
    else:
        wait(seconds)


def _install_watch_delay() -> None:
    """Route torch's join-loop poll through :func:`_delay_or_watch` (idempotent)."""
    if dynamic_rendezvous._delay is not _delay_or_watch:
        dynamic_rendezvous._delay = _delay_or_watch


def _method_name(depth: int = 2) -> str:
    """torch's ``get_method_name`` (the name of the function ``depth`` frames up, for
    its rendezvous events) without ``inspect.stack()``, which reads the source of every
    frame on the stack: torch calls it twice for each recorded event, several events per
    rendezvous step, and on a loaded machine that was most of a re-form (measured: about
    0.4 of 0.55 s after a kill)."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # the stack is not that deep
        return "no_method_name"


def _install_method_name() -> None:
    """Make torch's rendezvous events name their caller with :func:`_method_name`."""
    if dynamic_rendezvous.get_method_name is not _method_name:
        dynamic_rendezvous.get_method_name = _method_name


class EtcdRendezvousHandler(DynamicRendezvousHandler):
    """DynamicRendezvousHandler that rejoins when dropped, and records each round as an event."""

    _joined_round: int | None = None
    _peers: frozenset[_NodeDesc] = frozenset()
    _holder: ProbingStateHolder  # torch keeps it as _state_holder, typed as its base
    _reform_requested: bool = False
    _ledger: RunLedger | None = None
    _listener: ProbeListener | None = None
    _detector: DeathDetector | None = None
    _outage_since: float | None = None
    _outage_timeout_s: float = 600.0
    _fence: str = ""
    # torch's store for the round (the TCPStore on rank 0's worker) ends with the round.
    hosts_round_store = False

    def fence(self) -> str:
        """The commit fence of the round this node joined last (see the contract)."""
        return self._fence

    def attach(self, ledger: RunLedger, outage_timeout_s: float = 600.0) -> None:
        """Use the run's ledger, and listen on a probe port published in it."""
        self._ledger = ledger
        self._outage_timeout_s = outage_timeout_s
        self._listener = ProbeListener()
        ledger.publish_probe(str(self._this_node), self._listener.port)
        self._detector = DeathDetector(ledger.probe_ports)
        self._holder.detector = self._detector

    def request_reform(self) -> None:
        """Make the agent re-rendezvous at its next check (a planned change of membership)."""
        self._reform_requested = True

    def membership_change(self) -> MembershipChange | None:
        """Whether the group must re-form now, and why; None while the round is the job.

        The one query the agent asks at every monitor tick. It reads the state (one etcd
        read at most, as torch's ``num_nodes_waiting``) and changes nothing.
        """
        waiting = self._waiting_or_outage()
        if waiting is None:  # etcd is unreachable: the round goes on without it
            return None
        if self._reform_requested:
            return MembershipChange(ChangeKind.REQUESTED, self._joined_round, waiting=waiting)
        if waiting:
            return MembershipChange(ChangeKind.JOINERS, self._joined_round, waiting=waiting)
        if self._joined_round is None:
            return None
        with self._heartbeat_lock:  # the heartbeat thread's sync replaces and prunes it
            state = self._state_holder.state
            round_, participants = state.round, set(state.participants)
        if round_ != self._joined_round or self._this_node not in participants:
            return MembershipChange(ChangeKind.DROPPED, self._joined_round, (str(self._this_node),))
        gone = self._peers - participants
        if gone:
            return MembershipChange(ChangeKind.PEERS_LOST, round_, tuple(sorted(map(str, gone))))
        return None

    def _waiting_or_outage(self) -> int | None:
        """torch's count of waiting nodes; None while etcd is unreachable, for up to
        ``outage_timeout``: the workers' group does not need etcd between rounds."""
        try:
            waiting = super().num_nodes_waiting()
        except RendezvousConnectionError as exc:
            now = time.monotonic()
            if self._outage_since is None:
                self._outage_since = now
                logger.warning(
                    "etcd is unreachable (%s); training goes on, and this node gives up if "
                    "etcd is still unreachable after %.0f s (rdzv-conf outage_timeout).",
                    exc,
                    self._outage_timeout_s,
                )
                events.emit("etcd.unreachable", run_id=self.get_run_id())
            if now - self._outage_since > self._outage_timeout_s:
                raise EtcdConnectionError(
                    f"etcd has been unreachable for {now - self._outage_since:.0f} s, longer "
                    f"than outage_timeout={self._outage_timeout_s:.0f} s; check the etcd "
                    "cluster, then restart the agents (the checkpoints are safe)."
                ) from exc
            return None
        if self._outage_since is not None:
            seconds = time.monotonic() - self._outage_since
            logger.warning("etcd is reachable again after %.1f s.", seconds)
            events.emit("etcd.reachable", run_id=self.get_run_id(), seconds=round(seconds, 3))
            self._outage_since = None
        return waiting

    def round_view(self) -> tuple[int, int, int]:
        """(round, participants, waiting) of the state this node last read; no etcd request.

        For the metrics exporter: read without the handler's lock (an etcd request may hold
        it for seconds); ``len`` of a dict is atomic.
        """
        state = self._holder.state
        return int(state.round), len(state.participants), len(state.wait_list)

    def num_nodes_waiting(self) -> int:
        """torch's contract for any agent: > 0 when the group must re-form (see
        :meth:`membership_change`: also when a peer is lost or this node was dropped)."""
        change = self.membership_change()
        return 0 if change is None else max(change.waiting, 1)

    def leave(self, timeout: float = 10.0) -> None:
        """Leave the rendezvous now, so the others need not wait for heartbeats to expire."""
        started = time.monotonic()
        self._stop_heartbeats()
        with self._heartbeat_lock:
            self._op_executor.run(LeaveOp(), time.monotonic() + timeout)
        seconds = time.monotonic() - started
        events.emit(
            "node.leave",
            run_id=self.get_run_id(),
            node=str(self._this_node),
            seconds=round(seconds, 3),
        )
        logger.info(
            "The node '%s' left the rendezvous '%s' in %.2f s.",
            self._this_node,
            self.get_run_id(),
            seconds,
        )

    def shutdown(self) -> bool:
        """See base class; also closes the probe port and the etcd client."""
        try:
            return super().shutdown()
        finally:
            self.close()

    def close(self) -> None:
        """Release this handler's probe port and etcd client (after leave or shutdown)."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._ledger is not None:
            self._ledger.close()

    def next_rendezvous(self) -> RendezvousInfo:
        """See base class."""
        self._reform_requested = False
        self._joined_round = None
        _waiter.fn = self._wait_for_state_change
        try:
            info = super().next_rendezvous()
        finally:
            _waiter.fn = None
        state = self._state_holder.state
        self._joined_round = state.round
        self._peers = frozenset(state.participants)
        self._verify_peers()
        self._check_clocks()
        if self._ledger is not None:
            self._fence = self._ledger.publish_fence(state.round)  # the agent hands it on
        events.emit(
            "rdzv.round",
            run_id=self.get_run_id(),
            round=state.round,
            node=str(self._this_node),
            rank=info.rank,
            world_size=info.world_size,
        )
        return info

    def record_failed_round(self) -> int | None:
        """Count this round's failure in the job-wide ledger; None before any round."""
        if self._ledger is None or self._joined_round is None:
            return None
        return self._ledger.record_failed_round(self._joined_round)

    def _check_clocks(self) -> None:
        """Warn about a peer whose clock seems off: heartbeats are stamped with each node's
        own wall clock, and a node whose clock lags by more than the heartbeat window
        (less the interval) looks dead to the others (see docs/design.md, "Clocks")."""
        now = datetime.now(timezone.utc)
        interval = self._settings.keep_alive_interval
        for node, beat in self._state_holder.state.last_heartbeats.items():
            if node == self._this_node or node not in self._peers:
                continue
            ahead = (beat - now).total_seconds()
            behind = (now - beat - interval).total_seconds()
            if ahead > _SKEW_WARN_S or behind > _SKEW_WARN_S:
                logger.warning(
                    "The clock of node '%s' seems %.1f s %s this node's; keep clocks in sync "
                    "(NTP): a skew near the heartbeat window makes live nodes look dead.",
                    node,
                    max(ahead, behind),
                    "ahead of" if ahead > 0 else "behind",
                )

    def _verify_peers(self) -> None:
        """Probe the new round's peers once (they are alive now), in the background, so a
        later refusal from one of them is trusted (see DeathDetector)."""
        if self._detector is None:
            return
        peers = [(str(n), n.addr) for n in self._peers if n != self._this_node]
        threading.Thread(
            target=self._detector.verify, args=(peers,), name="probe-verify", daemon=True
        ).start()

    def _reap_dead_peers(self) -> bool:
        """Remove peers whose agent is certainly gone (probe refused); True if any was."""
        if self._detector is None:
            return False
        state = self._state_holder.state
        late = datetime.now(timezone.utc) - min(self._settings.keep_alive_interval / 2, _LATE)
        holders = {str(n) for n in self._holding_up(state)}
        suspects = {
            str(n): n
            for n, beat in state.last_heartbeats.items()
            if n != self._this_node and (beat < late or str(n) in holders)
        }
        dead = self._detector.dead([(name, n.addr) for name, n in suspects.items()], holders)
        if not dead:
            return False
        for name in dead:
            state.last_heartbeats[suspects[name]] = _EPOCH
        self._holder._sanitize()  # torch's own removal of expired nodes
        self._holder.mark_dirty()
        logger.warning(
            "The agents of %s are gone (their probe ports refuse connections); "
            "removed them from the rendezvous without waiting for heartbeat expiry.",
            sorted(dead),
        )
        events.emit("node.dead", run_id=self.get_run_id(), nodes=sorted(dead), evidence="probe")
        return True

    def _holding_up(self, state: _RendezvousState) -> dict[_NodeDesc, int]:
        """The participants still in the completed round this node left to re-form it: the
        next round cannot open before they have all left it, so a dead one among them is
        probed at once, not only once its heartbeat is late. (Not for a newcomer, nor a
        spare node that waits for room: the round goes on without them.)"""
        if self._this_node in completed_members(state) - set(state.participants):
            return state.participants
        return {}

    def _wait_for_state_change(self, seconds: float) -> None:
        if self._reap_dead_peers():
            return  # sync the removal now
        token = self._holder._token
        state = self._state_holder.state
        if self._holding_up(state):  # probe them again soon: one may be dying right now
            seconds = min(seconds, _REPROBE_S)
        crowd = len(state.participants) + len(state.wait_list)
        if token is None or self._ledger is None or crowd > _MAX_WATCH_CROWD:
            _torch_delay(seconds)
            return
        started = time.monotonic()
        if self._ledger.wait_for_change(token, seconds):
            # Coalesce a burst of changes into one re-read per gap, then make that sync
            # read etcd instead of the holder's one-second cache (which would turn each
            # wake into a busy loop).
            remaining = _MIN_WAKE_GAP_S * random.uniform(0.5, 1.0) - (time.monotonic() - started)
            if remaining > 0:
                time.sleep(remaining)
            self._holder._last_sync_time = -1.0


def build_handler(
    store: Store,
    backend: RendezvousBackend,
    ledger: RunLedger,
    params: RendezvousParameters,
    options: RendezvousOptions,
) -> EtcdRendezvousHandler:
    """torch's ``create_handler`` with our subclasses, from the parsed options."""
    _install_watch_delay()
    _install_method_name()
    # torch's from_backend, with our state holder and op executor.
    settings = RendezvousSettings(
        params.run_id,
        params.min_nodes,
        params.max_nodes,
        options.timeouts(),
        keep_alive_interval=timedelta(seconds=options.keep_alive_interval),
        keep_alive_max_attempt=options.keep_alive_max_attempt,
    )
    node = EtcdRendezvousHandler._node_desc_generator.generate(params.local_addr)
    holder = ProbingStateHolder(backend, settings)
    handler = EtcdRendezvousHandler(node, settings, backend.name, store, holder)
    handler._holder = holder
    handler._op_executor = WaitListExecutor(node, holder, settings)
    handler.attach(ledger, options.outage_timeout)
    return handler


__all__ = ["EtcdRendezvousHandler", "build_handler"]
