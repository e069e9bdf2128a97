"""The ``announce`` rendezvous: one key per node, one closer, O(1) etcd requests per node.

Chosen with ``--rdzv-conf algorithm=announce``. The ``single-key`` handler
(:mod:`elastic.rendezvous.handler`) keeps every node's join and heartbeat in one pickled
key updated by compare-and-set: N joiners and N heartbeating nodes race on one key, so a
round costs O(N) writes per node. Here:

* **Announce.** A node joining a round writes its own key
  ``<prefix>/<run>/announce/members/<node>`` (JSON: address, pid, probe port, a bootstrap
  port, and ``after``: the round it leaves behind) on its *own* lease, in one
  transaction that also reads the round key and its predecessor (the next-older member
  key). Liveness is that lease's keep-alive: no raft write per heartbeat, and a node
  whose agent is gone loses its key when the lease expires.
* **Close.** The node with the oldest member key (lowest ``create_revision``) is the
  closer. It reads the members once, then follows them with one prefix watch. Once
  ``min_nodes`` are ready and the last call has passed (or ``max_nodes`` are ready, or
  the round only re-forms the previous one and all its live members, and the newcomers
  it named in ``joining``, are back: the early close, as :mod:`elastic.rendezvous.rounds`
  does for single-key), it publishes
  ``<prefix>/<run>/announce/round`` (JSON: round, members -> rank, rank 0's address
  and bootstrap port, where its agent hosts the round's bootstrap store:
  :mod:`elastic.rendezvous.bootstrap`) in one transaction, fenced by the round key's
  ``mod_revision``, by its own member key (a closer whose lease expired cannot publish)
  and by the commit fence: the same transaction advances the fence
  (:mod:`elastic.rendezvous.fence`), so a round is never visible before its fence.
* **Wait.** Everybody else watches the round key and its predecessor's key in one watch:
  a published round wakes each node once; a death wakes only the dead node's successor
  (no herd). A node whose predecessor vanished looks for the next older one; with none
  left it is the closer.
* **A running round.** The closer publishes into the round key how many nodes wait
  (``waiting``: new nodes, and members that asked for a new round) and which members
  lost their key (``lost``); the others learn it from their watch, so
  :meth:`AnnounceRendezvousHandler.membership_change` is a pure, local query.
* **Deaths.** Each node probes its predecessor (the closer: the newest member and, while
  a round waits for them, up to 8 of the members not yet ready) every 1-2 s (a quarter
  of the lease TTL), and at once when a round is published or its predecessor changes,
  through :mod:`elastic.rendezvous.liveness`; a refused probe on a port that accepted
  before deletes the dead node's key at once. (Probing only on the tick let a node killed
  within a tick of its round stay unverified, so its key lived until its lease expired.)
  The lease's keep-alive runs in a thread of its own, so a slow etcd request delays
  neither the probes nor the renewal. A slow but alive node keeps its key as long as its
  keep-alive thread gets a turn once per ``keep_alive_interval * keep_alive_max_attempt``
  (the lease TTL), and it answers probes, so nobody reaps it.
* **Joins.** A node that arrives after a round closed is not in it. The round trains on
  through the newcomer's last call: the closer counts it in ``waiting`` (the running group
  sees JOINERS and stops) only once ``last_call_timeout`` has passed since the first
  newcomer not yet published arrived (newcomers arriving meanwhile share that call; the
  newcomer's agent and workers get ready meanwhile, so even one that fills the round to
  ``max_nodes`` is held), or at once if the round must re-form anyway (a member lost or
  asking for one). The round key then names them in ``joining``, and
  the next round closes as soon as every live member and every named newcomer has
  announced: no second last call. A node that arrives after that publication is left
  for the following round (the wait list), and gets its last call while that one trains.
* **Stale members.** A member left out of a round by ``close_timeout`` while it still ran
  the previous one (hung, or dead without a verified probe port) is listed in the round
  key's ``stale`` (name -> its key's ``mod_revision``); it is no joiner until it
  announces again, so a new round is not re-formed at once to take in a dead node.
* **Outages.** Requests ride out an unreachable etcd as :class:`EtcdClient` does; a node
  whose lease expired meanwhile finds itself DROPPED and rejoins with a fresh lease.

etcd cost per node per round: a joiner makes one transaction and one watch; the closer
adds one prefix read when it takes the role, one watch per wake and one publishing
transaction. Keep-alives are one request per node per ``keep_alive_interval``,
independent of rounds (counted apart in :attr:`AnnounceRendezvousHandler.keepalives`).

The round key is JSON, never unpickled; whoever can write etcd can still forge a round
(as with the unsigned single-key state), so protect etcd with TLS and auth.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
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
from elastic.errors import EtcdConnectionError
from elastic.etcd import client as etcd_client
from elastic.etcd.client import EtcdClient, compare_absent, compare_mod, op_get, op_put
from elastic.etcd.server import free_port
from elastic.rendezvous.bootstrap import BootstrapStore
from elastic.rendezvous.contract import ChangeKind, MembershipChange
from elastic.rendezvous.fence import FenceSpec, _compare_less, _round_bytes, high_key
from elastic.rendezvous.keys import RunKeys
from elastic.rendezvous.lease import RunLease
from elastic.rendezvous.ledger import RunLedger
from elastic.rendezvous.liveness import DeathDetector, ProbeListener
from elastic.rendezvous.options import RendezvousOptions

logger = logging.getLogger(__name__)

etcdrpc = etcd_client.etcdrpc
_DELETE = 1  # mvccpb.Event.EventType.DELETE
PROBE_EVERY_S = 1.0  # probes go every quarter lease TTL, from this to twice this
_PROBES_PER_TICK = 8  # the closer probes at most this many nodes each time
_IDLE_WATCH_S = 60.0  # a watch with nothing to wait for is renewed this often
_RETRY_S = 0.5  # after a failed etcd request in the background loop
_MIN_LEASE_TTL_S = 2  # etcd's smallest lease TTL with its default election timeout
_local_ids = itertools.count()


@dataclass(frozen=True)
class Member:
    """One node's announcement, as read from its member key."""

    name: str
    create_revision: int
    mod_revision: int
    addr: str
    pid: int
    local_id: int
    probe: int
    port: int
    after: int  # the round this node left behind when it announced (-1: none)
    local_world_size: int = 1

    @property
    def order(self) -> tuple[str, int, int]:
        """torch's rank order (its node descriptors sort by address, pid, local id)."""
        return self.addr, self.pid, self.local_id


