"""``algorithm=single-key`` is torch's own DynamicRendezvousHandler on our etcd storage:
built through torch's public constructor, nothing of torch patched, and run by our agent
as torch's LocalElasticAgent runs any handler."""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousHandler,
    RendezvousParameters,
    dynamic_rendezvous,
    utils,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

from elastic.errors import ConfigError
from elastic.etcd.server import EtcdServer
from elastic.node.procs import kill
from elastic.rendezvous.contract import MembershipHandler
from elastic.rendezvous.options import FAST_FAILOVER, SINGLE_KEY
from elastic.rendezvous.registry import create_rdzv_handler
from elastic_tools.harness.cluster import fast_conf
from tests.agent.jobs import Job
from tests.helpers import wait_until

TORCH_GLOBALS = ("get_method_name", "_delay", "_NodeDescGenerator", "DynamicRendezvousHandler")


def params(etcd: EtcdServer, run_id: str, nodes: str = "2:3", **conf: str) -> RendezvousParameters:
    low, _, high = nodes.partition(":")
    return RendezvousParameters(
        "etcd-v3",
        etcd.endpoint,
        run_id,
        int(low),
        int(high or low),
        local_addr=f"node-{uuid.uuid4().hex[:6]}",
        **{"profile": FAST_FAILOVER, "join_timeout": "60", "algorithm": SINGLE_KEY, **conf},
    )


def test_the_handler_is_torchs_own_class_and_torch_is_left_untouched(
    etcd: EtcdServer, run_id: str
) -> None:
    before = {name: getattr(dynamic_rendezvous, name) for name in TORCH_GLOBALS}
    handler = create_rdzv_handler(params(etcd, run_id))
    assert type(handler) is DynamicRendezvousHandler
    assert not isinstance(handler, MembershipHandler), "the agent must treat it as torch's"
    after = {name: getattr(dynamic_rendezvous, name) for name in TORCH_GLOBALS}
    assert after == before
    assert dynamic_rendezvous._delay is utils._delay
    assert dynamic_rendezvous.get_method_name.__module__ == dynamic_rendezvous.__name__
    # torch's own state holder and op executor: nothing written over them after construction
    assert type(handler._state_holder).__module__ == dynamic_rendezvous.__name__
    assert type(handler._op_executor).__module__ == dynamic_rendezvous.__name__


def test_two_stock_handlers_form_a_round_and_a_third_is_seen_waiting(
    etcd: EtcdServer, run_id: str
) -> None:
    made = [create_rdzv_handler(params(etcd, run_id)) for _ in range(3)]
    pair = made[:2]
    ranks: list[int] = []

    def join(handler: RendezvousHandler) -> None:
        ranks.append(handler.next_rendezvous().rank)

    threads = [threading.Thread(target=join, args=(h,)) for h in pair]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(ranks) == [0, 1], "the round did not form"
    assert [h.num_nodes_waiting() for h in pair] == [0, 0]
    closed: list[BaseException] = []

    def wait_to_join() -> None:
        try:
            made[2].next_rendezvous()
        except RendezvousClosedError as exc:
            closed.append(exc)

    joiner = threading.Thread(target=wait_to_join, daemon=True)
    joiner.start()
    wait_until(lambda: pair[0].num_nodes_waiting() == 1, 30, "torch's count of the joiner")
    assert pair[0].shutdown(), "torch closes the rendezvous for everyone"
    joiner.join(30)
    assert len(closed) == 1, "the waiting joiner learns that the rendezvous closed"
    for h in made[1:]:
        h.shutdown()


def test_a_fractional_keep_alive_interval_is_refused_in_a_sentence(
    etcd: EtcdServer, run_id: str
) -> None:
    conf = {"keep_alive_interval": "1.5", "keep_alive_max_attempt": "3"}
    with pytest.raises(ConfigError, match="whole number of seconds"):
        create_rdzv_handler(params(etcd, run_id, **conf))


@pytest.mark.slow
def test_under_elastic_agent_a_killed_node_is_survived_and_the_job_finishes(
    tmp_path: Path, etcd: EtcdServer, run_id: str
) -> None:
    job = Job(tmp_path, etcd.endpoint, run_id, max_steps=30)
    conf = f"{fast_conf(job.options.join_timeout)},algorithm={SINGLE_KEY}"
    job.options = dataclasses.replace(job.options, rdzv_conf=conf)
    try:
        a, b = job.start("a"), job.start("b")
        wait_until(lambda: job.last_step() >= 6 and job.worlds_after(0)[-1] == 2, 150, "world 2")
        killed_at = time.time()
        kill(b.pid)  # kill -9 of an agent: its worker dies with it (parent-death signal)
        after = job.wait_for_world(1, killed_at, 120)
        assert after["step"] > 6
        assert a.wait(240) == 0, job.logs()
        assert job.last_step() == job.max_steps
        reforms = [e for e in job.events("worker.restart") if e.get("reason") == "reform"]
        assert reforms == [], "no re-form of ours: torch restarts the failed workers"
    finally:
        orphans = job.cleanup()
    assert orphans == [], "no worker may outlive its agent"
