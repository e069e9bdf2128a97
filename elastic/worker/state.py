"""A Run's training state: the counters, the last loss and the user's objects, one owner.

:class:`TrainState` holds step, epoch, consumed samples, the group's last loss, and the
user's model, optimizer, scheduler and sampler, with the state dicts of all of them (a
snapshot's, :meth:`TrainState.state_dict`; a persisted checkpoint's,
:meth:`TrainState.persist_state`). It is the only writer of those fields: the loop moves them
on (:meth:`TrainState.advance`, :meth:`TrainState.begin_epoch`), a resume puts them back
(:meth:`TrainState.load_state_dict`, :meth:`TrainState.load_extra`), and every other part of
the worker reads them.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import DistributedSampler as _TorchDistributedSampler

from elastic.errors import RecoveryError
from elastic.worker.codec import to_json
from elastic.worker.sampler import DistributedSampler


class TrainState:
    """The training state of one rank (see the module)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        sampler: Any = None,
    ) -> None:
        self._model, self._optimizer, self._scheduler = model, optimizer, scheduler
        self._sampler = exact(sampler)
        self._step, self._epoch, self._consumed = 0, 0, 0
        self._sums = torch.zeros(2, dtype=torch.float64)  # this step's loss (sum, weight)
        self._loss: float | None = None

    # -- what the others read ----------------------------------------------------------------

    @property
    def step(self) -> int:
        return self._step

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def consumed(self) -> int:
        """Samples of the current epoch the group consumed."""
        return self._consumed

    @property
    def loss(self) -> float | None:
        """The group's mean loss of the last step (None until the group agreed on it)."""
        return self._loss

    @property
    def model(self) -> torch.nn.Module:
        return self._model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    @property
    def scheduler(self) -> Any:
        return self._scheduler

    @property
    def sampler(self) -> Any:
        return self._sampler

    # -- the loop's moves ----------------------------------------------------------------------

    def advance(self, samples: int = 0) -> int:
        """One step done, ``samples`` consumed by the group in it; the new step."""
        self._consumed += samples
        self._step += 1
        return self._step

    def begin_epoch(self, epoch: int, consumed: int = 0) -> None:
        """The counters are at ``epoch``, ``consumed`` samples into it."""
        self._epoch, self._consumed = epoch, consumed

    def roll_over(self, loop_epoch: int) -> None:
        """After a state was agreed on inside epoch ``loop_epoch``: :func:`rolled_over`."""
        self._epoch, self._consumed = rolled_over(
            self._epoch, self._consumed, loop_epoch, self._step
        )

    def adopt_sampler(self, sampler: Any) -> None:
        """The loader's sampler, when none was given."""
        if self._sampler is None:
            self._sampler = exact(sampler)

    def set_epoch(self, epoch: int) -> None:
        """Tell the sampler the epoch (one with ``set_epoch``)."""
        if self._sampler is not None and hasattr(self._sampler, "set_epoch"):
            self._sampler.set_epoch(epoch)

    def deal(self) -> None:
        """Our exact sampler deals the current epoch from the consumed position."""
        if isinstance(self._sampler, DistributedSampler):
            self._sampler.set_epoch(self._epoch)
            self._sampler.consumed = self._consumed

    def reshard(self, rank: int, world_size: int) -> None:
        """The sampler's share in a new group (one with ``num_replicas``)."""
        if self._sampler is not None and hasattr(self._sampler, "num_replicas"):
            self._sampler.num_replicas, self._sampler.rank = world_size, rank

    # -- the loss ------------------------------------------------------------------------------

    def log_loss(self, value: float | torch.Tensor, weight: float = 1.0) -> None:
        self._sums[0] += float(value) * weight
        self._sums[1] += weight

    def take_loss(self) -> tuple[float, float]:
        """This rank's ``(sum, weight)`` of the step's loss, cleared for the next step."""
        sums = (float(self._sums[0]), float(self._sums[1]))
        self._sums.zero_()
        return sums

    def agreed_loss(self, mean: float | None) -> None:
        """The group's mean loss of the step (None: not agreed yet, or not at all)."""
        self._loss = mean

    # -- the state dicts -----------------------------------------------------------------------

    def state_dict(self, world_size: int) -> dict[str, Any]:
        """The training state that snapshots hold (tensors are not copied)."""
        return {
            "model": self._model.state_dict(),
            "optim": self._optimizer.state_dict(),
            **self.extra(world_size),
        }

    def extra(self, world_size: int) -> dict[str, Any]:
        """Everything but the model and optimizer: counters, RNG, schedule, sampler."""
        extra: dict[str, Any] = {
            "train": {
                "step": self._step,
                "epoch": self._epoch,
                "consumed": self._consumed,
                "world_size": world_size,
            },
            "rng": _rng_state(),
        }
        if self._scheduler is not None:
            extra["scheduler"] = self._scheduler.state_dict()
        if self._sampler is not None and hasattr(self._sampler, "state_dict"):
            extra["sampler"] = self._sampler.state_dict()
        return extra

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._model.load_state_dict(state["model"])
        self._optimizer.load_state_dict(state["optim"])
        self.load_extra(state)

    def load_extra(self, state: Mapping[str, Any]) -> None:
        train = state["train"]
        self._step, self._epoch = int(train["step"]), int(train["epoch"])
        self._consumed = int(train["consumed"])
        if self._scheduler is not None and "scheduler" in state:
            self._scheduler.load_state_dict(state["scheduler"])
        if self._sampler is not None and "sampler" in state:
            self._sampler.load_state_dict(state["sampler"])
        _set_rng_state(state["rng"])

    def persist_state(self, world_size: int) -> dict[str, Any]:
        """The state a checkpoint holds (DCP's sharded model and optimizer dicts)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self._model, self._optimizer)
        return {"model": model_sd, "optim": optim_sd, "extra": to_json(self.extra(world_size))}

    def load_persisted(self, state: Mapping[str, Any], extra: Mapping[str, Any] | None) -> None:
        """Load a checkpoint's model and optimizer (DCP's dicts) and, given, its ``extra``."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self._model,
            self._optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        if extra is not None:
            self.load_extra(extra)

    def rewind(self, buffers: Mapping[int, torch.Tensor] | None, extra: Mapping[str, Any]) -> None:
        """Back to a step boundary: the model's buffers kept there (by data pointer) and its
        ``extra`` (counters, RNG, schedule, sampler)."""
        if buffers:
            for buf in self._model.buffers():
                kept = buffers.get(buf.data_ptr())
                if kept is not None:
                    buf.data.copy_(kept)
        self.load_extra(extra)


def rolled_over(state_epoch: int, consumed: int, loop_epoch: int, step: int) -> tuple[int, int]:
    """``(epoch, consumed)`` of a state the group agreed on inside epoch ``loop_epoch``: the
    state of the previous epoch's last boundary is ``loop_epoch``'s start; a newer epoch
    stands (a rank that was frozen catches up with the others).

    Raises:
        RecoveryError: the state is of an epoch before the previous one (the loop would
            repeat epochs).
    """
    if state_epoch == loop_epoch - 1:
        return loop_epoch, 0
    if state_epoch >= loop_epoch:
        return state_epoch, consumed
    raise RecoveryError(
        f"The state agreed on at step {step} is of epoch {state_epoch}, but the loop is in "
        f"epoch {loop_epoch}; the run stops rather than repeat epochs."
    )


def exact(sampler: Any) -> Any:
    """Give torch's DistributedSampler an exact resume point (a subclass, no new state)."""
    if type(sampler) is _TorchDistributedSampler:
        sampler.__class__ = DistributedSampler
    return sampler


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    numpy = sys.modules.get("numpy")
    if numpy is not None and "numpy" in state:
        numpy.random.set_state(tuple(state["numpy"]))


__all__ = ["TrainState", "exact", "rolled_over"]