def decode_member(kv: Any, prefix: bytes) -> Member | None:
    """A member key's announcement; None (with a warning) for a value we cannot read."""
    name = kv.key[len(prefix) :].decode(errors="replace")
    try:
        data = json.loads(kv.value)
        return Member(
            name=name,
            create_revision=kv.create_revision,
            mod_revision=kv.mod_revision,
            addr=str(data["addr"]),
            pid=int(data["pid"]),
            local_id=int(data["local_id"]),
            probe=int(data["probe"]),
            port=int(data["port"]),
            after=int(data["after"]),
            local_world_size=int(data.get("local_world_size", 1)),
        )
    except (ValueError, KeyError, TypeError) as exc:
        logger.warning("Ignoring the unreadable member key '%s' (%s).", kv.key.decode(), exc)
        return None


def decode_round(value: bytes) -> dict[str, Any]:
    """The round key's JSON; an empty round for an absent or unreadable one."""
    if not value:
        return {}
    try:
        doc = json.loads(value)
    except ValueError:
        logger.warning("The round key holds no JSON; treating it as no round yet.")
        return {}
    return doc if isinstance(doc, dict) else {}


def _range_op(key: bytes, **kwargs: Any) -> Any:
    return etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=key, **kwargs))


def _older_than(prefix: bytes, create_revision: int | None) -> Any:
    """A range op: the newest member keys, created before ``create_revision`` if given
    (then one), else the two newest (the caller's own fresh key and its predecessor)."""
    kwargs: dict[str, Any] = {
        "range_end": etcd_client._prefix_end(prefix),
        "sort_order": etcdrpc.RangeRequest.DESCEND,
        "sort_target": etcdrpc.RangeRequest.CREATE,
        "limit": 2,
    }
    if create_revision:
        kwargs.update(limit=1, max_create_revision=create_revision - 1)
    return _range_op(prefix, **kwargs)


