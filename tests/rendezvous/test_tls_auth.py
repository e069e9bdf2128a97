"""TLS (CA + client certificate) and user/password auth against a real etcd."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic.errors import EtcdConnectionError
from elastic.etcd.client import EtcdClient, EtcdOptions, parse_endpoints
from elastic.etcd.server import EtcdServer, find_etcd
from elastic.rendezvous.announce import build_announce_handler
from elastic.rendezvous.options import ALGORITHMS, RendezvousOptions
from elastic.rendezvous.registry import create_backend
from tests.helpers import local_cluster, node_env, run_node, wait_until
from tests.rendezvous.tls import Certs, make_certs

PASSWORD = "s3cret-pw"


@dataclass
class SecureEtcd:
    server: EtcdServer
    certs: Certs

    def options(self, password: str = PASSWORD, **kw: object) -> EtcdOptions:
        return EtcdOptions(
            parse_endpoints(self.server.endpoint)[0],
            ca_cert=str(self.certs.ca),
            cert=str(self.certs.client_cert),
            key=str(self.certs.client_key),
            user="root",
            password=password,
            **kw,  # type: ignore[arg-type]
        )


def etcdctl(server: EtcdServer, certs: Certs, *args: str) -> None:
    ctl = str(Path(find_etcd()).with_name("etcdctl"))
    subprocess.run(
        [
            ctl,
            f"--endpoints=https://{server.endpoint}",
            f"--cacert={certs.ca}",
            f"--cert={certs.client_cert}",
            f"--key={certs.client_key}",
            *args,
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )


@pytest.fixture(scope="module")
def secure_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureEtcd]:
    base = tmp_path_factory.mktemp("tls")
    certs = make_certs(base / "certs")
    tls_flags = [
        f"--cert-file={certs.server_cert}",
        f"--key-file={certs.server_key}",
        f"--trusted-ca-file={certs.ca}",
        "--client-cert-auth",
        "--auth-token-ttl=2",
    ]
    server = EtcdServer(base / "data", extra=tls_flags, scheme="https").start()
    try:
        secure = SecureEtcd(server, certs)
        wait_until(lambda: _ctl_ok(server, certs), 20, "TLS etcd to serve")
        etcdctl(server, certs, "user", "add", "root", f"--new-user-password={PASSWORD}")
        etcdctl(server, certs, "user", "grant-role", "root", "root")
        etcdctl(server, certs, "auth", "enable")
        yield secure
    finally:
        server.stop(signal.SIGKILL)


def _ctl_ok(server: EtcdServer, certs: Certs) -> bool:
    try:
        etcdctl(server, certs, "endpoint", "health")
    except subprocess.CalledProcessError:
        return False
    return True


def test_tls_and_password_work(secure_etcd: SecureEtcd) -> None:
    with EtcdClient(secure_etcd.options()) as client:
        client.put(b"/tls/k", b"v")
        assert client.range(b"/tls/k").kvs[0].value == b"v"


@pytest.mark.integration
def test_a_user_added_while_logged_in_does_not_fail_requests(secure_etcd: SecureEtcd) -> None:
    server, certs, root = secure_etcd.server, secure_etcd.certs, ("--user", f"root:{PASSWORD}")
    etcdctl(server, certs, *root, "role", "add", "tls-rw")
    grant = ["role", "grant-permission", "tls-rw", "readwrite", "/tls/", "--prefix"]
    etcdctl(server, certs, *root, *grant)
    etcdctl(server, certs, *root, "user", "add", "writer", "--new-user-password=w-pw")
    etcdctl(server, certs, *root, "user", "grant-role", "writer", "tls-rw")
    options = dataclasses.replace(secure_etcd.options(), user="writer", password="w-pw")
    with EtcdClient(options) as client:
        client.put(b"/tls/rev", b"1")
        # any auth change makes etcd refuse a non-root user's token issued before it, once
        etcdctl(server, certs, *root, "user", "add", "another", "--new-user-password=x")
        client.put(b"/tls/rev", b"2")
        assert client.range(b"/tls/rev").kvs[0].value == b"2"


def test_wrong_password_is_refused_clearly(secure_etcd: SecureEtcd) -> None:
    with (
        EtcdClient(secure_etcd.options(password="wrong")) as client,
        pytest.raises(EtcdConnectionError, match=r"refused the login of user 'root'") as info,
    ):
        client.range(b"/tls/k")
    assert "check the user name and password" in str(info.value)


def test_missing_client_certificate_fails_naming_the_endpoint(secure_etcd: SecureEtcd) -> None:
    opts = EtcdOptions(
        parse_endpoints(secure_etcd.server.endpoint)[0],
        ca_cert=str(secure_etcd.certs.ca),
        user="root",
        password=PASSWORD,
        connect_timeout=1,
    )
    with EtcdClient(opts) as client, pytest.raises(EtcdConnectionError) as info:
        client.range(b"/tls/k")
    assert f"Could not reach etcd at {secure_etcd.server.endpoint}" in str(info.value)


def test_expired_auth_token_is_renewed(
    secure_etcd: SecureEtcd, caplog: pytest.LogCaptureFixture
) -> None:
    import time

    caplog.set_level("INFO", logger="elastic.etcd.client")
    with EtcdClient(secure_etcd.options()) as client:
        client.put(b"/tls/t", b"1")
        later = time.monotonic() + 3.5  # the server's --auth-token-ttl is 2 s
        wait_until(lambda: time.monotonic() > later, 10, "the auth token to expire")
        client.put(b"/tls/t", b"2")
        assert client.range(b"/tls/t").kvs[0].value == b"2"
    assert "auth token was rejected" in caplog.text


def _secure_params(
    secure_etcd: SecureEtcd, run_id: str, max_nodes: int, **extra: str
) -> RendezvousParameters:
    """Rendezvous parameters for ``secure_etcd``: TLS, a client certificate and a password."""
    c = secure_etcd.certs
    return RendezvousParameters(
        "etcd-v3",
        f"https://{secure_etcd.server.endpoint}",
        run_id,
        1,
        max_nodes,
        cacert=str(c.ca),
        cert=str(c.client_cert),
        key=str(c.client_key),
        user="root",
        password=PASSWORD,
        **extra,
    )


def test_rendezvous_backend_over_tls_and_auth(secure_etcd: SecureEtcd, run_id: str) -> None:
    params = _secure_params(secure_etcd, run_id, 1)
    backend, store = create_backend(params)
    _, token, ok = backend.set_state(b"state")  # type: ignore[misc]
    assert ok and backend.get_state() == (b"state", token)
    store.set("k", "v")
    assert store.get("k") == b"v"


def test_announce_rendezvous_over_tls_and_auth(secure_etcd: SecureEtcd, run_id: str) -> None:
    """The announce algorithm's own requests (leases, keep-alives, watches, transactions)
    over TLS with a client certificate and a password."""
    params = _secure_params(
        secure_etcd,
        run_id,
        2,
        algorithm="announce",
        last_call_timeout="0.2",
        keep_alive_interval="1",
        keep_alive_max_attempt="3",
        local_addr="127.0.0.1",
    )
    handler = build_announce_handler(params, RendezvousOptions.from_params(params))
    try:
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        info.store.set("k", "v")
        assert info.store.get("k") == b"v"
        keepalives = handler.keepalives
        wait_until(lambda: handler.keepalives > keepalives, 10, "a keep-alive over TLS")
        assert handler.membership_change() is None
    finally:
        assert handler.shutdown()


ENV_DUMP = """
import json, os, sys
open(sys.argv[1], "w").write(json.dumps(dict(os.environ)))
"""


def run_agent_dumping_env(
    secure_etcd: SecureEtcd, tmp: Path, run_id: str, conf: str, **env: str
) -> tuple[str, str]:
    """One agent on the TLS etcd running a script that dumps its environment; return the
    agent's output (stdout and stderr) and the worker's environment (JSON)."""
    script, dump = tmp / "dump_env.py", tmp / "env.json"
    script.write_text(ENV_DUMP)
    certs = secure_etcd.certs
    conf += f",cacert={certs.ca},cert={certs.client_cert},key={certs.client_key}"
    endpoint = f"https://{secure_etcd.server.endpoint}"
    environ = node_env(LOGLEVEL="INFO", **env)
    with local_cluster(tmp / "run", endpoint, run_id, environ, nnodes="1", rdzv_conf=conf) as c:
        code, output = run_node(c, [str(script), str(dump)], 180)
    assert code == 0, output[-3000:]
    return output, dump.read_text()


@pytest.mark.integration
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_password_reaches_no_worker_environment_and_no_log(
    secure_etcd: SecureEtcd, tmp_path: Path, run_id: str, algorithm: str
) -> None:
    conf = f"profile=fast-failover,join_timeout=60,user=root,algorithm={algorithm}"
    output, worker_env = run_agent_dumping_env(
        secure_etcd, tmp_path, run_id, conf, ELASTIC_ETCD_PASSWORD=PASSWORD
    )
    assert "ELASTIC_ETCD_PASSWORD" not in worker_env
    assert PASSWORD not in worker_env, "the password reached the worker's environment"
    assert PASSWORD not in output, "the password reached a log"


@pytest.mark.integration
def test_a_password_on_the_command_line_is_redacted_from_torchs_log(
    secure_etcd: SecureEtcd, tmp_path: Path, run_id: str
) -> None:
    conf = f"profile=fast-failover,join_timeout=60,user=root,password={PASSWORD}"
    output, worker_env = run_agent_dumping_env(secure_etcd, tmp_path, run_id, conf)
    assert "shows in 'ps'" in output
    assert PASSWORD not in output, "the password reached a log"
    assert PASSWORD not in worker_env, "the password reached the worker's environment"
