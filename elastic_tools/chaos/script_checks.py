"""The invariants of a chaos run on a user's script (:mod:`elastic_tools.chaos.script`).

* the job completed: every step from 1 to the script's last ran (a step ran when rank 0
  reported it or a group went on from its state: :func:`elastic.events.completed_steps`),
  the newest step is the last, and no worker outlived its agent;
* no step completed twice: rank 0 reported each step once (a step redone after a resume
  from an older state is reported again);
* every exit code is explained: a node killed with ``kill -9`` ended by SIGKILL; every
  other agent exited 0, and only once the job had reached its last step, or after the
  SIGTERM of a planned leave. A job that ends early with exit 0 fails here;
* each sample once per epoch (``train.samples``), as for our worker;
* the final model within the script's bound of the fault-free reference, and every kept
  step's loss within :data:`~elastic_tools.chaos.invariants.LOSS_RTOL` of the reference's.

The checks on loads, snapshots, the newest step and recoveries are the common ones
(:mod:`elastic_tools.chaos.invariants`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from elastic import events
from elastic_tools.chaos.fault import Fault
from elastic_tools.chaos.invariants import (
    LOSS_RTOL,
    Check,
    Verdict,
    check,
    compare_losses,
    kept_samples,
    model_differences,
    recovered,
    sample_problems,
    snapshot_resumes,
    storage_loads,
)
from elastic_tools.chaos.job import ChaosJob
from elastic_tools.chaos.script import ScriptReference, ScriptSpec, final_script_model

# What an agent says when it finds the job's rendezvous closed: the job finished first.
FINISHED = "is closed (the job finished)"


def check_script_invariants(
    job: ChaosJob,
    faults: Sequence[Fault],
    codes: Mapping[str, int | None],
    orphans: list[int],
    reference: ScriptReference,
) -> Verdict:
    """Every invariant of a run on a user's script, in the report's order."""
    spec = job.opts.script
    assert spec is not None
    seen = job.observer.seen
    log = events.read(job.cluster.event_log)
    checks = [
        completed(job, spec, log, orphans),
        once(log),
        exits_explained(job, spec, codes),
        snapshot_resumes(job.tail, seen),
        storage_loads(job.tail, seen, job.run_id),
        check(
            "the newest complete step never deleted while newest",
            seen.newest_checks,
            seen.violations,
        ),
        script_samples(job, spec),
        recovered(faults),
    ]
    return compare_reference(job, spec, reference, Verdict(checks))


def completed(
    job: ChaosJob, spec: ScriptSpec, log: Sequence[Mapping[str, Any]], orphans: list[int]
) -> Check:
    """Every step of the job ran, the newest is the last, no worker outlived its agent."""
    ran = events.completed_steps(log)
    missing = sorted(set(range(1, spec.steps + 1)) - ran)
    top = max(ran, default=0)
    problems = []
    if top != spec.steps:
        problems.append(f"the job reached step {top}, not its last step {spec.steps}")
    if missing:
        problems.append(f"{len(missing)} steps never ran: {_ranges(missing)}")
    problems += [f"worker {p} outlived its agent" for p in orphans]
    name = f"the job completed: steps 1-{spec.steps} all ran, none beyond"
    return check(name, spec.steps + len(orphans), problems)


def once(log: Sequence[Mapping[str, Any]]) -> Check:
    """No step completed twice: every group went on (a resume, a re-form) from the newest
    step reported before it, never from an older one, which would train the steps between
    again. A rank that reports the step it was frozen in, after its group went on without
    it, redoes nothing: it takes the group's state next (``stale_reports``, not a failure).

    One exception, named in the check: a live node whose own etcd lease expired
    (``node.expired``: etcd stalled, or the agent was starved past the lease) is what a
    frozen node looks like to the rendezvous, so its round goes on without it, from the
    newest state the others hold; a resume behind the newest step after such an expiry,
    and before the job passed that step again, is a false death's cost, not a lost step.
    """
    newest, problems, checks = 0, [], 0
    expired: str | None = None  # the node whose lease expired, until the job passes newest
    excused: list[str] = []
    for e in log:
        kind, step = e.get("kind"), e.get("step")
        if kind == "node.expired":
            expired = str(e.get("node"))
        if not isinstance(step, int):
            continue
        if kind == "train.step":
            if step > newest:
                expired = None
            newest = max(newest, step)
        elif kind in events.RESUMED or kind == "recovery.resume":
            checks += 1
            if step < newest:
                what = (
                    f"{kind} of pid {e.get('pid')} went on from step {step} after step "
                    f"{newest} completed: steps {step + 1}-{newest} ran twice"
                )
                if expired is None:
                    problems.append(what)
                else:
                    excused.append(f"{what}, after the lease of {expired} expired")
    name = "no step completed twice (every resume from the newest step)"
    if excused:
        name += f"; {len(excused)} after a live node's lease expired: {excused[0]}"
    return check(name, checks, problems)


def stale_reports(steps: Sequence[Mapping[str, Any]]) -> list[int]:
    """The steps rank 0 reported more than once (a thawed rank reports its frozen step)."""
    counts = Counter(int(e["step"]) for e in steps)
    return sorted(s for s, n in counts.items() if n > 1)


def exits_explained(job: ChaosJob, spec: ScriptSpec, codes: Mapping[str, int | None]) -> Check:
    """Each agent's exit code has a reason: killed by us (SIGKILL), a planned leave
    (SIGTERM, exit 0), the job's end (exit 0 at the last step), or a joiner that found
    the rendezvous closed because the job had finished (its log says so)."""
    problems = []
    for name in sorted(codes):
        code = codes[name]
        exit_info = job.exits.get(name, {})
        step = exit_info.get("step")
        if code != 0 and step == spec.steps and FINISHED in job.cluster.nodes[name].output():
            continue  # it came as the job ended: the rendezvous was closed
        why = explain(name, code, step, spec.steps, job.killed, job.left)
        if why is not None:
            problems.append(why)
    return check(
        "every exit code explained (kill -9, a planned leave, or the job's end)",
        len(codes),
        problems,
    )


def explain(
    name: str, code: int | None, step: int | None, last: int, killed: set[str], left: set[str]
) -> str | None:
    """What is wrong with node ``name``'s exit ``code`` (None: it is explained): ``step``
    is the newest step when it exited."""
    if name in killed:
        return None if code == -9 else f"{name} was killed with kill -9 but exited {code}"
    if code is None:
        return f"{name} was still running at the end"
    if code != 0:
        return f"{name} exited {code} (neither killed nor stopped)"
    if name in left:
        return None
    if step is not None and step < last:
        return (
            f"{name} exited 0 at step {step} of {last} though nobody stopped it: "
            "the job ended early"
        )
    return None


def script_samples(job: ChaosJob, spec: ScriptSpec) -> Check:
    """Each sample used once per epoch, every step with its full global batch."""
    name = "each sample used once per epoch (train.samples)"
    if not spec.global_batch:
        return check(name + ": not checked, the script's global batch is unknown", 0, [])
    kept = kept_samples(job.tail.of("train.samples"))
    problems = sample_problems(kept, spec.steps_per_epoch, spec.global_batch)
    missing = sorted(set(range(1, spec.steps + 1)) - set(kept))
    if missing:
        problems.append(f"steps without samples: {_ranges(missing)}")
    return check(name, len(kept), problems)


def compare_reference(
    job: ChaosJob, spec: ScriptSpec, reference: ScriptReference, verdict: Verdict
) -> Verdict:
    """The final model's and the losses' checks against the fault-free reference."""
    diffs: dict[str, float] = {}
    problems: list[str] = []
    try:
        ref = reference.model()
        final = final_script_model(job.ckpt, job.run_id, spec.steps, job.secret())
        diffs = model_differences(final, ref)
        problems = [f"{k}: {v:.2e}" for k, v in diffs.items() if not v < spec.model_rtol]
    except Exception as exc:  # a missing checkpoint is a failed check, not a crash
        problems = [f"{type(exc).__name__}: {exc}"]
    verdict.worst_model_rel_l2 = max(diffs.values(), default=math.inf if problems else 0.0)
    losses, loss_problems = 0, list[str]()
    if reference.losses:
        losses, loss_problems, verdict.loss_drift = compare_losses(job.tail, reference.losses)
    verdict.checks += [
        check(
            f"final model within {spec.model_rtol:g} (relative L2 per tensor) of the "
            "fault-free reference",
            len(diffs),
            problems,
        ),
        check(
            f"every kept step's loss equals the reference's (relative < {LOSS_RTOL:g})",
            losses,
            loss_problems or ([] if losses else ["the reference recorded no losses"]),
        ),
    ]
    return verdict


def _ranges(steps: Sequence[int]) -> str:
    """``[1, 2, 3, 7]`` as ``1-3, 7`` (the first ten ranges)."""
    out: list[str] = []
    start = prev = None
    for s in [*steps, None]:
        if s is not None and prev is not None and s == prev + 1:
            prev = s
            continue
        if start is not None:
            out.append(f"{start}-{prev}" if prev != start else f"{start}")
        start = prev = s
    return ", ".join(out[:10]) + (" ..." if len(out) > 10 else "")


__all__ = [
    "check_script_invariants",
    "compare_reference",
    "completed",
    "exits_explained",
    "explain",
    "once",
    "script_samples",
    "stale_reports",
]
