"""Recovery of one job at N nodes: elastic and torchft side by side, interleaved (issue 39).

Method. For each size N of ``--sizes`` (default 3, 8, 16) the same job runs ``--runs`` times
(default 2) under each system, interleaved: elastic, torchft, elastic, torchft, ... Every run
has its own temp dir and run id, and (elastic) its own etcd or (torchft) its own Lighthouse;
one worker per node, every node a process tree on this machine. The job is
``bench/recovery.py``'s torchft comparison (a 16-32-2 MLP in float64, AdamW, a cosine
schedule, each step paced by ``--step-s``), with a global batch that divides among N and N - 1
(:func:`job`): ``tests/scripts/inplace_user.py`` on ``elastic.Run`` in place under
``elastic-agent`` (``profile=fast-failover,join_timeout=120``, ``--nnodes=1:N``), and
``bench/torchft_user.py`` (a ``torchft.Manager``, its DDP and ``OptimizerWrapper``, one
replica group per node) under a Lighthouse tuned like that profile
(``bench/torchft_cluster.py``).

One run: N nodes start and train at world N, then ``STEPS_BETWEEN`` steps more; then

1. ``kill``: node nN is killed with ``kill -9``, its agent and worker (world N -> N - 1);
2. ``join``: a new node starts (N - 1 -> N);
3. ``leave``: node n2 gets SIGTERM, a planned leave (N -> N - 1);

with ``STEPS_BETWEEN`` steps after each. Figures (seconds, from
:func:`elastic_tools.harness.cluster.measure`): ``kill_s`` and ``leave_s``, the event to the
first step at world N - 1; ``join_pause_s``, the survivors' pause (the gap between the last
step before and the first step at world N); ``join_first_step_s``, the joiner's start to that
first step. A step counts once its whole body, its pace included, is done (both sides).

Correctness, per run (:func:`correctness`): each worker appends one line per step attempt
(step, round or quorum id, rank, world, the sample indices) to ``out/steps.jsonl`` before
the step's collectives, and torchft's a line when the step committed; a step's samples are
those of its attempts in the round that committed it (elastic: the step's newest round, a
failed attempt is redone in a later one), one attempt per rank. The run is correct when the
completed steps in the event log never go back or repeat (no completed step redone), every
completed step has every rank's share and exactly the global batch of distinct samples, and
no sample is used twice in an epoch (each complete epoch uses every sample once).

Usage: ``flock /tmp/elastic-heavy.lock python bench/scale.py [--sizes 3,8,16] [--runs N]
[--step-s S] [--event-timeout S] [--json-out FILE] [--keep]``; torchft must be installed
(see ``bench/README-recovery.md``, "torchft as a baseline").
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages first
sys.path.insert(1, str(Path(__file__).resolve().parent))  # bench/recovery.py, torchft_cluster

from elastic_tools.harness import benchjson
from elastic_tools.harness.cluster import (
    REPO,
    AgentOptions,
    LocalCluster,
    WaitTimeout,
    agent_env,
    measure,
    provenance,
    pythonpath,
)

ELASTIC, TORCHFT = "mlp-inplace", "torchft"
SYSTEMS = (ELASTIC, TORCHFT)
PATHS = {
    ELASTIC: "elastic: tests/scripts/inplace_user.py on elastic.Run in place under "
    "elastic-agent (etcd v3 rendezvous, profile=fast-failover,join_timeout=120)",
    TORCHFT: "torchft: bench/torchft_user.py on torchft.Manager (ProcessGroupGloo, its DDP and "
    "OptimizerWrapper, synchronous quorum) under torchft_lighthouse (tuned: heartbeat 3 s, "
    "join timeout 1 s, 20 ms tick)",
}
STEP_S = 0.08
STEPS_BETWEEN = 8
EPOCHS = 1000  # never reached: the bench stops the job after the last event
MIN_BATCH = 12  # recovery.py's global batch: the smallest here
STEPS_PER_EPOCH = 100
FIGURES = ("kill_s", "leave_s", "join_pause_s", "join_first_step_s")


def job(n: int) -> tuple[int, int]:
    """The global batch and the number of samples of the job at ``n`` nodes: the smallest
    multiple of lcm(n, n - 1) of at least :data:`MIN_BATCH` (``elastic.Run`` splits a global
    batch evenly among the ranks), and :data:`STEPS_PER_EPOCH` such batches."""
    unit = math.lcm(n, max(n - 1, 1))
    batch = unit * math.ceil(MIN_BATCH / unit)
    return batch, batch * STEPS_PER_EPOCH


# -- correctness: pure functions of the workers' step records and the step events --------------


def kept(records: Iterable[Mapping[str, Any]]) -> dict[int, dict[int, list[int]]]:
    """Step -> rank -> the samples of that rank's attempt in the round that completed the
    step: the round of a ``committed`` line for it when there is one (torchft), else the
    step's newest round (``elastic.Run`` redoes a failed attempt in a later round); a rank's
    later attempt in that round replaces its earlier one."""
    attempts = [r for r in records if not r.get("committed")]
    chosen: dict[int, Any] = {}
    for r in attempts:
        if r["step"] not in chosen or _later(r["round"], chosen[r["step"]]):
            chosen[r["step"]] = r["round"]
    chosen.update({r["step"]: r["round"] for r in records if r.get("committed")})
    out: dict[int, dict[int, list[int]]] = defaultdict(dict)
    for r in attempts:
        if r["round"] == chosen[r["step"]]:
            out[r["step"]][r["rank"]] = list(r["idx"])
    return dict(out)


def _later(a: Any, b: Any) -> bool:
    """Whether round ``a`` is newer than ``b`` (None, a round not yet known, is oldest)."""
    if b is None:
        return a is not None
    return a is not None and a > b


def correctness(
    records: Sequence[Mapping[str, Any]],
    steps: Sequence[int],
    global_batch: int,
    samples: int,
) -> dict[str, Any]:
    """Whether a run trained right: ``steps`` (the step numbers of the ``train.step``
    events, in order) never go back or repeat (``no_step_redone``), and each of the
    ``max(steps)`` completed steps (0-based ``0 .. max - 1`` in ``records``) has every rank's
    share and ``global_batch`` distinct samples, none used twice in an epoch and each
    complete epoch using all ``samples`` (``samples_once``). ``ok``: both; ``problems``:
    the first few things wrong, in words."""
    redone = [b for a, b in itertools.pairwise(steps) if b <= a]
    wrong: list[str] = []  # the samples
    done = max(steps, default=0)
    by_step = kept(records)
    per_epoch = samples // global_batch
    epoch_used: dict[int, list[int]] = defaultdict(list)
    for step in range(done):
        ranks = by_step.get(step)
        if not ranks:
            wrong.append(f"step {step} has no record")
            continue
        if sorted(ranks) != list(range(len(ranks))):
            wrong.append(f"step {step} has the shares of ranks {sorted(ranks)}")
        used = [i for rank in sorted(ranks) for i in ranks[rank]]
        if len(used) != global_batch or len(set(used)) != len(used):
            wrong.append(f"step {step} used {len(used)} samples ({len(set(used))} distinct)")
        epoch_used[step // per_epoch].extend(used)
    for epoch, used in sorted(epoch_used.items()):
        if len(set(used)) != len(used):
            wrong.append(f"epoch {epoch} used a sample twice")
        elif (epoch + 1) * per_epoch <= done and sorted(used) != list(range(samples)):
            wrong.append(f"epoch {epoch} did not use every sample")
    problems = [f"completed step(s) {redone[:5]} recorded again or out of order"] if redone else []
    problems += wrong
    return {
        "ok": not problems,
        "no_step_redone": not redone,
        "samples_once": not wrong,
        "steps_checked": done,
        "problems": problems[:5],
    }


# -- summary: pure functions of the runs' figures ----------------------------------------------


def p90(values: Sequence[float]) -> float:
    """The 90th percentile of ``values`` (linear between the closest ranks, inclusive)."""
    if len(values) == 1:
        return float(values[0])
    return statistics.quantiles(values, n=10, method="inclusive")[8]


def figure(values: Sequence[float | None], digits: int = 3) -> dict[str, Any]:
    """Median, min, max (and ``p90`` from 5 figures on) of the figures that came, with
    ``n`` and ``missing`` (:func:`elastic_tools.harness.benchjson.spread`)."""
    out = benchjson.spread(values, digits)
    got = [float(v) for v in values if v is not None]
    if len(got) >= 5:
        out["p90"] = round(p90(got), digits)
    return out


def figures_of(events: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """One run's four figures from its events (:func:`measure`'s entries)."""
    by_kind = {e["kind"]: e for e in events}

    def get(kind: str, key: str) -> float | None:
        value = by_kind.get(kind, {}).get(key)
        return float(value) if value is not None else None

    return {
        "kill_s": get("kill", "recover_s"),
        "leave_s": get("leave", "recover_s"),
        "join_pause_s": get("join", "pause_s"),
        "join_first_step_s": get("join", "recover_s"),
    }


def summarize(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per size and system: each figure's :func:`figure` over the runs, how many runs were
    complete (``ok``: every event recovered) and correct (:func:`correctness`)."""
    out: dict[str, Any] = {}
    sizes = sorted({r["nodes"] for r in runs})
    for n in sizes:
        row: dict[str, Any] = {}
        for system in dict.fromkeys(r["system"] for r in runs):
            mine = [r for r in runs if r["nodes"] == n and r["system"] == system]
            if not mine:
                continue
            cell: dict[str, Any] = {
                "path": PATHS.get(system, system),
                "runs": len(mine),
                "complete": sum(bool(r["ok"]) for r in mine),
                "correct": sum(bool(r["correct"]["ok"]) for r in mine),
            }
            for key in FIGURES:
                cell[key] = figure([r["figures"][key] for r in mine])
            row[system] = cell
        out[str(n)] = row
    return out


