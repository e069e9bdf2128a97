"""A hung etcd (SIGSTOP: it accepts connections and never answers) is given up at
``outage_timeout``, with one sentence, not after a request's whole ``request_timeout``
on top of it (issue 26, item 6: 20 s set, etcd frozen 90 s, the agent still waited)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from elastic.errors import EtcdConnectionError
from elastic.etcd.server import EtcdServer
from tests.rendezvous.test_announce import Nodes, join_all

OUTAGE_S = 4.0


def test_a_frozen_etcd_is_given_up_at_outage_timeout(own_etcd: EtcdServer, run_id: str) -> None:
    """request_timeout (30 s, the default) longer than outage_timeout (4 s)."""
    assert own_etcd.proc is not None
    nodes = Nodes(own_etcd, run_id, "1:1", request_timeout="30", outage_timeout=str(OUTAGE_S))
    try:
        (handler,) = nodes.add(1)
        join_all([handler])
        assert handler.membership_change() is None
        os.kill(own_etcd.proc.pid, signal.SIGSTOP)
        frozen = time.monotonic()
        try:
            with pytest.raises(EtcdConnectionError) as err:
                while time.monotonic() - frozen < 60:
                    handler.membership_change()
                    time.sleep(0.1)
            gave_up = time.monotonic() - frozen
        finally:
            os.kill(own_etcd.proc.pid, signal.SIGCONT)
        message = str(err.value)
        assert f"outage_timeout={OUTAGE_S:.0f} s" in message and message.count(". ") == 0
        # the outage counts from etcd's last answer; a keep-alive interval of slack
        assert gave_up < OUTAGE_S + 6, f"gave up after {gave_up:.1f} s"
    finally:
        nodes.close()
