"""The agent <-> handler seam: ``membership_change()`` against a real etcd, in-process."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic.etcd.server import EtcdServer
from elastic.rendezvous.contract import ChangeKind
from elastic.rendezvous.handler import EtcdRendezvousHandler
from elastic.rendezvous.options import FAST_FAILOVER
from elastic.rendezvous.registry import create_rdzv_handler
from tests.helpers import wait_until


def handler(etcd: EtcdServer, run_id: str, nodes: str = "2:3") -> EtcdRendezvousHandler:
    low, _, high = nodes.partition(":")
    params = RendezvousParameters(
        "etcd-v3",
        etcd.endpoint,
        run_id,
        int(low),
        int(high or low),
        local_addr=f"node-{uuid.uuid4().hex[:6]}",
        profile=FAST_FAILOVER,
        join_timeout="60",
        algorithm="single-key",
    )
    made = create_rdzv_handler(params)
    assert isinstance(made, EtcdRendezvousHandler)
    return made


def form(handlers: list[EtcdRendezvousHandler]) -> None:
    threads = [threading.Thread(target=h.next_rendezvous) for h in handlers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "the round did not form"


@pytest.fixture
def pair(etcd: EtcdServer, run_id: str) -> Iterator[list[EtcdRendezvousHandler]]:
    made = [handler(etcd, run_id), handler(etcd, run_id)]
    form(made)
    yield made
    for h in made:
        h.close()


def test_a_fresh_round_is_the_job_and_queries_change_nothing(
    pair: list[EtcdRendezvousHandler],
) -> None:
    a, _ = pair
    assert a.membership_change() is None
    assert a.num_nodes_waiting() == 0
    assert a.membership_change() is None, "asking must not change the answer"


def test_a_peer_that_left_is_reported_on_every_ask_until_the_next_round(
    pair: list[EtcdRendezvousHandler],
) -> None:
    a, b = pair
    b.leave()
    change = wait_until(a.membership_change, 10, "the leave to be seen (state cache: 1 s)")
    assert change is not None and change.kind is ChangeKind.PEERS_LOST
    assert change.nodes == (str(b._this_node),)
    assert a.membership_change() == change, "a query, not a one-shot flag"
    assert a.num_nodes_waiting() == 1, "torch's own agent must re-form too"


def test_a_requested_reform_and_a_waiting_joiner_are_changes(
    pair: list[EtcdRendezvousHandler], etcd: EtcdServer
) -> None:
    a, b = pair
    a.request_reform()
    requested = a.membership_change()
    assert requested is not None and requested.kind is ChangeKind.REQUESTED
    c = handler(etcd, a.get_run_id())
    threading.Thread(target=c.next_rendezvous, daemon=True).start()
    joiners = wait_until(b.membership_change, 30, "a waiting joiner")
    assert joiners.kind is ChangeKind.JOINERS and joiners.waiting == 1
    c.close()


def test_a_peer_clock_far_off_is_warned_about(
    pair: list[EtcdRendezvousHandler], caplog: pytest.LogCaptureFixture
) -> None:
    a, b = pair
    a._check_clocks()
    assert "seems" not in caplog.text, "fresh heartbeats: no warning"
    beats = a._state_holder.state.last_heartbeats
    beats[b._this_node] = datetime.now(timezone.utc) + timedelta(seconds=5)
    a._check_clocks()
    assert f"The clock of node '{b._this_node}' seems" in caplog.text
    assert "ahead of" in caplog.text


def test_torchs_rendezvous_events_name_their_caller_without_inspecting_the_stack(
    pair: list[EtcdRendezvousHandler],
) -> None:
    # torch's get_method_name ran inspect.stack() twice per recorded event (tens of ms
    # each on a loaded machine); the handler swaps in a frame lookup with the same answer.
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    def _record() -> str:
        return dynamic_rendezvous.get_method_name()

    def the_caller() -> str:
        return _record()

    assert dynamic_rendezvous.get_method_name.__module__ == "elastic.rendezvous.handler"
    assert the_caller() == "the_caller"
