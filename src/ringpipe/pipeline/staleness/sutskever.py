"""SGD with momentum in the Sutskever form: ``v <- gamma*v + eta*g; theta <- theta - v``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["SutskeverSGD"]


class SutskeverSGD(torch.optim.Optimizer):
    """Momentum SGD with the learning rate inside the velocity (Sutskever et al., ICML 2013).

    Differs from ``torch.optim.SGD`` (``v <- gamma*v + g; theta <- theta - eta*v``) only when the
    learning rate changes over time. Weight decay adds ``weight_decay*theta`` to the gradient.
    The velocity is kept in ``state[p]["momentum_buffer"]``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
    ) -> None:
        if lr < 0 or not 0.0 <= momentum < 1.0 or weight_decay < 0:
            raise ValueError(
                f"invalid SutskeverSGD hyper-parameters lr={lr}, momentum={momentum}, "
                f"weight_decay={weight_decay}: need lr >= 0, 0 <= momentum < 1, weight_decay >= 0"
            )
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, gamma, wd = float(group["lr"]), group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad if wd == 0 else p.grad.add(p, alpha=wd)
                state = self.state[p]
                v = state.get("momentum_buffer")
                if v is None:
                    v = state["momentum_buffer"] = torch.zeros_like(p)
                v.mul_(gamma).add_(g, alpha=lr)
                p.sub_(v)
        return loss
