"""A member rank that tampers with its step-boundary record cannot end the job or crash it
(issue 38; the red team's replay under real agents, in place).

Two agents run the user's script (tests/scripts/inplace_user.py). On node ``b`` this file
wraps the script (run as a script itself) and makes its rank write, every step, into its own
record what the red team wrote into the old summed vector (``$BOUNDARY_TAMPER``):

* ``stop``: the world size in its stop vote. On the summed vector that read as every rank
  stopping: both agents exited 0 at the first step, the job's loop cut short.
* ``nan``: NaN in its stop vote. On the summed vector every rank raised "cannot convert
  float NaN to integer" each round, until the restarts ran out.

Now the record is refused (its rank counts as voting nothing; event ``boundary.refused``
names it), and the job runs every step to its end: both agents exit 0, no ``job.stopped``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic.etcd.server import EtcdServer
from elastic.node import nodelocal
from elastic_tools.harness.cluster import AgentOptions, LocalCluster
from tests.helpers import node_env

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "inplace_user.py"
TAMPER_ENV = "BOUNDARY_TAMPER"  # "stop" (world size in the stop vote) or "nan"
SAMPLES, BATCH, EPOCHS = 96, 12, 2  # 16 steps


@pytest.fixture
def cluster(tmp_path: Path, etcd: EtcdServer, run_id: str) -> Iterator[LocalCluster]:
    c = LocalCluster(
        tmp_path,
        run_id,
        etcd.endpoint,
        options=AgentOptions(join_timeout=90, max_restarts=2, monitor_interval=0.3),
        env=node_env(),
    )
    yield c
    c.close()
    for node in c.nodes.values():
        nodelocal.remove_owned(node.pid)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tamper", ["stop", "nan"])
def test_a_tampering_rank_neither_ends_nor_crashes_the_job(
    cluster: LocalCluster, tmp_path: Path, tamper: str
) -> None:
    out = tmp_path / "out"
    args = [f"--epochs={EPOCHS}", f"--samples={SAMPLES}", f"--global-batch={BATCH}"]
    worker = [str(Path(__file__)), *args, f"--out={out}", "--step-delay=0.02"]
    a = cluster.start("a", worker=worker)
    b = cluster.start("b", worker=worker, extra_env={TAMPER_ENV: tamper})
    assert a.wait(200) == 0 and b.wait(60) == 0, cluster.logs()
    steps = sorted({e["step"] for e in cluster.steps()})
    assert steps[-1] == EPOCHS * SAMPLES // BATCH, (steps, cluster.logs())
    assert cluster.events("job.stopped") == [], cluster.logs()
    assert cluster.events("recovery.fallback") == [], cluster.logs()
    refused = cluster.events("boundary.refused")
    assert refused and "stop vote" in refused[0]["reason"], refused
    tamperers = {e["rank"] for e in refused}
    assert len(tamperers) == 1, refused


def _tamper() -> None:
    """Run the user's script with this rank's boundary record tampered (see the module)."""
    import runpy

    import torch.distributed as dist

    from elastic.worker import boundary

    how = os.environ.get(TAMPER_ENV, "")
    # the record's builder (``build``: the old summed vector's, to replay against it)
    name = "row" if hasattr(boundary.Layout, "row") else "build"
    real = getattr(boundary.Layout, name)

    def tampered(self: boundary.Layout, *args: object, **kwargs: object) -> object:
        out = real(self, *args, **kwargs)
        world = dist.get_world_size() if dist.is_initialized() else self.world_size
        out[boundary.VOTES.index("stop")] = float(world) if how == "stop" else float("nan")
        return out

    if how:
        setattr(boundary.Layout, name, tampered)
    sys.argv = [str(SCRIPT), *sys.argv[1:]]
    runpy.run_path(str(SCRIPT), run_name="__main__")


if __name__ == "__main__":
    _tamper()
