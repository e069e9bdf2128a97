"""The agent hands its options to its workers: flags, --rdzv-conf keys and old spellings."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from elastic.etcd.server import EtcdServer
from tests.helpers import FAST_CONF, local_cluster, node_env, run_node

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    names = [k for k in os.environ if k.startswith("ELASTIC_")]
    with open(sys.argv[1], "w") as f:
        json.dump({k: os.environ[k] for k in names}, f)
    """
)


@pytest.mark.slow
def test_workers_get_flags_rdzv_conf_keys_and_old_spellings_as_new_variables(
    tmp_path: Path, etcd: EtcdServer, run_id: str
) -> None:
    script, out = tmp_path / "show_env.py", tmp_path / "env.json"
    script.write_text(SCRIPT)
    command = (sys.executable, "-m", "elastic.agent.launch", "--straggler-ratio", "3")
    options = {
        "nnodes": "1",
        "nproc": 1,
        "rdzv_conf": f"{FAST_CONF},hang.enabled=on",
        "command": command,
    }
    environ = node_env(ELASTIC_PROBATION="off", ELASTIC_STRAGGLER_STEPS="4")
    with local_cluster(tmp_path / "run", etcd.endpoint, run_id, environ, **options) as cluster:
        code, output = run_node(cluster, [str(script), str(out)], 120)
    assert code == 0, output[-3000:]
    seen = json.loads(out.read_text())
    assert seen["ELASTIC_STRAGGLER_RATIO"] == "3.0"  # the flag
    assert seen["ELASTIC_HANG_ENABLED"] == "1"  # the --rdzv-conf key
    assert seen["ELASTIC_STRAGGLER_STEPS"] == "4"  # the environment
    assert seen["ELASTIC_PROBATION_ENABLED"] == "0"  # the old spelling, as the new one
    assert "ELASTIC_PROBATION" not in seen
    assert seen["ELASTIC_STRAGGLER_MIN_NODES"] == "1"  # --nnodes MIN
    assert "ELASTIC_PROBATION=off is deprecated" in output
    assert "ELASTIC_PROBATION_ENABLED=off" in output
    assert "environment changed" not in output  # the options do not make the worker start cold
