"""A signed ``.metadata`` that names only allowlisted classes must not change a class.

The red team's file (issue 38): a pickle that names nothing outside
``dcp_metadata.ALLOWED`` but uses BUILD's slot state on the classes themselves, setting
``Metadata.__reduce_ex__`` (every later save fails) and ``PosixPath.__truediv__`` (so
``Path('/ckpt/run') / 'step-15'`` is relative). It is signed with the job secret, its
marker's digests recomputed: only the unpickler stands between it and the process. The
replay runs in a child process (what it would poison is the interpreter itself).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

CHILD = r"""
import hashlib, json, pickle, sys, torch
from pathlib import Path
from torch.distributed.checkpoint.metadata import Metadata
from elastic import secret as signing
from elastic.checkpoint import CheckpointManager, find_latest_complete
from elastic.checkpoint.config import CheckpointConfig
from elastic.checkpoint.digest import KEYED, bytes_digest
from elastic.checkpoint.dcp_metadata import read_metadata
from elastic.checkpoint.layout import COMMIT_MARKER, _signed_content
from elastic.errors import CheckpointError

url, run = sys.argv[1], "r"
def manager():
    return CheckpointManager(CheckpointConfig(url=url, interval=1, keep_last=5), run)
def state(v):
    return {"model": {"w": torch.full((8, 4), float(v))}, "train": {"step": v}}
for step in (1, 2):
    outcome = manager().save(step, state(step), block=True)
    assert outcome is not None and outcome.ok, outcome
secret = signing.job_secret()
info = find_latest_complete(url, run, warn=False, secret=secret)
assert info is not None and info.step == 2 and info.marker is not None
meta_path = next(Path(info.step_dir).rglob(".metadata"))
metadata = pickle.loads(meta_path.read_bytes())  # our own save, read by the test

def glob(module, name):
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"
def slot_state_on(cls, attr, value):
    # cls, then (None, {attr: value}), BUILD: pickle's slot state is setattr(cls, attr, value)
    name = attr.encode()
    return (cls + b"N}" + b"X" + len(name).to_bytes(4, "little") + name + value
            + b"s" + b"\x86" + b"b" + b"0")
poison = (
    slot_state_on(glob("torch.distributed.checkpoint.metadata", "Metadata"), "__reduce_ex__",
                  glob("torch", "Size"))
    + slot_state_on(glob("pathlib", "PosixPath"), "__truediv__", glob("pathlib", "PurePosixPath"))
)
legit = pickle.dumps(metadata, protocol=2)
data = legit[:2] + poison + legit[2:]
meta_path.write_bytes(data)
marker_path = Path(info.step_dir) / COMMIT_MARKER
marker = json.loads(marker_path.read_text())
for name, record in marker["files"].items():
    if name == ".metadata":
        record["size"] = len(data)
        for kind in list(record):
            if kind != "size" and kind not in KEYED:
                record[kind] = (hashlib.sha256(data).hexdigest() if kind == "sha256"
                                else bytes_digest(data, kind))
marker.pop("hmac", None)
marker["hmac"] = signing.sign(secret, _signed_content(marker))
marker_path.write_text(json.dumps(marker, sort_keys=True))

out = {}
try:
    read_metadata(data, str(meta_path), marker["files"])
    out["read"] = "accepted"
except CheckpointError as exc:
    out["read"] = str(exc)
loaded = manager().load_latest(lambda: state(0))
out["loaded_step"] = None if loaded is None else loaded[0]
out["reduce_ex_untouched"] = "__reduce_ex__" not in Metadata.__dict__
out["truediv_untouched"] = "__truediv__" not in vars(type(Path("/")))
out["joined"] = str(Path("/ckpt/run") / "step-15")
try:
    outcome = manager().save(3, state(3), block=True)
    out["save"] = "ok" if outcome is not None and outcome.ok else repr(outcome)
except Exception as exc:
    out["save"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out), flush=True)
"""


def _replay(tmp_path: Path) -> dict[str, Any]:
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config")}
    for name in ("ELASTIC_SECRET_FILE", "ELASTIC_FENCE", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    secret = tmp_path / "secret"
    secret.write_text("s3cr3t-shared-by-every-node")
    env["ELASTIC_SECRET_FILE"] = str(secret)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "ckpt")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.integration
def test_a_signed_metadata_that_rewrites_classes_is_refused_without_side_effects(
    tmp_path: Path,
) -> None:
    got = _replay(tmp_path)
    # the process is untouched: no class changed, paths join, a save still works
    assert got["reduce_ex_untouched"], got
    assert got["truediv_untouched"], got
    assert got["joined"] == "/ckpt/run/step-15", got
    assert got["save"] == "ok", got
    # the file is refused in one sentence that names it and what to do
    text = got["read"]
    assert text != "accepted", got
    assert text.startswith("Refusing the checkpoint metadata ") and ".metadata" in text, text
    assert "\n" not in text and "restore" in text, text
    # the resume takes the older, intact step
    assert got["loaded_step"] == 1, got


def _glob(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _text(value: str) -> bytes:
    return b"X" + len(value.encode()).to_bytes(4, "little") + value.encode()


_META = _glob("torch.distributed.checkpoint.metadata", "Metadata")
_ENUM = _glob("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")
# Each names only allowlisted globals, and changes something the pickle did not build.
CHANGING = {
    "slot state on a class": _META + b"N}" + _text("__reduce_ex__") + _text("x") + b"s\x86b.",
    "a dict state on a class": _META + b"}" + _text("__reduce_ex__") + _text("x") + b"sb.",
    "state on a shared enum member": _ENUM + b"K\x01\x85R}" + _text("_value_") + b"K\x09sb.",
    "a non-field on a fresh instance": _META + b")\x81}" + _text("__reduce_ex__") + b"Nsb.",
    "SETITEMS into a class": _META + b"(" + _text("__reduce_ex__") + b"Nu.",
    "APPENDS to a class": _META + b"(Ne.",
}


@pytest.fixture
def _unpoisoned() -> Iterator[None]:
    """Undo what a failing run of these tests did to Metadata (or every later save fails)."""
    from torch.distributed.checkpoint.metadata import Metadata

    yield
    if "__reduce_ex__" in vars(Metadata):
        del Metadata.__reduce_ex__


@pytest.mark.usefixtures("_unpoisoned")
@pytest.mark.parametrize("data", CHANGING.values(), ids=CHANGING.keys())
def test_an_opcode_that_changes_what_the_pickle_did_not_build_is_refused(data: bytes) -> None:
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, Metadata

    from elastic.checkpoint.dcp_metadata import read_metadata
    from elastic.errors import CheckpointError

    with pytest.raises(
        CheckpointError, match=r"^Refusing the checkpoint metadata /x/.metadata: "
    ) as refused:
        read_metadata(b"\x80\x02" + data, "/x/.metadata")
    assert "restore the step's files" in str(refused.value)
    assert "__reduce_ex__" not in vars(Metadata)
    assert _MEM_FORMAT_ENCODING(1).value == 1
