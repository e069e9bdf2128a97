"""The announce rendezvous' two records in etcd, typed, decoded and validated once.

* A **member key** ``announce/members/<node>`` holds a node's :class:`Announcement` (JSON:
  address, pid, local id, probe port, bootstrap port, the round it leaves behind, its local
  world size); read back with its key's revisions it is a :class:`Member`.
* The **round key** ``announce/round`` holds the newest :class:`Round` (JSON: round, node ->
  rank, rank 0's address and bootstrap port, the closer, and for the running round
  ``waiting``, ``joining``, ``lost`` and ``stale``; ``closed`` once the job finished).

With a job secret (``$ELASTIC_SECRET_FILE``: :func:`elastic.secret.shared_secret`) every
record is signed (:class:`Trust`: HMAC-SHA256 under a domain string, over the key and every
field, the bootstrap address and port and the ``closed`` flag included), and a record that
is unsigned or signed with another secret is not trusted: such a member gets no rank (one
warning and an ``rdzv.untrusted`` event per member key), such a round is refused and read as
no round. Without a secret, records are written unsigned and every readable one is trusted,
as before: then whoever can write etcd can join a round or forge one (protect etcd with TLS
and auth).

Replay: the key a signature covers names the run and the node (or the round key), so a
record written back under another key is not trusted. A member's signature also covers the
etcd lease it is written on (one per agent start, re-granted after an expiry): once its
agent is gone, its lease is gone, and its record written back on any other lease (or none)
gets no rank. Both signatures also cover ``at``: the key's ``create_revision`` and
``version`` (etcd's count of writes since the key was created) that the write produces,
which its writer knows because it writes by compare-and-set on the version it read
(:mod:`.publisher`). etcd's history is what nobody can rewrite: any later write of the key
moves its version on, and a deleted key comes back with a newer ``create_revision``, so a
record is trusted only as the very write it was signed for (:func:`written_at`). A record
written back, even on its node's still-live lease, or into the round key of an agent that
holds no round yet, is refused as replayed, with no extra etcd request and whatever etcd
compacted (the check reads only the key's own revisions). The round key's first version is
never a signed round (its writer cannot know the revision it will be created at): the
closer creates it empty first (no round), once per run. A member key's first version is
signed for ``(0, 1)`` (any first version): the one replay left is a live node's *first*
announcement on its lease, written back after its key was deleted (deleting keys is what
such a writer can do anyway: see docs/operations.md's threat model).

A record that is not what we write is reported in one sentence naming the key
(:class:`~elastic.errors.EtcdStateError` from :func:`parse_round` and :func:`parse_member`);
the lenient :func:`decode_round` and :func:`decode_member` log that sentence and read an
unreadable round as no round yet and skip an unreadable member, as the rendezvous must.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from elastic import events
from elastic.errors import EtcdStateError
from elastic.etcd.client import KeyValue
from elastic.secret import sign, verify

logger = logging.getLogger(__name__)

T = TypeVar("T")

MEMBER_DOMAIN = b"elastic-announce-member-v3\0"  # v2: the lease; v3: ``at`` is signed too
ROUND_DOMAIN = b"elastic-announce-round-v3\0"  # v3: ``at`` instead of v2's ``rev``
_SIG = "sig"  # the field that holds a record's signature
_AT = "at"  # a signed record's field: the key's [create_revision, version] of its write
UNKNOWN = (0, 0)  # ``at`` of a record not read from etcd (nor written there)


@dataclass(frozen=True)
class Announcement:
    """What a node writes into its member key as it joins a round."""

    addr: str
    pid: int
    local_id: int
    probe: int  # its agent's probe port (liveness)
    port: int  # the bootstrap store's port, should it be rank 0
    after: int  # the round this node left behind when it announced (-1: none)
    local_world_size: int = 1

    def document(self) -> dict[str, Any]:
        return asdict(self)

    def encode(self) -> bytes:
        """The record unsigned (:meth:`Trust.seal` signs it)."""
        return json.dumps(self.document()).encode()


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


@dataclass(frozen=True)
class Round:
    """The round key: the newest round, and what its running members must hear."""

    round: int = -1  # -1: no round yet
    members: Mapping[str, int] = field(default_factory=dict)  # node -> rank
    master_addr: str = ""
    master_port: int = 0
    closer: str = ""
    waiting: int = 0  # nodes a new round could take now (the running round re-forms)
    joining: tuple[str, ...] = ()  # newcomers named for the next round
    lost: tuple[str, ...] = ()  # members whose key vanished
    stale: Mapping[str, int] = field(default_factory=dict)  # left out: node -> mod_revision
    asked: tuple[str, ...] = ()  # members that asked for a new round (announced again)
    closed: bool = False  # the job finished

    def document(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "round": self.round,
            "members": dict(self.members),
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "closer": self.closer,
            "waiting": self.waiting,
            "joining": list(self.joining),
            "lost": list(self.lost),
            "stale": dict(self.stale),
        }
        if self.asked:
            doc["asked"] = list(self.asked)
        if self.closed:
            doc["closed"] = True
        return doc

    def encode(self) -> bytes:
        """The record unsigned (:meth:`Trust.seal` signs it)."""
        return json.dumps(self.document()).encode()

    def takes(self, name: str, after: int) -> bool:
        """Whether this round is newer than ``after`` and has ``name`` among its members."""
        return self.round > after and name in self.members


NO_ROUND = Round()


class Trust:
    """The job's secret on the records: signs what this node writes, checks what it reads.

    Args:
        secret: the job's secret; None: records are unsigned and all trusted (as before).
        round_key: the run's round key (a round's signature covers it).
        run_id: the run (for the ``rdzv.untrusted`` event).
    """

    def __init__(self, secret: bytes | None, round_key: bytes, run_id: str = "") -> None:
        self.secret, self._round_key, self._run_id = secret, round_key, run_id
        self._warned: set[tuple[bytes, int]] = set()  # untrusted member keys, incarnations
        self._lock = threading.Lock()

    def seal(
        self,
        key: bytes,
        record: Announcement | Round,
        *,
        lease: int = 0,
        at: tuple[int, int] = UNKNOWN,
    ) -> bytes:
        """``record`` as written into ``key``, signed if there is a secret: for the key's
        ``at`` (its ``create_revision`` and ``version`` once written: :func:`written_at`)
        and, for an announcement, for the etcd ``lease`` it is written on."""
        doc = record.document()
        if self.secret is not None:
            doc[_AT] = list(at)
            if isinstance(record, Round):
                doc[_SIG] = sign(self.secret, _content(key, doc), ROUND_DOMAIN)
            else:
                doc[_SIG] = sign(self.secret, _content(key, doc, lease), MEMBER_DOMAIN)
        return json.dumps(doc).encode()

    def signed_at(
        self, key: bytes, value: bytes, domain: bytes, lease: int | None = None
    ) -> tuple[int, int] | None:
        """The ``at`` that ``value`` (a JSON object) is signed for by this job, for ``key``
        (and, for a member, the ``lease`` it is on); None if it is not signed by the job.
        Without a secret, :data:`ANY` (everything is trusted)."""
        if self.secret is None:
            return ANY
        try:
            doc = json.loads(value)
        except ValueError:
            return None
        if not isinstance(doc, dict):
            return None
        signature = doc.pop(_SIG, None)
        if not verify(self.secret, _content(key, doc, lease), signature, domain):
            return None
        at = doc.get(_AT)
        if not (isinstance(at, list) and len(at) == 2 and all(type(n) is int for n in at)):
            return None  # we never sign one without it
        return at[0], at[1]

    def signed(self, key: bytes, value: bytes, domain: bytes, lease: int | None = None) -> bool:
        """Whether ``value`` carries this job's signature for ``key`` (and, for a member,
        for the ``lease`` it is on), whatever write it was signed for."""
        return self.signed_at(key, value, domain, lease) is not None

    def round_verdict(self, value: bytes, at: tuple[int, int]) -> str:
        """ "" if the round key's ``value``, read at ``at``, is trusted; else why not:
        "unsigned" or "replayed" (signed by the job for another write of the key)."""
        signed = self.signed_at(self._round_key, value, ROUND_DOMAIN)
        if signed is None:
            return "unsigned"
        return "" if signed in (ANY, at) else "replayed"

    def admits_member(self, kv: KeyValue, member: Member) -> bool:
        """Whether a member key is signed by the job for the lease it is on and for the
        write it holds; warns once per key incarnation (a replay: once per write)."""
        signed = self.signed_at(kv.key, kv.value, MEMBER_DOMAIN, kv.lease)
        if signed in (ANY, written_at(kv, member=True)):
            return True
        replayed = signed is not None
        with self._lock:
            mark = (kv.key, kv.mod_revision if replayed else -kv.create_revision)
            first = mark not in self._warned
            self._warned.add(mark)
        if first and replayed:
            logger.warning(
                "The member key '%s' (address %s) holds a record this job signed for another "
                "write of that key (an old announcement written back: replayed); it is not "
                "believed. Its node announces afresh at its next round; find who else can "
                "write etcd.",
                kv.key.decode(errors="replace"),
                member.addr,
            )
        elif first:
            logger.warning(
                "The member key '%s' (address %s) is not signed by this job's secret; it gets "
                "no rank (a forged key, or an old record written back on another lease). Every "
                "node of the job must share $ELASTIC_SECRET_FILE; delete the key if nobody of "
                "this job wrote it.",
                kv.key.decode(errors="replace"),
                member.addr,
            )
        if first:
            events.emit("rdzv.untrusted", run_id=self._run_id, node=member.name)
        return False


ANY = (-1, -1)  # :meth:`Trust.signed_at` without a secret: any write


def written_at(kv: KeyValue, member: bool = False) -> tuple[int, int]:
    """The ``at`` a trusted record read as ``kv`` must be signed for: the key's
    ``create_revision`` and ``version``; for a member key's first version ``(0, 1)`` (its
    writer cannot know the revision it creates the key at), and :data:`UNKNOWN` for a
    record with no version (not read from etcd)."""
    if not kv.version or (member and kv.version == 1):
        return 0, kv.version
    return kv.create_revision, kv.version


def _content(key: bytes, doc: Mapping[str, Any], lease: int | None = None) -> bytes:
    """What a signature covers: the key, a member's lease, and every field, canonically."""
    bound = key if lease is None else key + b"\0lease=" + str(lease).encode()
    return bound + b"\0" + json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def parse_round(value: bytes) -> Round:
    """The round key's value (empty: no round yet).

    Raises:
        EtcdStateError: the value is not a round as this module writes it.
    """
    if not value:
        return NO_ROUND
    doc = _json_object(value, "The round key")
    return Round(
        round=_get(doc, "round", int, -1, "The round key"),
        members=_str_map(doc, "members", "The round key"),
        master_addr=_get(doc, "master_addr", str, "", "The round key"),
        master_port=_get(doc, "master_port", int, 0, "The round key"),
        closer=_get(doc, "closer", str, "", "The round key"),
        waiting=_get(doc, "waiting", int, 0, "The round key"),
        joining=_str_tuple(doc, "joining", "The round key"),
        lost=_str_tuple(doc, "lost", "The round key"),
        asked=_str_tuple(doc, "asked", "The round key"),
        stale=_str_map(doc, "stale", "The round key"),
        closed=_get(doc, "closed", bool, False, "The round key"),
    )


