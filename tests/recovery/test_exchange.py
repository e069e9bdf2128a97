"""Agreeing on the newest state and streaming it between gloo processes on localhost."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elastic import events
from elastic.worker.exchange import Offer, decide, newest
from tests.helpers import REPO


def test_the_newest_held_step_wins_and_the_lowest_holder_sends() -> None:
    plan = decide([(5, 1), (7, 2), None, (7, 2)], persisted=4)
    assert (plan.source, plan.step, plan.src_rank, plan.holders) == ("memory", 7, 1, (1, 3))
    assert plan.needs_stream and plan.receivers == 2


def test_same_step_of_another_round_is_not_the_same_state() -> None:
    plan = decide([(7, 1), (7, 2)], persisted=-1)
    assert plan.holders == (1,) and plan.src_rank == 1


def test_storage_only_when_nobody_holds_a_state_as_new_as_the_persisted_one() -> None:
    assert decide([(4, 0), None], persisted=4).source == "memory"
    assert decide([(3, 0), None], persisted=4).source == "storage"
    assert decide([None, None], persisted=4).source == "storage"
    assert decide([None, None], persisted=-1).source == "fresh"
    assert not decide([(4, 0), (4, 0)], persisted=-1).needs_stream


def test_every_rank_live_on_the_same_state_moves_nothing() -> None:
    plan = newest([Offer((7, 2), (5, 2)), Offer((7, 2), None)])
    assert (plan.source, plan.step, plan.round, plan.writers) == ("live", 7, 2, ())


def test_the_newest_live_state_is_written_then_served() -> None:
    """A joiner (no live state) and a thawed rank (older live state) receive the survivors'
    newest live state; the thawed rank's own snapshot is not offered."""
    offers = [Offer((9, 6), (8, 6)), Offer((4, 5), (4, 5)), Offer(None, None), Offer((9, 6))]
    plan = newest(offers)
    assert (plan.source, plan.step, plan.round) == ("memory", 9, 6)
    assert plan.writers == (0, 3) and plan.holders == (0, 3) and plan.src_rank == 0


def test_one_ordering_the_most_steps_first_then_the_newer_round() -> None:
    """(step, round): a higher step of an older round beats a newer round that went back;
    between two copies of one step the newer round's wins."""
    assert newest([Offer((12, 5)), Offer((10, 6))]).step == 12
    assert newest([Offer(None, (12, 5)), Offer(None, (10, 6))]).step == 12
    plan = newest([Offer((10, 5)), Offer((10, 6))])
    assert (plan.step, plan.round, plan.writers) == (10, 6, (1,))
    assert decide([(12, 5), (10, 6)], -1).step == 12  # the same ordering for snapshots


def test_storage_wins_over_older_live_states() -> None:
    plan = newest([Offer((3, 1), persisted=8), Offer((2, 1))])
    assert (plan.source, plan.step, plan.writers) == ("storage", 8, ())


def _equal(a: dict, b: dict) -> bool:
    assert a.keys() == b.keys()
    return all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else _equal(a[k], b[k]) for k in a
    )


@pytest.mark.slow
def test_three_ranks_memory_peer_then_storage(tmp_path: Path) -> None:
    world = 3
    environ = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        events.env.EVENT_LOG: str(tmp_path / "events.jsonl"),
        "OMP_NUM_THREADS": "1",
    }
    script = str(Path(__file__).with_name("exchange_worker.py"))
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(r), str(world), str(tmp_path)],
            env=environ,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=240)[0])
        finally:
            if proc.poll() is None:
                proc.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)

    def load(name: str) -> dict:
        return torch.load(tmp_path / name, weights_only=False)

    trained = load("r1-step6.pt")
    assert trained["step"] == 6
    for r in range(world):
        got = load(f"r{r}-peer.pt")
        assert got["step"] == 6 and got["lr"] == trained["lr"]
        assert got["source"] == ("memory" if r == 1 else "peer")
        assert _equal(got["model"], trained["model"]), f"rank {r}: model differs"
        assert _equal(got["optim"], trained["optim"]), f"rank {r}: optimizer state differs"
        # DCP writes one copy of replicated tensors, each from some rank: BatchNorm
        # buffers (different on each rank under plain DDP) may mix ranks
        stored = load(f"r{r}-storage.pt")
        assert stored["step"] == 4 and stored["source"] == "storage"
        params = {k: v for k, v in stored["model"].items() if "running" not in k}
        at4 = [load(f"r{q}-step4.pt")["model"] for q in range(world)]
        assert _equal(params, {k: at4[0][k] for k in params})

    resumes = events.read(tmp_path / "events.jsonl", "recovery.resume")
    peer = [e for e in resumes if e["source"] == "peer"]
    assert len(peer) == 2 and all(e["bytes"] > 0 for e in peer)
    loads = events.read(tmp_path / "events.jsonl", "ckpt.load")
    # the storage was read exactly once per rank: in phase 3
    assert len([e for e in loads if "source" not in e]) == world


def _pair(tmp_path: Path, case: str, secrets: tuple[bytes | None, bytes | None]) -> str:
    """Run sender (rank 0) and receiver (rank 1) of stream_peer.py; the receiver's output."""
    script = str(Path(__file__).with_name("stream_peer.py"))
    procs = []
    for rank, secret in enumerate(secrets):
        environ = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        environ.pop("ELASTIC_SECRET_FILE", None)
        # A local run without a secret file makes one per host: the same for both ranks.
        environ["XDG_CONFIG_HOME"] = str(tmp_path / "home")
        if secret is not None:
            path = tmp_path / f"secret{rank}"
            path.write_bytes(secret)
            path.chmod(0o600)
            environ["ELASTIC_SECRET_FILE"] = str(path)
        cmd = [sys.executable, script, str(rank), str(tmp_path / f"store-{case}"), case]
        procs.append(subprocess.Popen(cmd, env=environ, stdout=subprocess.PIPE, text=True))
    out = [p.communicate(timeout=120)[0] for p in procs]
    assert procs[1].returncode == 0, out
    return out[1].strip().splitlines()[-1]


@pytest.mark.integration
@pytest.mark.integration  # two gloo processes
@pytest.mark.parametrize(
    ("case", "secrets", "expected"),
    [
        ("state", (b"s" * 32, b"s" * 32), "OK"),  # same secret: authenticated
        ("state", (None, None), "OK"),  # a local run: the host's own secret
        ("state", (b"x" * 32, b"s" * 32), "REFUSED: The state rank 0 sent is not signed"),
        ("state", (None, b"s" * 32), "REFUSED: The state rank 0 sent is not signed"),
        ("huge", (None, None), "REFUSED: Rank 0 announced a state of"),
        ("offer", (None, None), "REFUSED: Rank 0 offered an impossible state"),
    ],
)
def test_a_peer_cannot_push_forged_or_oversized_state(
    tmp_path: Path, case: str, secrets: tuple[bytes | None, bytes | None], expected: str
) -> None:
    assert _pair(tmp_path, case, secrets).startswith(expected)


@pytest.mark.integration  # two gloo processes
def test_a_stream_whose_source_moved_on_ends_when_the_guard_is_aborted(tmp_path: Path) -> None:
    """The source rank stays in the old group but never sends (it went on to a newer
    round): the receiver's stream is released by its step guard's abort, as the agent's
    newer round does, instead of waiting out the group's timeout (30 s here; minutes in a
    job) while its peers wait in the newer round's formation for it."""
    out = _pair(tmp_path, "abandoned", (None, None))
    assert out.startswith("INTERRUPTED"), out
    assert float(out.split()[1]) < 10.0, out
