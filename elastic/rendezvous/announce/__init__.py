"""The ``announce`` rendezvous: one key per node, one closer, O(1) etcd requests per node.

Chosen with ``--rdzv-conf algorithm=announce`` (the default). ``single-key`` (torch's stock
handler on our backend, :mod:`elastic.rendezvous.handler`) keeps every node's join and
heartbeat in one pickled key updated by compare-and-set: N joiners and N heartbeating nodes
race on one key, so a round costs O(N) writes per node. Here:

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
  it named in ``joining``, are back: the early close), it publishes
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
  asking for one) or runs in place on the closer's node (its agent says so,
  :meth:`AnnounceRendezvousHandler.running_in_place`: the ranks train on until the
  newcomer's workers are ready, so a last call would only delay the join). The round key
  then names them in ``joining``, and the next round closes as soon as every live member
  and every named newcomer has announced: no second last call. A node that arrives after
  that publication is left for the following round (the wait list), and gets its last
  call while that one trains (none once that round runs in place).
* **Stale members.** A member left out of a round by ``close_timeout`` while it still ran
  the previous one (hung, or dead without a verified probe port) is listed in the round
  key's ``stale`` (name -> its key's ``mod_revision``); it is no joiner until it
  announces again, so a new round is not re-formed at once to take in a dead node.
* **Outages.** Requests ride out an unreachable etcd as :class:`EtcdClient` does; a node
  whose lease expired meanwhile finds itself DROPPED and rejoins with a fresh lease. It learns
  that from its keep-alive or at once from its watch, which follows its own key too: a node
  without a key is no closer. An outage longer than the lease expires every key at once; the
  first node to announce again is then the oldest, hence the closer, and its own
  announcement (on the agent's thread) ends its watch thread's follower watch, so the new
  round forms as soon as every node is back.

etcd cost per node per round: a joiner makes one transaction and one watch; the closer
adds one prefix read when it takes the role, one watch per wake and one publishing
transaction (and, in a run's first round, one that creates the round key empty: a signed
round is never the key's first version, see records.py). Keep-alives are one request per
node per ``keep_alive_interval``, independent of rounds (counted apart in
:attr:`AnnounceRendezvousHandler.keepalives`).

Both records are JSON, never unpickled. With a job secret (``$ELASTIC_SECRET_FILE``, the
same file on every node) each is signed (:class:`.records.Trust`: HMAC-SHA256 over the key
and every field, the bootstrap address and port and ``closed`` included): a member key
written without the secret gets no rank (one warning and an ``rdzv.untrusted`` event per
key), and a round not signed by the job is refused (read as no round), so a forged
``closed`` flag ends nothing. Without a secret everything works as before, unsigned, and
whoever can write etcd can join or forge a round: protect etcd with TLS and auth either way
(a writer can still delete keys; a signed record written back is refused, each record being
signed for the etcd write it is: see records.py).

The modules, one concept each: :mod:`.records` (the two records, decoded once),
:mod:`.policy` (the closer's rules and the agent's question, pure), :mod:`.state` (what a
node knows, under one lock), :mod:`.publisher` (every write of an announcement or a round),
:mod:`.follower` and :mod:`.closer` (the watch thread's two roles), :mod:`.keeper` (lease,
probes, reaper), :mod:`.outage`, :mod:`.status` (``elastic status``) and :mod:`.handler`.
"""

from elastic.etcd.client import EtcdClient
from elastic.rendezvous.announce.handler import AnnounceRendezvousHandler, build_announce_handler
from elastic.rendezvous.announce.keeper import PROBE_EVERY_S
from elastic.rendezvous.announce.records import Member, Round, decode_member, decode_round
from elastic.rendezvous.announce.status import announce_status

# Watch several keys on one stream: now EtcdClient.watch_many(client, targets, timeout,
# on_events, handle), kept under its old name.
watch = EtcdClient.watch_many

__all__ = [
    "PROBE_EVERY_S",
    "AnnounceRendezvousHandler",
    "Member",
    "Round",
    "announce_status",
    "build_announce_handler",
    "decode_member",
    "decode_round",
    "watch",
]
