"""A receiver's memory room is charged what it really needs (issue 38, item 5/B).

A receiver holds the bytes it receives and then the tensors ``decode(clone=True)`` copies
out of them: twice the data. The room check charged the data once, so a state between
room/2 and room was accepted and the receiver was OOM-killed while decoding. It is now
refused before anything is allocated, in one sentence.
"""

from __future__ import annotations

import pytest

from elastic.node import memlimit
from elastic.worker import exchange
from elastic.worker.codec import RecoveryError

ROOM = 1 << 30


@pytest.fixture
def _room(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memlimit, "available_bytes", lambda: ROOM)


@pytest.mark.usefixtures("_room")
def test_a_state_between_half_the_room_and_the_room_is_refused_up_front() -> None:
    size = ROOM * 3 // 4
    with pytest.raises(RecoveryError) as refused:
        exchange._check_sizes(2, 100, size)
    text = str(refused.value)
    assert text.startswith(f"Rank 2 announced a state of 100 + {size} bytes")
    assert f"{2 * size} bytes to receive and decode" in text and str(ROOM) in text
    assert text.endswith("it is not received.") and text.count(". ") == 0


@pytest.mark.usefixtures("_room")
def test_a_state_of_half_the_room_is_received() -> None:
    exchange._check_sizes(2, 100, ROOM // 2)


@pytest.mark.usefixtures("_room")
def test_a_holder_that_does_not_receive_is_charged_the_data_once() -> None:
    exchange._check_sizes(2, 100, ROOM * 3 // 4, receive=False)
