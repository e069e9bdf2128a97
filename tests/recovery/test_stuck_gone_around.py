"""A stopped worker is gone around (elastic.agent.stuck; issue 39 item 3).

Three agents train in place (tests/scripts/inplace_user.py on ``Run``) with the hang check
on. One node's worker alone is stopped (SIGSTOP; a hung device looks the same to its
peers): it can neither name itself nor exit. Past the hang bound the waiting ranks name it
(``worker.hang.suspects``, a verdict in the round's store); its agent, seeing its worker
both named and stopped, ends it at once (``worker.stuck``, not the 3 s frozen-worker kill)
and leaves the round, so the others' next step comes at world 2 within bound + 0.5 s; the
node then rejoins as a joiner with a fresh worker (world 3 again). No completed step is
redone, every agent exits 0 and the job spends none of its restarts. Measured alone and
beside a CPU hog (this machine has 2 cores).

This file is also the tests' worker: run as a script it writes its pid where the test finds
it (``<out>/workers/<agent pid>``), then runs the user's script.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch  # noqa: F401  (before any os.environ: the worker starts warm)

from elastic_tools.harness.cluster import LocalCluster

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "inplace_user.py"
SAMPLES, BATCH, EPOCHS, BOUND = 240, 12, 12, 2.0
# On this 2-core machine, beside other jobs: the figure measured is printed; the target is
# bound + 0.5 s, and the margin absorbs a scheduler stall of the 5 processes involved.
MARGIN_S = 0.5


@pytest.fixture
def hog(request: pytest.FixtureRequest) -> Iterator[None]:
    """A CPU hog (one busy process) while the test runs, when the parameter asks for it."""
    if not request.param:
        yield
        return
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("hog", [False, True], ids=["alone", "beside-a-cpu-hog"], indirect=True)
def test_a_stopped_worker_is_gone_around_at_world_minus_one(
    cluster: LocalCluster, tmp_path: Path, hog: None
) -> None:
    out = tmp_path / "out"
    worker = [
        str(Path(__file__)),
        f"--epochs={EPOCHS}",
        f"--samples={SAMPLES}",
        f"--global-batch={BATCH}",
        f"--out={out}",
        "--step-delay=0.05",
    ]
    calm = {"ELASTIC_HANG": f"{BOUND:g},5"}
    nodes = {n: cluster.start(n, worker=worker, extra_env=calm, nnodes="2:3") for n in "abc"}
    cluster.wait_for(
        lambda: [e for e in cluster.steps() if e["world_size"] == 3 and e["step"] >= 30],
        "30 steps at world 3",
        240,
    )
    pid_file = out / "workers" / str(nodes["c"].pid)
    stuck_pid = int(pid_file.read_text())
    stopped = time.time()
    os.kill(stuck_pid, signal.SIGSTOP)  # the worker alone: its agent runs on
    suspects = cluster.wait_for(
        lambda: cluster.events("worker.hang.suspects"), "worker.hang.suspects", 60
    )[0]
    ended = cluster.wait_for(lambda: cluster.events("worker.stuck"), "worker.stuck", 30)[0]
    assert ended["pid"] == stuck_pid, (ended, stuck_pid)
    went_on = cluster.wait_for_world(2, stopped, 60)
    back = cluster.wait_for_world(3, went_on["ts"], 120)
    assert all(n.wait(240) == 0 for n in nodes.values()), cluster.logs()

    bound_at = suspects["ts"] - suspects["seconds"] + suspects["bound_s"]
    figure = went_on["ts"] - bound_at
    print(
        f"stopped at step {suspects['step']}; bound {suspects['bound_s']} s; next step at "
        f"world 2 {figure:.3f} s after the bound ({went_on['ts'] - stopped:.2f} s after the "
        f"SIGSTOP; verdict +{suspects['ts'] - bound_at:.3f} s, worker ended "
        f"+{ended['ts'] - bound_at:.3f} s); world 3 again {back['ts'] - went_on['ts']:.2f} s later"
    )
    assert suspects["bound_s"] >= BOUND and len(suspects["ranks"]) == 1, suspects
    assert figure <= 0.5 + MARGIN_S, f"gone around {figure:.3f} s after the bound"
    assert not cluster.events("worker.frozen"), "the 3 s frozen-worker kill acted"
    spent = [e for e in cluster.events("worker.restart") if e.get("reason") == "failure"]
    assert not spent, f"a restart of the job's budget was spent: {spent}"
    steps = [e["step"] for e in cluster.steps()]
    assert steps == sorted(set(steps)), "a completed step was redone"
    assert max(steps) == EPOCHS * SAMPLES // BATCH
    assert int(pid_file.read_text()) != stuck_pid, "the node came back with the same worker"


def _worker() -> None:
    """Write this worker's pid under its agent's pid, then run the user's script."""
    import runpy

    out = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--out="))
    from elastic import env

    owner = os.environ.get(env.SNAPSHOT_OWNER, "unknown")
    folder = Path(out) / "workers"
    folder.mkdir(parents=True, exist_ok=True)
    temporary = folder / f".{owner}.{os.getpid()}"
    temporary.write_text(str(os.getpid()))
    temporary.replace(folder / owner)
    sys.argv = [str(SCRIPT), *sys.argv[1:]]
    runpy.run_path(str(SCRIPT), run_name="__main__")


if __name__ == "__main__":
    _worker()
