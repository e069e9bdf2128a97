"""A streamed peer state is bounded by the receiver's own memory limit (issue 26, item 4).

Before, a claim was checked against the host's RAM: a 3 GiB claim OOM-killed a receiver
limited to 1 GiB (the digest is checked only after all of it arrived). Now the claim is
checked against what this process's memory cgroup (v2, else v1) and the host still allow,
and refused in one sentence before anything is allocated.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastic.node import memlimit
from elastic.worker import exchange
from elastic.worker.codec import RecoveryError
from tests.helpers import REPO

GIB = 1 << 30


def test_cgroup_v2_room_is_the_least_over_the_ancestors(tmp_path: Path) -> None:
    root, self_cgroup = tmp_path / "cg", tmp_path / "self"
    self_cgroup.write_text("0::/job/worker\n")
    (root / "job" / "worker").mkdir(parents=True)
    (root / "memory.max").write_text("max\n")  # the root: no limit
    (root / "job" / "memory.max").write_text(str(4 * GIB))
    (root / "job" / "memory.current").write_text(str(1 * GIB))
    (root / "job" / "worker" / "memory.max").write_text("max\n")
    (root / "job" / "worker" / "memory.current").write_text(str(GIB // 2))
    assert memlimit.cgroup_room(root, self_cgroup) == 3 * GIB
    (root / "job" / "worker" / "memory.max").write_text(f"{GIB}\n")
    assert memlimit.cgroup_room(root, self_cgroup) == GIB // 2
    (root / "job" / "worker" / "memory.current").write_text(str(2 * GIB))
    assert memlimit.cgroup_room(root, self_cgroup) == 0  # over its limit already


def test_cgroup_v1_and_no_limit(tmp_path: Path) -> None:
    root, self_cgroup = tmp_path / "cg", tmp_path / "self"
    (root / "memory" / "pod").mkdir(parents=True)
    self_cgroup.write_text("5:cpu:/pod\n4:memory:/pod\n0::/\n")
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # none
    (root / "memory" / "pod" / "memory.limit_in_bytes").write_text(str(GIB))
    (root / "memory" / "pod" / "memory.usage_in_bytes").write_text(str(GIB // 4))
    assert memlimit.cgroup_room(root, self_cgroup) == GIB * 3 // 4
    (root / "memory" / "pod" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert memlimit.cgroup_room(root, self_cgroup) is None
    assert memlimit.cgroup_room(root, tmp_path / "absent") is None


def test_available_is_the_least_of_cgroup_and_host(tmp_path: Path) -> None:
    root, self_cgroup, meminfo = tmp_path / "cg", tmp_path / "self", tmp_path / "meminfo"
    self_cgroup.write_text("0::/\n")
    root.mkdir()
    (root / "memory.max").write_text(str(GIB))
    (root / "memory.current").write_text("0")
    meminfo.write_text("MemTotal:       32000000 kB\nMemAvailable:   2097152 kB\n")
    assert memlimit.host_available(meminfo) == 2 * GIB
    assert memlimit.available_bytes(root, self_cgroup, meminfo) == GIB
    (root / "memory.max").write_text("max")
    assert memlimit.available_bytes(root, self_cgroup, meminfo) == 2 * GIB
    assert memlimit.available_bytes(root, self_cgroup, tmp_path / "none") is None


def test_a_claim_over_the_receivers_limit_is_refused_in_one_sentence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(memlimit, "available_bytes", lambda: GIB)
    exchange._check_sizes(3, 100, GIB // 2)  # fits: received, and decoded out of the bytes
    with pytest.raises(RecoveryError, match=r"^Rank 3 announced a state of 100 \+ 3221225472") as e:
        exchange._check_sizes(3, 100, 3 * GIB)
    message = str(e.value)
    assert str(GIB) in message and message.endswith("it is not received.")
    assert message.count(". ") == 0


@pytest.mark.integration
def test_a_real_memory_cgroup_bounds_what_is_available(tmp_path: Path) -> None:
    """A process in a memory cgroup of 256 MiB (v1 or v2, where this host lets us make one)."""
    v2, v1 = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/memory")
    if (v2 / "cgroup.controllers").exists():
        parent, limit_file = v2, "memory.max"
    elif (v1 / "memory.limit_in_bytes").exists():
        parent, limit_file = v1, "memory.limit_in_bytes"
    else:
        pytest.skip("no memory cgroup on this host")
    group = parent / f"elastic-test-{os.getpid()}"
    try:
        group.mkdir()
        (group / limit_file).write_text(str(256 << 20))
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup here ({exc})")
    try:
        code = (
            "import os, sys\n"
            f"open({str(group / 'cgroup.procs')!r}, 'w').write(str(os.getpid()))\n"
            "from elastic.node import memlimit\n"
            "print(memlimit.available_bytes())\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert 0 < int(done.stdout) <= 256 << 20, done.stdout
    finally:
        group.rmdir()
