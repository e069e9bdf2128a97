"""elastic status: TLS and login like the agent's, --watch, the cheap checkpoint check, and
nothing pickled decoded without the job's secret."""

from __future__ import annotations

import json
import math
import os
import pickle
import signal
import subprocess
import textwrap
import zlib
from datetime import datetime, timezone
from pathlib import Path
from typing import NoReturn

import pytest
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from elastic.checkpoint.layout import make_marker, step_url, write_marker
from elastic.errors import EtcdStateError
from elastic.etcd.client import EtcdClient
from elastic.etcd.server import EtcdServer, free_port
from elastic.rendezvous.backend import encode_state
from elastic.rendezvous.keys import RunKeys
from elastic_tools import status as status_module
from elastic_tools.harness.cluster import AgentOptions, LocalCluster
from elastic_tools.status import NEEDS_SECRET, format_table, rendezvous_status
from tests.helpers import FAST_CONF, PYTHON, REPO, node_env, wait_until
from tests.rendezvous.test_tls_auth import PASSWORD, SecureEtcd, secure_etcd  # noqa: F401

STATUS = [PYTHON, "-m", "elastic_tools.cli", "status"]
SECRET = b"a-job-secret-of-enough-length-0001"


def status(*argv: str, timeout: float = 120, **extra_env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in node_env(**extra_env).items() if extra_env.get(k) != ""}
    return subprocess.run(
        [*STATUS, *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environ,
        cwd=REPO,
    )


def tls_flags(secure: SecureEtcd) -> list[str]:
    c = secure.certs
    return [
        "--etcd",
        f"https://{secure.server.endpoint}",
        "--cacert",
        str(c.ca),
        "--cert",
        str(c.client_cert),
        "--key",
        str(c.client_key),
    ]


@pytest.fixture
def password_file(tmp_path: Path) -> Path:
    path = tmp_path / "etcd-password"
    path.write_text(PASSWORD + "\n")
    path.chmod(0o600)
    return path


# -- TLS and login ----------------------------------------------------------------------------


@pytest.mark.integration
def test_tls_with_a_password_file_or_the_environment(
    secure_etcd: SecureEtcd,  # noqa: F811
    password_file: Path,
    run_id: str,
) -> None:
    flags = [*tls_flags(secure_etcd), "--run-id", run_id, "--user", "root"]
    by_file = status(*flags, "--password-file", str(password_file), ELASTIC_ETCD_PASSWORD="")
    assert by_file.returncode == 0, by_file.stderr
    assert "no rendezvous state in etcd" in by_file.stdout
    by_env = status(*flags, ELASTIC_ETCD_PASSWORD=PASSWORD)
    assert by_env.returncode == 0, by_env.stderr
    assert by_env.stdout == by_file.stdout
    for result in (by_file, by_env):
        assert PASSWORD not in result.stdout + result.stderr


@pytest.mark.integration
def test_login_mistakes_are_one_sentence(
    secure_etcd: SecureEtcd,  # noqa: F811
    tmp_path: Path,
    run_id: str,
) -> None:
    flags = [*tls_flags(secure_etcd), "--run-id", run_id, "--user", "root"]
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-password")
    result = status(*flags, "--password-file", str(wrong), ELASTIC_ETCD_PASSWORD="")
    assert result.returncode == 1
    assert "refused the login of user 'root'" in result.stderr
    result = status(*flags, ELASTIC_ETCD_PASSWORD="")
    assert result.returncode == 2
    assert "The etcd user 'root' needs a password: pass --password-file FILE" in result.stderr
    result = status(*flags, "--password-file", str(tmp_path / "missing"))
    assert result.returncode == 2 and "Cannot read the etcd password file" in result.stderr
    for spelling in (["--password", PASSWORD], [f"--password={PASSWORD}"], ["--pass", PASSWORD]):
        result = status(*flags, *spelling)
        assert result.returncode == 2, spelling
        assert PASSWORD not in result.stdout + result.stderr, "the password was echoed back"
        assert "Traceback" not in result.stderr
    assert "There is no --password option" in status(*flags, "--password", "x").stderr
    no_ca = ["--etcd", f"https://{secure_etcd.server.endpoint}", "--run-id", run_id]
    result = status(*no_ca, "--user", "root", ELASTIC_ETCD_PASSWORD=PASSWORD, timeout=180)
    assert result.returncode == 1 and "Could not reach etcd" in result.stderr
    assert "Traceback" not in result.stderr


WAIT_SCRIPT = textwrap.dedent(
    """
    import pathlib, sys, time
    stop = pathlib.Path(sys.argv[1])
    while not stop.exists():
        time.sleep(0.1)
    """
)


@pytest.mark.slow
def test_members_of_a_real_agent_over_tls(
    secure_etcd: SecureEtcd,  # noqa: F811
    password_file: Path,
    tmp_path: Path,
    run_id: str,
) -> None:
    script, stop = tmp_path / "wait.py", tmp_path / "stop"
    script.write_text(WAIT_SCRIPT)
    c = secure_etcd.certs
    conf = (
        f"{FAST_CONF},user=root,password_file={password_file},cacert={c.ca},"
        f"cert={c.client_cert},key={c.client_key}"
    )
    cluster = LocalCluster(
        tmp_path / "run",
        run_id,
        f"https://{secure_etcd.server.endpoint}",
        options=AgentOptions(nnodes="1", rdzv_conf=conf),
        env=node_env(),
        cwd=REPO,
    )
    with cluster:
        agent = cluster.start("agent", worker=[str(script), str(stop)])
        flags = [*tls_flags(secure_etcd), "--run-id", run_id, "--user", "root", "--json"]

        def members() -> list[dict[str, object]]:
            result = status(*flags, "--password-file", str(password_file))
            assert result.returncode == 0, result.stderr
            rdzv = json.loads(result.stdout)["rendezvous"]
            return rdzv["members"] if rdzv["exists"] and rdzv["complete"] else []

        found = wait_until(members, 180, f"the agent's round (log {agent.log})", every=1.0)
        assert [(m["pid"], m["state"], m["addr"]) for m in found] == [
            (agent.pid, "rank 0", "127.0.0.1")
        ]
        stop.touch()
        assert agent.wait(120) == 0, agent.output()[-3000:]


# -- --watch ----------------------------------------------------------------------------------


def test_watch_reprints_until_ctrl_c(etcd: EtcdServer, run_id: str, tmp_path: Path) -> None:
    out = tmp_path / "watch.out"
    with open(out, "wb") as f:
        watch = ["--etcd", etcd.endpoint, "--run-id", run_id, "--watch", "0.2"]
        proc = subprocess.Popen(
            [*STATUS, *watch],
            stdout=f,
            stderr=subprocess.PIPE,
            env=node_env(),
            cwd=REPO,
            text=True,
        )
    try:
        wait_until(
            lambda: out.read_text().count(f"run {run_id}") >= 3, 60, "three reports of --watch"
        )
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.stderr is not None and "Traceback" not in proc.stderr.read()
    text = out.read_text()
    assert "(every 0.2 s," in text and "Ctrl-C stops" in text
    assert "\x1b[" not in text, "no terminal codes when stdout is not a terminal"
    bad = status("--etcd", etcd.endpoint, "--run-id", run_id, "--watch", "0")
    assert bad.returncode == 2 and "--watch 0 is not a positive number" in bad.stderr
    unreachable = status("--etcd", f"127.0.0.1:{free_port()}", "--run-id", "x", "--watch")
    assert unreachable.returncode == 1, "a watch that never reached etcd stops"
    assert "Could not reach etcd" in unreachable.stderr


# -- the checkpoint check -----------------------------------------------------------------------


def _commit(url: Path, run_id: str, step: int, payload: bytes) -> Path:
    """A committed step (marker listing .metadata and one shard); returns the shard."""
    attempt = f"save-{step:016x}"
    data = Path(step_url(str(url), run_id, step)) / attempt
    data.mkdir(parents=True)
    files = {}
    for name, body in ((".metadata", b"plan"), ("__0_0.distcp", payload)):
        (data / name).write_bytes(body)
        files[name] = {"size": len(body), "crc32": f"{zlib.crc32(body):08x}"}
    write_marker(str(data.parent), make_marker(step, 1, files, run=run_id, attempt=attempt))
    return data / "__0_0.distcp"


def test_size_check_by_default_crc_on_request(
    etcd: EtcdServer, run_id: str, tmp_path: Path
) -> None:
    url = tmp_path / "ckpt"
    _commit(url, run_id, 5, b"x" * 4096)
    shard = _commit(url, run_id, 10, b"y" * 4096)
    shard.write_bytes(b"z" * 4096)  # same size, other bytes: only a CRC check sees it
    flags = ["--etcd", etcd.endpoint, "--run-id", run_id, "--checkpoint-url", str(url), "--json"]
    cheap = status(*flags, ELASTIC_SECRET_FILE="")
    assert cheap.returncode == 0, cheap.stderr
    assert json.loads(cheap.stdout)["checkpoint"] == {
        "url": str(url),
        "verify": "size",
        "newest_complete_step": 10,
    }
    full = status(*flags, "--verify", "crc", ELASTIC_SECRET_FILE="")
    assert full.returncode == 0, full.stderr
    assert json.loads(full.stdout)["checkpoint"]["newest_complete_step"] == 5
    table = status(*flags[:-1], "--verify", "crc")
    assert "newest complete checkpoint: step 5 (crc check)" in table.stdout
    assert status(*flags, "--verify", "md5").returncode == 2
    assert os.path.getsize(shard) == 4096


# -- the single-key state: decoded only with the job's secret ---------------------------------


class _Payload:
    """Unpickling this runs a command: what a forged state would carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def _state() -> bytes:
    """A well-formed rendezvous state: one node, rank 0 of a complete round 3."""
    state = _RendezvousState()
    state.round = 3
    node = _NodeDesc("host", 7, 0)
    state.participants[node] = 0
    state.last_heartbeats[node] = datetime.now(timezone.utc)
    state.complete = True
    return pickle.dumps(state)


def _never(*args: object, **kwargs: object) -> NoReturn:
    raise AssertionError("status unpickled the rendezvous state")


@pytest.fixture
def no_unpickling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if anything in status unpickles."""
    monkeypatch.setattr(status_module, "load_state", _never)
    monkeypatch.setattr(status_module._StateUnpickler, "load", _never)
    monkeypatch.setattr(pickle, "loads", _never)
    monkeypatch.setattr(pickle, "load", _never)


def _publish(client: EtcdClient, keys: RunKeys, blob: bytes) -> int:
    """The state; its revision."""
    return int(client.put(keys.state, blob).header.revision)


@pytest.mark.usefixtures("no_unpickling")
def test_without_the_secret_nothing_pickled_is_decoded(
    client: EtcdClient, run_id: str, tmp_path: Path
) -> None:
    keys = RunKeys("/elastic", run_id)
    marker = tmp_path / "pwned"
    for blob in (
        encode_state(_state()),  # well-formed, CRC-framed
        encode_state(_state(), SECRET),  # signed by the agents
        encode_state(pickle.dumps(_Payload(marker))),  # forged, with a valid CRC
    ):
        revision = _publish(client, keys, blob)
        shown = rendezvous_status(client, keys)
        assert shown == {
            "exists": True,
            "decoded": False,
            "key": keys.state.decode(),
            "bytes": len(blob),
            "revision": revision,
            "signed": blob.startswith(b"EV3\x02"),
            "note": NEEDS_SECRET,
        }
        table = format_table(run_id, shown, None)
        assert f"{len(blob)} bytes at revision {revision}" in table
        assert "ELASTIC_SECRET_FILE" in table
    assert not marker.exists()


def test_with_the_secret_only_a_verified_state_is_decoded(
    client: EtcdClient, run_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = RunKeys("/elastic", run_id)
    _publish(client, keys, encode_state(_state(), SECRET))
    shown = rendezvous_status(client, keys, SECRET)
    assert (shown["round"], shown["world_size"], shown["complete"]) == (3, 1, True)
    assert [(m["addr"], m["pid"], m["state"]) for m in shown["members"]] == [("host", 7, "rank 0")]
    assert "decoded" not in shown

    decoded: list[bytes] = []
    monkeypatch.setattr(status_module, "load_state", decoded.append)
    marker = tmp_path / "pwned"
    forged = pickle.dumps(_Payload(marker))
    for blob, why in (
        (encode_state(forged), "not signed with this job's secret"),
        (encode_state(forged, b"another-secret"), "not signed with this job's secret"),
        (encode_state(forged, SECRET)[:-1] + b"X", "not signed with this job's secret"),
    ):
        client.put(keys.state, blob)
        with pytest.raises(EtcdStateError, match=why):
            rendezvous_status(client, keys, SECRET)
    assert decoded == [], "bytes whose signature did not verify were decoded"
    monkeypatch.undo()
    client.put(keys.state, encode_state(forged, SECRET))  # signed: still only torch's classes
    with pytest.raises(EtcdStateError, match="cannot be decoded"):
        rendezvous_status(client, keys, SECRET)
    assert not marker.exists()


def test_the_command_shows_the_undecoded_parts_and_asks_for_the_secret(
    etcd: EtcdServer, client: EtcdClient, run_id: str, tmp_path: Path
) -> None:
    keys = RunKeys("/elastic", run_id)
    marker = tmp_path / "pwned"
    blob = encode_state(pickle.dumps(_Payload(marker)))
    revision = _publish(client, keys, blob)
    flags = ["--etcd", etcd.endpoint, "--run-id", run_id]
    table = status(*flags, ELASTIC_SECRET_FILE="")
    assert table.returncode == 0, table.stderr
    assert f"rendezvous state: {len(blob)} bytes at revision {revision}, not signed" in table.stdout
    assert NEEDS_SECRET in table.stdout
    as_json = status(*flags, "--json", ELASTIC_SECRET_FILE="")
    assert as_json.returncode == 0, as_json.stderr
    rdzv = json.loads(as_json.stdout)["rendezvous"]
    assert (rdzv["decoded"], rdzv["bytes"], rdzv["signed"]) == (False, len(blob), False)
    assert not marker.exists()

    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET)
    secret_file.chmod(0o600)
    client.put(keys.state, encode_state(_state(), SECRET))
    with_secret = status(*flags, ELASTIC_SECRET_FILE=str(secret_file))
    assert with_secret.returncode == 0, with_secret.stderr
    assert "round 3  complete=True" in with_secret.stdout
    assert "host_7_0" in with_secret.stdout and "rank 0" in with_secret.stdout
    assert NEEDS_SECRET not in with_secret.stdout


def test_status_shows_the_slowest_ranks_and_stuck_ones(tmp_path: Path) -> None:
    """From the event log: the newest measured step's slowest ranks, then the newest slow,
    dropped and stuck ranks (elastic.worker.timing, elastic.worker.hang)."""
    log = tmp_path / "events.jsonl"
    lines = [
        {"ts": 1.0, "kind": "train.step", "step": 7, "slowest": [[2, 3.1], [0, 1.0]]},
        {"ts": 2.0, "kind": "straggler.detected", "step": 7, "ranks": [2], "ratio": 3.1},
        {"ts": 3.0, "kind": "worker.hang", "step": 9, "rank": 1, "seconds": 61.2},
        {"ts": 4.0, "kind": "train.step", "step": 10},  # not measured: the newest stays 7
    ]
    log.write_text("".join(json.dumps(e) + "\n" for e in lines))
    ranks = status_module.straggler_status(log)
    assert ranks is not None and ranks["step"] == 7
    assert ranks["slowest"][0] == {"rank": 2, "ratio": 3.1}
    text = format_table("r", {"exists": False}, None, ranks)
    assert "slowest ranks at step 7 (to the median): rank 2 3.10x, rank 0 1.00x" in text
    assert "rank 1 stuck 61.2 s in step 9" in text
    assert "ranks [2] slow at 3.1x" in text
    assert json.loads(status_module.status_json("r", {"exists": False}, None, ranks))["ranks"]
    assert status_module.straggler_status(None) is None or os.environ.get("ELASTIC_EVENT_LOG")


def _refuse(constant: str) -> None:
    raise ValueError(f"{constant} is not JSON (a browser's JSON.parse refuses it)")


def test_status_json_is_strict_json_whatever_the_figures() -> None:
    """A diverged run's figures (a NaN loss, an infinite ratio to a zero median) are written
    as strings a strict parser reads (issue 38, item 10), not as Python's bare NaN."""
    ranks = {
        "event_log": "events.jsonl",
        "step": 3,
        "slowest": [{"rank": 1, "ratio": float("inf")}],
        "events": [{"kind": "straggler.detected", "ratio": float("nan"), "ranks": (1, 2)}],
    }
    text = status_module.status_json("r", {"exists": False}, None, ranks)
    data = json.loads(text, parse_constant=_refuse)
    assert data["ranks"]["slowest"][0]["ratio"] == "Infinity"
    assert data["ranks"]["events"][0] == {
        "kind": "straggler.detected",
        "ratio": "NaN",
        "ranks": [1, 2],
    }
    body = {"x": [-math.inf, 1.5, None, "NaN"], "y": {"z": math.nan}}
    assert status_module.strict_json(body) == (
        '{"x": ["-Infinity", 1.5, null, "NaN"], "y": {"z": "NaN"}}'
    )
