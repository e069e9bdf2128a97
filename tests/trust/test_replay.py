"""A signed announce record written back into etcd later is not trusted (no replay).

With a job secret, a member record's signature covers its key (so its run and node) and
the lease it was written on: once its agent is gone, the lease is gone, and the record
written back, on another lease or none, or under another key, gets no rank (one warning
and an ``rdzv.untrusted`` event). Both records' signatures also cover the key's
create_revision and version that their write produced (``at``): a record written back
moves the version on (or, after a delete, comes with a newer create_revision), so it is
refused even by an agent that holds no round yet, and even on a live node's own lease.

On a real etcd with in-process announce handlers (tests/rendezvous/test_announce.py); the
attacker writes straight into etcd with the etcd client, as in test_membership_trust.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastic.etcd.client import EtcdClient, KeyValue, key_value
from elastic.etcd.server import EtcdServer
from elastic.rendezvous.announce.records import (
    NO_ROUND,
    UNKNOWN,
    Announcement,
    Round,
    Trust,
    decode_member,
    round_of,
)
from elastic.rendezvous.announce.state import NodeState
from tests.helpers import wait_until
from tests.rendezvous.test_announce import Nodes, join_all, pause
from tests.trust.test_membership_trust import keys_of


@pytest.fixture
def events_log(job_secret: Path) -> Path:
    """The event log of a job with a secret (the secret file is beside it)."""
    return job_secret.parent / "events.jsonl"


@pytest.fixture
def run(etcd: EtcdServer, run_id: str, events_log: Path) -> Iterator[Nodes]:
    nodes = Nodes(etcd, run_id, "2:3")
    yield nodes
    nodes.close()


def untrusted(log: Path) -> set[str]:
    if not log.exists():
        return set()
    kinds = [json.loads(line) for line in log.read_text().splitlines()]
    return {e["node"] for e in kinds if e["kind"] == "rdzv.untrusted"}


def test_a_departed_members_record_written_back_gets_no_rank(
    run: Nodes, client: EtcdClient, events_log: Path
) -> None:
    handlers = run.add(3)
    join_all(handlers)
    a, b, gone = handlers
    keys = keys_of(a)
    captured = client.range(keys.members + gone.name.encode()).kvs[0].value
    assert "sig" in json.loads(captured)  # a validly signed record of round N
    gone.close()  # its agent stops: its lease is revoked, its key vanishes
    wait_until(
        lambda: all(h.membership_change() is not None for h in (a, b)), 20, "the loss to show"
    )
    infos = join_all([a, b])  # round N+1, without it
    assert {i.world_size for i in infos.values()} == {2}
    lease = client.grant(30)
    client.put(keys.members + gone.name.encode(), captured, lease)  # written back
    client.put(keys.members + b"127.0.0.1_1_0", captured)  # under another node's key
    wait_until(
        lambda: {gone.name, "127.0.0.1_1_0"} <= untrusted(events_log),
        20,
        "the replayed records to be reported untrusted",
    )
    pause(1.5)  # more than the last call: a trusted newcomer would be counted by now
    assert all(h.membership_change() is None for h in (a, b))
    closer = next(h for h in (a, b) if h._state.closer)
    assert gone.name not in closer._state.members
    assert gone.name not in a._state.round.members


def test_an_older_round_record_written_back_is_refused(
    run: Nodes,
    client: EtcdClient,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first = run.add(2)
    join_all(first)
    keys = keys_of(first[0])
    old = client.range(keys.round).kvs[0].value  # round N, validly signed
    old_round = json.loads(old)["round"]
    handlers = first + run.add(1)
    join_all(handlers)  # round N+1, with a third node
    assert all(h._state.round.round > old_round for h in handlers)
    taken: list[tuple[str, int, int]] = []  # (node, round, revision): every round a node takes
    set_round = NodeState.set_round

    def spy(
        state: NodeState, round_: Round, mod_revision: int, seen: int = 0, at: Any = UNKNOWN
    ) -> None:
        taken.append((state.name, round_.round, mod_revision))
        set_round(state, round_, mod_revision, seen, at)

    monkeypatch.setattr(NodeState, "set_round", spy)
    replayed = int(client.put(keys.round, old).header.revision)
    wait_until(  # a follower may read the replay and the closer's next round in one batch
        lambda: {n for n, _, rev in taken if rev >= replayed} == {h.name for h in handlers},
        20,
        "every node to read the replayed round (or a newer one)",
    )
    assert any(rev == replayed for _, _, rev in taken), taken  # the closer, at least
    assert all(r != old_round for _, r, rev in taken if rev >= replayed), taken
    assert "replayed" in caplog.text
    infos = join_all(handlers)  # the closer publishes a fresh round over it
    assert sorted(i.rank for i in infos.values()) == [0, 1, 2]
    assert all(h._state.round.round > old_round + 1 for h in handlers)


def test_a_fresh_agent_refuses_an_older_round_written_back(run: Nodes, client: EtcdClient) -> None:
    first = run.add(2)
    join_all(first)
    keys = keys_of(first[0])
    old = client.range(keys.round).kvs[0].value  # round N, validly signed
    old_round = json.loads(old)["round"]
    join_all(first)  # round N+1
    for h in first:
        h.close()  # the agents stop; the round key stays (it lives on the run's lease)
    replayed = int(client.put(keys.round, old).header.revision)
    fresh = run.add(1)[0]  # a fresh agent: it holds no round to compare with
    fresh._announce(-1)  # its announcement reads the round key in the same transaction
    assert fresh._state.round_rev == replayed  # it did read the record written back
    assert fresh._state.round.round != old_round
    fresh._closer.read_members()  # the closer's own read of the round key (it is alone)
    assert fresh._state.round.round != old_round


def test_a_live_members_older_announcement_written_back_is_not_believed(
    run: Nodes, client: EtcdClient, events_log: Path
) -> None:
    handlers = run.add(2)
    join_all(handlers)
    closer = next(h for h in handlers if h._state.closer)
    victim = next(h for h in handlers if h is not closer)
    key = keys_of(victim).members + victim.name.encode()
    captured = key_value(client.range(key).kvs[0])  # "after": -1, signed for its live lease
    join_all(handlers)  # the next round: the victim's record now says it left round N behind
    after = closer._state.members[victim.name].after
    assert json.loads(captured.value)["after"] < after
    replayed = int(client.put(key, captured.value, captured.lease).header.revision)
    wait_until(  # the closer's watch reads it (nothing else here decodes member keys)
        lambda: victim.name in untrusted(events_log), 20, "the write-back to be reported"
    )
    assert closer._state.members_seen >= replayed
    assert closer._state.members[victim.name].after == after  # not the older claim
    now = key_value(client.range(key).kvs[0])
    assert now.lease == captured.lease  # the same, still-live lease
    assert decode_member(now, keys_of(victim).members, closer._state.trust) is None  # a read
    infos = join_all(handlers)  # the victim announces again over it, and is trusted
    assert {i.world_size for i in infos.values()} == {2}


# -- the rules, on records alone ----------------------------------------------------------

PREFIX = b"/elastic/run/announce/members/"
ROUND_KEY = b"/elastic/run/announce/round"


def member_kv(value: bytes, lease: int, name: str = "n1") -> KeyValue:
    return KeyValue(PREFIX + name.encode(), value, 5, 5, lease)


def test_a_member_record_is_trusted_only_on_the_lease_it_was_signed_for() -> None:
    trust = Trust(b"job-secret", ROUND_KEY, "run")
    announcement = Announcement("10.0.0.1", 42, 0, 9001, 29500, after=3)
    value = trust.seal(PREFIX + b"n1", announcement, lease=7)
    assert decode_member(member_kv(value, 7), PREFIX, trust) is not None
    assert decode_member(member_kv(value, 8), PREFIX, trust) is None  # another lease
    assert decode_member(member_kv(value, 0), PREFIX, trust) is None  # no lease
    assert decode_member(member_kv(value, 7, "n2"), PREFIX, trust) is None  # another key
    other_run = b"/elastic/other/announce/members/"
    assert decode_member(KeyValue(other_run + b"n1", value, 5, 5, 7), other_run, trust) is None


def test_a_round_record_is_trusted_only_as_the_write_it_was_signed_for() -> None:
    trust = Trust(b"job-secret", ROUND_KEY, "run")
    value = trust.seal(ROUND_KEY, Round(3, {"n1": 0}, "10.0.0.1", 29500, "n1"), at=(5, 3))
    assert round_of(round_kv(value, 5, 3), trust).round == 3  # the write it was signed for
    assert round_of(round_kv(value, 5, 4), trust) is NO_ROUND  # written back later
    assert round_of(round_kv(value, 12, 3), trust) is NO_ROUND  # deleted, rebuilt to v3
    first = trust.seal(ROUND_KEY, Round(0, {"n1": 0}, "10.0.0.1", 29500, "n1"), at=(0, 1))
    assert round_of(round_kv(first, 9, 1), trust) is NO_ROUND  # never a round's 1st version
    unsigned = Trust(None, ROUND_KEY, "run")  # without a secret, nothing is signed or refused
    assert round_of(round_kv(Round(3).encode(), 12, 9), unsigned).round == 3


def round_kv(value: bytes, create: int, version: int) -> KeyValue:
    return KeyValue(ROUND_KEY, value, create, create + version, 0, version)


def test_a_member_record_is_trusted_only_as_the_write_it_was_signed_for() -> None:
    trust = Trust(b"job-secret", ROUND_KEY, "run")
    announcement = Announcement("10.0.0.1", 42, 0, 9001, 29500, after=3)

    def kv(value: bytes, create: int, version: int) -> KeyValue:
        return KeyValue(PREFIX + b"n1", value, create, create + version, 7, version)

    value = trust.seal(PREFIX + b"n1", announcement, lease=7, at=(5, 3))
    assert decode_member(kv(value, 5, 3), PREFIX, trust) is not None
    assert decode_member(kv(value, 5, 4), PREFIX, trust) is None  # written back later
    assert decode_member(kv(value, 12, 3), PREFIX, trust) is None  # deleted, rebuilt to v3
    first = trust.seal(PREFIX + b"n1", announcement, lease=7, at=(0, 1))
    assert decode_member(kv(first, 9, 1), PREFIX, trust) is not None  # a key's first version
    assert decode_member(kv(first, 9, 2), PREFIX, trust) is None  # written back over it
