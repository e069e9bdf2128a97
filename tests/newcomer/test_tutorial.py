"""The road from the classic DDP tutorial (docs/from-the-tutorial.md), with real agents.

* The tutorial script as users have it (``mp.spawn``, ``MASTER_ADDR`` in the code) stops
  within seconds with one sentence and a non-zero exit, warm or cold, instead of waiting
  30 minutes on a store nobody hosts.
* Its changed version (examples/tutorial/train.py) trains on two nodes, survives a
  ``kill -9`` of one and finishes on the other.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path

import pytest

from elastic.etcd.server import EtcdServer
from elastic.node.procs import descendants
from tests.helpers import FAST_CONF, REPO, local_cluster, node_env, run_node, wait_until

TUTORIAL = REPO / "examples" / "tutorial"
ERROR = "elastic-agent: error: a worker failed: "


def _address_only(tmp: Path) -> Path:
    """The tutorial with the spawn removed but its setup() kept (address, rank, world size)."""
    source = (TUTORIAL / "spawn_tutorial.py").read_text()
    spawn = "    mp.spawn(train, args=(world_size,), nprocs=world_size, join=True)"
    assert spawn in source
    script = tmp / "no_spawn.py"
    script.write_text(source.replace(spawn, '    train(int(os.environ["RANK"]), world_size)'))
    return script


@pytest.mark.slow
@pytest.mark.parametrize(
    ("variant", "warm", "sentence"),
    [
        ("spawn", "1", "This worker called torch.multiprocessing.spawn, but under elastic-agent"),
        ("address", "0", "init_process_group would wait forever on a group elastic-agent did"),
    ],
)
def test_the_unchanged_tutorial_stops_with_one_sentence(
    tmp_path: Path, etcd: EtcdServer, run_id: str, variant: str, warm: str, sentence: str
) -> None:
    script = TUTORIAL / "spawn_tutorial.py" if variant == "spawn" else _address_only(tmp_path)
    environ = node_env(ELASTIC_WARM_START=warm)
    options = {"nnodes": "1", "nproc": 1, "rdzv_conf": FAST_CONF, "max_restarts": 0}
    started = time.monotonic()
    with local_cluster(tmp_path / "run", etcd.endpoint, run_id, environ, **options) as cluster:
        code, output = run_node(cluster, [str(script)], 240)
    seconds = time.monotonic() - started
    assert code != 0, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith(ERROR)]
    assert len(errors) == 1 and errors[0][len(ERROR) :].startswith(sentence), output[-3000:]
    assert "(see docs/from-the-tutorial.md). (node " in errors[0], errors[0]  # then who, how
    assert "TCPStore" not in output and "Traceback" not in output, output[-3000:]
    if variant == "address":
        for said in ("MASTER_PORT 12355", "world_size 2"):  # the agent has 127.0.0.1 too
            assert said in errors[0]
    else:  # the agent's warning at its start names the line
        assert "spawn_tutorial.py:64: calls spawn" in output
    print(f"{variant} warm={warm}: agent exited {code} after {seconds:.1f} s")


EPOCHS = 300
EPOCH = re.compile(r"^epoch (\d+) world (\d+) ", re.M)


@pytest.mark.slow
def test_the_changed_tutorial_survives_a_node_killed(
    tmp_path: Path, etcd: EtcdServer, run_id: str
) -> None:
    args = [str(TUTORIAL / "train.py"), "--snapshot", str(tmp_path / "snapshot.pt")]
    args += ["--epochs", str(EPOCHS), "--batch-size", "2048"]  # an epoch is one step
    options = {"nnodes": "1:2", "nproc": 1, "rdzv_conf": FAST_CONF, "max_restarts": 3}
    with local_cluster(tmp_path / "run", etcd.endpoint, run_id, **options) as cluster:
        a, b = cluster.start("a", worker=args), cluster.start("b", worker=args)

        def at_world_2() -> bool:
            return sum(w == "2" for _, w in EPOCH.findall(a.output() + b.output())) >= 5

        wait_until(at_world_2, 180, "five steps of both nodes")
        killed = time.monotonic()
        for pid in [b.pid, *descendants(b.pid)]:  # the whole node
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        assert a.wait(180) == 0, a.output()[-3000:]
        seconds = time.monotonic() - killed
    epochs = EPOCH.findall(a.output())
    assert epochs[-1] == (str(EPOCHS - 1), "1"), a.output()[-3000:]
    print(f"finished on one node {seconds:.1f} s after the kill")
