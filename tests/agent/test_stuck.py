"""A stuck worker gone around (elastic.agent.stuck): the verdict is a pure function of when
each worker was first seen stopped and which ones the waiting ranks named (fake clock); the
agent reads the waiting ranks' verdict through the same key space as the workers write it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from elastic import env
from elastic.agent.stuck import CONFIRM_S, RETRY_S, VerdictReader, stuck_pids
from elastic.worker import groups
from elastic.worker.hang import verdict_key

NOW = 500.0


@pytest.mark.parametrize(
    ("stopped", "named", "expected"),
    [
        ({}, {7}, []),  # named, running: a verdict alone moves nothing
        ({7: NOW - 5.0}, set(), []),  # stopped, not named: the frozen limit's business
        ({7: NOW - CONFIRM_S}, {7}, [7]),
        ({7: NOW - CONFIRM_S / 2}, {7}, []),  # just stopped: not yet confirmed
        ({9: NOW - 1.0, 7: NOW - 2.0, 8: NOW}, {7, 8, 9}, [7, 9]),
    ],
)
def test_stuck_is_named_and_stopped_for_the_confirmation(
    stopped: dict[int, float], named: set[int], expected: list[int]
) -> None:
    assert stuck_pids(stopped, named, NOW, CONFIRM_S) == expected


class _Store:
    def __init__(self, keys: set[str]) -> None:
        self.keys = keys

    def check(self, keys: list[str]) -> bool:
        return all(k in self.keys for k in keys)


def test_the_reader_names_the_pids_of_the_named_ranks_and_keeps_one_client() -> None:
    made: list[tuple[str, int]] = []

    def connect(host: str, port: int) -> Any:
        made.append((host, port))
        return _Store({verdict_key(4, 2)})

    reader = VerdictReader(connect)
    assert reader.named("h", 1, 4, {2: 102, 3: 103}) == {102}
    assert reader.named("h", 1, 5, {2: 102}) == set()  # another round's verdict
    assert made == [("h", 1)]


def test_a_store_that_does_not_answer_is_tried_again_after_a_while() -> None:
    clock = [0.0]
    tries: list[float] = []

    def connect(host: str, port: int) -> Any:
        tries.append(clock[0])
        raise RuntimeError("connection refused")

    reader = VerdictReader(connect, clock=lambda: clock[0])
    assert reader.named("h", 1, 0, {0: 10}) == set()
    clock[0] = RETRY_S / 2
    assert reader.named("h", 1, 0, {0: 10}) == set()
    clock[0] = RETRY_S
    assert reader.named("h", 1, 0, {0: 10}) == set()
    assert tries == [0.0, RETRY_S]


@pytest.mark.parametrize("with_secret", [False, True])
def test_the_agent_reads_the_verdict_in_the_workers_key_space(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, with_secret: bool
) -> None:
    if with_secret:
        path = tmp_path / "secret"
        path.write_bytes(b"the-job-secret-0123456789abcdef")
        path.chmod(0o600)
        monkeypatch.setenv(env.SECRET_FILE, str(path))
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    worker = groups.client("127.0.0.1", server.port)
    worker.set(verdict_key(3, 1), "12")
    assert server.check([verdict_key(3, 1)]) is not with_secret  # the plain name is empty
    assert VerdictReader().named("127.0.0.1", server.port, 3, {0: 50, 1: 51}) == {51}