def versus(summary: Mapping[str, Any]) -> dict[str, Any]:
    """Per size and figure, elastic's median over torchft's (below 1: elastic is faster)."""
    out: dict[str, Any] = {}
    for n, row in summary.items():
        mine, theirs = row.get(ELASTIC), row.get(TORCHFT)
        if not mine or not theirs:
            continue
        ratios = {}
        for key in FIGURES:
            a, b = mine[key]["median"], theirs[key]["median"]
            ratios[f"{key}_elastic_over_torchft"] = round(a / b, 2) if a is not None and b else None
        out[n] = ratios
    return out


def interleaved(sizes: Sequence[int], runs: int) -> list[tuple[int, str]]:
    """The runs in order: per size, elastic then torchft, ``runs`` times."""
    return [(n, system) for n in sizes for _ in range(runs) for system in SYSTEMS]


# -- the runs ----------------------------------------------------------------------------------


def make_cluster(system: str, n: int, run_dir: Path, step_s: float) -> LocalCluster:
    """A cluster of ``system`` for ``n`` nodes (at most ``n`` at once) in ``run_dir``."""
    from recovery import MLP_SCRIPT, TORCHFT_PG_TIMEOUT_S

    batch, samples = job(n)
    args = [f"--epochs={EPOCHS}", f"--samples={samples}", f"--global-batch={batch}"]
    args += [f"--step-delay={step_s}", f"--out={run_dir / 'out'}"]
    run_id = f"scale-{uuid.uuid4().hex[:8]}"
    if system == TORCHFT:
        from torchft_cluster import LIGHTHOUSE_TUNED, TorchftCluster

        return TorchftCluster(
            run_dir,
            run_id,
            lighthouse=LIGHTHOUSE_TUNED,
            script_args=[*args, f"--pg-timeout={TORCHFT_PG_TIMEOUT_S[TORCHFT]:g}"],
            env=agent_env(PYTHONPATH=pythonpath()),
            cwd=REPO,
        )
    options = AgentOptions(nnodes=f"1:{n}", max_restarts=10, monitor_interval=0.3)
    return LocalCluster(
        run_dir,
        run_id,
        options=options,
        env=agent_env(LOGLEVEL="INFO", PYTHONPATH=pythonpath()),
        cwd=REPO,
        script=[MLP_SCRIPT, *args],
    )


