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
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim import optimizer as _optimizer_module

__all__ = ["PER_PARAMETER", "steps_by_bucket", "step_only", "step_by_bucket"]

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


def step_by_bucket(opt: Any) -> bool:
    """Reduce and update together: each bucket's parameters are stepped once it is reduced.

    ``opt`` is a ``DistributedOptimizer`` whose ``step()`` has to synchronize and got no closure.
    Only where that gives the parameters of one update after the last reduction (see the module
    docstring); returns False, having done nothing, elsewhere. A bucket with a parameter that had
    no gradient on this rank, or a sparse one, is stepped after the last reduction with the rest.
    """
    if opt._local or opt._adasum or len(opt._buckets) < 2 or not steps_by_bucket(opt.optimizer):
        return False
    inner = opt.optimizer
    stepped: set[int] = set()
    clock = opt.clock

    def after(bucket: Any) -> None:
        if not all(s.used and not s.sparse for s in bucket.slots):
            return
        t0 = time.perf_counter()
        step_only(inner, (s.param for s in bucket.slots))
        stepped.add(bucket.index)
        if clock is not None:  # optimizer arithmetic, not waiting
            spent = time.perf_counter() - t0
            clock["bucket_step"] = clock.get("bucket_step", 0.0) + spent
            clock["wait"] = clock.get("wait", 0.0) - spent

    opt._launch_all()
    opt._wait_all(after)
    opt._synchronized = False
    if opt._peers_joined:  # ranks that joined apply the update with this rank's hyper-parameters
        opt._announce_update()
    if len(stepped) < len(opt._buckets):
        step_only(inner, (s.param for b in opt._buckets if b.index not in stepped for s in b.slots))
    return True
