"""The announce rendezvous' records (elastic.rendezvous.announce.records): what is written
is read back, what the previous release wrote still reads, and a malformed record is
reported in one sentence naming the key."""

from __future__ import annotations

import json
import logging

import pytest

from elastic.errors import EtcdStateError
from elastic.etcd.client import KeyValue
from elastic.rendezvous.announce.records import (
    NO_ROUND,
    Announcement,
    Round,
    Trust,
    decode_member,
    decode_members,
    decode_round,
    parse_member,
    parse_round,
)

PREFIX = b"/elastic/run/announce/members/"


def test_a_round_reads_back_as_written() -> None:
    round_ = Round(3, {"a": 0, "b": 1}, "10.0.0.1", 29500, "a", 1, ("c",), ("d",), {"e": 7})
    assert parse_round(round_.encode()) == round_
    closed = Round(3, {"a": 0}, closed=True)
    assert parse_round(closed.encode()) == closed
    assert "closed" not in json.loads(round_.encode())  # as before: only once closed
    asked = Round(3, {"a": 0, "b": 1}, waiting=1, asked=("b",))
    assert parse_round(asked.encode()) == asked
    assert "asked" not in json.loads(round_.encode())  # as before: only when someone asked


def test_a_round_of_the_previous_release_reads() -> None:
    old = {
        "round": 2,
        "members": {"n1": 0, "n2": 1},
        "master_addr": "h1",
        "master_port": 1234,
        "closer": "n1",
        "waiting": 0,
        "joining": [],
        "lost": [],
        "stale": {},
    }
    round_ = parse_round(json.dumps(old).encode())
    assert (round_.round, dict(round_.members), round_.master_port) == (2, old["members"], 1234)
    assert parse_round(b'{"closed": true}') == Round(closed=True)  # set_closed before a round


def test_no_round_key_is_no_round() -> None:
    assert parse_round(b"") is NO_ROUND
    assert not NO_ROUND.takes("a", -1)


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (b"not json", "holds no JSON"),
        (b"[1, 2]", "holds JSON that is no object"),
        (b'{"round": "3"}', "has no int 'round' \\(it holds '3'\\)"),
        (b'{"round": true}', "has no int 'round'"),
        (b'{"members": {"a": "0"}}', "has a 'members' that maps names to non-integers"),
        (b'{"joining": [1]}', "has a 'joining' that lists non-names"),
        (b'{"asked": [1]}', "has a 'asked' that lists non-names"),
        (b'{"closed": 1}', "has no bool 'closed'"),
    ],
)
def test_a_malformed_round_is_one_sentence(value: bytes, why: str) -> None:
    with pytest.raises(EtcdStateError, match=rf"^The round key {why}.*; delete it\.$"):
        parse_round(value)


def test_an_unreadable_round_is_no_round_yet_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        assert decode_round(b"{oops") is NO_ROUND
    assert "The round key holds no JSON" in caplog.text
    assert "Treating it as no round yet." in caplog.text


def kv(name: str, value: bytes) -> KeyValue:
    return KeyValue(PREFIX + name.encode(), value, create_revision=5, mod_revision=9, lease=77)


def test_an_announcement_reads_back_as_a_member() -> None:
    value = Announcement("10.0.0.1", 42, 0, 9001, 29500, after=3, local_world_size=8).encode()
    member = parse_member(kv("n1", value), PREFIX)
    assert (member.name, member.create_revision, member.mod_revision) == ("n1", 5, 9)
    assert (member.addr, member.pid, member.probe, member.port) == ("10.0.0.1", 42, 9001, 29500)
    assert (member.after, member.local_world_size, member.order) == (3, 8, ("10.0.0.1", 42, 0))


def test_an_announcement_without_local_world_size_reads_as_one() -> None:
    value = b'{"addr": "h", "pid": 1, "local_id": 0, "probe": 2, "port": 3, "after": -1}'
    assert parse_member(kv("n1", value), PREFIX).local_world_size == 1


def test_a_malformed_member_is_one_sentence_and_skipped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    value = b'{"addr": "h", "local_id": 0, "probe": 2, "port": 3, "after": -1}'
    key = (PREFIX + b"n1").decode()
    with pytest.raises(
        EtcdStateError,
        match=rf"^The member key '{key}' has no int 'pid' \(it holds None\); delete it\.$",
    ):
        parse_member(kv("n1", value), PREFIX)
    with caplog.at_level(logging.WARNING):
        assert decode_member(kv("n1", value), PREFIX) is None
    assert "Ignoring it." in caplog.text


# -- signed records (a job secret) ------------------------------------------------------

ROUND_KEY = b"/elastic/run/announce/round"
ANNOUNCEMENT = Announcement("10.0.0.1", 42, 0, 9001, 29500, after=3)
ROUND = Round(3, {"n1": 0}, "10.0.0.1", 29500, "n1")


def trust(secret: bytes | None = b"job-secret") -> Trust:
    return Trust(secret, ROUND_KEY, "run")


def test_signed_records_read_back_and_an_unsigned_or_foreign_one_is_refused() -> None:
    value = trust().seal(PREFIX + b"n1", ANNOUNCEMENT, lease=77)
    assert "sig" in json.loads(value)
    assert decode_member(kv("n1", value), PREFIX, trust()) == parse_member(kv("n1", value), PREFIX)
    assert decode_member(kv("n1", ANNOUNCEMENT.encode()), PREFIX, trust()) is None
    foreign = trust(b"another-secret").seal(PREFIX + b"n1", ANNOUNCEMENT)
    assert decode_member(kv("n1", foreign), PREFIX, trust()) is None
    sealed = trust().seal(ROUND_KEY, ROUND)
    assert decode_round(sealed, trust()) == ROUND
    assert decode_round(ROUND.encode(), trust()) is NO_ROUND
    assert decode_round(trust(b"another-secret").seal(ROUND_KEY, ROUND), trust()) is NO_ROUND


def test_a_signature_covers_the_key_the_bootstrap_address_and_the_closed_flag() -> None:
    value = trust().seal(PREFIX + b"n1", ANNOUNCEMENT)
    assert decode_member(kv("n2", value), PREFIX, trust()) is None  # copied to another key
    sealed = json.loads(trust().seal(ROUND_KEY, ROUND))
    forgeries = (
        ("master_addr", "10.6.6.6"),
        ("master_port", 6666),
        ("closed", True),
        ("asked", ["n2"]),
    )
    for field, forged in forgeries:
        doc = {**sealed, field: forged}
        assert decode_round(json.dumps(doc).encode(), trust()) is NO_ROUND, field
    member_sig = json.loads(value)["sig"]  # a member's signature does not pass for a round's
    doc = {**ROUND.document(), "sig": member_sig}
    assert decode_round(json.dumps(doc).encode(), trust()) is NO_ROUND


def test_an_untrusted_member_is_warned_about_once_per_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rogue, judge = kv("rogue", ANNOUNCEMENT.encode()), trust()
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert decode_members([rogue], PREFIX, judge) == []
    assert caplog.text.count("is not signed by this job's secret; it gets no rank") == 1


def test_without_a_secret_records_are_unsigned_and_all_trusted() -> None:
    value = trust(None).seal(PREFIX + b"n1", ANNOUNCEMENT)
    assert value == ANNOUNCEMENT.encode()
    assert decode_member(kv("n1", value), PREFIX, trust(None)) is not None
    assert decode_round(ROUND.encode(), trust(None)) == ROUND
