"""Learning-rate scaling by world size and gradual warmup (Goyal et al. 2017, "Accurate, Large Minibatch SGD").

With ``k`` ranks the global batch grows ``k`` times, so the learning rate is scaled by ``k``
(linear scaling rule); to avoid early instability it ramps up from the single-rank rate to the
scaled one over the first steps or epochs (Goyal et al. §2.2, gradual warmup; Horovod's
``LearningRateWarmupCallback`` uses the same ramp: ``lr(t) = lr_scaled / k * (1 + t (k - 1) / warmup)``).
"""

from __future__ import annotations

import torch
from torch.optim.lr_scheduler import LRScheduler

__all__ = ["scale_lr", "GradualWarmup"]


def scale_lr(lr: float, size: int) -> float:
    """The learning rate for ``size`` ranks under the linear scaling rule."""
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    return lr * size


class GradualWarmup(LRScheduler):
    """Ramp each group's learning rate linearly from ``lr / multiplier`` to ``lr`` over ``warmup_steps``.

    ``lr`` is the group's (already scaled) learning rate when the scheduler is created and
    ``multiplier`` is the scaling factor (usually the world size). Call ``step()`` once per
    optimizer step (or per epoch, with ``warmup_steps`` in epochs); after the warmup the rate
    stays at ``lr`` (chain other schedules with ``torch.optim.lr_scheduler.SequentialLR``).
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, warmup_steps: int, multiplier: float, last_epoch: int = -1
    ) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if multiplier <= 0:
            raise ValueError(f"multiplier must be > 0 (usually the world size), got {multiplier}")
        self.warmup_steps = int(warmup_steps)
        self.multiplier = float(multiplier)
        super().__init__(optimizer, last_epoch)

    def factor(self, step: int) -> float:
        """The fraction of the target learning rate used at ``step``."""
        if self.warmup_steps == 0 or step >= self.warmup_steps:
            return 1.0
        return (1.0 + step * (self.multiplier - 1.0) / self.warmup_steps) / self.multiplier

    def get_lr(self) -> list[float]:  # type: ignore[override]
        f = self.factor(self.last_epoch)
        return [float(base) * f for base in self.base_lrs]
