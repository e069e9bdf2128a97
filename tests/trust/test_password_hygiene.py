"""The etcd password, read from the outside: not in ``/proc/<pid>/environ`` nor ``cmdline`` of
a real agent on an auth-enabled etcd nor of its children, and no file of it after a SIGKILL."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import textwrap
from pathlib import Path

import pytest

from elastic import env
from tests.helpers import PYTHON, REPO, local_cluster, node_env, wait_until
from tests.rendezvous.test_tls_auth import PASSWORD, SecureEtcd, secure_etcd  # noqa: F401
from tests.trust.conftest import NOBODY

# A worker that says it runs, then waits (bounded) for the test to let it finish.
WORKER = """
import os, sys, time
# forked from a server that was forked from the agent: the agent's password must be gone
held = getattr(sys.modules.get("elastic.etcd.credentials"), "_env_password", None)
open(sys.argv[1] + ".held", "w").write("held" if held else "clear")
open(sys.argv[1] + ".tmp", "w").write(str(os.getpid()))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
deadline = time.monotonic() + 120
while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:
    time.sleep(0.05)
"""

# Takes the password as the agent does, makes the workers' password file, prints its path
# and what a child of it (a worker: the same user, a fresh process) reads there, and waits
# for stdin to close.
HOLDER = """
import subprocess, sys
from elastic.etcd import credentials
credentials.take_password_from_env()
path = credentials.password_file(credentials.password_from_env() or "")
read = subprocess.run(["cat", path], capture_output=True, text=True)
print(path, read.stdout.strip() or "-", flush=True)
sys.stdin.read()
"""


def _tree(root: int) -> list[int]:
    """``root`` and every live descendant of it."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_bytes()
        except (OSError, ValueError):
            continue
        if entry.name.isdigit():
            parents[int(entry.name)] = int(stat.rsplit(b")", 1)[1].split()[1])
    found, todo = [root], [root]
    while todo:
        pid = todo.pop()
        children = [c for c, p in parents.items() if p == pid]
        found += children
        todo += children
    return found


def _leaks(pids: list[int], secret: bytes) -> list[str]:
    """The /proc files of ``pids`` that hold ``secret`` (processes gone meanwhile skipped)."""
    leaks = []
    for pid in pids:
        for name in ("environ", "cmdline"):
            try:
                if secret in Path(f"/proc/{pid}/{name}").read_bytes():
                    leaks.append(f"/proc/{pid}/{name}")
            except OSError:
                pass
    return leaks


@pytest.mark.integration
def test_a_real_agent_and_its_children_show_no_password_in_proc(
    secure_etcd: SecureEtcd,  # noqa: F811
    tmp_path: Path,
    run_id: str,
) -> None:
    script, ready, go = tmp_path / "worker.py", tmp_path / "ready", tmp_path / "go"
    script.write_text(WORKER)
    certs = secure_etcd.certs
    conf = "profile=fast-failover,join_timeout=60,user=root,"
    conf += f"cacert={certs.ca},cert={certs.client_cert},key={certs.client_key}"
    environ = node_env(**{env.ETCD_PASSWORD: PASSWORD})
    endpoint = f"https://{secure_etcd.server.endpoint}"
    cluster = local_cluster(tmp_path / "run", endpoint, run_id, environ, nnodes="1", rdzv_conf=conf)
    with cluster as c:
        node = c.start("node", worker=[str(script), str(ready), str(go)])
        wait_until(lambda: ready.exists() or not node.running(), 180, "the worker to start")
        assert node.running(), node.output()[-3000:]
        pids = _tree(node.pid)
        assert int(ready.read_text()) in pids, "the worker is not among the agent's children"
        held = (tmp_path / "ready.held").read_text()
        leaks = _leaks(pids, PASSWORD.encode())
        go.touch()
        assert node.wait(60) == 0, node.output()[-3000:]
    assert not leaks, f"the etcd password is readable in {leaks}"
    assert held == "clear", "the worker's memory holds the agent's etcd password"
    assert len(pids) >= 2


def _holder(user: list[str]) -> subprocess.Popen[str]:
    environ = node_env(**{env.ETCD_PASSWORD: PASSWORD, "KEEP_ME": "1"})
    argv = [*user, PYTHON, "-c", textwrap.dedent(HOLDER)]
    return subprocess.Popen(
        argv, env=environ, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def _as_nobody() -> list[str]:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return []  # already not root: the plain run is the non-root one
    if not _others_can_enter(REPO):
        pytest.skip(
            f"uid {NOBODY} cannot read this checkout ({REPO} sits in a directory only its owner "
            "may enter, e.g. one made by mktemp -d); clone it where others may read it."
        )
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]


def _others_can_enter(path: Path) -> bool:
    """Whether a user of no group of ours may reach ``path``: every directory above it
    lets others search it."""
    return all(os.stat(p).st_mode & 0o001 for p in [path, *path.parents])


@pytest.mark.integration
@pytest.mark.parametrize("who", ["this user", "uid 65534"])
def test_the_wipe_needs_no_privilege_and_the_password_file_dies_with_its_process(
    who: str,
) -> None:
    proc = _holder(_as_nobody() if who == "uid 65534" else [])
    try:
        assert proc.stdout is not None
        path, worker_read = proc.stdout.readline().split()
        assert worker_read == PASSWORD, "a child of the holder cannot read the password file"
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
        assert PASSWORD.encode() not in environ and b"KEEP_ME=1" in environ
        assert path.startswith(f"/proc/{proc.pid}/fd/"), path
        assert Path(path).read_text() == PASSWORD  # what a worker of that process reads
        assert os.stat(path).st_mode & 0o077 == 0
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert not os.path.exists(path), "the password file outlived its process"
