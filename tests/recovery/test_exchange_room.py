"""A streamed peer state is decoded without a second copy (issue 38, item 5/B).

The receiver checks the announced size against its memory room; decoding with a clone
needed twice those bytes, so a state between room/2 and room was accepted and then the
receiver was OOM-killed in ``decode(clone=True)``. The bytes it received are its own, so
the state's tensors now view them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from elastic.worker import exchange
from elastic.worker.codec import Slot, encode_meta
from elastic.worker.exchange import Plan


def test_a_streamed_state_is_decoded_in_the_received_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    received = torch.arange(1024, dtype=torch.float32).view(torch.uint8).clone()
    meta = encode_meta(
        {"__d": [["w", {"__t": 0}]]}, [Slot(0, received.numel(), "float32", (1024,))]
    )

    def stream(*args: Any, **kwargs: Any) -> tuple[bytes, torch.Tensor]:
        return meta, received

    monkeypatch.setattr(exchange, "stream", stream)
    plan = Plan("memory", step=3, round=1, src_rank=1, holders=(1,), world_size=2)
    state, source, nbytes = exchange.fetch(plan, store=None, group=None)  # type: ignore[arg-type]
    assert (source, nbytes) == ("peer", received.numel())
    assert torch.equal(state["w"], torch.arange(1024, dtype=torch.float32))
    # no second copy: the tensor lies in the received buffer
    assert state["w"].untyped_storage().data_ptr() == received.untyped_storage().data_ptr()
