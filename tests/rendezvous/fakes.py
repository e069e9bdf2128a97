"""Fakes for the pure-logic rendezvous tests (no etcd)."""

from __future__ import annotations

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState


class FakeHolder:
    """A state holder with no backend: every sync is a no-op."""

    def __init__(self, state: _RendezvousState) -> None:
        self.state = state

    def sync(self) -> None:
        return None

    def mark_dirty(self) -> None:
        pass
