"""The etcd client's pure logic: endpoint parsing, key ranges. No etcd."""

from __future__ import annotations

import pytest

from elastic.errors import ConfigError
from elastic.etcd.client import Endpoint, _prefix_end, parse_endpoints


@pytest.mark.parametrize(
    ("spec", "expected", "secure"),
    [
        ("h1:1,h2:2", [Endpoint("h1", 1), Endpoint("h2", 2)], False),
        ("h1", [Endpoint("h1", 2379)], False),
        ("https://h1:5, http://h2:6", [Endpoint("h1", 5), Endpoint("h2", 6)], True),
        ("[::1]:7", [Endpoint("::1", 7)], False),
    ],
)
def test_parse_endpoints(spec: str, expected: list[Endpoint], secure: bool) -> None:
    assert parse_endpoints(spec) == (expected, secure)


@pytest.mark.parametrize("spec", ["", " , ", "ftp://h:1", "h:notaport", "h:99999"])
def test_parse_endpoints_rejects(spec: str) -> None:
    with pytest.raises(ConfigError, match=r"etcd endpoint"):
        parse_endpoints(spec)


def test_endpoint_str_brackets_ipv6() -> None:
    assert str(Endpoint("::1", 7)) == "[::1]:7"


def test_prefix_end() -> None:
    assert _prefix_end(b"/a/") == b"/a0"
    assert _prefix_end(b"a\xff") == b"b"