class _Stream:
    """The watch stream in flight, so that :meth:`cancel` can end it from another thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stream: Any = None
        self._cancelled = False

        self.current_id = 0  # how many streams were set: identifies the current one

    def set(self, stream: Any) -> None:
        with self._lock:
            self._stream = stream
            self.current_id += 1
            if self._cancelled:
                stream.cancel()

    def interrupt(self, stream_id: int) -> None:
        """End stream number ``stream_id`` if it is still the current one (a deadline)."""
        with self._lock:
            if self._stream is not None and self.current_id == stream_id:
                self._stream.cancel()

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            if self._stream is not None:
                self._stream.cancel()


def watch(
    client: EtcdClient,
    creates: list[Any],
    timeout: float,
    on_events: Callable[[int, list[Any]], bool],
    holder: _Stream,
) -> bool:
    """Watch several keys or ranges on one stream (one request) for up to ``timeout``.

    ``on_events(index, events)`` gets each batch (``index``: which create) and returns True
    to end the watch. Returns False when the history was compacted (re-read everything).
    """

    def once(conn: Any, _t: float) -> bool:
        done = threading.Event()

        def requests() -> Any:
            for create in creates:
                yield etcdrpc.WatchRequest(create_request=create)
            done.wait()

        stream = conn.watch.Watch(requests(), timeout=timeout, metadata=conn.metadata)
        holder.set(stream)
        ids: dict[int, int] = {}
        try:
            for response in stream:
                if response.created and response.watch_id not in ids:
                    ids[response.watch_id] = len(ids)
                if response.compact_revision or response.canceled:
                    return False
                if response.events and on_events(ids.get(response.watch_id, 0), response.events):
                    return True
            return True
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED or etcd_client._is_deadline(exc):
                return True
            raise
        finally:
            done.set()
            stream.cancel()

    return bool(client.call(once))


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
    """

    def __init__(
        self,
        client: EtcdClient,
        keys: RunKeys,
        lease: RunLease,
        store: Store,
        ledger: RunLedger,
        params: RendezvousParameters,
        options: RendezvousOptions,
    ) -> None:
        self._client = client
        self._keys = keys
        self._run_lease = lease
        self._store = store
        self._ledger = ledger
        self._run_id = params.run_id
        self._min_nodes = params.min_nodes
        self._max_nodes = params.max_nodes
        self._local_world_size = int(params.get("local_world_size", 1) or 1)
        self._interval = options.keep_alive_interval
        self._ttl = max(
            _MIN_LEASE_TTL_S,
            math.ceil(options.keep_alive_interval * options.keep_alive_max_attempt),
        )
        self._join_timeout = options.join_timeout
        self._last_call = options.last_call_timeout
        self._close_timeout = options.close_timeout
        self._outage_timeout = options.outage_timeout
        self._addr = params.local_addr or socket.getfqdn()
        self._local_id = next(_local_ids)
        self._name = f"{self._addr}_{os.getpid()}_{self._local_id}"
        self._key = keys.members + self._name.encode()
        self._listener: ProbeListener | None = ProbeListener()
        self._ports: dict[str, int] = {}
        self._detector = DeathDetector(lambda: dict(self._ports))
        self._cond = threading.Condition()
        self._stream = _Stream()
        self._stopped = threading.Event()
        self._probe_now = threading.Event()  # wakes the probe thread (new peers to watch)
        self._threads: list[threading.Thread] = []
        # This node's announcement.
        self._member_lease = 0
        self._create_rev = 0
        self._expired = False
        self._announced = False
        # The newest round, and the revisions each watched key was seen at.
        self._doc: dict[str, Any] = {}
        self._doc_rev = 0  # the round key's mod_revision (0: absent)
        self._round_seen = 0  # the revision the round key is known up to
        self._pred: Member | None = None
        self._pred_seen = 0
        # Only the closer: every member, and when the ready set last changed.
        self._closer = False
        self._members: dict[str, Member] = {}
        self._members_seen = 0
        self._high: int | None = None  # the fence's high mark (None: absent)
        self._last_change = time.monotonic()
        self._first_ready: float | None = None
        self._held_since: float | None = None  # the first newcomer not yet in `waiting`
        self._probe_turn = 0
        # The agent's view.
        self._joined_round: int | None = None
        self._peers: frozenset[str] = frozenset()
        self._reform_requested = False
        self._outage_since: float | None = None
        self._bootstrap = BootstrapStore()
        self.keepalives = 0  # etcd requests spent on keep-alives

    # -- torch's contract ------------------------------------------------------

    def get_backend(self) -> str:
        return "etcd-v3"

    # Each round's bootstrap store is hosted by an agent (rank 0's), so running workers can
    # form a new round's group through it: in-place re-forms (elastic.inplace).
    hosts_round_store = True
    _fence = ""

    @property
    def use_agent_store(self) -> bool:
        """Whether this node's workers are clients of a bootstrap store its agent hosts
        (:mod:`elastic.rendezvous.bootstrap`). On other nodes they are clients anyway."""
        return self._bootstrap.hosting

    @property
    def name(self) -> str:
        """This node's name in the rendezvous (address_pid_localid, as torch's)."""
        return self._name

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
        with self._cond:
            while True:
                doc = self._doc
                if doc.get("closed"):
                    raise RendezvousClosedError(
                        f"The rendezvous '{self._run_id}' is closed (the job finished)."
                    )
                if int(doc.get("round", -1)) > after and self._name in doc.get("members", {}):
                    break
                if self._stopped.is_set():
                    raise RendezvousClosedError(f"The node '{self._name}' was shut down.")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RendezvousTimeoutError(
                        f"The node '{self._name}' found no round of the rendezvous "
                        f"'{self._run_id}' within join_timeout={self._join_timeout:g} s "
                        f"({len(doc.get('members', {}))} nodes in the newest round, "
                        f"min_nodes={self._min_nodes}); start more nodes or raise the timeout."
                    )
                if self._expired:  # the lease ran out (an outage): announce afresh
                    self._cond.release()
                    try:
                        self._announce(after)
                    finally:
                        self._cond.acquire()
                    continue
                self._cond.wait(min(remaining, 1.0))
        round_ = int(doc["round"])
        ranks: dict[str, int] = doc["members"]
        self._joined_round = round_
        self._peers = frozenset(ranks)
        rank = ranks[self._name]
        self._fence = FenceSpec.for_run(self._client.options, self._keys, round_).to_env()
        store = PrefixStore(f"torch.rendezvous.{self._run_id}.{round_}", self._store)
        bootstrap = RendezvousStoreInfo(str(doc["master_addr"]), int(doc["master_port"]))
        self._bootstrap.start_round(rank, bootstrap.master_addr, bootstrap.master_port)
        logger.info(
            "The node '%s' has joined round %d of the rendezvous '%s' as rank %d in a world "
            "of size %d.",
            self._name,
            round_,
            self._run_id,
            rank,
            len(ranks),
        )
        events.emit(
            "rdzv.round",
            run_id=self._run_id,
            round=round_,
            node=self._name,
            rank=rank,
            world_size=len(ranks),
        )
        return RendezvousInfo(store, rank, len(ranks), bootstrap)

    def is_closed(self) -> bool:
        kvs = self._client.range(self._keys.round).kvs
        return bool(kvs and decode_round(kvs[0].value).get("closed"))

    def set_closed(self) -> None:
        """Mark the rendezvous closed: every node's next rendezvous then ends."""
        key = self._keys.round
        kvs = self._client.range(key).kvs
        while True:
            doc = decode_round(kvs[0].value) if kvs else {}
            if doc.get("closed"):
                return
            doc["closed"] = True
            compare = compare_mod(key, kvs[0].mod_revision) if kvs else compare_absent(key)
            put = op_put(key, json.dumps(doc).encode(), self._run_lease.id())
            response = self._client.txn([compare], [put], [op_get(key)])
            if response.succeeded:
                return
            kvs = response.responses[0].response_range.kvs

    def round_view(self) -> tuple[int, int, int]:
        """(round, participants, waiting) as this node last saw them; no etcd request (for
        the metrics exporter, read without the lock: a reference read is atomic)."""
        doc, members = self._doc, self._members
        ranks = doc.get("members", {})
        waiting = sum(1 for name in list(members) if name not in ranks)
        return int(doc.get("round", -1)), len(ranks), waiting

    def num_nodes_waiting(self) -> int:
        """torch's contract for any agent: > 0 when the group must re-form."""
        change = self.membership_change()
        return 0 if change is None else max(change.waiting, 1)

    def shutdown(self) -> bool:
        """Close the rendezvous (the job is done) and release this node."""
        try:
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

        Local only: the background watch keeps the round key's view current.
        """
        if not self._outage_ok():
            return None
        with self._cond:
            doc, expired = self._doc, self._expired
        waiting = int(doc.get("waiting", 0))
        if self._reform_requested:
            return MembershipChange(ChangeKind.REQUESTED, self._joined_round, waiting=waiting)
        if self._joined_round is None:
            return None
        round_ = int(doc.get("round", -1))
        if expired or round_ != self._joined_round or self._name not in doc.get("members", {}):
            return MembershipChange(ChangeKind.DROPPED, self._joined_round, (self._name,))
        gone = self._peers & set(doc.get("lost", ()))
        if gone:
            return MembershipChange(ChangeKind.PEERS_LOST, round_, tuple(sorted(gone)))
        if waiting:
            return MembershipChange(ChangeKind.JOINERS, round_, waiting=waiting)
        return None

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
        self._revoke()
        seconds = time.monotonic() - started
        events.emit("node.leave", run_id=self._run_id, node=self._name, seconds=round(seconds, 3))
        logger.info(
            "The node '%s' left the rendezvous '%s' in %.2f s.", self._name, self._run_id, seconds
        )

    def close(self) -> None:
        """Stop the background threads, drop this node's key, close the probe port and client."""
        self._stop_threads()
        with contextlib.suppress(Exception):
            self._revoke()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._bootstrap.close()
        self._ledger.close()

    # -- announcing ------------------------------------------------------------

    def _announce(self, after: int) -> None:
        """Write this node's key (one transaction that also reads the round and the
        predecessor); grant a fresh lease first if there is none or it expired."""
        listener = self._listener
        if listener is None:
            raise RendezvousClosedError(f"The node '{self._name}' was shut down.")
        value = json.dumps(
            {
                "addr": self._addr,
                "pid": os.getpid(),
                "local_id": self._local_id,
                "probe": listener.port,
                "port": free_port(""),
                "after": after,
                "local_world_size": self._local_world_size,
            }
        ).encode()
        for _ in range(3):
            if not self._member_lease or self._expired:
                self._member_lease = self._client.grant(self._ttl)
                self._create_rev = 0
                with self._cond:
                    self._expired = False
            try:
                response = self._client.txn(
                    [],
                    [
                        op_put(self._key, value, self._member_lease),
                        op_get(self._keys.round),
                        _older_than(self._keys.members, self._create_rev),
                        op_get(self._key),
                    ],
                    [],
                )
                break
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:  # "requested lease not found"
                    raise
                self._expired = True
        else:
            raise EtcdConnectionError(
                f"The node '{self._name}' could not announce itself: its etcd lease kept "
                "expiring; check etcd's health and the keep_alive_* options."
            )
        revision = response.header.revision
        round_kvs = response.responses[1].response_range.kvs
        older = [
            m
            for kv in response.responses[2].response_range.kvs
            if (m := decode_member(kv, self._keys.members)) is not None
        ]
        mine = response.responses[3].response_range.kvs
        created = mine[0].create_revision if mine else revision
        with self._cond:
            recreated = bool(self._create_rev) and created != self._create_rev
            self._create_rev = created
            older = [m for m in older if m.name != self._name][:1]
            if not recreated:
                self._set_pred(older[0] if older else None, revision)
            self._set_doc(
                round_kvs[0].value if round_kvs else b"",
                round_kvs[0].mod_revision if round_kvs else 0,
                revision,
            )
            self._announced = True
            if self._closer:
                self._last_change = time.monotonic()
        if recreated:  # our key was deleted (reaped) and written anew: we are the newest
            self._find_pred()

    def _set_pred(self, pred: Member | None, revision: int) -> None:
        if pred != self._pred:
            self._probe_now.set()
        self._pred = pred
        self._pred_seen = revision
        if pred is not None:
            self._ports[pred.name] = pred.probe
        elif not self._closer:
            self._closer = True
            self._members_seen = 0  # read them all once
            logger.info("The node '%s' is the closer of '%s'.", self._name, self._run_id)
        if pred is not None and self._closer:
            self._closer = False  # an older node is back (after an outage of ours)

    def _set_doc(self, value: bytes, mod_revision: int, seen: int = 0) -> None:
        """Take a view of the round key, unless it is older than the one held (a read that
        raced with a newer event or with our own publish)."""
        self._round_seen = max(self._round_seen, seen)
        if mod_revision < self._doc_rev or (not mod_revision and self._doc_rev):
            return
        self._doc = decode_round(value)
        self._doc_rev = mod_revision
        self._probe_now.set()  # a new round: see its peers accept while they are alive
        self._cond.notify_all()

    def _revoke(self) -> None:
        if self._member_lease:
            lease, self._member_lease = self._member_lease, 0
            request = etcdrpc.LeaseRevokeRequest(ID=lease)
            self._client.call(
                lambda c, t: c.lease.LeaseRevoke(request, timeout=t, metadata=c.metadata)
            )

    # -- background ------------------------------------------------------------

    def _start_threads(self) -> None:
        if self._threads:
            return
        self._stopped.clear()
        for target, name in (
            (self._loop, "announce-watch"),
            (self._monitor, "announce-live"),
            (self._keeper, "announce-lease"),
        ):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def _stop_threads(self) -> None:
        self._stopped.set()
        self._probe_now.set()
        self._stream.cancel()
        with self._cond:
            self._cond.notify_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5)
        self._threads = []
        self._stream = _Stream()

    def _outage(self, exc: Exception | None) -> None:
        """Record an etcd failure (or, with None, success) of a background request."""
        if exc is None:
            if self._outage_since is not None:
                seconds = time.monotonic() - self._outage_since
                logger.warning("etcd is reachable again after %.1f s.", seconds)
                events.emit("etcd.reachable", run_id=self._run_id, seconds=round(seconds, 3))
                self._outage_since = None
            return
        if self._outage_since is None:
            self._outage_since = time.monotonic()
            logger.warning(
                "etcd is unreachable (%s); training goes on, and this node gives up if etcd "
                "is still unreachable after %.0f s (rdzv-conf outage_timeout).",
                exc,
                self._outage_timeout,
            )
            events.emit("etcd.unreachable", run_id=self._run_id)

    def _outage_ok(self) -> bool:
        """False while etcd is unreachable; raise once that lasted past outage_timeout."""
        since = self._outage_since
        if since is None:
            return True
        seconds = time.monotonic() - since
        if seconds > self._outage_timeout:
            raise EtcdConnectionError(
                f"etcd has been unreachable for {seconds:.0f} s, longer than "
                f"outage_timeout={self._outage_timeout:.0f} s; check the etcd cluster, then "
                "restart the agents (the checkpoints are safe)."
            )
        return False

    def _keeper(self) -> None:
        """Keep this node's lease alive (a thread of its own: a probe or a reap that waits
        on a slow etcd must not delay the renewal, nor a slow renewal the probes)."""
        while not self._stopped.wait(self._interval):
            try:
                self._keep_alive()
            except (EtcdConnectionError, grpc.RpcError) as exc:
                self._outage(exc)
            except Exception:
                logger.exception("The keep-alive thread of '%s' failed; retrying.", self._name)

    def _monitor(self) -> None:
        """Probe the peers this node watches over: every quarter lease TTL (1-2 s), and at
        once when they change (a new round, a new predecessor), so that a peer is seen
        accepting before it can die: a refusal only counts from a port that accepted."""
        probe_every = min(max(PROBE_EVERY_S, self._ttl / 4), 2 * PROBE_EVERY_S)
        while not self._stopped.is_set():
            self._probe_now.wait(probe_every)
            self._probe_now.clear()
            if self._stopped.is_set():
                return
            try:
                self._probe_watched()
            except (EtcdConnectionError, grpc.RpcError) as exc:
                self._outage(exc)
            except Exception:
                logger.exception("The liveness thread of '%s' failed; retrying.", self._name)

    def _keep_alive(self) -> None:
        if not self._member_lease or self._expired:
            return
        self.keepalives += 1
        if self._client.keepalive(self._member_lease) <= 0:
            logger.warning(
                "The etcd lease of node '%s' expired (an etcd outage, or this node was too "
                "slow to renew it); it will rejoin.",
                self._name,
            )
            with self._cond:
                self._expired = True
                self._cond.notify_all()
        self._outage(None)

    def _probe_watched(self) -> None:
        unready: list[Member] = []
        with self._cond:
            if self._closer:
                others = [m for m in self._members.values() if m.name != self._name]
                newest = max(others, key=lambda m: m.create_revision, default=None)
                targets = [newest] if newest is not None else []
                # A few of the members a round waits for at each tick, in turn: a probe
                # blocks up to PROBE_TIMEOUT_S, and this thread also renews our lease.
                unready = sorted(self._unready_members(), key=lambda m: m.create_revision)
                if unready:
                    start = self._probe_turn % len(unready)
                    targets += (unready[start:] + unready[:start])[: _PROBES_PER_TICK - 1]
                    self._probe_turn += _PROBES_PER_TICK - 1
            else:
                targets = [self._pred] if self._pred is not None else []
        targets = [m for m in {m.name: m for m in targets}.values() if m is not None]
        if not targets:
            return
        pairs = [(m.name, m.addr) for m in targets]
        self._detector.verify(pairs)
        suspects = [m.name for m in unready] if self._closer else []
        dead = set(self._detector.dead(pairs, recheck=suspects))
        for member in targets:
            if member.name in dead:
                self._reap(member)

    def _reap(self, member: Member) -> None:
        """Delete a dead node's key (only the incarnation that was probed)."""
        key = self._keys.members + member.name.encode()
        compare = etcdrpc.Compare(
            key=key,
            result=etcdrpc.Compare.EQUAL,
            target=etcdrpc.Compare.CREATE,
            create_revision=member.create_revision,
        )
        delete = etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(key=key))
        if self._client.txn([compare], [delete], []).succeeded:
            logger.warning(
                "The agent of '%s' is gone (its probe port refuses connections); removed it "
                "from the rendezvous without waiting for its lease to expire.",
                member.name,
            )
            events.emit("node.dead", run_id=self._run_id, nodes=[member.name], evidence="probe")

    def _loop(self) -> None:
        """Follow the round key (and the predecessor, or as the closer every member)."""
        while not self._stopped.is_set():
            try:
                if self._closer:
                    self._close_step()
                else:
                    self._follow_step()
                self._outage(None)
            except (EtcdConnectionError, grpc.RpcError) as exc:
                if self._stopped.is_set():
                    return
                logger.debug("The rendezvous watch failed: %s", exc)
                self._outage(exc)
                self._stopped.wait(_RETRY_S)
            except Exception:
                if self._stopped.is_set():
                    return
                logger.exception("The rendezvous loop of '%s' failed; retrying.", self._name)
                self._stopped.wait(_RETRY_S)

    def _follow_step(self) -> None:
        with self._cond:
            pred, round_from, pred_from = self._pred, self._round_seen + 1, self._pred_seen + 1
        creates = [etcdrpc.WatchCreateRequest(key=self._keys.round, start_revision=round_from)]
        if pred is not None:
            creates.append(
                etcdrpc.WatchCreateRequest(
                    key=self._keys.members + pred.name.encode(), start_revision=pred_from
                )
            )
        pred_gone = False

        def on_events(index: int, batch: list[Any]) -> bool:
            nonlocal pred_gone
            with self._cond:
                if index == 0:
                    last = batch[-1]
                    self._set_doc(last.kv.value, last.kv.mod_revision, last.kv.mod_revision)
                else:
                    self._pred_seen = max(e.kv.mod_revision for e in batch)
                    pred_gone = any(e.type == _DELETE for e in batch)
            return pred_gone or index == 0

        if not watch(self._client, creates, _IDLE_WATCH_S, on_events, self._stream):
            self._resync()
        elif pred_gone:
            self._find_pred()

    def _find_pred(self) -> None:
        response = self._client.txn([], [_older_than(self._keys.members, self._create_rev)], [])
        kvs = response.responses[0].response_range.kvs
        pred = decode_member(kvs[0], self._keys.members) if kvs else None
        with self._cond:
            self._set_pred(pred, response.header.revision)

    def _resync(self) -> None:
        """The watched history was compacted: read the round key and predecessor again."""
        response = self._client.txn(
            [], [op_get(self._keys.round), _older_than(self._keys.members, self._create_rev)], []
        )
        round_kvs = response.responses[0].response_range.kvs
        kvs = response.responses[1].response_range.kvs
        with self._cond:
            self._set_doc(
                round_kvs[0].value if round_kvs else b"",
                round_kvs[0].mod_revision if round_kvs else 0,
            )
            self._round_seen = response.header.revision
            self._set_pred(decode_member(kvs[0], self._keys.members) if kvs else None, 0)
            self._pred_seen = response.header.revision
            if self._closer:
                self._members_seen = 0

    # -- the closer ------------------------------------------------------------

    def _read_members(self) -> None:
        """The closer's one read of every member key (and of the fence's high mark)."""
        response = self._client.txn(
            [],
            [
                _range_op(
                    self._keys.members, range_end=etcd_client._prefix_end(self._keys.members)
                ),
                op_get(self._keys.round),
                op_get(high_key(self._keys)),
            ],
            [],
        )
        members = {
            m.name: m
            for kv in response.responses[0].response_range.kvs
            if (m := decode_member(kv, self._keys.members)) is not None
        }
        round_kvs = response.responses[1].response_range.kvs
        high = response.responses[2].response_range.kvs
        with self._cond:
            self._members = members
            self._ports.update({m.name: m.probe for m in members.values()})
            self._members_seen = response.header.revision
            self._set_doc(
                round_kvs[0].value if round_kvs else b"",
                round_kvs[0].mod_revision if round_kvs else 0,
            )
            self._round_seen = response.header.revision
            self._high = int(high[0].value) if high else None
            self._last_change = time.monotonic()
        older = [m for m in members.values() if m.create_revision < self._create_rev]
        if older:  # not the oldest after all (a stale view): follow again
            with self._cond:
                self._set_pred(max(older, key=lambda m: m.create_revision), self._members_seen)

    def _ready(self) -> tuple[list[Member], list[Member]]:
        """(ready, running): live nodes that want a new round, and members of the
        newest round that still run it. A stale node (:meth:`_stale`) is neither."""
        doc = self._doc
        round_ = int(doc.get("round", -1))
        current = doc.get("members", {})
        ready, running = [], []
        for member in self._members.values():
            if member.after >= round_ or (member.name not in current and not self._stale(member)):
                ready.append(member)
            elif member.name in current:
                running.append(member)
        return ready, running

    def _stale(self, member: Member) -> bool:
        """Whether ``member`` was left out of the newest round while it still ran the one
        before, and has not announced since: dead with its death not proven (no probe
        answer; its key lives until its lease expires) or too slow to see the new round.
        It is no joiner: taking it in would make the next round wait for a dead node.
        Once it announces again (it saw that it was dropped) it is ready as any node."""
        stale = self._doc.get("stale", {})
        return isinstance(stale, dict) and stale.get(member.name) == member.mod_revision

    def _early(self, ready: list[Member], running: list[Member]) -> list[Member] | None:
        """The early close: the open round only re-forms the newest one (with the newcomers
        its ``joining`` named), and every one of them still alive (its key neither reaped
        as dead, nor revoked by a leave, nor expired) has announced again. No one else is
        coming, so the round needs no second last call: the named newcomers had theirs
        while the round ran. Its participants, or None (a run's first round, or someone
        missing). A newcomer not named waits for the next round (the wait list), where it
        gets its last call while that round trains."""
        previous = self._doc.get("members")
        if not previous or running or not ready:
            return None
        expected = (set(previous) | set(self._joining())) & set(self._members)
        chosen = [m for m in ready if m.name in expected]
        if len(chosen) != len(expected) or len(chosen) < self._min_nodes:
            return None
        return chosen

    def _joining(self) -> list[str]:
        joining = self._doc.get("joining", [])
        return [str(name) for name in joining] if isinstance(joining, list) else []

    def _unready_members(self) -> list[Member]:
        """Members still running the old round while others wait for a new one."""
        ready, running = self._ready()
        return running if ready else []

    def _decide(self, now: float) -> tuple[str, float]:
        """What the closer does now: ("publish"|"update"|"wait", seconds to wait)."""
        ready, running = self._ready()
        doc = self._doc
        lost = sorted(set(doc.get("members", {})) - set(self._members))
        held = self._hold(ready, now)
        # A full round that nobody asked to leave goes on; newcomers wait for room, and
        # train on through their last call (the hold) before the running round hears.
        candidates = ready if not running or self._waiting(ready, lost, now) else []
        if not doc.get("closed") and len(candidates) >= self._min_nodes:
            if self._first_ready is None:
                self._first_ready = now
            if len(ready) >= self._max_nodes or self._early(ready, running) is not None:
                return "publish", 0.0
            quiet = self._last_change + self._last_call - now
            patience = self._first_ready + self._close_timeout - now
            if quiet <= 0 and (not running or patience <= 0):
                return "publish", 0.0
            left = quiet if quiet > 0 else patience
            if self._news(ready, running, lost, now):
                return "update", left
            return "wait", left
        if not candidates:
            self._first_ready = None
        # Wake when the newcomers' last call ends (the running round must hear of them).
        wait_s = held if running and held is not None and held > 0 else _IDLE_WATCH_S
        if self._news(ready, running, lost, now):
            return "update", wait_s
        return "wait", wait_s

    def _news(
        self, ready: list[Member], running: list[Member], lost: list[str], now: float
    ) -> bool:
        """Whether the running round must hear of waiting nodes or lost members (only a
        change of "anyone waiting?" counts, so a burst of joiners is one write)."""
        doc = self._doc
        if lost != doc.get("lost", []):
            return True
        waiting = self._waiting(ready, lost, now)
        return bool(running) and bool(doc.get("waiting")) != bool(waiting)

    def _newcomers(self, ready: list[Member]) -> list[Member]:
        """Ready nodes outside the newest round that its ``joining`` does not name yet."""
        current, named = self._doc.get("members", {}), set(self._joining())
        return [m for m in ready if m.name not in current and m.name not in named]

    def _hold(self, ready: list[Member], now: float) -> float | None:
        """Seconds left of the newcomers' last call (it runs from the first newcomer not
        yet published; later ones share it); None with no newcomer."""
        if not self._newcomers(ready):
            self._held_since = None
            return None
        if self._held_since is None:
            self._held_since = now
        return self._held_since + self._last_call - now

    def _released(self, ready: list[Member], lost: list[str], now: float) -> list[Member]:
        """The newcomers the running round hears of now: none while their last call runs
        and the round is healthy (training goes on, and the newcomer gets ready: its
        agent's fork server imports torch), all of them once it passed, and at once when
        the round must re-form anyway (a member lost or asking for a new round). One that
        would fill the round to ``max_nodes`` is held too: the bench's join (1:3, the
        third node) paused 1.38 s median with it released at once, 0.6-0.8 s held."""
        newcomers = self._newcomers(ready)
        if not newcomers:
            return []
        current = self._doc.get("members", {})
        if len(current) >= self._max_nodes and not lost:
            return []  # a full round goes on: they wait, as torch's redundancy list
        asked = any(m.name in current for m in ready)
        since = self._held_since if self._held_since is not None else now
        if lost or asked or now - since >= self._last_call:
            return newcomers
        return []

    def _waiting(self, ready: list[Member], lost: list[str], now: float) -> int:
        """Ready nodes a new round could take: members that asked for one, the newcomers
        ``joining`` names, and those released now (:meth:`_released`)."""
        current, named = self._doc.get("members", {}), set(self._joining())
        asked = sum(1 for m in ready if m.name in current)
        joining = sum(1 for m in ready if m.name in named)
        return asked + joining + len(self._released(ready, lost, now))

    def _close_step(self) -> None:
        if not self._members_seen:
            self._read_members()
            if not self._closer:
                return
        with self._cond:
            action = self._decide(time.monotonic())[0]
        if action == "publish":
            self._publish()
            return
        if action == "update":
            self._update()
        self._closer_watch()

    def _closer_watch(self) -> None:
        with self._cond:
            creates = [
                etcdrpc.WatchCreateRequest(
                    key=self._keys.members,
                    range_end=etcd_client._prefix_end(self._keys.members),
                    start_revision=self._members_seen + 1,
                ),
                etcdrpc.WatchCreateRequest(
                    key=self._keys.round, start_revision=self._round_seen + 1
                ),
            ]
            before, wait_s = self._decide(time.monotonic())

        def on_events(index: int, batch: list[Any]) -> bool:
            with self._cond:
                if index == 1:
                    last = batch[-1]
                    self._set_doc(last.kv.value, last.kv.mod_revision, last.kv.mod_revision)
                    return True
                for event in batch:
                    name = event.kv.key[len(self._keys.members) :].decode(errors="replace")
                    self._members_seen = max(self._members_seen, event.kv.mod_revision)
                    if event.type == _DELETE:
                        self._members.pop(name, None)
                        if name == self._name:
                            self._expired = True
                            self._closer = False
                            self._cond.notify_all()
                            return True
                    elif (member := decode_member(event.kv, self._keys.members)) is not None:
                        self._members[name] = member
                        self._ports[name] = member.probe
                        if member.name in self._doc.get("members", {}):
                            # A member asks for a new round: probe the ones that still run
                            # the old one now (one may be dead), not at the next tick.
                            self._probe_now.set()
                now = self._last_change = time.monotonic()
                action, left = self._decide(now)
                if action != before or before == "publish":
                    return True
                if now + left < deadline[0] - 0.01:  # the wait got shorter: end it sooner
                    deadline[0] = now + left
                    timers.append(threading.Timer(left, self._stream.interrupt, (stream,)))
                    timers[-1].daemon = True
                    timers[-1].start()
                return False

        wait_s = max(wait_s, 0.05)
        deadline = [time.monotonic() + wait_s]
        timers: list[threading.Timer] = []
        stream = self._stream.current_id + 1  # the stream this watch will open
        try:
            if not watch(self._client, creates, wait_s, on_events, self._stream):
                self._members_seen = 0  # compacted: read everything again
        finally:
            for timer in timers:
                timer.cancel()

    def _round_doc(
        self, round_: int, chosen: list[Member], stale: dict[str, int]
    ) -> dict[str, Any]:
        ordered = sorted(chosen, key=lambda m: m.order)
        ranks = {m.name: rank for rank, m in enumerate(ordered)}
        return {
            "round": round_,
            "members": ranks,
            "master_addr": ordered[0].addr,
            "master_port": ordered[0].port,
            "closer": self._name,
            "waiting": 0,
            "joining": [],
            "lost": [],
            "stale": stale,
        }

    def _fenced_put(self, doc: dict[str, Any], high: int | None) -> Any:
        """One transaction: the round key (if unchanged), guarded by this node's key, and
        with a new round the commit fence (if ``high`` is given)."""
        key = self._keys.round
        compares = [
            compare_mod(key, self._doc_rev) if self._doc_rev else compare_absent(key),
            etcdrpc.Compare(
                key=self._key,
                result=etcdrpc.Compare.EQUAL,
                target=etcdrpc.Compare.CREATE,
                create_revision=self._create_rev,
            ),
        ]
        puts = [op_put(key, json.dumps(doc).encode(), self._run_lease.id())]
        if high is not None:
            value = _round_bytes(high)
            fence_high = high_key(self._keys)
            compares.append(
                compare_absent(fence_high)
                if self._high is None
                else _compare_less(fence_high, value)
            )
            puts += [op_put(fence_high, value), op_put(self._keys.fence, value)]
        response = self._client.txn(
            compares, puts, [op_get(key), op_get(high_key(self._keys)), op_get(self._key)]
        )
        if not response.succeeded:
            round_kvs = response.responses[0].response_range.kvs
            high_kvs = response.responses[1].response_range.kvs
            mine = response.responses[2].response_range.kvs
            with self._cond:
                self._set_doc(
                    round_kvs[0].value if round_kvs else b"",
                    round_kvs[0].mod_revision if round_kvs else 0,
                )
                self._high = int(high_kvs[0].value) if high_kvs else None
                if not mine or mine[0].create_revision != self._create_rev:
                    self._expired = True
                    self._closer = False
                    self._cond.notify_all()
        return response

    def _publish(self) -> None:
        with self._cond:
            ready, running = self._ready()
            early = self._early(ready, running)
            pool = early if early is not None and len(ready) < self._max_nodes else ready
            chosen = sorted(pool, key=lambda m: m.create_revision)[: self._max_nodes]
            round_ = int(self._doc.get("round", -1)) + 1
            if self._high is not None:
                round_ = max(round_, self._high + 1)
            # Members left behind while still running (close_timeout passed) are stale
            # until they announce again, as are those already stale.
            stale = {
                m.name: m.mod_revision
                for m in self._members.values()
                if m in running or self._stale(m)
            }
            doc = self._round_doc(round_, chosen, stale)  # the rest wait: the round is full
        response = self._fenced_put(doc, round_)
        if not response.succeeded:
            return
        with self._cond:
            self._high = round_
            revision = response.header.revision
            self._set_doc(json.dumps(doc).encode(), revision, revision)
            self._first_ready = None
            self._last_change = time.monotonic()
        logger.info(
            "The closer '%s' published round %d of '%s' with %d nodes.",
            self._name,
            round_,
            self._run_id,
            len(chosen),
        )

    def _update(self) -> None:
        """Tell the running round how many nodes wait and which members were lost."""
        with self._cond:
            ready, _ = self._ready()
            now = time.monotonic()
            doc = dict(self._doc)
            doc["lost"] = sorted(set(doc.get("members", {})) - set(self._members))
            released = [m.name for m in self._released(ready, doc["lost"], now)]
            doc["waiting"] = self._waiting(ready, doc["lost"], now)
            doc["joining"] = sorted({*self._joining(), *released})
        response = self._fenced_put(doc, None)
        if response.succeeded:
            with self._cond:
                revision = response.header.revision
                self._set_doc(json.dumps(doc).encode(), revision, revision)


