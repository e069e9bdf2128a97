"""Another local user plants node-local files: workers and agents ignore or refuse them.

The attacker (uid 65534) writes into a sticky world-writable directory, as anyone may in
/dev/shm; the worker and the agent run as root with that directory as their base.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from elastic import env
from elastic.node import channel, nodelocal, reform
from elastic.node.channel import Assignment, Registration
from elastic.worker.codec import RecoveryError
from elastic.worker.snapshot import SnapshotStore
from tests.trust.conftest import DROP_ROOT, NOBODY, as_nobody, python, worker

ROOT_DIR = f"elastic-{os.geteuid()}"  # the name the attacker takes first


def _dead_pid() -> int:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(done.stdout)


def _forged(tmp_path: Path, shared: Path, owner: int) -> Path:
    """A complete snapshot of step 12 (a real one, as an attacker could build), readable by all."""
    made = worker(tmp_path, 12, owner)
    assert made.returncode == 0, made.stderr[-3000:]
    source = nodelocal.find(owner, str(tmp_path))
    assert source is not None
    forged = shared / ".forged"
    forged.write_bytes((source / "snap-trust-r0-a").read_bytes())
    forged.chmod(0o644)
    return forged


@pytest.mark.integration
def test_a_planted_snapshot_is_never_resumed_nor_written(tmp_path: Path, shared: Path) -> None:
    owner = os.getpid()  # the "agent" whose files the worker looks for
    forged = _forged(tmp_path, shared, owner)
    legacy = shared / f"elastic-trust-p{owner}-r0-a"  # the guessable name of earlier versions
    planted = shared / ROOT_DIR / str(owner) / "snap-trust-r0-a"
    done = as_nobody(
        f"mkdir -m 777 {shared / ROOT_DIR} {planted.parent} && cp {forged} {planted} && "
        f"cp {forged} {legacy} && chmod 666 {planted} {legacy}"
    )
    assert done.returncode == 0, done.stderr
    assert (shared / ROOT_DIR).stat().st_uid == NOBODY

    first = worker(shared, 3, owner)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "resumed 0 fresh" in first.stdout, first.stdout  # not the forged step 12
    assert first.stderr.count("is not a private directory of this uid") == 1, first.stderr
    assert planted.read_bytes() == forged.read_bytes() == legacy.read_bytes()  # untouched
    ours = nodelocal.find(owner, str(shared))
    assert ours is not None and ours.parent.name.startswith(f"{ROOT_DIR}-")
    for folder in (ours, ours.parent):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and folder.stat().st_uid == 0

    again = worker(shared, 5, owner)  # a restart finds its own snapshot: nothing lost
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed 3 memory" in again.stdout, again.stdout


@pytest.mark.integration
def test_planted_symlinks_never_redirect_a_write(tmp_path: Path, shared: Path) -> None:
    owner = os.getpid()
    victim = tmp_path / "precious"
    victim.write_text("precious")
    evil = shared / "evil"
    links = " && ".join(
        f"ln -s {victim} {path}"
        for path in (
            evil / str(owner) / "snap-trust-r0-a",
            evil / str(owner) / "snap-trust-r0-b",
            shared / f"elastic-trust-p{owner}-r0-a",
            shared / f"elastic-trust-p{owner}-r0-b",
        )
    )
    done = as_nobody(
        f"mkdir -m 777 {evil} {evil / str(owner)} && {links} && ln -s {evil} {shared / ROOT_DIR}"
    )
    assert done.returncode == 0, done.stderr

    ran = worker(shared, 3, owner)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "resumed 0 fresh" in ran.stdout
    assert victim.read_text() == "precious"
    assert (shared / ROOT_DIR).is_symlink() and (evil / str(owner) / "snap-trust-r0-a").is_symlink()


def test_a_symlink_in_our_own_directory_is_refused_in_one_sentence(tmp_path: Path) -> None:
    folder = nodelocal.directory(os.getpid(), str(tmp_path))
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (folder / "snap-run-r0-a").symlink_to(victim)
    with pytest.raises(RecoveryError, match=r"^\S+snap-run-r0-a is not a private file of uid") as e:
        SnapshotStore("run", 0, owner=os.getpid(), directory=str(tmp_path)).newest()
    assert str(e.value).count(". ") == 0 and str(e.value).endswith("another directory.")
    assert victim.read_text() == "precious"


@pytest.mark.integration
def test_a_planted_reform_marker_does_not_skip_the_checkpoint(
    tmp_path: Path, shared: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    owner = os.getpid()
    target = tmp_path / "made-by-the-agent"  # where the old marker's symlink led
    done = as_nobody(
        f"touch {shared}/elastic-reform-{owner} && mkdir -m 777 {shared / ROOT_DIR} "
        f"{shared / ROOT_DIR / str(owner)} && touch {shared / ROOT_DIR / str(owner)}/reform && "
        f"ln -s {target} {shared}/elastic-reform-{owner + 1}"
    )
    assert done.returncode == 0, done.stderr
    code = f"from elastic.node import reform; print(reform.stopping_for_reform({str(shared)!r}))"
    seen = python(code, {env.SNAPSHOT_OWNER: str(owner)})
    assert seen.returncode == 0 and seen.stdout.strip() == "False", seen.stderr  # so: persist

    monkeypatch.setenv(env.SNAPSHOT_OWNER, str(owner + 1))
    with reform.marking(owner + 1, str(shared)):
        assert reform.stopping_for_reform(str(shared))  # the agent's own marker works
        folder = nodelocal.find(owner + 1, str(shared))
        assert folder is not None
        denied = as_nobody(f"touch {folder}/reform-too")
        assert denied.returncode != 0 and "Permission denied" in denied.stderr
    assert not target.exists() and not reform.stopping_for_reform(str(shared))


@pytest.mark.integration
def test_planted_channel_files_are_neither_read_nor_followed(tmp_path: Path, shared: Path) -> None:
    owner = os.getpid()
    victim = tmp_path / "precious"
    victim.write_text("precious")
    forged = '{"round": 99, "rank": 0, "world_size": 1, "abort": true}'
    theirs = shared / ROOT_DIR / str(owner)
    done = as_nobody(
        f"echo '{forged}' > {shared}/elastic-channel-{owner}-0.agent && "
        f"ln -s {victim} {shared}/elastic-channel-{owner}-0.worker && "
        f"mkdir -m 777 {shared / ROOT_DIR} {theirs} && echo '{forged}' > {theirs}/channel-0.agent"
        f" && ln -s {victim} {theirs}/channel-0.worker"
    )
    assert done.returncode == 0, done.stderr
    prefix = channel.prefix_for(owner, 0, str(shared))  # what the agent hands its worker
    assert prefix.parent != theirs and channel.read_assignment(prefix) is None
    channel.write_assignment(prefix, Assignment(1, rank=0, world_size=1))
    channel.register(prefix, Registration(owner, 1))
    assert channel.read_assignment(prefix) == Assignment(1, rank=0, world_size=1)
    assert channel.read_registration(prefix) == Registration(owner, 1)
    assert victim.read_text() == "precious"


def _prepare(shared: Path, drop_root: bool) -> subprocess.CompletedProcess[str]:
    """An agent's start on this node (its orphan cleanup and directory), optionally as uid
    65534; it prints where its own directory is."""
    code = (
        "import logging, os\n"
        "logging.basicConfig(level=logging.INFO, format='%(levelname)s %(message)s')\n"
        "from elastic.node import nodelocal\n"
        "from elastic.agent import node\n"
        + (DROP_ROOT if drop_root else "")
        + f"node._prepare_node({str(shared)!r})\n"
        f"print(nodelocal.find(os.getpid(), {str(shared)!r}))\n"
    )
    return python(code)


@pytest.mark.integration
def test_another_users_directories_never_stop_an_agent_from_starting(shared: Path) -> None:
    dead = _dead_pid()
    done = as_nobody(
        f"mkdir {shared}/elastic-x-p{dead}-r0-a {shared}/elastic-channel-{dead}-0.agent && "
        f"touch {shared}/elastic-x-p{dead}-r0-a/keep && touch {shared / ROOT_DIR}"
    )
    assert done.returncode == 0, done.stderr
    started = _prepare(shared, drop_root=False)
    assert started.returncode == 0, started.stderr
    left = f"Left these entries in {shared}, which are not this user's files to remove"
    assert started.stderr.count(left) == 2, started.stderr  # one line per kind, never a raise
    assert Path(started.stdout.strip()).parent.name.startswith(f"{ROOT_DIR}-")
    assert (shared / f"elastic-x-p{dead}-r0-a" / "keep").exists()
    assert (shared / f"elastic-channel-{dead}-0.agent").is_dir()


@pytest.mark.integration
def test_a_killed_root_runs_files_never_stop_a_non_root_agent(shared: Path) -> None:
    dead = _dead_pid()  # a root agent killed with -9 left these
    (shared / f"elastic-x-p{dead}-r0-a").write_bytes(b"root's")
    (shared / f"elastic-channel-{dead}-0.worker").write_text("{}")
    leftover = nodelocal.directory(dead, str(shared)) / "snap-x-r0-a"
    leftover.write_bytes(b"root's")
    started = _prepare(shared, drop_root=True)
    assert started.returncode == 0, started.stderr
    assert started.stderr.count("which are not this user's files to remove") == 2, started.stderr
    assert started.stdout.strip().startswith(f"{shared}/elastic-{NOBODY}/")
    assert (shared / f"elastic-x-p{dead}-r0-a").exists() and leftover.exists()
