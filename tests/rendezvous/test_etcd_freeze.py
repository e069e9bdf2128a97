"""etcd frozen (SIGSTOP) longer than every node's lease, then thawed: every member key
expires at once, every node rejoins, and a round forms again within seconds.

fast-failover's leases last 3 s (keep_alive_interval 1 s x 3). A 4 s freeze expires all of
them together: no key is left to say who is the oldest, so the node that announces first
afterwards is the closer. Before the fix no round formed within join_timeout, in about
half the runs: the node made the closer by its own announcement (on the agent's thread)
sat in a follower's watch of the round key, which nobody else could change; a node whose
key was gone took the closer's role when its predecessor's key vanished; and a node that
rewrote its surviving key on a fresh lease took the two newest keys for its predecessors,
so the predecessors could form a cycle with no closer.

Here in-process handlers stand in for the agents (one thread each: join, then poll
:meth:`membership_change` and rejoin on a change, as the agent does); the system test of
the same outage under real agents and a training script is in test_etcd_freeze_agents.py.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic.etcd.client import EtcdClient, EtcdOptions, op_delete, parse_endpoints
from elastic.etcd.server import EtcdServer
from elastic.rendezvous.announce import AnnounceRendezvousHandler, build_announce_handler
from elastic.rendezvous.contract import ChangeKind, MembershipChange
from elastic.rendezvous.options import RendezvousOptions
from tests.helpers import wait_until

FREEZE_S = 4.0  # longer than fast-failover's 3 s leases
REFORM_BOUND_S = 10.0  # every node in a new round within this of the thaw
CONF = {"algorithm": "announce", "profile": "fast-failover", "join_timeout": "30"}


@dataclass
class Agent:
    """One node: its handler, the rounds it joined (round, when), the changes it saw."""

    handler: AnnounceRendezvousHandler
    rounds: list[tuple[int, float]] = field(default_factory=list)
    changes: list[MembershipChange] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)

    def run(self, stop: threading.Event) -> None:
        """Join; while the round is the job, poll for a change (as the agent's monitor
        does, every 0.1 s); on one, rejoin."""
        try:
            while not stop.is_set():
                self.handler.next_rendezvous()
                self.rounds.append((self.handler._joined_round or 0, time.monotonic()))
                while not stop.wait(0.1):
                    change = self.handler.membership_change()
                    if change is not None:
                        self.changes.append(change)
                        break
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)


@pytest.fixture
def agents(own_etcd: EtcdServer, run_id: str) -> Iterator[list[Agent]]:
    """Three nodes of 3:4 on fast-failover (a round re-forms by the early close, not by
    max_nodes), each in a thread; stopped and closed after."""
    made = []
    for _ in range(3):
        params = RendezvousParameters(
            "etcd-v3", own_etcd.endpoint, run_id, 3, 4, local_addr="127.0.0.1", **CONF
        )
        made.append(Agent(build_announce_handler(params, RendezvousOptions.from_params(params))))
    stop = threading.Event()
    threads = [threading.Thread(target=a.run, args=(stop,), daemon=True) for a in made]
    for thread in threads:
        thread.start()
    yield made
    stop.set()
    if own_etcd.proc is not None and own_etcd.alive():
        os.kill(own_etcd.proc.pid, signal.SIGCONT)  # never leave it stopped
    for agent in made:
        agent.handler.close()
    for thread in threads:
        thread.join(10)


def freeze(etcd: EtcdServer, seconds: float) -> float:
    """SIGSTOP the test's own etcd (by its PID) for ``seconds``; when it was thawed."""
    assert etcd.proc is not None
    os.kill(etcd.proc.pid, signal.SIGSTOP)
    try:
        until = time.monotonic() + seconds
        wait_until(lambda: time.monotonic() >= until, seconds + 5, f"a {seconds:g} s freeze")
    finally:
        os.kill(etcd.proc.pid, signal.SIGCONT)
    return time.monotonic()


def test_a_round_forms_again_after_etcd_froze_past_every_lease(
    agents: list[Agent], own_etcd: EtcdServer
) -> None:
    wait_until(lambda: all(a.rounds for a in agents), 30, "the first round")
    first = agents[0].rounds[0][0]
    assert all(a.rounds[0][0] == first for a in agents)

    thawed = freeze(own_etcd, FREEZE_S)

    def rejoined() -> bool:
        failed = [e for a in agents for e in a.errors]
        assert not failed, f"a node gave up: {failed}"
        return all(len(a.rounds) >= 2 for a in agents)

    wait_until(rejoined, REFORM_BOUND_S, f"every node in a new round within {REFORM_BOUND_S} s")
    second = {a.rounds[1][0] for a in agents}
    assert len(second) == 1 and second.pop() > first, [a.rounds for a in agents]
    # The freeze expired the leases: every node was dropped and rejoined (the test would
    # prove nothing if a lease had survived it).
    kinds = {c.kind for a in agents for c in a.changes}
    assert ChangeKind.DROPPED in kinds, [a.changes for a in agents]
    seconds = max(a.rounds[1][1] for a in agents) - thawed
    print(f"every node joined round {agents[0].rounds[1][0]} {seconds:.2f} s after the thaw")


def test_a_live_node_whose_key_was_deleted_rejoins_at_once(
    agents: list[Agent], own_etcd: EtcdServer
) -> None:
    """A key deleted under a live node (a mistaken reap, or an operator): the node learns it
    from its watch (its own key's deletion, or the round's ``lost``) and rejoins, and the
    round forms again with every node."""
    wait_until(lambda: all(a.rounds for a in agents), 30, "the first round")
    first = agents[0].rounds[0][0]
    victim = agents[-1].handler
    with EtcdClient(EtcdOptions(parse_endpoints(own_etcd.endpoint)[0])) as client:
        client.txn([], [op_delete(victim._keys.members + victim.name.encode())], [])
    deleted = time.monotonic()
    wait_until(lambda: all(len(a.rounds) >= 2 for a in agents), REFORM_BOUND_S, "a new round")
    assert {a.rounds[1][0] for a in agents} == {first + 1}, [a.rounds for a in agents]
    assert agents[-1].changes, "the node whose key was deleted saw no change"
    seconds = max(a.rounds[1][1] for a in agents) - deleted
    print(f"every node joined round {first + 1} {seconds:.2f} s after the deletion")
