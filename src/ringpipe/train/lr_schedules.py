"""Learning-rate schedules over fractional epochs, with gradual warmup, as torch LR schedulers.

The rate is a function of the epoch ``step * global_batch / records``, so a schedule written
in epochs means the same thing at any world size and batch. Warmup follows Goyal et al.
(2017, "Accurate, Large Minibatch SGD", section 2.2): with the rate scaled by ``k`` replicas,
start at ``1/k`` of the target (the single-process rate) and ramp linearly to the target
over the warmup epochs; after the warmup the named schedule takes over.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from ringpipe.train.registry import Registry

__all__ = ["LR_SCHEDULES", "EpochSchedule", "build_schedule", "warmup_start"]

#: name -> (schedule config, total epochs) -> factor(epoch) applied after the warmup
LR_SCHEDULES: Registry[Callable[[Any, float], Callable[[float], float]]] = Registry("schedule")


@LR_SCHEDULES.register("constant")
def _constant(cfg: Any, total: float) -> Callable[[float], float]:
    return lambda epoch: 1.0


@LR_SCHEDULES.register("step")
def _step(cfg: Any, total: float) -> Callable[[float], float]:
    return lambda epoch: float(cfg.gamma ** math.floor(epoch / cfg.step_epochs + 1e-9))


@LR_SCHEDULES.register("multistep")
def _multistep(cfg: Any, total: float) -> Callable[[float], float]:
    milestones = list(cfg.milestones)
    return lambda epoch: float(cfg.gamma ** bisect.bisect_right(milestones, epoch + 1e-9))


@LR_SCHEDULES.register("cosine")
def _cosine(cfg: Any, total: float) -> Callable[[float], float]:
    start = cfg.warmup_epochs
    span = max(total - start, 1e-9)

    def factor(epoch: float) -> float:
        t = min(max((epoch - start) / span, 0.0), 1.0)
        return cfg.min_factor + (1.0 - cfg.min_factor) * 0.5 * (1.0 + math.cos(math.pi * t))

    return factor


def warmup_start(cfg: Any, scale: float) -> float:
    """The warmup's starting factor: as configured, else ``1/scale`` (Goyal et al.), else 0.1."""
    if cfg.warmup_start_factor is not None:
        return float(cfg.warmup_start_factor)
    return 1.0 / scale if scale > 1 else 0.1


class EpochSchedule(LRScheduler):
    """``lr = base_lr * f(epoch)`` with ``epoch = steps * global_batch / records``; call ``step()`` per optimizer step.

    ``f`` ramps linearly from ``start_factor`` to 1 during ``warmup_epochs``, then follows ``after``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        steps_per_epoch: float,
        after: Callable[[float], float],
        warmup_epochs: float = 0.0,
        start_factor: float = 1.0,
    ) -> None:
        if steps_per_epoch <= 0:
            raise ValueError(f"steps_per_epoch={steps_per_epoch} must be > 0")
        self.steps_per_epoch = float(steps_per_epoch)
        self.after = after
        self.warmup_epochs = float(warmup_epochs)
        self.start_factor = float(start_factor)
        super().__init__(optimizer)

    def factor(self, step: int) -> float:
        epoch = step / self.steps_per_epoch
        if epoch < self.warmup_epochs:
            return self.start_factor + (1.0 - self.start_factor) * epoch / self.warmup_epochs
        return self.after(epoch)

    def get_lr(self) -> list[float]:  # type: ignore[override]
        f = self.factor(self.last_epoch)
        return [float(base) * f for base in self.base_lrs]

    def state_dict(self) -> dict[str, Any]:
        return {
            "last_epoch": self.last_epoch,
            "_step_count": self._step_count,
            "_last_lr": list(self._last_lr),
            "base_lrs": list(self.base_lrs),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.__dict__.update(state_dict)
        for group, lr in zip(self.optimizer.param_groups, self._last_lr, strict=True):
            group["lr"] = lr


def build_schedule(
    optimizer: torch.optim.Optimizer, cfg: Any, total_epochs: float, steps_per_epoch: float, scale: float
) -> EpochSchedule:
    """The schedule of a schedule config section; ``scale`` is the factor the rate was multiplied by."""
    after = LR_SCHEDULES.get(cfg.name)(cfg, total_epochs)
    return EpochSchedule(optimizer, steps_per_epoch, after, cfg.warmup_epochs, warmup_start(cfg, scale))