def start_all(cluster: LocalCluster, n: int, timeout: float) -> None:
    """Start nodes n1 .. nN, wait until they train at world N, then some steps more."""
    for i in range(1, n + 1):
        cluster.start(f"n{i}", host=i == 1)
    cluster.wait_for_world(n, 0.0, timeout)
    cluster.train_more(STEPS_BETWEEN, timeout)


def scenario(
    cluster: LocalCluster, n: int, timeout: float, start_timeout: float
) -> list[dict[str, Any]]:
    """N nodes train; nN is killed with -9 (N - 1); a new node joins (N); n2 leaves (N - 1)."""
    from recovery import _annotate

    start_all(cluster, n, start_timeout)
    joiner = f"n{n + 1}"
    plan: list[tuple[str, str, int, Callable[[], object]]] = [
        ("kill", f"n{n}", n - 1, lambda: cluster.kill_node(f"n{n}")),
        ("join", joiner, n, lambda: cluster.start(joiner, host=False)),
        ("leave", "n2", n - 1, lambda: cluster.leave("n2")),
    ]
    done: list[dict[str, Any]] = []
    for kind, node, world, act in plan:
        entry, first = measure(cluster, kind, node, world, act, timeout)
        done.append(entry)
        if first is None:
            break
        with contextlib.suppress(OSError, ValueError, KeyError):
            _annotate(cluster, entry, first)
        cluster.train_more(STEPS_BETWEEN, timeout)
    return done


