"""Which update rule an optimizer applies, as far as staleness mitigation needs to know."""

from __future__ import annotations

from typing import Any, Literal

import torch

from ringpipe.pipeline.staleness.sutskever import SutskeverSGD

__all__ = ["OptimizerKind", "optimizer_kind", "SUPPORTED_OPTIMIZERS", "param_groups_of"]

OptimizerKind = Literal["sgd", "sutskever", "adam", "adamw"]

SUPPORTED_OPTIMIZERS = "torch.optim.SGD, ringpipe SutskeverSGD, torch.optim.Adam, torch.optim.AdamW"


def optimizer_kind(optimizer: torch.optim.Optimizer) -> OptimizerKind:
    """``sgd`` (PyTorch momentum form), ``sutskever``, ``adam`` (L2 decay) or ``adamw`` (decoupled).

    Raises ``ValueError`` for other optimizers and for options the formulas do not cover.
    """
    groups = optimizer.param_groups
    if any(g.get("maximize", False) for g in groups):
        raise ValueError(
            f"{type(optimizer).__name__}(maximize=True) is not supported by staleness "
            "mitigation; minimise the negated objective instead"
        )
    if isinstance(optimizer, SutskeverSGD):
        return "sutskever"
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd"
    if isinstance(optimizer, torch.optim.AdamW):
        return "adamw"
    if isinstance(optimizer, torch.optim.Adam):
        return "adamw" if any(g.get("decoupled_weight_decay", False) for g in groups) else "adam"
    raise ValueError(
        f"staleness mitigation does not support optimizer {type(optimizer).__name__}; "
        f"supported: {SUPPORTED_OPTIMIZERS}"
    )


def param_groups_of(
    params: list[torch.Tensor], optimizer: torch.optim.Optimizer
) -> list[dict[str, Any]]:
    """The param group of each parameter; errors name a parameter the optimizer does not hold."""
    where: dict[int, dict[str, Any]] = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            where[id(p)] = g
    out = []
    for i, p in enumerate(params):
        if id(p) not in where:
            raise ValueError(
                f"parameter {i} (shape {tuple(p.shape)}) is not in the optimizer's param groups; "
                "pass the stage's optimizer and the parameters it optimises"
            )
        out.append(where[id(p)])
    return out
