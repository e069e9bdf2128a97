"""No client of a round's store can forge the hang roll call (issue 38, elastic.worker.hang):
a planted mark for a stuck rank does not hide it, a deleted mark of a waiting rank does not
name it. Real TCPStore, real threads; each mark is checked against the commitment its rank
wrote into its own boundary record."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from elastic.worker.hang import ARRIVED_PREFIX, commitment, new_token, roll_call

ROUND, STEP, WORLD = 5, 17, 3


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)


def _key(rank: int) -> str:
    return f"{ARRIVED_PREFIX}/{ROUND}/{STEP}/{rank}"


def test_a_planted_mark_for_a_stuck_rank_does_not_hide_it(store: dist.TCPStore) -> None:
    """Rank 0 is stuck (it never marks itself); a hostile client plants its mark. Rank 1,
    holding every rank's commitment, names rank 0 anyway (with no commitments, the plant
    would hide it: the old roll call)."""
    tokens = [new_token() for _ in range(WORLD)]
    commits = tuple(commitment(t) for t in tokens)
    store.set(_key(0), new_token())  # a forgery: not rank 0's token
    store.set(_key(2), tokens[2])  # rank 2 waits too
    assert roll_call(store, ROUND, STEP, 1, WORLD, 0.3, tokens[1], commits) == ([0], True)
    assert roll_call(store, ROUND, STEP, 1, WORLD, 0.1, tokens[1], None)[0] == []  # unchecked


def test_deleting_a_waiting_ranks_mark_names_nobody(store: dist.TCPStore) -> None:
    """Ranks 1 and 2 wait; a hostile client deletes rank 2's mark as soon as it appears, for
    the first part of the grace. Rank 2 sets its own again at every poll and rank 1 keeps a
    mark once seen: nobody is named (a mark written once, as before, stayed deleted).
    A client that deletes without pause for the whole grace can still hide a mark: the
    store is no ledger; the cost is a wrong ``worker.hang.peers`` line, nothing stops."""
    tokens = [new_token() for _ in range(WORLD)]
    commits = tuple(commitment(t) for t in tokens)
    found: dict[int, tuple[list[int], bool]] = {}
    done = threading.Event()

    def wait(rank: int) -> None:
        found[rank] = roll_call(store, ROUND, STEP, rank, WORLD, 0.6, tokens[rank], commits)

    def delete() -> None:
        until = time.monotonic() + 0.2
        while not done.is_set() and time.monotonic() < until:
            store.delete_key(_key(2))
            time.sleep(0.01)

    store.set(_key(0), tokens[0])
    deleter = threading.Thread(target=delete)
    deleter.start()
    threads = [threading.Thread(target=wait, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    done.set()
    deleter.join(5)
    assert found[1] == ([], False) and found[2] == ([], False), found


def test_a_commitment_is_48_bits_exact_in_float64() -> None:
    token = new_token()
    c = commitment(token)
    assert c == float(int(c)) and 0 <= c < 2**48 and commitment(token) == c
    assert commitment(new_token()) != c
