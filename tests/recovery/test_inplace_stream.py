"""A node frozen while a joiner's state streams from it (tests/scripts/inplace_user.py on Run,
in place).

Nodes a and b train; c joins, and the round that takes it in agrees that a holder streams
the state to it. The holder chosen as the source stops before it sends (this file, run as
every node's worker, makes the first stream's source at world 3 wait, once) and its node is frozen
(SIGSTOP of agent and worker): no error reaches the others, who wait in the stream's first
broadcast. At heartbeat expiry the agents form the next round (the other holder and c) and
abort the old group's collectives; the stream's broadcasts run through the step guard, so
both re-form in place and go on at world 2, the other holder streaming the state to c. The
frozen node is then killed. The job finishes with every step once, each sample once per
epoch, the fault-free model, and no worker restarted. (Seen in CI, stop 34: the stream's
broadcasts were plain ones, and the ranks left in it waited out the group's 5-minute
timeout while their peers waited in the newer round's formation for them.)
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch  # noqa: F401  (before any os.environ: the worker below starts warm)

from elastic.node.procs import descendants
from elastic_tools.harness.cluster import LocalCluster

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "inplace_user.py"
HOLD_MARK = "stream-source-holds"  # written (the source's pid) by the first stream's source


@pytest.mark.timeout(420)
def test_a_source_frozen_mid_stream_leaves_the_others_in_place(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    from tests.recovery.test_inplace import _args, _check_result, _records, _reference

    epochs = 20
    out, ref = tmp_path / "out", tmp_path / "ref"
    _reference(ref, epochs)
    args = [*_args(out), f"--epochs={epochs}", "--step-delay=0.05"]
    worker = [str(Path(__file__)), *args]
    nodes = {name: cluster.start(name, worker=worker) for name in "ab"}
    cluster.wait_for(
        lambda: [e for e in cluster.steps() if e["world_size"] == 2 and e["step"] >= 20],
        "20 steps at world 2",
        240,
    )
    nodes["c"] = cluster.start("c", worker=worker)
    mark = out / HOLD_MARK
    cluster.wait_for(lambda: (mark.exists() and mark.read_text().strip()) or None, "a source", 120)
    source_pid = int(mark.read_text())
    source = next(n for n, node in nodes.items() if source_pid in descendants(node.pid))
    assert source != "c", "the joiner cannot be the source of its own state"
    frozen = time.time()
    for pid in [nodes[source].pid, *descendants(nodes[source].pid)]:
        os.kill(pid, signal.SIGSTOP)  # a hung node: no error, no answer
    # Before: the others waited out the old group's 5-minute timeout in the stream.
    first = cluster.wait_for(lambda: cluster.first_step_after(frozen, 2), "a step at world 2", 120)
    print(f"first step at world 2 {first['ts'] - frozen:.2f} s after the freeze")
    for pid in [nodes[source].pid, *descendants(nodes[source].pid)]:
        os.kill(pid, signal.SIGKILL)
    others = [n for n in nodes if n != source]
    assert all(nodes[n].wait(240) == 0 for n in others), cluster.logs()
    pids = {r["pid"] for r in _records(out)}
    assert len(pids) == 3 and source_pid in pids, f"a worker restarted: pids {pids}"
    inplace = [e for e in cluster.events("recovery.inplace") if e["ts"] > frozen]
    assert {e["world_size"] for e in inplace} == {2}, inplace
    _check_result(cluster, out, ref, epochs)


def _hold_the_first_stream() -> None:
    """Run the user's script with the first stream's source stopping before it sends (its
    pid in the mark), as a node that hangs at that moment."""
    import runpy

    import torch.distributed as dist

    from elastic.worker import exchange

    out = Path(next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--out=")))
    real = exchange.stream

    def stream(meta: bytes | None, *args: object, **kwargs: object) -> object:
        # c's join (world 3); a may have trained alone first, and b's join streamed too.
        if meta is not None and dist.get_world_size() == 3:
            try:
                fd = os.open(out / HOLD_MARK, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                pass
            else:
                os.write(fd, str(os.getpid()).encode())
                os.close(fd)
                while True:  # frozen, then killed, by the test
                    time.sleep(1)
        return real(meta, *args, **kwargs)  # type: ignore[arg-type]

    exchange.stream = stream  # type: ignore[assignment]
    sys.argv = [str(SCRIPT), *sys.argv[1:]]
    runpy.run_path(str(SCRIPT), run_name="__main__")


if __name__ == "__main__":
    _hold_the_first_stream()
