"""torch's DynamicRendezvousHandler plus one fix: a node dropped while alive rejoins.

torch judges a node dead when its last heartbeat in the shared state is older
than ``keep_alive_interval * keep_alive_max_attempt``. An etcd outage longer
than that (a restart, a lost quorum) makes *every* heartbeat look old: the
first node to read the state after the outage drops all participants, the
round moves on without anyone, and the live agents, no longer in the state,
stop sending heartbeats and never notice. A node that joins later then waits
forever in a round nobody else is in. Here, a node that finds it is no longer
a participant of the round it joined reports "nodes waiting", so its agent
restarts its workers and the whole group re-forms.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from torch.distributed import Store
from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    RendezvousTimeout,
)

from elastic import events

logger = logging.getLogger(__name__)


class EtcdRendezvousHandler(DynamicRendezvousHandler):
    """DynamicRendezvousHandler that rejoins when dropped, and records each round as an event."""

    _joined_round: int | None = None

    def next_rendezvous(self) -> RendezvousInfo:
        """See base class."""
        info = super().next_rendezvous()
        state = self._state_holder.state
        self._joined_round = state.round
        events.emit(
            "rdzv.round",
            run_id=self.get_run_id(),
            round=state.round,
            node=str(self._this_node),
            rank=info.rank,
            world_size=info.world_size,
        )
        return info

    def num_nodes_waiting(self) -> int:
        """See base class; also > 0 when this node was dropped from its round."""
        waiting = super().num_nodes_waiting()
        if waiting or self._joined_round is None:
            return waiting
        state = self._state_holder.state
        if state.round == self._joined_round and self._this_node in state.participants:
            return 0
        logger.warning(
            "The node '%s' is no longer a participant of round %d of the rendezvous '%s' "
            "(an etcd outage or missed heartbeats); it will rejoin.",
            self._this_node,
            self._joined_round,
            self.get_run_id(),
        )
        events.emit("rdzv.dropped", run_id=self.get_run_id(), round=self._joined_round)
        self._joined_round = None
        return 1


def _timeout(params: RendezvousParameters, name: str) -> timedelta | None:
    seconds = params.get_as_int(f"{name}_timeout")
    return None if seconds is None else timedelta(seconds=seconds)


def build_handler(
    store: Store, backend: RendezvousBackend, params: RendezvousParameters
) -> EtcdRendezvousHandler:
    """torch's ``create_handler``, building our subclass from the standard options."""
    timeout = RendezvousTimeout(
        *(_timeout(params, name) for name in ("join", "last_call", "close", "heartbeat"))
    )
    return EtcdRendezvousHandler.from_backend(
        params.run_id,
        store,
        backend,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        timeout,
        keep_alive_interval=params.get_as_int("keep_alive_interval", 5) or 5,
        keep_alive_max_attempt=params.get_as_int("keep_alive_max_attempt", 3) or 3,
    )


__all__ = ["EtcdRendezvousHandler", "build_handler"]
