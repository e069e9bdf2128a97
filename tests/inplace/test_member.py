"""elastic.worker.member.Member: the worker's vote on a newer round, a round replaced before
it formed, and a leave, over a real channel file and a dict standing in for the round's
store (no process, no socket)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastic.errors import RecoveryError
from elastic.node import channel
from elastic.node.channel import Assignment
from elastic.worker import groups
from elastic.worker.exchange import Interrupted
from elastic.worker.member import BROKEN, NOT_YET, READY, READY_PREFIX, Member


class DictStore:
    """The two calls Member makes on a round's TCPStore."""

    def __init__(self, keys: dict[str, str]) -> None:
        self.keys = keys
        self.fail = False

    def set(self, key: str, value: str) -> None:
        self.keys[key] = value

    def check(self, keys: list[str]) -> bool:
        if self.fail:
            raise ConnectionResetError("its host is gone")
        return all(k in self.keys for k in keys)


@pytest.fixture
def stores(monkeypatch: pytest.MonkeyPatch) -> dict[int, DictStore]:
    """One store per port; a port not in the dict cannot be reached."""
    by_port: dict[int, DictStore] = {}

    def client(host: str, port: int) -> DictStore:
        if port not in by_port:
            raise ConnectionRefusedError(f"{host}:{port} is not reachable")
        return by_port[port]

    monkeypatch.setattr(groups, "client", client)
    return by_port


@pytest.fixture
def member(tmp_path: Path) -> Iterator[Member]:
    m = Member(str(tmp_path / "ch"))
    m.assignment = Assignment(1, rank=0, world_size=2)  # it runs round 1
    yield m
    m.close()


def _offer(m: Member, a: Assignment) -> None:
    channel.write_assignment(m.prefix, a)
    deadline = time.monotonic() + 5
    while m.watcher.newest != a:
        assert time.monotonic() < deadline, "the watcher did not see the assignment"
        time.sleep(channel.POLL_S)


def _round(n: int, rank: int = 0, world: int = 2, port: int = 1, **kw: Any) -> Assignment:
    return Assignment(n, rank=rank, world_size=world, master_port=port, **kw)


def test_switch_vote(member: Member, stores: dict[int, DictStore]) -> None:
    assert member.switch_vote() == NOT_YET  # no newer round
    _offer(member, Assignment(2, pending=True))
    assert member.switch_vote() == NOT_YET  # being formed
    _offer(member, _round(2, port=7))
    assert member.switch_vote() == BROKEN  # its store cannot be reached: restart
    member._ready = None
    stores[7] = DictStore({})
    assert member.switch_vote() == NOT_YET  # only this rank is ready
    assert f"{READY_PREFIX}/2/0" in stores[7].keys
    stores[7].keys[f"{READY_PREFIX}/2/1"] = "1"
    assert member.switch_vote() == READY
    stores[7].fail = True
    assert member.switch_vote() == NOT_YET  # its host went: a newer round replaces it


def test_a_newer_round_replaces_one_not_yet_formed(
    member: Member, stores: dict[int, DictStore]
) -> None:
    stores[7] = DictStore({})  # round 2: its other rank never becomes ready
    stores[8] = DictStore({f"{READY_PREFIX}/3/1": "1"})
    _offer(member, _round(3, port=8))
    got = member._all_ready(_round(2, port=7), time.monotonic() + 5)
    assert got.round == 3 and f"{READY_PREFIX}/3/0" in stores[8].keys


def test_a_leave_note_makes_the_member_leave(member: Member, stores: dict[int, DictStore]) -> None:
    stores[7] = DictStore({})
    assert not member.leaving
    _offer(member, Assignment(2, pending=True, abort=True, leave=True))
    assert member.leaving and member.guard.aborted is not None
    with pytest.raises(RecoveryError, match="leaves the job"):
        member._poll_ready(stores[7], ["missing"], 2, time.monotonic() + 5)


def test_a_formation_gives_up_on_its_round_once_a_newer_one_forms(member: Member) -> None:
    member.give_up_on(2)  # nothing newer: the wait goes on
    _offer(member, Assignment(3, pending=True))
    member.give_up_on(2)  # being formed, not formed
    _offer(member, _round(3))
    member.give_up_on(3)  # the round being formed is the newest
    with pytest.raises(Interrupted, match="Round 3 formed while the groups of round 2"):
        member.give_up_on(2)
    _offer(member, Assignment(4, pending=True, abort=True, leave=True))
    with pytest.raises(RecoveryError, match="leaves the job"):
        member.give_up_on(3)
