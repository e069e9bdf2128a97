"""A local user who takes ``elastic-<uid>`` first and fills the base with decoys cannot
slow a node-local lookup (issue 26, item 4): the other root's name comes from a key private
to this uid, so it is found with a few ``stat`` calls; the base is never listed. Before,
every lookup listed the base and opened each name of the fallback shape: 440 ms with
20,000 decoys, per lookup, and an in-place agent burnt most of a core on it.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from elastic.node import nodelocal
from tests.trust.conftest import NOBODY, as_nobody

DECOYS = 20_000
pytestmark = pytest.mark.integration  # the attacker is a process of another uid


def _no_listing(monkeypatch: pytest.MonkeyPatch, base: Path) -> None:
    real = os.listdir

    def listdir(path: str | os.PathLike[str] = ".") -> list[str]:
        assert Path(path) != base, "a lookup listed the base directory"
        return real(path)

    monkeypatch.setattr(nodelocal.os, "listdir", listdir)


def test_a_squatter_and_decoys_cost_a_lookup_nothing(
    shared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    uid = os.geteuid()
    squat = shared / f"elastic-{uid}"
    done = as_nobody(
        f"mkdir -m 777 {squat} && cd {shared} && "
        f"python3 -c 'import os\nfor i in range({DECOYS}): os.mkdir(\"elastic-{uid}-%05d\" % i)'"
    )
    assert done.returncode == 0, done.stderr
    assert squat.stat().st_uid == NOBODY and len(os.listdir(shared)) > DECOYS
    _no_listing(monkeypatch, shared)

    base = str(shared)
    assert nodelocal.find(4242, base) is None  # nothing made yet: no scan either
    path, made = nodelocal.ensure(4242, base)
    assert made and path.parent != squat and path.parent.name.startswith(f"elastic-{uid}-")
    for folder in (path, path.parent):
        st = folder.stat()
        assert st.st_uid == uid and stat.S_IMODE(st.st_mode) == 0o700
    keys = tmp_path / "cache" / "elastic" / nodelocal.KEYS_NAME
    assert stat.S_IMODE(keys.stat().st_mode) == 0o600
    assert stat.S_IMODE(keys.parent.stat().st_mode) == 0o700

    start = time.perf_counter()
    for _ in range(100):
        assert nodelocal.find(4242, base) == path
        assert nodelocal.find(4243, base) is None
    per_lookup = (time.perf_counter() - start) / 200
    assert per_lookup < 0.005, f"{per_lookup * 1000:.2f} ms per lookup"
    assert nodelocal.ensure(4242, base) == (path, False)
    assert nodelocal.remove_owned(4242, base) and nodelocal.find(4242, base) is None


def test_a_taken_keyed_name_gets_a_new_key(
    shared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A name seen before a reboot and taken after it: a new key, a new name."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    uid = os.geteuid()
    assert as_nobody(f"mkdir -m 777 {shared}/elastic-{uid}").returncode == 0
    first, _ = nodelocal.ensure(1, str(shared))
    first.rmdir()
    first.parent.rmdir()  # the base was emptied; the attacker saw the name and takes it
    assert as_nobody(f"mkdir -m 777 {first.parent}").returncode == 0
    second, made = nodelocal.ensure(1, str(shared))
    assert made and second.parent not in (first.parent, shared / f"elastic-{uid}")
    assert nodelocal.find(1, str(shared)) == second


def test_no_private_place_for_a_key_is_one_sentence(
    shared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "elastic").symlink_to(tmp_path)  # not a private directory
    assert as_nobody(f"mkdir -m 777 {shared}/elastic-{os.geteuid()}").returncode == 0
    with pytest.raises(PermissionError, match="no private key for another name") as err:
        nodelocal.ensure(1, str(shared))
    assert str(err.value).count(". ") == 0 and str(err.value).endswith(".")