def decode_round(value: bytes, trust: Trust | None = None, at: tuple[int, int] = UNKNOWN) -> Round:
    """:func:`parse_round`, but an unreadable round, or one that ``trust`` does not admit
    (not signed by the job, or signed for another write than the one read at ``at``:
    :func:`written_at`, replayed), is no round yet (with a warning)."""
    try:
        round_ = parse_round(value)
    except EtcdStateError as exc:
        logger.warning("%s Treating it as no round yet.", exc)
        return NO_ROUND
    if not value or trust is None:
        return round_
    verdict = trust.round_verdict(value, at)
    if verdict == "unsigned":
        logger.warning(
            "The round key is not signed by this job's secret (written by someone outside "
            "the job, or a node with another $ELASTIC_SECRET_FILE); refusing it as no round."
        )
        return NO_ROUND
    if verdict:
        logger.warning(
            "The round key holds round %d, signed by this job for another write of that key "
            "(an old record written back: replayed); refusing it as no round (the closer "
            "publishes a fresh one over it).",
            round_.round,
        )
        return NO_ROUND
    return round_


def round_of(kv: KeyValue, trust: Trust | None = None) -> Round:
    """:func:`decode_round` of the round key as read (``kv``)."""
    return decode_round(kv.value, trust, written_at(kv))


