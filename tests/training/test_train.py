"""Units of the training step: LR schedule, step budget, BatchNorm statistics."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from elastic_tools.training.config import OptimizerConfig, load_config
from elastic_tools.training.model import BatchNormStats
from elastic_tools.training.sampler import ElasticSampler
from elastic_tools.training.train import lr_lambda
from elastic_tools.training.worker import total_steps


def test_lr_warmup_then_cosine_to_floor() -> None:
    f = lr_lambda(OptimizerConfig(lr=0.1, min_lr=0.01, warmup_steps=4), 104, world_size=2)
    assert [f(s) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert f(54) == pytest.approx(0.1 + 0.9 * 0.5)
    assert f(104) == pytest.approx(0.1)


@pytest.mark.parametrize(("rule", "expected"), [("none", 1.0), ("linear", 4.0), ("sqrt", 2.0)])
def test_lr_scaling_rules(rule: str, expected: float) -> None:
    cfg = OptimizerConfig(schedule="step", step_size=10, gamma=0.5, lr_scaling=rule)
    f = lr_lambda(cfg, 100, world_size=4)
    assert f(0) == pytest.approx(expected) and f(10) == pytest.approx(expected / 2)


def test_epochs_cap_the_step_budget() -> None:
    cfg = load_config(
        None,
        [
            "job.max_steps=1000",
            "job.max_epochs=2",
            "data.num_samples=100",
            "data.global_batch_size=24",
            "data.micro_batch_size=4",
        ],
        environ={},
    )
    sampler = ElasticSampler(100, 24, 4, 0)
    assert total_steps(cfg, sampler) == 8


def test_batchnorm_update_is_the_mean_over_micro_batches() -> None:
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(3, momentum=0.1)
    bn.running_mean.fill_(0.5)
    stats = BatchNormStats(nn.Sequential(bn))
    micro = [torch.randn(4, 3, 5, 5) * (j + 1) + j for j in range(3)]
    stats.begin_step()
    for x in micro:
        stats.before_micro_batch()
        bn(x)
        stats.after_micro_batch()
    stats.end_step(len(micro))
    means = torch.stack([x.mean((0, 2, 3)) for x in micro]).mean(0)
    varis = torch.stack([x.var((0, 2, 3), unbiased=True) for x in micro]).mean(0)
    torch.testing.assert_close(bn.running_mean, 0.9 * 0.5 + 0.1 * means)
    torch.testing.assert_close(bn.running_var, 0.9 * 1.0 + 0.1 * varis)
    assert int(bn.num_batches_tracked) == 1
    assert not math.isnan(float(bn.running_var.sum()))
