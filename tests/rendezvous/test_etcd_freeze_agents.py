"""etcd frozen (SIGSTOP) past every lease while real agents train a user's script in place,
with checkpoints saving every other step: after the thaw every node rejoins, a round forms
within seconds, and the job goes on from its state in memory to the end, exit 0.

The outage of the chaos harness's ``etcd_freeze_in_save`` (elastic_tools/chaos/compound.py) on
two nodes; tests/rendezvous/test_etcd_freeze.py is the same outage with in-process
handlers (fast, and where the cause is explained).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastic.etcd.server import EtcdServer
from elastic_tools.harness.cluster import AgentOptions, LocalCluster
from tests.helpers import node_env
from tests.recovery.test_inplace import SCRIPT
from tests.rendezvous.test_etcd_freeze import FREEZE_S, freeze

pytestmark = pytest.mark.slow
SAMPLES, BATCH, EPOCHS = 48, 12, 6
TOTAL = EPOCHS * SAMPLES // BATCH  # 24 steps
FREEZE_AT = 6  # the step after which etcd freezes (a save every 2 steps)
REFORM_BOUND_S = 15.0  # both agents in a new round within this of the thaw


@pytest.fixture
def nodes(tmp_path: Path, own_etcd: EtcdServer, run_id: str) -> Iterator[LocalCluster]:
    """Agents (2 nodes, fast-failover, 60 s to join) on the test's own etcd."""
    options = AgentOptions(nnodes="2", join_timeout=60, max_restarts=3, monitor_interval=0.3)
    c = LocalCluster(tmp_path, run_id, own_etcd.endpoint, options=options, env=node_env())
    yield c
    if own_etcd.proc is not None and own_etcd.alive():
        os.kill(own_etcd.proc.pid, signal.SIGCONT)  # never leave it stopped
    c.close()


@pytest.mark.timeout(240)
def test_training_goes_on_after_etcd_froze_past_every_lease(
    nodes: LocalCluster, own_etcd: EtcdServer, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    worker = [str(SCRIPT), f"--epochs={EPOCHS}", f"--samples={SAMPLES}"]
    worker += [f"--global-batch={BATCH}", f"--out={out}", f"--ckpt={tmp_path / 'ckpt'}"]
    worker += ["--ckpt-every=2", "--step-delay=0.2"]
    a, b = nodes.start("a", worker=worker), nodes.start("b", worker=worker)
    nodes.wait_for_step(FREEZE_AT, 120)
    before = max(e["round"] for e in nodes.events("rdzv.round"))
    last = nodes.last_step()

    thawed = freeze(own_etcd, FREEZE_S)
    thawed_ts = time.time()

    def rejoined() -> list[dict[str, Any]]:
        rounds = [e for e in nodes.events("rdzv.round") if e["round"] > before]
        return rounds if len(rounds) >= 2 else []

    formed = nodes.wait_for(rejoined, "both nodes in a new round", REFORM_BOUND_S)
    formed_ts = max(float(e["ts"]) for e in formed)
    formed_s = formed_ts - thawed_ts
    dropped = nodes.events("node.expired")
    assert dropped, "the freeze expired no lease: it tested nothing"
    nodes.wait_for(lambda: (out / "final.pt").exists(), "the final model", 120)
    after = [e for e in nodes.steps() if e["ts"] > formed_ts]
    assert after, "no step was trained in the new round"
    for node in (a, b):
        assert node.wait(60) == 0, nodes.logs()
    steps = sorted({e["step"] for e in nodes.steps()})
    assert steps == list(range(1, TOTAL + 1)), f"steps reported: {steps}"
    loads = [e for e in nodes.events("ckpt.load") if e["step"] < last]
    assert not loads, f"a worker resumed from a checkpoint older than step {last}: {loads}"
    skipped = sorted({e["step"] for e in nodes.events("ckpt.save") if e.get("skipped")})
    print(
        f"frozen {FREEZE_S:g} s after step {last} (saves skipped: {skipped}); a round "
        f"{formed_s:.2f} s after the thaw, {len(after) and after[0]['step']}..{TOTAL} trained "
        f"in it ({time.monotonic() - thawed:.1f} s to the end of the job)"
    )
