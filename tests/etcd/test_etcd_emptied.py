"""etcd restarted on an empty data dir (issue 38, item 4): the agents see it (the revision
went backwards, elastic.etcd.reset), announce again, and the job re-forms within seconds.

Before: both leases "expired", both workers stopped for a re-form, and no round formed again
in 300 s (the nodes kept revisions of the lost store: watches from revisions the new etcd
had not reached, compare-and-sets on keys it no longer held)."""

from __future__ import annotations

import shutil
import signal
import time
from pathlib import Path

import pytest

from elastic import env
from elastic.errors import CheckpointError
from elastic.etcd.client import EtcdClient, EtcdOptions, parse_endpoints
from elastic.etcd.server import EtcdServer
from elastic.rendezvous.fence import FenceSpec, RoundFence
from elastic_tools.harness.cluster import LocalCluster, fast_conf
from tests.agent.jobs import Job
from tests.helpers import wait_until
from tests.rendezvous.test_announce import Nodes, join_all

REFORM_S = 30.0  # on this loaded machine; measured 1-3 s


def restart_empty(server: EtcdServer) -> EtcdServer:
    """Stop etcd (by PID), wipe its data dir, start it again on the same ports."""
    server.stop(signal.SIGKILL)
    shutil.rmtree(server.data_dir)
    fresh = EtcdServer(
        server.data_dir, client_port=server.client_port, peer_port=server.peer_port
    ).start()
    fresh.wait_ready()
    return fresh


def history(client: EtcdClient, writes: int = 100) -> None:
    """A store that served a while: more revisions than the new one reaches in seconds."""
    for i in range(writes):
        client.put(b"/history", str(i).encode())


def test_the_client_sees_etcd_lose_its_data(own_etcd: EtcdServer) -> None:
    client = EtcdClient(EtcdOptions(parse_endpoints(own_etcd.endpoint)[0]))
    told: list[str] = []
    client.on_reset.append(told.append)
    try:
        for i in range(20):
            client.put(b"/t/k", str(i).encode())
        fresh = restart_empty(own_etcd)
        own_etcd.proc = fresh.proc  # the fixture stops it
        assert client.range(b"/t/k").kvs == []
        assert len(told) == 1 and "backwards" in told[0], told
        assert client.identity.resets == 1
    finally:
        client.close()


def test_handlers_reform_after_etcd_restarts_empty(own_etcd: EtcdServer, run_id: str) -> None:
    nodes = Nodes(own_etcd, run_id, "2:2")
    try:
        handlers = nodes.add(2)
        join_all(handlers)
        history(handlers[0]._client)
        before = max(h._joined_round or 0 for h in handlers)
        h0 = handlers[0]
        spec = FenceSpec.for_run(h0._client.options, h0._keys, before)
        fresh = restart_empty(own_etcd)
        own_etcd.proc = fresh.proc
        back = time.monotonic()
        for h in handlers:
            wait_until(h.membership_change, REFORM_S, "the node to see the loss")
        infos = join_all(handlers)
        took = time.monotonic() - back
        rounds = {h._joined_round for h in handlers}
        assert len(rounds) == 1 and rounds.pop() > before  # numbered after the lost ones
        assert sorted(i.rank for i in infos.values()) == [0, 1]
        assert took < REFORM_S, f"re-formed {took:.1f} s after etcd came back"
        print(f"re-formed {took:.2f} s after etcd came back empty")
        # The fence of the round before the loss commits nothing (the fence is the new one).
        stale = RoundFence(spec)
        try:
            with pytest.raises(CheckpointError):
                stale.commit(1)
        finally:
            stale.close()
    finally:
        nodes.close()


MAX_STEPS = 30


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "restart"])
def test_a_job_trains_on_after_etcd_restarts_empty(
    own_etcd: EtcdServer, tmp_path: Path, run_id: str, in_place: bool
) -> None:
    """Two agents running our CNN worker; etcd dies, loses its data and comes back on the
    same port: the job re-forms and finishes every step (in place, and with
    ELASTIC_IN_PLACE=0 through fresh workers)."""
    job = Job(tmp_path / "job", own_etcd.endpoint, run_id, max_steps=MAX_STEPS)
    extra = {} if in_place else {env.IN_PLACE: "0"}
    try:
        for name in ("a", "b"):
            LocalCluster.start(job, name, nnodes="2:2", overrides={}, extra_env=extra)
        job.wait_for_step(8, timeout=240)
        killed = time.time()
        fresh = restart_empty(own_etcd)
        own_etcd.proc = fresh.proc
        # From the first moment an agent saw etcd back empty (it may be before this thread
        # sees etcd ready: the agents poll too) to the first step of the round after it.
        seen = job.wait_for(
            lambda: next((e for e in job.events("etcd.reset") if e["ts"] > killed), None),
            "an agent to see that etcd lost its data",
            REFORM_S + 60,
        )
        round_ = job.wait_for(
            lambda: next((e for e in job.events("rdzv.round") if e["ts"] > seen["ts"]), None),
            "a round after etcd came back",
            REFORM_S + 60,
        )
        after = job.wait_for(
            lambda: next((e for e in job.steps() if e["ts"] > round_["ts"]), None),
            "a step after the new round",
            REFORM_S + 60,
        )
        took = after["ts"] - seen["ts"]
        for node in job.nodes.values():
            assert node.wait(240) == 0, job.logs()
        resets = job.events("etcd.reset")
        assert resets and all(e["ts"] > killed for e in resets), resets
        steps = {e["step"] for e in job.steps()}
        assert steps >= set(range(1, MAX_STEPS + 1)), sorted(set(range(1, MAX_STEPS + 1)) - steps)
        assert job.last_step() == MAX_STEPS
        rounds = [round(e["ts"] - seen["ts"], 2) for e in job.events("rdzv.round")]
        print(
            f"{'in place' if in_place else 'restart'}: first step {took:.2f} s after an agent "
            f"saw etcd back empty (rounds at {rounds} s from then)"
        )
        assert took < REFORM_S, f"the first step came {took:.1f} s after etcd came back empty"
    finally:
        assert not job.cleanup()


def test_an_etcd_that_never_comes_back_ends_each_agent_with_one_sentence(
    own_etcd: EtcdServer, tmp_path: Path, run_id: str
) -> None:
    """The case the nodes cannot recover from: etcd dies and stays down. Each agent trains on
    for ``outage_timeout``, then ends with one sentence naming it and a non-zero exit code
    (never 0: a job that stopped early must not look finished)."""
    outage_s = 8.0
    job = Job(tmp_path / "job", own_etcd.endpoint, run_id, max_steps=100_000)
    conf = f"{fast_conf(90)},request_timeout=3,outage_timeout={outage_s:g}"
    try:
        for name in ("a", "b"):
            LocalCluster.start(job, name, nnodes="2:2", overrides={}, rdzv_conf=conf)
        job.wait_for_step(5, timeout=240)
        own_etcd.stop(signal.SIGKILL)
        gone = time.monotonic()
        codes = {name: node.wait(outage_s + 120) for name, node in job.nodes.items()}
        took = time.monotonic() - gone
        assert all(code not in (0, None) for code in codes.values()), codes
        for node in job.nodes.values():
            said = [line for line in node.output().splitlines() if "outage_timeout" in line]
            assert said and said[-1].startswith("elastic-agent: error: etcd has been"), said
        print(f"agents exited {codes} {took:.1f} s after etcd died (outage_timeout {outage_s} s)")
    finally:
        job.cleanup()
