"""agents/k8s/etcd.yaml's etcd command, run for real: three members on loopback.

No Kubernetes here, so the pod names and ports are replaced (etcd-i.etcd:2379/2380/2381 ->
127.0.0.1:<free ports>, the Secret and volume paths -> a temporary folder); every flag and
value else is the manifest's own. The certificates follow docs/operations.md's recipe (one
server certificate for clients and peers, serverAuth + clientAuth), plus IP:127.0.0.1 for the
loopback addresses. The cluster must form with peer TLS, answer the readiness probe's
/health on the metrics port, and serve our client over mutual TLS.
"""

from __future__ import annotations

import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from elastic.errors import EtcdConnectionError
from elastic.etcd.client import EtcdClient, EtcdOptions, parse_endpoints
from elastic.etcd.server import find_etcd, free_port

MANIFEST = Path(__file__).resolve().parents[2] / "agents" / "k8s" / "etcd.yaml"
SANS = "DNS:etcd-0.etcd,DNS:etcd-1.etcd,DNS:etcd-2.etcd,DNS:etcd-client,IP:127.0.0.1"


def _openssl(cwd: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _issue(cwd: Path, name: str, cn: str, ext: str) -> None:
    """NAME.key + NAME.crt signed by ca.crt, with the given X.509 extensions."""
    (cwd / f"{name}.ext").write_text(ext)
    _openssl(
        cwd, "req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key",
        "-subj", f"/CN={cn}", "-out", f"{name}.csr",
    )  # fmt: skip
    _openssl(
        cwd, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.crt",
    )  # fmt: skip


def _certs(cwd: Path) -> Path:
    _openssl(
        cwd, "req", "-x509", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key",
        "-subj", "/CN=test CA", "-days", "2", "-out", "ca.crt",
    )  # fmt: skip
    _issue(
        cwd, "server", "etcd", f"subjectAltName={SANS}\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    _issue(cwd, "client", "elastic-client", "extendedKeyUsage=clientAuth\n")
    return cwd


def _etcd_container() -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    return container


def _member_args(i: int, ports: list[dict[str, int]], tls: Path, data: Path) -> list[str]:
    """The manifest's args for pod etcd-i, on loopback ports."""
    out = []
    for arg in _etcd_container()["args"]:
        arg = arg.replace("$(POD_NAME)", f"etcd-{i}")
        for j, p in enumerate(ports):
            arg = arg.replace(f"etcd-{j}.etcd:2379", f"127.0.0.1:{p['client']}")
            arg = arg.replace(f"etcd-{j}.etcd:2380", f"127.0.0.1:{p['peer']}")
        arg = arg.replace("0.0.0.0:2379", f"127.0.0.1:{ports[i]['client']}")
        arg = arg.replace("0.0.0.0:2380", f"127.0.0.1:{ports[i]['peer']}")
        arg = arg.replace("0.0.0.0:2381", f"127.0.0.1:{ports[i]['metrics']}")
        arg = arg.replace("/etc/etcd/tls", str(tls)).replace("/var/lib/etcd", str(data / str(i)))
        out.append(arg)
    return out


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[list[dict[str, int]], Path]]:
    tls = _certs(tmp_path)
    ports = [{k: free_port() for k in ("client", "peer", "metrics")} for _ in range(3)]
    procs = []
    for i in range(3):
        with open(tmp_path / f"etcd-{i}.log", "wb") as log:
            cmd = [find_etcd(), *_member_args(i, ports, tls, tmp_path)]
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=log))
    yield ports, tls
    for proc in procs:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as reply:
            return reply.status == 200 and b'"health":"true"' in reply.read()
    except OSError:
        return False


def test_the_statefulset_command_forms_a_three_member_tls_cluster(
    cluster: tuple[list[dict[str, int]], Path],
) -> None:
    ports, tls = cluster
    deadline = time.monotonic() + 60
    while not all(_healthy(p["metrics"]) for p in ports):
        assert time.monotonic() < deadline, "the members did not become healthy in 60 s"
        time.sleep(0.2)
    endpoints = ",".join(f"https://127.0.0.1:{p['client']}" for p in ports)
    options = EtcdOptions(
        parse_endpoints(endpoints)[0],
        tls=True,
        ca_cert=str(tls / "ca.crt"),
        cert=str(tls / "client.crt"),
        key=str(tls / "client.key"),
    )
    with EtcdClient(options) as client:
        client.put(b"/elastic/k8s-check", b"ok")
        assert client.range(b"/elastic/k8s-check").kvs[0].value == b"ok"
    no_cert = EtcdOptions(
        parse_endpoints(endpoints)[0], tls=True, ca_cert=str(tls / "ca.crt"), connect_timeout=1
    )
    with pytest.raises(EtcdConnectionError), EtcdClient(no_cert) as client:
        client.range(b"/elastic/k8s-check")  # client certificates are required
