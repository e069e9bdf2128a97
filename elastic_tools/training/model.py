"""Models: any torchvision classifier by name, plus BatchNorm statistics kept world-size free.

BatchNorm and elastic micro-batching
------------------------------------
Each micro-batch is normalized with its own batch statistics (train mode), so
the forward pass of a micro-batch is the same whatever rank computes it. The
running statistics would still depend on the world size, because each rank
would fold only its own micro-batches into its buffers, in its own order.
:class:`BatchNormStats` removes that dependence: before every micro-batch it
restores the buffers to their value at the start of the step, collects the
update that micro-batch would make, and at the end of the step all-reduces the
updates and applies their mean. The result is, on every rank and for every
world size, ``running = (1 - m) * running + m * mean_j(stat_j)`` over the step's
micro-batches ``j``: one momentum update per optimizer step with the mean of
the micro-batch statistics. ``num_batches_tracked`` grows by one per step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
import torchvision
from torch import nn

from elastic_tools.training.config import ModelConfig

logger = logging.getLogger(__name__)


def tiny_cnn(num_classes: int) -> nn.Module:
    """A four-layer CNN with BatchNorm: quick enough for multi-process tests on CPU."""

    def block(cin: int, cout: int) -> list[nn.Module]:
        return [
            nn.Conv2d(cin, cout, 3, padding=1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
        ]

    return nn.Sequential(
        *block(3, 16),
        nn.MaxPool2d(2),
        *block(16, 32),
        nn.MaxPool2d(2),
        *block(32, 32),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, num_classes),
    )


def build_model(cfg: ModelConfig) -> nn.Module:
    """Build the configured model with freshly initialized weights (seed torch first)."""
    if cfg.name == "tiny_cnn":
        return tiny_cnn(cfg.num_classes)
    model = torchvision.models.get_model(cfg.name, weights=None, num_classes=cfg.num_classes)
    if cfg.small_input:
        _small_input_stem(model, cfg.name)
    return model


def _small_input_stem(model: nn.Module, name: str) -> None:
    """Use a 3x3 stride-1 stem without max-pool (the usual CIFAR variant of ResNet)."""
    conv = getattr(model, "conv1", None)
    if not isinstance(conv, nn.Conv2d) or not hasattr(model, "maxpool"):
        logger.warning(
            "model.small_input has no effect on %s: it applies to ResNet-style "
            "models with conv1 and maxpool",
            name,
        )
        return
    model.conv1 = nn.Conv2d(conv.in_channels, conv.out_channels, 3, 1, 1, bias=False)
    model.maxpool = nn.Identity()


# torch's public batch-norm layers (their common base class is private)
BatchNorm = nn.BatchNorm1d | nn.BatchNorm2d | nn.BatchNorm3d | nn.SyncBatchNorm


def _stats(m: BatchNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """The running mean and variance of a layer that tracks them."""
    assert m.running_mean is not None and m.running_var is not None
    return m.running_mean, m.running_var


def _batches(m: BatchNorm) -> torch.Tensor:
    assert m.num_batches_tracked is not None
    return m.num_batches_tracked


class BatchNormStats:
    """Makes BatchNorm running statistics independent of how micro-batches are dealt."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = [
            m for m in model.modules() if isinstance(m, BatchNorm) and m.track_running_stats
        ]
        self._start: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._tracked: list[torch.Tensor | None] = []
        self._delta: list[tuple[torch.Tensor, torch.Tensor]] = []

    def begin_step(self) -> None:
        """Remember the buffers as they are at the start of the step."""
        self._start = [(mean.clone(), var.clone()) for mean, var in map(_stats, self.layers)]
        self._tracked = [
            None if m.num_batches_tracked is None else m.num_batches_tracked.clone()
            for m in self.layers
        ]
        self._delta = [(torch.zeros_like(a), torch.zeros_like(b)) for a, b in self._start]

    def before_micro_batch(self) -> None:
        """Reset the buffers to the step's start values."""
        for m, (mean, var) in zip(self.layers, self._start, strict=True):
            running_mean, running_var = _stats(m)
            running_mean.copy_(mean)
            running_var.copy_(var)
        for m, tracked in zip(self.layers, self._tracked, strict=True):
            if tracked is not None:
                _batches(m).copy_(tracked)

    def after_micro_batch(self) -> None:
        """Add this micro-batch's update to the step's sum of updates."""
        for m, (mean, var), (dm, dv) in zip(self.layers, self._start, self._delta, strict=True):
            running_mean, running_var = _stats(m)
            dm.add_(running_mean - mean)
            dv.add_(running_var - var)

    @torch.no_grad()
    def end_step(
        self, micro_batches: int, all_reduce: Callable[[torch.Tensor], bool] | None = None
    ) -> None:
        """Apply the mean update over all ``micro_batches`` of the step, on every rank
        (``all_reduce`` sums over the group; default: the default group's)."""
        if not self.layers:
            return
        flat = torch.cat([t.flatten() for pair in self._delta for t in pair])
        if all_reduce is not None:
            all_reduce(flat)
        elif dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flat)
        flat /= micro_batches
        offset = 0
        for m, (mean, var) in zip(self.layers, self._start, strict=True):
            for buf, start in zip(_stats(m), (mean, var), strict=True):
                n = buf.numel()
                buf.copy_(start + flat[offset : offset + n].view_as(buf))
                offset += n
        for m, tracked in zip(self.layers, self._tracked, strict=True):
            if tracked is not None:
                _batches(m).copy_(tracked + 1)


__all__ = ["BatchNormStats", "build_model", "tiny_cnn"]