def announce_status(client: EtcdClient, keys: RunKeys) -> dict[str, Any]:
    """The run's announce rendezvous in the shape of
    :func:`elastic.tools.status.rendezvous_status` (which reads the single-key state only):
    the round key and every member key in one read, and each member's lease for how long
    ago it was renewed (its heartbeat). ``{"exists": False}`` when neither key exists."""
    response = client.txn(
        [],
        [
            op_get(keys.round),
            _range_op(keys.members, range_end=etcd_client._prefix_end(keys.members)),
        ],
        [],
    )
    round_kvs = response.responses[0].response_range.kvs
    member_kvs = response.responses[1].response_range.kvs
    if not round_kvs and not member_kvs:
        return {"exists": False}
    doc = decode_round(round_kvs[0].value) if round_kvs else {}
    ranks: dict[str, int] = doc.get("members", {})
    round_ = int(doc.get("round", -1))
    stale = doc.get("stale", {}) if isinstance(doc.get("stale"), dict) else {}
    members = []
    for kv in member_kvs:
        member = decode_member(kv, keys.members)
        if member is None:
            continue
        if member.name in ranks and member.after < round_:
            state = f"rank {ranks[member.name]}"
        elif stale.get(member.name) == member.mod_revision:
            state = "stale"
        else:
            state = "joining"
        members.append(
            {
                "node": member.name,
                "addr": member.addr,
                "pid": member.pid,
                "state": state,
                "last_heartbeat_s_ago": _renewed_s_ago(client, kv.lease),
            }
        )
    return {
        "exists": True,
        "algorithm": "announce",
        "round": round_,
        "complete": bool(ranks),
        "closed": bool(doc.get("closed")),
        "world_size": len(ranks),
        "waiting": int(doc.get("waiting", 0)),
        "members": members,
    }