def _records(out: Path) -> list[dict[str, Any]]:
    path = out / "steps.jsonl"
    if not path.exists():
        return []
    found = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):  # a line cut short by a kill -9
            found.append(json.loads(line))
    return found


def one_run(system: str, n: int, base: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One run of :func:`scenario`; always kills what it started."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"{system}-{n}-", dir=base))
    cluster = make_cluster(system, n, run_dir, args.step_s)
    started, load = time.time(), os.getloadavg()[0]
    events: list[dict[str, Any]] = []
    error = None
    try:
        cluster.open()
        events = scenario(cluster, n, args.event_timeout, args.start_timeout)
    except WaitTimeout as exc:
        error = str(exc)
    finally:
        steps = [e["step"] for e in cluster.steps()] if cluster.event_log.exists() else []
        cluster.close()
    batch, samples = job(n)
    result: dict[str, Any] = {
        "system": system,
        "nodes": n,
        "run_id": cluster.run_id,
        "ok": error is None and len(events) == 3 and None not in figures_of(events).values(),
        "figures": figures_of(events),
        "correct": correctness(_records(run_dir / "out"), steps, batch, samples),
        "events": events,
        "total_s": round(time.time() - started, 1),
        "loadavg_1min_start_end": [load, os.getloadavg()[0]],
    }
    if error:
        result["error"] = error
    if args.keep:
        result["dir"] = str(run_dir)
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
    print(json.dumps({k: result[k] for k in ("system", "nodes", "ok", "figures")}), file=sys.stderr)
    return result


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="3,8,16", help="comma list of node counts (default 3,8,16)")
    p.add_argument("--runs", type=int, default=2, help="runs per size and system (default 2)")
    p.add_argument("--step-s", type=float, default=STEP_S, help=f"paced step (default {STEP_S})")
    p.add_argument(
        "--event-timeout", type=float, default=120.0, help="seconds an event may take (120)"
    )
    p.add_argument(
        "--start-timeout", type=float, default=600.0, help="seconds to reach world N (600)"
    )
    p.add_argument("--keep", action="store_true", help="keep the run dirs (logs, event logs)")
    p.add_argument("--json-out", type=Path, help="also write the JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    if min(sizes) < 3:
        raise SystemExit("Each size must be at least 3 nodes (a leave takes one of N - 1 >= 2).")
    from recovery import torchft_refusal

    if refusal := torchft_refusal([TORCHFT]):
        raise SystemExit(refusal)
    import torch

    ran = provenance()  # the commit that runs, read before the runs (they take minutes)
    base = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    load = [os.getloadavg()[0]]
    try:
        runs = [one_run(system, n, base, args) for n, system in interleaved(sizes, args.runs)]
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    load.append(os.getloadavg()[0])
    summary = summarize(runs)
    out = {
        **ran,
        "finished_utc": provenance()["utc"],
        "torch": torch.__version__,
        "command": " ".join(["bench/scale.py", *(argv if argv is not None else sys.argv[1:])]),
        "method": {
            "scenario": "N nodes train; nN kill -9 (N-1); a new node joins (N); n2 SIGTERM (N-1)",
            "paths": PATHS,
            "jobs": {str(n): {"global_batch": job(n)[0], "samples": job(n)[1]} for n in sizes},
            "step_s": args.step_s,
            "steps_between_events": STEPS_BETWEEN,
            "order": "per size: elastic, torchft, elastic, torchft, ...",
            "cpus": os.cpu_count(),
            "loadavg_1min_start_end": load,
        },
        "summary": summary,
        "versus": versus(summary),
        "runs": runs,
    }
    return benchjson.output(out, args.json_out)


if __name__ == "__main__":
    raise SystemExit(main())
