"""Fixtures for the docker-compose end-to-end tests: a docker daemon, local images, a project.

Nothing here skips: without docker the tests fail, saying what is missing (CI runs
``.ci/docker-setup.sh`` first, which installs and starts everything and builds the images).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from elastic.etcd.server import free_port
from elastic.events import read as read_events
from tests.helpers import REPO
from tests.helpers import wait_until as _wait_until

T = TypeVar("T")

AGENT_UID = 10001  # the agent image's user (Dockerfile: AGENT_UID)
ETCD_USER = "elastic"
# docker/gen-secrets.sh's secret files (their values must never leak), and its private keys
SECRET_FILES = (
    "job-secret",
    "etcd-password",
    "etcd-root-password",
    "s3-access-key",
    "s3-secret-key",
)
KEY_FILES = ("ca.key", "etcd.key", "client.key")


def run(
    cmd: list[str], timeout: float = 120, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}:\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc


def wait_until(predicate: Callable[[], T], timeout: float, what: str, every: float = 0.5) -> T:
    return _wait_until(predicate, timeout, what, every)


def compose_cli() -> list[str]:
    """``docker-compose`` (v1, Debian's package) or ``docker compose`` (v2 plugin)."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    plugin = ["docker", "compose"]
    if shutil.which("docker") and run([*plugin, "version"], check=False).returncode == 0:
        return plugin
    pytest.fail(
        "Neither docker-compose nor the docker compose plugin is installed; run "
        "`bash .ci/docker-setup.sh` (apt-get install docker.io docker-compose)."
    )


@pytest.fixture(scope="session")
def images() -> dict[str, str]:
    """Start dockerd if none answers, build the local images (cached), return their names."""
    if not shutil.which("docker"):
        pytest.fail(
            "docker is not installed; run `bash .ci/docker-setup.sh` "
            "(apt-get install docker.io docker-compose debootstrap)."
        )
    if run(["docker", "info"], check=False, timeout=30).returncode != 0:
        started = run(["bash", "docker/start-dockerd.sh"], check=False, timeout=120)
        if started.returncode != 0:
            pytest.fail(f"No docker daemon, and starting one failed:\n{started.stderr[-3000:]}")
    built = run(["bash", "docker/build-base.sh"], check=False, timeout=3600)
    if built.returncode != 0:
        pytest.fail(f"Building the local images failed:\n{built.stderr[-5000:]}")
    names = dict(line.split("=", 1) for line in built.stdout.splitlines() if "=" in line)
    for key in (
        "ELASTIC_BASE_IMAGE",
        "ELASTIC_ETCD_IMAGE",
        "ELASTIC_AGENT_IMAGE",
        "ELASTIC_PROMETHEUS_IMAGE",
    ):
        assert names.get(key), f"docker/build-base.sh printed no {key}:\n{built.stdout}"
    return names


class Cluster:
    """One docker-compose project of this repo's docker-compose.yml, and what it wrote."""

    def __init__(self, images: dict[str, str], tmp: Path, overrides: dict[str, Any]) -> None:
        self.name = f"elastic-e2e-{uuid.uuid4().hex[:8]}"
        self.run_id = "compose-e2e"
        self.dir = tmp / "checkpoints"
        self.dir.mkdir()
        self.etcd_port = free_port()
        self.dashboard_port = free_port()
        # Fresh secrets per cluster (etcd TLS + passwords, the job secret, S3 keys), as
        # .ci/docker-setup.sh makes them for `docker compose up` by hand.
        self.secrets = tmp / "secrets"
        made = run(["bash", "docker/gen-secrets.sh", str(self.secrets)], check=False)
        if made.returncode != 0:
            pytest.fail(f"docker/gen-secrets.sh failed:\n{made.stderr[-3000:]}")
        # The agents (uid AGENT_UID) write the bind-mounted checkpoint directory.
        os.chown(self.dir, AGENT_UID, AGENT_UID)
        self.env_file = tmp / "agent.env"
        self.env_file.write_text("".join(f"{k}={v}\n" for k, v in overrides.items()))
        self.env = {
            **os.environ,
            "COMPOSE_PROJECT_NAME": self.name,
            "ELASTIC_IMAGE": images["ELASTIC_AGENT_IMAGE"],
            "ETCD_IMAGE": images["ELASTIC_ETCD_IMAGE"],
            "ELASTIC_ETCD_PORT": str(self.etcd_port),
            "ELASTIC_DASHBOARD_PORT": str(self.dashboard_port),
            "ELASTIC_CHECKPOINTS": str(self.dir),
            "ELASTIC_ENV_FILE": str(self.env_file),
            "ELASTIC_SECRETS_DIR": str(self.secrets),
            "ELASTIC_RUN_ID": self.run_id,
            "ELASTIC_STOP_GRACE": "120s",
        }
        self.cli = [*compose_cli(), "-f", str(REPO / "docker-compose.yml")]
        self.event_log = self.dir / "events.jsonl"
        self.profiles: list[str] = []  # passed to every compose command (down included)
        self.prometheus_port: int | None = None

    def compose(
        self, *args: str, timeout: float = 180, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        profiles = [a for p in self.profiles for a in ("--profile", p)]
        return run([*self.cli, *profiles, *args], timeout=timeout, check=check, env=self.env)

    def enable_monitoring(self, image: str) -> None:
        """Run the ``monitoring`` profile too: Prometheus from ``image`` on a free host port."""
        self.profiles.append("monitoring")
        self.prometheus_port = free_port()
        self.env.update(PROMETHEUS_IMAGE=image, PROMETHEUS_PORT=str(self.prometheus_port))

    def prometheus(self, path: str, **params: Any) -> Any:
        """The ``data`` of a Prometheus HTTP API reply, e.g. ``prometheus("/api/v1/query",
        query="up")``; fails the test on an error status."""
        assert self.prometheus_port, "call enable_monitoring() first"
        query = urllib.parse.urlencode(params)
        url = f"http://127.0.0.1:{self.prometheus_port}{path}?{query}"
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                body = json.load(reply)
        except urllib.error.HTTPError as exc:
            body = json.load(exc)
        assert body.get("status") == "success", f"Prometheus {path} {params}: {body}"
        return body["data"]

    def prometheus_value(self, query: str) -> float | None:
        """The one value of an instant ``query`` now; None while Prometheus has none (or is
        not up yet)."""
        try:
            result = self.prometheus("/api/v1/query", query=query)["result"]
        except OSError:  # not listening yet
            return None
        return float(result[0]["value"][1]) if result else None

    def dashboard(self, path: str = "api/status") -> Any:
        """The dashboard service's ``path`` on its published port: JSON for ``api/...``, the
        text otherwise; None while it does not answer (not up yet)."""
        url = f"http://127.0.0.1:{self.dashboard_port}/{path}"
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                body = reply.read()
        except OSError:  # refused, reset, or an HTTP error status (HTTPError is an OSError)
            return None
        return json.loads(body) if path.startswith("api/") else body.decode()

    def etcd_args(self) -> list[str]:
        """``elastic status``'s options to reach this cluster's etcd from the host: TLS with
        the client certificate, and the agents' user (its password from the file)."""
        return [
            "--etcd",
            f"https://127.0.0.1:{self.etcd_port}",
            "--cacert",
            str(self.secrets / "ca.crt"),
            "--cert",
            str(self.secrets / "client.crt"),
            "--key",
            str(self.secrets / "client.key"),
            "--user",
            ETCD_USER,
            "--password-file",
            str(self.secrets / "etcd-password"),
        ]

    def etcd_client(self, user: str | None = None, password: str | None = None) -> Any:
        """An EtcdClient from the host over TLS (client certificate), logged in as ``user``
        (None: no login)."""
        from elastic.etcd.client import EtcdClient, EtcdOptions, parse_endpoints

        endpoints, _ = parse_endpoints(f"127.0.0.1:{self.etcd_port}")
        return EtcdClient(
            EtcdOptions(
                endpoints,
                tls=True,
                ca_cert=str(self.secrets / "ca.crt"),
                cert=str(self.secrets / "client.crt"),
                key=str(self.secrets / "client.key"),
                user=user,
                password=password,
                connect_timeout=10,
                request_timeout=10,
            )
        )

    def secret(self, name: str) -> str:
        return (self.secrets / name).read_text().strip()

    def secret_values(self) -> list[str]:
        """Every generated secret value, and every line of the private keys."""
        values = [self.secret(name) for name in SECRET_FILES]
        for name in KEY_FILES:
            values += [
                line
                for line in (self.secrets / name).read_text().splitlines()
                if line and not line.startswith("-----")
            ]
        assert all(len(v) >= 16 for v in values), "gen-secrets.sh made a short secret"
        return values

    def assert_no_secret_in(self, container: str) -> None:
        """No secret value in ``docker inspect`` (env, command, mounts, labels: all of it)
        nor in the container's logs."""
        described = run(["docker", "inspect", container]).stdout
        logs = run(["docker", "logs", container], timeout=60)
        for value in self.secret_values():
            assert value not in described, f"a secret shows in `docker inspect {container}`"
            assert value not in logs.stdout + logs.stderr, f"a secret is in {container}'s logs"
        config = json.loads(described)[0]["Config"]
        assert not any(
            e.split("=", 1)[0].endswith(("PASSWORD", "SECRET_ACCESS_KEY", "ACCESS_KEY_ID"))
            for e in config["Env"] or []
        ), config["Env"]

    def agents(self) -> list[str]:
        """Container ids of the agent replicas, running or not."""
        return self.compose("ps", "-q", "agent").stdout.split()

    def running_agents(self) -> list[str]:
        return [c for c in self.agents() if self.inspect(c)["State"]["Running"]]

    def inspect(self, container: str) -> dict[str, Any]:
        return json.loads(run(["docker", "inspect", container]).stdout)[0]

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        return read_events(self.event_log, kind)

    def steps(self) -> list[dict[str, Any]]:
        return self.events("train.step")

    def last_step(self) -> int:
        steps = self.steps()  # the newest step, not the highest: a rollback goes back
        return steps[-1]["step"] if steps else 0

    def logs(self, lines: int = 40, width: int = 300) -> str:
        """The last ``lines`` lines of every service's logs (each line cut at ``width``: etcd
        logs whole stack traces), services one after the other."""
        services = self.compose("config", "--services", check=False).stdout.split()
        out = []
        for service in services:
            text = self.compose("logs", "--no-color", f"--tail={lines}", service, check=False)
            out += [f"--- {service}"] + [line[:width] for line in text.stdout.splitlines()]
        return "\n".join(out)

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans", "-t", "5", check=False, timeout=300)


@pytest.fixture
def cluster_factory(
    images: dict[str, str], tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(**overrides: Any) -> Cluster:
        cluster = Cluster(images, tmp_path, overrides)
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        failed = getattr(request.node, "rep_call", None)
        if failed is not None and failed.failed:
            print(f"--- docker-compose logs of {cluster.name}\n{cluster.logs()}")
        cluster.down()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