def parse_member(kv: KeyValue, prefix: bytes) -> Member:
    """A member key's announcement, with the key's revisions.

    Raises:
        EtcdStateError: the value is not an announcement as this module writes it.
    """
    what = f"The member key '{kv.key.decode(errors='replace')}'"
    doc = _json_object(kv.value, what)
    return Member(
        name=kv.key[len(prefix) :].decode(errors="replace"),
        create_revision=kv.create_revision,
        mod_revision=kv.mod_revision,
        addr=_get(doc, "addr", str, None, what),
        pid=_get(doc, "pid", int, None, what),
        local_id=_get(doc, "local_id", int, None, what),
        probe=_get(doc, "probe", int, None, what),
        port=_get(doc, "port", int, None, what),
        after=_get(doc, "after", int, None, what),
        local_world_size=_get(doc, "local_world_size", int, 1, what),
    )


def decode_member(kv: KeyValue, prefix: bytes, trust: Trust | None = None) -> Member | None:
    """:func:`parse_member`; None (with a warning) for a value we cannot read or that
    ``trust`` does not admit (not signed by the job)."""
    try:
        member = parse_member(kv, prefix)
    except EtcdStateError as exc:
        logger.warning("%s Ignoring it.", exc)
        return None
    if trust is not None and not trust.admits_member(kv, member):
        return None
    return member


