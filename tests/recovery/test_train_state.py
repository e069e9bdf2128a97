"""TrainState (elastic.worker.state): the one writer of a Run's counters, loss and the
user's objects; its moves, and its state dicts round-tripping every field."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler as TorchDistributedSampler

from elastic.errors import RecoveryError
from elastic.worker.sampler import DistributedSampler
from elastic.worker.state import TrainState


def _state(sampler: object = None) -> TrainState:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return TrainState(model, opt, sched, sampler)


@pytest.mark.parametrize(
    ("moves", "expected"),
    [
        ([("advance", 8), ("advance", 8)], (2, 0, 16)),
        ([("advance", 8), ("begin_epoch", 1)], (1, 1, 0)),
        ([("begin_epoch", 2), ("advance", 0), ("roll_over", 3)], (1, 3, 0)),  # prev epoch
        ([("begin_epoch", 4), ("advance", 4), ("roll_over", 3)], (1, 4, 4)),  # newer stands
    ],
)
def test_the_loops_moves(moves: list[tuple[str, int]], expected: tuple[int, int, int]) -> None:
    state = _state()
    for name, arg in moves:
        getattr(state, name)(arg)
    assert (state.step, state.epoch, state.consumed) == expected


def test_an_older_epoch_is_refused() -> None:
    state = _state()
    with pytest.raises(RecoveryError, match="repeat epochs"):
        state.roll_over(2)


def test_the_loss_is_summed_taken_once_and_agreed() -> None:
    state = _state()
    state.log_loss(2.0, weight=2)
    state.log_loss(torch.tensor(1.0))
    assert state.take_loss() == (5.0, 3.0) and state.take_loss() == (0.0, 0.0)
    assert state.loss is None
    state.agreed_loss(1.5)
    assert state.loss == 1.5


def test_a_state_dict_puts_every_field_back() -> None:
    data = list(range(10))
    state = _state(TorchDistributedSampler(data, num_replicas=2, rank=0, shuffle=False))
    assert isinstance(state.sampler, DistributedSampler), "torch's gets an exact resume point"
    state.begin_epoch(1, 4)
    state.advance(2)
    state.optimizer.step()
    state.scheduler.step()
    saved = state.state_dict(world_size=2)
    assert saved["train"] == {"step": 1, "epoch": 1, "consumed": 6, "world_size": 2}
    other = _state(TorchDistributedSampler(data, num_replicas=2, rank=0, shuffle=False))
    other.load_state_dict(saved)
    assert (other.step, other.epoch, other.consumed) == (1, 1, 6)
    assert other.scheduler.state_dict() == state.scheduler.state_dict()
    for a, b in zip(other.model.parameters(), state.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_rewind_puts_the_buffers_and_counters_back() -> None:
    model = torch.nn.BatchNorm1d(2)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    kept = {b.data_ptr(): b.detach().clone() for b in model.buffers() if b.numel()}
    extra = state.extra(world_size=1)
    model(torch.randn(4, 2))  # a step that failed moved the running statistics
    state.advance(4)
    state.rewind(kept, extra)
    assert state.step == 0 and torch.equal(model.running_mean, torch.zeros(2))
