"""The etcd stubs load under protobuf's default C (upb) implementation, and nothing we start
sets PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION for workers or user scripts."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from elastic.etcd.server import EtcdServer
from tests.helpers import PYTHON, REPO, local_cluster, run_node

PROTOBUF_IMPL = "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"

UPB_FIRST = textwrap.dedent(
    """
    import sys

    from google.protobuf import struct_pb2
    from google.protobuf.internal import api_implementation

    assert api_implementation.Type() == "upb", api_implementation.Type()
    message = struct_pb2.Struct()
    message.update({"built": "before etcd3"})
    assert struct_pb2.Struct.FromString(message.SerializeToString()) == message

    from elastic.etcd.client import EtcdClient, EtcdOptions, parse_endpoints
    from elastic.rendezvous.backend import EtcdRendezvousBackend
    from elastic.rendezvous.keys import RunKeys
    from elastic.rendezvous.lease import RunLease

    endpoint, run_id = sys.argv[1:]
    keys = RunKeys("/elastic-test", run_id)
    with EtcdClient(EtcdOptions(parse_endpoints(endpoint)[0])) as client:
        backend = EtcdRendezvousBackend(client, keys, RunLease(client, 60))
        state, token, ok = backend.set_state(b"state-under-upb")
        assert ok and state == b"state-under-upb", (state, ok)
        assert backend.get_state() == (b"state-under-upb", token)
    assert api_implementation.Type() == "upb"
    print("round trip ok")
    """
)

USER_SCRIPT = textwrap.dedent(
    """
    import json
    import os
    import sys

    with open(sys.argv[1], "w") as f:
        json.dump({"impl": os.environ.get("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION")}, f)
    """
)


def _clean_env() -> dict[str, str]:
    """This process's environment without the override, with the repo importable."""
    environ = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), environ.get("PYTHONPATH")]))
    environ.pop(PROTOBUF_IMPL, None)
    return environ


def test_this_test_process_does_not_select_pure_python_protobuf() -> None:
    import elastic.etcd.client  # noqa: F401  (importing it once set the variable)

    assert PROTOBUF_IMPL not in os.environ


def test_backend_round_trip_after_protobuf_was_imported_with_upb(
    etcd: EtcdServer, run_id: str
) -> None:
    result = subprocess.run(
        [PYTHON, "-c", UPB_FIRST, etcd.endpoint, run_id],
        env=_clean_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "round trip ok" in result.stdout


def test_user_script_under_the_agent_does_not_inherit_the_protobuf_override(
    etcd: EtcdServer, run_id: str, tmp_path: Path
) -> None:
    assert PROTOBUF_IMPL not in os.environ
    script, out = tmp_path / "report_env.py", tmp_path / "env.json"
    script.write_text(USER_SCRIPT)
    with local_cluster(
        tmp_path / "run",
        etcd.endpoint,
        run_id,
        _clean_env(),
        nnodes="1",
        rdzv_conf="profile=fast-failover",
        max_restarts=0,
    ) as cluster:
        code, output = run_node(cluster, [str(script), str(out)], 120)
    assert code == 0, output
    assert json.loads(out.read_text()) == {"impl": None}, output


@pytest.mark.integration
def test_old_etcd3_stubs_left_by_an_upgrade_fail_with_a_sentence_saying_what_to_do(
    tmp_path: Path,
) -> None:
    # What etcd3 0.12's generated code raises under upb, imported in place of python3-etcd3's.
    package = tmp_path / "etcd3"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "etcdrpc.py").write_text(
        'raise TypeError("Descriptors cannot be created directly.")'
    )
    environ = _clean_env()
    environ["PYTHONPATH"] = os.pathsep.join([str(tmp_path), environ["PYTHONPATH"]])
    result = subprocess.run(
        [PYTHON, "-c", "import elastic.etcd.client"],
        env=environ,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "ImportError: The installed 'etcd3' package holds stubs from the old" in result.stderr
    assert "pip uninstall -y etcd3 python3-etcd3" in result.stderr
