"""One training step with a constant global batch, whatever the world size.

Each global batch is cut into fixed micro-batches defined globally (see
:mod:`elastic_tools.training.sampler`); rank ``r`` computes micro-batches ``r, r+W, r+2W, ...``.
Every micro-batch loss is the mean over its samples, scaled by ``W / M`` (``M``
micro-batches per step, ``W`` ranks). DDP averages gradients over ``W``, so the
applied gradient is ``sum_j grad(loss_j) / M``: the gradient of the mean loss
over the global batch, independent of ``W``. Only each rank's last micro-batch
synchronizes; the others run under ``no_sync``. BatchNorm running statistics are
made world-size free by :class:`elastic_tools.training.model.BatchNormStats`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import Dataset

from elastic_tools.training.config import OptimizerConfig
from elastic_tools.training.data import collate
from elastic_tools.training.model import BatchNormStats
from elastic_tools.training.sampler import Cursor, ElasticSampler


def build_optimizer(cfg: OptimizerConfig, model: nn.Module) -> torch.optim.Optimizer:
    """Build SGD (with momentum) or AdamW over the model's parameters."""
    if cfg.name == "sgd":
        return torch.optim.SGD(
            model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
    return torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
    )


def lr_lambda(
    cfg: OptimizerConfig, total_steps: int, world_size: int | Callable[[], int]
) -> Callable[[int], float]:
    """Return step -> LR multiplier: scaling rule x linear warmup x cosine/step/constant decay.

    ``world_size`` may be a callable: the scaling then follows a group that re-forms in place.
    """
    size = world_size if callable(world_size) else (lambda: world_size)

    def scaled() -> float:
        ratio = size() / cfg.reference_world_size
        return {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[cfg.lr_scaling]

    floor = cfg.min_lr / cfg.lr

    def factor(step: int) -> float:
        scale = scaled()
        if step < cfg.warmup_steps:
            return scale * (step + 1) / cfg.warmup_steps
        if cfg.schedule == "cosine":
            span = max(1, total_steps - cfg.warmup_steps)
            progress = min(1.0, (step - cfg.warmup_steps) / span)
            return scale * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
        if cfg.schedule == "step":
            return scale * cfg.gamma ** ((step - cfg.warmup_steps) // cfg.step_size)
        return scale

    return factor


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    cfg: OptimizerConfig,
    total_steps: int,
    world_size: int | Callable[[], int],
) -> LambdaLR:
    """Build the LR schedule (``LambdaLR``; its state holds the step count)."""
    return LambdaLR(optimizer, lr_lambda(cfg, total_steps, world_size))


@dataclass(frozen=True)
class StepResult:
    """What one step did on this rank: its loss sum, its samples, the sampler's next cursor."""

    loss: float  # the mean over this rank's samples
    samples: int
    cursor: Cursor


def _plain_all_reduce(tensor: torch.Tensor) -> bool:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor)
    return True


class Trainer:
    """Runs global-batch steps over ``sampler`` with gradient accumulation.

    ``rank``/``world_size`` are this rank's place for the next step (they change when the
    group re-forms in place); ``all_reduce`` sums a tensor over the group (our worker gives
    :meth:`elastic.Run.all_reduce`, which a lost peer cannot hang).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: LambdaLR,
        dataset: Dataset[tuple[torch.Tensor, int]],
        sampler: ElasticSampler,
        device: torch.device,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.dataset = dataset
        self.sampler = sampler
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.bn = BatchNormStats(model)
        self.all_reduce: Callable[[torch.Tensor], bool] = _plain_all_reduce

    def step(self, cursor: Cursor) -> StepResult:
        """Run one optimizer step on the global batch at ``cursor``."""
        indices, after = self.sampler.global_batch(cursor)
        mine = self.sampler.for_rank(indices, self.rank, self.world_size)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        self.bn.begin_step()
        loss_sum = torch.zeros((), dtype=torch.float64)
        for i, micro in enumerate(mine):
            loss_sum += self._micro_step(micro, last=i == len(mine) - 1)
        self.bn.end_step(self.sampler.micro_batches_per_step, self.all_reduce)
        self.optimizer.step()
        self.scheduler.step()
        samples = sum(len(m) for m in mine)
        return StepResult(loss=float(loss_sum) / max(samples, 1), samples=samples, cursor=after)

    def _micro_step(self, micro: torch.Tensor, last: bool) -> torch.Tensor:
        images, labels = collate(self.dataset, micro)
        images, labels = images.to(self.device), labels.to(self.device)
        self.bn.before_micro_batch()
        no_sync = getattr(self.model, "no_sync", None)  # DDP's; a plain module has none
        sync = nullcontext() if last or no_sync is None else no_sync()
        with sync:
            loss = F.cross_entropy(self.model(images), labels)
            (loss * self.world_size / self.sampler.micro_batches_per_step).backward()
        self.bn.after_micro_batch()
        return loss.detach().double().cpu() * len(micro)


__all__ = ["StepResult", "Trainer", "build_optimizer", "build_scheduler", "lr_lambda"]
