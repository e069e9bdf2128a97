"""The rogue member key (written on a real etcd, refused by the job's trust, removed after)
and the checks of the rogue_member and frozen_etcd faults, on made-up event logs."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from elastic.etcd.client import EtcdClient
from elastic.rendezvous.announce.records import Round, Trust, parse_member
from elastic.rendezvous.keys import RunKeys
from elastic_tools.chaos.fault import Fault
from elastic_tools.chaos.injectors import Injector
from elastic_tools.chaos.invariants import SKIPPED_SAVE, frozen_etcd, rogue_members
from elastic_tools.chaos.job import ChaosJob
from elastic_tools.chaos.observers import EventTail, wait_stable
from elastic_tools.chaos.plan import ChaosOptions
from elastic_tools.chaos.rogue import RogueMember


def test_the_rogue_key_is_an_unsigned_announcement_the_job_refuses_and_is_removed(
    client: EtcdClient, run_id: str
) -> None:
    keys = RunKeys("/elastic", run_id)
    rogue = RogueMember(client, keys, "rogue-1")
    rogue.plant()
    (kv,) = client.range(keys.members, prefix=True).kvs
    member = parse_member(kv, keys.members)
    assert member.name == "rogue-1" and kv.lease == rogue.lease
    assert not Trust(b"the-job-secret", keys.round, run_id).admits_member(kv, member)
    assert Trust(None, keys.round).admits_member(kv, member), "without a secret it would join"
    client.put(keys.round, Round(round=4, members={"n1": 0}).encode())
    assert rogue.watch(lambda: True, timeout=10.0, linger=0.3).untrusted_s is not None
    client.put(keys.round, Round(round=5, members={"n1": 0, "rogue-1": 1}).encode())
    rogue.look()
    assert rogue.seen.as_dict()["rounds"] == [4, 5] and rogue.seen.ranked == {5}
    rogue.remove()
    assert not client.range(keys.members, prefix=True).kvs


def _tail(tmp_path: Path, events: list[dict[str, Any]]) -> EventTail:
    log = tmp_path / "events.jsonl"
    log.write_text("".join(json.dumps(e) + "\n" for e in events))
    return EventTail(log)


def _rogue_fault(**kw: Any) -> Fault:
    return Fault("rogue_member", 100.0, 40, node="rogue-1", t_end=105.0, world=3, **kw)


def test_a_rogue_that_was_named_and_got_no_rank_passes(tmp_path: Path) -> None:
    tail = _tail(
        tmp_path,
        [
            {"ts": 101.0, "kind": "rdzv.untrusted", "node": "rogue-1"},
            {"ts": 102.0, "kind": "rdzv.round", "node": "n1", "round": 3, "world_size": 3},
        ],
    )
    seen = [{"node": "rogue-1", "t": 100.0, "rounds": [3], "ranked": []}]
    result = rogue_members(tail, [_rogue_fault(steps_lost=0)], seen)
    assert result["ok"] and result["checks"] == 5 and result["kind"] == "rogue_member"


def test_a_rogue_with_a_rank_unnamed_or_losing_a_step_fails(tmp_path: Path) -> None:
    tail = _tail(
        tmp_path,
        [
            {"ts": 99.0, "kind": "rdzv.untrusted", "node": "rogue-1"},  # before: not it
            {"ts": 102.0, "kind": "rdzv.round", "node": "n1", "round": 4, "world_size": 4},
        ],
    )
    seen = [{"node": "rogue-1", "t": 100.0, "rounds": [3, 4], "ranked": [4]}]
    problems = rogue_members(tail, [_rogue_fault(steps_lost=2)], seen)["problems"]
    assert any("ranked the rogue key rogue-1 in rounds [4]" in p for p in problems)
    assert any("no rdzv.untrusted event named" in p for p in problems)
    assert any("world size 4, more than the 3 agents" in p for p in problems)
    assert any("2 steps lost" in p for p in problems)


def _frozen(t: float, **kw: Any) -> Fault:
    return Fault("frozen_etcd", t, 60, node="m1", t_end=t + 6.0, detail="stopped 6 s", **kw)


def test_a_frozen_etcd_may_skip_saves_but_not_fail_them(tmp_path: Path) -> None:
    skipped = {"ts": 203.0, "kind": "ckpt.save", "step": 65, "ok": False, "rank": 0}
    failed = {**skipped, "ts": 230.0, "step": 70, "error": "commit refused: EtcdConnectionError"}
    later = {**failed, "ts": 260.0, "step": 75}  # after the next fault: not this one's
    events = [{**skipped, "error": SKIPPED_SAVE + "etcd did not answer"}, failed, later]
    faults = [_frozen(200.0, steps_lost=0), Fault("storage_ro", 250.0, 70, steps_lost=0)]
    result = frozen_etcd(_tail(tmp_path, events), faults, only_member=False)
    assert result["checks"] == 1 + 2 and result["kind"] == "frozen_etcd"
    assert result["problems"] == [
        "the save of step 70 (rank 0) after freezing etcd m1 failed instead of being "
        "skipped: commit refused: EtcdConnectionError"
    ]


def test_a_frozen_only_etcd_must_be_seen_unreachable_then_reachable(tmp_path: Path) -> None:
    faults = [_frozen(200.0, steps_lost=0)]
    assert "no etcd.unreachable" in frozen_etcd(_tail(tmp_path, []), faults, True)["problems"][0]
    lost = {"ts": 204.0, "kind": "etcd.unreachable"}
    back = {"ts": 207.0, "kind": "etcd.reachable", "seconds": 3.0}
    problems = frozen_etcd(_tail(tmp_path, [lost]), faults, True)["problems"]
    assert problems and "no etcd.reachable" in problems[0]
    assert frozen_etcd(_tail(tmp_path, [lost, back]), faults, True)["ok"]
    assert not frozen_etcd(_tail(tmp_path, []), [_frozen(200.0)], False)["ok"], "not recovered"


@pytest.mark.integration
def test_a_freeze_outlasts_requests_only_for_a_single_etcd_and_stays_in_the_tolerance(
    tmp_path: Path,
) -> None:
    job = ChaosJob(ChaosOptions(runs_dir=tmp_path))
    rdzv = job.rendezvous_options()
    assert (rdzv.request_timeout, rdzv.outage_timeout) == (30.0, 600.0), "the agents' defaults"
    injector = Injector(job, random.Random(0))
    assert all(3.0 <= injector._frozen_s(only=False) <= 8.0 for _ in range(20))
    assert all(33.0 <= injector._frozen_s(only=True) <= 38.0 for _ in range(20))


def _step(ts: float, step: int, world: int) -> dict[str, Any]:
    return {"ts": ts, "kind": "train.step", "step": step, "world_size": world}


def test_training_is_stable_once_the_old_world_switched_in_place(tmp_path: Path) -> None:
    """A CI run (2026-12-02): one node formed the first round alone, the other two joined
    1.75 s later and its worker trained steps 3-4 at world 1 until the joiners were ready
    (in place), then world 3 from step 5. That start is stable at step 5; the harness
    waited until the job's end instead and injected no fault."""
    rounds = [{"ts": 1.75 + i / 100, "kind": "rdzv.round", "round": 1} for i in range(3)]
    old = [_step(0.9 + i / 2, i + 1, 1) for i in range(4)]
    new = [_step(3.0 + i / 2, i + 5, 3) for i in range(8)]
    tail = _tail(tmp_path, [*old[:2], *rounds, *old[2:], *new])
    start = Fault("start", 0.0, 0, t_end=0.0)
    wait_stable(tail, start, lambda: 3, 256, timeout=1.0)
    assert not start.error and start.recover_s == 3.0
    back = [_step(7.0 + i / 2, i + 13, 1) for i in range(8)]  # the world went back: not stable
    tail = _tail(tmp_path, [*old[:2], *rounds, *old[2:], *new[:3], *back])
    late = Fault("start", 0.0, 0, t_end=0.0)
    wait_stable(tail, late, lambda: 3, 256, timeout=0.5)
    assert late.error.startswith("no stable training at world 3")
