"""The warning for an etcd password that would travel over plain http, and the password
never in a log record."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic.rendezvous.options import RendezvousOptions

PASSWORD = "pw-never-logged-7f3a"
UNENCRYPTED = "travels unencrypted"


@pytest.fixture
def password_file(tmp_path: Path) -> Path:
    path = tmp_path / "etcd-password"
    path.write_text(PASSWORD + "\n")
    path.chmod(0o600)
    return path


def parse(endpoint: str, caplog: pytest.LogCaptureFixture, **conf: str) -> list[str]:
    """Parse the options as the agent does; every log message it wrote, after checking
    that none of them holds the password."""
    params = RendezvousParameters("etcd-v3", endpoint, "run", 1, 1, **conf)
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        options = RendezvousOptions.from_params(params)
    assert options.password == PASSWORD
    assert PASSWORD not in repr(options)
    for record in caplog.records:
        shown = f"{record.getMessage()} {record.msg} {record.args} {record.exc_text}"
        assert PASSWORD not in shown, f"the password is in a log record of {record.name}"
    assert PASSWORD not in caplog.text
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_password_over_plain_http_is_warned_about(
    password_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for endpoint in ("127.0.0.1:2379", "http://etcd-1:2379,http://etcd-2:2379"):
        warnings = parse(endpoint, caplog, user="root", password_file=str(password_file))
        assert [w for w in warnings if UNENCRYPTED in w], f"no warning for {endpoint}"
    warnings = parse(
        "https://etcd:2379",
        caplog,
        protocol="http",
        user="root",
        password_file=str(password_file),
    )
    assert [w for w in warnings if UNENCRYPTED in w], "protocol=http wins over the endpoint"
    inline = parse("127.0.0.1:2379", caplog, user="root", password=PASSWORD)
    assert [w for w in inline if UNENCRYPTED in w]
    assert [w for w in inline if "shows in 'ps'" in w]


def test_no_warning_over_tls_or_without_a_password(
    password_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for endpoint, conf in (
        ("https://etcd:2379", {}),  # TLS from the endpoint, as the client decides it
        ("etcd:2379", {"protocol": "https"}),
    ):
        warnings = parse(endpoint, caplog, user="root", password_file=str(password_file), **conf)
        assert not [w for w in warnings if UNENCRYPTED in w], (endpoint, conf)
    params = RendezvousParameters("etcd-v3", "127.0.0.1:2379", "run", 1, 1)
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        RendezvousOptions.from_params(params)
    assert UNENCRYPTED not in caplog.text
