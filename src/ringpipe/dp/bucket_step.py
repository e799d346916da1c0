"""Stepping each bucket's parameters as soon as its reduction is done, while later buckets still travel.

``DistributedOptimizer.step()`` waits for the buckets in the order they were launched. With an
optimizer whose update of one parameter reads only that parameter, its gradient, its own state
and its group's hyper-parameters (the per-parameter optimizers of ``torch.optim`` listed in
:data:`PER_PARAMETER`), updating the parameters of a reduced bucket while the later buckets are
still being reduced gives exactly the parameters of one update after the last reduction: each
parameter sees the same gradient and state, and goes through the same arithmetic. The optimizer's
arithmetic then overlaps the tail of the communication instead of following it.

This is done only where it is provably the same: the wrapped optimizer is exactly one of those
classes (not a subclass, which may couple parameters), not ``fused`` (fused SGD treats the
parameters it is given as one list when it decides whether this is the first step), no step pre-
or post-hook is registered on it or globally (they would run once per bucket), ``step()`` got no closure, and the bucket's
parameters all had a gradient on this rank (so none of them ends the step without one) and none was
sparse. Everything else is stepped after the last reduction, as before. ``step()`` is still one
call for learning-rate schedulers; ``synchronize()`` and ``skip_synchronize()`` are unchanged (the
gradients are then reduced before ``step()``, which updates every parameter at once).

The stepping is ``DistributedOptimizer.step()``'s: it hands the reducer's
:meth:`~ringpipe.dp.gradient_reducer.GradientReducer.synchronize` a function that steps each
reduced bucket's parameters with :func:`step_only`; this module says where that is the same
(:func:`steps_by_bucket`) and how one ``step()`` updates only some parameters.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.optim import optimizer as _optimizer_module

__all__ = ["PER_PARAMETER", "steps_by_bucket", "step_only"]

#: ``torch.optim`` optimizers whose update of each parameter depends on that parameter alone.
PER_PARAMETER: frozenset[type] = frozenset(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop",
                 "ASGD")
    if hasattr(torch.optim, name)
)


def steps_by_bucket(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` may update some parameters before others are reduced, with the same result."""
    if type(optimizer) not in PER_PARAMETER:
        return False
    if getattr(optimizer, "_optimizer_step_pre_hooks", None) or getattr(optimizer, "_optimizer_step_post_hooks", None):
        return False
    if any(group.get("fused") for group in optimizer.param_groups):
        return False  # fused SGD decides "first step" for the whole list of parameters it is given
    return not (getattr(_optimizer_module, "_global_optimizer_pre_hooks", None)
                or getattr(_optimizer_module, "_global_optimizer_post_hooks", None))


def step_only(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]) -> None:
    """One ``optimizer.step()`` that updates only ``params`` (each group keeps its hyper-parameters)."""
    chosen = {id(p) for p in params}
    groups = optimizer.param_groups
    saved = [group["params"] for group in groups]
    try:
        for group, every in zip(groups, saved, strict=True):
            group["params"] = [p for p in every if id(p) in chosen]
        optimizer.step()
    finally:
        for group, every in zip(groups, saved, strict=True):
            group["params"] = every
