"""elastic status: TLS and login like the agent's, --watch, and the cheap checkpoint check."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import zlib
from pathlib import Path

import pytest

from elastic.checkpoint.layout import make_marker, step_url, write_marker
from elastic.etcd.server import EtcdServer, free_port
from tests.helpers import FAST_CONF, PYTHON, REPO, node_env, wait_until
from tests.rendezvous.test_tls_auth import PASSWORD, SecureEtcd, secure_etcd  # noqa: F401


def status(*argv: str, timeout: float = 120, **extra_env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in node_env(**extra_env).items() if extra_env.get(k) != ""}
    return subprocess.run(
        [PYTHON, "-m", "elastic.tools.cli", "status", *argv],
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
    log = tmp_path / "agent.log"
    with open(log, "wb") as out:
        agent = subprocess.Popen(
            [PYTHON, "-m", "agents.launch", "--nnodes=1", "--nproc-per-node=1",
             f"--rdzv-endpoint=https://{secure_etcd.server.endpoint}", f"--rdzv-id={run_id}",
             f"--rdzv-conf={conf}", "--local-addr=127.0.0.1", str(script), str(stop)],
            stdout=out, stderr=subprocess.STDOUT, env=node_env(), cwd=REPO,
        )  # fmt: skip
    try:
        flags = [*tls_flags(secure_etcd), "--run-id", run_id, "--user", "root", "--json"]

        def members() -> list[dict[str, object]]:
            result = status(*flags, "--password-file", str(password_file))
            assert result.returncode == 0, result.stderr
            rdzv = json.loads(result.stdout)["rendezvous"]
            return rdzv["members"] if rdzv["exists"] and rdzv["complete"] else []

        found = wait_until(members, 180, f"the agent's round (log {log})", every=1.0)
        assert [(m["pid"], m["state"], m["addr"]) for m in found] == [
            (agent.pid, "rank 0", "127.0.0.1")
        ]
        stop.touch()
        assert agent.wait(120) == 0, log.read_text()[-3000:]
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(30)


# -- --watch ----------------------------------------------------------------------------------


def test_watch_reprints_until_ctrl_c(etcd: EtcdServer, run_id: str, tmp_path: Path) -> None:
    out = tmp_path / "watch.out"
    with open(out, "wb") as f:
        proc = subprocess.Popen(
            [PYTHON, "-m", "elastic.tools.cli", "status", "--etcd", etcd.endpoint,
             "--run-id", run_id, "--watch", "0.2"],
            stdout=f, stderr=subprocess.PIPE, env=node_env(), cwd=REPO, text=True,
        )  # fmt: skip
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
