"""Forward a stage on aliases of its parameter storage so a kept graph survives in-place updates.

Without recomputation a stage keeps the autograd graph of each forward until that micro-batch's
backward, and the optimizer (and the weight policies) update the parameters in place in
between. Autograd would reject that ("modified by an inplace operation") if the graph had
saved the parameters themselves. :func:`live_forward` instead hands the module, through
``torch.func.functional_call``, one alias per parameter: a tensor that shares the parameter's
storage but has its own version counter, and whose gradient flows into ``p.grad``. The graph
therefore reads, at backward time, whatever the parameter storage holds *then*: the current
true weights (stale), the stash loaded by ``before_backward`` (weight stashing), while the
saved activations stay those of the forward-time weights. This is the "stale without
recomputation" semantics of ALGORITHMS.md §1.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["live_forward"]


class _LiveAlias(torch.autograd.Function):
    """Identity whose output shares ``p``'s storage but not its version counter."""

    @staticmethod
    def forward(ctx: Any, p: torch.Tensor) -> torch.Tensor:
        return p.data

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def live_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``module(*args, **kwargs)`` with every trainable parameter replaced by a live alias."""
    aliases = {
        name: _LiveAlias.apply(p) for name, p in module.named_parameters() if p.requires_grad
    }
    return torch.func.functional_call(module, aliases, args, kwargs)
