"""Future learning rates: what an LR scheduler will set for the next ``d`` optimizer steps."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch

__all__ = ["future_lrs"]


class _LrOnlyOptimizer:
    """A stand-in for an optimizer holding copies of its param-group hyper-parameters only.

    A scheduler copied with this stand-in in place of its optimizer can be stepped without
    copying the optimizer's state (momentum buffers, moments) or touching the real groups.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.param_groups: list[dict[str, Any]] = [
            {k: copy.copy(v) for k, v in g.items() if k != "params"} | {"params": []}
            for g in optimizer.param_groups
        ]
        self.defaults = dict(optimizer.defaults)
        self.state: dict[Any, Any] = {}
        self._opt_called = True

    def step(self) -> None:
        """Never called by the copied scheduler's arithmetic; present for its sanity checks."""


def future_lrs(
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None,
    steps: int,
) -> list[list[float]]:
    """``lrs[g][k]``: the learning rate of param group ``g`` at the ``k+1``-th future step.

    The next step uses the current ``group["lr"]``; step ``k+1`` uses the value a copy of the
    scheduler sets after ``k`` calls to ``step()`` (schedulers are stepped after the optimizer).
    Without a scheduler, or with ``ReduceLROnPlateau`` (its future depends on metrics not yet
    seen), the learning rate is assumed constant.
    """
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    current = [float(g["lr"]) for g in optimizer.param_groups]
    out = [[lr] for lr in current]
    plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    if scheduler is None or plateau or steps <= 1:
        return [[lr] * steps for lr in current]
    stub = _LrOnlyOptimizer(optimizer)
    shadow = copy.deepcopy(scheduler, memo={id(optimizer): stub})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(steps - 1):
            shadow.step()
            for g, group in enumerate(stub.param_groups):
                out[g].append(float(group["lr"]))
    return out