def decode_members(kvs: list[KeyValue], prefix: bytes, trust: Trust | None = None) -> list[Member]:
    """The readable, trusted members of ``kvs`` (the others are logged and skipped)."""
    return [m for kv in kvs if (m := decode_member(kv, prefix, trust)) is not None]


def _json_object(value: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(value)
    except ValueError as exc:
        raise EtcdStateError(f"{what} holds no JSON ({exc}); delete it.") from exc
    if not isinstance(doc, dict):
        raise EtcdStateError(f"{what} holds JSON that is no object; delete it.")
    return doc


def _get(doc: dict[str, Any], name: str, kind: type[T], default: T | None, what: str) -> T:
    if name not in doc and default is not None:
        return default
    value = doc.get(name)
    # bool is an int in Python, but no int field of ours takes one (nor a float).
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise EtcdStateError(
            f"{what} has no {kind.__name__} '{name}' (it holds {value!r}); delete it."
        )
    return value


def _str_map(doc: dict[str, Any], name: str, what: str) -> dict[str, int]:
    value = _get(doc, name, dict, {}, what)
    if not all(isinstance(k, str) and type(v) is int for k, v in value.items()):
        raise EtcdStateError(f"{what} has a '{name}' that maps names to non-integers; delete it.")
    return value


def _str_tuple(doc: dict[str, Any], name: str, what: str) -> tuple[str, ...]:
    value = _get(doc, name, list, [], what)
    if not all(isinstance(item, str) for item in value):
        raise EtcdStateError(f"{what} has a '{name}' that lists non-names; delete it.")
    return tuple(value)


__all__ = [
    "ANY",
    "MEMBER_DOMAIN",
    "NO_ROUND",
    "ROUND_DOMAIN",
    "UNKNOWN",
    "Announcement",
    "Member",
    "Round",
    "Trust",
    "decode_member",
    "decode_members",
    "decode_round",
    "parse_member",
    "parse_round",
    "round_of",
    "written_at",
]
