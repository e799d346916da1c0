"""Optimizer registry (SGD with momentum/Nesterov, Adam, AdamW) and learning-rate scaling."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ringpipe.train.registry import Registry

__all__ = ["OPTIMIZERS", "build_optimizer", "scaled_lr"]

OPTIMIZERS: Registry[Callable[[Iterable[torch.nn.Parameter], Any, float], torch.optim.Optimizer]] = Registry(
    "optimizer"
)


def scaled_lr(cfg: Any, replicas: int) -> tuple[float, float]:
    """(learning rate, scale factor): ``lr x replicas`` when ``scale_lr`` (Goyal et al.'s linear rule)."""
    scale = float(replicas) if cfg.scale_lr else 1.0
    return cfg.lr * scale, scale


@OPTIMIZERS.register("sgd")
def _sgd(params: Iterable[torch.nn.Parameter], cfg: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        params, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov, weight_decay=cfg.weight_decay
    )


@OPTIMIZERS.register("adam")
def _adam(params: Iterable[torch.nn.Parameter], cfg: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


@OPTIMIZERS.register("adamw")
def _adamw(params: Iterable[torch.nn.Parameter], cfg: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: Any, lr: float) -> torch.optim.Optimizer:
    """The optimizer of an optimizer config section at learning rate ``lr``."""
    return OPTIMIZERS.get(cfg.name)(params, cfg, lr)
