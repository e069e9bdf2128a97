"""Probe ports: a refused connection is certain death, anything else is not."""

from __future__ import annotations

import contextlib
import socket

from elastic.rendezvous.liveness import DeathDetector, ProbeListener, probe


def test_a_listening_agent_is_alive_and_a_closed_one_refuses() -> None:
    listener = ProbeListener("127.0.0.1")
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
        assert False not in answers, "a node that does not answer must never be judged dead"
    finally:
        for s in filler:
            s.close()
        silent.close()


def test_detector_reports_only_refusals_and_reads_ports_lazily() -> None:
    alive = ProbeListener("127.0.0.1")
    gone = ProbeListener("127.0.0.1")
    ports = {"alive": alive.port, "gone": gone.port}
    gone.close()
    reads: list[int] = []

    def lookup() -> dict[str, int]:
        reads.append(1)
        return ports

    detector = DeathDetector(lookup)
    nodes = [("alive", "127.0.0.1"), ("gone", "127.0.0.1"), ("unpublished", "127.0.0.1")]
    assert detector.dead(nodes) == ["gone"]
    assert detector.dead([("alive", "127.0.0.1")]) == []
    assert len(reads) == 1, "a known port is not read from etcd again"
    assert detector.dead([("unpublished", "127.0.0.1")]) == []
    assert len(reads) == 1, "a node without an answer is asked again only after a pause"
    alive.close()
