"""The job secret file: who may read it before we warn."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from elastic import secret


@pytest.mark.parametrize(
    ("mode", "gid", "warns"),
    [
        (0o600, None, False),
        (0o440, None, False),  # Kubernetes: a Secret mounted 0440 with the pod's own group
        (0o644, None, True),  # everyone
        (0o640, 65534, True),  # a group this process is not in
    ],
)
def test_secret_file_mode(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: int, gid: int | None, warns: bool
) -> None:
    path = tmp_path / "job.key"
    path.write_bytes(b"k" * 32)
    if gid is not None:
        if gid in (os.getgid(), *os.getgroups()) or os.geteuid() != 0:
            pytest.skip("needs root and a group this process is not in")
        os.chown(path, -1, gid)
    path.chmod(mode)
    with caplog.at_level(logging.WARNING, logger="elastic.secret"):
        assert secret.job_secret({"ELASTIC_SECRET_FILE": str(path)}) == b"k" * 32
    assert ("readable by other users" in caplog.text) == warns
