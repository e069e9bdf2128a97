"""Probe ports: a refused connection is certain death, anything else is not."""

from __future__ import annotations

import contextlib
import errno
import socket

import pytest

from elastic.rendezvous.liveness import DeathDetector, ProbeListener, probe
from tests.helpers import wait_until


def test_a_listening_agent_is_alive_and_a_closed_one_refuses() -> None:
    listener = ProbeListener()
    port = listener.port
    assert probe("127.0.0.1", port) is True
    assert probe("127.0.0.1", port) is True, "the listener keeps accepting"
    listener.close()
    assert probe("127.0.0.1", port) is False


def test_no_answer_is_unknown_not_dead() -> None:
    # A listening socket whose backlog is full and that never accepts gives no answer
    # (its SYNs are dropped), as a node behind a cut link does.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(0)
    filler = []
    for _ in range(3):
        s = socket.socket()
        s.settimeout(0.2)
        with contextlib.suppress(OSError):
            s.connect(silent.getsockname())
        filler.append(s)
    try:
        host, port = silent.getsockname()
        answers = {probe(host, port, timeout=0.2) for _ in range(3)}
        assert answers == {None}, "no answer is unknown, never dead"
    finally:
        for s in filler:
            s.close()
        silent.close()


def test_detector_trusts_a_refusal_only_from_a_port_that_accepted_before() -> None:
    alive, gone, never = ProbeListener(), ProbeListener(), ProbeListener()
    ports = {"alive": alive.port, "gone": gone.port, "never": never.port}
    never.close()  # refuses from the start: a wrong address or a firewall, not a death
    reads: list[int] = []

    def lookup() -> dict[str, int]:
        reads.append(1)
        return dict(ports)

    detector = DeathDetector(lookup)
    nodes = [("alive", "127.0.0.1"), ("gone", "127.0.0.1"), ("never", "127.0.0.1")]
    detector.verify(nodes)
    gone.close()
    assert detector.dead(nodes) == ["gone"]
    assert detector.dead([("alive", "127.0.0.1")]) == [], "a listening agent is not dead"
    alive.close()


def test_a_node_restarted_under_the_same_name_is_probed_on_its_new_port() -> None:
    old, new = ProbeListener(), ProbeListener()
    ports = {"n": old.port}
    detector = DeathDetector(lambda: dict(ports))
    detector.verify([("n", "127.0.0.1")])
    old.close()
    ports["n"] = new.port  # the new incarnation published its port
    assert detector.dead([("n", "127.0.0.1")]) == [], "the live new incarnation is not dead"
    new.close()


def test_an_unreachable_etcd_makes_answers_unknown_not_an_error() -> None:
    def broken() -> dict[str, int]:
        raise RuntimeError("etcd is down")

    assert DeathDetector(broken).dead([("n", "127.0.0.1")]) == []


class _FailsOnce:
    """A listening socket whose first accept fails, as when out of file descriptors."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock, self.failed = sock, False

    def accept(self) -> tuple[socket.socket, object]:
        if not self.failed:
            self.failed = True
            raise OSError(errno.EMFILE, "Too many open files")
        return self._sock.accept()

    def __getattr__(self, name: str) -> object:
        return getattr(self._sock, name)


def test_the_listener_survives_a_failed_accept(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import elastic.rendezvous.liveness as liveness

    real = liveness._bind_everywhere
    monkeypatch.setattr(liveness, "_bind_everywhere", lambda: _FailsOnce(real()))
    listener = ProbeListener()
    try:
        wait_until(lambda: "failed to accept" in caplog.text, 5, "the failed accept's warning")
        for _ in range(3):
            assert probe("127.0.0.1", listener.port) is True
        assert listener._thread.is_alive(), "the listener must keep serving"
    finally:
        listener.close()


def test_a_recheck_probes_again_a_node_that_accepted_a_moment_ago() -> None:
    # A killed agent's port may still accept for a few milliseconds; the node that waits
    # on it asks again (recheck) instead of trusting that answer for half a second.
    listener = ProbeListener()
    detector = DeathDetector(lambda: {"n": listener.port})
    node = [("n", "127.0.0.1")]
    detector.verify(node)
    assert detector.dead(node) == [], "it accepts"
    listener.close()
    assert detector.dead(node) == [], "without a recheck, the answer of a moment ago stands"
    assert detector.dead(node, recheck={"n"}) == ["n"]


def test_a_suspect_that_still_accepts_is_probed_again_soon_after_a_wake_up() -> None:
    # A killed agent's port accepts until its process is torn down: the closer, woken
    # because a survivor asked for a new round, probes it again every 50 ms for a second,
    # and only then falls back to the tick.
    from elastic.rendezvous.announce.keeper import (
        SUSPECT_REPROBE_S,
        SUSPECT_WINDOW_S,
        probe_wait,
    )

    woken = 100.0
    fast_until = woken + SUSPECT_WINDOW_S
    assert probe_wait(1.0, True, fast_until, woken + 0.01) == SUSPECT_REPROBE_S
    assert probe_wait(1.0, True, fast_until, fast_until - 0.01) == pytest.approx(0.01)
    assert probe_wait(1.0, True, fast_until, fast_until + 0.01) == 1.0  # the window passed
    assert probe_wait(1.0, False, fast_until, woken + 0.01) == 1.0  # no suspect accepted
