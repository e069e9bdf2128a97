"""The announce handler: torch's RendezvousHandler and the agent's MembershipHandler.

Thin: it announces this node (:class:`.publisher.Publisher`), starts three threads (the
watch: :class:`.follower.Follower`, or as the closer :class:`.closer.Closer`; the keeper's
lease and probe loops: :class:`.keeper.Keeper`), and waits on the shared
:class:`.state.NodeState` for a round that takes this node in. The agent's questions
(:meth:`AnnounceRendezvousHandler.membership_change`, :meth:`round_view`, :meth:`fence`)
are answered locally from that state, with no etcd request.

With a job secret (``$ELASTIC_SECRET_FILE``, the same file on every node) every record this
node writes is signed and only signed records are trusted (:class:`.records.Trust`): a member
key written by someone without the secret gets no rank, a forged round (or ``closed`` flag)
is refused. Without one everything works as before, unsigned.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable

from torch.distributed import PrefixStore, Store
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from elastic import events
from elastic.etcd.client import REQUEST_ERRORS, EtcdClient, WatchHandle
from elastic.rendezvous.announce import policy
from elastic.rendezvous.announce.closer import Closer
from elastic.rendezvous.announce.follower import Follower
from elastic.rendezvous.announce.keeper import Keeper, MemberLease
from elastic.rendezvous.announce.outage import Outage
from elastic.rendezvous.announce.policy import Limits
from elastic.rendezvous.announce.publisher import Publisher
from elastic.rendezvous.announce.records import Announcement, Round, Trust
from elastic.rendezvous.announce.state import NodeState
from elastic.rendezvous.bootstrap import BootstrapStore
from elastic.rendezvous.contract import MembershipChange
from elastic.rendezvous.fence import FenceSpec
from elastic.rendezvous.keys import RunKeys
from elastic.rendezvous.lease import RunLease
from elastic.rendezvous.ledger import RunLedger
from elastic.rendezvous.options import RendezvousOptions
from elastic.secret import shared_secret

logger = logging.getLogger(__name__)

_RETRY_S = 0.5  # after a failed etcd request in the watch loop
_MIN_LEASE_TTL_S = 2  # etcd's smallest lease TTL with its default election timeout
_local_ids = itertools.count()


class AnnounceRendezvousHandler(RendezvousHandler):
    """torch's RendezvousHandler, plus the agent's seam, on one member key per node.

    Args:
        client: the etcd client (its ``requests`` counter includes keep-alives, which
            :attr:`keepalives` counts apart).
        keys: the run's key layout.
        lease: the run's lease (for the round key and the store; abandoned runs expire).
        store: the run's etcd store; each round uses a prefix of it.
        ledger: the run's ledger (restart budget).
        params: torch's rendezvous parameters.
        options: the parsed options.
        secret: the job's secret, which signs and checks every record (None: unsigned).
    """

    # Each round's bootstrap store is hosted by an agent (rank 0's), so running workers can
    # form a new round's group through it: in-place re-forms (elastic.worker).
    hosts_round_store = True
    _fence = ""
    _keep_open = False  # this node left the job on its own: shutdown() does not close it

    def __init__(
        self,
        client: EtcdClient,
        keys: RunKeys,
        lease: RunLease,
        store: Store,
        ledger: RunLedger,
        params: RendezvousParameters,
        options: RendezvousOptions,
        secret: bytes | None = None,
    ) -> None:
        self._client, self._keys, self._store, self._ledger = client, keys, store, ledger
        self._run_id = params.run_id
        self._min_nodes = params.min_nodes
        self._local_world_size = int(params.get("local_world_size", 1) or 1)
        self._join_timeout = options.join_timeout
        self._addr = params.local_addr or socket.getfqdn()
        self._local_id = next(_local_ids)
        self._name = f"{self._addr}_{os.getpid()}_{self._local_id}"
        trust = Trust(secret, keys.round, self._run_id)
        self._state = NodeState(self._name, self._run_id, trust)
        self._outage = Outage(self._run_id, options.outage_timeout)
        self._parts(client, keys, lease, params, options)
        self._threads: list[threading.Thread] = []
        self._joined_round: int | None = None  # read by bench/rendezvous.py
        self._peers: frozenset[str] = frozenset()
        self._reform_requested = False
        self._bootstrap = BootstrapStore()
        # etcd lost its data (restarted empty): forget its revisions and announce afresh.
        client.on_reset.append(functools.partial(_store_lost, self._state, self._publisher))
        # A handler dropped without shutdown() (torch's own agent tests drop some) must not
        # leave its threads in gRPC: a later fork() then aborts in the child (gRPC skips its
        # fork handlers while other threads are in a call). The threads hold no reference
        # to the handler (_watch_loop is static), so it is collected and this stops them.
        lease_parts = (self._lease, self._ledger)
        self._finalizer = weakref.finalize(
            self, _release, self._state, self._threads, self._keeper, self._bootstrap, lease_parts
        )

    def _parts(
        self,
        client: EtcdClient,
        keys: RunKeys,
        run_lease: RunLease,
        params: RendezvousParameters,
        options: RendezvousOptions,
    ) -> None:
        """The lease, keeper, publisher, follower and closer on the shared state."""
        ttl = max(
            _MIN_LEASE_TTL_S,
            math.ceil(options.keep_alive_interval * options.keep_alive_max_attempt),
        )
        limits = Limits(
            params.min_nodes, params.max_nodes, options.last_call_timeout, options.close_timeout
        )
        state = self._state
        self._lease = MemberLease(client, ttl)
        self._keeper = Keeper(
            client, keys, state, self._lease, self._outage, options.keep_alive_interval, limits
        )
        self._publisher = Publisher(client, keys, run_lease, self._lease, state)
        self._follower = Follower(client, keys, state)
        self._closer = Closer(client, keys, state, self._publisher, limits)

    # -- torch's contract ------------------------------------------------------

    def get_backend(self) -> str:
        return "etcd-v3"

    @property
    def use_agent_store(self) -> bool:
        """Whether this node's workers are clients of a bootstrap store its agent hosts
        (:mod:`elastic.rendezvous.bootstrap`). On other nodes they are clients anyway."""
        return self._bootstrap.hosting

    @property
    def name(self) -> str:
        """This node's name in the rendezvous (address_pid_localid, as torch's)."""
        return self._name

    @property
    def keepalives(self) -> int:
        """etcd requests spent on keep-alives (apart from the client's ``requests``)."""
        return self._keeper.keepalives

    @property
    def is_closer(self) -> bool:
        """Whether this node is the closer now."""
        return self._state.closer

    def get_run_id(self) -> str:
        return self._run_id

    def fence(self) -> str:
        """The commit fence of the round this node joined last (see the contract)."""
        return self._fence

    def next_rendezvous(self) -> RendezvousInfo:
        """Announce this node, wait for a round that takes it in, return its rank."""
        logger.info(
            "The node '%s' attempts to join the next round of the rendezvous '%s'.",
            self._name,
            self._run_id,
        )
        after = -1 if self._joined_round is None else self._joined_round
        self._reform_requested = False
        self._joined_round = None
        deadline = time.monotonic() + self._join_timeout
        self._announce(after)
        self._start_threads()
        return self._join(self._await_round(after, deadline))

    def _await_round(self, after: int, deadline: float) -> Round:
        """Wait for a round newer than ``after`` that takes this node in."""
        state = self._state
        with state.cond:
            while True:
                round_ = state.round
                if round_.closed:
                    raise RendezvousClosedError(
                        f"The rendezvous '{self._run_id}' is closed (the job finished)."
                    )
                if round_.takes(self._name, after):
                    return round_
                self._check_waiting(round_, deadline)
                if state.expired:  # the lease ran out (an outage): announce afresh
                    state.cond.release()
                    try:
                        self._announce(after)
                    finally:
                        state.cond.acquire()
                    continue
                state.cond.wait(min(deadline - time.monotonic(), 1.0))

    def _check_waiting(self, round_: Round, deadline: float) -> None:
        """Raise if this node was shut down or its join_timeout passed."""
        if self._state.stopped.is_set():
            raise RendezvousClosedError(f"The node '{self._name}' was shut down.")
        if deadline - time.monotonic() <= 0:
            raise RendezvousTimeoutError(
                f"The node '{self._name}' found no round of the rendezvous "
                f"'{self._run_id}' within join_timeout={self._join_timeout:g} s "
                f"({len(round_.members)} nodes in the newest round, "
                f"min_nodes={self._min_nodes}); start more nodes or raise the timeout."
            )

    def _join(self, round_: Round) -> RendezvousInfo:
        """Take ``round_`` as this node's round: its rank, store, fence and bootstrap."""
        ranks, number = round_.members, round_.round
        self._joined_round, self._peers = number, frozenset(ranks)
        rank = ranks[self._name]
        self._fence = FenceSpec.for_run(self._client.options, self._keys, number).to_env()
        store = PrefixStore(f"torch.rendezvous.{self._run_id}.{number}", self._store)
        bootstrap = RendezvousStoreInfo(round_.master_addr, round_.master_port)
        self._bootstrap.start_round(rank, bootstrap.master_addr, bootstrap.master_port)
        logger.info(
            "The node '%s' has joined round %d of the rendezvous '%s' as rank %d in a world "
            "of size %d.",
            self._name,
            number,
            self._run_id,
            rank,
            len(ranks),
        )
        events.emit(
            "rdzv.round",
            run_id=self._run_id,
            round=number,
            node=self._name,
            rank=rank,
            world_size=len(ranks),
        )
        return RendezvousInfo(store, rank, len(ranks), bootstrap)

    def is_closed(self) -> bool:
        return self._publisher.is_closed()

    def set_closed(self) -> None:
        """Mark the rendezvous closed: every node's next rendezvous then ends."""
        self._publisher.close_run()

    def round_view(self) -> tuple[int, int, int]:
        """(round, participants, waiting) as this node last saw them; no etcd request (for
        the metrics exporter, read without the lock: a reference read is atomic)."""
        round_, members = self._state.round, self._state.members
        waiting = sum(1 for name in list(members) if name not in round_.members)
        return round_.round, len(round_.members), waiting

    def num_nodes_waiting(self) -> int:
        """torch's contract for any agent: > 0 when the group must re-form."""
        change = self.membership_change()
        return 0 if change is None else max(change.waiting, 1)

    def keep_open(self) -> None:
        """This node leaves the job on its own (the others go on): :meth:`shutdown` then
        releases it without closing the rendezvous."""
        self._keep_open = True

    def shutdown(self) -> bool:
        """Close the rendezvous (the job is done) and release this node; only release it
        when it left the job on its own (:meth:`keep_open`)."""
        try:
            if not self._keep_open:
                self.set_closed()
            return True
        except Exception as exc:
            logger.warning("The node '%s' could not close the rendezvous: %s", self._name, exc)
            return False
        finally:
            self.close()

    # -- the agent's seam ------------------------------------------------------

    def request_reform(self) -> None:
        """Make the agent re-rendezvous at its next check (a planned change of membership)."""
        self._reform_requested = True

    def membership_change(self) -> MembershipChange | None:
        """Whether the group must re-form now, and why; None while the round is the job.

        Local only: the background watch keeps the round key's view current
        (:func:`.policy.membership_change` decides).
        """
        if not self._outage.check():
            return None
        with self._state.cond:
            round_, expired = self._state.round, self._state.expired
        if round_.closed:
            # The job is finishing (torch's launcher closes the rendezvous when a node's run
            # ends): a re-form could only end in RendezvousClosedError, so the nodes still
            # running finish their workers (torch's agent test workers_drift_fail).
            return None
        return policy.membership_change(
            round_,
            me=self._name,
            joined=self._joined_round,
            peers=self._peers,
            expired=expired,
            requested=self._reform_requested,
        )

    def running_in_place(self, round_: int | None) -> None:
        """Note the round this node's workers run in place (None: none); the closer reads it."""
        with self._state.cond:
            self._state.in_place_round = round_

    def record_failed_round(self) -> int | None:
        """Count this round's failure in the job-wide ledger; None before any round."""
        if self._joined_round is None:
            return None
        return self._ledger.record_failed_round(self._joined_round)

    def leave(self, timeout: float = 10.0) -> None:
        """Leave now: delete this node's key, so the others need not wait for its lease."""
        del timeout  # one delete; the client's request timeout bounds it
        started = time.monotonic()
        self._stop_threads()
        self._lease.revoke()
        seconds = time.monotonic() - started
        events.emit("node.leave", run_id=self._run_id, node=self._name, seconds=round(seconds, 3))
        logger.info(
            "The node '%s' left the rendezvous '%s' in %.2f s.", self._name, self._run_id, seconds
        )

    def close(self) -> None:
        """Stop the background threads, drop this node's key, close the probe port and client."""
        self._finalizer()  # _release
        self._state.watch = WatchHandle()

    # -- announcing and the threads --------------------------------------------

    def _announce(self, after: int) -> None:
        """Write this node's key (see :meth:`.publisher.Publisher.announce`)."""
        listener = self._keeper.listener
        if listener is None:
            raise RendezvousClosedError(f"The node '{self._name}' was shut down.")
        announcement = Announcement(
            addr=self._addr,
            pid=os.getpid(),
            local_id=self._local_id,
            probe=listener.port,
            port=self._bootstrap.reserve(self._addr),  # held until the round
            after=after,
            local_world_size=self._local_world_size,
        )
        with self._state.cond:
            unwatched = not self._state.mine_rev  # the watch does not follow our key
        if self._publisher.announce(announcement):
            self._follower.find_pred()  # the read did not look below our key
        if unwatched:  # end it: our announcement may have made this node the closer
            self._state.watch.interrupt(self._state.watch.current_id)

    def _start_threads(self) -> None:
        if self._threads:
            return
        self._state.stopped.clear()
        # No target is a method of the handler (see the finalizer in __init__).
        watch = (self._state, self._closer, self._follower, self._outage)
        loops: list[tuple[Callable[..., None], tuple[object, ...], str]] = [
            (_watch_loop, watch, "announce-watch"),
            (self._keeper.probe_loop, (), "announce-live"),
            (self._keeper.lease_loop, (), "announce-lease"),
        ]
        for target, args, name in loops:
            thread = threading.Thread(target=target, args=args, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def _stop_threads(self) -> None:
        _stop(self._state, self._threads)
        self._state.watch = WatchHandle()


def _stop(state: NodeState, threads: list[threading.Thread]) -> None:
    """Stop a handler's threads (ends its watch at once) and wait for them."""
    state.stopped.set()
    state.probe_now.set()
    state.watch.cancel()
    with state.cond:
        state.cond.notify_all()
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join(timeout=5)
    threads.clear()


def _release(
    state: NodeState,
    threads: list[threading.Thread],
    keeper: Keeper,
    bootstrap: BootstrapStore,
    lease_parts: tuple[MemberLease, RunLedger],
) -> None:
    """What a handler holds outside itself: its threads, this node's key, its probe port,
    bootstrap store and etcd client (the ledger's close). Run once, by close() or when a
    handler is dropped (or at exit)."""
    lease, ledger = lease_parts
    _stop(state, threads)
    with contextlib.suppress(Exception):
        lease.revoke()
    keeper.close()
    bootstrap.close()
    ledger.close()


def _store_lost(state: NodeState, publisher: Publisher, reason: str) -> None:
    """etcd lost its data (:mod:`elastic.etcd.reset`; called in the thread whose request saw
    it): forget every revision, end the watch in flight, and announce afresh, so the closer
    publishes a round numbered after the newest one this node knew (the workers re-form)."""
    with state.cond:
        round_ = state.round.round
        state.forget_store()
    publisher.forget()
    state.watch.interrupt(state.watch.current_id)
    logger.warning(
        "etcd lost the data of the rendezvous '%s' (%s); the node '%s' announces again, and "
        "the next round comes after round %d.",
        state.run_id,
        reason,
        state.name,
        round_,
    )
    events.emit("etcd.reset", run_id=state.run_id, node=state.name, round=round_, reason=reason)


def _watch_loop(state: NodeState, closer: Closer, follower: Follower, outage: Outage) -> None:
    """Follow the round key (and the predecessor, or as the closer every member)."""
    stopped = state.stopped
    while not stopped.is_set():
        try:
            step = closer.step if state.closer else follower.step
            if step():  # etcd answered (not merely a watch that ran out)
                outage.record(None)
        except REQUEST_ERRORS as exc:
            if stopped.is_set():
                return
            logger.debug("The rendezvous watch failed: %s", exc)
            outage.record(exc)
            stopped.wait(_RETRY_S)
        except Exception:
            if stopped.is_set():
                return
            logger.exception("The rendezvous loop of '%s' failed; retrying.", state.name)
            stopped.wait(_RETRY_S)


def build_announce_handler(
    params: RendezvousParameters, options: RendezvousOptions, client: EtcdClient | None = None
) -> AnnounceRendezvousHandler:
    """The ``announce`` handler and its run storage on one etcd client; its records are
    signed with ``$ELASTIC_SECRET_FILE``'s secret if set (:func:`elastic.secret.shared_secret`)."""
    from datetime import timedelta

    from elastic.rendezvous.store import EtcdStore

    client = client or EtcdClient(options.etcd_options(params.endpoint))
    keys = RunKeys(options.prefix, params.run_id)
    lease = RunLease(client, options.ttl)
    lease.id()
    store = EtcdStore(client, keys, lease, timeout=timedelta(seconds=options.store_timeout))
    ledger = RunLedger(client, keys, lease)
    secret = shared_secret()
    return AnnounceRendezvousHandler(
        client, keys, lease, store, ledger, params, options, secret=secret
    )


__all__ = ["AnnounceRendezvousHandler", "build_announce_handler"]