def _renewed_s_ago(client: EtcdClient, lease: int) -> float:
    """Seconds since ``lease`` was last renewed (its granted TTL less the TTL left)."""
    request = etcdrpc.LeaseTimeToLiveRequest(ID=lease)
    answer = client.call(
        lambda c, t: c.lease.LeaseTimeToLive(request, timeout=t, metadata=c.metadata)
    )
    return float(answer.grantedTTL - max(answer.TTL, 0))


# The agent (elastic/agent/node.py) looks for the etcd-v3 handler's class; this handler offers
# the same seam (membership_change, request_reform, leave, record_failed_round).


def build_announce_handler(
    params: RendezvousParameters, options: RendezvousOptions, client: EtcdClient | None = None
) -> AnnounceRendezvousHandler:
    """The ``announce`` handler and its run storage on one etcd client."""
    from datetime import timedelta

    from elastic.rendezvous.store import EtcdStore

    client = client or EtcdClient(options.etcd_options(params.endpoint))
    keys = RunKeys(options.prefix, params.run_id)
    lease = RunLease(client, options.ttl)
    lease.id()
    store = EtcdStore(client, keys, lease, timeout=timedelta(seconds=options.store_timeout))
    ledger = RunLedger(client, keys, lease)
    return AnnounceRendezvousHandler(client, keys, lease, store, ledger, params, options)


__all__ = [
    "PROBE_EVERY_S",
    "AnnounceRendezvousHandler",
    "Member",
    "announce_status",
    "build_announce_handler",
    "decode_member",
    "decode_round",
    "watch",
]
