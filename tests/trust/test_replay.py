"""A signed announce record written back into etcd later is not trusted (no replay).

With a job secret, a member record's signature covers its key (so its run and node) and
the lease it was written on: once its agent is gone, the lease is gone, and the record
written back, on another lease or none, or under another key, gets no rank (one warning
and an ``rdzv.untrusted`` event). A round record's signature covers its key and the newest
revision of the round key its closer had seen: a node that holds a newer round refuses an
older one written back, and reads it as no round (it is never taken as the current round).

On a real etcd with in-process announce handlers (tests/rendezvous/test_announce.py); the
attacker writes straight into etcd with the etcd client, as in test_membership_trust.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic.etcd.client import EtcdClient, KeyValue
from elastic.etcd.server import EtcdServer
from elastic.rendezvous.announce.records import (
    NO_ROUND,
    Announcement,
    Round,
    Trust,
    decode_member,
    decode_round,
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

    def spy(state: NodeState, round_: Round, mod_revision: int, seen: int = 0) -> None:
        taken.append((state.name, round_.round, mod_revision))
        set_round(state, round_, mod_revision, seen)

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


def test_a_round_signed_before_the_held_one_is_refused_as_replayed() -> None:
    trust = Trust(b"job-secret", ROUND_KEY, "run")
    older = trust.seal(ROUND_KEY, Round(3, {"n1": 0}, "10.0.0.1", 29500, "n1"), rev=10)
    newer = trust.seal(ROUND_KEY, Round(4, {"n1": 0}, "10.0.0.1", 29500, "n1"), rev=12)
    assert decode_round(older, trust, 11, 0).round == 3  # nothing held: taken
    assert decode_round(newer, trust, 13, 11).round == 4  # written after the one held
    assert decode_round(older, trust, 11, 11).round == 3  # the held record, read again
    assert decode_round(older, trust, 14, 13) is NO_ROUND  # written back later: replayed
    unsigned = Trust(None, ROUND_KEY, "run")  # without a secret, nothing is signed or refused
    assert decode_round(Round(3).encode(), unsigned, 14, 13).round == 3
