"""A member that hangs (SIGSTOP: no error, no answer) is given up after ATTEMPT_S, not
after the whole request timeout: the others answer, and leases on them stay alive."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from elastic.etcd import client as etcd_client
from elastic.etcd.client import EtcdClient, EtcdOptions, parse_endpoints
from elastic.etcd.server import start_cluster


@pytest.mark.integration
def test_a_frozen_member_is_given_up_quickly(tmp_path: Path) -> None:
    members = start_cluster(tmp_path / "cluster", 3)
    frozen = members[0]
    try:
        endpoints = parse_endpoints(",".join(m.endpoint for m in members))[0]
        client = EtcdClient(EtcdOptions(endpoints, request_timeout=30.0))
        client.put(b"/t/warm", b"1")  # connected, to the first endpoint
        assert frozen.proc is not None
        os.kill(frozen.proc.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            client.put(b"/t/k", b"v")
            took = time.monotonic() - started
        finally:
            os.kill(frozen.proc.pid, signal.SIGCONT)
        assert took < 3 * etcd_client.ATTEMPT_S + 1, f"a put waited {took:.1f} s on a frozen member"
        assert client.range(b"/t/k").kvs[0].value == b"v"
        client.close()
    finally:
        for m in members:
            m.stop()
