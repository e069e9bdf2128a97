"""Where the bootstrap store listens (elastic.rendezvous.bootstrap.listen_on): on the node's
address only, unless that address is a host name that resolves to loopback here."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from elastic.etcd.server import free_port
from elastic.rendezvous.bootstrap import listen_on


def accepts(addr: str, port: int) -> bool:
    try:
        socket.create_connection((addr, port), timeout=2).close()
    except ConnectionRefusedError:
        return False
    return True


@pytest.mark.parametrize("addr", ["127.0.0.2", "localhost"])
def test_the_store_listens_on_the_nodes_address_only(addr: str) -> None:
    port = free_port("")
    with listen_on(addr, port) as sock:
        bound = sock.getsockname()[0]
        assert bound in ("127.0.0.2", "127.0.0.1"), bound
        other = "127.0.0.1" if bound == "127.0.0.2" else "127.0.0.2"
        assert accepts(bound, port)
        assert not accepts(other, port)


def test_a_host_name_that_resolves_to_loopback_listens_everywhere(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = socket.getaddrinfo

    def debian_hosts(host: Any, *args: Any, **kwargs: Any) -> Any:
        return real("127.0.1.1" if host == "node-7.example" else host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", debian_hosts)
    port = free_port("")
    with listen_on("node-7.example", port):
        assert accepts("127.0.0.1", port) and accepts("127.0.0.2", port)
    assert "--local-addr" in caplog.text
