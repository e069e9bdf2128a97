"""The fault plan of a chaos run: the kinds of fault, a run's options, which kinds this
machine can inject, and the seeded schedule drawn from them."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from elastic.configs import config_path

if TYPE_CHECKING:
    from elastic_tools.chaos.script import ScriptSpec

logger = logging.getLogger(__name__)

TINY = config_path("tiny")  # shipped as package data: found from a wheel install too

KINDS: Mapping[str, str] = {
    "kill_agent": "kill -9 of a whole node (agent and worker)",
    "kill_worker": "kill -9 of one node's worker (its agent restarts it)",
    "kill_in_save": "kill -9 of rank 0 while a save-<nonce> directory has no marker yet",
    "kill_after_fence": "kill -9 of rank 0 once a commit record is in etcd, before its marker",
    "kill_in_purge": "kill -9 of rank 0 while it deletes an old step",
    "leave": "SIGTERM of an agent (a planned leave)",
    "join": "a new agent joins",
    "stop_cont": "SIGSTOP of an agent for a few seconds, then SIGCONT",
    "etcd_restart": "every etcd member killed with kill -9, restarted a few seconds later",
    "etcd_member": "one member of the 3-member etcd cluster killed, restarted later",
    "storage_ro": "the checkpoint directory read-only for a few seconds",
    "stale_writer": "a process holding an old round's fence tries to commit and purge",
    "cut_link": "a node's network link cut (needs network namespaces)",
    "rogue_member": "an unsigned member key written straight into etcd (needs the job secret)",
    "frozen_etcd": "SIGSTOP of one etcd member (or the only one), SIGCONT within the tolerance",
}
REMOVES = {"kill_agent", "leave"}
AIMED = {"kill_in_save", "kill_after_fence", "kill_in_purge"}


@dataclass
class ChaosOptions:
    """One chaos run. ``every_s``: mean seconds from one fault to the next."""

    minutes: float = 10.0
    seed: int = 0
    runs_dir: Path = Path("runs")
    every_s: float = 120.0
    agents: int = 3
    min_agents: int = 2
    max_agents: int = 4
    step_s: float = 0.5  # the worker's job.min_step_s: the pace of a step
    max_steps: int | None = None  # default: what minutes allow at step_s
    interval: int = 5  # checkpoint.interval
    kinds: Sequence[str] | None = None  # default: every kind this machine can inject
    etcd_members: int = 3
    config: Path = TINY
    recover_timeout: float = 240.0
    netns: bool | None = None  # nodes in network namespaces; None: when cut_link can run
    secret: bool = True  # the job signs its records with a secret; rogue_member needs one
    faults: int | None = None  # inject this many (however long they take); default: by time
    script: ScriptSpec | None = None  # a user's script on elastic.Run instead of our worker
    compound: int = 0  # rounds of the compound schedule (elastic_tools.chaos.compound); 0: random
    freeze_s: float = 8.0  # a compound freeze of a node (agent and workers)
    etcd_freeze_s: float = 4.0  # a compound freeze of etcd
    margin_s: float = 60.0  # compound: no fault starts when the job has less time left
    compound_kinds: Sequence[str] | None = None  # compound: only these of its kinds; None: all
    say: Callable[[str], None] = field(default=lambda line: None)


def available_kinds(etcd_members: int, secret: bool = True) -> tuple[list[str], dict[str, str]]:
    """The kinds this machine (and a job with or without a ``secret``) can inject, and why
    each other kind is skipped. Every kind weighs the same: one per shuffled round."""
    from elastic_tools.harness.faults import netns_usable

    skipped: dict[str, str] = {}
    why = netns_usable()
    if why:
        skipped["cut_link"] = f"network namespaces are unusable here: {why}"
    if etcd_members < 3:
        skipped["etcd_member"] = "etcd runs as one member: a member loss is a full outage"
    if not secret:
        skipped["rogue_member"] = (
            "the job has no secret: its records are unsigned, so an unsigned member key "
            "would be trusted and given a rank (run with a secret to inject it)"
        )
    return [k for k in KINDS if k not in skipped], skipped


def choose_kinds(opts: ChaosOptions) -> tuple[list[str], dict[str, str]]:
    """The kinds a run injects (``opts.kinds`` less what this machine cannot), and why each
    skipped kind is skipped.

    Raises:
        ValueError: ``opts.kinds`` names a kind that does not exist.
    """
    kinds, skipped = available_kinds(opts.etcd_members, opts.secret)
    if not opts.kinds:
        return kinds, skipped
    unknown = [k for k in opts.kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"Unknown fault kinds {unknown}; the kinds are {list(KINDS)}.")
    for k in opts.kinds:
        if k in skipped:
            logger.warning("Skipping fault kind %s: %s.", k, skipped[k])
    return [k for k in opts.kinds if k not in skipped], skipped


def planned_steps(opts: ChaosOptions) -> int:
    """The job's steps: ``opts.max_steps``, or enough for the faults' time at ``step_s``."""
    if opts.script is not None:
        return opts.script.steps
    fault_s = opts.minutes * 60 if opts.faults is None else opts.faults * (opts.every_s + 10)
    return opts.max_steps or max(2 * opts.interval, int(fault_s / opts.step_s) + 40)


def schedule(
    rng: random.Random, opts: ChaosOptions, kinds: Sequence[str]
) -> tuple[list[str], list[float]]:
    """The run's faults in order, and the seconds before each (``every_s``, +-30%)."""
    count = opts.faults or max(1, int(opts.minutes * 60 / opts.every_s))
    faults = draw_faults(rng, kinds, count, opts.agents, opts.min_agents, opts.max_agents)
    return faults, [opts.every_s * rng.uniform(0.7, 1.3) for _ in faults]


def draw_faults(
    rng: random.Random, kinds: Sequence[str], count: int, agents: int, lo: int, hi: int
) -> list[str]:
    """``count`` fault kinds: shuffled rounds of ``kinds`` (every kind early), with a join put
    before a removal at ``lo`` agents and a removal before a join at ``hi``."""
    out: list[str] = []
    pool: list[str] = []
    while len(out) < count:
        if not pool:
            pool = list(kinds)
            rng.shuffle(pool)
        kind = pool.pop()
        before = _balancing(rng, kinds, kind, agents, lo, hi)
        if before is None:
            continue
        for k in [*before, kind]:
            out.append(k)
            agents += 1 if k == "join" else -1 if k in REMOVES else 0
    return out[:count]


def _balancing(
    rng: random.Random, kinds: Sequence[str], kind: str, agents: int, lo: int, hi: int
) -> list[str] | None:
    """The fault to put before ``kind`` that keeps ``agents`` within ``[lo, hi]`` (none: an
    empty list), or None when no kind can (``kind`` is then left out)."""
    if kind in REMOVES and agents <= lo:
        return ["join"] if "join" in kinds else None
    if kind == "join" and agents >= hi:
        removes = [k for k in kinds if k in REMOVES]
        return [rng.choice(removes)] if removes else None
    return []


__all__ = [
    "AIMED",
    "KINDS",
    "REMOVES",
    "TINY",
    "ChaosOptions",
    "available_kinds",
    "choose_kinds",
    "draw_faults",
    "planned_steps",
    "schedule",
]
